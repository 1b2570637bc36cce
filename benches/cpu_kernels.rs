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
//! - `mxfp4_q8_inputs_*` in `matvec` and `prefill8`: the experts with `--expert-activations q8`.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use picchio::cpu::matmul::{dense_matmul, mxfp4_matmul, mxfp4_q8_matmul};
use picchio::cpu::q8::{Q8Matrix, q8_matmul};
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

criterion_group!(benches, kernels);
criterion_main!(benches);
