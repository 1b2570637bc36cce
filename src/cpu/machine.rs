//! What the CPU tier needs to know about the machine: how many threads to run and how fast
//! memory reads (the roofline decode speed is judged against).

use std::time::Instant;

use rayon::prelude::*;

/// Physical cores (not hardware threads): the CPU tier's default thread count. Decode is bound
/// by memory bandwidth, which a second thread per core does not add to, while its share of the
/// core's execution ports slows the first.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        // Distinct (physical id, core id) pairs; absent fields (some VMs, non-x86) fall back.
        let mut cores = std::collections::BTreeSet::new();
        let (mut package, mut core) = (None, None);
        for line in info.lines().chain(std::iter::once("")) {
            let mut field = line.splitn(2, ':').map(str::trim);
            match (field.next(), field.next()) {
                (Some("physical id"), Some(v)) => package = Some(v.to_string()),
                (Some("core id"), Some(v)) => core = Some(v.to_string()),
                (Some(""), _) | (None, _) => {
                    if let (Some(p), Some(c)) = (package.take(), core.take()) {
                        cores.insert((p, c));
                    }
                }
                _ => {}
            }
        }
        if !cores.is_empty() {
            return cores.len().min(logical);
        }
    }
    logical
}

/// Sets the CPU tier's thread count (`None`: physical cores) for the rest of the process.
/// Must run before any parallel work; a second call keeps the first pool.
/// The most threads `set_threads` starts per logical CPU.
pub const MAX_THREADS_PER_LOGICAL_CPU: usize = 4;

/// Logical CPUs this process may run on.
fn logical_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

pub fn set_threads(threads: Option<usize>) -> crate::error::Result<usize> {
    let mut threads = threads.unwrap_or_else(physical_cores);
    if threads == 0 {
        return Err(crate::error::Error::InvalidArgument(
            "--threads must be at least 1".into(),
        ));
    }
    // More threads than this only add scheduling and memory (each has its own stack).
    let most = MAX_THREADS_PER_LOGICAL_CPU * logical_cpus();
    if threads > most {
        log::warn!(
            "--threads {threads} is more than {MAX_THREADS_PER_LOGICAL_CPU} per logical CPU; using {most}"
        );
        threads = most;
    }
    if let Err(e) = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("picchio-cpu-{i}"))
        .build_global()
    {
        log::warn!("thread pool already running ({e}); keeping it");
    }
    Ok(rayon::current_num_threads())
}

/// The smallest buffer a bandwidth measurement reads.
const MIN_BANDWIDTH_BUFFER_BYTES: usize = 2 << 30;

/// How many times the last-level cache a bandwidth measurement reads. A cache keeps part of a
/// buffer from one pass to the next when the buffer is only a few times its size, while a
/// decoded token reads several GB between two reads of the same weights: a smaller buffer would
/// flatter the memory a decoded token reads.
const BUFFER_PER_LAST_LEVEL_CACHE: usize = 8;

/// Size of the largest CPU cache, where the OS says (Linux: sysfs).
pub fn last_level_cache_bytes() -> Option<usize> {
    #[cfg(target_os = "linux")]
    {
        let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
        caches
            .flatten()
            .filter_map(|entry| std::fs::read_to_string(entry.path().join("size")).ok())
            .filter_map(|size| parse_cache_size(&size))
            .max()
    }
    #[cfg(not(target_os = "linux"))]
    None
}

/// A sysfs cache size: bytes, or a count of KiB ("2048K") or MiB ("32M").
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn parse_cache_size(text: &str) -> Option<usize> {
    let text = text.trim();
    let (digits, unit) = match text.as_bytes().last()? {
        b'K' => (&text[..text.len() - 1], 1 << 10),
        b'M' => (&text[..text.len() - 1], 1 << 20),
        b'G' => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(unit)
}

/// The buffer a bandwidth measurement should read: `BUFFER_PER_LAST_LEVEL_CACHE` times the
/// last-level cache, at least 2 GiB, and no more than half the memory available
/// (`experts::available_memory_bytes`, cgroup limits included; the measurement runs while no
/// model is loaded).
pub fn bandwidth_buffer_bytes() -> usize {
    let available =
        crate::experts::available_memory_bytes().map(|a| usize::try_from(a).unwrap_or(usize::MAX));
    bandwidth_buffer_for(last_level_cache_bytes(), available)
}

fn bandwidth_buffer_for(cache: Option<usize>, available: Option<usize>) -> usize {
    let wanted = cache.map_or(0, |c| c.saturating_mul(BUFFER_PER_LAST_LEVEL_CACHE));
    let room = available.map_or(usize::MAX, |a| a / 2);
    wanted.min(room).max(MIN_BANDWIDTH_BUFFER_BYTES)
}

/// A measured memory read bandwidth.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Bandwidth {
    /// The best pass, bytes per second.
    pub bytes_per_s: f64,
    /// Size of the buffer read (larger than the caches).
    pub buffer_bytes: usize,
    pub passes: usize,
    pub threads: usize,
    /// Whether the buffer asked for huge pages (as weights copied into memory do) or small ones
    /// (as mapped files have).
    pub huge_pages: bool,
}

