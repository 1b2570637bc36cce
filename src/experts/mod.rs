//! The expert store: each (layer, expert) is one unit, read from the checkpoint's shards with
//! positioned reads by a pool of IO threads, and kept in a byte-budgeted RAM LRU.
//!
//! The CPU tier asks for the experts a layer's routing chose; hits come from RAM, misses from
//! disk. Where an expert comes from never changes the math: the bytes are the checkpoint's own.
//! Guessed experts (prefetch) wait in a small staging area beside the LRU until a layer uses
//! them, so a guess never evicts an expert the LRU kept.

mod disk_bandwidth;
mod reader;

pub use reader::Priority;
use reader::{ReadHandle, Reader};

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::flat_store::{FlatExperts, FlatFormat, ProjectionLayout, Span};
use crate::pages::PageBuffer;
use crate::weights::{
    Checkpoint, DenseExperts, ExpertMatrices, FloatFormat, Int4Experts, ModelWeights, Mxfp4Experts,
    RowExperts, TensorBytes,
};

/// One (layer, expert).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    pub layer: usize,
    pub expert: usize,
}

/// A run of bytes in one of the store's files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Extent {
    file: usize,
    offset: u64,
    len: usize,
}

/// A byte range of expert 0 in a file; expert e's is `e * stride` bytes further.
#[derive(Debug, Clone, Copy)]
struct Part {
    file: usize,
    offset: u64,
    len: usize,
    stride: u64,
}

impl Part {
    fn of(&self, expert: usize) -> Extent {
        Extent {
            file: self.file,
            offset: self.offset + expert as u64 * self.stride,
            len: self.len,
        }
    }
}

/// Where one projection's experts live.
#[derive(Debug, Clone)]
enum Projection {
    /// MXFP4 (or, from a converted store, INT4) weights and scales.
    Packed {
        weights: Part,
        scales: Part,
        rows: usize,
        cols: usize,
        int4: bool,
    },
    Dense {
        weights: Part,
        inputs: usize,
        outputs: usize,
        format: FloatFormat,
    },
    /// Row-major float experts, each as the runs of its row blocks wherever the checkpoint put
    /// them (Qwen3-MoE's per-expert tensors).
    Rows {
        extents: Arc<[Vec<Extent>]>,
        rows: usize,
        cols: usize,
        format: FloatFormat,
    },
}

impl Projection {
    /// Where expert `expert`'s bytes lie, in order.
    fn extents(&self, expert: usize) -> Vec<Extent> {
        match self {
            Projection::Packed {
                weights, scales, ..
            } => vec![weights.of(expert), scales.of(expert)],
            Projection::Dense { weights, .. } => vec![weights.of(expert)],
            Projection::Rows { extents, .. } => extents[expert].clone(),
        }
    }

    /// Bytes of one expert.
    fn bytes(&self) -> usize {
        match self {
            Projection::Packed {
                weights, scales, ..
            } => weights.len + scales.len,
            Projection::Dense { weights, .. } => weights.len,
            Projection::Rows {
                rows, cols, format, ..
            } => rows * cols * format.size(),
        }
    }

    /// Builds the one-expert matrices over bytes `start..` of a read (`bytes(range)` views
    /// them), returning the end.
    fn view(
        &self,
        bytes: &dyn Fn(std::ops::Range<usize>) -> TensorBytes,
        start: usize,
    ) -> (ExpertMatrices, usize) {
        match *self {
            Projection::Rows {
                rows, cols, format, ..
            } => {
                let end = start + self.bytes();
                let blocks = vec![vec![bytes(start..end)]];
                (
                    ExpertMatrices::Rows(RowExperts::new((rows, cols), format, blocks)),
                    end,
                )
            }
            Projection::Packed {
                weights,
                scales,
                rows,
                cols,
                int4,
            } => {
                let scales_start = start + weights.len;
                let end = scales_start + scales.len;
                let (w, s) = (bytes(start..scales_start), bytes(scales_start..end));
                let m = if int4 {
                    ExpertMatrices::Int4(Int4Experts::contiguous(1, (rows, cols), w, s))
                } else {
                    ExpertMatrices::Mxfp4(Mxfp4Experts::contiguous(1, (rows, cols), w, s))
                };
                (m, end)
            }
            Projection::Dense {
                weights,
                inputs,
                outputs,
                format,
            } => {
                let end = start + weights.len;
                let d = DenseExperts {
                    experts: 1,
                    inputs,
                    outputs,
                    format,
                    data: bytes(start..end),
                };
                (ExpertMatrices::Dense(d), end)
            }
        }
    }
}

/// One expert's weights, read into memory (biases stay with the layer, as f32).
#[derive(Debug)]
pub struct ExpertData {
    pub gate_up: ExpertMatrices,
    pub down: ExpertMatrices,
    pub bytes: usize,
}

/// Counters of the store, for `--stats`.
#[derive(Debug, Default)]
pub struct ExpertCounters {
    pub requests: AtomicU64,
    pub ram_hits: AtomicU64,
    pub disk_reads: AtomicU64,
    pub disk_bytes: AtomicU64,
    pub evictions: AtomicU64,
    /// Microseconds spent waiting for IO threads.
    pub io_wait_us: AtomicU64,
    /// Requests the GPU tier's VRAM cache answered (counted in `requests` too).
    pub vram_hits: AtomicU64,
    /// Experts the VRAM cache dropped to make room.
    pub vram_evictions: AtomicU64,
    /// Bytes copied into the VRAM cache, and the microseconds that took.
    pub upload_bytes: AtomicU64,
    pub upload_us: AtomicU64,
    /// Prefetch reads queued, their bytes once read, prefetched experts a request then used,
    /// and bytes of prefetched experts dropped unused.
    pub prefetch_issued: AtomicU64,
    pub prefetch_bytes: AtomicU64,
    pub prefetch_used: AtomicU64,
    pub prefetch_wasted_bytes: AtomicU64,
    /// Prefetched experts a request took from the staging area (arrived in time), guesses not
    /// read for want of staging room, and queued guesses cancelled as wrong.
    pub staged_hits: AtomicU64,
    pub prefetch_skipped: AtomicU64,
    pub prefetch_cancelled: AtomicU64,
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ExpertStats {
    /// Every (layer, expert) a layer's routing chose, counted once per block:
    /// `vram_hits + ram_hits + disk_reads`.
    pub requests: u64,
    pub vram_hits: u64,
    pub ram_hits: u64,
    pub disk_reads: u64,
    pub disk_bytes: u64,
    /// RAM cache evictions.
    pub evictions: u64,
    pub vram_evictions: u64,
    pub io_wait_ms: f64,
    pub upload_bytes: u64,
    pub upload_ms: f64,
    pub prefetch: PrefetchStats,
    pub reads: ReadStats,
}

/// What the IO threads did: chunks and bytes read (cancelled reads' included), and the reads
/// and bytes in flight each chunk saw when it started (summed, itself included).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct ReadStats {
    pub chunks: u64,
    pub bytes: u64,
    pub depth_sum: u64,
    pub bytes_in_flight_sum: u64,
}

