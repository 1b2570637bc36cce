//! L1 for the GPU tier: every kernel against the CPU tier's version of the same op, through a
//! table of cases with named tolerances per format (tiny shapes plus real GPT-OSS shapes), and
//! every WGSL variant validated by naga without a device.
//!
//! Without an adapter these tests print why and pass, except where `PICCHIO_REQUIRE_GPU=1`
//! (set by .ci/run): there a missing adapter is a failure.

mod common;

use picchio::arch::{Activation, Gating};
use picchio::cpu;
use picchio::formats::KvFormat;
use picchio::gpu::GpuContext;
use picchio::gpu::attention::{
    AttentionInputs, AttentionShape, MAX_SPLITS, QkvRows, prepare_attention,
};
use picchio::gpu::kernels::{
    GpuExperts, GpuMatrix, PairTiles, prepare_rms_norm, prepare_sort_pairs,
};
use picchio::gpu::pipelines::{SHADERS, preprocess};
use picchio::weights::{DenseMatrix, FloatFormat, Int4Experts, Mxfp4Experts, TensorBytes};

use common::{assert_close, gpu, gpu_variants};

/// Every shader file with the define sets picchio compiles it with.
const VARIANTS: &[(&str, &[&[&str]])] = &[
    (
        "matmul.wgsl",
        &[
            &["DENSE", "BF16"],
            &["DENSE", "F16"],
            &["DENSE", "F32"],
            &["DENSE_ROWS", "BF16"],
            &["DENSE_ROWS", "F16", "BATCHED", "TOKENS=8"],
            &["DENSE_ROWS", "BF16", "NORMED", "BATCHED", "TOKENS=8"],
            &["DENSE_ROWS", "F16", "NORMED"],
            &[
                "DENSE_ROWS",
                "BF16",
                "NORMED",
                "SUBGROUPS",
                "SUBGROUP_MIN=8",
                "BATCHED",
                "TOKENS=8",
            ],
            &["DENSE_ROWS", "F16", "CHUNKED"],
            &["DENSE_ROWS", "BF16", "TILED"],
            &["DENSE_ROWS", "F16", "TILED", "NORMED", "CHUNKED"],
            &[
                "DENSE_ROWS",
                "BF16",
                "NORMED",
                "CHUNKED",
                "BATCHED",
                "TOKENS=8",
            ],
            &["DENSE", "F32", "SUBGROUPS", "SUBGROUP_MIN=32"],
            &[
                "EXPERTS",
                "MXFP4",
                "EXPERT_PAIRS",
                "SUBGROUPS",
                "SUBGROUP_MIN=4",
            ],
            &["EXPERTS", "MXFP4", "EXPERT_PAIRS"],
            &["EXPERTS", "INT4", "EXPERT_PAIRS"],
            &["EXPERTS_UNQUANTIZED", "BF16", "EXPERT_PAIRS"],
            &["EXPERTS_UNQUANTIZED", "F16", "EXPERT_PAIRS"],
            &["EXPERTS_UNQUANTIZED", "F32", "EXPERT_PAIRS"],
            &["EXPERTS_ROWS", "BF16", "EXPERT_PAIRS"],
            &["EXPERTS_ROWS", "F16", "EXPERT_PAIRS"],
            &["EXPERTS_ROWS", "F32", "EXPERT_PAIRS"],
        ],
    ),
    ("norm.wgsl", &[&[], &["HEADS"]]),
    ("subgroup_probe.wgsl", &[&[]]),
    (
        "attention.wgsl",
        &[
            &["ATTEND", "HEAD_DIM=64", "GROUP=8", "TILE=32", "SINKS"],
            &[
                "ATTEND",
                "HEAD_DIM=64",
                "GROUP=8",
                "TILE=32",
                "KV_F16",
                "SINKS",
            ],
            &["ATTEND", "HEAD_DIM=64", "GROUP=8", "TILE=32", "SPLIT"],
            &["ATTEND", "HEAD_DIM=128", "GROUP=8", "TILE=16"],
            &[
                "ATTEND",
                "HEAD_DIM=128",
                "GROUP=16",
                "TILE=8",
                "SPLIT",
                "KV_F16",
            ],
            &["ATTEND", "HEAD_DIM=96", "GROUP=1", "TILE=64", "SINKS"],
            &["MERGE", "HEAD_DIM=64", "SINKS"],
            &["MERGE", "HEAD_DIM=256", "SINKS"],
            &["MERGE", "HEAD_DIM=128"],
        ],
    ),
    (
        "moe.wgsl",
        &[&["SWIGLU"], &["SWIGLU", "PLAIN"], &["COMBINE"]],
    ),
    (
        "experts.wgsl",
        &[
            &["SWIGLU", "MXFP4"],
            &["SWIGLU", "INT4"],
            &["COMBINE", "MXFP4"],
            &["COMBINE", "INT4"],
            &["SWIGLU", "MXFP4", "SUBGROUPS", "SUBGROUP_MIN=8"],
            &["SWIGLU", "INT4", "CHUNKED"],
            &["SWIGLU", "MXFP4", "GROUPED"],
            &["SWIGLU", "INT4", "GROUPED", "CHUNKED"],
            &["DOWN", "INT4", "GROUPED", "CHUNKED"],
            &["DOWN", "MXFP4", "GROUPED", "SUBGROUPS", "SUBGROUP_MIN=8"],
            &[
                "COMBINE",
                "MXFP4",
                "CHUNKED",
                "SUBGROUPS",
                "SUBGROUP_MIN=16",
            ],
            &["COMBINE", "INT4", "SUBGROUPS", "SUBGROUP_MIN=64"],
        ],
    ),
    (
        "router.wgsl",
        &[
            &[],
            &["SOFTMAX_FIRST"],
            &["SOFTMAX_FIRST", "RENORMALIZE"],
            &["NORMED", "BF16", "BIAS"],
            &["NORMED", "F16", "BIAS"],
            &["NORMED", "F32", "BIAS"],
            &["NORMED", "BF16", "SOFTMAX_FIRST", "RENORMALIZE"],
            &["SORT", "EXPERTS=32", "TILE_PAIRS=32"],
            &["SORT", "EXPERTS=128", "TILE_PAIRS=32"],
        ],
    ),
    ("bandwidth.wgsl", &[&[]]),
    ("elementwise.wgsl", &[&["ADD"], &["SELECT"]]),
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
            // `NAME` alone means NAME=1.
            let defines: Vec<(&str, String)> = defines
                .iter()
                .map(|d| match d.split_once('=') {
                    Some((name, value)) => (name, value.to_string()),
                    None => (*d, "1".to_string()),
                })
                .collect();
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
    for ctx in gpu_variants(None) {
        for format in [FloatFormat::Bf16, FloatFormat::F16, FloatFormat::F32] {
            check_dense(&ctx, "tiny", 7, 33, 1, format, true);
            check_dense(&ctx, "batch", 64, 96, 3, format, false);
            check_dense(&ctx, "odd", 130, 65, 5, format, true);
            // Whole 16-byte words per row (dense_rows for bf16/f16), rows not a multiple of 4.
            check_dense(&ctx, "words", 131, 72, 2, format, true);
            // A prompt block over two batches of 8 tokens.
            check_dense(&ctx, "block", 131, 72, 11, format, true);
            // Tiles of 64 rows x 32 tokens: edges in rows and tokens, several steps of 32 columns.
            check_dense(&ctx, "tiled", 131, 96, 40, format, true);
        }
        // A real GPT-OSS projection (q_proj of 20B/120B).
        check_dense(&ctx, "q_proj", 4096, 2880, 1, FloatFormat::Bf16, true);
        // GPT-OSS's width in tiles: 90 steps of 32 columns.
        check_dense(&ctx, "q_proj rows", 256, 2880, 33, FloatFormat::Bf16, true);
    }
}