/// Reads a `buffer_bytes` buffer `passes` times with every thread of the CPU tier's pool, as the
/// kernels read weights (each thread its own chunks, several streams at once), and keeps the
/// fastest pass. The buffer should be several times the last-level cache. `huge_pages` picks the
/// page size the weights being judged live in: huge pages read faster (fewer TLB misses).
pub fn measure_read_bandwidth(buffer_bytes: usize, passes: usize, huge_pages: bool) -> Bandwidth {
    let words = (buffer_bytes / 8).max(CHUNK_WORDS);
    let mut buffer = match memmap2::MmapMut::map_anon(words * 8) {
        Ok(buffer) => buffer,
        Err(e) => {
            log::warn!("no buffer to measure the read bandwidth with: {e}");
            return Bandwidth {
                bytes_per_s: 0.0,
                buffer_bytes: 0,
                passes: 0,
                threads: rayon::current_num_threads(),
                huge_pages,
            };
        }
    };
    #[cfg(target_os = "linux")]
    {
        let advice = if huge_pages {
            memmap2::Advice::HugePage
        } else {
            memmap2::Advice::NoHugePage
        };
        if let Err(e) = buffer.advise(advice) {
            log::debug!("page size advice refused: {e}");
        }
    }
    let buffer: &mut [u64] = bytemuck::cast_slice_mut(&mut buffer[..]);
    // Written once so every page is real memory, not the shared zero page.
    buffer
        .par_chunks_mut(CHUNK_WORDS)
        .enumerate()
        .for_each(|(c, chunk)| {
            for (i, w) in chunk.iter_mut().enumerate() {
                *w = (c * CHUNK_WORDS + i) as u64;
            }
        });
    let chunks: Vec<&[u64]> = buffer.chunks(CHUNK_WORDS).collect();
    let best = (0..passes.max(1))
        .map(|_| read_pass(&chunks))
        .fold(0f64, f64::max);
    Bandwidth {
        bytes_per_s: best,
        buffer_bytes: words * 8,
        passes: passes.max(1),
        threads: rayon::current_num_threads(),
        huge_pages,
    }
}

/// Words read per task of a bandwidth pass (256 KiB).
const CHUNK_WORDS: usize = 1 << 15;

/// One timed read of every word of `chunks` by the CPU tier's pool, each thread reading its
/// share of the chunks in order, each chunk as `READ_STREAMS` streams: bytes per second.
fn read_pass(chunks: &[&[u64]]) -> f64 {
    let bytes: usize = chunks.iter().map(|c| c.len() * 8).sum();
    let started = Instant::now();
    let sum = chunks
        .par_iter()
        .map(|c| sum_words(c))
        .reduce(|| 0, u64::wrapping_add);
    let seconds = started.elapsed().as_secs_f64();
    std::hint::black_box(sum);
    bytes as f64 / seconds.max(1e-9)
}

/// Reads `parts` (in that order, split over the CPU tier's threads as a bandwidth measurement
/// splits its buffer) once: bytes per second. For weights the decode reads, this is the read
/// bandwidth of the very memory (and page size) it reads them from. Bytes before each part's
/// first 8-byte boundary and after its last are left out.
pub fn read_bytes_per_s(parts: &[&[u8]]) -> f64 {
    read_pass(&aligned_chunks(parts))
}

/// The whole 8-byte words of `parts`, in chunks of at most `CHUNK_WORDS`.
fn aligned_chunks<'a>(parts: &[&'a [u8]]) -> Vec<&'a [u64]> {
    parts
        .iter()
        .flat_map(|part| {
            bytemuck::pod_align_to::<u8, u64>(part)
                .1
                .chunks(CHUNK_WORDS)
        })
        .collect()
}

