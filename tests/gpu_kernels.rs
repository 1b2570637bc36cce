//! L1 for the GPU tier: every kernel against the CPU tier's version of the same op, through a
//! table of cases with named tolerances per format (tiny shapes plus real GPT-OSS shapes), and
//! every WGSL variant validated by naga without a device.
//!
//! Without an adapter these tests print why and pass, except where `PICCHIO_REQUIRE_GPU=1`
//! (set by .ci/run): there a missing adapter is a failure.

mod common;

use picchio::cpu;
use picchio::gpu::kernels::{GpuExperts, GpuMatrix, prepare_rms_norm};
use picchio::gpu::pipelines::{SHADERS, preprocess};
use picchio::gpu::{GpuContext, GpuOptions};
use picchio::weights::{DenseMatrix, FloatFormat, Int4Experts, Mxfp4Experts, TensorBytes};

use common::assert_close;

/// Every shader file with the define sets picchio compiles it with.
const VARIANTS: &[(&str, &[&[&str]])] = &[
    (
        "matmul.wgsl",
        &[
            &["DENSE", "BF16"],
            &["DENSE", "F16"],
            &["DENSE", "F32"],
            &["EXPERTS", "MXFP4"],
            &["EXPERTS", "INT4"],
        ],
    ),
    ("norm.wgsl", &[&[]]),
];

/// Named tolerances (atol, rtol) per kernel family and format.
const DENSE_TOLERANCE: (f32, f32) = (1e-4, 1e-4);
const EXPERT_TOLERANCE: (f32, f32) = (1e-4, 1e-4);
const NORM_TOLERANCE: (f32, f32) = (1e-5, 1e-5);

#[test]
fn every_shader_variant_validates_with_naga() {
    for (file, _) in SHADERS {
        assert!(
            VARIANTS.iter().any(|(f, _)| f == file),
            "{file} has no entry in VARIANTS"
        );
    }
    for (file, variants) in VARIANTS {
        let source = SHADERS.iter().find(|(f, _)| f == file).unwrap().1;
        for defines in *variants {
            let defines: Vec<(&str, String)> =
                defines.iter().map(|d| (*d, "1".to_string())).collect();
            let text = preprocess(file, source, &defines).unwrap();
            let module = naga::front::wgsl::parse_str(&text)
                .unwrap_or_else(|e| panic!("{file} {defines:?}: {}", e.emit_to_string(&text)));
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{file} {defines:?}: {e:?}"));
        }
    }
}