#[test]
fn dense_matmul_splits_tensors_over_the_binding_limit() {
    // 2 KiB bindings: a 130x65 bf16 matrix (130 B rows) needs 9 chunks; activations still fit.
    let Some(ctx) = gpu(Some(2048)) else { return };
    check_dense(&ctx, "split", 130, 65, 3, FloatFormat::Bf16, true);
    check_dense(&ctx, "split", 33, 64, 2, FloatFormat::F32, false);
    check_dense(&ctx, "split words", 33, 64, 2, FloatFormat::Bf16, true);
    // Whole-word rows read up to four chunks per dispatch: 10 chunks of 14 rows in 3 dispatches.
    check_dense(&ctx, "split words", 131, 72, 2, FloatFormat::F16, false);
    // As tiles (16 tokens): 8 KiB bindings hold the activations, the weights need 4 chunks of 32
    // rows, and a tile of 64 rows spans two.
    let Some(ctx) = gpu(Some(8192)) else { return };
    check_dense(&ctx, "split tiles", 120, 128, 16, FloatFormat::Bf16, true);
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
            Quantized::Mxfp4(Mxfp4Experts::contiguous(
                experts,
                (rows, cols),
                packed,
                TensorBytes::from_vec(scales),
            ))
        }
        _ => {
            let scales = values(experts * rows * groups, 4)
                .iter()
                .flat_map(|v| half::f16::from_f32(0.002 + 0.01 * v.abs()).to_le_bytes())
                .collect();
            Quantized::Int4(Int4Experts::contiguous(
                experts,
                (rows, cols),
                packed,
                TensorBytes::from_vec(scales),
            ))
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
    for ctx in gpu_variants(None) {
        quantized_experts_on(&ctx);
    }
}

fn quantized_experts_on(ctx: &GpuContext) {
    for kind in ["mxfp4", "int4"] {
        // Decode: one token, top-2 of 4 experts; prefill: 3 tokens x top-2.
        check_experts(ctx, kind, 4, 40, 64, &[3, 1], 2);
        check_experts(ctx, kind, 4, 40, 96, &[0, 2, 2, 3, 1, 0], 2);
        // Down projection style: one x row per pair.
        check_experts(ctx, kind, 3, 64, 32, &[2, 0, 1], 1);
    }
    // A real GPT-OSS expert: gate_up of 20B/120B, 5760 x 2880.
    check_experts(ctx, "mxfp4", 1, 5760, 2880, &[0], 1);
}

/// One expert product on the CPU tier: `out = W[e] . x + bias[e]`.
fn cpu_expert(q: &Quantized, e: usize, x: &[f32], bias: &[f32], out: &mut [f32]) {
    let b = Some(&bias[e * out.len()..(e + 1) * out.len()]);
    match q {
        Quantized::Mxfp4(m) => cpu::matmul::mxfp4_matmul(m, e, x, b, out),
        Quantized::Int4(m) => cpu::matmul::int4_matmul(m, e, x, b, out),
    }
}

fn upload_quantized(ctx: &GpuContext, name: &str, q: &Quantized) -> GpuExperts {
    match q {
        Quantized::Mxfp4(m) => GpuExperts::upload_mxfp4(ctx, name, m).unwrap(),
        Quantized::Int4(m) => GpuExperts::upload_int4(ctx, name, m).unwrap(),
    }
}

/// gate_up + SwiGLU and down + combine as the fused kernels run them, against the CPU tier's
/// products, clamped SwiGLU and ascending-id combine; `ids` routes `tokens` tokens to `top_k`
/// experts each.
fn check_fused_experts(
    ctx: &GpuContext,
    kind: &str,
    (experts, hidden, intermediate): (usize, usize, usize),
    ids: &[u32],
    top_k: usize,
) {
    check_expert_kernels(
        ctx,
        kind,
        (experts, hidden, intermediate),
        ids,
        top_k,
        false,
    );
    check_expert_kernels(ctx, kind, (experts, hidden, intermediate), ids, top_k, true);
}

/// One of `check_fused_experts`'s runs: the per-pair kernels, or (`grouped`) the prompt block's
/// kernels grouped by expert, down then moe.wgsl's combine.
fn check_expert_kernels(
    ctx: &GpuContext,
    kind: &str,
    (experts, hidden, intermediate): (usize, usize, usize),
    ids: &[u32],
    top_k: usize,
    grouped: bool,
) {
    use picchio::gpu::kernels::prepare_combine;
    let tokens = ids.len() / top_k;
    let (alpha, limit) = (1.702, 7.0);
    let gate_up = quantized(kind, experts, 2 * intermediate, hidden);
    let down = quantized(kind, experts, hidden, intermediate);
    let x: Vec<f32> = values(tokens * hidden, 8).iter().map(|v| v * 4.0).collect();
    let (gate_up_bias, down_bias) = (
        values(experts * 2 * intermediate, 2),
        values(experts * hidden, 3),
    );
    let route_weights = values(ids.len(), 5);
    let start = values(tokens * hidden, 6);
    let mut want_act = vec![0f32; ids.len() * intermediate];
    let mut want_hidden = start.clone();
    for t in 0..tokens {
        let mut slots: Vec<usize> = (0..top_k).collect();
        slots.sort_by_key(|s| ids[t * top_k + s]);
        let mut sum = vec![0f32; hidden];
        for s in slots {
            let (p, e) = (t * top_k + s, ids[t * top_k + s] as usize);
            let mut products = vec![0f32; 2 * intermediate];
            cpu_expert(
                &gate_up,
                e,
                &x[t * hidden..(t + 1) * hidden],
                &gate_up_bias,
                &mut products,
            );
            let act = &mut want_act[p * intermediate..(p + 1) * intermediate];
            cpu::moe::clamped_swiglu(&products, alpha, limit, act);
            let mut out = vec![0f32; hidden];
            cpu_expert(&down, e, act, &down_bias, &mut out);
            for (total, v) in sum.iter_mut().zip(&out) {
                *total += v * route_weights[p];
            }
        }
        for (h, v) in want_hidden[t * hidden..(t + 1) * hidden]
            .iter_mut()
            .zip(&sum)
        {
            *h += v;
        }
    }

    let (gw, dw) = (
        upload_quantized(ctx, kind, &gate_up),
        upload_quantized(ctx, kind, &down),
    );
    let [xb, gb, db, wb, hb] =
        [&x, &gate_up_bias, &down_bias, &route_weights, &start].map(|v| ctx.upload_f32("in", v));
    let (ib, dummy) = (
        ctx.upload("ids", bytemuck::cast_slice(ids)),
        ctx.zeroed("dummy", 4).unwrap(),
    );
    let act = ctx.zeroed("act", (want_act.len() * 4) as u64).unwrap();
    let input = (&xb, tokens, top_k);
    let alpha_limit = (alpha, limit);
    // Grouped: the pairs sorted into tiles by expert first.
    let (order_bytes, tile_bytes) = PairTiles::bytes(ids.len(), experts);
    let [order, tile_list] = [order_bytes, tile_bytes].map(|b| ctx.zeroed("tiles", b).unwrap());
    let tiles = PairTiles {
        order: &order,
        tiles: &tile_list,
    };
    let sort = prepare_sort_pairs(ctx, &ib, (tokens, top_k, experts), &tiles).unwrap();
    let swiglu = gw.prepare_gate_up_swiglu(
        ctx,
        input,
        &ib,
        Some(&gb),
        alpha_limit,
        grouped.then_some(&tiles),
        &act,
        &dummy,
    );
    let swiglu = swiglu
        .unwrap()
        .expect("quantized experts in at most four bindings");
    match grouped {
        true => ctx.run(&[&sort, &swiglu]).unwrap(),
        false => ctx.run(&[&swiglu]).unwrap(),
    }
    if grouped {
        check_sorted_pairs(ctx, &tiles, ids, experts);
    }
    let what = format!(
        "{kind} E{experts} H{hidden} I{intermediate} ids {ids:?} ({} and {} chunks{})",
        gw.chunk_count(),
        dw.chunk_count(),
        if grouped { ", grouped" } else { "" }
    );
    let (atol, rtol) = EXPERT_TOLERANCE;
    let got = ctx.read_f32(&act, want_act.len()).unwrap();
    let c = assert_close(
        &format!("{what} gate_up_swiglu"),
        &got,
        &want_act,
        atol,
        rtol,
    );
    eprintln!("{what} gate_up_swiglu: max |error| {:e}", c.max_abs_error);
    // down + combine from the CPU's activations, so each kernel answers for its own error.
    ctx.queue
        .write_buffer(&act, 0, bytemuck::cast_slice(&want_act));
    if grouped {
        let down_out = ctx.zeroed("down", (ids.len() * hidden * 4) as u64).unwrap();
        let down = dw
            .prepare_down_grouped(ctx, (&act, ids.len()), &tiles, Some(&db), &down_out, &dummy)
            .unwrap()
            .expect("quantized experts in at most four bindings");
        let shape = (tokens, top_k, hidden);
        let combine = prepare_combine(ctx, (&ib, &wb, &down_out), shape, &hb).unwrap();
        ctx.run(&[&down, &combine]).unwrap();
    } else {
        let combine = dw
            .prepare_down_combine(
                ctx,
                (&act, tokens, top_k),
                (&ib, &wb),
                Some(&db),
                &hb,
                &dummy,
            )
            .unwrap()
            .expect("quantized experts in at most four bindings");
        ctx.run(&[&combine]).unwrap();
    }
    let got = ctx.read_f32(&hb, want_hidden.len()).unwrap();
    let c = assert_close(
        &format!("{what} down_combine"),
        &got,
        &want_hidden,
        atol,
        rtol,
    );
    eprintln!("{what} down_combine: max |error| {:e}", c.max_abs_error);
}