impl ReadStats {
    /// Mean reads in flight as a chunk started: the queue depth the disk was given.
    pub fn mean_depth(&self) -> Option<f64> {
        (self.chunks > 0).then(|| self.depth_sum as f64 / self.chunks as f64)
    }

    /// Mean bytes in flight as a chunk started.
    pub fn mean_bytes_in_flight(&self) -> Option<f64> {
        (self.chunks > 0).then(|| self.bytes_in_flight_sum as f64 / self.chunks as f64)
    }

    fn since(&self, earlier: &ReadStats) -> ReadStats {
        ReadStats {
            chunks: self.chunks - earlier.chunks,
            bytes: self.bytes - earlier.bytes,
            depth_sum: self.depth_sum - earlier.depth_sum,
            bytes_in_flight_sum: self.bytes_in_flight_sum - earlier.bytes_in_flight_sum,
        }
    }
}

/// What prefetching did (its reads are not in `disk_reads`/`disk_bytes`, which count reads a
/// request waited for: requests = vram_hits + ram_hits + disk_reads either way).
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct PrefetchStats {
    pub issued: u64,
    /// Bytes the prefetch reads brought in.
    pub bytes: u64,
    /// Prefetched experts a layer's real routing then chose.
    pub used: u64,
    /// Bytes of prefetched experts dropped before any use, or still unused.
    pub wasted_bytes: u64,
    /// Of `used`, those that had arrived before the layer asked (the rest it waited for).
    pub staged_hits: u64,
    /// Guesses not read for want of staging room.
    pub skipped: u64,
    /// Guesses still being read, cancelled once the layer chose otherwise.
    pub cancelled: u64,
}

impl ExpertStats {
    /// The counts from `earlier` to `self`.
    pub fn since(&self, earlier: &ExpertStats) -> ExpertStats {
        ExpertStats {
            requests: self.requests - earlier.requests,
            vram_hits: self.vram_hits - earlier.vram_hits,
            ram_hits: self.ram_hits - earlier.ram_hits,
            disk_reads: self.disk_reads - earlier.disk_reads,
            disk_bytes: self.disk_bytes - earlier.disk_bytes,
            evictions: self.evictions - earlier.evictions,
            vram_evictions: self.vram_evictions - earlier.vram_evictions,
            io_wait_ms: self.io_wait_ms - earlier.io_wait_ms,
            upload_bytes: self.upload_bytes - earlier.upload_bytes,
            upload_ms: self.upload_ms - earlier.upload_ms,
            prefetch: PrefetchStats {
                issued: self.prefetch.issued - earlier.prefetch.issued,
                bytes: self.prefetch.bytes - earlier.prefetch.bytes,
                used: self.prefetch.used - earlier.prefetch.used,
                wasted_bytes: self
                    .prefetch
                    .wasted_bytes
                    .saturating_sub(earlier.prefetch.wasted_bytes),
                staged_hits: self.prefetch.staged_hits - earlier.prefetch.staged_hits,
                skipped: self.prefetch.skipped - earlier.prefetch.skipped,
                cancelled: self.prefetch.cancelled - earlier.prefetch.cancelled,
            },
            reads: self.reads.since(&earlier.reads),
        }
    }
}

/// The VRAM expert cache's budget: the same forms; `Auto` lets the adapter decide (every
/// expert, or as many as its memory takes), and a percentage is a share of the expert bytes.
pub type VramBudget = RamBudget;

/// How much RAM the expert cache may hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RamBudget {
    /// What the system has available, less the dense weights and a reserve for KV and the OS.
    Auto,
    Bytes(u64),
    /// A share of the model's expert bytes (25% = a quarter of the experts fit).
    Percent(f64),
}

impl std::str::FromStr for RamBudget {
    type Err = String;

    /// `auto`, a byte count with an optional K/M/G/T suffix (powers of 1024), or `N%`.
    fn from_str(text: &str) -> std::result::Result<RamBudget, String> {
        let t = text.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(RamBudget::Auto);
        }
        if let Some(p) = t.strip_suffix('%') {
            return match p.trim().parse::<f64>() {
                Ok(v) if (0.0..=100.0).contains(&v) => Ok(RamBudget::Percent(v)),
                _ => Err(format!(
                    "{text:?}: a percentage must be between 0% and 100%"
                )),
            };
        }
        let (digits, unit) = match t
            .char_indices()
            .find(|(_, c)| !c.is_ascii_digit() && *c != '.')
        {
            Some((i, _)) => t.split_at(i),
            None => (t, ""),
        };
        let scale: f64 = match unit.trim().to_ascii_uppercase().as_str() {
            "" | "B" => 1.0,
            "K" | "KB" | "KIB" => 1024.0,
            "M" | "MB" | "MIB" => 1024f64.powi(2),
            "G" | "GB" | "GIB" => 1024f64.powi(3),
            "T" | "TB" | "TIB" => 1024f64.powi(4),
            _ => {
                return Err(format!(
                    "{text:?}: expected bytes (e.g. 4G, 512M, 1000000), N% or auto"
                ));
            }
        };
        match digits.parse::<f64>() {
            Ok(v) if v >= 0.0 && v.is_finite() => Ok(RamBudget::Bytes((v * scale) as u64)),
            _ => Err(format!(
                "{text:?}: expected bytes (e.g. 4G, 512M, 1000000), N% or auto"
            )),
        }
    }
}

/// Bytes this process could still get: /proc/meminfo's MemAvailable, capped by the cgroup's
/// limit where one is set (containers), where those files exist.
pub fn available_memory_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let system: u64 = line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024;
    let number = |path: &str| {
        std::fs::read_to_string(path)
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    };
    let limit_and_use = [
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ];
    let cgroup = limit_and_use
        .iter()
        .find_map(|(max, current)| Some(number(max)?.saturating_sub(number(current)?)));
    Some(cgroup.map_or(system, |c| c.min(system)))
}

/// A converted store's records, each checked against its index's hash the first time it is read
/// (a damaged file is an error, not different tokens).
struct RecordCheck {
    flat: Arc<FlatExperts>,
    checked: Vec<AtomicBool>,
}

