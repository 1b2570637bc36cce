//! AMX-BF16 tiles (Intel Xeon since Sapphire Rapids) for bf16 dense layers over several tokens
//! (prompt processing). One `tdpbf16ps` multiplies 16 weight rows by 32 inputs of five tokens,
//! 2560 multiply-adds, in the time the AVX-512 kernels take for about 500.
//!
//! Exact like the FMA kernels: each f32 input is cut into three bf16 parts that add up to it
//! (its significand's top, middle and low 8 bits), a bf16 weight times a bf16 part is exact in
//! f32, and the tile adds the products in f32, rounding to nearest even. A token's three parts
//! sit in three columns of the tile, whose sums are added at the end. The tiles treat subnormal
//! bf16 values as zero, so only inputs smaller than about 2^-110 lose their low parts (an error
//! below 2^-126 per product).
//!
//! Not the default: a prompt's dense layers would then round differently from the same tokens
//! fed one at a time (which take the AVX-512 kernels), and the CPU tier keeps batching
//! bit-identical. `PICCHIO_CPU_AMX=on` turns the tiles on where `kernels()` is AVX-512, the CPU
//! has AMX-TILE and AMX-BF16, and Linux grants the process the tile state.

use std::arch::asm;
use std::sync::OnceLock;

use rayon::prelude::*;

/// Tokens per input tile: three columns each, 15 of the tile's 16.
const TOKENS_PER_TILE: usize = 5;
/// Token blocks whose sums stay in tile registers at once: tiles 0-2 (3 and 4 take the
/// weights, 5-7 the inputs).
const SUMS_PER_PASS: usize = 3;
/// Rows per weight tile, and rows per call of `rows16`.
pub const ROWS: usize = 16;
/// Inputs per tile step (32 bf16 weights of each row, one 64-byte tile row).
const STEP: usize = 32;

/// Whether the bf16 dense layers use AMX tiles (decided once): only when asked for with
/// `PICCHIO_CPU_AMX=on`, on AVX-512 kernels, where `usable()`.
pub fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        match std::env::var("PICCHIO_CPU_AMX").as_deref() {
            Ok("on") => {}
            Err(_) | Ok("off") => return false,
            Ok(other) => {
                log::warn!("PICCHIO_CPU_AMX={other:?} is not on or off: ignored (off)");
                return false;
            }
        }
        if super::kernels() != super::CpuKernels::Avx512 {
            log::info!("PICCHIO_CPU_AMX=on: no AMX tiles below AVX-512 kernels");
            return false;
        }
        let usable = usable();
        if usable {
            log::info!("bf16 dense layers over several tokens use AMX-BF16 tiles");
        } else {
            log::warn!("PICCHIO_CPU_AMX=on, but this CPU or OS has no AMX-BF16 tiles");
        }
        usable
    })
}

/// Whether this CPU and OS run AMX-BF16 tiles (detected once).
pub fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE.get_or_init(detect)
}

/// Whether this CPU and OS run AMX-BF16: CPUID's AMX-TILE and AMX-BF16 bits, the OS saving the
/// tile state (XCR0 bits 17 and 18), and (Linux) the process granted that state.
fn detect() -> bool {
    use std::arch::x86_64::{__cpuid, __cpuid_count};
    // Leaf 7 is read only where the maximum leaf allows it.
    let max_leaf = __cpuid(0).eax;
    let leaf7 = (max_leaf >= 7).then(|| __cpuid_count(7, 0));
    let leaf1 = __cpuid(1);
    let Some(leaf7) = leaf7 else { return false };
    let (amx_bf16, amx_tile) = (leaf7.edx & (1 << 22) != 0, leaf7.edx & (1 << 24) != 0);
    let os_saves_state = leaf1.ecx & (1 << 27) != 0;
    if !amx_bf16 || !amx_tile || !os_saves_state {
        return false;
    }
    /// # Safety
    /// The CPU must have XSAVE with the OS enabling it (CPUID.1:ECX.OSXSAVE).
    #[target_feature(enable = "xsave")]
    unsafe fn xcr0() -> u64 {
        // Safety: the caller's guarantee.
        unsafe { std::arch::x86_64::_xgetbv(0) }
    }
    // Safety: OSXSAVE was checked above.
    let tile_state = unsafe { xcr0() } & (0b11 << 17) == 0b11 << 17;
    tile_state && granted()
}

/// Asks Linux for the tile data state (without it the first tile instruction faults).
#[cfg(target_os = "linux")]
fn granted() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // Safety: arch_prctl with these arguments only changes the process's permissions.
    let status = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if status != 0 {
        log::info!(
            "no AMX tiles: Linux refused the tile state ({})",
            std::io::Error::last_os_error()
        );
    }
    status == 0
}

#[cfg(not(target_os = "linux"))]
fn granted() -> bool {
    false
}