/// The tiles `sort_pairs` listed: every pair once, by expert, each tile one expert's next pairs in
/// ascending order, at most 32.
fn check_sorted_pairs(ctx: &GpuContext, tiles: &PairTiles, ids: &[u32], experts: usize) {
    let (order_bytes, tile_bytes) = PairTiles::bytes(ids.len(), experts);
    let order: Vec<u32> =
        bytemuck::pod_collect_to_vec(&ctx.read_back(tiles.order, order_bytes).unwrap());
    let list: Vec<u32> =
        bytemuck::pod_collect_to_vec(&ctx.read_back(tiles.tiles, tile_bytes).unwrap());
    let mut want: Vec<u32> = (0..ids.len() as u32).collect();
    want.sort_by_key(|&q| ids[q as usize]);
    assert_eq!(&order[..ids.len()], want, "pairs by expert");
    let mut next = 0;
    for tile in list[1..1 + 3 * list[0] as usize].chunks(3) {
        let (expert, first, count) = (tile[0], tile[1] as usize, tile[2] as usize);
        assert_eq!(first, next, "tiles in order");
        assert!((1..=32).contains(&count), "tile of {count} pairs");
        assert!(
            order[first..first + count]
                .iter()
                .all(|&q| ids[q as usize] == expert)
        );
        next += count;
    }
    assert_eq!(next, ids.len(), "every pair in a tile");
}