impl RecordCheck {
    /// Checks record `key` unless it passed before: `read`, its bytes as just read from the
    /// file, else the mapped file's.
    fn check(&self, key: ExpertKey, read: Option<&[u8]>) -> Result<()> {
        let r = key.layer * self.flat.index.experts + key.expert;
        if self.checked[r].load(Ordering::Relaxed) {
            return Ok(());
        }
        self.flat
            .check_record(r, read.unwrap_or_else(|| self.flat.record(r)))?;
        self.checked[r].store(true, Ordering::Relaxed);
        Ok(())
    }
}

struct Shared {
    files: Vec<(PathBuf, File)>,
    layers: Vec<(Projection, Projection)>,
    /// Reads bypass the page cache (O_DIRECT): one page-aligned read per expert.
    direct: bool,
    /// When every expert fits the budget: each layer's (gate_up, down) as mapped, which a
    /// "read" views in place and faults in instead of copying.
    mapped: Option<Vec<(ExpertMatrices, ExpertMatrices)>>,
    /// Record hashes to check (a converted store, unless turned off).
    records: Option<RecordCheck>,
}

fn not_in_files(layer: usize) -> Error {
    Error::Unsupported(format!(
        "layer {layer}: expert weights that are not in the checkpoint's files"
    ))
}

/// Extents that follow each other in the same file, as one read.
fn coalesce(extents: &[Extent]) -> Vec<Extent> {
    let mut reads: Vec<Extent> = Vec::new();
    for &extent in extents {
        match reads.last_mut() {
            Some(last)
                if last.file == extent.file && last.offset + last.len as u64 == extent.offset =>
            {
                last.len += extent.len;
            }
            _ => reads.push(extent),
        }
    }
    reads
}

/// How one expert is read: the runs of its bytes in the files, in order, into a buffer of
/// `pages` pages (none for a mapped store, whose experts are viewed where they lie).
struct ReadPlan {
    segments: Vec<reader::Segment>,
    pages: usize,
}

impl Shared {
    fn plan(&self, key: ExpertKey) -> ReadPlan {
        if self.mapped.is_some() {
            return ReadPlan {
                segments: Vec::new(),
                pages: 0,
            };
        }
        let reads = coalesce(&self.extents(key));
        let mut segments = Vec::with_capacity(reads.len());
        let mut dest = 0;
        for read in &reads {
            // O_DIRECT reads whole pages: a converted store's record is one read from a page
            // boundary, padded to its stride.
            let len = if self.direct {
                read.len.next_multiple_of(4096)
            } else {
                read.len
            };
            segments.push(reader::Segment {
                file: read.file,
                offset: read.offset,
                len,
                dest,
            });
            dest += len;
        }
        ReadPlan {
            segments,
            pages: dest.div_ceil(4096),
        }
    }

    /// Where expert `key`'s bytes lie, gate_up then down.
    fn extents(&self, key: ExpertKey) -> Vec<Extent> {
        let (gate_up, down) = &self.layers[key.layer];
        [gate_up.extents(key.expert), down.extents(key.expert)].concat()
    }

    /// Checks an expert's bytes as read into `buffer` (planned by `plan`) and views them.
    fn finish(&self, key: ExpertKey, buffer: PageBuffer) -> Result<ExpertData> {
        if let Some(mapped) = &self.mapped {
            if let Some(records) = &self.records {
                records.check(key, None)?;
            }
            let (gate_up, down) = &mapped[key.layer];
            let (gate_up, down) = (gate_up.single(key.expert), down.single(key.expert));
            gate_up.populate();
            down.populate();
            return Ok(ExpertData {
                bytes: gate_up.expert_bytes() + down.expert_bytes(),
                gate_up,
                down,
            });
        }
        let (gate_up, down) = &self.layers[key.layer];
        let total = gate_up.bytes() + down.bytes();
        if let Some(records) = &self.records {
            // A converted store's record is one read, from its start.
            records.check(key, Some(buffer.bytes()))?;
        }
        // What the disk delivered: whole pages with O_DIRECT.
        let read = if self.direct {
            buffer.bytes().len()
        } else {
            total
        };
        let buffer = Arc::new(buffer); // no copy: the views share it
        let bytes = move |r| TensorBytes::paged(buffer.clone(), r);
        let (gate_up, down) = &self.layers[key.layer];
        let (gate_up, end) = gate_up.view(&bytes, 0);
        let (down, _) = down.view(&bytes, end);
        Ok(ExpertData {
            gate_up,
            down,
            bytes: read,
        })
    }
}

/// Opens `path` for reads that bypass the page cache.
fn open_direct(path: &std::path::Path) -> std::io::Result<File> {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
    }
    #[cfg(target_os = "macos")]
    {
        use std::os::fd::AsRawFd;
        let file = File::open(path)?;
        // Safety: F_NOCACHE on a descriptor this function owns; no memory is passed.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) } == -1 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(file)
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = path;
        Err(std::io::Error::other(
            "direct IO is supported on Linux and macOS",
        ))
    }
}

#[cfg(unix)]
fn read_exact_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    std::os::unix::fs::FileExt::read_exact_at(file, buf, offset)
}

#[cfg(windows)]
fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> std::io::Result<()> {
    use std::os::windows::fs::FileExt;
    while !buf.is_empty() {
        match file.seek_read(buf, offset)? {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            n => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
        }
    }
    Ok(())
}

fn io_stopped() -> Error {
    Error::io("expert IO threads", std::io::Error::other("stopped"))
}

struct Lru {
    entries: HashMap<ExpertKey, (Arc<ExpertData>, u64)>,
    /// Prefetch reads under way.
    in_flight: HashMap<ExpertKey, ReadHandle>,
    /// Prefetched experts that arrived and that no layer used yet: outside the budget, at most
    /// `ExpertStore::staging` of them with those in flight.
    staged: HashMap<ExpertKey, Arc<ExpertData>>,
    /// Hot experts loaded at start-up: never evicted.
    pinned: std::collections::HashSet<ExpertKey>,
    bytes: u64,
    clock: u64,
}

/// Name of the usage file beside the model (`PICCHIO_USAGE_BESIDE_MODEL=1`).
pub const USAGE_FILE: &str = ".picchio_usage";

/// Where the usage counts of the model in `ck` are kept: in `dir` when given, else beside the
/// model when `PICCHIO_USAGE_BESIDE_MODEL=1`, else in the user's cache directory; in the last
/// two, a file named by the model's identity. None when there is no cache directory.
fn usage_file(ck: &Checkpoint, dir: Option<&Path>) -> Option<PathBuf> {
    let beside = std::env::var("PICCHIO_USAGE_BESIDE_MODEL").is_ok_and(|v| v == "1");
    if dir.is_none() && beside {
        return Some(ck.dir().join(USAGE_FILE));
    }
    let dir = match dir {
        Some(dir) => dir.to_path_buf(),
        None => cache_dir()?.join("usage"),
    };
    Some(dir.join(format!("{:016x}.json", model_identity(ck))))
}