/// Streams a task of a bandwidth pass reads side by side. One sequential stream per thread does
/// not keep every machine's memory busy, and the decode, whose kernels read several rows or runs
/// at once, can then read faster than the one-stream figure. The limit a decode is judged
/// against must be what the memory can give, not what one stream gets.
const READ_STREAMS: usize = 4;

/// A sum that must read every word: `READ_STREAMS` equal parts of `words` read side by side,
/// eight words of each at a time into eight independent lanes (vectorized, far from
/// compute-bound), then whatever is left over.
fn sum_words(words: &[u64]) -> u64 {
    let stream_len = words.len() / READ_STREAMS / 8 * 8;
    let (streamed, rest) = words.split_at(stream_len * READ_STREAMS);
    let mut parts = streamed.chunks_exact(stream_len.max(1));
    let streams: [&[u64]; READ_STREAMS] = std::array::from_fn(|_| parts.next().unwrap_or(&[]));
    let mut lanes = [0u64; 8];
    for start in (0..stream_len).step_by(8) {
        for stream in &streams {
            for (lane, w) in lanes.iter_mut().zip(&stream[start..start + 8]) {
                *lane = lane.wrapping_add(*w);
            }
        }
    }
    rest.iter()
        .chain(&lanes)
        .fold(0u64, |sum, w| sum.wrapping_add(*w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn physical_cores_is_at_least_one_and_at_most_the_logical_cpus() {
        let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
        let cores = physical_cores();
        assert!(cores >= 1 && cores <= logical, "{cores} of {logical}");
    }

    #[test]
    fn word_sums_read_every_word() {
        // Lengths with and without a part for every stream, and with words left over.
        for n in [0u64, 5, 21, 32, 37, 100, 1000] {
            let words: Vec<u64> = (1..=n).collect();
            assert_eq!(sum_words(&words), n * (n + 1) / 2, "{n} words");
        }
    }

    #[test]
    fn cache_sizes_parse_as_sysfs_writes_them() {
        assert_eq!(parse_cache_size("491520K\n"), Some(480 << 20));
        assert_eq!(parse_cache_size("32M"), Some(32 << 20));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("lots"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn the_bandwidth_buffer_is_eight_last_level_caches_within_two_gib_and_half_the_memory() {
        let gib = 1usize << 30;
        // A laptop's 24 MiB cache: the 2 GiB floor.
        assert_eq!(
            bandwidth_buffer_for(Some(24 << 20), Some(16 * gib)),
            2 * gib
        );
        // A large server's 480 MiB: 3.75 GiB.
        assert_eq!(
            bandwidth_buffer_for(Some(480 << 20), Some(23 * gib)),
            3840 << 20
        );
        // Little memory free: half of it, but never under the floor.
        assert_eq!(
            bandwidth_buffer_for(Some(480 << 20), Some(6 * gib)),
            3 * gib
        );
        assert_eq!(bandwidth_buffer_for(Some(480 << 20), Some(gib)), 2 * gib);
        // Nothing known: the floor.
        assert_eq!(bandwidth_buffer_for(None, None), 2 * gib);
        let here = bandwidth_buffer_bytes();
        assert!(here >= 2 * gib, "{here}");
        if let Some(cache) = last_level_cache_bytes() {
            assert!(cache > 0, "a cache of 0 bytes");
        }
    }

    #[test]
    fn a_read_of_parts_takes_their_whole_words_in_chunks() {
        let words: Vec<u64> = (0..(3 * CHUNK_WORDS as u64 + 5)).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&words);
        // The second part starts 3 bytes in: its first and last words are not whole.
        let chunks = aligned_chunks(&[bytes, &bytes[3..], &[]]);
        let sizes: Vec<usize> = chunks.iter().map(|c| c.len()).collect();
        let full = [CHUNK_WORDS; 3];
        assert_eq!(sizes, [&full[..], &[5], &full[..], &[4]].concat());
        assert_eq!(chunks[0][0], 0);
        assert_eq!(
            chunks[4][0],
            u64::from_le_bytes(bytes[8..16].try_into().unwrap())
        );
        let rate = read_bytes_per_s(&[bytes]);
        assert!(rate > 0.0 && rate.is_finite(), "{rate}");
    }

    #[test]
    fn bandwidth_is_positive_and_reports_its_buffer() {
        let b = measure_read_bandwidth(1 << 20, 2, false);
        assert!(b.bytes_per_s > 0.0 && b.bytes_per_s.is_finite());
        assert_eq!((b.buffer_bytes, b.passes), (1 << 20, 2));
    }
}