#[test]
fn fused_experts_match_cpu() {
    for ctx in gpu_variants(None) {
        for kind in ["mxfp4", "int4"] {
            // Prefill: 3 tokens x top-2 of 4 experts, ids out of order; decode: top-4.
            check_fused_experts(&ctx, kind, (4, 64, 32), &[3, 1, 0, 2, 2, 3], 2);
            check_fused_experts(&ctx, kind, (4, 96, 64), &[2, 0, 3, 1], 4);
        }
        // GPT-OSS widths (2880 x 2880 per expert), decode with top-2 of 2.
        check_fused_experts(&ctx, "mxfp4", (2, 2880, 2880), &[1, 0], 2);
        // A block of 40 tokens: expert 0 in every token (two tiles of its pairs), expert 3 in
        // none; down's 96 rows are one and a half tiles of 64.
        let ids: Vec<u32> = (0..40).flat_map(|t| [0, 1 + t % 2]).collect();
        for kind in ["mxfp4", "int4"] {
            check_fused_experts(&ctx, kind, (4, 96, 32), &ids, 2);
        }
    }
    // 2 KiB bindings: gate_up in 4 chunks of one expert, down in 2 of two.
    for small in gpu_variants(Some(2048)) {
        for kind in ["mxfp4", "int4"] {
            check_fused_experts(&small, kind, (4, 64, 32), &[3, 1, 0, 2, 2, 3], 2);
        }
    }
    let Some(small) = gpu(Some(2048)) else { return };
    // Experts over more than four bindings are left to the separate kernels.
    let split = upload_quantized(&small, "split", &quantized("mxfp4", 5, 40, 64));
    let b = small.zeroed("b", 64).unwrap();
    let fused = split
        .prepare_down_combine(&small, (&b, 1, 2), (&b, &b), None, &b, &b)
        .unwrap();
    assert!(
        fused.is_none(),
        "{} chunks are not fused",
        split.chunk_count()
    );
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

/// Qwen3's per-head norms of the stacked q/k/v product's rows, in place: the queries' heads and
/// the keys' (a view at an offset, rows `stride` floats apart), the values untouched.
#[test]
fn head_norm_matches_cpu() {
    use picchio::gpu::kernels::{RowView, prepare_head_norm};
    let Some(ctx) = gpu(None) else { return };
    for (tokens, heads, kv_heads, head_dim) in [(1, 32, 4, 128), (5, 4, 2, 16), (3, 2, 1, 72)] {
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let stride = q_dim + 2 * kv_dim;
        let rows: Vec<f32> = values(tokens * stride, 3).iter().map(|v| v * 4.0).collect();
        let (q_weight, k_weight) = (values(head_dim, 4), values(head_dim, 5));
        let mut want = rows.clone();
        for row in want.chunks_exact_mut(stride) {
            let (q, rest) = row.split_at_mut(q_dim);
            for (part, w) in [(q, &q_weight), (&mut rest[..kv_dim], &k_weight)] {
                let input = part.to_vec();
                cpu::norm::rms_norm(&input, w, 1e-6, part);
            }
        }
        let rb = ctx.upload_f32("rows", &rows);
        let [qw, kw] = [&q_weight, &k_weight].map(|w| ctx.upload_f32("norm", w));
        let views = [(0, heads, &qw), (q_dim, kv_heads, &kw)];
        let dispatches: Vec<_> = views
            .into_iter()
            .map(|(offset, n, w)| {
                let view = RowView {
                    buffer: &rb,
                    offset,
                    stride,
                };
                prepare_head_norm(&ctx, &view, w, (tokens, n, head_dim), 1e-6).unwrap()
            })
            .collect();
        ctx.run(&dispatches.iter().collect::<Vec<_>>()).unwrap();
        let got = ctx.read_f32(&rb, rows.len()).unwrap();
        let (atol, rtol) = NORM_TOLERANCE;
        let what = format!("head_norm {tokens} x ({heads} + {kv_heads}) x {head_dim}");
        assert_close(&what, &got, &want, atol, rtol);
    }
}

const ROPE_TOLERANCE: (f32, f32) = (1e-6, 1e-6);
const ATTENTION_TOLERANCE: (f32, f32) = (1e-5, 1e-4);
const ROUTER_WEIGHT_TOLERANCE: (f32, f32) = (1e-6, 1e-6);
const SWIGLU_TOLERANCE: (f32, f32) = (1e-5, 1e-5);
const COMBINE_TOLERANCE: (f32, f32) = (1e-6, 1e-6);

fn rope_config(head_dim: usize) -> picchio::Config {
    let text = format!(
        r#"{{"head_dim": {head_dim}, "num_attention_heads": 4, "num_key_value_heads": 2}}"#
    );
    picchio::Config::from_json(&text, std::path::Path::new("test")).unwrap()
}

/// Per-token rotary tables of positions `positions`, as the host writes them.
fn rotary_tables(
    rope: &cpu::rope::RopeTable,
    positions: std::ops::Range<usize>,
) -> (Vec<f32>, Vec<f32>) {
    let (mut cos, mut sin) = (Vec::new(), Vec::new());
    for position in positions {
        let (c, s) = rope.cos_sin(position);
        cos.extend(c);
        sin.extend(s);
    }
    (cos, sin)
}

/// `[tokens, width]` rows of `x`, each head rotated as the CPU tier does at positions `first..`.
fn rotated_rows(rope: &cpu::rope::RopeTable, x: &[f32], width: usize, first: usize) -> Vec<f32> {
    let mut out = x.to_vec();
    for (t, row) in out.chunks_mut(width).enumerate() {
        let (c, s) = rope.cos_sin(first + t);
        rope.apply(row, &c, &s);
    }
    out
}

/// The attention kernel rotates the keys it stores in the cache: the cache against the CPU
/// tier's rope.
#[test]
fn rope_matches_cpu() {
    let Some(ctx) = gpu(None) else { return };
    for (head_dim, heads, start, tokens) in [(16, 3, 0, 4), (64, 8, 1000, 2), (64, 64, 4095, 1)] {
        let rope = cpu::rope::RopeTable::new(&rope_config(head_dim));
        let width = heads * head_dim;
        let keys = values(tokens * width, 3);
        let want = rotated_rows(&rope, &keys, width, start);
        // Rows of [queries, keys, values]; only the stored keys are looked at.
        let rows: Vec<f32> = keys
            .chunks(width)
            .flat_map(|k| k.iter().chain(k).chain(k).copied())
            .collect();
        let (cos, sin) = rotary_tables(&rope, start..start + tokens);
        let shape = AttentionShape {
            num_heads: heads,
            num_kv_heads: heads,
            head_dim,
            capacity: tokens,
            window: Some(1),
            kv_format: KvFormat::F32,
            splits: 1,
        };
        let buffers =
            [("rows", rows), ("cos", cos), ("sin", sin)].map(|(n, v)| ctx.upload_f32(n, &v));
        let bytes = (tokens * width * 4) as u64;
        let [k_cache, v_cache, out] =
            ["keys", "values", "out"].map(|n| ctx.zeroed(n, bytes).unwrap());
        let sinks = ctx.zeroed("sinks", (heads * 4) as u64).unwrap();
        // Token t lands in slot t: each case starts on a multiple of its length (the capacity).
        assert_eq!(start % tokens, 0);
        let step = ctx.uniform("step", bytemuck::cast_slice(&[start as u32, 0, 0, 0]));
        let inputs = AttentionInputs {
            step: &step,
            rows: QkvRows {
                buffer: &buffers[0],
                stride: 3 * width,
                query: 0,
                key: width,
                value: 2 * width,
                rotate_query: true,
                rotate_key: true,
            },
            cos: &buffers[1],
            sin: &buffers[2],
            keys: &k_cache,
            values: &v_cache,
            partials: None,
        };
        let d = prepare_attention(&ctx, shape, tokens, &inputs, Some(&sinks), &out).unwrap();
        ctx.run(&d.iter().collect::<Vec<_>>()).unwrap();
        let got = ctx.read_f32(&k_cache, want.len()).unwrap();
        let (atol, rtol) = ROPE_TOLERANCE;
        assert_close(
            &format!("rope D{head_dim} x{heads} at {start}"),
            &got,
            &want,
            atol,
            rtol,
        );
    }
}

/// One attention case: `tokens` queries at positions start.. against keys 0..start+tokens.
#[derive(Clone, Copy, Debug)]
struct AttentionCase {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    start: usize,
    tokens: usize,
    window: Option<usize>,
    /// Queries and keys rotated by the kernel.
    rotate: bool,
    kv_format: KvFormat,
    /// Workgroups the new block's keys are split across (the past block runs unsplit).
    splits: usize,
    /// GPT-OSS's sinks, or none (Qwen3-MoE).
    sinks: bool,
}

const fn case(
    (heads, kv_heads, head_dim): (usize, usize, usize),
    (start, tokens): (usize, usize),
    window: Option<usize>,
    rotate: bool,
) -> AttentionCase {
    AttentionCase {
        heads,
        kv_heads,
        head_dim,
        start,
        tokens,
        window,
        rotate,
        kv_format: KvFormat::F32,
        splits: 1,
        sinks: true,
    }
}

impl AttentionCase {
    const fn f16(self) -> AttentionCase {
        AttentionCase {
            kv_format: KvFormat::F16,
            ..self
        }
    }

    const fn split(self, splits: usize) -> AttentionCase {
        AttentionCase { splits, ..self }
    }

    const fn without_sinks(self) -> AttentionCase {
        AttentionCase {
            sinks: false,
            ..self
        }
    }
}

/// The attention table: prefill and decode, windows and rings, head sizes, group sizes, split
/// keys and the f16 cache.
const ATTENTION_CASES: &[AttentionCase] = &[
    case((4, 2, 16), (0, 5), None, false), // prefill from scratch
    case((4, 2, 16), (0, 5), None, true),
    case((4, 2, 16), (10, 3), Some(4), true), // window crossed, ring
    case((6, 2, 32), (70, 1), Some(16), true), // decode, group of 3
    case((2, 1, 96), (130, 2), None, true),   // head_dim above 64, several tiles
    // GPT-OSS shape: 64 heads of 64, 8 kv heads, decode with the 128-key window.
    case((64, 8, 64), (300, 1), Some(128), true),
    // Decode with the keys split across workgroups: GPT-OSS's shape over 701 keys, uneven shares,
    // shares of a window, a head_dim above 64 with more splits than tiles.
    case((64, 8, 64), (700, 1), None, true).split(3),
    case((6, 2, 32), (90, 1), None, true).split(7),
    case((6, 2, 32), (300, 1), Some(16), true).split(4),
    case((2, 1, 96), (200, 1), None, true).split(32),
    // More query heads per KV head than lanes.
    case((72, 1, 16), (40, 1), None, true).split(2),
    // The f16 cache, against the CPU with the same rounding.
    case((4, 2, 16), (10, 3), Some(4), false).f16(),
    case((64, 8, 64), (300, 1), None, true).f16(),
    case((6, 2, 32), (90, 1), None, true).f16().split(5),
    // No sinks (Qwen3-MoE's shape: 128-wide heads, groups of 8), whole and split.
    case((16, 2, 128), (0, 6), None, true).without_sinks(),
    case((16, 2, 128), (40, 1), None, true)
        .without_sinks()
        .split(3),
    case((4, 2, 16), (10, 3), Some(4), true).without_sinks(),
];

/// Attention of a case on the GPU (the cache filled by the kernel itself in two blocks, ring when
/// windowed) and on the CPU.
fn check_attention(ctx: &GpuContext, c: AttentionCase) {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let total = c.start + c.tokens;
    let q: Vec<f32> = values(c.tokens * q_dim, 11)
        .iter()
        .map(|v| v * 2.0)
        .collect();
    let k: Vec<f32> = values(total * kv_dim, 12).iter().map(|v| v * 2.0).collect();
    let v = values(total * kv_dim, 13);
    let sinks: Option<Vec<f32>> = c.sinks.then(|| values(c.heads, 14));
    let rope = cpu::rope::RopeTable::new(&rope_config(c.head_dim));
    let (q_seen, mut k_seen) = match c.rotate {
        true => (
            rotated_rows(&rope, &q, q_dim, c.start),
            rotated_rows(&rope, &k, kv_dim, 0),
        ),
        false => (q.clone(), k.clone()),
    };
    let mut v_seen = v.clone();
    c.kv_format.round(&mut k_seen);
    c.kv_format.round(&mut v_seen);
    let want = cpu_attention(c, &q_seen, &k_seen, &v_seen, sinks.as_deref());

    // Ring of window + block - 1 slots for sliding layers, everything for full ones.
    let capacity = c.window.map_or(total, |w| w + c.tokens.max(c.start) - 1);
    let shape = AttentionShape {
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        head_dim: c.head_dim,
        capacity,
        window: c.window,
        kv_format: c.kv_format,
        splits: 1,
    };
    let bytes = capacity as u64 * shape.cache_row_bytes();
    let caches = ["k_cache", "v_cache"].map(|n| ctx.zeroed(n, bytes).unwrap());
    let step = ctx.uniform("step", bytemuck::cast_slice(&[0u32; 4]));
    let stride = q_dim + 2 * kv_dim;
    let sb = sinks.as_ref().map(|sinks| ctx.upload_f32("sinks", sinks));
    let ob = ctx.zeroed("out", (want.len() * 4) as u64).unwrap();
    let past_out = ctx
        .zeroed("past out", (c.start.max(1) * q_dim * 4) as u64)
        .unwrap();
    let partials = ctx
        .zeroed("partials", shape.partials_bytes(c.tokens, c.splits))
        .unwrap();
    // Past keys (positions 0..start) in one block, then the new block, as prefill then decode;
    // only the new block's output is checked, so the past block's queries are zeros.
    for (first, count) in [(0, c.start), (c.start, c.tokens)] {
        if count == 0 {
            continue;
        }
        ctx.queue
            .write_buffer(&step, 0, bytemuck::cast_slice(&[first as u32, 0, 0, 0]));
        let mut rows = Vec::with_capacity(count * stride);
        for t in 0..count {
            let j = first + t;
            match first == c.start {
                true => rows.extend_from_slice(&q[t * q_dim..(t + 1) * q_dim]),
                false => rows.extend(std::iter::repeat_n(0.0, q_dim)),
            }
            rows.extend_from_slice(&k[j * kv_dim..(j + 1) * kv_dim]);
            rows.extend_from_slice(&v[j * kv_dim..(j + 1) * kv_dim]);
        }
        let (cos, sin) = rotary_tables(&rope, first..first + count);
        let buffers =
            [("rows", rows), ("cos", cos), ("sin", sin)].map(|(n, v)| ctx.upload_f32(n, &v));
        let inputs = AttentionInputs {
            step: &step,
            rows: QkvRows {
                buffer: &buffers[0],
                stride,
                query: 0,
                key: q_dim,
                value: q_dim + kv_dim,
                rotate_query: c.rotate,
                rotate_key: c.rotate,
            },
            cos: &buffers[1],
            sin: &buffers[2],
            keys: &caches[0],
            values: &caches[1],
            partials: Some(&partials),
        };
        let (out, splits) = match first == c.start {
            true => (&ob, c.splits),
            false => (&past_out, 1),
        };
        let shape = AttentionShape { splits, ..shape };
        let attend = prepare_attention(ctx, shape, count, &inputs, sb.as_ref(), out).unwrap();
        assert_eq!(attend.len(), if splits > 1 { 2 } else { 1 });
        ctx.run(&attend.iter().collect::<Vec<_>>()).unwrap();
    }
    let got = ctx.read_f32(&ob, want.len()).unwrap();
    let (atol, rtol) = ATTENTION_TOLERANCE;
    let what = format!("attention {c:?}");
    let comparison = assert_close(&what, &got, &want, atol, rtol);
    eprintln!("{what}: max |error| {:e}", comparison.max_abs_error);
}

/// The CPU tier's attention of a case's queries over keys and values as the cache holds them.
fn cpu_attention(
    c: AttentionCase,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let (q_dim, kv_dim) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let layout = cpu::attention::HeadLayout {
        num_heads: c.heads,
        num_kv_heads: c.kv_heads,
        head_dim: c.head_dim,
    };
    let scaling = (c.head_dim as f64).powf(-0.5) as f32;
    let mut want = vec![0f32; c.tokens * q_dim];
    for t in 0..c.tokens {
        let position = c.start + t;
        let keys = cpu::attention::first_visible_key(position, c.window)..=position;
        let kv = |j: usize| {
            (
                &k[j * kv_dim..(j + 1) * kv_dim],
                &v[j * kv_dim..(j + 1) * kv_dim],
            )
        };
        let out = &mut want[t * q_dim..(t + 1) * q_dim];
        let query = &q[t * q_dim..(t + 1) * q_dim];
        cpu::attention::attend(layout, query, keys, kv, sinks, scaling, out);
    }
    want
}

#[test]
fn attention_matches_cpu() {
    let Some(ctx) = gpu(None) else { return };
    for c in ATTENTION_CASES {
        check_attention(&ctx, *c);
    }
}

/// The f16 cache stores every key and value as the CPU tier rounds it (nearest, ties to even):
/// ties, subnormals, overflow, infinities, NaN.
#[test]
fn f16_cache_rounds_like_the_cpu() {
    let Some(ctx) = gpu(None) else { return };
    let tie = |base: f32, ulp: f32| base + ulp / 2.0;
    let keys = vec![
        0.0,
        -0.0,
        1.0,
        tie(1.0, 2f32.powi(-10)),                  // tie, even below
        tie(1.0 + 2f32.powi(-10), 2f32.powi(-10)), // tie, even above
        65504.0,
        65519.0, // rounds down to the largest f16
        65520.0, // rounds up to infinity
        1e6,
        2f32.powi(-24),       // smallest subnormal
        2f32.powi(-25),       // tie to zero
        3.0 * 2f32.powi(-25), // tie to 2^-23
        6.097e-5,             // just below the smallest normal
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -1.0 / 3.0,
        0.1,
    ];
    let values: Vec<f32> = keys.iter().map(|k| -k * 0.7).collect();
    let head_dim = keys.len();
    let shape = AttentionShape {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim,
        capacity: 1,
        window: None,
        kv_format: KvFormat::F16,
        splits: 1,
    };
    let row: Vec<f32> = keys.iter().chain(&keys).chain(&values).copied().collect();
    let rows = ctx.upload_f32("rows", &row);
    let tables = ctx.zeroed("rope tables", 4 * head_dim as u64).unwrap();
    let [k_cache, v_cache] =
        ["keys", "values"].map(|n| ctx.zeroed(n, shape.cache_row_bytes()).unwrap());
    let out = ctx.zeroed("out", 4 * head_dim as u64).unwrap();
    let sinks = ctx.zeroed("sinks", 4).unwrap();
    let step = ctx.uniform("step", bytemuck::cast_slice(&[0u32; 4]));
    let inputs = AttentionInputs {
        step: &step,
        rows: QkvRows {
            buffer: &rows,
            stride: 3 * head_dim,
            query: 0,
            key: head_dim,
            value: 2 * head_dim,
            rotate_query: false,
            rotate_key: false,
        },
        cos: &tables,
        sin: &tables,
        keys: &k_cache,
        values: &v_cache,
        partials: None,
    };
    let d = prepare_attention(&ctx, shape, 1, &inputs, Some(&sinks), &out).unwrap();
    ctx.run(&d.iter().collect::<Vec<_>>()).unwrap();
    for (cache, stored) in [(&k_cache, &keys), (&v_cache, &values)] {
        let bytes = ctx.read_back(cache, shape.cache_row_bytes()).unwrap();
        let got: Vec<u16> = bytemuck::pod_collect_to_vec(&bytes);
        let want: Vec<u16> = stored
            .iter()
            .map(|v| half::f16::from_f32(*v).to_bits())
            .collect();
        assert_eq!(got, want, "f16 cache of {stored:?}");
    }
}

/// The split policy: decode over a long cache splits, a prompt never does.
#[test]
fn attention_splits_only_long_decodes() {
    assert_eq!(AttentionShape::splits_for(1, 128), 1);
    assert_eq!(AttentionShape::splits_for(1, 256), 1);
    assert_eq!(AttentionShape::splits_for(1, 257), 2);
    assert_eq!(AttentionShape::splits_for(1, 1 << 20), MAX_SPLITS);
    assert_eq!(AttentionShape::splits_for(8, 1 << 20), 1);
    // A sliding layer's ring holds more slots than its window: the window decides.
    let ring = AttentionShape {
        num_heads: 64,
        num_kv_heads: 8,
        head_dim: 64,
        capacity: 128 + 512 - 1,
        window: Some(128),
        kv_format: KvFormat::F32,
        splits: 1,
    };
    assert_eq!(AttentionShape::splits_for(1, ring.most_visible_keys()), 1);
}

/// Every router gating: GPT-OSS's, and Qwen3-MoE's with and without `norm_topk_prob`.
const GATINGS: [Gating; 3] = [
    Gating::TopKThenSoftmax,
    Gating::SoftmaxThenTopK { renormalize: true },
    Gating::SoftmaxThenTopK { renormalize: false },
];

/// The CPU tier's routing of one token's logits.
fn cpu_route(logits: &[f32], k: usize, gating: Gating) -> cpu::moe::Routing {
    match gating {
        Gating::TopKThenSoftmax => cpu::moe::route(logits, k),
        Gating::SoftmaxThenTopK { renormalize } => {
            cpu::moe::route_softmax_first(logits, k, renormalize)
        }
    }
}

#[test]
fn router_top_k_matches_cpu() {
    use picchio::gpu::kernels::prepare_route;
    let Some(ctx) = gpu(None) else { return };
    let shapes = [(1, 4, 2), (5, 32, 4), (3, 128, 4), (2, 6, 6), (4, 128, 8)];
    for ((tokens, experts, k), gating) in shapes.into_iter().flat_map(|s| GATINGS.map(|g| (s, g))) {
        let mut logits = values(tokens * experts, 21);
        logits[1] = logits[0]; // a tie: the lower id goes first
        let (mut want_ids, mut want_weights) = (Vec::new(), Vec::new());
        for row in logits.chunks(experts) {
            let r = cpu_route(row, k, gating);
            want_ids.extend(r.experts.iter().map(|e| *e as u32));
            want_weights.extend(r.weights);
        }
        let lb = ctx.upload_f32("logits", &logits);
        let (ib, wb) = (
            ctx.zeroed("ids", (tokens * k * 4) as u64).unwrap(),
            ctx.zeroed("w", (tokens * k * 4) as u64).unwrap(),
        );
        let d = prepare_route(&ctx, &lb, (tokens, experts, k), gating, &ib, &wb).unwrap();
        ctx.run(&[&d]).unwrap();
        let ids: Vec<u32> =
            bytemuck::pod_collect_to_vec(&ctx.read_back(&ib, (tokens * k * 4) as u64).unwrap());
        assert_eq!(ids, want_ids, "route {tokens}x{experts} top-{k} {gating:?}");
        let (atol, rtol) = ROUTER_WEIGHT_TOLERANCE;
        assert_close(
            "router weights",
            &ctx.read_f32(&wb, tokens * k).unwrap(),
            &want_weights,
            atol,
            rtol,
        );
    }
}

/// The output projection's variant: `y += W x + bias` (into the residual stream), split over
/// bindings as well.
#[test]
fn dense_matmul_accumulates_into_its_output() {
    use picchio::gpu::kernels::Output;
    for binding_limit in [None, Some(2048)] {
        let Some(ctx) = gpu(binding_limit) else {
            return;
        };
        for (format, (rows, cols, tokens)) in [
            (FloatFormat::Bf16, (131, 72, 2)),
            (FloatFormat::F32, (7, 33, 1)),
            (FloatFormat::F16, (64, 96, 3)),
            (FloatFormat::Bf16, (70, 64, 17)), // tiles
        ] {
            let m = dense_matrix(rows, cols, format, 77);
            let (x, bias, start) = (
                values(tokens * cols, 5),
                values(rows, 9),
                values(tokens * rows, 4),
            );
            let mut product = vec![0f32; tokens * rows];
            cpu::matmul::dense_matmul(&m, &x, Some(&bias), &mut product);
            let want: Vec<f32> = start.iter().zip(&product).map(|(s, p)| s + p).collect();
            let gm = GpuMatrix::upload(&ctx, "o", &m).unwrap();
            let [xb, bb, yb] = [&x, &bias, &start].map(|v| ctx.upload_f32("buffer", v));
            let dummy = ctx.zeroed("dummy", 4).unwrap();
            let dispatches = gm
                .prepare_product(
                    &ctx,
                    (&xb, tokens),
                    None,
                    Some(&bb),
                    (&yb, Output::Accumulate),
                    &dummy,
                )
                .unwrap();
            ctx.run(&dispatches.iter().collect::<Vec<_>>()).unwrap();
            let got = ctx.read_f32(&yb, tokens * rows).unwrap();
            let (atol, rtol) = DENSE_TOLERANCE;
            let what = format!(
                "accumulate {format:?} {rows}x{cols} x{tokens} ({} chunks)",
                gm.chunks.len()
            );
            assert_close(&what, &got, &want, atol, rtol);
        }
    }
}

/// A product that takes its input's RMSNorm in (q/k/v after the input norm, the head after the
/// final norm) against the CPU tier's norm then product; split over bindings as well. A matrix
/// whose rows are not whole 16-byte words runs the norm first into the scratch buffer given, and
/// refuses without one.
#[test]
fn dense_matmul_takes_its_input_norm_in() {
    use picchio::gpu::kernels::{Output, RowNorm};
    for (binding_limit, ctx) in [None, Some(2048)]
        .into_iter()
        .flat_map(|limit| gpu_variants(limit).into_iter().map(move |ctx| (limit, ctx)))
    {
        let mut cases = vec![
            (FloatFormat::Bf16, (131, 72, 2)),
            (FloatFormat::F16, (64, 96, 3)),
            (FloatFormat::Bf16, (40, 64, 10)),
            // Rows not of whole words: the norm runs first, into the scratch buffer.
            (FloatFormat::Bf16, (7, 33, 2)),
            (FloatFormat::F32, (9, 40, 3)),
        ];
        if binding_limit.is_none() {
            cases.push((FloatFormat::Bf16, (5120, 2880, 1))); // GPT-OSS's stacked q/k/v
            cases.push((FloatFormat::Bf16, (70, 96, 33))); // tiles
        }
        for (format, (rows, cols, tokens)) in cases {
            let m = dense_matrix(rows, cols, format, 78);
            let x: Vec<f32> = values(tokens * cols, 5).iter().map(|v| v * 3.0).collect();
            let norm: Vec<f32> = values(cols, 6).iter().map(|v| 1.0 + 0.1 * v).collect();
            let bias = values(rows, 9);
            let mut normed = vec![0f32; tokens * cols];
            cpu::norm::rms_norm(&x, &norm, 1e-5, &mut normed);
            let mut want = vec![0f32; tokens * rows];
            cpu::matmul::dense_matmul(&m, &normed, Some(&bias), &mut want);
            let gm = GpuMatrix::upload(&ctx, "qkv", &m).unwrap();
            let [xb, nb, bb] = [&x, &norm, &bias].map(|v| ctx.upload_f32("buffer", v));
            let (yb, dummy) = (
                ctx.zeroed("y", (want.len() * 4) as u64).unwrap(),
                ctx.zeroed("dummy", 4).unwrap(),
            );
            // Needed only by matrices whose rows are not whole words (the norm runs first).
            let scratch =
                (!gm.by_words()).then(|| ctx.zeroed("normed", (x.len() * 4) as u64).unwrap());
            let row_norm = Some(RowNorm {
                weight: &nb,
                eps: 1e-5,
                scratch: scratch.as_ref(),
            });
            let out = (&yb, Output::Store);
            let dispatches = gm
                .prepare_product(&ctx, (&xb, tokens), row_norm, Some(&bb), out, &dummy)
                .unwrap();
            ctx.run(&dispatches.iter().collect::<Vec<_>>()).unwrap();
            let got = ctx.read_f32(&yb, want.len()).unwrap();
            let what = format!(
                "normed {format:?} {rows}x{cols} x{tokens} ({} chunks)",
                gm.chunks.len()
            );
            let (atol, rtol) = DENSE_TOLERANCE;
            let c = assert_close(&what, &got, &want, atol, rtol);
            eprintln!("{what}: max |error| {:e}", c.max_abs_error);
        }
    }
    let Some(ctx) = gpu(None) else { return };
    let odd = GpuMatrix::upload(&ctx, "odd", &dense_matrix(7, 33, FloatFormat::Bf16, 1)).unwrap();
    let b = ctx.zeroed("b", 256).unwrap();
    let norm = Some(RowNorm {
        weight: &b,
        eps: 1e-5,
        scratch: None,
    });
    let refused = odd.prepare_product(&ctx, (&b, 1), norm, None, (&b, Output::Store), &b);
    assert!(
        refused.is_err(),
        "33 columns are not whole words, and no scratch was given"
    );
}

/// The router in one kernel (norm, product, top-k) against the CPU tier's three ops; with the
/// router split over bindings it declines, and the caller runs the three kernels.
#[test]
fn router_with_its_norm_matches_cpu() {
    use picchio::gpu::kernels::{RouterWeights, RoutingBuffers, prepare_route_normed};
    let Some(ctx) = gpu(None) else { return };
    let cases = [
        (1, 32, 2880, 4, FloatFormat::Bf16, GATINGS[0]), // GPT-OSS decode
        (3, 13, 40, 6, FloatFormat::F32, GATINGS[2]),    // a partial tile of router rows
        (2, 128, 64, 8, FloatFormat::F16, GATINGS[1]),   // many experts, Qwen3-MoE's router
    ];
    for (tokens, experts, cols, k, format, gating) in cases {
        let x: Vec<f32> = values(tokens * cols, 1).iter().map(|v| v * 3.0).collect();
        let norm: Vec<f32> = values(cols, 2).iter().map(|v| 1.0 + 0.1 * v).collect();
        let m = dense_matrix(experts, cols, format, 41);
        // GPT-OSS's router has a bias, Qwen3-MoE's none.
        let bias = (gating == Gating::TopKThenSoftmax).then(|| values(experts, 42));
        let mut want_normed = vec![0f32; tokens * cols];
        cpu::norm::rms_norm(&x, &norm, 1e-5, &mut want_normed);
        let mut want_logits = vec![0f32; tokens * experts];
        cpu::matmul::dense_matmul(&m, &want_normed, bias.as_deref(), &mut want_logits);
        let (mut want_ids, mut want_weights) = (Vec::new(), Vec::new());
        for row in want_logits.chunks(experts) {
            let r = cpu_route(row, k, gating);
            want_ids.extend(r.experts.iter().map(|e| *e as u32));
            want_weights.extend(r.weights);
        }

        let gm = GpuMatrix::upload(&ctx, "router", &m).unwrap();
        let [xb, nb] = [&x, &norm].map(|v| ctx.upload_f32("buffer", v));
        let bb = bias.as_ref().map(|b| ctx.upload_f32("bias", b));
        let zeroed = |floats: usize| ctx.zeroed("out", (floats * 4) as u64).unwrap();
        let (normed, logits) = (zeroed(tokens * cols), zeroed(tokens * experts));
        let (ids, weights) = (zeroed(tokens * k), zeroed(tokens * k));
        let router = RouterWeights {
            matrix: &gm,
            bias: bb.as_ref(),
            top_k: k,
            gating,
        };
        let out = RoutingBuffers {
            logits: &logits,
            ids: &ids,
            weights: &weights,
        };
        let d = prepare_route_normed(&ctx, (&xb, tokens), (&nb, 1e-5), &normed, &router, &out)
            .unwrap()
            .expect("the router fits one binding");
        ctx.run(&[&d]).unwrap();
        let what = format!("router {tokens}x{cols} -> {experts} top-{k} {format:?} {gating:?}");
        let (atol, rtol) = NORM_TOLERANCE;
        let got = ctx.read_f32(&normed, tokens * cols).unwrap();
        assert_close(&format!("{what} normed"), &got, &want_normed, atol, rtol);
        let (atol, rtol) = DENSE_TOLERANCE;
        let got = ctx.read_f32(&logits, tokens * experts).unwrap();
        let c = assert_close(&format!("{what} logits"), &got, &want_logits, atol, rtol);
        let got: Vec<u32> =
            bytemuck::pod_collect_to_vec(&ctx.read_back(&ids, (tokens * k * 4) as u64).unwrap());
        assert_eq!(got, want_ids, "{what} ids");
        let (atol, rtol) = ROUTER_WEIGHT_TOLERANCE;
        let got = ctx.read_f32(&weights, tokens * k).unwrap();
        assert_close(&format!("{what} weights"), &got, &want_weights, atol, rtol);
        eprintln!("{what}: logits max |error| {:e}", c.max_abs_error);
    }
    let Some(small) = gpu(Some(2048)) else { return };
    let m = dense_matrix(32, 64, FloatFormat::Bf16, 41);
    let gm = GpuMatrix::upload(&small, "router", &m).unwrap();
    let b = small.zeroed("b", 32 * 4).unwrap();
    let router = RouterWeights {
        matrix: &gm,
        bias: Some(&b),
        top_k: 4,
        gating: Gating::TopKThenSoftmax,
    };
    let out = RoutingBuffers {
        logits: &b,
        ids: &b,
        weights: &b,
    };
    let fused = prepare_route_normed(&small, (&b, 1), (&b, 1e-5), &b, &router, &out).unwrap();
    assert!(
        fused.is_none(),
        "a router over {} bindings is not fused",
        gm.chunks.len()
    );
}

#[test]
fn swiglu_and_combine_match_cpu() {
    use picchio::gpu::kernels::{prepare_combine, prepare_swiglu};
    let Some(ctx) = gpu(None) else { return };
    let (rows, width) = (6, 40);
    let gate_up: Vec<f32> = values(rows * 2 * width, 31)
        .iter()
        .map(|v| v * 12.0)
        .collect();
    let mut want = vec![0f32; rows * width];
    cpu::moe::clamped_swiglu(&gate_up, 1.702, 7.0, &mut want);
    let (gb, ab) = (
        ctx.upload_f32("gate_up", &gate_up),
        ctx.zeroed("act", (rows * width * 4) as u64).unwrap(),
    );
    let clamped = Activation::ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };
    let d = prepare_swiglu(&ctx, &gb, (rows, width), clamped, &ab).unwrap();
    ctx.run(&[&d]).unwrap();
    let (atol, rtol) = SWIGLU_TOLERANCE;
    assert_close(
        "swiglu",
        &ctx.read_f32(&ab, rows * width).unwrap(),
        &want,
        atol,
        rtol,
    );
    // Qwen3-MoE's: gate rows then up rows, no clamp.
    cpu::moe::swiglu(&gate_up, width, &mut want);
    let d = prepare_swiglu(&ctx, &gb, (rows, width), Activation::Swiglu, &ab).unwrap();
    ctx.run(&[&d]).unwrap();
    let got = ctx.read_f32(&ab, rows * width).unwrap();
    assert_close("plain swiglu", &got, &want, atol, rtol);

    // combine: 2 tokens x top-3, experts listed out of id order.
    let (tokens, k, hidden) = (2, 3, 24);
    let ids: Vec<u32> = vec![5, 1, 3, 0, 7, 2];
    let weights = [0.5f32, 0.3, 0.2, 0.6, 0.25, 0.15];
    let down = values(tokens * k * hidden, 33);
    let base = values(tokens * hidden, 34);
    let mut want = base.clone();
    for t in 0..tokens {
        let mut order: Vec<usize> = (0..k).collect();
        order.sort_by_key(|s| ids[t * k + s]);
        let mut sum = vec![0f32; hidden];
        for s in order {
            for c in 0..hidden {
                sum[c] += down[(t * k + s) * hidden + c] * weights[t * k + s];
            }
        }
        for c in 0..hidden {
            want[t * hidden + c] += sum[c];
        }
    }
    let (ib, wb, db, hb) = (
        ctx.upload("ids", bytemuck::cast_slice(&ids)),
        ctx.upload_f32("w", &weights),
        ctx.upload_f32("down", &down),
        ctx.upload_f32("hidden", &base),
    );
    let d = prepare_combine(&ctx, (&ib, &wb, &db), (tokens, k, hidden), &hb).unwrap();
    ctx.run(&[&d]).unwrap();
    let (atol, rtol) = COMBINE_TOLERANCE;
    assert_close(
        "combine",
        &ctx.read_f32(&hb, tokens * hidden).unwrap(),
        &want,
        atol,
        rtol,
    );
}