/// The GPU for these tests, or None (with the reason printed) when there is none and CI did not
/// ask for one.
fn gpu(max_binding_bytes: Option<u64>) -> Option<GpuContext> {
    let required = std::env::var("PICCHIO_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let mut options = GpuOptions::from_env();
    options.max_binding_bytes = max_binding_bytes;
    match GpuContext::new(&options) {
        Ok(ctx) => {
            eprintln!(
                "GPU adapter: {} ({}, {})",
                ctx.adapter.name, ctx.adapter.backend, ctx.adapter.device_type
            );
            if let Ok(expected) = std::env::var("PICCHIO_EXPECT_BACKEND") {
                assert_eq!(ctx.adapter.backend, expected, "wrong wgpu backend");
            }
            Some(ctx)
        }
        Err(e) if !required => {
            eprintln!("no GPU, GPU kernel test skipped: {e}");
            None
        }
        Err(e) => panic!("PICCHIO_REQUIRE_GPU=1 but: {e}"),
    }
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn bytes(n: usize, seed: u64) -> Vec<u8> {
    values(n, seed)
        .iter()
        .map(|v| ((v + 1.0) * 127.99) as u8)
        .collect()
}

fn dense_matrix(rows: usize, cols: usize, format: FloatFormat, seed: u64) -> DenseMatrix {
    let w: Vec<f32> = values(rows * cols, seed).iter().map(|v| v * 0.05).collect();
    let data: Vec<u8> = match format {
        FloatFormat::Bf16 => w
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        FloatFormat::F16 => w
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        FloatFormat::F32 => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    DenseMatrix {
        rows,
        cols,
        format,
        data: TensorBytes::from_vec(data),
    }
}

fn check_dense(
    ctx: &GpuContext,
    name: &str,
    rows: usize,
    cols: usize,
    tokens: usize,
    format: FloatFormat,
    with_bias: bool,
) {
    let m = dense_matrix(rows, cols, format, rows as u64 * 31 + cols as u64);
    let x = values(tokens * cols, 5);
    let bias = values(rows, 9);
    let mut want = vec![0f32; tokens * rows];
    cpu::matmul::dense_matmul(&m, &x, with_bias.then_some(&bias[..]), &mut want);

    let gm = GpuMatrix::upload(ctx, name, &m).unwrap();
    let (xb, bb, yb, dummy) = (
        ctx.upload_f32("x", &x),
        ctx.upload_f32("bias", &bias),
        ctx.zeroed("y", (tokens * rows * 4) as u64).unwrap(),
        ctx.zeroed("dummy", 4).unwrap(),
    );
    let dispatches = gm
        .prepare(ctx, &xb, tokens, with_bias.then_some(&bb), &yb, &dummy)
        .unwrap();
    ctx.run(&dispatches.iter().collect::<Vec<_>>()).unwrap();
    let got = ctx.read_f32(&yb, tokens * rows).unwrap();
    let (atol, rtol) = DENSE_TOLERANCE;
    let c = assert_close(
        &format!(
            "{name} {format:?} {rows}x{cols} x{tokens} ({} chunks)",
            gm.chunks.len()
        ),
        &got,
        &want,
        atol,
        rtol,
    );
    eprintln!(
        "{name} {format:?} {rows}x{cols} x{tokens}: {} chunk(s), max |error| {:e}",
        gm.chunks.len(),
        c.max_abs_error
    );
}

#[test]
fn dense_matmul_matches_cpu() {
    let Some(ctx) = gpu(None) else { return };
    for format in [FloatFormat::Bf16, FloatFormat::F16, FloatFormat::F32] {
        check_dense(&ctx, "tiny", 7, 33, 1, format, true);
        check_dense(&ctx, "batch", 64, 96, 3, format, false);
        check_dense(&ctx, "odd", 130, 65, 5, format, true);
    }
    // A real GPT-OSS projection (q_proj of 20B/120B).
    check_dense(&ctx, "q_proj", 4096, 2880, 1, FloatFormat::Bf16, true);
}

#[test]
fn dense_matmul_splits_tensors_over_the_binding_limit() {
    // 1 KiB bindings: a 130x65 bf16 matrix (130 B rows) needs 17 chunks.
    let Some(ctx) = gpu(Some(1024)) else { return };
    check_dense(&ctx, "split", 130, 65, 3, FloatFormat::Bf16, true);
    check_dense(&ctx, "split", 33, 64, 2, FloatFormat::F32, false);
}

enum Quantized {
    Mxfp4(Mxfp4Experts),
    Int4(Int4Experts),
}

fn quantized(kind: &str, experts: usize, rows: usize, cols: usize) -> Quantized {
    let groups = cols / 32;
    let packed = TensorBytes::from_vec(bytes(experts * rows * cols / 2, (rows * cols) as u64));
    match kind {
        "mxfp4" => {
            let scales = bytes(experts * rows * groups, 3)
                .iter()
                .map(|b| 118 + b % 6)
                .collect();
            Quantized::Mxfp4(Mxfp4Experts {
                experts,
                rows,
                cols,
                blocks: packed,
                scales: TensorBytes::from_vec(scales),
            })
        }
        _ => {
            let scales = values(experts * rows * groups, 4)
                .iter()
                .flat_map(|v| half::f16::from_f32(0.002 + 0.01 * v.abs()).to_le_bytes())
                .collect();
            Quantized::Int4(Int4Experts {
                experts,
                rows,
                cols,
                qweight: packed,
                scales: TensorBytes::from_vec(scales),
            })
        }
    }
}

/// `pairs` (token, slot) pairs routed by `ids`; x has one row per token (x_div = slots).
fn check_experts(
    ctx: &GpuContext,
    kind: &str,
    experts: usize,
    rows: usize,
    cols: usize,
    ids: &[u32],
    slots: usize,
) {
    let q = quantized(kind, experts, rows, cols);
    let pairs = ids.len();
    let x = values(pairs / slots * cols, 8);
    let bias = values(experts * rows, 2);
    let mut want = vec![0f32; pairs * rows];
    for (p, &e) in ids.iter().enumerate() {
        let e = e as usize;
        let xs = &x[(p / slots) * cols..(p / slots + 1) * cols];
        let b = Some(&bias[e * rows..(e + 1) * rows]);
        let out = &mut want[p * rows..(p + 1) * rows];
        match &q {
            Quantized::Mxfp4(m) => cpu::matmul::mxfp4_matmul(m, e, xs, b, out),
            Quantized::Int4(m) => cpu::matmul::int4_matmul(m, e, xs, b, out),
        }
    }
    let gw = match &q {
        Quantized::Mxfp4(m) => GpuExperts::upload_mxfp4(ctx, kind, m).unwrap(),
        Quantized::Int4(m) => GpuExperts::upload_int4(ctx, kind, m).unwrap(),
    };
    let (xb, bb, yb, ib, dummy) = (
        ctx.upload_f32("x", &x),
        ctx.upload_f32("bias", &bias),
        ctx.zeroed("y", (pairs * rows * 4) as u64).unwrap(),
        ctx.upload("ids", bytemuck::cast_slice(ids)),
        ctx.zeroed("dummy", 4).unwrap(),
    );
    let dispatches = gw
        .prepare(ctx, &xb, slots, &ib, pairs, Some(&bb), &yb, &dummy)
        .unwrap();
    ctx.run(&dispatches.iter().collect::<Vec<_>>()).unwrap();
    let got = ctx.read_f32(&yb, pairs * rows).unwrap();
    let (atol, rtol) = EXPERT_TOLERANCE;
    let what = format!(
        "{kind} E{experts} {rows}x{cols} ids {ids:?} ({} chunks)",
        gw.chunk_count()
    );
    let c = assert_close(&what, &got, &want, atol, rtol);
    eprintln!("{what}: max |error| {:e}", c.max_abs_error);
}

#[test]
fn quantized_experts_match_cpu() {
    let Some(ctx) = gpu(None) else { return };
    for kind in ["mxfp4", "int4"] {
        // Decode: one token, top-2 of 4 experts; prefill: 3 tokens x top-2.
        check_experts(&ctx, kind, 4, 40, 64, &[3, 1], 2);
        check_experts(&ctx, kind, 4, 40, 96, &[0, 2, 2, 3, 1, 0], 2);
        // Down projection style: one x row per pair.
        check_experts(&ctx, kind, 3, 64, 32, &[2, 0, 1], 1);
    }
    // A real GPT-OSS expert: gate_up of 20B/120B, 5760 x 2880.
    check_experts(&ctx, "mxfp4", 1, 5760, 2880, &[0], 1);
}

#[test]
fn quantized_experts_split_over_the_binding_limit() {
    // 2 KiB bindings: each 40x64 expert (1280 B) is its own chunk.
    let Some(ctx) = gpu(Some(2048)) else { return };
    check_experts(&ctx, "mxfp4", 5, 40, 64, &[4, 1, 0, 3], 2);
    check_experts(&ctx, "int4", 5, 40, 64, &[2, 4], 1);
}

#[test]
fn rms_norm_matches_cpu() {
    let Some(ctx) = gpu(None) else { return };
    for (rows, cols) in [(1, 64), (3, 2880), (5, 33)] {
        let x: Vec<f32> = values(rows * cols, 1).iter().map(|v| v * 3.0).collect();
        let w: Vec<f32> = values(cols, 2).iter().map(|v| 1.0 + 0.1 * v).collect();
        let mut want = vec![0f32; rows * cols];
        cpu::norm::rms_norm(&x, &w, 1e-5, &mut want);
        let (xb, wb, yb) = (
            ctx.upload_f32("x", &x),
            ctx.upload_f32("w", &w),
            ctx.zeroed("y", (rows * cols * 4) as u64).unwrap(),
        );
        let d = prepare_rms_norm(&ctx, &xb, &wb, rows, cols, 1e-5, &yb).unwrap();
        ctx.run(&[&d]).unwrap();
        let got = ctx.read_f32(&yb, rows * cols).unwrap();
        let (atol, rtol) = NORM_TOLERANCE;
        assert_close(&format!("rms_norm {rows}x{cols}"), &got, &want, atol, rtol);
    }
}