/// picchio's cache directory: `PICCHIO_CACHE_DIR`, else the platform's user cache directory
/// (`$XDG_CACHE_HOME` or `~/.cache` on Linux, `~/Library/Caches` on macOS, `%LOCALAPPDATA%` on
/// Windows) and `picchio` in it.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var("PICCHIO_CACHE_DIR") {
        return Some(dir);
    }
    let user_cache = if cfg!(target_os = "macos") {
        var("HOME").map(|home| home.join("Library/Caches"))
    } else if cfg!(windows) {
        var("LOCALAPPDATA")
    } else {
        var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|home| home.join(".cache")))
    };
    user_cache.map(|dir| dir.join("picchio"))
}

/// A model's identity: its directory (canonical: two fine-tunes may share every size), its
/// config.json, and the names and sizes of its weight files.
fn model_identity(ck: &Checkpoint) -> u64 {
    let dir = (ck.dir().canonicalize()).unwrap_or_else(|_| ck.dir().to_path_buf());
    let mut key = dir.to_string_lossy().into_owned().into_bytes();
    key.push(0);
    key.extend(std::fs::read(dir.join("config.json")).unwrap_or_default());
    let records = dir.join(crate::flat_store::RECORDS_FILE);
    for path in ck.shard_paths().chain([records.as_path()]) {
        key.extend(path.file_name().unwrap_or_default().as_encoded_bytes());
        let size = std::fs::metadata(path).map_or(0, |m| m.len());
        key.extend(size.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&key)
}

/// Requests per (layer, expert), accumulated over runs in `USAGE_FILE`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Usage {
    layers: usize,
    experts: usize,
    counts: Vec<u64>,
}

/// How the store reads.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Threads reading experts: the reads the disk has in flight.
    pub io_threads: usize,
    /// Largest read an IO thread makes at once: an expert is read in chunks of this size by
    /// several threads side by side.
    pub read_chunk_bytes: usize,
    /// Prefetched experts (arrived or in flight) the staging area holds at most.
    pub staging_experts: usize,
    /// Pin the most used experts of earlier runs and save this run's usage (`usage_file`).
    pub hot_experts: bool,
    /// Where usage files go instead of the user's cache directory.
    pub usage_dir: Option<PathBuf>,
    /// Read a converted store with O_DIRECT (F_NOCACHE on macOS): no page-cache copy.
    pub direct_io: bool,
    /// Check each record of a converted store against its index's hash when first read.
    pub check_records: bool,
}

/// The files a store reads and where each layer's projections sit in them.
type StoreLayout = (Vec<(PathBuf, File)>, Vec<(Projection, Projection)>);

/// An expert asked for: in RAM already, or being read by an IO thread.
pub struct Pending(PendingState);

enum PendingState {
    Ready(Arc<ExpertData>),
    Reading(ReadHandle),
    /// A prefetch read under way that a request now wants.
    Prefetched(ReadHandle),
}

/// The experts of a model: disk -> RAM LRU, read by IO threads.
pub struct ExpertStore {
    /// Where the experts live (also held by the IO threads).
    shared: Arc<Shared>,
    reader: Reader,
    cache: Mutex<Lru>,
    budget: u64,
    /// Prefetched experts held beside the budget, at most (arrived or in flight).
    staging: usize,
    expert_bytes: u64,
    counters: ExpertCounters,
    /// Requests per (layer, expert) in this run.
    usage: Vec<AtomicU64>,
    /// Microseconds each layer waited for its expert reads.
    layer_wait_us: Vec<AtomicU64>,
    /// Reads from disk (demand and prefetch) per (layer, expert).
    disk_reads_by_key: Vec<AtomicU64>,
    experts_per_layer: usize,
    /// The usage file (`usage_file`), when hot experts are on and there is a place for it.
    usage_path: Option<PathBuf>,
    /// Pinning happens before the first fetch (never, for runs that fetch nothing: the GPU tier).
    pinning_started: AtomicBool,
}

impl ExpertStore {
    /// Maps where every expert lives (the checkpoint's tensors, or a converted store's records)
    /// and starts `io_threads` readers. `weights` must come from `ck` (it was validated against
    /// the config). `direct_io` reads a converted store past the page cache.
    pub fn open(
        ck: &Checkpoint,
        weights: &ModelWeights,
        budget: RamBudget,
        options: StoreOptions,
    ) -> Result<ExpertStore> {
        let StoreOptions {
            io_threads,
            read_chunk_bytes,
            staging_experts,
            hot_experts,
            direct_io,
            check_records,
            usage_dir,
        } = options;
        let (files, layers) = match &weights.flat {
            Some(flat) => Self::flat_layout(flat, direct_io)?,
            None if direct_io => {
                return Err(Error::InvalidArgument(format!(
                    "--direct-io reads converted expert stores; {} is a checkpoint (convert it with picchio convert)",
                    ck.dir().display()
                )));
            }
            None => Self::checkpoint_layout(ck, weights)?,
        };
        let record = |(g, d): &(Projection, Projection)| -> u64 {
            let len = (g.bytes() + d.bytes()) as u64;
            if direct_io {
                len.div_ceil(4096) * 4096
            } else {
                len
            }
        };
        let expert_bytes = layers.first().map_or(0, record);
        let total_expert_bytes = expert_bytes
            * (weights.layers.len() * weights.layers.first().map_or(0, |l| l.gate_up.experts()))
                as u64;
        let budget = match budget {
            RamBudget::Bytes(b) => b,
            RamBudget::Percent(p) => (total_expert_bytes as f64 * p / 100.0) as u64,
            RamBudget::Auto => {
                // Leave room for the dense weights, the KV cache and the OS.
                let reserve = (weights.bytes() as u64
                    - total_expert_bytes.min(weights.bytes() as u64))
                    + (2 << 30);
                available_memory_bytes()
                    .map_or(total_expert_bytes, |a| a.saturating_sub(reserve))
                    .min(total_expert_bytes)
            }
        };
        // A budget holding every expert needs no copies: the OS page cache holds the files, and
        // the CPU tier computes from the mapping (the first use of an expert faults it in).
        let mapped = (!direct_io
            && budget >= total_expert_bytes
            && weights
                .layers
                .iter()
                .all(|l| l.gate_up.is_mapped() && l.down.is_mapped()))
        .then(|| {
            log::debug!("every expert fits the RAM budget: computing from the mapped files");
            weights
                .layers
                .iter()
                .map(|l| (l.gate_up.clone(), l.down.clone()))
                .collect()
        });
        let records = (weights.flat.as_ref())
            .filter(|_| check_records)
            .map(|flat| RecordCheck {
                flat: flat.clone(),
                checked: (0..flat.index.hashes.len())
                    .map(|_| AtomicBool::new(false))
                    .collect(),
            });
        let shared = Arc::new(Shared {
            files,
            layers,
            direct: direct_io,
            mapped,
            records,
        });
        // A layer's experts come back together once it has run: a few idle buffers cover the
        // next layer's reads; more would only hold memory after a prompt's burst.
        let reader = Reader::start(shared.clone(), io_threads, read_chunk_bytes, io_threads)?;
        log::debug!("expert RAM budget: {budget} bytes of {total_expert_bytes}");
        let experts_per_layer = weights.layers.first().map_or(0, |l| l.gate_up.experts());
        let store = ExpertStore {
            shared: shared.clone(),
            reader,
            cache: Mutex::new(Lru {
                entries: HashMap::new(),
                in_flight: HashMap::new(),
                staged: HashMap::new(),
                pinned: Default::default(),
                bytes: 0,
                clock: 0,
            }),
            budget,
            staging: staging_experts,
            expert_bytes,
            counters: ExpertCounters::default(),
            usage: (0..weights.layers.len() * experts_per_layer)
                .map(|_| AtomicU64::new(0))
                .collect(),
            layer_wait_us: (0..weights.layers.len())
                .map(|_| AtomicU64::new(0))
                .collect(),
            disk_reads_by_key: (0..weights.layers.len() * experts_per_layer)
                .map(|_| AtomicU64::new(0))
                .collect(),
            experts_per_layer,
            usage_path: hot_experts
                .then(|| usage_file(ck, usage_dir.as_deref()))
                .flatten(),
            pinning_started: AtomicBool::new(!hot_experts),
        };
        Ok(store)
    }