#[test]
fn add_and_argmax_match_cpu() {
    use picchio::gpu::kernels::{prepare_add, prepare_argmax};
    {
        let Some(ctx) = gpu(None) else { return };
        let (x, y) = (values(100, 51), values(100, 52));
        let (xb, yb) = (ctx.upload_f32("x", &x), ctx.upload_f32("y", &y));
        ctx.run(&[&prepare_add(&ctx, &xb, &yb, 100).unwrap()])
            .unwrap();
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        assert_eq!(ctx.read_f32(&yb, 100).unwrap(), want);
    }
    let Some(ctx) = gpu(None) else { return };
    for (n, seed) in [(1, 1), (257, 2), (201088, 3)] {
        let mut v = values(n, seed);
        if n > 10 {
            v[n - 1] = 5.0; // the maximum last, and a tie before it
            v[3] = 5.0;
            v[5] = f32::NAN;
        }
        let (vb, rb) = (ctx.upload_f32("v", &v), ctx.zeroed("r", 4).unwrap());
        ctx.run(&[&prepare_argmax(&ctx, &vb, n, &rb).unwrap()])
            .unwrap();
        let got: Vec<u32> = bytemuck::pod_collect_to_vec(&ctx.read_back(&rb, 4).unwrap());
        assert_eq!(got[0], cpu_argmax(&v), "argmax of {n}");
        let k = n.min(10);
        let rb = ctx.zeroed("r", (8 * k) as u64).unwrap();
        ctx.run(&[&picchio::gpu::kernels::prepare_top_k(&ctx, &vb, n, k, &rb).unwrap()])
            .unwrap();
        let words: Vec<u32> =
            bytemuck::pod_collect_to_vec(&ctx.read_back(&rb, (8 * k) as u64).unwrap());
        let got: Vec<(u32, f32)> = words
            .chunks(2)
            .map(|w| (w[0], f32::from_bits(w[1])))
            .collect();
        let finite: Vec<f32> = v
            .iter()
            .map(|x| if x.is_nan() { f32::NEG_INFINITY } else { *x })
            .collect();
        assert_eq!(
            got,
            picchio::model::sampler::top_k(&finite, k),
            "top-{k} of {n}"
        );
    }
}

