//! SIMD versions of the hot dot products, chosen at run time: AVX-512 or AVX2 + FMA on x86_64,
//! NEON on aarch64. The scalar kernels in `matmul.rs` stay the reference (tests compare every
//! SIMD path with them) and the fallback elsewhere. `PICCHIO_CPU_KERNELS=scalar|avx2|avx512|neon`
//! caps the choice.
//!
//! Each function sums in its own fixed order, the same for every row and token, so batching
//! still gives bit-identical results; against the scalar kernels they differ by rounding only.

use std::sync::OnceLock;

use crate::weights::FloatFormat;

/// Which kernels the CPU tier runs, from the most portable to the widest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum CpuKernels {
    Scalar,
    /// x86_64 AVX2 with FMA and F16C.
    Avx2,
    /// x86_64 AVX-512 (F, BW, VL) on top of AVX2.
    Avx512,
    /// aarch64 NEON (every aarch64 CPU has it). Ordered last so that capping an x86 level on
    /// aarch64 (or NEON on x86) lands on what the CPU has, or below.
    Neon,
}

impl CpuKernels {
    pub fn name(self) -> &'static str {
        match self {
            CpuKernels::Scalar => "scalar",
            CpuKernels::Avx2 => "avx2",
            CpuKernels::Avx512 => "avx512",
            CpuKernels::Neon => "neon",
        }
    }
}

/// Asks for the cache lines of `values` to be brought into the L1 cache (where the CPU has a
/// prefetch instruction): for reads whose addresses a loop knows ahead but the hardware
/// prefetchers do not follow, such as a KV cache's rows of one head.
#[inline]
pub fn prefetch(values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in values.chunks(16) {
        // Safety: a prefetch is a hint with no memory access semantics; the address is in a
        // live slice anyway. SSE is part of x86_64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// The kernels the CPU tier uses: the widest this CPU supports, capped by
/// `PICCHIO_CPU_KERNELS` (decided once).
pub fn kernels() -> CpuKernels {
    static CHOICE: OnceLock<CpuKernels> = OnceLock::new();
    *CHOICE.get_or_init(|| {
        let detected = detect();
        let cap = match std::env::var("PICCHIO_CPU_KERNELS").as_deref() {
            Err(_) => detected,
            Ok("scalar") => CpuKernels::Scalar,
            Ok("avx2") => CpuKernels::Avx2,
            Ok("avx512") => CpuKernels::Avx512,
            Ok("neon") => CpuKernels::Neon,
            Ok(other) => {
                log::warn!(
                    "PICCHIO_CPU_KERNELS={other:?} is not scalar, avx2, avx512 or neon: ignored"
                );
                detected
            }
        };
        if (cap == CpuKernels::Neon) != (detected == CpuKernels::Neon) && cap != CpuKernels::Scalar
        {
            log::warn!(
                "PICCHIO_CPU_KERNELS={}: not this CPU's kind: ignored",
                cap.name()
            );
            return detected;
        }
        cap.min(detected)
    })
}

/// What the hardware supports, whatever the environment says (detected once).
pub fn detect() -> CpuKernels {
    static DETECTED: OnceLock<CpuKernels> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                if has!("avx512f") && has!("avx512bw") && has!("avx512vl") {
                    return CpuKernels::Avx512;
                }
                return CpuKernels::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        if std::arch::is_aarch64_feature_detected!("neon") {
            return CpuKernels::Neon;
        }
        CpuKernels::Scalar
    })
}

/// A dot product of one stored float row (bf16, f16 or f32) with `x`.
pub type FloatDot = fn(FloatFormat, &[u8], &[f32]) -> f32;

/// Dot products of one stored float row with each of several inputs, `out[t] = row . xs[t]`,
/// each bit-identical to the one-input kernel's (the row is decoded once for all of them).
pub type FloatDotEach = fn(FloatFormat, &[u8], &[&[f32]], &mut [f32]);

/// The float-row dot product of `kernels` (the scalar reference where the CPU lacks them).
/// Every format sums in the same order, so widening a checkpoint's tensors changes nothing.
pub fn float_dot(kernels: CpuKernels) -> FloatDot {
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => |format, row, x| {
            // Safety: `float_dot` hands this out only where `detect()` found AVX2, FMA, F16C.
            unsafe { x86::dot_floats(format, row, x) }
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => |format, row, x| {
            // Safety: handed out only where `detect()` found AVX-512 F/BW/VL and AVX2.
            unsafe { x86_512::dot_floats(format, row, x) }
        },
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => neon::dot_floats,
        _ => crate::cpu::matmul::dot_dense_scalar,
    }
}

/// Rows (at most `TILE_ROWS`) of one float format times every input, `out[r * xs.len() + t]`,
/// each bit-identical to `float_dot`'s: a cache-blocked `float_dot_each` over several rows.
pub type FloatTile = fn(FloatFormat, &[&[u8]], &[&[f32]], &mut [f32]);

/// The float tile of `kernels`: AVX-512's cache-blocked one, else `float_dot_each` per row.
pub fn float_tile(kernels: CpuKernels) -> FloatTile {
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => |format, rows, xs, out| {
            // Safety: handed out only where `detect()` found AVX-512 F/BW/VL and AVX2.
            unsafe { x86_512::floats_tile(format, rows, xs, out) }
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => |format, rows, xs, out| {
            // Safety: handed out only where `detect()` found AVX2, FMA and F16C.
            unsafe { x86::floats_tile(format, rows, xs, out) }
        },
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => neon::floats_tile,
        _ => |format, rows, xs, out| {
            float_tile_with(float_dot_each(CpuKernels::Scalar), format, rows, xs, out)
        },
    }
}

/// A `FloatTile` of `dot_each` row by row.
fn float_tile_with(
    dot_each: FloatDotEach,
    format: FloatFormat,
    rows: &[&[u8]],
    xs: &[&[f32]],
    out: &mut [f32],
) {
    for (row, sums) in rows.iter().zip(out.chunks_exact_mut(xs.len())) {
        dot_each(format, row, xs, sums);
    }
}

/// `float_dot` over several inputs at once.
pub fn float_dot_each(kernels: CpuKernels) -> FloatDotEach {
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => |format, row, xs, out| {
            // Safety: handed out only where `detect()` found AVX-512 F/BW/VL and AVX2.
            unsafe { x86_512::dot_floats_each(format, row, xs, out) }
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => |format, row, xs, out| {
            // Safety: handed out only where `detect()` found AVX2, FMA and F16C.
            unsafe { x86::dot_floats_each(format, row, xs, out) }
        },
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => neon::dot_floats_each,
        _ => |format, row, xs, out| {
            for (o, x) in out.iter_mut().zip(xs) {
                *o = crate::cpu::matmul::dot_dense_scalar(format, row, x);
            }
        },
    }
}

/// Consecutive stored float rows (each as long as `x`) times one input, `out[r] = row r . x`,
/// each bit-identical to `float_dot`'s: decode's form, several rows' sums in flight.
pub type FloatRows = fn(FloatFormat, &[u8], &[f32], &mut [f32]);

/// The float rows kernel of `kernels`: AVX2's takes four rows at a time (one running sum per row
/// and input, so one row alone leaves the multiply-adds waiting on each other); the others take
/// the rows one at a time through `float_dot_each`.
pub fn float_rows(kernels: CpuKernels) -> FloatRows {
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => |format, rows, x, out| {
            // Safety: handed out only where `detect()` found AVX2, FMA and F16C.
            unsafe { x86::dot_float_rows(format, rows, x, out) }
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => |format, rows, x, out| {
            float_rows_with(float_dot_each(CpuKernels::Avx512), format, rows, x, out)
        },
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => |format, rows, x, out| {
            float_rows_with(float_dot_each(CpuKernels::Neon), format, rows, x, out)
        },
        _ => |format, rows, x, out| {
            float_rows_with(float_dot_each(CpuKernels::Scalar), format, rows, x, out)
        },
    }
}

/// A `FloatRows` of `dot_each` row by row.
fn float_rows_with(
    dot_each: FloatDotEach,
    format: FloatFormat,
    rows: &[u8],
    x: &[f32],
    out: &mut [f32],
) {
    let width = format.size() * x.len();
    assert_eq!(rows.len(), width * out.len(), "one output per row");
    for (row, y) in rows.chunks_exact(width).zip(out) {
        dot_each(format, row, &[x], std::slice::from_mut(y));
    }
}

/// The dot products of one row of groups of 32 weights with a scale each (a packed 4-bit row, 16
/// bytes per group, or a q8 row, 32), with inputs in the order the kernel reads.
#[derive(Clone, Copy)]
pub struct PackedDot {
    /// The order the kernel reads its input in (`InputOrder::arrange` puts it there).
    pub input_order: InputOrder,
    /// `row . x`.
    pub dot: fn(&[u8], &[u8], &[f32]) -> f32,
    /// `out[t] = row . xs[t]`, each bit-identical to `dot`'s (the row decoded once for all).
    pub dot_each: PackedDotEach,
    /// Rows (packed, scales; at most `TILE_ROWS`) times every input, `out[r * xs.len() + t]`,
    /// each bit-identical to `dot`'s: a cache-blocked `dot_each` over several rows.
    pub tile: PackedTile,
    /// Two runs of consecutive rows times one input (decode): run k holds `outs[k].len()` rows
    /// back to back, `outs[k][i] = row i of run k . x`, each bit-identical to `dot`'s. The
    /// AVX-512 kernel computes row i of both runs side by side: two streams from memory, far
    /// apart, which keep more reads in flight than one.
    pub rows: PackedRows,
}

/// Packed bytes and scale bytes of consecutive rows, back to back.
pub type RowBytes<'a> = (&'a [u8], &'a [u8]);

/// See `PackedDot::rows`.
pub type PackedRows = fn([RowBytes; 2], &[f32], [&mut [f32]; 2]);

/// See `PackedDot::dot_each`.
pub type PackedDotEach = fn(&[u8], &[u8], &[&[f32]], &mut [f32]);

/// See `PackedDot::tile`.
pub type PackedTile = fn(&[(&[u8], &[u8])], &[&[f32]], &mut [f32]);

/// Most rows one `PackedDot::tile` call takes.
pub const TILE_ROWS: usize = 16;

/// Groups of 32 a packed tile works through before moving to the next row: the inputs' slices of
/// a block (32 KiB for eight inputs) stay in L1 while every row of the tile reads them.
const TILE_GROUPS: usize = 32;

impl PackedDot {
    /// A kernel without a batched form: `dot_each` calls `dot` per input, `tile` `dot_each` per
    /// row.
    fn one_at_a_time(
        input_order: InputOrder,
        dot: fn(&[u8], &[u8], &[f32]) -> f32,
        dot_each: PackedDotEach,
        tile: PackedTile,
        rows: PackedRows,
    ) -> PackedDot {
        PackedDot {
            input_order,
            dot,
            dot_each,
            tile,
            rows,
        }
    }
}

/// A `PackedRows` (or a `Q8Rows`) of `dot` row by row, the first run then the second.
pub(crate) fn rows_with<X: ?Sized>(
    dot: fn(&[u8], &[u8], &X) -> f32,
    runs: [RowBytes; 2],
    x: &X,
    outs: [&mut [f32]; 2],
) {
    for ((packed, scales), out) in runs.into_iter().zip(outs) {
        if out.is_empty() {
            continue;
        }
        let (row_bytes, row_scales) = (packed.len() / out.len(), scales.len() / out.len());
        let rows = packed
            .chunks_exact(row_bytes)
            .zip(scales.chunks_exact(row_scales));
        for ((packed, scales), y) in rows.zip(out) {
            *y = dot(packed, scales, x);
        }
    }
}

/// Decode's order over two runs of consecutive rows (`PackedDot::rows`): rows r and r + 1 of
/// both runs in one call of `four` (its outputs: row r of the first run, of the second, row r +
/// 1 of the first, of the second), the last row of an odd count of pairs through `two` (row r
/// of each run), then the rows one run has beyond the other's through `one` (run, row).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn in_fours(
    [first, second]: [&mut [f32]; 2],
    four: impl Fn(usize) -> [f32; 4],
    two: impl Fn(usize) -> [f32; 2],
    one: impl Fn(usize, usize) -> f32,
) {
    let paired = first.len().min(second.len());
    let mut r = 0;
    while r + 1 < paired {
        [first[r], second[r], first[r + 1], second[r + 1]] = four(r);
        r += 2;
    }
    for r in r..paired {
        [first[r], second[r]] = two(r);
    }
    for (k, out) in [first, second].into_iter().enumerate() {
        for (r, y) in out.iter_mut().enumerate().skip(paired) {
            *y = one(k, r);
        }
    }
}

/// A `PackedTile` of `dot_each` row by row.
fn tile_with(dot_each: PackedDotEach, rows: &[(&[u8], &[u8])], xs: &[&[f32]], out: &mut [f32]) {
    for ((packed, scales), sums) in rows.iter().zip(out.chunks_exact_mut(xs.len())) {
        dot_each(packed, scales, xs, sums);
    }
}

/// `out[t] = dot(packed, scales, xs[t])`.
fn each_with(
    dot: fn(&[u8], &[u8], &[f32]) -> f32,
    packed: &[u8],
    scales: &[u8],
    xs: &[&[f32]],
    out: &mut [f32],
) {
    for (o, x) in out.iter_mut().zip(xs) {
        *o = dot(packed, scales, x);
    }
}

/// The MXFP4 row kernel of `kernels` (the scalar reference where the CPU lacks them).
pub fn mxfp4_dot(kernels: CpuKernels) -> PackedDot {
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 if has_vbmi() => folded_mxfp4_dot::<false>(),
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => mxfp4_dot_per_run(),
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => avx2_mxfp4_dot(),
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => neon_mxfp4_dot(),
        _ => PackedDot::one_at_a_time(
            InputOrder::Natural,
            crate::cpu::matmul::dot_mxfp4_scalar,
            |blocks, scales, xs, out| {
                each_with(
                    crate::cpu::matmul::dot_mxfp4_scalar,
                    blocks,
                    scales,
                    xs,
                    out,
                )
            },
            |rows, xs, out| tile_with(mxfp4_dot(CpuKernels::Scalar).dot_each, rows, xs, out),
            |runs, x, outs| rows_with(crate::cpu::matmul::dot_mxfp4_scalar, runs, x, outs),
        ),
    }
}

