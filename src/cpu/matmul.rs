//! Matrix-vector and matrix-matrix products over the checkpoint's own formats, f32 accumulation.
//!
//! `out[t][r] = dot(row r, x[t]) + bias[r]`. Every (row, token) product calls the same dot
//! function, so a batch of tokens gives exactly the values one token at a time gives.

use rayon::prelude::*;

use crate::formats::{FP4_VALUES, bf16_to_f32, e8m0_scale, f16_to_f32};
use crate::weights::{
    DenseExperts, DenseMatrix, ExpertMatrices, FloatFormat, Int4Experts, Mxfp4Experts, RowExperts,
};

const LANES: usize = 8;

/// Weight bytes one parallel task reads for a single token (decode), at least: enough to
/// outweigh its scheduling, few enough that the threads finish a call together (the last task
/// runs alone); bf16 projections read faster 16 rows at a time than 64. Each task is its own
/// rayon job (`with_max_len(1)`): left to split adaptively, rayon could run a large share of a
/// call as one piece the other thread could not share, which then waited at the end of the call.
const DECODE_TASK_BYTES: usize = 96 << 10;

/// Tasks per thread a large decode call is cut into: a matrix as large as the LM head (1.16 GB)
/// reads faster in tasks of a MiB or more than in `DECODE_TASK_BYTES` ones.
const DECODE_TASKS_PER_THREAD: usize = 128;

/// Rows of `row_bytes` each that one decode task of a `rows`-row matrix computes: a
/// `DECODE_TASKS_PER_THREAD` share of the matrix, between `DECODE_TASK_BYTES` and 16 times
/// that, and a multiple of four rows (a packed task splits them between its two streams).
fn decode_rows_per_task(rows: usize, row_bytes: usize) -> usize {
    let share = rows * row_bytes / (DECODE_TASKS_PER_THREAD * rayon::current_num_threads());
    let bytes = share.clamp(DECODE_TASK_BYTES, 16 * DECODE_TASK_BYTES);
    (bytes / row_bytes.max(1) / 4 * 4).max(4)
}

/// `acc[i] += x[i]`.
pub(crate) fn add_into(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

#[inline(always)]
fn reduce(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]))
}

/// Dot product of one dense row (stored in `format`) with `x`: the SIMD kernel where this CPU
/// has one, else the scalar reference.
pub fn dot_dense(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
    super::simd::float_dot(super::simd::kernels())(format, row, x)
}

/// The scalar reference of `dot_dense`.
pub fn dot_dense_scalar(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
    let size = format.size();
    debug_assert_eq!(row.len(), x.len() * size);
    let mut acc = [0f32; LANES];
    let chunks = x.len() / LANES;
    for c in 0..chunks {
        let xs = &x[c * LANES..(c + 1) * LANES];
        let ws = &row[c * LANES * size..(c + 1) * LANES * size];
        for k in 0..LANES {
            acc[k] += decode_at(format, ws, k) * xs[k];
        }
    }
    let mut sum = reduce(acc);
    for (k, xk) in x.iter().enumerate().skip(chunks * LANES) {
        sum += decode_at(format, row, k) * xk;
    }
    sum
}

/// Value `k` of a stored float row.
#[inline(always)]
pub(crate) fn decode_at(format: FloatFormat, bytes: &[u8], k: usize) -> f32 {
    match format {
        FloatFormat::Bf16 => bf16_to_f32(bytes[2 * k], bytes[2 * k + 1]),
        FloatFormat::F16 => f16_to_f32(bytes[2 * k], bytes[2 * k + 1]),
        FloatFormat::F32 => f32::from_le_bytes([
            bytes[4 * k],
            bytes[4 * k + 1],
            bytes[4 * k + 2],
            bytes[4 * k + 3],
        ]),
    }
}

/// Dot product of one MXFP4 row (16 bytes + 1 scale per 32 inputs) with `x`: the SIMD kernel
/// where this CPU has one, else the scalar reference.
pub fn dot_mxfp4(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    packed_dot(
        super::simd::mxfp4_dot(super::simd::kernels()),
        blocks,
        scales,
        x,
    )
}

