//! CPU kernel throughput on GPT-OSS-20B's real shapes (random weights), one group per kernel:
//! `cargo bench --bench cpu_kernels`; criterion reports time and bytes/s per kernel. Matrices
//! up to a few MiB stay in cache between iterations (kernel speed); the 201088-row LM head does
//! not (memory speed).
//!
//! - `matvec`: one token (decode) through each shape.
//! - `prefill8`: eight tokens through each shape (a prompt's tokens per expert, on average, for
//!   a 64-token prompt on GPT-OSS-20B), each row read once for all of them.
//! - `prefill64`: a 64-token prompt through the dense shape (AMX tiles where the CPU has them;
//!   `PICCHIO_CPU_AMX=off` for the AVX-512 kernel).
//! - `q8`: the `--dense-format q8` versions of the dense shapes.
//! - `mxfp4_interleaved_*` in `matvec` and `prefill8`: the experts as the CPU tier lays them out
//!   at load where the CPU has AVX-512 VBMI (whole runs interleaved).
//! - `mxfp4_q8_inputs_*` in `matvec` and `prefill8`: the experts with `--expert-activations q8`.
//! - `attention`: one decoded position's attention over 128, 1024 and 4096 cached positions of a
//!   GPT-OSS-20B layer (a `KvCache` that keeps them all, laid out as the model reads it), every
//!   kv head's group in turn on one thread. Up to 1024 positions the keys and values stay in
//!   cache between iterations (kernel speed; decode reads them after the rest of the model). `PICCHIO_CPU_KERNELS=avx2` (or `scalar`) times the
//!   narrower kernels on a CPU that has wider ones.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use picchio::Config;
use picchio::cpu::attention::{HeadLayout, attend_group};
use picchio::cpu::matmul::{dense_matmul, mxfp4_matmul, mxfp4_q8_matmul};
use picchio::cpu::q8::{Q8Matrix, q8_matmul};
use picchio::model::KvCache;
use picchio::weights::{DenseMatrix, FloatFormat, Mxfp4Experts, TensorBytes};

/// Deterministic pseudo-random bytes (xorshift), so runs compare.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

fn bf16_matrix(rows: usize, cols: usize) -> DenseMatrix {
    // Random bf16 with sane exponents: keep the high byte in a narrow range.
    let mut bytes = random_bytes(rows * cols * 2, 7);
    for pair in bytes.chunks_exact_mut(2) {
        pair[1] = 0x3C | (pair[1] & 0x80);
    }
    DenseMatrix {
        rows,
        cols,
        format: FloatFormat::Bf16,
        data: TensorBytes::from_vec(bytes),
    }
}

fn mxfp4_expert(rows: usize, cols: usize) -> Mxfp4Experts {
    let groups = cols / 32;
    let scales: Vec<u8> = random_bytes(rows * groups, 3)
        .iter()
        .map(|b| 118 + b % 4)
        .collect();
    Mxfp4Experts::contiguous(
        1,
        (rows, cols),
        TensorBytes::from_vec(random_bytes(rows * groups * 16, 5)),
        TensorBytes::from_vec(scales),
    )
}

fn input(len: usize) -> Vec<f32> {
    (0..len).map(|i| ((i as f32) * 0.618).sin()).collect()
}

const EXPERT_SHAPES: [(&str, usize, usize); 2] = [
    ("mxfp4_5760x2880", 5760, 2880),
    ("mxfp4_2880x2880", 2880, 2880),
];

const DENSE_SHAPES: [(&str, usize, usize); 2] = [
    ("bf16_4096x2880", 4096, 2880),
    ("bf16_lm_head_201088x2880", 201088, 2880),
];