/// The folded AVX-512 MXFP4 kernel, over rows whose whole runs are interleaved where
/// `INTERLEAVED` (`interleave_mxfp4_runs`), else in the checkpoint's layout.
#[cfg(target_arch = "x86_64")]
fn folded_mxfp4_dot<const INTERLEAVED: bool>() -> PackedDot {
    use x86_512::folded;
    PackedDot {
        input_order: InputOrder::GroupHalves,
        // Safety (all): handed out only where `detect()` found AVX-512 F/BW/VL and AVX2, and
        // `has_vbmi()` VBMI.
        dot: |blocks, scales, x| unsafe { folded::dot_mxfp4::<INTERLEAVED>(blocks, scales, x) },
        dot_each: |blocks, scales, xs, out| unsafe {
            folded::dot_mxfp4_each::<INTERLEAVED>(blocks, scales, xs, out)
        },
        tile: |rows, xs, out| unsafe { folded::mxfp4_tile::<INTERLEAVED>(rows, xs, out) },
        rows: |runs, x, outs| unsafe { folded::dot_mxfp4_rows::<INTERLEAVED>(runs, x, outs) },
    }
}

/// The MXFP4 kernel over rows whose whole runs `interleave_mxfp4_runs` interleaved (where it
/// returned true): the folded AVX-512 one, where this process runs it.
pub fn mxfp4_interleaved_dot() -> Option<PackedDot> {
    #[cfg(target_arch = "x86_64")]
    if kernels() == CpuKernels::Avx512 && has_vbmi() {
        return Some(folded_mxfp4_dot::<true>());
    }
    None
}

/// Interleaves the whole runs of the MXFP4 rows `packed` (of `cols` weights, `scales` theirs) in
/// place for `mxfp4_interleaved_dot`, where this process runs it: word w of a 64-byte run then
/// holds weight w of each of the run's four groups. Reads 16-bit words where the checkpoint's
/// layout needs a byte permute, and 4 word permutes per 128 weights where it needs 8 float ones
/// (bit-identical results from fewer shuffles). False, and nothing changed, elsewhere.
pub fn interleave_mxfp4_runs(packed: &mut [u8], scales: &[u8], cols: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if mxfp4_interleaved_dot().is_some() {
        // Safety: the kernel set is AVX-512 with VBMI (`mxfp4_interleaved_dot`).
        unsafe { x86_512::folded::interleave_runs(packed, scales, cols) };
        return true;
    }
    let _ = (packed, scales, cols);
    false
}

/// A row format of groups of 32 weights with a scale each, as the AVX2 and NEON group kernels
/// read it.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[derive(Clone, Copy)]
enum GroupFormat {
    /// MXFP4: E2M1 codes, 16 bytes and one E8M0 scale byte per group, inputs in
    /// `InputOrder::GroupHalves`.
    Mxfp4,
    /// Group-scaled INT4: nibble - 8, 16 bytes and a little-endian f16 scale per group, inputs
    /// in `InputOrder::GroupHalves`.
    Int4,
    /// q8: 32 signed bytes and a little-endian f16 scale per group, inputs as given.
    Q8,
}

#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
impl GroupFormat {
    fn bytes_per_group(self) -> usize {
        match self {
            GroupFormat::Q8 => 32,
            _ => 16,
        }
    }

    fn scale_bytes(self) -> usize {
        match self {
            GroupFormat::Mxfp4 => 1,
            _ => 2,
        }
    }

    /// The order the AVX2 and NEON group kernels read a row's inputs in.
    fn input_order(self) -> InputOrder {
        match self {
            GroupFormat::Q8 => InputOrder::Natural,
            _ => InputOrder::GroupHalves,
        }
    }

    /// The weights by 4-bit code as small integers (twice the E2M1 values for MXFP4: the halving
    /// goes into the scale, exactly); unused for q8.
    fn small_integers(self) -> [i8; 16] {
        match self {
            GroupFormat::Mxfp4 => [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
            _ => [-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7],
        }
    }
}

/// The packed formats as const parameters of `avx2_packed_dot` and `neon_packed_dot` (kernels
/// are plain function pointers, which cannot capture a format).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const PACKED_MXFP4: u8 = 0;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const PACKED_INT4: u8 = 1;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const PACKED_Q8: u8 = 2;

/// The group format a packed-format parameter names.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
const fn packed_format<const FORMAT: u8>() -> GroupFormat {
    match FORMAT {
        PACKED_MXFP4 => GroupFormat::Mxfp4,
        PACKED_INT4 => GroupFormat::Int4,
        _ => GroupFormat::Q8,
    }
}

/// The NEON kernels of a packed format: each group decoded once for up to eight inputs (tiles)
/// or four (one row).
#[cfg(target_arch = "aarch64")]
fn neon_packed_dot<const FORMAT: u8>() -> PackedDot {
    PackedDot {
        input_order: packed_format::<FORMAT>().input_order(),
        dot: |packed, scales, x| neon::dot_row(packed_format::<FORMAT>(), packed, scales, x),
        dot_each: |packed, scales, xs, out| {
            neon::dot_row_each(packed_format::<FORMAT>(), packed, scales, xs, out)
        },
        tile: |rows, xs, out| neon::rows_tile(packed_format::<FORMAT>(), rows, xs, out),
        rows: |runs, x, outs| rows_with(neon_packed_dot::<FORMAT>().dot, runs, x, outs),
    }
}

/// The NEON MXFP4 kernel through byte tables with the scales folded in.
#[cfg(target_arch = "aarch64")]
fn neon_mxfp4_dot() -> PackedDot {
    use neon::byte_tables;
    PackedDot {
        input_order: InputOrder::GroupHalves,
        dot: byte_tables::dot_mxfp4,
        dot_each: byte_tables::dot_mxfp4_each,
        tile: byte_tables::mxfp4_tile,
        rows: byte_tables::dot_mxfp4_rows,
    }
}

/// The AVX2 kernels of a packed format: each group decoded once for up to eight inputs (tiles)
/// or four (one row).
#[cfg(target_arch = "x86_64")]
fn avx2_packed_dot<const FORMAT: u8>() -> PackedDot {
    assert!(detect() >= CpuKernels::Avx2);
    PackedDot {
        input_order: packed_format::<FORMAT>().input_order(),
        // Safety (all): AVX2, FMA and F16C were detected (asserted above).
        dot: |packed, scales, x| unsafe {
            x86::dot_packed_row(packed_format::<FORMAT>(), packed, scales, x)
        },
        dot_each: |packed, scales, xs, out| unsafe {
            x86::dot_packed_each(packed_format::<FORMAT>(), packed, scales, xs, out)
        },
        tile: |rows, xs, out| unsafe {
            x86::packed_rows_tile(packed_format::<FORMAT>(), rows, xs, out)
        },
        rows: |runs, x, outs| unsafe { x86::dot_packed_rows::<FORMAT>(runs, x, outs) },
    }
}

/// The AVX2 MXFP4 kernel through byte tables with the scales folded in.
#[cfg(target_arch = "x86_64")]
fn avx2_mxfp4_dot() -> PackedDot {
    use x86::byte_tables;
    assert!(detect() >= CpuKernels::Avx2);
    PackedDot {
        input_order: InputOrder::GroupLanes,
        // Safety (all): AVX2, FMA and F16C were detected (asserted above).
        dot: |blocks, scales, x| unsafe { byte_tables::dot_mxfp4(blocks, scales, x) },
        dot_each: |blocks, scales, xs, out| unsafe {
            byte_tables::dot_mxfp4_each(blocks, scales, xs, out)
        },
        tile: |rows, xs, out| unsafe { byte_tables::mxfp4_tile(rows, xs, out) },
        rows: |runs, x, outs| unsafe { byte_tables::dot_mxfp4_rows(runs, x, outs) },
    }
}

/// The AVX-512 MXFP4 kernel that scales each run's sums (no VBMI needed).
#[cfg(target_arch = "x86_64")]
fn mxfp4_dot_per_run() -> PackedDot {
    const MXFP4: x86_512::PackedFormat = x86_512::PackedFormat::Mxfp4;
    assert!(detect() >= CpuKernels::Avx512);
    PackedDot {
        input_order: InputOrder::NibbleRuns,
        // Safety (all): AVX-512 F/BW/VL and AVX2 were detected (asserted above).
        dot: |blocks, scales, x| unsafe { x86_512::dot_packed_row(MXFP4, blocks, scales, x) },
        dot_each: |blocks, scales, xs, out| unsafe {
            x86_512::dot_packed_each(MXFP4, blocks, scales, xs, out)
        },
        tile: |rows, xs, out| unsafe { x86_512::packed_rows_tile(MXFP4, rows, xs, out) },
        rows: |runs, x, outs| rows_with(mxfp4_dot_per_run().dot, runs, x, outs),
    }
}

/// Whether this CPU has AVX-512 VBMI (byte permutes), detected once.
#[cfg(target_arch = "x86_64")]
fn has_vbmi() -> bool {
    static VBMI: OnceLock<bool> = OnceLock::new();
    *VBMI.get_or_init(|| std::arch::is_x86_feature_detected!("avx512vbmi"))
}

/// The group-scaled INT4 row kernel of `kernels` (the scalar reference where the CPU lacks them).
pub fn int4_dot(kernels: CpuKernels) -> PackedDot {
    #[cfg(target_arch = "x86_64")]
    const INT4: x86_512::PackedFormat = x86_512::PackedFormat::Int4;
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => PackedDot {
            input_order: InputOrder::NibbleRuns,
            // Safety (both): handed out only where `detect()` found AVX-512 F/BW/VL and AVX2.
            dot: |qweight, scales, x| unsafe { x86_512::dot_packed_row(INT4, qweight, scales, x) },
            dot_each: |qweight, scales, xs, out| unsafe {
                x86_512::dot_packed_each(INT4, qweight, scales, xs, out)
            },
            tile: |rows, xs, out| unsafe { x86_512::packed_rows_tile(INT4, rows, xs, out) },
            rows: |runs, x, outs| rows_with(int4_dot(CpuKernels::Avx512).dot, runs, x, outs),
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => avx2_packed_dot::<PACKED_INT4>(),
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => neon_packed_dot::<PACKED_INT4>(),
        _ => PackedDot::one_at_a_time(
            InputOrder::Natural,
            crate::cpu::matmul::dot_int4_scalar,
            |qweight, scales, xs, out| {
                each_with(
                    crate::cpu::matmul::dot_int4_scalar,
                    qweight,
                    scales,
                    xs,
                    out,
                )
            },
            |rows, xs, out| tile_with(int4_dot(CpuKernels::Scalar).dot_each, rows, xs, out),
            |runs, x, outs| rows_with(crate::cpu::matmul::dot_int4_scalar, runs, x, outs),
        ),
    }
}

/// The q8 row kernel of `kernels` (the scalar reference where the CPU lacks them): rows of
/// signed bytes with an f16 scale per 32, inputs in their natural order.
pub fn q8_dot(kernels: CpuKernels) -> PackedDot {
    match kernels.min(detect()) {
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx512 => PackedDot {
            input_order: InputOrder::Natural,
            // Safety (all): handed out only where `detect()` found AVX-512 F/BW/VL and AVX2.
            dot: |values, scales, x| unsafe { x86_512::dot_q8_row(values, scales, x) },
            dot_each: |values, scales, xs, out| unsafe {
                x86_512::dot_q8_each(values, scales, xs, out)
            },
            tile: |rows, xs, out| unsafe { x86_512::q8_tile(rows, xs, out) },
            rows: |runs, x, outs| unsafe { x86_512::dot_q8_rows(runs, x, outs) },
        },
        #[cfg(target_arch = "x86_64")]
        CpuKernels::Avx2 => avx2_packed_dot::<PACKED_Q8>(),
        #[cfg(target_arch = "aarch64")]
        CpuKernels::Neon => neon_packed_dot::<PACKED_Q8>(),
        _ => PackedDot::one_at_a_time(
            InputOrder::Natural,
            crate::cpu::q8::dot_q8_scalar,
            |values, scales, xs, out| {
                each_with(crate::cpu::q8::dot_q8_scalar, values, scales, xs, out)
            },
            |rows, xs, out| tile_with(q8_dot(CpuKernels::Scalar).dot_each, rows, xs, out),
            |runs, x, outs| rows_with(crate::cpu::q8::dot_q8_scalar, runs, x, outs),
        ),
    }
}

/// The length of every input of a float tile, checked: at most `TILE_ROWS` rows, each as many
/// values of `format` as every input holds.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
fn float_tile_len(format: FloatFormat, rows: &[&[u8]], xs: &[&[f32]]) -> usize {
    assert!(rows.len() <= TILE_ROWS);
    let n = xs.first().map_or(0, |x| x.len());
    assert!(
        rows.iter().all(|r| r.len() == format.size() * n) && xs.iter().all(|x| x.len() == n),
        "every row and input of a tile as long"
    );
    n
}

/// `0..len` in consecutive ranges of `size` (the last may be shorter): the blocks a cache-blocked
/// tile works through.
fn blocks(len: usize, size: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..len)
        .step_by(size)
        .map(move |start| start..(start + size).min(len))
}

/// `0..len` in as few ranges of at most `most` as cover it, their lengths as even as can be
/// (longest first): a pass over a few inputs keeps fewer sums in flight, so it costs nearly as
/// much as a full one.
#[cfg(target_arch = "x86_64")]
fn evenly(len: usize, most: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let count = len.div_ceil(most);
    let mut start = 0;
    (0..count).map(move |i| {
        let size = (len - start).div_ceil(count - i);
        start += size;
        start - size..start
    })
}

/// The first slots of `slots` filled from `ranges` (which must fit): `evenly`'s ranges worked
/// out once where a loop would redo each one's division per pass.
#[cfg(target_arch = "x86_64")]
fn filled(
    slots: &mut [std::ops::Range<usize>],
    ranges: impl Iterator<Item = std::ops::Range<usize>>,
) -> &[std::ops::Range<usize>] {
    let mut count = 0;
    for (slot, range) in slots.iter_mut().zip(ranges) {
        *slot = range;
        count += 1;
    }
    &slots[..count]
}

/// The order a packed kernel reads its input in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputOrder {
    /// As given.
    Natural,
    /// `arrange_packed_input`'s: runs of 128 by nibble of each 32-bit word.
    NibbleRuns,
    /// Every group of 32 as its 16 even inputs, then its 16 odd ones.
    GroupHalves,
    /// Every group of 32 as the AVX2 byte-table kernel decodes it: 4 vectors of 8, lane l of
    /// vector v holding input `group_lane_input(v, l)`.
    GroupLanes,
}