/// `kernel`'s dot product of one packed row with `x` in natural order.
fn packed_dot(kernel: super::simd::PackedDot, packed: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut split = super::simd::AlignedFloats::default();
    (kernel.dot)(
        packed,
        scales,
        kernel.input_order.arrange(x, x.len(), &mut split),
    )
}

/// The scalar reference of `dot_mxfp4`.
pub fn dot_mxfp4_scalar(blocks: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(blocks.len() * 2, x.len());
    let mut total = 0f32;
    for (g, (group, &scale)) in blocks.chunks_exact(16).zip(scales).enumerate() {
        let xs = &x[g * 32..(g + 1) * 32];
        let mut acc = [0f32; LANES];
        for (j, &byte) in group.iter().enumerate() {
            let lane = (2 * j) % LANES;
            acc[lane] += FP4_VALUES[(byte & 0x0F) as usize] * xs[2 * j];
            acc[lane + 1] += FP4_VALUES[(byte >> 4) as usize] * xs[2 * j + 1];
        }
        // Scaling by a power of two is exact, so this equals the dot with dequantized weights
        // up to the order of the additions.
        total += reduce(acc) * e8m0_scale(scale);
    }
    total
}

/// Dot product of one group-scaled INT4 row (16 bytes + one f16 scale per 32 inputs) with `x`:
/// the SIMD kernel where this CPU has one, else the scalar reference.
pub fn dot_int4(qweight: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    packed_dot(
        super::simd::int4_dot(super::simd::kernels()),
        qweight,
        scales,
        x,
    )
}

/// The scalar reference of `dot_int4`.
pub fn dot_int4_scalar(qweight: &[u8], scales: &[u8], x: &[f32]) -> f32 {
    let mut total = 0f32;
    for (g, (group, scale)) in qweight
        .chunks_exact(16)
        .zip(scales.chunks_exact(2))
        .enumerate()
    {
        let xs = &x[g * 32..(g + 1) * 32];
        let mut acc = [0f32; LANES];
        for (j, &byte) in group.iter().enumerate() {
            let lane = (2 * j) % LANES;
            acc[lane] += ((byte & 0x0F) as i32 - 8) as f32 * xs[2 * j];
            acc[lane + 1] += ((byte >> 4) as i32 - 8) as f32 * xs[2 * j + 1];
        }
        total += reduce(acc) * f16_to_f32(scale[0], scale[1]);
    }
    total
}

/// Rows `rows` times every input: `out[(r - rows.start) * inputs.len() + t]`.
pub(crate) type Tile<'a, I> = &'a (dyn Fn(std::ops::Range<usize>, &[I], &mut [f32]) + Sync);

/// A `Tile` of f32 inputs (of any lifetime).
pub(crate) type FloatInputsTile<'a> =
    &'a (dyn Fn(std::ops::Range<usize>, &[&[f32]], &mut [f32]) + Sync);

/// `out[t * rows + r] = dot(r, xs[t * cols..]) + bias[r]` for every token `t`, rows in
/// parallel.
/// `dot_each(r, inputs, sums)` writes row r's dot product with each input (the kernels decode
/// the row once for all inputs, each result bit-identical to a one-input call); `tile`, where a
/// kernel has one, does the same for `TILE_ROWS` rows at a time, cache-blocked.
pub(crate) fn rows_times_tokens(
    (rows, cols): (usize, usize),
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    dot_each: impl Fn(usize, &[&[f32]], &mut [f32]) + Sync,
    tile: Option<FloatInputsTile>,
) {
    let tokens = xs.len() / cols;
    assert_eq!(
        xs.len(),
        tokens * cols,
        "input is not a whole number of rows"
    );
    // On a cache line (each row too when `cols` is a multiple of 16): see `AlignedFloats`.
    let mut aligned = super::simd::AlignedFloats::default();
    let xs = super::simd::InputOrder::Natural.arrange(xs, cols, &mut aligned);
    let inputs: Vec<&[f32]> = xs.chunks_exact(cols).collect();
    rows_times_inputs(rows, &inputs, bias, out, dot_each, tile);
}

