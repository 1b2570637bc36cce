//! The adapter's own read bandwidth: the roofline a decoded token on the GPU tier is judged
//! against (a batch-1 decode reads every weight it uses once, so its limit is this speed).
//!
//! A kernel reads buffers larger together than any GPU's caches, coalesced, in 16-byte words,
//! several passes per submission so that submission and wait overheads stay small next to the
//! reads; the best of a few submissions counts.

use std::time::Instant;

use super::GpuContext;
use super::kernels::{Dispatch, u32_of};
use crate::error::Result;

/// Bytes read per pass: past the largest last-level caches GPUs have (up to 128 MiB).
const PROBE_BYTES: u64 = 512 << 20;
/// Passes over the probe's buffers per submission.
pub const PASSES: usize = 4;
/// Submissions timed; the fastest counts.
pub const ROUNDS: usize = 5;
/// Invocations in the grid (each reads every `LANES`-th word).
const LANES: usize = 64 * 1024;

/// What a measurement found.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct GpuBandwidth {
    pub bytes_per_s: f64,
    /// Bytes one pass read (the probe's buffers together).
    pub buffer_bytes: u64,
}

/// A read of every 16-byte word of `data` (`bytes` long), xor-folded per lane into `folded`
/// (`LANES` words).
pub fn prepare_read(
    ctx: &GpuContext,
    data: &wgpu::Buffer,
    bytes: u64,
    folded: &wgpu::Buffer,
) -> Result<Dispatch> {
    let groups_x = u32_of(LANES / 256, "workgroups")?;
    let words = u32_of((bytes / 16) as usize, "words")?;
    let params = [words, groups_x, u32_of(LANES, "lanes")?, 0];
    ctx.prepare(
        "bandwidth.wgsl",
        "read_all",
        &[],
        &params,
        &[data, folded],
        [groups_x, 1, 1],
    )
}

/// The xor-fold `prepare_read` computes, on the host (what the kernel's test compares with).
pub fn fold_on_host(words: &[u32]) -> Vec<u32> {
    let mut folded = vec![0u32; LANES];
    for (i, word) in words.chunks_exact(4).enumerate() {
        folded[i % LANES] ^= word[0] ^ word[1] ^ word[2] ^ word[3];
    }
    folded
}

/// Measures the adapter's read bandwidth (about 10 GB read; a fraction of a second on a GPU).
pub fn measure(ctx: &GpuContext) -> Result<GpuBandwidth> {
    // Buffers of at most one binding each, 16-byte words, filled with a pattern (never zero:
    // some memory systems compress it).
    let piece = ctx.max_binding_bytes.min(PROBE_BYTES) / 16 * 16;
    let count = PROBE_BYTES.div_ceil(piece) as usize;
    let pattern: Vec<u32> = (0..piece / 4)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761) | 1)
        .collect();
    let buffers: Vec<wgpu::Buffer> = (0..count)
        .map(|_| ctx.try_upload("bandwidth probe", bytemuck::cast_slice(&pattern)))
        .collect::<Result<_>>()?;
    drop(pattern);
    let folded = ctx.zeroed("bandwidth probe folds", (LANES * 4) as u64)?;
    let reads: Vec<Dispatch> = buffers
        .iter()
        .map(|data| prepare_read(ctx, data, piece, &folded))
        .collect::<Result<_>>()?;
    let passes: Vec<&Dispatch> = (0..PASSES).flat_map(|_| &reads).collect();
    let submit = || -> Result<f64> {
        let started = Instant::now();
        ctx.run(&passes)?;
        Ok(started.elapsed().as_secs_f64())
    };
    submit()?; // warm-up: pipelines, first touch of the pages
    let mut best = f64::INFINITY;
    for _ in 0..ROUNDS {
        best = best.min(submit()?);
    }
    let buffer_bytes = piece * count as u64;
    Ok(GpuBandwidth {
        bytes_per_s: (buffer_bytes * PASSES as u64) as f64 / best,
        buffer_bytes,
    })
}