fn cpu_argmax(v: &[f32]) -> u32 {
    picchio::model::sampler::argmax(v)
}

#[test]
fn unquantized_experts_match_cpu() {
    use picchio::weights::DenseExperts;
    for max_binding in [None, Some(8192)] {
        let Some(ctx) = gpu(max_binding) else { return };
        for format in [FloatFormat::Bf16, FloatFormat::F32] {
            let (experts, inputs, outputs) = (3, 48, 40);
            // [E, in, out] with the same bytes layout as a dense [E * in, out] matrix.
            let m = dense_matrix(experts * inputs, outputs, format, 61);
            let w = DenseExperts {
                experts,
                inputs,
                outputs,
                format,
                data: m.data.clone(),
            };
            let ids = [2u32, 0, 1, 2];
            let x = values(2 * inputs, 62);
            let bias = values(experts * outputs, 63);
            let mut want = vec![0f32; ids.len() * outputs];
            for (p, &e) in ids.iter().enumerate() {
                let e = e as usize;
                let out = &mut want[p * outputs..(p + 1) * outputs];
                let xs = &x[(p / 2) * inputs..(p / 2 + 1) * inputs];
                cpu::matmul::dense_expert_matmul(
                    &w,
                    e,
                    xs,
                    Some(&bias[e * outputs..(e + 1) * outputs]),
                    out,
                );
            }
            let gw = GpuExperts::upload_unquantized(&ctx, "dense", &w).unwrap();
            let (xb, bb, yb, ib, dummy) = (
                ctx.upload_f32("x", &x),
                ctx.upload_f32("bias", &bias),
                ctx.zeroed("y", (want.len() * 4) as u64).unwrap(),
                ctx.upload("ids", bytemuck::cast_slice(&ids)),
                ctx.zeroed("dummy", 4).unwrap(),
            );
            let ds = gw
                .prepare(&ctx, &xb, 2, &ib, ids.len(), Some(&bb), &yb, &dummy)
                .unwrap();
            ctx.run(&ds.iter().collect::<Vec<_>>()).unwrap();
            let (atol, rtol) = EXPERT_TOLERANCE;
            let what = format!(
                "unquantized {format:?} experts ({} chunks)",
                gw.chunk_count()
            );
            assert_close(
                &what,
                &ctx.read_f32(&yb, want.len()).unwrap(),
                &want,
                atol,
                rtol,
            );
        }
    }
}

