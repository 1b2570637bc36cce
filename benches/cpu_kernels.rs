//! CPU kernel throughput on GPT-OSS-20B's real shapes (random weights).
//! `cargo bench --bench cpu_kernels`; criterion reports time and bytes/s per kernel.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use picchio::cpu::matmul::{dense_matmul, mxfp4_matmul};
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

fn kernels(c: &mut Criterion) {
    let mut group = c.benchmark_group("matvec");
    group.sample_size(10);
    for (name, rows, cols) in [
        ("mxfp4_5760x2880", 5760, 2880),
        ("mxfp4_2880x2880", 2880, 2880),
    ] {
        let w = mxfp4_expert(rows, cols);
        let x = input(cols);
        let mut y = vec![0f32; rows];
        group.throughput(Throughput::Bytes(
            (rows * cols / 2 + rows * cols / 32) as u64,
        ));
        group.bench_function(name, |b| b.iter(|| mxfp4_matmul(&w, 0, &x, None, &mut y)));
    }
    for (name, rows, cols) in [
        ("bf16_4096x2880", 4096, 2880),
        ("bf16_lm_head_201088x2880", 201088, 2880),
    ] {
        let w = bf16_matrix(rows, cols);
        let x = input(cols);
        let mut y = vec![0f32; rows];
        group.throughput(Throughput::Bytes((rows * cols * 2) as u64));
        group.bench_function(name, |b| b.iter(|| dense_matmul(&w, &x, None, &mut y)));
    }
    group.finish();
}

criterion_group!(benches, kernels);
criterion_main!(benches);