/// Every token's input cut into three bf16 parts, laid out as the tiles read them: for each
/// block of five tokens and each step of 32 inputs, one 1 KiB tile whose row i holds, in column
/// 3 j + p, part p of token j's inputs 2i and 2i + 1 (one bf16 pair per 32-bit word).
pub struct SplitInputs {
    words: Vec<u32>,
    tokens: usize,
    steps: usize,
}

impl SplitInputs {
    /// `xs` holds `xs.len() / cols` tokens of `cols` inputs; `cols` is a multiple of 32.
    pub fn new(xs: &[f32], cols: usize) -> SplitInputs {
        assert!(cols.is_multiple_of(STEP) && xs.len().is_multiple_of(cols));
        let (tokens, steps) = (xs.len() / cols, cols / STEP);
        let blocks = tokens.div_ceil(TOKENS_PER_TILE);
        let mut words = vec![0u32; blocks * steps * ROWS * 16];
        // Blocks of five tokens in parallel (on one thread, this split weighed on a prompt's
        // layer time).
        words
            .par_chunks_mut(steps * ROWS * 16)
            .zip(xs.par_chunks(TOKENS_PER_TILE * cols))
            .for_each(|(tiles, tokens)| {
                for (j, x) in tokens.chunks_exact(cols).enumerate() {
                    for (k, pair) in x.chunks_exact(2).enumerate() {
                        let (s, i) = (k / (STEP / 2), k % (STEP / 2));
                        let row = (s * ROWS + i) * 16;
                        let (a, b) = (bf16_parts(pair[0]), bf16_parts(pair[1]));
                        for p in 0..3 {
                            tiles[row + 3 * j + p] = u32::from(a[p]) | u32::from(b[p]) << 16;
                        }
                    }
                }
            });
        SplitInputs {
            words,
            tokens,
            steps,
        }
    }

    /// The tile of token block `block`, step `s`.
    fn tile(&self, block: usize, s: usize) -> *const u32 {
        self.words[(block * self.steps + s) * ROWS * 16..].as_ptr()
    }
}

/// `x` as three bf16 values whose exact sum is `x`: the top 8 bits of its significand, the next
/// 8, the last 8 (each cut off, not rounded, so that nothing overflows).
fn bf16_parts(x: f32) -> [u16; 3] {
    let high = f32::from_bits(x.to_bits() & 0xffff_0000);
    let rest = x - high; // exact: the significand's low 16 bits
    let middle = f32::from_bits(rest.to_bits() & 0xffff_0000);
    let low = rest - middle; // exact, and at most 8 significant bits: a bf16 as it is
    [high, middle, low].map(|v| (v.to_bits() >> 16) as u16)
}

/// The tile configuration: palette 1, eight tiles of 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut bytes = [0u8; 64];
    bytes[0] = 1;
    let mut t = 0;
    while t < 8 {
        bytes[16 + 2 * t] = 64; // bytes per row (a u16, little-endian)
        bytes[48 + t] = ROWS as u8;
        t += 1;
    }
    TileConfig(bytes)
};