/// Qwen3-MoE's float experts in `[out, in]` orientation, gate and up in one block or two (as the
/// hub's per-expert tensors may lie), over one binding and split over several.
#[test]
fn row_experts_match_cpu() {
    use picchio::weights::{ExpertMatrices, RowExperts};
    for max_binding in [None, Some(8192)] {
        let Some(ctx) = gpu(max_binding) else { return };
        for format in [FloatFormat::Bf16, FloatFormat::F16, FloatFormat::F32] {
            let (experts, rows, cols) = (4, 40, 48);
            let matrices: Vec<DenseMatrix> = (0..experts)
                .map(|e| dense_matrix(rows, cols, format, 70 + e as u64))
                .collect();
            // Expert 1 as two row blocks, the others whole.
            let half = rows / 2 * cols * format.size();
            let blocks = (matrices.iter().enumerate())
                .map(|(e, m)| match e {
                    1 => vec![m.data.slice(0..half), m.data.slice(half..2 * half)],
                    _ => vec![m.data.clone()],
                })
                .collect();
            let w = RowExperts::new((rows, cols), format, blocks);
            let ids = [1u32, 3, 0, 1, 2, 1];
            let x = values(3 * cols, 62);
            let mut want = vec![0f32; ids.len() * rows];
            for (p, &e) in ids.iter().enumerate() {
                let out = &mut want[p * rows..(p + 1) * rows];
                let xs = &x[(p / 2) * cols..(p / 2 + 1) * cols];
                cpu::matmul::row_expert_matmul(&w, e as usize, xs, None, out);
            }
            let gw = GpuExperts::upload(&ctx, "rows", &ExpertMatrices::Rows(w)).unwrap();
            let (xb, yb, ib, dummy) = (
                ctx.upload_f32("x", &x),
                ctx.zeroed("y", (want.len() * 4) as u64).unwrap(),
                ctx.upload("ids", bytemuck::cast_slice(&ids)),
                ctx.zeroed("dummy", 4).unwrap(),
            );
            let ds = gw
                .prepare(&ctx, &xb, 2, &ib, ids.len(), None, &yb, &dummy)
                .unwrap();
            ctx.run(&ds.iter().collect::<Vec<_>>()).unwrap();
            let (atol, rtol) = EXPERT_TOLERANCE;
            let what = format!("row {format:?} experts ({} chunks)", gw.chunk_count());
            let got = ctx.read_f32(&yb, want.len()).unwrap();
            assert_close(&what, &got, &want, atol, rtol);
        }
    }
}

/// The bandwidth probe's read (what `picchio bench --backend gpu --roofline` times) reads every
/// word: its per-lane folds equal the host's, including a buffer that is not a whole number of
/// grid-wide passes.
#[test]
fn bandwidth_probe_reads_every_word() {
    use picchio::gpu::bandwidth::{fold_on_host, prepare_read};
    let Some(ctx) = gpu(None) else {
        return;
    };
    let words: Vec<u32> = bytes((1 << 20) + 48, 7)
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let data = ctx.upload("probe data", bytemuck::cast_slice(&words));
    let want = fold_on_host(&words);
    let folded = ctx.zeroed("folds", (want.len() * 4) as u64).unwrap();
    let read = prepare_read(&ctx, &data, (words.len() * 4) as u64, &folded).unwrap();
    ctx.run(&[&read]).unwrap();
    let got: Vec<u32> =
        bytemuck::pod_collect_to_vec(&ctx.read_back(&folded, (want.len() * 4) as u64).unwrap());
    let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    assert_eq!(wrong, 0, "{wrong} of {} lanes differ", want.len());
}