impl InputOrder {
    /// `x` (rows of `cols` inputs) in this order, starting on a cache line: `x` itself where it
    /// already does, else `scratch` filled with it.
    pub fn arrange<'a>(
        self,
        x: &'a [f32],
        cols: usize,
        scratch: &'a mut AlignedFloats,
    ) -> &'a [f32] {
        match self {
            InputOrder::Natural if x.as_ptr().cast::<Line>().is_aligned() => x,
            InputOrder::Natural => {
                scratch.filled(x.len()).copy_from_slice(x);
                scratch
            }
            InputOrder::NibbleRuns => {
                arrange_packed_input(x, cols, scratch);
                scratch
            }
            InputOrder::GroupHalves => {
                arrange_groups(x, cols, scratch, group_halves);
                scratch
            }
            InputOrder::GroupLanes => {
                arrange_groups(x, cols, scratch, group_lanes);
                scratch
            }
        }
    }
}

/// 16 floats on a 64-byte boundary: one cache line.
#[derive(Clone, Copy, Default, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Floats that start on a cache line. The kernels read their inputs in 64-byte vectors, and a
/// load that spans two lines costs two: with four to eight inputs per weight (prefill's tiles),
/// unaligned inputs cost a large share of the speed.
#[derive(Default)]
pub struct AlignedFloats {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedFloats {
    /// `len` floats (zeros) for the caller to fill: the buffer's new contents.
    fn filled(&mut self, len: usize) -> &mut [f32] {
        self.lines.clear();
        self.lines.resize(len.div_ceil(16), Line::default());
        self.len = len;
        &mut bytemuck::cast_slice_mut(&mut self.lines)[..len]
    }
}

impl std::ops::Deref for AlignedFloats {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &bytemuck::cast_slice(&self.lines)[..self.len]
    }
}

/// Rearranges rows of `cols` inputs group of 32 by group: `arrange(group, out)` writes a group's
/// inputs in the kernel's order.
fn arrange_groups(
    x: &[f32],
    cols: usize,
    out: &mut AlignedFloats,
    arrange: impl Fn(&[f32], &mut [f32]),
) {
    assert!(
        cols.is_multiple_of(32) && x.len().is_multiple_of(cols),
        "packed rows hold whole groups of 32"
    );
    let out = out.filled(x.len());
    for (group, arranged) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        arrange(group, arranged);
    }
}

/// A group's inputs in `InputOrder::GroupLanes`.
fn group_lanes(group: &[f32], out: &mut [f32]) {
    for (i, input) in out.iter_mut().enumerate() {
        *input = group[group_lane_input(i / 8, i % 8)];
    }
}

/// See `InputOrder::GroupLanes`: the input that lane `l` of weight vector `v` multiplies, in
/// its group. The low 128-bit lane decodes the group's low nibbles (even weights), the high
/// lane its high ones; vectors 0 and 1 widen the words of the group's first 8 bytes, 2 and 3
/// of its last 8; the even vectors take each 32-bit word's lower word, the odd ones its upper.
const fn group_lane_input(v: usize, l: usize) -> usize {
    16 * (v / 2) + 2 * (v % 2) + l / 4 + 4 * (l % 4)
}

/// A group's even inputs, then its odd ones.
fn group_halves(group: &[f32], out: &mut [f32]) {
    for (k, pair) in group.chunks_exact(2).enumerate() {
        out[k] = pair[0];
        out[16 + k] = pair[1];
    }
}

/// Rearranges rows of `cols` inputs into the order the AVX-512 packed kernels read them. Each
/// run of 128 inputs (four groups, 64 packed bytes) becomes 8 vectors of 16, vector k holding
/// inputs `8i + k` (i = 0..16): nibble k of each 32-bit word of the packed bytes, in lane order.
/// The last groups of a row that make no whole run become their 16 even inputs then their 16
/// odd ones: the low and high nibbles of their 16 bytes.
fn arrange_packed_input(x: &[f32], cols: usize, out: &mut AlignedFloats) {
    assert!(
        cols.is_multiple_of(32) && x.len().is_multiple_of(cols),
        "packed rows hold whole groups of 32"
    );
    let out = out.filled(x.len());
    for (row, arranged) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let runs = cols / 128 * 128;
        let (run_inputs, last_groups) = arranged.split_at_mut(runs);
        for (run, vectors) in row[..runs]
            .chunks_exact(128)
            .zip(run_inputs.chunks_exact_mut(128))
        {
            for (k, vector) in vectors.chunks_exact_mut(16).enumerate() {
                for (i, v) in vector.iter_mut().enumerate() {
                    *v = run[8 * i + k];
                }
            }
        }
        for (group, halves) in row[runs..]
            .chunks_exact(32)
            .zip(last_groups.chunks_exact_mut(32))
        {
            group_halves(group, halves);
        }
    }
}

// The batching macros the kernel modules share (textually scoped: defined before them).

/// Runs `$call` over `$xs` in blocks of `$full` inputs, then the rest together (one of the
/// sizes `$n`), `$block` being an array of them and `$t` the index of its first.
macro_rules! for_blocks_of {
    ($full:literal, [$($n:literal),*], $xs:expr, |$block:ident, $t:ident| $call:expr) => {{
        let xs = &$xs[..];
        let mut $t = 0;
        while $t < xs.len() {
            match xs.len() - $t {
                $(
                    $n => {
                        let $block: [_; $n] = xs[$t..$t + $n].try_into().unwrap();
                        $call;
                        $t += $n;
                    }
                )*
                _ => {
                    let $block: [_; $full] = xs[$t..$t + $full].try_into().unwrap();
                    $call;
                    $t += $full;
                }
            }
        }
    }};
}

/// `for_blocks_of!` four inputs at a time.
macro_rules! for_blocks_of_four {
    ($xs:expr, |$block:ident, $t:ident| $call:expr) => {
        for_blocks_of!(4, [1, 2, 3], $xs, |$block, $t| $call)
    };
}

/// `for_blocks_of!` eight inputs at a time.
macro_rules! for_blocks_of_eight {
    ($xs:expr, |$block:ident, $t:ident| $call:expr) => {
        for_blocks_of!(8, [1, 2, 3, 4, 5, 6, 7], $xs, |$block, $t| $call)
    };
}

/// Runs `$call` (an expression of `$block`, an array of inputs) over `$xs` through
/// `$for_blocks` (one of the `for_blocks_of_*` macros), writing each result into
/// `$out`.
macro_rules! in_blocks {
    ($for_blocks:ident, $xs:expr, $out:expr, |$block:ident| $call:expr) => {{
        let (xs, out): (&[_], &mut [f32]) = ($xs, $out);
        assert_eq!(xs.len(), out.len());
        $for_blocks!(xs, |$block, t| {
            let sums = $call;
            out[t..t + sums.len()].copy_from_slice(&sums);
        });
    }};
}