/// `rows_times_tokens` over inputs of any kind (f32 rows, or quantized ones): `out[t * rows + r]
/// = dot(r, inputs[t]) + bias[r]`. One token goes the same way, but every caller routes decode
/// through its kernel's rows form instead (`dense_decode`, `in_two_streams`).
pub(crate) fn rows_times_inputs<I: Sync>(
    rows: usize,
    inputs: &[I],
    bias: Option<&[f32]>,
    out: &mut [f32],
    dot_each: impl Fn(usize, &[I], &mut [f32]) + Sync,
    tile: Option<Tile<I>>,
) {
    let tokens = inputs.len();
    assert_eq!(out.len(), tokens * rows, "output has the wrong size");
    if let Some(b) = bias {
        assert_eq!(b.len(), rows, "bias has the wrong size");
    }
    // Each row's weights are read (and decoded) once for all tokens.
    let mut by_row = vec![0f32; rows * tokens];
    let tile_rows = super::simd::TILE_ROWS;
    by_row
        .par_chunks_mut(tile_rows * tokens)
        .enumerate()
        .with_max_len(1) // As in decode (`DECODE_TASK_BYTES`): no unsplittable long pieces.
        .for_each(|(i, ys)| {
            let first = i * tile_rows;
            let count = ys.len() / tokens;
            match tile {
                Some(tile) => tile(first..first + count, inputs, ys),
                None => {
                    for (r, sums) in (first..).zip(ys.chunks_exact_mut(tokens)) {
                        dot_each(r, inputs, sums);
                    }
                }
            }
        });
    // Back to one row of outputs per token, the bias added on the way (the same addition as a
    // pass of its own, one pass fewer over `by_row`), in parallel over blocks of tokens: each
    // block reads `by_row` a few adjacent values per row (one pass over it by one thread kept
    // the other threads idle for a noticeable share of a long prefill).
    const TOKENS_PER_BLOCK: usize = 16;
    out.par_chunks_mut(rows * TOKENS_PER_BLOCK)
        .enumerate()
        .for_each(|(block, out)| {
            let first = block * TOKENS_PER_BLOCK;
            let mut token_rows: Vec<&mut [f32]> = out.chunks_exact_mut(rows).collect();
            let count = token_rows.len();
            for (r, sums) in by_row.chunks_exact(tokens).enumerate() {
                let b = bias.map_or(0.0, |b| b[r]);
                for (token_row, &sum) in token_rows.iter_mut().zip(&sums[first..first + count]) {
                    token_row[r] = sum + b;
                }
            }
        });
}

/// Dense linear layer over one or more tokens.
pub fn dense_matmul(m: &DenseMatrix, xs: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    dense_matmul_using(m, xs, bias, out, super::simd::amx_tiles())
}

/// `dense_matmul`, with AMX tiles for bf16 rows over several tokens where `amx` (which the
/// caller has checked: `amx::usable()`).
fn dense_matmul_using(
    m: &DenseMatrix,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    amx: bool,
) {
    if xs.len() == m.cols {
        dense_decode(m, xs, bias, out);
        return;
    }
    let dot_each = super::simd::float_dot_each(super::simd::kernels());
    let float_tile = super::simd::float_tile(super::simd::kernels());
    // Over several tokens, bf16 rows go through AMX tiles where the CPU has them.
    #[cfg(target_arch = "x86_64")]
    let split =
        (amx && xs.len() > m.cols && m.format == FloatFormat::Bf16 && m.cols.is_multiple_of(32))
            .then(|| super::simd::amx::SplitInputs::new(xs, m.cols));
    #[cfg(not(target_arch = "x86_64"))]
    let _ = amx;
    let tile = |rows: std::ops::Range<usize>, inputs: &[&[f32]], sums: &mut [f32]| {
        #[cfg(target_arch = "x86_64")]
        if let Some(split) = &split
            && rows.len() == super::simd::amx::ROWS
        {
            let width = m.cols * m.format.size();
            let bytes = &m.data.bytes()[rows.start * width..rows.end * width];
            // Safety: `split` exists only where `amx`, which the caller checked with
            // `amx::usable()`.
            unsafe { super::simd::amx::rows16(bytes, split, sums) };
            return;
        }
        let rows: Vec<&[u8]> = rows.map(|r| m.row(r)).collect();
        float_tile(m.format, &rows, inputs, sums)
    };
    rows_times_tokens(
        (m.rows, m.cols),
        xs,
        bias,
        out,
        |r, inputs, sums| dot_each(m.format, m.row(r), inputs, sums),
        Some(&tile),
    );
}