/// Loads the weights of one step into tile 3 + `a` (two, used in turn, so that one step's
/// loads need not wait for the last step's products).
///
/// # Safety
/// AMX-BF16 enabled and configured on this thread; 16 rows of 64 bytes at `p`, `stride` apart.
#[inline(always)]
unsafe fn load_weights(a: usize, p: *const u8, stride: usize) {
    // Safety: the caller's guarantees.
    unsafe {
        match a {
            0 => {
                asm!("tileloadd tmm3, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
            _ => {
                asm!("tileloadd tmm4, [{p} + {s}*1]", p = in(reg) p, s = in(reg) stride, options(nostack, readonly))
            }
        }
    }
}

/// Loads input tile `p` (1 KiB) into tile 5 + `j` and adds weight tile 3 + `a` times it into sum
/// tile `j`. Each sum has its own input tile: a tile is reused only once the product reading it
/// is done (tiles are not renamed), so separate ones keep three products in flight.
///
/// # Safety
/// As `load_weights`; `p` holds 1 KiB.
#[inline(always)]
unsafe fn multiply_into(j: usize, a: usize, p: *const u32) {
    let stride = 64usize;
    // Safety: the caller's guarantees.
    unsafe {
        macro_rules! product {
            ($input:literal, $weights:literal, $sum:literal) => {
                asm!(
                    concat!("tileloadd ", $input, ", [{p} + {s}*1]"),
                    concat!("tdpbf16ps ", $sum, ", ", $weights, ", ", $input),
                    p = in(reg) p,
                    s = in(reg) stride,
                    options(nostack, readonly)
                )
            };
        }
        match (j, a) {
            (0, 0) => product!("tmm5", "tmm3", "tmm0"),
            (0, _) => product!("tmm5", "tmm4", "tmm0"),
            (1, 0) => product!("tmm6", "tmm3", "tmm1"),
            (1, _) => product!("tmm6", "tmm4", "tmm1"),
            (_, 0) => product!("tmm7", "tmm3", "tmm2"),
            (_, _) => product!("tmm7", "tmm4", "tmm2"),
        }
    }
}

/// Zeroes sum tile `j`.
///
/// # Safety
/// AMX-BF16 enabled and configured on this thread.
#[inline(always)]
unsafe fn zero(j: usize) {
    // Safety: the caller's guarantee.
    unsafe {
        match j {
            0 => asm!("tilezero tmm0", options(nostack)),
            1 => asm!("tilezero tmm1", options(nostack)),
            _ => asm!("tilezero tmm2", options(nostack)),
        }
    }
}

/// Stores sum tile `j` (16 rows of 16 f32) to `out`.
///
/// # Safety
/// As `zero`.
#[inline(always)]
unsafe fn store(j: usize, out: &mut [[f32; 16]; ROWS]) {
    let (p, stride) = (out.as_mut_ptr(), 64usize);
    // Safety: as `zero`; the tile's 16 rows of 64 bytes fill `out` exactly.
    unsafe {
        match j {
            0 => {
                asm!("tilestored [{p} + {s}*1], tmm0", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            1 => {
                asm!("tilestored [{p} + {s}*1], tmm1", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
            _ => {
                asm!("tilestored [{p} + {s}*1], tmm2", p = in(reg) p, s = in(reg) stride, options(nostack))
            }
        }
    }
}

/// Sixteen consecutive bf16 rows times every token of `inputs`: `out[r * tokens + t]`. The rows
/// are `rows` (16 rows of `2 * cols` bytes, one after the other) and `inputs` was split from
/// `cols` inputs per token.
///
/// # Safety
/// `usable()` returned true.
pub unsafe fn rows16(rows: &[u8], inputs: &SplitInputs, out: &mut [f32]) {
    let stride = inputs.steps * STEP * 2;
    assert_eq!(rows.len(), ROWS * stride, "16 whole rows");
    assert_eq!(out.len(), ROWS * inputs.tokens);
    let blocks = inputs.tokens.div_ceil(TOKENS_PER_TILE);
    // Passes of at most six token blocks, as even as they come.
    let passes = blocks.div_ceil(SUMS_PER_PASS);
    let per_pass = blocks.div_ceil(passes);
    let mut sums = [[0f32; 16]; ROWS];
    // Safety: the caller's guarantee (AMX granted); the configuration is valid for palette 1.
    unsafe { asm!("ldtilecfg [{c}]", c = in(reg) CONFIG.0.as_ptr(), options(nostack)) };
    for (pass, first) in (0..blocks).step_by(per_pass).enumerate() {
        let count = per_pass.min(blocks - first);
        for j in 0..count {
            // Safety: as above.
            unsafe { zero(j) };
        }
        for s in 0..inputs.steps {
            if pass == 0 {
                // The first pass reads the rows from memory: ask for them eight steps ahead.
                for r in 0..ROWS {
                    let ahead = rows.as_ptr().wrapping_add(r * stride + (s + 8) * 64);
                    // Safety: a prefetch never faults, whatever the address.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                            ahead.cast(),
                        )
                    };
                }
            }
            let weights = rows[s * 64..].as_ptr();
            // Safety: AMX as above; the weight tile reads 64 bytes of each of the 16 rows at
            // `weights` (step s of each row exists: `s < steps`), each input tile the 1 KiB
            // tile of (block, s), which `SplitInputs` holds.
            unsafe {
                load_weights(s % 2, weights, stride);
                for j in 0..count {
                    multiply_into(j, s % 2, inputs.tile(first + j, s));
                }
            }
        }
        for j in 0..count {
            // Safety: as above.
            unsafe { store(j, &mut sums) };
            let block = first + j;
            for (r, row) in sums.iter().enumerate() {
                let tokens =
                    block * TOKENS_PER_TILE..((block + 1) * TOKENS_PER_TILE).min(inputs.tokens);
                for (k, t) in tokens.enumerate() {
                    out[r * inputs.tokens + t] = row[3 * k] + row[3 * k + 1] + row[3 * k + 2];
                }
            }
        }
    }
    // Safety: AMX as above; releasing returns the tile state to its initial (cheap) form.
    unsafe { asm!("tilerelease", options(nostack)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_bf16_parts_add_up_to_the_input_exactly() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..100_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let x = f32::from_bits(state as u32);
            if !x.is_finite() || x.abs() < 1e-30 {
                continue;
            }
            let parts = bf16_parts(x).map(|p| f32::from_bits(u32::from(p) << 16));
            assert_eq!(
                (parts[0] + parts[1]) + parts[2],
                x,
                "{x:e} split as {parts:?}"
            );
        }
    }
}