    /// The checkpoint's expert tensors: expert e at `e * len` bytes into each, or each expert's
    /// own tensors.
    fn checkpoint_layout(ck: &Checkpoint, weights: &ModelWeights) -> Result<StoreLayout> {
        let files = ck
            .shard_paths()
            .map(|p| {
                File::open(p)
                    .map(|f| (p.to_path_buf(), f))
                    .map_err(|e| Error::io(p, e))
            })
            .collect::<Result<Vec<_>>>()?;
        // Expert e of a projection at `e * len` bytes into its tensor, where the checkpoint
        // reader found it.
        let part = |t: &TensorBytes, experts: usize, l: usize| -> Result<Part> {
            let place = t.origin().ok_or_else(|| not_in_files(l))?;
            let len = t.bytes().len() / experts;
            Ok(Part {
                file: place.shard,
                offset: place.offset,
                len,
                stride: len as u64,
            })
        };
        // One expert's block, where the checkpoint reader found it.
        let extent = |t: &TensorBytes, l: usize| -> Result<Extent> {
            let place = t.origin().ok_or_else(|| not_in_files(l))?;
            Ok(Extent {
                file: place.shard,
                offset: place.offset,
                len: t.bytes().len(),
            })
        };
        let mut layers = Vec::with_capacity(weights.layers.len());
        for (l, w) in weights.layers.iter().enumerate() {
            let projection = |m: &ExpertMatrices| -> Result<Projection> {
                Ok(match m {
                    ExpertMatrices::Mxfp4(x) => Projection::Packed {
                        weights: part(&x.blocks, x.experts, l)?,
                        scales: part(&x.scales, x.experts, l)?,
                        rows: x.rows,
                        cols: x.cols,
                        int4: false,
                    },
                    ExpertMatrices::Dense(d) => Projection::Dense {
                        weights: part(&d.data, d.experts, l)?,
                        inputs: d.inputs,
                        outputs: d.outputs,
                        format: d.format,
                    },
                    ExpertMatrices::Rows(r) => Projection::Rows {
                        extents: (r.blocks.iter())
                            .map(|blocks| blocks.iter().map(|b| extent(b, l)).collect())
                            .collect::<Result<_>>()?,
                        rows: r.rows,
                        cols: r.cols,
                        format: r.format,
                    },
                    ExpertMatrices::Int4(_) => {
                        return Err(Error::Unsupported(
                            "INT4 experts come from converted stores".into(),
                        ));
                    }
                })
            };
            layers.push((projection(&w.gate_up)?, projection(&w.down)?));
        }
        Ok((files, layers))
    }

    /// A converted store's records: one file, expert e of layer l at record `l * E + e`.
    fn flat_layout(flat: &FlatExperts, direct_io: bool) -> Result<StoreLayout> {
        let path = flat.records_path.clone();
        let file = if direct_io {
            open_direct(&path)
        } else {
            File::open(&path)
        }
        .map_err(|e| Error::io(&path, e))?;
        let index = &flat.index;
        let int4 = index.experts_format == FlatFormat::Int4;
        let layers = (0..index.layers)
            .map(|l| {
                let base = index.record_offset(l, 0);
                let part = |span: Span| Part {
                    file: 0,
                    offset: base + span.offset as u64,
                    len: span.len,
                    stride: index.record_stride as u64,
                };
                let projection = |p: ProjectionLayout| Projection::Packed {
                    weights: part(p.weights),
                    scales: part(p.scales),
                    rows: p.rows,
                    cols: p.cols,
                    int4,
                };
                (projection(index.gate_up), projection(index.down))
            })
            .collect::<Vec<_>>();
        // `plan` pads each run of an O_DIRECT read to whole pages: the views find their bytes
        // only where an expert is one run.
        let one_run = |(gate_up, down): &(Projection, Projection)| {
            coalesce(&[gate_up.extents(0), down.extents(0)].concat()).len() == 1
        };
        if direct_io && !layers.iter().all(one_run) {
            return Err(Error::Unsupported(
                "--direct-io reads converted expert stores, one run of bytes per expert".into(),
            ));
        }
        Ok((vec![(path, file)], layers))
    }

    fn saved_usage(&self) -> Option<Usage> {
        let text = std::fs::read_to_string(self.usage_path.as_ref()?).ok()?;
        let usage: Usage = serde_json::from_str(&text).ok()?;
        let fits =
            usage.experts == self.experts_per_layer && usage.counts.len() == self.usage.len();
        fits.then_some(usage)
    }