/// `dense_matmul` of one token (decode): each task a chunk of consecutive rows through the
/// kernel's `FloatRows` (several rows' sums in flight), the bias added while the sums are in this
/// core's cache.
fn dense_decode(m: &DenseMatrix, x: &[f32], bias: Option<&[f32]>, out: &mut [f32]) {
    assert_eq!(out.len(), m.rows, "output has the wrong size");
    if let Some(b) = bias {
        assert_eq!(b.len(), m.rows, "bias has the wrong size");
    }
    // On a cache line: see `AlignedFloats`.
    let mut aligned = super::simd::AlignedFloats::default();
    let x = super::simd::InputOrder::Natural.arrange(x, m.cols, &mut aligned);
    let float_rows = super::simd::float_rows(super::simd::kernels());
    let width = m.cols * m.format.size();
    let rows_per_task = decode_rows_per_task(m.rows, width);
    out.par_chunks_mut(rows_per_task)
        .enumerate()
        .with_max_len(1) // See `DECODE_TASK_BYTES`.
        .for_each(|(chunk, ys)| {
            let first = chunk * rows_per_task;
            let bytes = &m.data.bytes()[first * width..(first + ys.len()) * width];
            float_rows(m.format, bytes, x, ys);
            if let Some(bias) = bias {
                add_into(ys, &bias[first..]);
            }
        });
}

/// One expert's MXFP4 linear layer over one or more tokens.
pub fn mxfp4_matmul(
    w: &Mxfp4Experts,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let kernel = if w.interleaved {
        super::simd::mxfp4_interleaved_dot()
            .expect("experts are interleaved only where their kernel runs")
    } else {
        super::simd::mxfp4_dot(super::simd::kernels())
    };
    let shape = (w.rows, w.cols, packed_row_bytes(w.cols));
    packed_matmul(kernel, shape, xs, bias, out, |rows| w.rows_of(expert, rows));
}

/// One expert's MXFP4 linear layer over one or more tokens with each input quantized to 8 bits
/// per 32 values (`cpu::q8_activations`: faster, not exact).
pub fn mxfp4_q8_matmul(
    w: &Mxfp4Experts,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    use super::q8_activations::{Q8Input, q8_kernel};
    assert!(
        !w.interleaved,
        "the 8-bit input kernels read MXFP4 experts in the checkpoint's layout"
    );
    let kernel = q8_kernel(super::simd::kernels());
    assert!(
        xs.len().is_multiple_of(w.cols),
        "input is not a whole number of rows"
    );
    let inputs: Vec<Q8Input> = xs.chunks_exact(w.cols).map(Q8Input::quantize).collect();
    let shape = (w.rows, packed_row_bytes(w.cols));
    let rows_of = |rows| w.rows_of(expert, rows);
    if let [x] = &inputs[..] {
        let rows_pair = |runs, outs: [&mut [f32]; 2]| (kernel.rows)(runs, x, outs);
        in_two_streams(shape, bias, out, rows_of, rows_pair);
        return;
    }
    let inputs: Vec<&Q8Input> = inputs.iter().collect();
    let dot_each = |r: usize, inputs: &[&Q8Input], sums: &mut [f32]| {
        let (packed, scales) = rows_of(r..r + 1);
        (kernel.dot_each)(packed, scales, inputs, sums)
    };
    rows_times_inputs(w.rows, &inputs, bias, out, dot_each, None);
}

/// One expert's group-scaled INT4 linear layer over one or more tokens.
pub fn int4_matmul(
    w: &Int4Experts,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let kernel = super::simd::int4_dot(super::simd::kernels());
    let shape = (w.rows, w.cols, packed_row_bytes(w.cols));
    packed_matmul(kernel, shape, xs, bias, out, |rows| w.rows_of(expert, rows));
}

/// Bytes of one packed 4-bit row of `cols` weights: half a byte each, and a scale byte (MXFP4;
/// INT4's are two) per group of 32.
fn packed_row_bytes(cols: usize) -> usize {
    cols / 2 + cols / 32
}