/// `in_blocks!` four inputs at a time.
macro_rules! in_blocks_of_four {
    ($xs:expr, $out:expr, |$block:ident| $call:expr) => {
        in_blocks!(for_blocks_of_four, $xs, $out, |$block| $call)
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod amx;

/// Whether bf16 dense layers over several tokens run on AMX-BF16 tiles (`amx`).
pub fn amx_tiles() -> bool {
    #[cfg(target_arch = "x86_64")]
    return amx::enabled();
    #[cfg(not(target_arch = "x86_64"))]
    false
}
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod folding;
#[cfg(target_arch = "aarch64")]
mod neon;
pub(crate) mod q8_activations;

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GroupFormat, TILE_GROUPS, TILE_ROWS};
    use crate::formats::e8m0_scale;
    use crate::weights::FloatFormat;

    /// How far ahead of the bytes being read the kernels ask for the next ones: into L1 a little
    /// ahead, into L2 far ahead. Rows continue into the next row, and memory pages are small
    /// and scattered (a mapped file), so the hardware prefetchers, which stop at every 4 KiB
    /// page, alone leave bandwidth unused; decode ran fastest with both distances.
    const PREFETCH_L1: usize = 2048;
    const PREFETCH_L2: usize = 32768;

    /// Hints that the `len` bytes at `p` plus each prefetch distance will be read soon. A
    /// prefetch never faults, so the addresses may lie past the end of the row or mapping.
    #[inline(always)]
    pub(super) fn prefetch_ahead(p: *const u8, len: usize) {
        let mut at = 0;
        while at < len {
            // Safety: prefetching is a hint with no memory access semantics: any address is fine.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_L1 + at).cast());
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(PREFETCH_L2 + at).cast());
            }
            at += 64;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn sum8(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// Each vector's lanes added up.
    #[target_feature(enable = "avx2,fma")]
    fn sums8<const T: usize>(vectors: &[__m256; T]) -> [f32; T] {
        let mut sums = [0f32; T];
        for (sum, &v) in sums.iter_mut().zip(vectors) {
            *sum = sum8(v);
        }
        sums
    }

    /// Eight values of `format` at `p`, as f32.
    ///
    /// # Safety
    /// `p` must point to 8 readable values (16 bytes, or 32 for f32).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(format: FloatFormat, p: *const u8) -> __m256 {
        // Safety: the caller guarantees the bytes are readable; unaligned loads are allowed.
        unsafe {
            match format {
                FloatFormat::Bf16 => {
                    let raw = _mm_loadu_si128(p.cast());
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(raw)))
                }
                FloatFormat::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                FloatFormat::F32 => _mm256_loadu_ps(p.cast()),
            }
        }
    }

    /// The float formats as const parameters, so that each loop has its load inlined.
    pub(super) const BF16: u8 = 0;
    pub(super) const F16: u8 = 1;
    pub(super) const F32: u8 = 2;

    /// The float format `FORMAT` names.
    pub(super) const fn format_of<const FORMAT: u8>() -> FloatFormat {
        match FORMAT {
            BF16 => FloatFormat::Bf16,
            F16 => FloatFormat::F16,
            _ => FloatFormat::F32,
        }
    }

    /// Float rows: one running sum per row and input.
    mod floats;
    pub use floats::{dot_float_rows, dot_floats, dot_floats_each, floats_tile};

    /// What group `g` of `row` (its weights as `group_weights` gives them) is multiplied by.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    fn group_scale(row: GroupRow, g: usize) -> f32 {
        match row.format {
            // Twice the FP4 values (`small_integers`), halved here. MXFP4 rows go through the
            // byte tables on x86 (`avx2_mxfp4_dot`); this kernel still reads them (tests).
            GroupFormat::Mxfp4 => 0.5 * e8m0_scale(row.scales[g]),
            _ => {
                let scales = row.scales;
                let bits = u16::from_le_bytes([scales[2 * g], scales[2 * g + 1]]);
                _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
            }
        }
    }

    /// Eight signed bytes (the low half of `bytes`) as f32.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn widen8(bytes: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes))
    }

    /// Group `g`'s 32 weights (before scaling) as 4 vectors, in the order the format reads its
    /// inputs: a 4-bit group's 16 low nibbles (even inputs) then its 16 high ones, through the
    /// table of small integers; a q8 group's bytes as they are.
    ///
    /// # Safety
    /// AVX2; the group's bytes lie in `bytes`.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn group_weights(row: GroupRow, g: usize) -> [__m256; 4] {
        let at = row.format.bytes_per_group() * g;
        match row.format {
            GroupFormat::Mxfp4 | GroupFormat::Int4 => {
                let low = _mm_set1_epi8(0x0F);
                // Safety: the caller's guarantee.
                let bytes = unsafe { _mm_loadu_si128(row.bytes.as_ptr().add(at).cast()) };
                let even = _mm_shuffle_epi8(row.small_integers, _mm_and_si128(bytes, low));
                let odd = _mm_shuffle_epi8(
                    row.small_integers,
                    _mm_and_si128(_mm_srli_epi16::<4>(bytes), low),
                );
                [
                    widen8(even),
                    widen8(_mm_srli_si128::<8>(even)),
                    widen8(odd),
                    widen8(_mm_srli_si128::<8>(odd)),
                ]
            }
            // Safety: the caller's guarantee (32 bytes from `at`).
            GroupFormat::Q8 => std::array::from_fn(|k| unsafe {
                widen8(_mm_loadl_epi64(row.bytes.as_ptr().add(at + 8 * k).cast()))
            }),
        }
    }

    /// One row of a group format: its bytes, its scale bytes, and for 4-bit codes their table.
    #[derive(Clone, Copy)]
    struct GroupRow<'a> {
        format: GroupFormat,
        small_integers: __m128i,
        bytes: &'a [u8],
        scales: &'a [u8],
    }

    impl<'a> GroupRow<'a> {
        #[target_feature(enable = "avx2")]
        fn new(format: GroupFormat, (bytes, scales): (&'a [u8], &'a [u8])) -> GroupRow<'a> {
            let groups = bytes.len() / format.bytes_per_group();
            assert!(
                bytes.len() == format.bytes_per_group() * groups
                    && scales.len() >= groups * format.scale_bytes(),
                "a row holds whole groups of 32 weights and a scale per group"
            );
            let table = format.small_integers();
            // Safety: 16 bytes from a 16-byte array.
            let small_integers = unsafe { _mm_loadu_si128(table.as_ptr().cast()) };
            GroupRow {
                format,
                small_integers,
                bytes,
                scales,
            }
        }

        fn groups(&self) -> usize {
            self.bytes.len() / self.format.bytes_per_group()
        }
    }

    /// Adds groups `groups` of a row times `T` inputs to `totals`: per input, a group's 32
    /// products summed (one multiply, three multiply-adds), then scaled into the total. The
    /// group's weights are decoded once for all inputs, and each total sees the same operations
    /// however many inputs and groups a call takes.
    ///
    /// # Safety
    /// AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn row_groups<const T: usize>(
        row: GroupRow,
        xs: [&[f32]; T],
        groups: std::ops::Range<usize>,
        totals: &mut [__m256; T],
    ) {
        assert!(
            groups.end <= row.groups() && xs.iter().all(|x| x.len() == 32 * row.groups()),
            "each input holds 32 values per group of the row"
        );
        let mut acc = *totals;
        for g in groups {
            // Safety: group g exists (asserted above).
            let (w, scale) = unsafe { scaled_group(row, g) };
            for (total, x) in acc.iter_mut().zip(&xs) {
                // Safety: the group's 32 inputs are in bounds (asserted above).
                let inputs = unsafe { group_inputs(x, g) };
                *total = _mm256_fmadd_ps(group_sum(w, inputs), scale, *total);
            }
        }
        *totals = acc;
    }

    /// Group `g` of `row`: its weights (`group_weights`) and its scale in every lane, with the
    /// row's bytes ahead prefetched at each cache line's first group.
    ///
    /// # Safety
    /// AVX2; group g exists (`g < row.groups()`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn scaled_group(row: GroupRow, g: usize) -> ([__m256; 4], __m256) {
        let at = row.format.bytes_per_group() * g;
        if at.is_multiple_of(64) {
            prefetch_ahead(row.bytes.as_ptr().wrapping_add(at), 64);
        }
        // Safety: the caller's guarantee.
        let w = unsafe { group_weights(row, g) };
        (w, _mm256_set1_ps(group_scale(row, g)))
    }

    /// Group `g`'s 32 inputs of `x` as 4 vectors.
    ///
    /// # Safety
    /// AVX; `x` holds them (`32 * (g + 1) <= x.len()`).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn group_inputs(x: &[f32], g: usize) -> [__m256; 4] {
        // Safety: the caller's guarantee.
        unsafe {
            let x = x.as_ptr().add(32 * g);
            [
                _mm256_loadu_ps(x),
                _mm256_loadu_ps(x.add(8)),
                _mm256_loadu_ps(x.add(16)),
                _mm256_loadu_ps(x.add(24)),
            ]
        }
    }

    /// A group's 32 products summed: one multiply, three multiply-adds.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    fn group_sum(w: [__m256; 4], x: [__m256; 4]) -> __m256 {
        let sum = _mm256_mul_ps(w[0], x[0]);
        let sum = _mm256_fmadd_ps(w[1], x[1], sum);
        let sum = _mm256_fmadd_ps(w[2], x[2], sum);
        _mm256_fmadd_ps(w[3], x[3], sum)
    }

    /// `N` rows of the packed format `FORMAT` names times one input, each bit-identical to
    /// `row_dots`: group by
    /// group, the group's inputs loaded once for every row. Each row's total waits on its
    /// multiply-add at every group; with several rows the core has other rows' work meanwhile
    /// (one row at a time runs at the multiply-adds' latency).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; every row as long as the others, `x` 32 inputs per group of them.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn rows_dots<const FORMAT: u8, const N: usize>(
        rows: [GroupRow; N],
        x: &[f32],
    ) -> [f32; N] {
        // The format as a constant, so that its branches fold away in the loop.
        let format = super::packed_format::<FORMAT>();
        let rows = rows.map(|row| GroupRow { format, ..row });
        let groups = rows[0].groups();
        assert!(
            rows.iter().all(|r| r.groups() == groups) && x.len() == 32 * groups,
            "each row holds one group per 32 inputs"
        );
        let mut totals = [_mm256_setzero_ps(); N];
        for g in 0..groups {
            // Safety: group g's inputs are in bounds (asserted above).
            let inputs = unsafe { group_inputs(x, g) };
            for (total, row) in totals.iter_mut().zip(rows) {
                // Safety: group g exists (asserted above).
                let (w, scale) = unsafe { scaled_group(row, g) };
                *total = _mm256_fmadd_ps(group_sum(w, inputs), scale, *total);
            }
        }
        sums8(&totals)
    }

    /// One row times `T` inputs.
    ///
    /// # Safety
    /// AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn row_dots<const T: usize>(row: GroupRow, xs: [&[f32]; T]) -> [f32; T] {
        let mut totals = [_mm256_setzero_ps(); T];
        // Safety: the caller's guarantees.
        unsafe { row_groups(row, xs, 0..row.groups(), &mut totals) };
        sums8(&totals)
    }

    /// `out[t] = row . xs[t]`, four inputs at a time.
    ///
    /// # Safety
    /// AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn row_dots_each(row: GroupRow, xs: &[&[f32]], out: &mut [f32]) {
        // Safety: the caller's guarantees.
        in_blocks_of_four!(xs, out, |block| unsafe { row_dots(row, block) });
    }

    /// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, block of groups by block of
    /// groups: `out[r * stride + t]`. Bit-identical to `row_dots`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile_dots<const T: usize>(
        rows: &[GroupRow],
        xs: [&[f32]; T],
        (out, stride): (&mut [f32], usize),
    ) {
        assert!(rows.len() <= TILE_ROWS);
        let mut totals = [[_mm256_setzero_ps(); T]; TILE_ROWS];
        let groups = rows.first().map_or(0, GroupRow::groups);
        for block in super::blocks(groups, TILE_GROUPS) {
            for (row, totals) in rows.iter().zip(totals.iter_mut()) {
                // Safety: the caller's guarantees.
                unsafe { row_groups(*row, xs, block.clone(), totals) };
            }
        }
        for (r, totals) in totals.iter().take(rows.len()).enumerate() {
            out[r * stride..r * stride + T].copy_from_slice(&sums8(totals));
        }
    }

    /// Rows (bytes, scale bytes; at most `TILE_ROWS`, all as long) of `format` times every
    /// input: `out[r * xs.len() + t]`, eight inputs at a time (four decoded weight vectors and
    /// eight totals in registers; faster than four on the synthetic 20B's expert shapes).
    ///
    /// # Safety
    /// AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn rows_tile(
        format: GroupFormat,
        rows: &[(&[u8], &[u8])],
        xs: &[&[f32]],
        out: &mut [f32],
    ) {
        assert!(rows.len() <= TILE_ROWS);
        let mut tile = [GroupRow::new(format, (&[], &[])); TILE_ROWS];
        for (slot, &row) in tile.iter_mut().zip(rows) {
            *slot = GroupRow::new(format, row);
        }
        let rows = &tile[..rows.len()];
        assert!(rows.iter().all(|r| r.groups() == rows[0].groups()));
        let stride = xs.len();
        // Safety: the caller's guarantees.
        for_blocks_of_eight!(xs, |block, t| unsafe {
            tile_dots(rows, block, (&mut out[t..], stride))
        });
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C; `packed` holds the format's bytes (16, q8's 32)
    /// and `scales` its scale per 32 values of `x` (in `format.input_order()`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_packed_row(
        format: GroupFormat,
        packed: &[u8],
        scales: &[u8],
        x: &[f32],
    ) -> f32 {
        let row = GroupRow::new(format, (packed, scales));
        // Safety: the caller's guarantees.
        unsafe { row_dots(row, [x])[0] }
    }

    /// # Safety
    /// As `dot_packed_row`, for every input.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_packed_each(
        format: GroupFormat,
        packed: &[u8],
        scales: &[u8],
        xs: &[&[f32]],
        out: &mut [f32],
    ) {
        let row = GroupRow::new(format, (packed, scales));
        // Safety: the caller's guarantees.
        unsafe { row_dots_each(row, xs, out) }
    }

    /// Decode's two runs of consecutive rows (`PackedDot::rows`) of the packed format `FORMAT`
    /// names, four rows at a time: row i of both runs and row i + 1 of both, then the rows one
    /// run has beyond the other's.
    ///
    /// # Safety
    /// As `dot_packed_row`, for every row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_packed_rows<const FORMAT: u8>(
        runs: [(&[u8], &[u8]); 2],
        x: &[f32],
        outs: [&mut [f32]; 2],
    ) {
        let format = super::packed_format::<FORMAT>();
        let groups = x.len() / 32;
        let (bytes, scale_bytes) = (
            format.bytes_per_group() * groups,
            format.scale_bytes() * groups,
        );
        for ((packed, scales), out) in runs.iter().zip(&outs) {
            assert!(
                packed.len() == bytes * out.len() && scales.len() == scale_bytes * out.len(),
                "consecutive rows hold one group and its scale per 32 inputs"
            );
        }
        let row = |k: usize, r: usize| {
            let (packed, scales) = runs[k];
            GroupRow::new(
                format,
                (
                    &packed[r * bytes..(r + 1) * bytes],
                    &scales[r * scale_bytes..(r + 1) * scale_bytes],
                ),
            )
        };
        // Safety (each): the caller's guarantees.
        super::in_fours(
            outs,
            |r| unsafe {
                rows_dots::<FORMAT, 4>([row(0, r), row(1, r), row(0, r + 1), row(1, r + 1)], x)
            },
            |r| unsafe { rows_dots::<FORMAT, 2>([row(0, r), row(1, r)], x) },
            |k, r| unsafe { rows_dots::<FORMAT, 1>([row(k, r)], x)[0] },
        );
    }

    /// # Safety
    /// As `dot_packed_row`, for every row and input.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn packed_rows_tile(
        format: GroupFormat,
        rows: &[(&[u8], &[u8])],
        xs: &[&[f32]],
        out: &mut [f32],
    ) {
        // Safety: the caller's guarantees.
        unsafe { rows_tile(format, rows, xs, out) }
    }

    /// MXFP4 through byte tables with the scales folded in.
    pub mod byte_tables;
}

#[cfg(target_arch = "x86_64")]
mod x86_512 {
    use std::arch::x86_64::*;

    use super::x86::{BF16, F16, F32, format_of, prefetch_ahead};

    use crate::cpu::matmul::decode_at;
    use crate::formats::FP4_VALUES;
    use crate::weights::FloatFormat;

    /// A mask of the first `n` (at most 16) lanes.
    fn lane_mask(n: usize) -> u32 {
        (1u32 << n) - 1
    }

    /// Sixteen values of `format` at `p`, as f32.
    ///
    /// # Safety
    /// AVX-512F must be supported and `p` must point to 16 readable values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load16(format: FloatFormat, p: *const u8) -> __m512 {
        // Safety: the caller guarantees the bytes are readable; unaligned loads are allowed.
        unsafe {
            match format {
                FloatFormat::Bf16 => {
                    let raw = _mm256_loadu_si256(p.cast());
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(raw)))
                }
                FloatFormat::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                FloatFormat::F32 => _mm512_loadu_ps(p.cast()),
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX-512 F/BW/VL, AVX2, FMA and F16C; `row` holds `x.len()` values.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_floats(format: FloatFormat, row: &[u8], x: &[f32]) -> f32 {
        // Safety: the caller's guarantees.
        unsafe { dot_floats_tokens::<1>(format, row, [x])[0] }
    }

    /// One float row's running sums for `T` inputs: four per input.
    #[derive(Clone, Copy)]
    struct FloatTotals<const T: usize>([[__m512; 4]; T]);