    /// Loads the most used experts of earlier runs (from `USAGE_FILE`) into up to half of the
    /// budget and keeps them there; the other half stays a plain LRU.
    fn pin_hot_experts(&self) -> Result<()> {
        let Some(usage) = self.saved_usage() else {
            return Ok(());
        };
        let mut order: Vec<usize> = (0..usage.counts.len())
            .filter(|&i| usage.counts[i] > 0)
            .collect();
        order.sort_by_key(|&i| (std::cmp::Reverse(usage.counts[i]), i));
        let room = (self.budget / 2 / self.expert_bytes.max(1)) as usize;
        // Start-up reads are not the run's requests: whatever they add is taken back below.
        let c = &self.counters;
        let counters = [
            &c.requests,
            &c.ram_hits,
            &c.disk_reads,
            &c.disk_bytes,
            &c.evictions,
            &c.io_wait_us,
        ];
        let before: Vec<u64> = counters.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let usage_before: Vec<u64> = self
            .usage
            .iter()
            .map(|u| u.load(Ordering::Relaxed))
            .collect();
        let mut by_layer: HashMap<usize, Vec<usize>> = HashMap::new();
        for &i in order.iter().take(room) {
            by_layer
                .entry(i / self.experts_per_layer)
                .or_default()
                .push(i % self.experts_per_layer);
        }
        let mut pinned = 0;
        for (layer, experts) in by_layer {
            let fetched = self.fetch_counted(layer, &experts)?;
            let mut lru = self.cache.lock().unwrap();
            for &expert in &experts {
                let key = ExpertKey { layer, expert };
                if lru.entries.contains_key(&key) {
                    lru.pinned.insert(key);
                    pinned += 1;
                }
            }
            drop(fetched);
        }
        for (u, value) in self.usage.iter().zip(usage_before) {
            u.store(value, Ordering::Relaxed);
        }
        for (counter, value) in counters.iter().zip(before) {
            counter.store(value, Ordering::Relaxed);
        }
        if let (true, Some(path)) = (pinned > 0, &self.usage_path) {
            log::info!("pinned {pinned} hot experts from {}", path.display());
        }
        Ok(())
    }

    /// Adds this run's requests to the usage file (best effort: a place that cannot be written
    /// only costs the pinning of later runs).
    pub fn save_usage(&self) {
        let requested = self.usage.iter().any(|u| u.load(Ordering::Relaxed) > 0);
        // No path without hot experts.
        let (Some(path), true) = (&self.usage_path, requested) else {
            return;
        };
        let mut usage = self.saved_usage().unwrap_or(Usage {
            layers: self.usage.len() / self.experts_per_layer.max(1),
            experts: self.experts_per_layer,
            counts: vec![0; self.usage.len()],
        });
        for (total, now) in usage.counts.iter_mut().zip(&self.usage) {
            *total = total.saturating_add(now.load(Ordering::Relaxed));
        }
        // A private temporary name: concurrent runs each replace the file whole.
        let temporary = path.with_extension(format!("{}.tmp", std::process::id()));
        let written = serde_json::to_string(&usage)
            .map_err(std::io::Error::other)
            .and_then(|text| {
                let folder = path.parent().unwrap_or(Path::new("."));
                std::fs::create_dir_all(folder)?;
                std::fs::write(&temporary, text)
            })
            .and_then(|()| std::fs::rename(&temporary, path));
        if let Err(e) = written {
            log::warn!("could not save expert usage to {}: {e}", path.display());
        }
    }

    /// Where this run's expert usage is saved and read back (None: nowhere).
    pub fn usage_path(&self) -> Option<&Path> {
        self.usage_path.as_deref()
    }

    /// Bytes of one expert (gate_up and down weights with their scales).
    /// Whether every expert fits the budget and is computed in place from the mapped files.
    pub fn is_mapped(&self) -> bool {
        self.shared.mapped.is_some()
    }

    /// Faults in every mapped expert now, or reads it once where it was copied into memory
    /// (`ExpertMatrices::warm`), in parallel (a no-op unless `is_mapped`), so the first prompt
    /// does not pay for it. Counters are untouched: the first request of an expert still
    /// counts as its read.
    pub fn warm_up(&self) {
        if let Some(mapped) = &self.shared.mapped {
            use rayon::prelude::*;
            mapped.par_iter().for_each(|(gate_up, down)| {
                gate_up.warm();
                down.warm();
            });
        }
    }