/// A linear layer of rows of groups with a scale each (4-bit, or q8): the input rearranged once
/// for `kernel`, then every row. `rows_of(range)` gives those rows' bytes and scales, back to
/// back; a row is `row_bytes` of them in all.
pub(crate) fn packed_matmul<'w>(
    kernel: super::simd::PackedDot,
    (rows, cols, row_bytes): (usize, usize, usize),
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
    rows_of: impl Fn(std::ops::Range<usize>) -> (&'w [u8], &'w [u8]) + Sync,
) {
    let mut split = super::simd::AlignedFloats::default();
    let input = kernel.input_order.arrange(xs, cols, &mut split);
    if xs.len() == cols && out.len() == rows {
        let rows_pair = |runs, outs: [&mut [f32]; 2]| (kernel.rows)(runs, input, outs);
        in_two_streams((rows, row_bytes), bias, out, rows_of, rows_pair);
        return;
    }
    let row = |r: usize| rows_of(r..r + 1);
    let tile = |rows: std::ops::Range<usize>, inputs: &[&[f32]], sums: &mut [f32]| {
        let rows: Vec<(&[u8], &[u8])> = rows.map(row).collect();
        (kernel.tile)(&rows, inputs, sums)
    };
    rows_times_tokens(
        (rows, cols),
        input,
        bias,
        out,
        |r, inputs, sums| {
            let (packed, scales) = row(r);
            (kernel.dot_each)(packed, scales, inputs, sums)
        },
        Some(&tile),
    );
}