fn kernels(c: &mut Criterion) {
    for tokens in [1usize, 8, 64] {
        let name = match tokens {
            1 => "matvec".to_string(),
            t => format!("prefill{t}"),
        };
        let mut group = c.benchmark_group(name);
        group.sample_size(10);
        // Experts see a few of a prompt's tokens each; 64 tokens go through the dense layers.
        let expert_shapes = if tokens > 8 {
            &[][..]
        } else {
            &EXPERT_SHAPES[..]
        };
        for &(shape, rows, cols) in expert_shapes {
            let w = mxfp4_expert(rows, cols);
            let x = input(tokens * cols);
            let mut y = vec![0f32; tokens * rows];
            group.throughput(Throughput::Bytes(
                (rows * cols / 2 + rows * cols / 32) as u64,
            ));
            group.bench_function(BenchmarkId::new(shape, tokens), |b| {
                b.iter(|| mxfp4_matmul(&w, 0, &x, None, &mut y))
            });
            // The layout the CPU tier gives experts at load where the CPU has a kernel for it
            // (AVX-512 VBMI): whole runs interleaved.
            if let Some(interleaved) =
                picchio::cpu::layout::interleaved_copy(&w).expect("an interleaved copy")
            {
                let interleaved_shape = shape.replace("mxfp4", "mxfp4_interleaved");
                group.bench_function(BenchmarkId::new(interleaved_shape, tokens), |b| {
                    b.iter(|| mxfp4_matmul(&interleaved, 0, &x, None, &mut y))
                });
            }
            // The same expert with 8-bit inputs (`--expert-activations q8`).
            let q8_shape = shape.replace("mxfp4", "mxfp4_q8_inputs");
            group.bench_function(BenchmarkId::new(q8_shape, tokens), |b| {
                b.iter(|| mxfp4_q8_matmul(&w, 0, &x, None, &mut y))
            });
        }
        for (shape, rows, cols) in DENSE_SHAPES {
            if tokens > 1 && rows > 100_000 {
                continue; // the LM head runs for the last position only
            }
            let w = bf16_matrix(rows, cols);
            let x = input(tokens * cols);
            let mut y = vec![0f32; tokens * rows];
            group.throughput(Throughput::Bytes((rows * cols * 2) as u64));
            group.bench_function(BenchmarkId::new(shape, tokens), |b| {
                b.iter(|| dense_matmul(&w, &x, None, &mut y))
            });
        }
        group.finish();
    }
    let mut group = c.benchmark_group("q8");
    group.sample_size(10);
    for (shape, rows, cols) in DENSE_SHAPES {
        let w = Q8Matrix::quantize(&bf16_matrix(rows, cols), shape).unwrap();
        let x = input(cols);
        let mut y = vec![0f32; rows];
        group.throughput(Throughput::Bytes(w.bytes() as u64));
        group.bench_function(shape.replace("bf16", "q8"), |b| {
            b.iter(|| q8_matmul(&w, &x, None, &mut y))
        });
    }
    group.finish();
}

/// One decoded position's attention over a layer's cache of every position (as a full-attention
/// layer holds it), as `Model::attention` calls it (there each group is a task of its own).
fn attention(c: &mut Criterion) {
    let config = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/configs/gpt-oss-20b.config.json");
    let cfg = Config::load_file(&config).expect("the GPT-OSS-20B config in fixtures/configs");
    let layout = HeadLayout {
        num_heads: cfg.num_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
    };
    let width = layout.heads_per_kv_head() * cfg.head_dim;
    let q: Vec<f32> = input(cfg.q_dim() + 7)[7..].to_vec();
    let sinks = input(cfg.num_heads);
    let scaling = (cfg.head_dim as f32).powf(-0.5);
    let mut group = c.benchmark_group("attention");
    group.sample_size(20);
    for positions in [128usize, 1024, 4096] {
        // Layer 0 only: the others stay empty.
        let mut cache = KvCache::keeping_all(&cfg, positions);
        let keys = input(positions * cfg.kv_dim());
        let values: Vec<f32> = keys.iter().rev().copied().collect();
        cache.store(0, &keys, &values);
        cache.advance(positions);
        let mut out = vec![0f32; cfg.q_dim()];
        // Keys and values read per position: 8 kv heads of 64, 4 bytes each.
        group.throughput(Throughput::Bytes((2 * positions * cfg.kv_dim() * 4) as u64));
        group.bench_function(BenchmarkId::new("gpt_oss_20b_layer", positions), |b| {
            b.iter(|| {
                for (g, out) in out.chunks_exact_mut(width).enumerate() {
                    let head = |j: usize| cache.get(0, j, g);
                    attend_group(
                        layout,
                        g,
                        &q,
                        0..=positions - 1,
                        &head,
                        Some(&sinks),
                        scaling,
                        out,
                    );
                }
            })
        });
    }
    group.finish();
}

criterion_group!(benches, kernels, attention);
criterion_main!(benches);