    pub fn expert_bytes(&self) -> u64 {
        self.expert_bytes
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn stats(&self) -> ExpertStats {
        let c = &self.counters;
        ExpertStats {
            requests: c.requests.load(Ordering::Relaxed),
            vram_hits: c.vram_hits.load(Ordering::Relaxed),
            ram_hits: c.ram_hits.load(Ordering::Relaxed),
            disk_reads: c.disk_reads.load(Ordering::Relaxed),
            disk_bytes: c.disk_bytes.load(Ordering::Relaxed),
            evictions: c.evictions.load(Ordering::Relaxed),
            vram_evictions: c.vram_evictions.load(Ordering::Relaxed),
            io_wait_ms: c.io_wait_us.load(Ordering::Relaxed) as f64 / 1000.0,
            upload_bytes: c.upload_bytes.load(Ordering::Relaxed),
            upload_ms: c.upload_us.load(Ordering::Relaxed) as f64 / 1000.0,
            prefetch: PrefetchStats {
                issued: c.prefetch_issued.load(Ordering::Relaxed),
                bytes: c.prefetch_bytes.load(Ordering::Relaxed),
                used: c.prefetch_used.load(Ordering::Relaxed),
                // Prefetched experts still waiting for a use count as waste until used.
                wasted_bytes: c.prefetch_wasted_bytes.load(Ordering::Relaxed) + {
                    let lru = self.cache.lock().unwrap();
                    lru.staged.values().map(|d| d.bytes as u64).sum::<u64>()
                },
                staged_hits: c.staged_hits.load(Ordering::Relaxed),
                skipped: c.prefetch_skipped.load(Ordering::Relaxed),
                cancelled: c.prefetch_cancelled.load(Ordering::Relaxed),
            },
            reads: {
                let r = &self.reader.counters;
                ReadStats {
                    chunks: r.chunks.load(Ordering::Relaxed),
                    bytes: r.bytes.load(Ordering::Relaxed),
                    depth_sum: r.depth_sum.load(Ordering::Relaxed),
                    bytes_in_flight_sum: r.bytes_in_flight_sum.load(Ordering::Relaxed),
                }
            },
        }
    }

    /// Counts `count` experts of `layer` that the GPU tier found in its VRAM cache: requests
    /// that never reach RAM or disk (they still count as usage for hot-expert pinning).
    pub fn count_vram_hits(&self, layer: usize, experts: &[usize]) {
        for &expert in experts {
            self.usage[layer * self.experts_per_layer + expert].fetch_add(1, Ordering::Relaxed);
        }
        let n = experts.len() as u64;
        self.counters.requests.fetch_add(n, Ordering::Relaxed);
        self.counters.vram_hits.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts `n` experts the VRAM cache dropped to make room.
    pub fn count_vram_evictions(&self, n: u64) {
        self.counters.vram_evictions.fetch_add(n, Ordering::Relaxed);
    }

    /// Counts `bytes` copied into the VRAM cache since `started`.
    pub fn count_upload(&self, bytes: u64, started: Instant) {
        let c = &self.counters;
        c.upload_bytes.fetch_add(bytes, Ordering::Relaxed);
        c.upload_us
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
    }

    /// The experts `experts` of `layer`, in that order: RAM hits at once, misses read by the IO
    /// threads in parallel. The returned handles stay valid whatever the cache evicts later.
    pub fn fetch(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<ExpertData>>> {
        self.request(layer, experts)?
            .into_iter()
            .map(|p| self.wait(p))
            .collect()
    }

    /// Checks every record of `layer` of a converted store that no read checked yet against its
    /// hash (for a tier that takes the layer's experts whole, not through `request`).
    pub fn check_layer_records(&self, layer: usize) -> Result<()> {
        let Some(records) = &self.shared.records else {
            return Ok(());
        };
        (0..records.flat.index.experts)
            .try_for_each(|expert| records.check(ExpertKey { layer, expert }, None))
    }

    /// Starts fetching `experts` of `layer`: hits are ready at once, misses are queued for the IO
    /// threads, all before the first one is awaited, so the caller can compute with each expert
    /// (`wait`, in order) while the later ones are still being read.
    pub fn request(&self, layer: usize, experts: &[usize]) -> Result<Vec<Pending>> {
        if !self.pinning_started.swap(true, Ordering::SeqCst)
            && let Err(e) = self.pin_hot_experts()
        {
            log::warn!("could not pin hot experts: {e}");
        }
        self.request_counted(layer, experts)
    }

    fn fetch_counted(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<ExpertData>>> {
        self.request_counted(layer, experts)?
            .into_iter()
            .map(|p| self.wait(p))
            .collect()
    }

    fn request_counted(&self, layer: usize, experts: &[usize]) -> Result<Vec<Pending>> {
        let c = &self.counters;
        for &expert in experts {
            self.usage[layer * self.experts_per_layer + expert].fetch_add(1, Ordering::Relaxed);
        }
        let mut requests = Vec::with_capacity(experts.len());
        let mut lru = self.cache.lock().unwrap();
        self.collect_prefetched(&mut lru);
        self.drop_wrong_guesses(&mut lru, layer, experts);
        for &expert in experts {
            let key = ExpertKey { layer, expert };
            lru.clock += 1;
            let now = lru.clock;
            if let Some((data, used)) = lru.entries.get_mut(&key) {
                *used = now;
                c.requests.fetch_add(1, Ordering::Relaxed);
                c.ram_hits.fetch_add(1, Ordering::Relaxed);
                requests.push(Pending(PendingState::Ready(data.clone())));
            } else if let Some(data) = lru.staged.remove(&key) {
                // A guess that arrived in time: now a use, cached as a read of it would be.
                c.requests.fetch_add(1, Ordering::Relaxed);
                c.ram_hits.fetch_add(1, Ordering::Relaxed);
                c.prefetch_used.fetch_add(1, Ordering::Relaxed);
                c.staged_hits.fetch_add(1, Ordering::Relaxed);
                self.insert_locked(&mut lru, key, &data);
                requests.push(Pending(PendingState::Ready(data)));
            } else if let Some(read) = lru.in_flight.remove(&key) {
                self.reader.promote(&read);
                requests.push(Pending(PendingState::Prefetched(read)));
            } else {
                let read = self.submit(key, Priority::Demand);
                requests.push(Pending(PendingState::Reading(read)));
            }
        }
        Ok(requests)
    }

    /// Queues the read of `key` (counted in `disk_reads_by_key`).
    fn submit(&self, key: ExpertKey, priority: Priority) -> ReadHandle {
        self.disk_reads_by_key[key.layer * self.experts_per_layer + key.expert]
            .fetch_add(1, Ordering::Relaxed);
        self.reader.submit(&self.shared, key, priority)
    }

    /// Forgets the guesses for `layer` that its routing did not choose: staged ones are dropped
    /// (wasted), reads under way cancelled (the chunks not yet started are never read).
    fn drop_wrong_guesses(&self, lru: &mut Lru, layer: usize, chosen: &[usize]) {
        let wrong = |key: &ExpertKey| key.layer == layer && !chosen.contains(&key.expert);
        let staged: Vec<ExpertKey> = lru.staged.keys().copied().filter(wrong).collect();
        for key in staged {
            if let Some(data) = lru.staged.remove(&key) {
                self.counters
                    .prefetch_wasted_bytes
                    .fetch_add(data.bytes as u64, Ordering::Relaxed);
            }
        }
        let reading: Vec<ExpertKey> = lru.in_flight.keys().copied().filter(wrong).collect();
        for key in reading {
            let Some(read) = lru.in_flight.remove(&key) else {
                continue;
            };
            match read.answer.try_recv() {
                // Arrived since the staged ones were collected: read whole, and wasted.
                Ok(Ok(data)) => {
                    let c = &self.counters;
                    c.prefetch_bytes
                        .fetch_add(data.bytes as u64, Ordering::Relaxed);
                    c.prefetch_wasted_bytes
                        .fetch_add(data.bytes as u64, Ordering::Relaxed);
                }
                _ => {
                    self.reader.cancel(read);
                    self.counters
                        .prefetch_cancelled
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Starts reading `experts` of `layer` that are neither cached nor being read, for a later
    /// request, behind every demand read: they wait in the staging area (not the budget) until
    /// a layer uses them, so a guess never evicts a cached expert. Guesses beyond the staging
    /// area's room are not read. Returns how many reads were queued.
    pub fn prefetch(&self, layer: usize, experts: &[usize]) -> Result<usize> {
        let mut lru = self.cache.lock().unwrap();
        let mut issued = 0;
        for &expert in experts {
            let key = ExpertKey { layer, expert };
            if lru.entries.contains_key(&key)
                || lru.in_flight.contains_key(&key)
                || lru.staged.contains_key(&key)
            {
                continue;
            }
            if lru.in_flight.len() + lru.staged.len() >= self.staging {
                self.counters
                    .prefetch_skipped
                    .fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let read = self.submit(key, Priority::Prefetch);
            lru.in_flight.insert(key, read);
            issued += 1;
        }
        self.counters
            .prefetch_issued
            .fetch_add(issued as u64, Ordering::Relaxed);
        Ok(issued)
    }

    /// Starts reading `experts` of `layer` for a faster tier's prefetch (the GPU tier's VRAM
    /// cache): from the RAM cache where it holds them, else by the IO threads, behind the
    /// demand reads. These are not requests (the layer has not chosen them yet): only
    /// `prefetch.issued` counts them, and `wait_prefetch` their bytes.
    pub fn request_prefetch(&self, layer: usize, experts: &[usize]) -> Result<Vec<Pending>> {
        let lru = self.cache.lock().unwrap();
        let mut pending = Vec::with_capacity(experts.len());
        for &expert in experts {
            let key = ExpertKey { layer, expert };
            match lru.entries.get(&key) {
                Some((data, _)) => pending.push(Pending(PendingState::Ready(data.clone()))),
                None => {
                    let read = self.submit(key, Priority::Prefetch);
                    pending.push(Pending(PendingState::Reading(read)));
                }
            }
        }
        self.counters
            .prefetch_issued
            .fetch_add(experts.len() as u64, Ordering::Relaxed);
        Ok(pending)
    }

    /// The expert of a `request_prefetch`, waiting for its read if it is still under way.
    pub fn wait_prefetch(&self, pending: Pending) -> Result<Arc<ExpertData>> {
        let data = match pending.0 {
            PendingState::Ready(data) => data,
            PendingState::Reading(read) | PendingState::Prefetched(read) => {
                read.answer.recv().map_err(|_| io_stopped())??
            }
        };
        self.counters
            .prefetch_bytes
            .fetch_add(data.bytes as u64, Ordering::Relaxed);
        Ok(data)
    }

    /// Counts prefetched experts a faster tier's cache then used, and bytes it dropped unused.
    pub fn count_prefetch_outcome(&self, used: u64, wasted_bytes: u64) {
        let c = &self.counters;
        c.prefetch_used.fetch_add(used, Ordering::Relaxed);
        c.prefetch_wasted_bytes
            .fetch_add(wasted_bytes, Ordering::Relaxed);
    }

    /// Moves prefetch reads that have arrived into the staging area (a failed one is forgotten:
    /// a request reads the expert itself and reports).
    fn collect_prefetched(&self, lru: &mut Lru) {
        let done: Vec<ExpertKey> = lru
            .in_flight
            .iter()
            .filter(|(_, read)| !read.answer.is_empty() || read.answer.is_disconnected())
            .map(|(key, _)| *key)
            .collect();
        for key in done {
            let Some(read) = lru.in_flight.remove(&key) else {
                continue;
            };
            if let Ok(Ok(data)) = read.answer.recv() {
                self.counters
                    .prefetch_bytes
                    .fetch_add(data.bytes as u64, Ordering::Relaxed);
                lru.staged.insert(key, data);
            }
        }
    }

    /// The expert of a request, waiting for its read if it is still under way.
    pub fn wait(&self, pending: Pending) -> Result<Arc<ExpertData>> {
        let c = &self.counters;
        let (read, prefetched) = match pending.0 {
            PendingState::Ready(data) => return Ok(data),
            PendingState::Reading(read) => (read, false),
            PendingState::Prefetched(read) => (read, true),
        };
        let key = read.key();
        let started = Instant::now();
        let data = read.answer.recv().map_err(|_| io_stopped())?;
        let waited = started.elapsed().as_micros() as u64;
        c.io_wait_us.fetch_add(waited, Ordering::Relaxed);
        self.layer_wait_us[key.layer].fetch_add(waited, Ordering::Relaxed);
        let data = match (data, prefetched) {
            (Ok(data), _) => data,
            (Err(e), false) => return Err(e),
            // The prefetch failed: read it again, as any request would.
            (Err(_), true) => {
                let read = self.submit(key, Priority::Demand);
                return self.wait(Pending(PendingState::Reading(read)));
            }
        };
        c.requests.fetch_add(1, Ordering::Relaxed);
        if prefetched {
            // A guess still being read when the layer asked: a hit that arrived late.
            c.prefetch_bytes
                .fetch_add(data.bytes as u64, Ordering::Relaxed);
            c.ram_hits.fetch_add(1, Ordering::Relaxed);
            c.prefetch_used.fetch_add(1, Ordering::Relaxed);
        } else {
            c.disk_reads.fetch_add(1, Ordering::Relaxed);
            c.disk_bytes.fetch_add(data.bytes as u64, Ordering::Relaxed);
        }
        let mut lru = self.cache.lock().unwrap();
        self.insert_locked(&mut lru, key, &data);
        Ok(data)
    }

    /// Caches `data` within the budget, evicting the least recently used experts (never pinned
    /// ones); an expert that would evict only pinned ones is not cached.
    fn insert_locked(&self, lru: &mut Lru, key: ExpertKey, data: &Arc<ExpertData>) {
        let bytes = data.bytes as u64;
        if bytes > self.budget || lru.entries.contains_key(&key) {
            return; // too large, or another fetch read it meanwhile
        }
        while lru.bytes + bytes > self.budget {
            let pinned = &lru.pinned;
            let Some((&victim, _)) = lru
                .entries
                .iter()
                .filter(|(key, _)| !pinned.contains(key))
                .min_by_key(|(_, (_, used))| *used)
            else {
                return;
            };
            if let Some((old, _)) = lru.entries.remove(&victim) {
                lru.bytes -= old.bytes as u64;
                self.counters.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        lru.clock += 1;
        let now = lru.clock;
        lru.entries.insert(key, (data.clone(), now));
        lru.bytes += bytes;
    }

    /// Milliseconds each layer has waited for its expert reads.
    pub fn layer_wait_ms(&self) -> Vec<f64> {
        (self.layer_wait_us.iter())
            .map(|us| us.load(Ordering::Relaxed) as f64 / 1000.0)
            .collect()
    }

    /// Threads reading experts (the reads in flight at most) and the largest read each makes.
    pub fn read_shape(&self) -> (usize, usize) {
        (self.reader.threads, self.reader.chunk_bytes)
    }

    /// Prefetched experts the staging area holds at most (arrived or in flight), beside the
    /// budget.
    pub fn staging_experts(&self) -> usize {
        self.staging
    }

    /// Experts pinned at start-up.
    pub fn pinned(&self) -> usize {
        self.cache.lock().unwrap().pinned.len()
    }

    /// Bytes held by the RAM cache now.
    pub fn cached_bytes(&self) -> u64 {
        self.cache.lock().unwrap().bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budgets_parse() {
        assert_eq!("auto".parse::<RamBudget>(), Ok(RamBudget::Auto));
        assert_eq!("0".parse::<RamBudget>(), Ok(RamBudget::Bytes(0)));
        assert_eq!("4G".parse::<RamBudget>(), Ok(RamBudget::Bytes(4 << 30)));
        assert_eq!(
            "512MiB".parse::<RamBudget>(),
            Ok(RamBudget::Bytes(512 << 20))
        );
        assert_eq!("1.5k".parse::<RamBudget>(), Ok(RamBudget::Bytes(1536)));
        assert_eq!("25%".parse::<RamBudget>(), Ok(RamBudget::Percent(25.0)));
        for bad in ["-1", "12X", "150%", "G", "", "4GBBB", "4ib", "1e9"] {
            assert!(bad.parse::<RamBudget>().is_err(), "{bad}");
        }
    }
}