/// Decode of a matrix of groups with scales (packed 4-bit, or q8): `out[r] = row r . x + bias[r]`,
/// where `rows_pair(runs, outs)` computes two runs of consecutive rows (`rows_of(range)`) side by
/// side. Each task takes a chunk of the first half of the rows and the same chunk of the second
/// half, and the kernel reads them side by side: two streams from memory, far apart, which keep
/// more reads in flight than rows read in adjacent pairs.
fn in_two_streams<'w>(
    (rows, row_bytes): (usize, usize),
    bias: Option<&[f32]>,
    out: &mut [f32],
    rows_of: impl Fn(std::ops::Range<usize>) -> (&'w [u8], &'w [u8]) + Sync,
    rows_pair: impl Fn([super::simd::RowBytes<'w>; 2], [&mut [f32]; 2]) + Sync,
) {
    assert_eq!(out.len(), rows, "output has the wrong size");
    if let Some(b) = bias {
        assert_eq!(b.len(), rows, "bias has the wrong size");
    }
    let half = rows / 2;
    let per_task = (decode_rows_per_task(rows, row_bytes) / 2).max(1);
    let (first_half, second_half) = out.split_at_mut(half);
    let (second_half, last) = second_half.split_at_mut(half);
    first_half
        .par_chunks_mut(per_task)
        .zip(second_half.par_chunks_mut(per_task))
        .enumerate()
        .with_max_len(1) // See `DECODE_TASK_BYTES`.
        .for_each(|(chunk, (a, b))| {
            let first = chunk * per_task;
            let runs = [
                rows_of(first..first + a.len()),
                rows_of(half + first..half + first + b.len()),
            ];
            rows_pair(runs, [&mut *a, &mut *b]);
            // Here, while the sums are in this core's cache: added afterwards by one thread,
            // the biases took a noticeable share of the experts' decode time.
            if let Some(bias) = bias {
                add_into(a, &bias[first..]);
                add_into(b, &bias[half + first..]);
            }
        });
    // An odd row count leaves the last row without a partner.
    rows_pair(
        [rows_of(2 * half..rows), rows_of(rows..rows)],
        [&mut *last, &mut []],
    );
    if let Some(bias) = bias {
        add_into(last, &bias[2 * half..]);
    }
}

/// Unquantized expert `e` in `[in, out]` orientation: `y = x @ W[e] + bias`, summing over the
/// inputs in ascending order (output columns in parallel).
pub fn dense_expert_matmul(
    w: &DenseExperts,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    const COLUMNS: usize = 256;
    for (x, y) in xs
        .chunks_exact(w.inputs)
        .zip(out.chunks_exact_mut(w.outputs))
    {
        y.par_chunks_mut(COLUMNS)
            .enumerate()
            .for_each(|(chunk, ys)| {
                let first = chunk * COLUMNS;
                ys.fill(0.0);
                for (i, xi) in x.iter().enumerate() {
                    let row = w.input_row(expert, i);
                    for (k, yk) in ys.iter_mut().enumerate() {
                        *yk += xi * decode_at(w.format, row, first + k);
                    }
                }
                if let Some(b) = bias {
                    for (yk, bk) in ys.iter_mut().zip(&b[first..]) {
                        *yk += bk;
                    }
                }
            });
    }
}

/// One expert's projection over one or more tokens with MXFP4 experts' inputs as `activations`
/// says (the other formats are always exact).
pub fn expert_matmul_as(
    activations: super::q8_activations::ExpertActivations,
    w: &ExpertMatrices,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    match (w, activations) {
        (ExpertMatrices::Mxfp4(m), super::q8_activations::ExpertActivations::Q8) => {
            mxfp4_q8_matmul(m, expert, xs, bias, out)
        }
        _ => expert_matmul(w, expert, xs, bias, out),
    }
}

/// One expert's projection over one or more tokens, whatever the checkpoint's expert format.
pub fn expert_matmul(
    w: &ExpertMatrices,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    match w {
        ExpertMatrices::Mxfp4(m) => mxfp4_matmul(m, expert, xs, bias, out),
        ExpertMatrices::Int4(m) => int4_matmul(m, expert, xs, bias, out),
        ExpertMatrices::Dense(d) => dense_expert_matmul(d, expert, xs, bias, out),
        ExpertMatrices::Rows(r) => row_expert_matmul(r, expert, xs, bias, out),
    }
}

/// Float expert `e` in `[out, in]` orientation (`y = W[e] x + bias`): each of its row blocks is a
/// dense matrix product, the blocks' outputs side by side in each token's row.
pub fn row_expert_matmul(
    w: &RowExperts,
    expert: usize,
    xs: &[f32],
    bias: Option<&[f32]>,
    out: &mut [f32],
) {
    let blocks = w.matrices(expert);
    if let [whole] = &blocks[..] {
        return dense_matmul(whole, xs, bias, out);
    }
    let tokens = xs.len() / w.cols;
    let mut first = 0;
    for block in &blocks {
        let mut part = vec![0f32; tokens * block.rows];
        let bias = bias.map(|b| &b[first..first + block.rows]);
        dense_matmul(block, xs, bias, &mut part);
        for (row, part) in out
            .chunks_exact_mut(w.rows)
            .zip(part.chunks_exact(block.rows))
        {
            row[first..first + block.rows].copy_from_slice(part);
        }
        first += block.rows;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::dequantize_mxfp4_row;

    #[test]
    fn mxfp4_dot_matches_dequantized_dot() {
        let blocks: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
        let scales = [120u8, 126, 127, 131];
        let x: Vec<f32> = (0..128).map(|i| ((i as f32) * 0.37).sin()).collect();
        let mut w = vec![0f32; 128];
        dequantize_mxfp4_row(&blocks, &scales, &mut w);
        let exact: f64 = w.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
        let got = dot_mxfp4(&blocks, &scales, &x) as f64;
        assert!(
            (got - exact).abs() <= 1e-5 * exact.abs().max(1.0),
            "{got} vs {exact}"
        );
    }

    /// `experts` MXFP4 experts of `[rows, cols]` with packed byte i = `i * step + offset` and scale
    /// byte i = `base + i % spread`: every code, scales a few powers of two apart.
    fn patterned_mxfp4_experts(
        experts: usize,
        (rows, cols): (usize, usize),
        (step, offset): (usize, usize),
        (base, spread): (u8, usize),
    ) -> Mxfp4Experts {
        let blocks: Vec<u8> = (0..experts * rows * cols / 2)
            .map(|i| (i * step + offset) as u8)
            .collect();
        let scales: Vec<u8> = (0..experts * rows * cols / 32)
            .map(|i| base + (i % spread) as u8)
            .collect();
        Mxfp4Experts::contiguous(
            experts,
            (rows, cols),
            crate::weights::TensorBytes::from_vec(blocks),
            crate::weights::TensorBytes::from_vec(scales),
        )
    }

    #[test]
    fn q8_activation_matmul_is_each_rows_dot_plus_bias_in_decode_and_prefill() {
        use crate::cpu::q8_activations::{Q8Input, q8_kernel};
        // An odd row count (the decode's two streams leave one row over) and three groups per
        // row (one partial run).
        let (rows, cols) = (37, 96);
        let mx = patterned_mxfp4_experts(2, (rows, cols), (73, 11), (118, 7));
        let tokens = 5;
        let xs: Vec<f32> = (0..tokens * cols)
            .map(|i| ((i as f32) * 0.37).sin())
            .collect();
        let bias: Vec<f32> = (0..rows).map(|r| r as f32 * 0.03 - 0.5).collect();
        let kernel = q8_kernel(crate::cpu::simd::kernels());
        let e = 1;
        let mut prefill = vec![0f32; tokens * rows];
        mxfp4_q8_matmul(&mx, e, &xs, Some(&bias), &mut prefill);
        for (t, x) in xs.chunks_exact(cols).enumerate() {
            let mut decode = vec![0f32; rows];
            mxfp4_q8_matmul(&mx, e, x, Some(&bias), &mut decode);
            let input = Q8Input::quantize(x);
            for r in 0..rows {
                let (packed, scales) = mx.row(e, r);
                let want = (kernel.dot)(packed, scales, &input) + bias[r];
                for (what, got) in [("decode", decode[r]), ("prefill", prefill[t * rows + r])] {
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{what} token {t} row {r}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn unquantized_experts_match_mxfp4_experts() {
        // Two experts of [rows=40, cols=64] in MXFP4, and the same values as f32 [E, in, out].
        let (experts, rows, cols) = (2, 40, 64);
        let mx = patterned_mxfp4_experts(experts, (rows, cols), (89, 7), (120, 5));
        let mut transposed = vec![0f32; experts * cols * rows];
        for e in 0..experts {
            for r in 0..rows {
                let (b, s) = mx.row(e, r);
                let mut values = vec![0f32; cols];
                dequantize_mxfp4_row(b, s, &mut values);
                for (i, v) in values.iter().enumerate() {
                    transposed[(e * cols + i) * rows + r] = *v;
                }
            }
        }
        let dense = DenseExperts {
            experts,
            inputs: cols,
            outputs: rows,
            format: FloatFormat::F32,
            data: crate::weights::TensorBytes::from_vec(
                transposed.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
        };
        let xs: Vec<f32> = (0..3 * cols).map(|i| ((i as f32) * 0.41).cos()).collect();
        let bias: Vec<f32> = (0..rows).map(|r| r as f32 * 0.01).collect();
        for e in 0..experts {
            let (mut a, mut b) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
            mxfp4_matmul(&mx, e, &xs, Some(&bias), &mut a);
            dense_expert_matmul(&dense, e, &xs, Some(&bias), &mut b);
            for (k, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                    "expert {e} value {k}: {x} vs {y}"
                );
            }
        }
    }

    /// Random values with full significands, sizes 2^(-spread/2) to 2^(spread/2), either sign.
    fn random_values(seed: u64, spread: i32) -> impl FnMut() -> f32 {
        let mut state = seed;
        move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let size = (state >> 40) as i32 % spread - spread / 2;
            let sign = if state & 1 == 0 { 1.0 } else { -1.0 };
            sign * (1.0 + (state >> 8 & 0x7f_ffff) as f32 / 8_388_608.0) * 2f32.powi(size)
        }
    }

    /// Runs `matmul(xs, out)` (a `rows x cols` layer with weights `weights`) for 1, 7 and 33
    /// tokens of random inputs (a few tiny) and checks each output within the f32 summation
    /// bound (`cols` x 2^-24 x the sum of |products|) of the f64 product; reports how many
    /// outputs missed it and the worst (index, error, bound).
    fn assert_within_the_f32_summation_bound(
        weights: &[f32],
        (rows, cols): (usize, usize),
        matmul: impl Fn(&[f32], &mut [f32]),
    ) {
        let mut value = random_values(0x2545_f491_4f6c_dd1d, 16);
        for tokens in [1, 7, 33] {
            let xs: Vec<f32> = (0..tokens * cols)
                .map(|i| value() * if i % 37 == 5 { 1e-36 } else { 1.0 })
                .collect();
            let mut out = vec![0f32; tokens * rows];
            matmul(&xs, &mut out);
            let mut failures = Vec::new();
            for (i, &got) in out.iter().enumerate() {
                let (t, r) = (i / rows, i % rows);
                let products =
                    (0..cols).map(|k| weights[r * cols + k] as f64 * xs[t * cols + k] as f64);
                let exact: f64 = products.clone().sum();
                let bound = cols as f64 * 2f64.powi(-24) * products.map(f64::abs).sum::<f64>();
                let error = (got as f64 - exact).abs();
                if error > bound {
                    failures.push((i, error, bound));
                }
            }
            let worst = failures.iter().max_by(|a, b| a.1.total_cmp(&b.1));
            assert!(
                failures.is_empty(),
                "{tokens} tokens: {} of {} outputs past the bound, worst (index, error, bound) {worst:?}",
                failures.len(),
                out.len()
            );
        }
    }

    /// bf16 dense rows over tokens, through the SIMD kernels and, on CPUs with AMX tiles, again
    /// with them (the two 16-row blocks over 7 and 33 tokens; the 8 rows left take the SIMD
    /// tile).
    #[test]
    fn bf16_dense_matmul_over_tokens_stays_within_the_f32_summation_bound() {
        let (rows, cols) = (40, 96);
        let mut value = random_values(0x9e37_79b9_7f4a_7c15, 8);
        let weights: Vec<f32> = (0..rows * cols)
            .map(|_| half::bf16::from_f32(value()).to_f32())
            .collect();
        let bytes: Vec<u8> = weights
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let m = DenseMatrix {
            rows,
            cols,
            format: FloatFormat::Bf16,
            data: crate::weights::TensorBytes::from_vec(bytes),
        };
        assert_within_the_f32_summation_bound(&weights, (rows, cols), |xs, out| {
            dense_matmul_using(&m, xs, None, out, false)
        });
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::simd::amx::usable() {
            assert_within_the_f32_summation_bound(&weights, (rows, cols), |xs, out| {
                dense_matmul_using(&m, xs, None, out, true)
            });
        } else {
            // Never handed out where the tiles are missing, whatever the environment says.
            assert!(!crate::cpu::simd::amx::enabled());
        }
    }

    /// MXFP4 rows over tokens, every code, scales from 2^-7 to 2^0 (expert 0) and from 2^-127
    /// (expert 1).
    #[test]
    fn mxfp4_matmul_over_tokens_stays_within_the_f32_summation_bound() {
        let (rows, cols) = (40, 96);
        for (expert, (base, spread)) in [(120u8, 8), (0, 6)].into_iter().enumerate() {
            let w = patterned_mxfp4_experts(2, (rows, cols), (37, 11), (base, spread));
            let mut weights = vec![0f32; rows * cols];
            for (r, row) in weights.chunks_exact_mut(cols).enumerate() {
                let (packed, scales) = w.rows_of(expert, r..r + 1);
                dequantize_mxfp4_row(packed, scales, row);
            }
            assert_within_the_f32_summation_bound(&weights, (rows, cols), |xs, out| {
                mxfp4_matmul(&w, expert, xs, None, out)
            });
        }
    }

    #[test]
    fn dense_dot_handles_tails_in_every_format() {
        let x: Vec<f32> = (0..13).map(|i| i as f32 * 0.25 - 1.0).collect();
        let w: Vec<f32> = (0..13).map(|i| 1.0 - i as f32 * 0.125).collect();
        let exact: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        let bf: Vec<u8> = w
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        let f16: Vec<u8> = w
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect();
        let f32s: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        for (format, bytes) in [
            (FloatFormat::Bf16, bf),
            (FloatFormat::F16, f16),
            (FloatFormat::F32, f32s),
        ] {
            let got = dot_dense(format, &bytes, &x);
            assert!((got - exact).abs() < 1e-5, "{format:?}: {got} vs {exact}");
        }
    }
}
