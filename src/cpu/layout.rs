//! Layouts the CPU tier's kernels prefer, made by the CPU tier from the checkpoint's bytes (the
//! checkpoint reader knows no kernels).

use rayon::prelude::*;

use crate::weights::{ExpertStride, Mxfp4Experts};

/// A copy of `experts` in memory (huge pages) with every expert's whole runs interleaved for the
/// CPU tier's kernel (`simd::interleave_mxfp4_runs`: the same results from fewer shuffles per
/// weight); None where this process runs no kernel over interleaved runs, or the experts do not
/// lie one after the other. The GPU tier cannot read the copy (`Mxfp4Experts::interleaved`).
pub fn interleaved_copy(experts: &Mxfp4Experts) -> std::io::Result<Option<Mxfp4Experts>> {
    let contiguous = matches!(experts.stride, ExpertStride::Contiguous);
    if experts.interleaved || !contiguous || super::simd::mxfp4_interleaved_dot().is_none() {
        return Ok(None);
    }
    let scales = experts.scales.copy_to_memory()?;
    let groups = experts.cols / 32;
    // Every expert's rows lie back to back: interleaved in chunks of rows, in parallel.
    const ROWS: usize = 1024;
    let blocks = experts.blocks.copy_to_memory_then(|bytes| {
        bytes
            .par_chunks_mut(ROWS * 16 * groups)
            .zip(scales.bytes().par_chunks(ROWS * groups))
            .for_each(|(packed, scales)| {
                super::simd::interleave_mxfp4_runs(packed, scales, experts.cols);
            });
    })?;
    Ok(Some(Mxfp4Experts {
        blocks,
        scales,
        interleaved: true,
        ..experts.clone()
    }))
}