    /// Adds 64-value steps `steps` of `row` times each of `T` inputs to `totals`, decoding the
    /// row's values once for all of them. Every input's sums run in the same order whatever `T`
    /// and however the steps are split into calls.
    ///
    /// # Safety
    /// As `dot_floats`, every input as long as the row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn float_steps<const T: usize>(
        format: FloatFormat,
        row: &[u8],
        xs: [&[f32]; T],
        steps: std::ops::Range<usize>,
        totals: &mut FloatTotals<T>,
    ) {
        let size = format.size();
        let n = row.len() / size;
        assert!(row.len() == size * n && xs.iter().all(|x| x.len() == n) && 64 * steps.end <= n);
        // One loop per format, the format's load inlined into it.
        // Safety (each): the caller's guarantees.
        unsafe {
            match format {
                FloatFormat::Bf16 => float_steps_as::<T, 2>(load_bf16, row, xs, steps, totals),
                FloatFormat::F16 => float_steps_as::<T, 2>(load_f16, row, xs, steps, totals),
                FloatFormat::F32 => float_steps_as::<T, 4>(load_f32, row, xs, steps, totals),
            }
        }
    }

    /// 16 bf16 values at `p` as f32.
    ///
    /// # Safety
    /// AVX-512F; 32 readable bytes at `p`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn load_bf16(p: *const u8) -> __m512 {
        // Safety: the caller's guarantees.
        unsafe { load16(FloatFormat::Bf16, p) }
    }

    /// 16 f16 values at `p` as f32.
    ///
    /// # Safety
    /// AVX-512F; 32 readable bytes at `p`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn load_f16(p: *const u8) -> __m512 {
        // Safety: the caller's guarantees.
        unsafe { load16(FloatFormat::F16, p) }
    }

    /// 16 f32 values at `p`.
    ///
    /// # Safety
    /// AVX-512F; 64 readable bytes at `p`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn load_f32(p: *const u8) -> __m512 {
        // Safety: the caller's guarantees.
        unsafe { load16(FloatFormat::F32, p) }
    }

    /// `float_steps` for values of `SIZE` bytes read by `load`.
    ///
    /// # Safety
    /// As `float_steps`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn float_steps_as<const T: usize, const SIZE: usize>(
        load: unsafe fn(*const u8) -> __m512,
        row: &[u8],
        xs: [&[f32]; T],
        steps: std::ops::Range<usize>,
        totals: &mut FloatTotals<T>,
    ) {
        let w = row.as_ptr();
        // The sums in registers for the whole loop.
        let mut acc = totals.0;
        for step in steps {
            let i = 64 * step;
            prefetch_ahead(w.wrapping_add(SIZE * i), 64 * SIZE);
            for k in 0..4 {
                let at = i + 16 * k;
                // Safety: at + 16 <= n (checked by `float_steps`): 16 values of `row` and of
                // each input are in bounds.
                let weights = unsafe { load(w.add(SIZE * at)) };
                for (a, x) in acc.iter_mut().zip(&xs) {
                    // Safety: as above.
                    let x = unsafe { _mm512_loadu_ps(x.as_ptr().add(at)) };
                    a[k] = _mm512_fmadd_ps(weights, x, a[k]);
                }
            }
        }
        totals.0 = acc;
    }

    /// Adds the values after the last whole 64-value step to `totals` and reduces them: the
    /// row's dot product with each input.
    ///
    /// # Safety
    /// As `float_steps`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn float_finish<const T: usize>(
        format: FloatFormat,
        row: &[u8],
        xs: [&[f32]; T],
        totals: &FloatTotals<T>,
    ) -> [f32; T] {
        let size = format.size();
        let n = row.len() / size;
        assert!(row.len() == size * n && xs.iter().all(|x| x.len() == n));
        let w = row.as_ptr();
        let mut i = n / 64 * 64;
        // The 16-value steps after the whole 64-value ones go into each input's first sum.
        let mut first: [__m512; T] = std::array::from_fn(|t| totals.0[t][0]);
        while i + 16 <= n {
            // Safety: i + 16 <= n.
            let weights = unsafe { load16(format, w.add(size * i)) };
            for (a, x) in first.iter_mut().zip(&xs) {
                // Safety: as above.
                *a = _mm512_fmadd_ps(weights, unsafe { _mm512_loadu_ps(x.as_ptr().add(i)) }, *a);
            }
            i += 16;
        }
        let mut sums = [0f32; T];
        for (((sum, a), first), x) in sums.iter_mut().zip(&totals.0).zip(first).zip(&xs) {
            let total = _mm512_add_ps(_mm512_add_ps(first, a[1]), _mm512_add_ps(a[2], a[3]));
            *sum = _mm512_reduce_add_ps(total);
            for (k, xk) in x.iter().enumerate().skip(i) {
                *sum += decode_at(format, row, k) * xk;
            }
        }
        sums
    }

    /// `row` times each of `T` inputs.
    ///
    /// # Safety
    /// As `float_steps`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_floats_tokens<const T: usize>(
        format: FloatFormat,
        row: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let mut totals = FloatTotals([[_mm512_setzero_ps(); 4]; T]);
        let steps = row.len() / format.size() / 64;
        // Safety: the caller's guarantees.
        unsafe {
            float_steps(format, row, xs, 0..steps, &mut totals);
            float_finish(format, row, xs, &totals)
        }
    }

    /// Each of `rows` (at most `TILE_ROWS`) times `T` inputs, 512 values at a time so that the
    /// inputs' slices stay in L1 across the rows: `out[r * stride + t]`. Bit-identical to
    /// `dot_floats_tokens`.
    ///
    /// # Safety
    /// As `float_steps`, for every row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn float_tile<const T: usize>(
        format: FloatFormat,
        rows: &[&[u8]],
        xs: [&[f32]; T],
        (out, stride): (&mut [f32], usize),
    ) {
        let n = super::float_tile_len(format, rows, &xs);
        let mut totals = [FloatTotals([[_mm512_setzero_ps(); 4]; T]); TILE_ROWS];
        let steps = n / 64;
        for block in super::blocks(steps, 8) {
            let totals = totals[..rows.len()].chunks_mut(FLOAT_ROW_BLOCK);
            let groups = rows.chunks(FLOAT_ROW_BLOCK).zip(totals);
            for (rows, totals) in groups {
                // Safety: the caller's guarantees; the lengths were checked above.
                unsafe {
                    match format {
                        FloatFormat::Bf16 => float_rows::<T, BF16>(rows, xs, &block, totals),
                        FloatFormat::F16 => float_rows::<T, F16>(rows, xs, &block, totals),
                        FloatFormat::F32 => float_rows::<T, F32>(rows, xs, &block, totals),
                    }
                }
            }
        }
        // By reference: iterating the array by value copied all of it (16 rows' sums, 16 KiB for
        // four inputs) per tile, a sixth of a 64-token dense layer's time.
        for (r, (row, totals)) in rows.iter().zip(&totals).enumerate() {
            // Safety: the caller's guarantees.
            let sums = unsafe { float_finish(format, row, xs, totals) };
            out[r * stride..r * stride + T].copy_from_slice(&sums);
        }
    }

    /// Rows of a float tile whose sums stay in registers together: each input vector, loaded
    /// once, feeds that many rows (loads, not multiply-adds, bound a tile that reloads its inputs
    /// for every row). The tile is compute-bound, so it asks for no prefetches: measured on the
    /// synthetic 20B's prefill, they cost more issue slots than they saved.
    const FLOAT_ROW_BLOCK: usize = 4;

    /// 16 values of the format `FORMAT` names at `p`, as f32.
    ///
    /// # Safety
    /// As `load16`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn load_format<const FORMAT: u8>(p: *const u8) -> __m512 {
        // Safety: the caller's guarantees.
        unsafe { load16(format_of::<FORMAT>(), p) }
    }

    /// Adds 64-value steps `steps` of up to `FLOAT_ROW_BLOCK` rows times `T` inputs to `totals`,
    /// the same additions in the same order as `float_steps` row by row: one of a step's four
    /// vectors at a time, all rows' and inputs' sums for it in registers.
    ///
    /// # Safety
    /// As `float_steps`, for every row (in the format `FORMAT` names).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn float_rows<const T: usize, const FORMAT: u8>(
        rows: &[&[u8]],
        xs: [&[f32]; T],
        steps: &std::ops::Range<usize>,
        totals: &mut [FloatTotals<T>],
    ) {
        // Safety (each arm): the caller's guarantees.
        unsafe {
            match rows.len() {
                4 => float_row_block::<T, 4, FORMAT>(rows, xs, steps, totals),
                3 => float_row_block::<T, 3, FORMAT>(rows, xs, steps, totals),
                2 => float_row_block::<T, 2, FORMAT>(rows, xs, steps, totals),
                _ => float_row_block::<T, 1, FORMAT>(rows, xs, steps, totals),
            }
        }
    }

    /// `float_rows` for exactly `R` rows.
    ///
    /// # Safety
    /// As `float_rows`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn float_row_block<const T: usize, const R: usize, const FORMAT: u8>(
        rows: &[&[u8]],
        xs: [&[f32]; T],
        steps: &std::ops::Range<usize>,
        totals: &mut [FloatTotals<T>],
    ) {
        let size = if FORMAT == F32 { 4 } else { 2 };
        assert!(rows.len() == R && totals.len() == R);
        assert!(xs.iter().all(|x| 64 * steps.end <= x.len()));
        assert!(rows.iter().all(|r| size * 64 * steps.end <= r.len()));
        let w: [*const u8; R] = std::array::from_fn(|r| rows[r].as_ptr());
        for k in 0..4 {
            let mut acc: [[__m512; T]; R] =
                std::array::from_fn(|r| std::array::from_fn(|t| totals[r].0[t][k]));
            for step in steps.clone() {
                let at = 64 * step + 16 * k;
                // Safety: at + 16 <= 64 * steps.end (asserted above) for inputs and rows alike.
                let x: [__m512; T] =
                    std::array::from_fn(|t| unsafe { _mm512_loadu_ps(xs[t].as_ptr().add(at)) });
                for (p, sums) in w.iter().zip(acc.iter_mut()) {
                    // Safety: as above.
                    let weights = unsafe { load_format::<FORMAT>(p.add(size * at)) };
                    for (a, x) in sums.iter_mut().zip(&x) {
                        *a = _mm512_fmadd_ps(weights, *x, *a);
                    }
                }
            }
            for (total, sums) in totals.iter_mut().zip(&acc) {
                for (t, a) in sums.iter().enumerate() {
                    total.0[t][k] = *a;
                }
            }
        }
    }

    /// How a packed row's group scales are stored.
    #[derive(Clone, Copy)]
    enum DecodeScales {
        /// One E8M0 byte per group (MXFP4).
        E8m0,
        /// One little-endian f16 per group (INT4).
        F16,
    }

    impl DecodeScales {
        /// The scales of groups `g..g + n` (n <= 16) of a row's scale bytes, in the first n lanes.
        ///
        /// # Safety
        /// AVX-512 F/BW/VL; those groups exist in `scales`.
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
        #[inline]
        unsafe fn decode(self, scales: &[u8], g: usize, n: usize) -> __m512 {
            // Safety: the caller's guarantees.
            unsafe {
                match self {
                    DecodeScales::E8m0 => e8m0_scales16(scales, g, n),
                    DecodeScales::F16 => f16_scales16(scales, g, n),
                }
            }
        }
    }

    /// One packed row's running sums for `T` inputs: two per input, so that consecutive runs do
    /// not wait on each other's additions.
    #[derive(Clone, Copy)]
    struct Totals<const T: usize> {
        even: [__m512; T],
        odd: [__m512; T],
    }

    impl<const T: usize> Totals<T> {
        #[target_feature(enable = "avx512f")]
        fn zero() -> Totals<T> {
            Totals {
                even: [_mm512_setzero_ps(); T],
                odd: [_mm512_setzero_ps(); T],
            }
        }
    }

    /// Adds runs `runs` (starting at a multiple of 4) of a packed 4-bit row times `T` inputs laid
    /// out by `arrange_packed_input` to `totals`: `sum over groups g of scale(g) * sum_j
    /// table[nibble j] * x_j`. A run of four groups is one 64-byte load; shifting its 32-bit
    /// words by 4k puts nibble k of every word in the low bits of its lane, and one permute of a
    /// 16-entry f32 table turns those into weights (the permute reads only the low 4 bits). No
    /// byte widening and no integer-to-float conversion: the permutes are the only shuffles,
    /// which matters because shuffles and half the FMAs share one execution port. Every input's
    /// sums run in the same order whatever `T` and however the runs are split into calls.
    ///
    /// # Safety
    /// The CPU must support AVX-512F; `packed` holds 16 bytes per 32 values of each input and
    /// `scales` what `decode` reads for its groups.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn packed_runs<const T: usize>(
        (table, decode): (__m512, DecodeScales),
        (packed, scales): (&[u8], &[u8]),
        xs: [&[f32]; T],
        runs: std::ops::Range<usize>,
        totals: &mut Totals<T>,
    ) {
        let groups = packed.len() / 16;
        assert!(packed.len() == 16 * groups && xs.iter().all(|x| x.len() == 32 * groups));
        assert!(runs.start.is_multiple_of(4) && runs.end <= groups / 4);
        let p = packed.as_ptr();
        // Lane i of run c (c % 4 = j) takes scale 4j + i / 4 of the 16 decoded at once.
        let spread = |j: i32| {
            let g = 4 * j;
            _mm512_setr_epi32(
                g,
                g,
                g,
                g,
                g + 1,
                g + 1,
                g + 1,
                g + 1,
                g + 2,
                g + 2,
                g + 2,
                g + 2,
                g + 3,
                g + 3,
                g + 3,
                g + 3,
            )
        };
        let spreads = [spread(0), spread(1), spread(2), spread(3)];
        let mut decoded = _mm512_setzero_ps();
        for c in runs {
            if c % 4 == 0 {
                let g = 4 * c;
                // Safety: groups g..g + n exist.
                decoded = unsafe { decode.decode(scales, g, (groups - g).min(16)) };
            }
            prefetch_ahead(p.wrapping_add(64 * c), 64);
            // Safety: run c's 64 bytes are in bounds (c < groups / 4, asserted above).
            let words = unsafe { _mm512_loadu_si512(p.add(64 * c).cast()) };
            // The weights of the run, nibble k of every word (lane i: input 8i + k of the run,
            // all of lane i's inputs from group i / 4).
            let w = [
                _mm512_permutexvar_ps(words, table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(words), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(words), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(words), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(words), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(words), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(words), table),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(words), table),
            ];
            let s = _mm512_permutexvar_ps(spreads[c % 4], decoded);
            // Safety: run c's 128 inputs are in bounds (asserted above).
            let input = |t: usize, k: usize| unsafe {
                _mm512_loadu_ps(xs[t].as_ptr().add(128 * c + 16 * k))
            };
            // Per input: a sums the even nibbles' products, b the odd ones'; the inputs'
            // chains interleave so that independent instructions sit next to each other.
            let mut a = [_mm512_setzero_ps(); T];
            let mut b = [_mm512_setzero_ps(); T];
            for t in 0..T {
                a[t] = _mm512_mul_ps(w[0], input(t, 0));
                b[t] = _mm512_mul_ps(w[1], input(t, 1));
            }
            for k in 1..4 {
                for t in 0..T {
                    a[t] = _mm512_fmadd_ps(w[2 * k], input(t, 2 * k), a[t]);
                    b[t] = _mm512_fmadd_ps(w[2 * k + 1], input(t, 2 * k + 1), b[t]);
                }
            }
            for t in 0..T {
                let sum = _mm512_add_ps(a[t], b[t]);
                if c % 2 == 0 {
                    totals.even[t] = _mm512_fmadd_ps(sum, s, totals.even[t]);
                } else {
                    totals.odd[t] = _mm512_fmadd_ps(sum, s, totals.odd[t]);
                }
            }
        }
    }

    /// Adds the groups after the last whole run (inputs split into evens then odds) to `totals`
    /// and reduces them: the row's dot product with each input.
    ///
    /// # Safety
    /// As `packed_runs`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn packed_finish<const T: usize>(
        (table, decode): (__m512, DecodeScales),
        (packed, scales): (&[u8], &[u8]),
        xs: [&[f32]; T],
        mut totals: Totals<T>,
    ) -> [f32; T] {
        let groups = packed.len() / 16;
        assert!(packed.len() == 16 * groups && xs.iter().all(|x| x.len() == 32 * groups));
        let p = packed.as_ptr();
        let first = 4 * (groups / 4);
        // Safety: groups first..groups exist.
        let last_scales = unsafe { decode.decode(scales, first, groups - first) };
        for g in first..groups {
            // Safety: group g's 16 bytes are in bounds (asserted above).
            let codes = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(16 * g).cast())) };
            let low = _mm512_permutexvar_ps(codes, table);
            let high = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(codes), table);
            let s = _mm512_permutexvar_ps(_mm512_set1_epi32((g - first) as i32), last_scales);
            for (x, even) in xs.iter().zip(totals.even.iter_mut()) {
                // Safety: group g's 32 inputs are in bounds (asserted above).
                let sum = unsafe {
                    let xg = x.as_ptr().add(32 * g);
                    let sum = _mm512_mul_ps(low, _mm512_loadu_ps(xg));
                    _mm512_fmadd_ps(high, _mm512_loadu_ps(xg.add(16)), sum)
                };
                *even = _mm512_fmadd_ps(sum, s, *even);
            }
        }
        reduce_totals(&totals)
    }

    /// One packed row times `T` inputs.
    ///
    /// # Safety
    /// As `packed_runs`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn dot_packed<const T: usize>(
        format: (__m512, DecodeScales),
        row: (&[u8], &[u8]),
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let mut totals = Totals::zero();
        // Safety: the caller's guarantees.
        unsafe {
            packed_runs(format, row, xs, 0..row.0.len() / 64, &mut totals);
            packed_finish(format, row, xs, totals)
        }
    }

    /// Runs of 4 groups (512 inputs) a tile works through before moving to the next: the
    /// inputs' slices of a block (8 KiB for 4 inputs) stay in L1 while every row of the tile
    /// reads them, instead of streaming whole inputs from L2 once per row.
    const TILE_RUNS: usize = 4;

    use super::TILE_ROWS;

    /// Each of `rows` (packed bytes, scale bytes; at most `TILE_ROWS`) times `T` inputs, block
    /// of runs by block of runs: `out[r * stride + t]`. Bit-identical to `dot_packed`.
    ///
    /// # Safety
    /// As `packed_runs`, for every row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn packed_tile<const T: usize>(
        format: (__m512, DecodeScales),
        rows: &[(&[u8], &[u8])],
        xs: [&[f32]; T],
        (out, stride): (&mut [f32], usize),
    ) {
        assert!(rows.len() <= TILE_ROWS);
        let mut totals = [Totals::<T>::zero(); TILE_ROWS];
        let runs = rows.first().map_or(0, |(p, _)| p.len() / 64);
        for block in super::blocks(runs, TILE_RUNS) {
            for (row, totals) in rows.iter().zip(totals.iter_mut()) {
                // Safety: the caller's guarantees.
                unsafe { packed_runs(format, *row, xs, block.clone(), totals) };
            }
        }
        // By reference (iterating the array by value copies all of it), each row's sums copied.
        for (r, (row, totals)) in rows.iter().zip(&totals).enumerate() {
            // Safety: the caller's guarantees.
            let sums = unsafe { packed_finish(format, *row, xs, *totals) };
            out[r * stride..r * stride + T].copy_from_slice(&sums);
        }
    }

    /// # Safety
    /// As `dot_floats_tokens`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_floats_each(format: FloatFormat, row: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        // Safety: the caller's guarantees.
        in_blocks_of_four!(xs, out, |block| unsafe {
            dot_floats_tokens(format, row, block)
        });
    }

    /// Rows (at most `TILE_ROWS`) times every input: `out[r * xs.len() + t]`.
    ///
    /// # Safety
    /// As `dot_floats_tokens`, for every row and input.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn floats_tile(format: FloatFormat, rows: &[&[u8]], xs: &[&[f32]], out: &mut [f32]) {
        let stride = xs.len();
        // Safety: the caller's guarantees.
        for_blocks_of_four!(xs, |block, t| unsafe {
            float_tile(format, rows, block, (&mut out[t..], stride))
        });
    }

    /// The 16 E8M0 scales from group `g` (the first `n` of them) as f32.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL; groups `g..g + n` exist in `scales`, n <= 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn e8m0_scales16(scales: &[u8], g: usize, n: usize) -> __m512 {
        assert!(n <= 16 && g + n <= scales.len());
        // Safety: the masked load reads bytes g..g + n only, which exist; masked-out bytes are
        // never touched.
        let raw =
            unsafe { _mm_maskz_loadu_epi8(lane_mask(n) as u16, scales.as_ptr().add(g).cast()) };
        let raw = _mm512_cvtepu8_epi32(raw);
        // 2^(s - 127) is the float with exponent field s; s = 0 is the subnormal 2^-127.
        let bits = _mm512_slli_epi32::<23>(raw);
        let zero = _mm512_cmpeq_epi32_mask(raw, _mm512_setzero_si512());
        _mm512_castsi512_ps(_mm512_mask_mov_epi32(
            bits,
            zero,
            _mm512_set1_epi32(0x0040_0000),
        ))
    }

    /// The 16 f16 scales from group `g` (the first `n` of them) as f32.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL; groups `g..g + n` exist in `scales` (2 bytes each), n <= 16.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn f16_scales16(scales: &[u8], g: usize, n: usize) -> __m512 {
        assert!(n <= 16 && 2 * (g + n) <= scales.len());
        // Safety: the masked load reads the n scales from group g, which exist.
        let raw = unsafe {
            _mm256_maskz_loadu_epi16(lane_mask(n) as u16, scales.as_ptr().add(2 * g).cast())
        };
        _mm512_cvtph_ps(raw)
    }

    /// Adds groups `groups` (starting at a multiple of 16) of a q8 row times `T` inputs (natural
    /// order) to `totals`: per group of 32, two vectors of 16 widened bytes, multiplied into each
    /// input, the sum scaled. Each input's sums run in the same order whatever `T` and however
    /// the groups are split into calls.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL; `values` holds 32 bytes and `scales` an f16 per group of every input.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_groups<const T: usize>(
        (values, scales): (&[u8], &[u8]),
        xs: [&[f32]; T],
        range: std::ops::Range<usize>,
        totals: &mut Totals<T>,
    ) {
        let groups = values.len() / 32;
        assert!(values.len() == 32 * groups && xs.iter().all(|x| x.len() == 32 * groups));
        assert!(range.start.is_multiple_of(16) && range.end <= groups);
        let v = values.as_ptr();
        let mut decoded = _mm512_setzero_ps();
        for g in range {
            if g % 16 == 0 {
                // Safety: groups g..g + n exist.
                decoded = unsafe { f16_scales16(scales, g, (groups - g).min(16)) };
            }
            if g % 2 == 0 {
                prefetch_ahead(v.wrapping_add(32 * g), 64);
            }
            let s = _mm512_permutexvar_ps(_mm512_set1_epi32((g % 16) as i32), decoded);
            // Safety: group g's 32 bytes are in bounds (asserted above).
            let w = unsafe { q8_group_weights(v, g) };
            for (t, x) in xs.iter().enumerate() {
                // Safety: group g's 32 inputs are in bounds (asserted above).
                let sum = q8_group_sum(w, unsafe { group_inputs(x, g) });
                // Written out per parity, not through a reference to one of the two arrays:
                // chosen at run time, that kept the totals on the stack (a store and a reload in
                // every group's chain).
                if g % 2 == 0 {
                    totals.even[t] = _mm512_fmadd_ps(sum, s, totals.even[t]);
                } else {
                    totals.odd[t] = _mm512_fmadd_ps(sum, s, totals.odd[t]);
                }
            }
        }
    }

    /// Group `g`'s 32 signed bytes (from `values`) as two vectors of floats.
    ///
    /// # Safety
    /// AVX-512F; the group's bytes are in bounds.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn q8_group_weights(values: *const u8, g: usize) -> [__m512; 2] {
        std::array::from_fn(|k| {
            // Safety: the caller's guarantee.
            let bytes = unsafe { _mm_loadu_si128(values.add(32 * g + 16 * k).cast()) };
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes))
        })
    }

    /// Group `g`'s 32 inputs of `x` as two vectors.
    ///
    /// # Safety
    /// AVX-512F; `x` holds them.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn group_inputs(x: &[f32], g: usize) -> [__m512; 2] {
        // Safety: the caller's guarantee.
        std::array::from_fn(|k| unsafe { _mm512_loadu_ps(x.as_ptr().add(32 * g + 16 * k)) })
    }

    /// A q8 group's products with its inputs, summed over pairs of lanes (before its scale).
    #[target_feature(enable = "avx512f,fma")]
    #[inline]
    fn q8_group_sum([w0, w1]: [__m512; 2], [x0, x1]: [__m512; 2]) -> __m512 {
        _mm512_fmadd_ps(w1, x1, _mm512_mul_ps(w0, x0))
    }

    /// The dot products `totals` hold.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn reduce_totals<const T: usize>(totals: &Totals<T>) -> [f32; T] {
        std::array::from_fn(|t| _mm512_reduce_add_ps(_mm512_add_ps(totals.even[t], totals.odd[t])))
    }

    /// A q8 row times `T` inputs.
    ///
    /// # Safety
    /// As `q8_groups`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn dot_q8_tokens<const T: usize>(
        values: &[u8],
        scales: &[u8],
        xs: [&[f32]; T],
    ) -> [f32; T] {
        let mut totals = Totals::zero();
        // Safety: the caller's guarantees.
        unsafe { q8_groups((values, scales), xs, 0..values.len() / 32, &mut totals) };
        reduce_totals(&totals)
    }

    /// q8 rows (at most `TILE_ROWS`) times `T` inputs, 16 groups (512 inputs) at a time so
    /// that the inputs' slices stay in L1 across the rows: `out[r * stride + t]`.
    /// Bit-identical to `dot_q8_tokens`.
    ///
    /// # Safety
    /// As `q8_groups`, for every row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_tile_tokens<const T: usize>(
        rows: &[(&[u8], &[u8])],
        xs: [&[f32]; T],
        (out, stride): (&mut [f32], usize),
    ) {
        assert!(rows.len() <= TILE_ROWS);
        let mut totals = [Totals::<T>::zero(); TILE_ROWS];
        let groups = rows.first().map_or(0, |(v, _)| v.len() / 32);
        for block in super::blocks(groups, 16) {
            for (row, totals) in rows.iter().zip(totals.iter_mut()) {
                // Safety: the caller's guarantees.
                unsafe { q8_groups(*row, xs, block.clone(), totals) };
            }
        }
        for (r, totals) in totals.iter().take(rows.len()).enumerate() {
            out[r * stride..r * stride + T].copy_from_slice(&reduce_totals(totals));
        }
    }

    /// Rows (at most `TILE_ROWS`) times every input: `out[r * xs.len() + t]`.
    ///
    /// # Safety
    /// As `dot_q8_tokens`, for every row and input.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn q8_tile(rows: &[(&[u8], &[u8])], xs: &[&[f32]], out: &mut [f32]) {
        let stride = xs.len();
        // Safety: the caller's guarantees.
        for_blocks_of_four!(xs, |block, t| unsafe {
            q8_tile_tokens(rows, block, (&mut out[t..], stride))
        });
    }

    /// `N` q8 rows (each as long as the others) times one input, group by group: the group's
    /// inputs loaded once for every row and the rows' chains side by side (one row at a time,
    /// each group's total waits on the previous one's multiply-add). Each bit-identical to
    /// `dot_q8_tokens::<1>`.
    ///
    /// # Safety
    /// As `q8_groups`, for every row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    #[inline]
    unsafe fn q8_rows_dots<const N: usize>(rows: [(&[u8], &[u8]); N], x: &[f32]) -> [f32; N] {
        let groups = x.len() / 32;
        assert!(
            x.len() == 32 * groups
                && rows
                    .iter()
                    .all(|(v, s)| v.len() == 32 * groups && s.len() >= 2 * groups),
            "each row holds 32 bytes and a scale per 32 inputs"
        );
        let mut totals = Totals::<N>::zero();
        let mut decoded = [_mm512_setzero_ps(); N];
        for g in 0..groups {
            if g % 16 == 0 {
                for (d, (_, scales)) in decoded.iter_mut().zip(&rows) {
                    // Safety: groups g..g + n exist (asserted above).
                    *d = unsafe { f16_scales16(scales, g, (groups - g).min(16)) };
                }
            }
            if g % 2 == 0 {
                for (values, _) in &rows {
                    prefetch_ahead(values.as_ptr().wrapping_add(32 * g), 64);
                }
            }
            let lane = _mm512_set1_epi32((g % 16) as i32);
            // Safety: group g's inputs are in bounds (asserted above).
            let inputs = unsafe { group_inputs(x, g) };
            for n in 0..N {
                // Safety: group g's bytes are in bounds (asserted above).
                let sum = q8_group_sum(unsafe { q8_group_weights(rows[n].0.as_ptr(), g) }, inputs);
                let s = _mm512_permutexvar_ps(lane, decoded[n]);
                if g % 2 == 0 {
                    totals.even[n] = _mm512_fmadd_ps(sum, s, totals.even[n]);
                } else {
                    totals.odd[n] = _mm512_fmadd_ps(sum, s, totals.odd[n]);
                }
            }
        }
        reduce_totals(&totals)
    }

    /// # Safety
    /// As `q8_groups`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q8_row(values: &[u8], scales: &[u8], x: &[f32]) -> f32 {
        // Safety: the caller's guarantees.
        unsafe { dot_q8_tokens(values, scales, [x])[0] }
    }

    /// Decode's two runs of consecutive q8 rows (`PackedDot::rows`), four rows at a time: row
    /// i of both runs and row i + 1 of both, then the rows one run has beyond the other's.
    ///
    /// # Safety
    /// As `q8_groups`, for every row.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q8_rows(runs: [(&[u8], &[u8]); 2], x: &[f32], outs: [&mut [f32]; 2]) {
        let groups = x.len() / 32;
        let (bytes, scale_bytes) = (32 * groups, 2 * groups);
        for ((values, scales), out) in runs.iter().zip(&outs) {
            assert!(
                values.len() == bytes * out.len() && scales.len() == scale_bytes * out.len(),
                "consecutive rows hold 32 bytes and a scale per 32 inputs"
            );
        }
        let row = |k: usize, r: usize| {
            let (values, scales) = runs[k];
            (
                &values[r * bytes..(r + 1) * bytes],
                &scales[r * scale_bytes..(r + 1) * scale_bytes],
            )
        };
        // Safety (each): the caller's guarantees.
        super::in_fours(
            outs,
            |r| unsafe { q8_rows_dots([row(0, r), row(1, r), row(0, r + 1), row(1, r + 1)], x) },
            |r| unsafe { q8_rows_dots([row(0, r), row(1, r)], x) },
            |k, r| unsafe { q8_rows_dots([row(k, r)], x)[0] },
        );
    }

    /// # Safety
    /// As `dot_q8_tokens`, for every input.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_q8_each(values: &[u8], scales: &[u8], xs: &[&[f32]], out: &mut [f32]) {
        // Safety: the caller's guarantees.
        in_blocks_of_four!(xs, out, |block| unsafe {
            dot_q8_tokens(values, scales, block)
        });
    }

    /// E2M1 values by 4-bit code.
    fn fp4_table() -> __m512 {
        // Safety: the table holds 16 floats; AVX-512F is enabled wherever this is inlined.
        unsafe { _mm512_loadu_ps(FP4_VALUES.as_ptr()) }
    }

    /// Signed INT4 values (nibble - 8) by 4-bit code.
    fn int4_table() -> __m512 {
        const CENTERED: [f32; 16] = [
            -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
        ];
        // Safety: as in `fp4_table`.
        unsafe { _mm512_loadu_ps(CENTERED.as_ptr()) }
    }

    /// A packed 4-bit row format the per-run kernels read.
    #[derive(Clone, Copy)]
    pub enum PackedFormat {
        /// MXFP4: E2M1 weights, one E8M0 scale byte per group.
        Mxfp4,
        /// Group-scaled INT4: nibble - 8, one little-endian f16 scale per group.
        Int4,
    }

    impl PackedFormat {
        /// The values by 4-bit code and how the group scales decode.
        #[target_feature(enable = "avx512f")]
        fn parts(self) -> (__m512, DecodeScales) {
            match self {
                PackedFormat::Mxfp4 => (fp4_table(), DecodeScales::E8m0),
                PackedFormat::Int4 => (int4_table(), DecodeScales::F16),
            }
        }
    }

    /// One row of `format` times `x`.
    ///
    /// # Safety
    /// As `packed_runs`; `scales` holds the format's scale per group.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_packed_row(
        format: PackedFormat,
        packed: &[u8],
        scales: &[u8],
        x: &[f32],
    ) -> f32 {
        // Safety: the caller's guarantees.
        unsafe { dot_packed(format.parts(), (packed, scales), [x])[0] }
    }

    /// # Safety
    /// As `dot_packed_row`, for every input.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn dot_packed_each(
        format: PackedFormat,
        packed: &[u8],
        scales: &[u8],
        xs: &[&[f32]],
        out: &mut [f32],
    ) {
        let format = format.parts();
        // Safety: the caller's guarantees.
        in_blocks_of_four!(xs, out, |block| unsafe {
            dot_packed(format, (packed, scales), block)
        });
    }

    /// Rows (at most `TILE_ROWS`) of `format` times every input: `out[r * xs.len() + t]`.
    ///
    /// # Safety
    /// As `dot_packed_row`, for every row and input.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn packed_rows_tile(
        format: PackedFormat,
        rows: &[(&[u8], &[u8])],
        xs: &[&[f32]],
        out: &mut [f32],
    ) {
        let (format, stride) = (format.parts(), xs.len());
        // Safety: the caller's guarantees.
        for_blocks_of_four!(xs, |block, t| unsafe {
            packed_tile(format, rows, block, (&mut out[t..], stride))
        });
    }

    /// MXFP4 with the scales folded into the tables (needs VBMI).
    pub mod folded;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matmul::{dot_dense_scalar, dot_int4_scalar, dot_mxfp4_scalar};

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let v = (i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8;
                (v % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn bf16_bytes(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    }

    /// Every SIMD kernel set this CPU has (the scalar reference excluded).
    fn simd_sets() -> Vec<CpuKernels> {
        if detect() == CpuKernels::Neon {
            return vec![CpuKernels::Neon];
        }
        [CpuKernels::Avx2, CpuKernels::Avx512]
            .into_iter()
            .filter(|&k| k <= detect())
            .collect()
    }

    /// |simd - scalar| within a few ulps of the sum of |terms| (rounding of a different order).
    fn close(simd: f32, scalar: f32, magnitude: f32, what: &str) {
        let bound = 1e-6 * magnitude.max(1.0) * 8.0;
        assert!(
            (simd - scalar).abs() <= bound,
            "{what}: simd {simd} vs scalar {scalar} (bound {bound})"
        );
    }

    fn packed(kernel: PackedDot, w: &[u8], s: &[u8], x: &[f32]) -> f32 {
        let mut split = AlignedFloats::default();
        (kernel.dot)(w, s, kernel.input_order.arrange(x, x.len(), &mut split))
    }

    #[test]
    fn simd_dots_match_the_scalar_reference() {
        let sets = simd_sets();
        if sets.is_empty() {
            eprintln!("no SIMD kernels on this CPU: nothing to compare");
            return;
        }
        for kernels in sets {
            let name = kernels.name();
            for n in [32, 64, 96, 2880, 2880 + 32] {
                let x = values(n, 7);
                let w = values(n, 3);
                let row = bf16_bytes(&w);
                let magnitude: f32 = w.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
                let simd = float_dot(kernels)(FloatFormat::Bf16, &row, &x);
                let scalar = dot_dense_scalar(FloatFormat::Bf16, &row, &x);
                close(simd, scalar, magnitude, &format!("{name} bf16 n={n}"));

                let blocks: Vec<u8> = (0..n / 2).map(|i| (i * 37 + 11) as u8).collect();
                // Scales around 2^0, plus the extremes of E8M0.
                let scales: Vec<u8> = (0..n / 32).map(|g| [127, 120, 130, 1, 0][g % 5]).collect();
                let simd = packed(mxfp4_dot(kernels), &blocks, &scales, &x);
                let scalar = dot_mxfp4_scalar(&blocks, &scales, &x);
                let x_sum = x.iter().map(|v| v.abs()).sum::<f32>();
                close(
                    simd,
                    scalar,
                    6.0 * 8.0 * x_sum,
                    &format!("{name} mxfp4 n={n}"),
                );

                let int4_scales: Vec<u8> = (0..n / 32)
                    .flat_map(|g| half::f16::from_f32(0.01 * (g % 7 + 1) as f32).to_le_bytes())
                    .collect();
                let simd = packed(int4_dot(kernels), &blocks, &int4_scales, &x);
                let scalar = dot_int4_scalar(&blocks, &int4_scales, &x);
                close(
                    simd,
                    scalar,
                    8.0 * 0.07 * x_sum,
                    &format!("{name} int4 n={n}"),
                );

                let q8_values: Vec<u8> = (0..n).map(|i| (i * 89 + 3) as u8).collect();
                let simd = packed(q8_dot(kernels), &q8_values, &int4_scales, &x);
                let scalar = crate::cpu::q8::dot_q8_scalar(&q8_values, &int4_scales, &x);
                close(
                    simd,
                    scalar,
                    128.0 * 0.07 * x_sum,
                    &format!("{name} q8 n={n}"),
                );
            }
            // The same values stored as f32 or f16 sum in the same order: bit-identical.
            for n in [40, 2880] {
                let x = values(n, 5);
                let bf16 = bf16_bytes(&values(n, 9));
                let widened: Vec<u8> = bf16
                    .chunks_exact(2)
                    .flat_map(|b| crate::formats::bf16_to_f32(b[0], b[1]).to_le_bytes())
                    .collect();
                let as_f16: Vec<u8> = [0u8, 0x3c, 0x00, 0xc0].repeat(n / 2); // 1.0, -2.0, ...
                let as_f32: Vec<u8> = [1.0f32, -2.0]
                    .repeat(n / 2)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect();
                let dot = float_dot(kernels);
                assert_eq!(
                    dot(FloatFormat::Bf16, &bf16, &x),
                    dot(FloatFormat::F32, &widened, &x),
                    "{name}"
                );
                assert_eq!(
                    dot(FloatFormat::F16, &as_f16, &x),
                    dot(FloatFormat::F32, &as_f32, &x),
                    "{name}"
                );
            }
            // Odd lengths: the tail runs scalar.
            for n in [13, 77] {
                let x = values(n, 1);
                let row = bf16_bytes(&values(n, 2));
                close(
                    float_dot(kernels)(FloatFormat::Bf16, &row, &x),
                    dot_dense_scalar(FloatFormat::Bf16, &row, &x),
                    n as f32,
                    &format!("{name} bf16 tail n={n}"),
                );
            }
        }
    }

    #[test]
    fn batched_dots_equal_one_input_dots_bit_for_bit() {
        let n = 2880 + 32; // 22 runs of four groups and 3 groups after them (45.5 float steps)
        // Up to 15 inputs: every remainder of blocks of four, and of eight alone and after a
        // whole block.
        let inputs: Vec<Vec<f32>> = (0..15).map(|t| values(n, 11 + t)).collect();
        let row = bf16_bytes(&values(n, 4));
        let wide_blocks: Vec<u8> = (0..2 * n + 16 * TILE_ROWS)
            .map(|i| (i * 29 + 1) as u8)
            .collect();
        let scales: Vec<u8> = (0..n / 32).map(|g| 120 + (g % 9) as u8).collect();
        let int4_scales: Vec<u8> = (0..n / 32)
            .flat_map(|g| half::f16::from_f32(0.02 * (g % 5 + 1) as f32).to_le_bytes())
            .collect();
        for kernels in std::iter::once(CpuKernels::Scalar).chain(simd_sets()) {
            for count in 1..=inputs.len() {
                let xs: Vec<&[f32]> = inputs[..count].iter().map(Vec::as_slice).collect();
                let mut sums = vec![0f32; count];
                float_dot_each(kernels)(FloatFormat::Bf16, &row, &xs, &mut sums);
                for (x, sum) in xs.iter().zip(&sums) {
                    assert_eq!(*sum, float_dot(kernels)(FloatFormat::Bf16, &row, x));
                }
                let float_rows: Vec<&[u8]> = (0..TILE_ROWS)
                    .map(|r| &wide_blocks[2 * r..2 * r + 2 * n])
                    .collect();
                // Consecutive rows through decode's entry, one input: every remainder of its
                // blocks of rows.
                let consecutive_rows = bf16_bytes(&values(9 * n, 77));
                for rows in [1, 2, 3, 5, 9] {
                    let bytes = &consecutive_rows[..2 * n * rows];
                    let mut each_row = vec![0f32; rows];
                    super::float_rows(kernels)(FloatFormat::Bf16, bytes, xs[0], &mut each_row);
                    for (r, row) in bytes.chunks_exact(2 * n).enumerate() {
                        assert_eq!(
                            each_row[r].to_bits(),
                            float_dot(kernels)(FloatFormat::Bf16, row, xs[0]).to_bits(),
                            "{kernels:?} float rows of {rows}, row {r}"
                        );
                    }
                }
                // Row counts that leave every remainder of the tile's blocks of rows.
                for rows in [1, 6, 7, TILE_ROWS] {
                    let mut tiled = vec![0f32; rows * count];
                    float_tile(kernels)(FloatFormat::Bf16, &float_rows[..rows], &xs, &mut tiled);
                    for (r, row) in float_rows[..rows].iter().enumerate() {
                        for (t, x) in xs.iter().enumerate() {
                            assert_eq!(
                                tiled[r * count + t].to_bits(),
                                float_dot(kernels)(FloatFormat::Bf16, row, x).to_bits(),
                                "{kernels:?} float tile of {rows}, row {r} input {t}"
                            );
                        }
                    }
                }
                // Row bytes: 4-bit codes, or q8's signed bytes.
                for (kernel, scales, row_bytes) in [
                    (mxfp4_dot(kernels), &scales, n / 2),
                    (int4_dot(kernels), &int4_scales, n / 2),
                    (q8_dot(kernels), &int4_scales, n),
                ] {
                    let blocks = &wide_blocks[8..8 + row_bytes];
                    let arranged: Vec<Vec<f32>> = xs
                        .iter()
                        .map(|x| {
                            let mut a = AlignedFloats::default();
                            kernel.input_order.arrange(x, n, &mut a).to_vec()
                        })
                        .collect();
                    let refs: Vec<&[f32]> = arranged.iter().map(Vec::as_slice).collect();
                    (kernel.dot_each)(blocks, scales, &refs, &mut sums);
                    for (x, sum) in refs.iter().zip(&sums) {
                        assert_eq!(*sum, (kernel.dot)(blocks, scales, x), "{kernels:?}");
                    }
                    // A tile of rows (the same row's bytes shifted, so rows differ).
                    // Each row its own scales too (the row's scales rotated by r groups), so that a
                    // kernel pairing one row's bytes with another's scales fails.
                    let scale_bytes = scales.len() / (n / 32);
                    let row_scales: Vec<Vec<u8>> = (0..TILE_ROWS)
                        .map(|r| {
                            let mut rotated = scales.to_vec();
                            rotated.rotate_left(r * scale_bytes);
                            rotated
                        })
                        .collect();
                    let rows: Vec<(&[u8], &[u8])> = (0..TILE_ROWS)
                        .map(|r| (&wide_blocks[r * 16..r * 16 + row_bytes], &row_scales[r][..]))
                        .collect();
                    // Consecutive rows through the decode entry as two runs side by side, one
                    // input at a time: even runs, and uneven ones (rows without a partner at
                    // the end of the first run or of the second).
                    let consecutive: Vec<u8> =
                        rows.iter().flat_map(|r| r.0.iter().copied()).collect();
                    let all_scales = row_scales.concat();
                    let row_scales = scales.len();
                    for (i, x) in refs.iter().enumerate() {
                        let count = [TILE_ROWS, TILE_ROWS - 1, TILE_ROWS - 1, 5][i % 4];
                        let split = [count / 2, count / 2, count / 2 + 1, 4][i % 4];
                        let run = |rows: std::ops::Range<usize>| {
                            (
                                &consecutive[rows.start * row_bytes..rows.end * row_bytes],
                                &all_scales[rows.start * row_scales..rows.end * row_scales],
                            )
                        };
                        let mut each_row = vec![0f32; count];
                        let (first, second) = each_row.split_at_mut(split);
                        (kernel.rows)([run(0..split), run(split..count)], x, [first, second]);
                        for (r, (packed, s)) in rows[..count].iter().enumerate() {
                            assert_eq!(
                                each_row[r].to_bits(),
                                (kernel.dot)(packed, s, x).to_bits(),
                                "{kernels:?} consecutive rows, row {r}"
                            );
                        }
                    }
                    for count in [1, 5, TILE_ROWS] {
                        let mut tiled = vec![0f32; count * refs.len()];
                        (kernel.tile)(&rows[..count], &refs, &mut tiled);
                        for (r, (packed, s)) in rows[..count].iter().enumerate() {
                            for (t, x) in refs.iter().enumerate() {
                                assert_eq!(
                                    tiled[r * refs.len() + t].to_bits(),
                                    (kernel.dot)(packed, s, x).to_bits(),
                                    "{kernels:?} tile of {count}, row {r}, input {t}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Tiles over more inputs than one block of any kernel's (AVX2's MXFP4 panels take 16 inputs
    /// per pass over a row's groups, four at a time), rows in every remainder of three, each
    /// result bit-identical to one input's dot.
    #[test]
    fn tiles_of_many_inputs_equal_one_input_dots_bit_for_bit() {
        let n = 32 * 45; // 45 groups: two blocks of 16 and one of 13
        let rows = 7;
        let bytes: Vec<u8> = (0..n + 16 * rows).map(|i| (i * 37 + 5) as u8).collect();
        let row_scales: Vec<Vec<u8>> = (0..rows)
            .map(|r| (0..n / 32).map(|g| 117 + ((g + 2 * r) % 7) as u8).collect())
            .collect();
        let inputs: Vec<Vec<f32>> = (0..37).map(|t| values(n, 40 + t)).collect();
        for kernels in std::iter::once(CpuKernels::Scalar).chain(simd_sets()) {
            let kernel = mxfp4_dot(kernels);
            let arranged: Vec<Vec<f32>> = inputs
                .iter()
                .map(|x| {
                    let mut a = AlignedFloats::default();
                    kernel.input_order.arrange(x, n, &mut a).to_vec()
                })
                .collect();
            let xs: Vec<&[f32]> = arranged.iter().map(Vec::as_slice).collect();
            let tile_rows: Vec<(&[u8], &[u8])> = (0..rows)
                .map(|r| (&bytes[16 * r..16 * r + n / 2], &row_scales[r][..]))
                .collect();
            let mut tiled = vec![0f32; rows * xs.len()];
            (kernel.tile)(&tile_rows, &xs, &mut tiled);
            for (r, (packed, scales)) in tile_rows.iter().enumerate() {
                for (t, x) in xs.iter().enumerate() {
                    assert_eq!(
                        tiled[r * xs.len() + t].to_bits(),
                        (kernel.dot)(packed, scales, x).to_bits(),
                        "{kernels:?} row {r}, input {t}"
                    );
                }
            }
        }
    }

    /// Every MXFP4 kernel this CPU runs that folds or scales per run (the byte tables of AVX2
    /// and NEON, AVX-512's folded one (VBMI) and its per-run one), and the per-group kernels the
    /// byte tables replaced.
    fn mxfp4_kernels() -> Vec<(&'static str, PackedDot)> {
        #[cfg_attr(
            not(any(target_arch = "x86_64", target_arch = "aarch64")),
            allow(unused_mut) // none elsewhere
        )]
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        if detect() >= CpuKernels::Avx2 {
            kernels.push(("byte tables", avx2_mxfp4_dot()));
            kernels.push(("per group", avx2_packed_dot::<PACKED_MXFP4>()));
        }
        #[cfg(target_arch = "x86_64")]
        if detect() >= CpuKernels::Avx512 {
            kernels.push(("per-run", mxfp4_dot_per_run()));
            if has_vbmi() {
                kernels.push(("folded", mxfp4_dot(CpuKernels::Avx512)));
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            kernels.push(("NEON byte tables", neon_mxfp4_dot()));
            kernels.push(("NEON per group", neon_packed_dot::<PACKED_MXFP4>()));
        }
        kernels
    }

    #[test]
    fn mxfp4_kernels_match_the_scalar_reference_at_every_scale() {
        let n = 2880 + 32; // 22 runs and 3 groups after them
        let mut x = values(n, 13);
        // Groups 0, 5 and 40 get scales up to 2^127 below: small inputs keep their sums finite.
        for g in [0, 5, 40] {
            x[32 * g..32 * g + 32].iter_mut().for_each(|v| *v *= 1e-3);
        }
        let x_sum = x.iter().map(|v| v.abs()).sum::<f32>();
        let blocks: Vec<u8> = (0..n / 2).map(|i| (i * 59 + 3) as u8).collect();
        // Ordinary scales, then rows with scales whose folded table would overflow (253, 254):
        // those rows must scale each group's sum instead, and give the same values.
        let ordinary: Vec<u8> = (0..n / 32).map(|g| 110 + (g % 30) as u8).collect();
        let mut large = ordinary.clone();
        large[5] = 253;
        large[40] = 254;
        let mut at_the_edge = vec![127u8; n / 32];
        at_the_edge[0] = 254;
        // The smallest scales: weights down to 2^-128, below the normal floats.
        let tiny: Vec<u8> = (0..n / 32).map(|g| (g % 8) as u8).collect();
        for (name, kernel) in mxfp4_kernels() {
            // Two runs of rows through the decode entry, which pairs row i of one with row i of
            // the other: every pairing of rows that fold and rows that do not, then a row
            // alone (at the end of either run). The same values as one by one.
            let mut arranged = AlignedFloats::default();
            let input = kernel.input_order.arrange(&x, n, &mut arranged);
            let kinds = [&ordinary, &large, &at_the_edge];
            let mut first: Vec<&Vec<u8>> = kinds.iter().flat_map(|k| [*k; 3]).collect();
            first.push(&ordinary);
            let second: Vec<&Vec<u8>> = (0..3).flat_map(|_| kinds).collect();
            // Runs of rows that all fold, one longer than the other (the AVX2 and NEON kernels
            // take two rows of each run at a time where all four fold).
            let folding: Vec<&Vec<u8>> = vec![&ordinary, &tiny, &ordinary, &ordinary, &tiny];
            let longer: Vec<&Vec<u8>> = vec![&tiny, &ordinary, &ordinary, &tiny, &tiny, &ordinary];
            // Runs that do not fold as a whole, whose first rows do (a batch of folding rows
            // found row by row).
            let folding_first: Vec<&Vec<u8>> = vec![&ordinary, &ordinary, &ordinary, &tiny, &large];
            let then_edge: Vec<&Vec<u8>> =
                vec![&tiny, &ordinary, &ordinary, &tiny, &ordinary, &at_the_edge];
            for runs in [
                [&first, &second],
                [&second, &first],
                [&folding, &longer],
                [&longer, &folding],
                [&folding_first, &then_edge],
            ] {
                let mut outs = runs.map(|run| vec![0f32; run.len()]);
                let bytes = runs.map(|run| blocks.repeat(run.len()));
                let scales =
                    runs.map(|run| run.iter().map(|s| &s[..]).collect::<Vec<_>>().concat());
                let [a, b] = &mut outs;
                (kernel.rows)(
                    [(&bytes[0], &scales[0]), (&bytes[1], &scales[1])],
                    input,
                    [a, b],
                );
                for (run, out) in runs.iter().zip(&outs) {
                    for (scales, row) in run.iter().zip(out) {
                        assert_eq!(
                            row.to_bits(),
                            (kernel.dot)(&blocks, scales, input).to_bits(),
                            "{name}"
                        );
                    }
                }
            }
            for scales in [&ordinary, &large, &at_the_edge, &tiny] {
                let mut magnitude = 0f32;
                for (g, s) in scales.iter().enumerate() {
                    let group: f32 = x[32 * g..32 * g + 32].iter().map(|v| v.abs()).sum();
                    magnitude += 6.0 * group * crate::formats::e8m0_scale(*s);
                }
                let simd = packed(kernel, &blocks, scales, &x);
                let scalar = dot_mxfp4_scalar(&blocks, scales, &x);
                assert!(simd.is_finite(), "{name}: {simd}");
                close(simd, scalar, magnitude.max(x_sum), &format!("{name} mxfp4"));
                if scales == &tiny {
                    // Far below `close`'s absolute floor: relative to the products' magnitude.
                    assert!(
                        simd != 0.0 && (simd - scalar).abs() <= 8e-6 * magnitude,
                        "{name} tiny scales: simd {simd:e} vs scalar {scalar:e}"
                    );
                }
            }
            // Rows of every kind (and different bytes) in one tile, and each through dot_each,
            // times a block of eight distinct inputs and three more: each value bit-identical to
            // the one-row dot's.
            let shifted = |by: usize| -> Vec<u8> {
                blocks
                    .iter()
                    .map(|b| b.wrapping_add(by as u8 * 37))
                    .collect()
            };
            let row_bytes = [shifted(0), shifted(1), shifted(2), shifted(3)];
            let row_scales = [&ordinary, &large, &tiny, &at_the_edge];
            let xs: Vec<Vec<f32>> = (0..11u32)
                .map(|t| {
                    let mut x = values(n, 14 + t);
                    for g in [0, 5, 40] {
                        x[32 * g..32 * g + 32].iter_mut().for_each(|v| *v *= 1e-3);
                    }
                    let mut arranged = AlignedFloats::default();
                    kernel.input_order.arrange(&x, n, &mut arranged).to_vec()
                })
                .collect();
            let inputs: Vec<&[f32]> = xs.iter().map(|x| &x[..]).collect();
            let rows: Vec<(&[u8], &[u8])> = row_bytes
                .iter()
                .zip(row_scales)
                .map(|(b, s)| (&b[..], &s[..]))
                .collect();
            let mut tiled = vec![0f32; rows.len() * inputs.len()];
            (kernel.tile)(&rows, &inputs, &mut tiled);
            for (r, &(bytes, scales)) in rows.iter().enumerate() {
                let mut each = vec![0f32; inputs.len()];
                (kernel.dot_each)(bytes, scales, &inputs, &mut each);
                for (t, input) in inputs.iter().enumerate() {
                    let dot = (kernel.dot)(bytes, scales, input).to_bits();
                    let what = format!("{name}: row {r}, input {t}");
                    assert_eq!(each[t].to_bits(), dot, "{what} (dot_each)");
                    assert_eq!(tiled[r * inputs.len() + t].to_bits(), dot, "{what} (tile)");
                }
            }
        }
    }

    /// Nibble `i` (weight order: low nibble first) of a packed row.
    fn nibble(packed: &[u8], i: usize) -> u8 {
        (packed[i / 2] >> (4 * (i % 2))) & 0xf
    }

    #[test]
    fn interleaving_puts_weight_w_of_each_group_in_word_w() {
        let cols = 2880 + 32; // 22 runs, then 3 groups
        let groups = cols / 32;
        let rows = 3;
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 + 11) as u8).collect();
        let mut scales: Vec<u8> = (0..rows * groups).map(|g| 100 + (g % 50) as u8).collect();
        scales[groups + 7] = 253; // row 1 does not fold
        let mut interleaved = packed.clone();
        if !interleave_mxfp4_runs(&mut interleaved, &scales, cols) {
            assert_eq!(
                interleaved, packed,
                "nothing changes where the kernel is absent"
            );
            return;
        }
        let row_bytes = cols / 2;
        for r in 0..rows {
            let (before, after) = (
                &packed[r * row_bytes..(r + 1) * row_bytes],
                &interleaved[r * row_bytes..(r + 1) * row_bytes],
            );
            if r == 1 {
                assert_eq!(before, after, "a row that does not fold keeps its layout");
                continue;
            }
            for c in 0..groups / 4 {
                for w in 0..32 {
                    for k in 0..4 {
                        assert_eq!(
                            nibble(after, 128 * c + 4 * w + k),
                            nibble(before, 128 * c + 32 * k + w),
                            "row {r}, run {c}, word {w}, group {k}"
                        );
                    }
                }
            }
            assert_eq!(
                before[64 * (groups / 4)..],
                after[64 * (groups / 4)..],
                "tail groups"
            );
        }
    }

    #[test]
    fn the_interleaved_kernel_gives_the_folded_kernels_bits() {
        let Some(interleaved) = mxfp4_interleaved_dot() else {
            return; // This CPU runs no kernel over interleaved runs (nothing interleaves them).
        };
        let folded = mxfp4_dot(CpuKernels::Avx512);
        let n = 2880 + 32;
        let groups = n / 32;
        let x = values(n, 29);
        let mut arranged = AlignedFloats::default();
        let input = folded.input_order.arrange(&x, n, &mut arranged);
        // Seven rows: ordinary scales, one that does not fold, scales at both ends of the
        // folding range.
        let rows = 7;
        let blocks: Vec<u8> = (0..rows * n / 2).map(|i| (i * 59 + 3) as u8).collect();
        let mut scales: Vec<u8> = (0..rows * groups).map(|g| 110 + (g % 30) as u8).collect();
        scales[2 * groups + 40] = 254;
        scales[4 * groups..5 * groups].fill(0);
        scales[5 * groups..6 * groups].fill(252);
        let mut moved = blocks.clone();
        assert!(interleave_mxfp4_runs(&mut moved, &scales, n));
        let row = |bytes: &[u8], r: usize| {
            let (b, s) = (
                &bytes[r * n / 2..(r + 1) * n / 2],
                &scales[r * groups..(r + 1) * groups],
            );
            (b.to_vec(), s.to_vec())
        };
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for r in 0..rows {
            let ((b, s), (m, _)) = (row(&blocks, r), row(&moved, r));
            let expected = (folded.dot)(&b, &s, input);
            assert_eq!(
                (interleaved.dot)(&m, &s, input).to_bits(),
                expected.to_bits(),
                "row {r}"
            );
            let inputs = [input; 11];
            let mut each = [0f32; 11];
            (interleaved.dot_each)(&m, &s, &inputs, &mut each);
            assert_eq!(bits(&each), [expected.to_bits(); 11], "row {r}, each");
        }
        // Tiles of every row, and decode's two runs (4 rows and 3).
        let all: Vec<(Vec<u8>, Vec<u8>)> = (0..rows).map(|r| row(&moved, r)).collect();
        let refs: Vec<(&[u8], &[u8])> = all.iter().map(|(b, s)| (&b[..], &s[..])).collect();
        let plain: Vec<(Vec<u8>, Vec<u8>)> = (0..rows).map(|r| row(&blocks, r)).collect();
        let plain_refs: Vec<(&[u8], &[u8])> = plain.iter().map(|(b, s)| (&b[..], &s[..])).collect();
        // Different inputs, as many as leave every remainder of the kernels' blocks of inputs.
        let xs: Vec<Vec<f32>> = (0..9).map(|t| values(n, 31 + t)).collect();
        let mut arranged: Vec<AlignedFloats> =
            xs.iter().map(|_| AlignedFloats::default()).collect();
        let inputs: Vec<&[f32]> = xs
            .iter()
            .zip(&mut arranged)
            .map(|(x, a)| folded.input_order.arrange(x, n, a))
            .collect();
        for count in 1..=inputs.len() {
            let inputs = &inputs[..count];
            let (mut a, mut b) = (vec![0f32; rows * count], vec![0f32; rows * count]);
            (interleaved.tile)(&refs, inputs, &mut a);
            (folded.tile)(&plain_refs, inputs, &mut b);
            assert_eq!(bits(&a), bits(&b), "tiles of {count} inputs");
            for (r, (m, s)) in refs.iter().enumerate() {
                for (t, input) in inputs.iter().enumerate() {
                    let dot = (interleaved.dot)(m, s, input);
                    assert_eq!(
                        a[r * count + t].to_bits(),
                        dot.to_bits(),
                        "row {r} input {t}"
                    );
                }
            }
        }
        let split = 4 * n / 2;
        let (scales_first, scales_second) = scales.split_at(4 * groups);
        let decode = |kernel: &PackedDot, bytes: &[u8]| {
            let mut outs = [vec![0f32; 4], vec![0f32; 3]];
            let [first, second] = &mut outs;
            let runs = [
                (&bytes[..split], scales_first),
                (&bytes[split..], scales_second),
            ];
            (kernel.rows)(runs, input, [first, second]);
            outs.map(|v| bits(&v))
        };
        let (a, b) = (decode(&interleaved, &moved), decode(&folded, &blocks));
        assert_eq!(a, b, "decode rows");
    }

    #[test]
    fn group_halves_put_even_inputs_first() {
        let x: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let mut arranged = AlignedFloats::default();
        let got = InputOrder::GroupHalves.arrange(&x, 64, &mut arranged);
        let expected: Vec<f32> = (0..2)
            .flat_map(|g| (0..32).map(move |k| (32 * g + 2 * (k % 16) + k / 16) as f32))
            .collect();
        assert_eq!(got, expected);
    }

    #[test]
    fn arranged_input_follows_the_nibbles_of_each_word() {
        // Two rows of 160 inputs: one run of 128, then one group split into evens and odds.
        let x: Vec<f32> = (0..320).map(|i| i as f32).collect();
        let mut arranged = AlignedFloats::default();
        arrange_packed_input(&x, 160, &mut arranged);
        let expected: Vec<f32> = (0..2)
            .flat_map(|row| {
                let base = 160 * row;
                let run = (0..8).flat_map(move |k| (0..16).map(move |i| base + 8 * i + k));
                let evens = (0..16).map(move |j| base + 128 + 2 * j);
                let odds = (0..16).map(move |j| base + 128 + 2 * j + 1);
                run.chain(evens).chain(odds).map(|v| v as f32)
            })
            .collect();
        assert_eq!(*arranged, expected);
    }
}
