//! Checkpoint files: `model.safetensors` or shards listed by `model.safetensors.index.json`,
//! mapped with memmap2 and described by the safetensors crate's header parser.
//!
//! This module knows the HF GPT-OSS tensor names and the L0 contract: every mandatory tensor is
//! present with an accepted dtype and the shape config.json implies, or loading fails with an
//! error naming the tensor and the file. It knows nothing about devices or caches.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

use crate::arch::Family;
use crate::arch::gpt_oss;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::pages::PageBuffer;

/// A tensor's place in a checkpoint.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    pub name: String,
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range in the shard file (absolute, header included).
    pub range: Range<usize>,
}

struct Shard {
    path: PathBuf,
    map: Arc<Mmap>,
}

/// The mapped files of one checkpoint and the tensors they hold.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
}

/// Bytes of one tensor: a range of a mapped file (kept alive by the handle) or an owned buffer.
#[derive(Clone)]
pub struct TensorBytes {
    backing: Backing,
    range: Range<usize>,
    /// Where these bytes start in the checkpoint's shards, where they came from one (kept by
    /// copies: the expert store reads experts there).
    origin: Option<FilePlace>,
}

/// A position in a checkpoint's shard files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FilePlace {
    pub shard: usize,
    pub offset: u64,
}

#[derive(Clone)]
enum Backing {
    Mapped(Arc<Mmap>),
    /// An anonymous mapping the process filled (`huge_buffer`): memory, not a file.
    Anonymous(Arc<Mmap>),
    Owned(Arc<Vec<u8>>),
    Pages(Arc<PageBuffer>),
}

impl TensorBytes {
    pub fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mapped(map) | Backing::Anonymous(map) => &map[self.range.clone()],
            Backing::Owned(buffer) => &buffer[self.range.clone()],
            Backing::Pages(pages) => &pages.bytes()[self.range.clone()],
        }
    }

    /// A range of a mapped file.
    pub fn mapped(map: Arc<Mmap>, range: Range<usize>) -> TensorBytes {
        TensorBytes {
            backing: Backing::Mapped(map),
            range,
            origin: None,
        }
    }

    /// A range of a page-aligned buffer (an O_DIRECT read).
    pub fn paged(pages: Arc<PageBuffer>, range: Range<usize>) -> TensorBytes {
        TensorBytes {
            backing: Backing::Pages(pages),
            range,
            origin: None,
        }
    }

    /// A range of a shared in-memory buffer (one read holding several tensors).
    pub fn shared(buffer: Arc<Vec<u8>>, range: Range<usize>) -> TensorBytes {
        TensorBytes {
            backing: Backing::Owned(buffer),
            range,
            origin: None,
        }
    }

    /// `range` (relative to this view) of the same bytes, sharing their backing.
    pub fn slice(&self, range: Range<usize>) -> TensorBytes {
        assert!(range.start <= range.end && range.end <= self.range.len());
        TensorBytes {
            backing: self.backing.clone(),
            range: self.range.start + range.start..self.range.start + range.end,
            origin: self.origin.map(|o| FilePlace {
                offset: o.offset + range.start as u64,
                ..o
            }),
        }
    }

    /// Whether these bytes are a range of a mapped file, or of a buffer `huge_buffer` filled
    /// (the expert store views both in place).
    pub fn is_mapped(&self) -> bool {
        matches!(self.backing, Backing::Mapped(_) | Backing::Anonymous(_))
    }

    /// Maps the pages of a mapped range into the process now (the OS reads those the page cache
    /// lacks), so kernels computing over them later do not stall on page faults. Nothing to do
    /// for bytes already in memory.
    pub fn populate(&self) {
        let Backing::Mapped(map) = &self.backing else {
            return;
        };
        const PAGE: usize = 4096;
        let first = self.range.start / PAGE * PAGE;
        let len = self.range.end - first;
        if len == 0 {
            return;
        }
        #[cfg(target_os = "linux")]
        {
            // MADV_POPULATE_READ (Linux 5.14+); older kernels answer EINVAL and we touch pages.
            const MADV_POPULATE_READ: libc::c_int = 22;
            // Safety: `first..first + len` lies within the mapping `map` (page-aligned start,
            // in-bounds end), which the Arc keeps alive; the advice only faults pages in.
            let done = unsafe {
                libc::madvise(map.as_ptr().add(first) as *mut _, len, MADV_POPULATE_READ) == 0
            };
            if done {
                return;
            }
        }
        let bytes = &map[first..self.range.end];
        for page in bytes.chunks(PAGE) {
            // A read the optimizer cannot drop: it faults the page in.
            std::hint::black_box(page[0]);
        }
    }

    /// Gets these bytes ready for timed reads: mapped ranges are faulted in (`populate`), and
    /// copies in memory (`huge_buffer`) are read once, in parallel. The first read of memory
    /// the process has just written can be far slower than the next ones on some virtual
    /// machines, with no page fault in the guest, and a timed run should not pay for it.
    pub fn warm(&self) {
        use rayon::prelude::*;
        match &self.backing {
            Backing::Mapped(_) => self.populate(),
            Backing::Anonymous(_) => {
                const CHUNK: usize = 256 << 10;
                let sum = self
                    .bytes()
                    .par_chunks(CHUNK)
                    .map(|chunk| chunk.iter().step_by(64).fold(0u8, |a, &b| a ^ b))
                    .reduce(|| 0, |a, b| a ^ b);
                std::hint::black_box(sum);
            }
            Backing::Owned(_) | Backing::Pages(_) => {}
        }
    }

    /// Reads a mapped range into the OS page cache on a background thread, a chunk at a time
    /// (each faulted in, then released), so the process's resident memory grows by one chunk at
    /// most: for weights read a row at a time, such as the embeddings, whose first reads would
    /// otherwise each wait on the disk once their pages are evicted. `MADV_WILLNEED` alone reads
    /// only the first few hundred KiB. Nothing to do for bytes in memory, or off Linux (where
    /// releasing the pages is not known to leave them cached).
    pub fn read_ahead(&self) {
        const CHUNK: usize = 8 << 20;
        if !cfg!(target_os = "linux") || !matches!(self.backing, Backing::Mapped(_)) {
            return;
        }
        let bytes = self.clone();
        let started = std::thread::Builder::new()
            .name("picchio-read-ahead".into())
            .spawn(move || {
                let started = std::time::Instant::now();
                let len = bytes.range.len();
                for start in (0..len).step_by(CHUNK) {
                    let chunk = bytes.slice(start..(start + CHUNK).min(len));
                    chunk.populate();
                    chunk.release();
                }
                log::debug!(
                    "read ahead {:.2} GB in {:.1} s",
                    len as f64 / 1e9,
                    started.elapsed().as_secs_f64()
                );
            });
        if let Err(e) = started {
            log::debug!("no read-ahead thread: {e}");
        }
    }

    /// Drops the process's pages of a mapped range (the data stays in the file and the OS page
    /// cache, and reading it again faults it back in): for weights a copy has replaced, or read
    /// a row at a time, so they stop counting in the resident memory. Nothing to do for bytes
    /// in memory.
    pub fn release(&self) {
        let Backing::Mapped(map) = &self.backing else {
            return;
        };
        #[cfg(not(unix))]
        let _ = map; // Elsewhere the OS trims the working set of a mapping itself.
        #[cfg(unix)]
        {
            const PAGE: usize = 4096;
            // Only whole pages inside the range: the neighbours may still be in use.
            let first = self.range.start.div_ceil(PAGE) * PAGE;
            let end = self.range.end / PAGE * PAGE;
            if end > first {
                // Safety: the mapping is a read-only shared file mapping: dropping its pages loses
                // nothing (a later read faults the file's bytes back in), so every slice over it
                // stays valid and unchanged.
                let released = unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        first,
                        end - first,
                    )
                };
                if let Err(e) = released {
                    log::debug!("could not release {} mapped bytes: {e}", end - first);
                }
            }
        }
    }

    /// A copy of these bytes in a `huge_buffer`, made in parallel chunks; each chunk of a mapped
    /// source is faulted in, copied and released, so the file's pages never all count in the
    /// resident memory at once.
    pub fn copy_to_memory(&self) -> std::io::Result<TensorBytes> {
        self.copy_to_memory_then(|_| {})
    }

    /// `copy_to_memory`, with `change` applied to the copy before it becomes read-only.
    pub fn copy_to_memory_then(
        &self,
        change: impl FnOnce(&mut [u8]),
    ) -> std::io::Result<TensorBytes> {
        if self.range.is_empty() {
            return Ok(self.clone());
        }
        let mut copies = TensorBytes::copy_all_then(&[self], change)?;
        Ok(copies.remove(0))
    }

    /// Copies of `parts`, back to back in one `huge_buffer` (as `copy_to_memory` makes them), so
    /// that `joined` can view neighbours as one tensor.
    pub fn copy_all_to_memory(parts: &[&TensorBytes]) -> std::io::Result<Vec<TensorBytes>> {
        TensorBytes::copy_all_then(parts, |_| {})
    }

    /// `copy_all_to_memory`, with `change` applied to the whole buffer before it becomes
    /// read-only.
    fn copy_all_then(
        parts: &[&TensorBytes],
        change: impl FnOnce(&mut [u8]),
    ) -> std::io::Result<Vec<TensorBytes>> {
        use rayon::prelude::*;
        const CHUNK: usize = 8 << 20;
        let mut starts = Vec::with_capacity(parts.len());
        let mut len = 0;
        for part in parts {
            starts.push(len);
            len += part.range.len();
        }
        let mut buffer = huge_buffer(len)?;
        for (part, &start) in parts.iter().zip(&starts) {
            buffer[start..start + part.range.len()]
                .par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(c, out)| {
                    let source = part.slice(c * CHUNK..c * CHUNK + out.len());
                    source.populate();
                    out.copy_from_slice(source.bytes());
                    source.release();
                });
        }
        change(&mut buffer[..]);
        let whole = freeze(buffer)?;
        Ok(parts
            .iter()
            .zip(starts)
            .map(|(part, start)| TensorBytes {
                origin: part.origin,
                ..whole.slice(start..start + part.range.len())
            })
            .collect())
    }

    /// `self` then `next` as one view, where `next` starts where `self` ends in the same buffer
    /// (as `copy_all_to_memory` leaves neighbours).
    pub fn joined(&self, next: &TensorBytes) -> Option<TensorBytes> {
        let same_buffer = match (&self.backing, &next.backing) {
            (Backing::Mapped(a), Backing::Mapped(b))
            | (Backing::Anonymous(a), Backing::Anonymous(b)) => Arc::ptr_eq(a, b),
            (Backing::Owned(a), Backing::Owned(b)) => Arc::ptr_eq(a, b),
            (Backing::Pages(a), Backing::Pages(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        // A mapped file's neighbours are neighbours in the file too; copies need not be.
        let origin = match self.backing {
            Backing::Mapped(_) => self.origin,
            _ => None,
        };
        (same_buffer && self.range.end == next.range.start).then(|| TensorBytes {
            backing: self.backing.clone(),
            range: self.range.start..next.range.end,
            origin,
        })
    }

    /// Where these bytes start in the checkpoint's shards, if they came from there.
    pub fn origin(&self) -> Option<FilePlace> {
        self.origin
    }

    /// Bytes held in memory rather than in a checkpoint file (tests, benches, converted data).
    pub fn from_vec(bytes: Vec<u8>) -> TensorBytes {
        TensorBytes {
            range: 0..bytes.len(),
            backing: Backing::Owned(Arc::new(bytes)),
            origin: None,
        }
    }
}

impl std::fmt::Debug for TensorBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorBytes({:?})", self.range)
    }
}

/// A zeroed anonymous buffer of `len` bytes (at least 1), backed by huge pages where the OS
/// grants them: reads through 2 MiB pages miss the TLB far less than through 4 KiB ones.
pub fn huge_buffer(len: usize) -> std::io::Result<memmap2::MmapMut> {
    let buffer = memmap2::MmapMut::map_anon(len.max(1))?;
    #[cfg(target_os = "linux")]
    if let Err(e) = buffer.advise(memmap2::Advice::HugePage) {
        log::debug!("no huge pages for a {len}-byte buffer: {e}");
    }
    Ok(buffer)
}

/// A filled `huge_buffer`, read-only from now on, as tensor bytes.
pub fn freeze(buffer: memmap2::MmapMut) -> std::io::Result<TensorBytes> {
    let len = buffer.len();
    Ok(TensorBytes {
        backing: Backing::Anonymous(Arc::new(buffer.make_read_only()?)),
        range: 0..len,
        origin: None,
    })
}

/// A model path must be an existing directory.
pub(crate) fn require_dir(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let what = if dir.exists() {
        "not a directory"
    } else {
        "model directory not found"
    };
    Err(Error::io(
        dir,
        std::io::Error::new(std::io::ErrorKind::NotFound, what),
    ))
}

/// Fails unless `path` is a regular file (or a link to one): opening a FIFO blocks until a
/// writer comes, and a directory or device cannot be mapped.
pub(crate) fn require_regular_file(path: &Path) -> Result<()> {
    let kind = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .file_type();
    if kind.is_file() {
        return Ok(());
    }
    let what = if kind.is_dir() {
        "a directory"
    } else {
        "a FIFO, socket or device"
    };
    Err(Error::io(
        path,
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{what}, not a regular file"),
        ),
    ))
}

const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_FILE: &str = "model.safetensors";

impl Checkpoint {
    /// Opens every shard of the checkpoint in `dir` and reads their headers.
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        require_dir(dir)?;
        if dir.join(crate::flat_store::PARTIAL_MARKER).exists() {
            return Err(Error::InvalidArgument(format!(
                "{} is a half-written picchio convert output (the conversion did not finish): convert again",
                dir.display()
            )));
        }
        let index_path = dir.join(INDEX_FILE);
        let (files, weight_map) = if index_path.is_file() {
            let (files, map) = read_index(&index_path)?;
            (files, Some(map))
        } else if dir.join(SINGLE_FILE).is_file() {
            (vec![SINGLE_FILE.to_string()], None)
        } else {
            // Shards without an index: take every *.safetensors file in name order.
            let mut files: Vec<String> = std::fs::read_dir(dir)
                .map_err(|e| Error::io(dir, e))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            files.sort();
            if files.is_empty() {
                return Err(Error::io(
                    dir,
                    std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        format!("no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors file"),
                    ),
                ));
            }
            (files, None)
        };

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = BTreeMap::new();
        for (shard_index, file) in files.iter().enumerate() {
            let path = dir.join(file);
            require_regular_file(&path)?;
            let handle = File::open(&path).map_err(|e| Error::io(&path, e))?;
            // SAFETY: the mapping is read-only and private to this process. A checkpoint file
            // modified or truncated by another process while mapped is outside what we can guard
            // against (as for every mmap-based loader); every offset we read is checked against the
            // mapping's length by safetensors' header validation below.
            let map = unsafe { Mmap::map(&handle) }.map_err(|e| Error::io(&path, e))?;
            let (header_len, metadata) =
                SafeTensors::read_metadata(&map).map_err(|e| Error::Safetensors {
                    file: path.clone(),
                    msg: describe_header_error(e, map.len()),
                })?;
            let data_start = 8 + header_len;
            for (name, info) in metadata.tensors() {
                let (begin, end) = info.data_offsets;
                let entry = TensorEntry {
                    name: name.clone(),
                    shard: shard_index,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    range: data_start + begin..data_start + end,
                };
                if let Some(map) = &weight_map {
                    // The index is the authority on which file holds a tensor.
                    if map.get(&name).map(String::as_str) != Some(file.as_str()) {
                        continue;
                    }
                }
                if let Some(previous) = tensors.insert(name.clone(), entry) {
                    let other: &Shard = &shards[previous.shard];
                    return Err(Error::Safetensors {
                        file: path.clone(),
                        msg: format!("tensor `{name}` is also in {}", other.path.display()),
                    });
                }
            }
            shards.push(Shard {
                path,
                map: Arc::new(map),
            });
        }
        if let Some(map) = &weight_map {
            for (name, file) in map {
                if !tensors.contains_key(name) {
                    return Err(Error::ShardIndex {
                        file: index_path.clone(),
                        msg: format!("tensor `{name}` is listed in {file}, which does not hold it"),
                    });
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn tensors(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.values()
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    pub fn file_of(&self, entry: &TensorEntry) -> &Path {
        &self.shards[entry.shard].path
    }

    pub fn shard_paths(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|s| s.path.as_path())
    }

    pub fn bytes_of(&self, entry: &TensorEntry) -> TensorBytes {
        TensorBytes {
            backing: Backing::Mapped(self.shards[entry.shard].map.clone()),
            range: entry.range.clone(),
            origin: Some(FilePlace {
                shard: entry.shard,
                offset: entry.range.start as u64,
            }),
        }
    }

    /// Looks up a mandatory tensor and checks its dtype and shape (the L0 contract).
    pub fn require(&self, name: &str, dtypes: &[Dtype], shape: &[usize]) -> Result<&TensorEntry> {
        let entry = self.get(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            dir: self.dir.clone(),
        })?;
        if !dtypes.contains(&entry.dtype) {
            let expected: Vec<String> = dtypes.iter().map(|d| format!("{d:?}")).collect();
            return Err(Error::TensorDtype {
                name: name.to_string(),
                file: self.file_of(entry).to_path_buf(),
                found: format!("{:?}", entry.dtype),
                expected: expected.join(" or "),
            });
        }
        if entry.shape != shape {
            return Err(Error::TensorShape {
                name: name.to_string(),
                file: self.file_of(entry).to_path_buf(),
                found: entry.shape.clone(),
                expected: shape.to_vec(),
            });
        }
        Ok(entry)
    }

    /// A mandatory float matrix `[rows, cols]`, viewed where it lies.
    pub fn dense_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<DenseMatrix> {
        let entry = self.require(name, &FloatFormat::DTYPES, &[rows, cols])?;
        Ok(DenseMatrix {
            rows,
            cols,
            format: FloatFormat::of(entry.dtype),
            data: self.bytes_of(entry),
        })
    }

    /// A mandatory float tensor of `shape`, decoded to f32 (norms, biases, sinks).
    pub fn float_vector(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let entry = self.require(name, &FloatFormat::DTYPES, shape)?;
        Ok(crate::formats::decode_floats(
            FloatFormat::of(entry.dtype),
            self.bytes_of(entry).bytes(),
        ))
    }
}

fn describe_header_error(e: safetensors::SafeTensorError, file_len: usize) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::MetadataIncompleteBuffer => format!(
            "the header's tensor data does not end where the file ends ({file_len} bytes): truncated or corrupt"
        ),
        E::InvalidHeaderLength | E::HeaderTooSmall => {
            format!(
                "the header length does not fit in the file ({file_len} bytes): truncated or not safetensors"
            )
        }
        other => other.to_string(),
    }
}

fn read_index(path: &Path) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let fail = |msg: String| Error::ShardIndex {
        file: path.to_path_buf(),
        msg,
    };
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| fail(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| fail("no \"weight_map\" object".into()))?;
    let mut weight_map = BTreeMap::new();
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| fail(format!("weight_map entry for `{name}` is not a file name")))?;
        if file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(fail(format!(
                "shard name {file:?} is not a plain file name"
            )));
        }
        files.insert(file.to_string());
        weight_map.insert(name.clone(), file.to_string());
    }
    if files.is_empty() {
        return Err(fail("weight_map is empty".into()));
    }
    Ok((files.into_iter().collect(), weight_map))
}

/// Floating-point storage formats of dense tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatFormat {
    Bf16,
    F16,
    F32,
}

impl FloatFormat {
    pub const DTYPES: [Dtype; 3] = [Dtype::BF16, Dtype::F16, Dtype::F32];

    /// The format of a dtype the L0 check accepted (`DTYPES`).
    pub(crate) fn of(dtype: Dtype) -> FloatFormat {
        match dtype {
            Dtype::BF16 => FloatFormat::Bf16,
            Dtype::F16 => FloatFormat::F16,
            Dtype::F32 => FloatFormat::F32,
            other => unreachable!("dtype {other:?} was rejected by the L0 check"),
        }
    }

    pub fn size(self) -> usize {
        match self {
            FloatFormat::Bf16 | FloatFormat::F16 => 2,
            FloatFormat::F32 => 4,
        }
    }
}

/// A dense `[rows, cols]` matrix in PyTorch `[out, in]` orientation.
#[derive(Debug, Clone)]
pub struct DenseMatrix {
    pub rows: usize,
    pub cols: usize,
    pub format: FloatFormat,
    pub data: TensorBytes,
}

impl DenseMatrix {
    pub fn row(&self, r: usize) -> &[u8] {
        let width = self.cols * self.format.size();
        &self.data.bytes()[r * width..(r + 1) * width]
    }

    /// The rows of `parts` one after the other, as one matrix, where they share a format and a
    /// width and lie back to back in one buffer (`ModelWeights::copy_to_memory` lays each
    /// layer's q, k and v out so); else None.
    pub fn stacked(parts: &[&DenseMatrix]) -> Option<DenseMatrix> {
        let (first, rest) = parts.split_first()?;
        let mut data = first.data.clone();
        for m in rest {
            if m.format != first.format || m.cols != first.cols {
                return None;
            }
            data = data.joined(&m.data)?;
        }
        Some(DenseMatrix {
            rows: parts.iter().map(|m| m.rows).sum(),
            cols: first.cols,
            format: first.format,
            data,
        })
    }
}

/// Where consecutive experts start in a weights or scales buffer: one after the other, as a
/// checkpoint's `[E, ...]` tensor holds them, or every `stride` bytes, as the records of a
/// converted expert store do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertStride {
    Contiguous,
    Bytes(usize),
}

impl ExpertStride {
    fn of(self, expert_bytes: usize) -> usize {
        match self {
            ExpertStride::Contiguous => expert_bytes,
            ExpertStride::Bytes(b) => b,
        }
    }
}

/// MXFP4 weights of all experts of one projection: `blocks [E, R, C/32, 16]`,
/// `scales [E, R, C/32]` (E8M0), i.e. `E` matrices of `[R, C]`.
#[derive(Debug, Clone)]
pub struct Mxfp4Experts {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub blocks: TensorBytes,
    pub scales: TensorBytes,
    pub stride: ExpertStride,
    /// Whether the whole runs of every row whose scales fold are interleaved for the CPU tier's
    /// kernel (`cpu::layout::interleaved_copy`); else the checkpoint's layout, which the GPU
    /// tier reads.
    pub interleaved: bool,
}

/// The packed bytes and the scale bytes of rows `range` of expert `e` (back to back), for 4-bit
/// experts with `scale_size` bytes per 32 inputs.
fn packed_rows<'a>(
    (rows, cols, stride): (usize, usize, ExpertStride),
    (packed, scales, scale_size): (&'a TensorBytes, &'a TensorBytes, usize),
    e: usize,
    range: std::ops::Range<usize>,
) -> (&'a [u8], &'a [u8]) {
    assert!(range.end <= rows, "rows {range:?} of a {rows}-row expert");
    let groups = cols / 32;
    let (row_bytes, row_scales) = (groups * 16, groups * scale_size);
    let w0 = e * stride.of(rows * row_bytes);
    let s0 = e * stride.of(rows * row_scales);
    (
        &packed.bytes()[w0 + range.start * row_bytes..w0 + range.end * row_bytes],
        &scales.bytes()[s0 + range.start * row_scales..s0 + range.end * row_scales],
    )
}

impl Mxfp4Experts {
    /// Experts stored one after the other (a checkpoint's `[E, ...]` tensors).
    pub fn contiguous(
        experts: usize,
        (rows, cols): (usize, usize),
        blocks: TensorBytes,
        scales: TensorBytes,
    ) -> Mxfp4Experts {
        Mxfp4Experts {
            experts,
            rows,
            cols,
            blocks,
            scales,
            stride: ExpertStride::Contiguous,
            interleaved: false,
        }
    }

    /// The packed bytes and scales of row `r` of expert `e`.
    pub fn row(&self, e: usize, r: usize) -> (&[u8], &[u8]) {
        self.rows_of(e, r..r + 1)
    }

    /// Rows `range` of expert `e`, back to back: (blocks, scales).
    pub fn rows_of(&self, e: usize, range: std::ops::Range<usize>) -> (&[u8], &[u8]) {
        let shape = (self.rows, self.cols, self.stride);
        packed_rows(shape, (&self.blocks, &self.scales, 1), e, range)
    }
}

/// Group-scaled INT4 experts (picchio's converted format): `qweight [E, R, C/2]` with two signed
/// 4-bit values per byte (low nibble first, value = nibble - 8) and `scales [E, R, C/32]` f16, one
/// per 32 consecutive inputs of a row: `w = (nibble - 8) * scale`.
#[derive(Debug, Clone)]
pub struct Int4Experts {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub qweight: TensorBytes,
    pub scales: TensorBytes,
    pub stride: ExpertStride,
}

impl Int4Experts {
    /// Experts stored one after the other.
    pub fn contiguous(
        experts: usize,
        (rows, cols): (usize, usize),
        qweight: TensorBytes,
        scales: TensorBytes,
    ) -> Int4Experts {
        Int4Experts {
            experts,
            rows,
            cols,
            qweight,
            scales,
            stride: ExpertStride::Contiguous,
        }
    }

    /// The packed bytes and f16 scale bytes of row `r` of expert `e`.
    pub fn row(&self, e: usize, r: usize) -> (&[u8], &[u8]) {
        self.rows_of(e, r..r + 1)
    }

    /// Rows `range` of expert `e`, back to back: (packed values, scales).
    pub fn rows_of(&self, e: usize, range: std::ops::Range<usize>) -> (&[u8], &[u8]) {
        let shape = (self.rows, self.cols, self.stride);
        packed_rows(shape, (&self.qweight, &self.scales, 2), e, range)
    }
}

/// Unquantized experts in transformers' orientation, `[E, in, out]` (`x @ W`): what
/// `save_pretrained` writes for a GPT-OSS model that was never quantized or was dequantized.
#[derive(Debug, Clone)]
pub struct DenseExperts {
    pub experts: usize,
    pub inputs: usize,
    pub outputs: usize,
    pub format: FloatFormat,
    pub data: TensorBytes,
}

impl DenseExperts {
    /// The `outputs` weights that input `i` of expert `e` feeds.
    pub fn input_row(&self, e: usize, i: usize) -> &[u8] {
        let width = self.outputs * self.format.size();
        let row = e * self.inputs + i;
        &self.data.bytes()[row * width..(row + 1) * width]
    }
}

/// Float experts in PyTorch's `[out, in]` orientation (`W x`), each expert's matrix as the row
/// blocks that stack into it: Qwen3-MoE's gate and up tensors (one block where they lie back to
/// back), its down tensor, or an expert's slice of a fused `[E, out, in]` tensor.
#[derive(Debug, Clone)]
pub struct RowExperts {
    pub rows: usize,
    pub cols: usize,
    pub format: FloatFormat,
    /// Per expert, its row blocks in order (their rows add up to `rows`).
    pub blocks: Vec<Vec<TensorBytes>>,
}

impl RowExperts {
    pub fn new(
        (rows, cols): (usize, usize),
        format: FloatFormat,
        blocks: Vec<Vec<TensorBytes>>,
    ) -> RowExperts {
        RowExperts {
            rows,
            cols,
            format,
            blocks,
        }
    }

    /// Expert `e`'s row blocks as matrices, in order.
    pub fn matrices(&self, e: usize) -> Vec<DenseMatrix> {
        let row_bytes = self.cols * self.format.size();
        self.blocks[e]
            .iter()
            .map(|data| DenseMatrix {
                rows: data.bytes().len() / row_bytes,
                cols: self.cols,
                format: self.format,
                data: data.clone(),
            })
            .collect()
    }
}

/// One projection of all experts of a layer, as the checkpoint stores it.
#[derive(Debug, Clone)]
pub enum ExpertMatrices {
    Mxfp4(Mxfp4Experts),
    Int4(Int4Experts),
    Dense(DenseExperts),
    Rows(RowExperts),
}

impl ExpertMatrices {
    /// Output size of one expert's projection.
    pub fn outputs(&self) -> usize {
        match self {
            ExpertMatrices::Mxfp4(m) => m.rows,
            ExpertMatrices::Int4(m) => m.rows,
            ExpertMatrices::Dense(d) => d.outputs,
            ExpertMatrices::Rows(r) => r.rows,
        }
    }

    /// Input size of one expert's projection.
    pub fn inputs(&self) -> usize {
        match self {
            ExpertMatrices::Mxfp4(m) => m.cols,
            ExpertMatrices::Int4(m) => m.cols,
            ExpertMatrices::Dense(d) => d.inputs,
            ExpertMatrices::Rows(r) => r.cols,
        }
    }
}

/// Weights of one decoder layer.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_attention_norm: Vec<f32>,
    pub q: DenseMatrix,
    pub k: DenseMatrix,
    pub v: DenseMatrix,
    pub o: DenseMatrix,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    /// Each query and key head's RMSNorm weights, `[head_dim]` (Qwen3-MoE).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    /// One learned sink logit per head (GPT-OSS).
    pub sinks: Option<Vec<f32>>,
    pub router: DenseMatrix,
    pub router_bias: Option<Vec<f32>>,
    /// `E x [2I, H]`: GPT-OSS's rows interleaved (even = gate unit, odd = up unit), Qwen3-MoE's
    /// gate rows then up rows.
    pub gate_up: ExpertMatrices,
    /// `[E, 2I]`
    pub gate_up_bias: Option<Vec<f32>>,
    /// `E x [H, I]`
    pub down: ExpertMatrices,
    /// `[E, H]`
    pub down_bias: Option<Vec<f32>>,
}

impl LayerWeights {
    /// The q, k and v projections stacked into one matrix (rows q, then k, then v), where their
    /// bytes lie back to back: one call reads them all.
    pub fn qkv(&self) -> Option<DenseMatrix> {
        DenseMatrix::stacked(&[&self.q, &self.k, &self.v])
    }
}

/// All weights of a GPT-OSS model, validated against its config.
pub struct ModelWeights {
    pub embeddings: DenseMatrix,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub lm_head: DenseMatrix,
    /// The converted expert store the experts come from, when the directory has one
    /// (`picchio convert`); else they are the checkpoint's tensors.
    pub flat: Option<Arc<crate::flat_store::FlatExperts>>,
}

/// A tier's own layout of MXFP4 experts, made while they are copied into memory: the copy, or
/// None to keep the checkpoint's layout. The reader knows no kernels; the tier that prefers a
/// layout makes it (`cpu::layout::interleaved_copy`).
pub type ExpertRelayout = dyn Fn(&Mxfp4Experts) -> std::io::Result<Option<Mxfp4Experts>> + Sync;

/// What a tensor is, for `inspect` and byte accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorRole {
    Embedding,
    LmHead,
    Dense,
    Expert,
    Unknown,
}

pub fn tensor_role(name: &str) -> TensorRole {
    crate::arch::gpt_oss::tensor_role(name)
}

/// A short description of a tensor's storage format.
pub fn tensor_format(name: &str, dtype: Dtype) -> String {
    if name.ends_with("_proj_blocks") {
        "mxfp4 blocks (2 x e2m1 per byte)".into()
    } else if name.ends_with("_proj_scales") {
        "mxfp4 scales (e8m0)".into()
    } else {
        format!("{dtype:?}").to_lowercase()
    }
}

impl ExpertMatrices {
    /// Number of experts.
    pub fn experts(&self) -> usize {
        match self {
            ExpertMatrices::Mxfp4(m) => m.experts,
            ExpertMatrices::Int4(m) => m.experts,
            ExpertMatrices::Dense(d) => d.experts,
            ExpertMatrices::Rows(r) => r.blocks.len(),
        }
    }

    /// Bytes of all experts of this projection.
    pub fn bytes(&self) -> usize {
        self.experts() * self.expert_bytes()
    }

    /// Bytes of one expert (weights and scales).
    pub fn expert_bytes(&self) -> usize {
        let (weights, scales) = self.part_sizes();
        weights + scales
    }

    /// Weight bytes and scale bytes (0 for float experts) of one expert.
    pub fn part_sizes(&self) -> (usize, usize) {
        match self {
            ExpertMatrices::Mxfp4(m) => (m.rows * m.cols / 2, m.rows * m.cols / 32),
            ExpertMatrices::Int4(m) => (m.rows * m.cols / 2, m.rows * m.cols / 16),
            ExpertMatrices::Dense(d) => (d.inputs * d.outputs * d.format.size(), 0),
            ExpertMatrices::Rows(r) => (r.rows * r.cols * r.format.size(), 0),
        }
    }

    /// Expert `e` alone, as a one-expert view of the same bytes (no copy).
    pub fn single(&self, e: usize) -> ExpertMatrices {
        let (w, s) = self.part_sizes();
        let at = |bytes: &TensorBytes, stride: ExpertStride, len: usize| {
            let start = e * stride.of(len);
            bytes.slice(start..start + len)
        };
        match self {
            ExpertMatrices::Mxfp4(m) => ExpertMatrices::Mxfp4(Mxfp4Experts {
                interleaved: m.interleaved,
                ..Mxfp4Experts::contiguous(
                    1,
                    (m.rows, m.cols),
                    at(&m.blocks, m.stride, w),
                    at(&m.scales, m.stride, s),
                )
            }),
            ExpertMatrices::Int4(m) => ExpertMatrices::Int4(Int4Experts::contiguous(
                1,
                (m.rows, m.cols),
                at(&m.qweight, m.stride, w),
                at(&m.scales, m.stride, s),
            )),
            ExpertMatrices::Dense(d) => ExpertMatrices::Dense(DenseExperts {
                experts: 1,
                data: at(&d.data, ExpertStride::Contiguous, w),
                ..d.clone()
            }),
            ExpertMatrices::Rows(r) => ExpertMatrices::Rows(RowExperts {
                blocks: vec![r.blocks[e].clone()],
                ..r.clone()
            }),
        }
    }

    /// The same matrices over bytes `copy` makes of each of their tensors.
    fn with_tensors(
        &self,
        mut copy: impl FnMut(&TensorBytes) -> std::io::Result<TensorBytes>,
    ) -> std::io::Result<ExpertMatrices> {
        Ok(match self {
            ExpertMatrices::Mxfp4(m) => ExpertMatrices::Mxfp4(Mxfp4Experts {
                blocks: copy(&m.blocks)?,
                scales: copy(&m.scales)?,
                ..m.clone()
            }),
            ExpertMatrices::Int4(m) => ExpertMatrices::Int4(Int4Experts {
                qweight: copy(&m.qweight)?,
                scales: copy(&m.scales)?,
                ..m.clone()
            }),
            ExpertMatrices::Dense(d) => ExpertMatrices::Dense(DenseExperts {
                data: copy(&d.data)?,
                ..d.clone()
            }),
            ExpertMatrices::Rows(r) => ExpertMatrices::Rows(RowExperts {
                blocks: (r.blocks.iter())
                    .map(|blocks| blocks.iter().map(&mut copy).collect())
                    .collect::<std::io::Result<_>>()?,
                ..r.clone()
            }),
        })
    }

    /// The byte views this projection reads.
    fn tensors(&self) -> Vec<&TensorBytes> {
        match self {
            ExpertMatrices::Mxfp4(m) => vec![&m.blocks, &m.scales],
            ExpertMatrices::Int4(m) => vec![&m.qweight, &m.scales],
            ExpertMatrices::Dense(d) => vec![&d.data],
            ExpertMatrices::Rows(r) => r.blocks.iter().flatten().collect(),
        }
    }

    /// Whether every byte of this projection is a range of a mapped file.
    pub fn is_mapped(&self) -> bool {
        self.tensors().iter().all(|t| t.is_mapped())
    }

    /// Faults the mapped pages of these bytes in (see `TensorBytes::populate`).
    pub fn populate(&self) {
        for t in self.tensors() {
            t.populate();
        }
    }

    /// Gets these bytes ready for timed reads (see `TensorBytes::warm`).
    pub fn warm(&self) {
        for t in self.tensors() {
            t.warm();
        }
    }

    /// Expert `e`'s weight bytes as the pieces that follow each other in its matrix (one, but
    /// for a Qwen3-MoE expert whose gate and up tensors lie apart), and its scale bytes (absent
    /// for float experts).
    pub fn expert_pieces(&self, e: usize) -> (Vec<&[u8]>, Option<&[u8]>) {
        match self {
            ExpertMatrices::Rows(r) => (r.blocks[e].iter().map(TensorBytes::bytes).collect(), None),
            _ => {
                let (weights, scales) = self.expert_parts(e);
                (vec![weights], scales)
            }
        }
    }

    /// The weight bytes and the scale bytes (absent for float experts) of expert `e`.
    pub fn expert_parts(&self, e: usize) -> (&[u8], Option<&[u8]>) {
        self.expert_run(e..e + 1)
            .expect("one expert's bytes are always back to back")
    }

    /// The weight and scale bytes of experts `run`, when they lie back to back: for one expert
    /// (but a Qwen3-MoE expert whose gate and up tensors lie apart), for several only where the
    /// experts are stored contiguously (a checkpoint's tensors, not a converted store's padded
    /// records).
    pub fn expert_run(&self, run: std::ops::Range<usize>) -> Option<(&[u8], Option<&[u8]>)> {
        fn slice<'a>(
            bytes: &'a TensorBytes,
            stride: ExpertStride,
            run: &std::ops::Range<usize>,
            len: usize,
        ) -> Option<&'a [u8]> {
            (run.len() <= 1 || stride == ExpertStride::Contiguous).then(|| {
                let start = run.start * stride.of(len);
                &bytes.bytes()[start..start + run.len() * len]
            })
        }
        let (w, s) = self.part_sizes();
        let run = &run;
        Some(match self {
            ExpertMatrices::Mxfp4(m) => (
                slice(&m.blocks, m.stride, run, w)?,
                Some(slice(&m.scales, m.stride, run, s)?),
            ),
            ExpertMatrices::Int4(m) => (
                slice(&m.qweight, m.stride, run, w)?,
                Some(slice(&m.scales, m.stride, run, s)?),
            ),
            ExpertMatrices::Dense(d) => (slice(&d.data, ExpertStride::Contiguous, run, w)?, None),
            ExpertMatrices::Rows(r) => match &r.blocks[run.start..run.end] {
                [expert] if expert.len() == 1 => (expert[0].bytes(), None),
                _ => return None,
            },
        })
    }
}

impl ModelWeights {
    /// Copies every weight a decoded token reads (routers, experts, and with `dense` the
    /// attention projections and the LM head; never the embeddings, read a row at a time) from
    /// the mapped checkpoint into huge-page memory, and drops the mapped pages. Returns the
    /// bytes copied. A converted expert store's experts stay mapped (they are read by record).
    pub fn copy_to_memory(
        &mut self,
        dense: bool,
        relayout: Option<&ExpertRelayout>,
    ) -> Result<u64> {
        let copied = std::cell::Cell::new(0u64);
        let copy_bytes = |t: &TensorBytes| {
            copied.set(copied.get() + t.bytes().len() as u64);
            t.copy_to_memory()
        };
        let copy_experts = self.flat.is_none();
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let what = format!("layer {l} weights");
            let mut matrices = vec![&mut layer.router];
            if dense {
                // Back to back, so that one call computes all three (`LayerWeights::qkv`).
                let parts = [&layer.q.data, &layer.k.data, &layer.v.data];
                let bytes: u64 = parts.iter().map(|t| t.bytes().len() as u64).sum();
                let copies =
                    TensorBytes::copy_all_to_memory(&parts).map_err(|e| Error::io(&what, e))?;
                copied.set(copied.get() + bytes);
                for (m, copy) in [&mut layer.q, &mut layer.k, &mut layer.v]
                    .into_iter()
                    .zip(copies)
                {
                    m.data = copy;
                }
                matrices.push(&mut layer.o);
            }
            for m in matrices {
                m.data = copy_bytes(&m.data).map_err(|e| Error::io(&what, e))?;
            }
            if copy_experts {
                for m in [&mut layer.gate_up, &mut layer.down] {
                    let relaid = match (&*m, relayout) {
                        (ExpertMatrices::Mxfp4(x), Some(relayout)) => {
                            relayout(x).map_err(|e| Error::io(&what, e))?
                        }
                        _ => None,
                    };
                    *m = match relaid {
                        Some(x) => {
                            let x = ExpertMatrices::Mxfp4(x);
                            copied.set(copied.get() + x.bytes() as u64);
                            x
                        }
                        None => m
                            .with_tensors(copy_bytes)
                            .map_err(|e| Error::io(&what, e))?,
                    };
                }
            }
        }
        if dense {
            self.lm_head.data =
                copy_bytes(&self.lm_head.data).map_err(|e| Error::io(gpt_oss::LM_HEAD, e))?;
        }
        Ok(copied.get())
    }

    /// Bytes of one expert's biases as the tiers hold them (f32; none for a family without
    /// expert biases).
    pub fn expert_bias_bytes(&self) -> usize {
        let Some(first) = self.layers.first() else {
            return 0;
        };
        let experts = first.gate_up.experts().max(1);
        let per_expert = |b: &Option<Vec<f32>>| b.as_ref().map_or(0, |b| b.len() / experts);
        4 * (per_expert(&first.gate_up_bias) + per_expert(&first.down_bias))
    }

    /// Whether some layer's MXFP4 experts were laid out for the CPU tier's kernel
    /// (`Mxfp4Experts::interleaved`), which the GPU tier cannot read.
    pub fn experts_interleaved(&self) -> bool {
        self.layers.iter().any(|l| {
            [&l.gate_up, &l.down]
                .iter()
                .any(|m| matches!(m, ExpertMatrices::Mxfp4(x) if x.interleaved))
        })
    }

    /// Bytes of every weight as the tiers hold them (matrices in their checkpoint format, norms,
    /// biases and sinks as f32).
    pub fn bytes(&self) -> usize {
        let floats = |v: &[f32]| v.len() * 4;
        let optional = |v: &Option<Vec<f32>>| v.as_deref().map_or(0, floats);
        let layers: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.q, &l.k, &l.v, &l.o, &l.router]
                    .iter()
                    .map(|m| m.data.bytes().len())
                    .sum::<usize>()
                    + l.gate_up.bytes()
                    + l.down.bytes()
                    + floats(&l.input_norm)
                    + floats(&l.post_attention_norm)
                    + optional(&l.sinks)
                    + optional(&l.router_bias)
                    + optional(&l.gate_up_bias)
                    + optional(&l.down_bias)
                    + optional(&l.q_norm)
                    + optional(&l.k_norm)
                    + optional(&l.q_bias)
                    + optional(&l.k_bias)
                    + optional(&l.v_bias)
                    + optional(&l.o_bias)
            })
            .sum();
        layers
            + self.embeddings.data.bytes().len()
            + self.lm_head.data.bytes().len()
            + floats(&self.final_norm)
    }

    /// Resolves and validates every tensor the forward pass needs.
    pub fn load(ck: &Checkpoint, cfg: &Config) -> Result<ModelWeights> {
        let h = cfg.hidden_size;
        let flat = crate::flat_store::FlatExperts::open(ck.dir(), cfg)?.map(Arc::new);
        let mut layers = Vec::new(); // grows as tensors are found: no trust in the config's count
        for l in 0..cfg.num_layers {
            // A converted store's records replace the checkpoint's experts, which it may lack.
            let converted = flat.as_deref().map(|store| LayerExperts {
                gate_up: store.projection(l, true),
                down: store.projection(l, false),
            });
            layers.push(match cfg.family {
                Family::GptOss => gpt_oss_layer(ck, cfg, l, converted)?,
                Family::Qwen3Moe => crate::arch::qwen3_moe::load_layer(ck, cfg, l, converted)?,
            });
        }
        let embeddings = ck.dense_matrix(gpt_oss::EMBEDDINGS, cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_word_embeddings && ck.get(gpt_oss::LM_HEAD).is_none() {
            embeddings.clone()
        } else {
            ck.dense_matrix(gpt_oss::LM_HEAD, cfg.vocab_size, h)?
        };
        Ok(ModelWeights {
            embeddings,
            layers,
            final_norm: ck.float_vector(gpt_oss::FINAL_NORM, &[h])?,
            lm_head,
            flat,
        })
    }
}

/// A layer's two expert projections.
pub struct LayerExperts {
    pub gate_up: ExpertMatrices,
    pub down: ExpertMatrices,
}

/// Layer `l` of a GPT-OSS checkpoint: MXFP4 experts as published (`*_blocks`/`*_scales`), or
/// unquantized `[E, in, out]` ones, unless `converted` gives them.
fn gpt_oss_layer(
    ck: &Checkpoint,
    cfg: &Config,
    l: usize,
    converted: Option<LayerExperts>,
) -> Result<LayerWeights> {
    let (h, i, e) = (cfg.hidden_size, cfg.intermediate_size, cfg.num_experts);
    if let Some(method) = &cfg.quant_method
        && method != "mxfp4"
    {
        return Err(Error::Unsupported(format!(
            "quantization_config.quant_method {method:?} (picchio reads mxfp4 experts)"
        )));
    }
    let experts = |prefix: &str, rows: usize, cols: usize| -> Result<ExpertMatrices> {
        let blocks_name = format!("{prefix}_blocks");
        if ck.get(&blocks_name).is_none() && ck.get(prefix).is_some() {
            let entry = ck.require(prefix, &FloatFormat::DTYPES, &[e, cols, rows])?;
            return Ok(ExpertMatrices::Dense(DenseExperts {
                experts: e,
                inputs: cols,
                outputs: rows,
                format: FloatFormat::of(entry.dtype),
                data: ck.bytes_of(entry),
            }));
        }
        if !cols.is_multiple_of(32) {
            return Err(Error::Unsupported(format!(
                "{prefix}: input size {cols} is not a multiple of 32, which MXFP4 experts need"
            )));
        }
        let groups = cols / 32;
        let u8s = [Dtype::U8, Dtype::F8_E8M0];
        let blocks = ck.require(&blocks_name, &[Dtype::U8], &[e, rows, groups, 16])?;
        let scales = ck.require(&format!("{prefix}_scales"), &u8s, &[e, rows, groups])?;
        Ok(ExpertMatrices::Mxfp4(Mxfp4Experts::contiguous(
            e,
            (rows, cols),
            ck.bytes_of(blocks),
            ck.bytes_of(scales),
        )))
    };
    let names = gpt_oss::layer_tensors(l);
    let experts = match converted {
        Some(experts) => experts,
        None => LayerExperts {
            gate_up: experts(&names.gate_up, 2 * i, h)?,
            down: experts(&names.down, h, i)?,
        },
    };
    Ok(LayerWeights {
        sinks: Some(ck.float_vector(&names.sinks, &[cfg.num_heads])?),
        router_bias: Some(ck.float_vector(&names.router_bias, &[e])?),
        gate_up_bias: Some(ck.float_vector(&names.gate_up_bias, &[e, 2 * i])?),
        down_bias: Some(ck.float_vector(&names.down_bias, &[e, h])?),
        ..shared_layer(ck, cfg, l, &names.router, experts)?
    })
}

/// What every family's layer `l` has, under the names the families share: the two norms, q, k,
/// v and o (biases where `attention_bias`), the router's matrix (`router`) and the experts.
/// Nothing else: each family adds its own (sinks, biases, per-head norms).
pub fn shared_layer(
    ck: &Checkpoint,
    cfg: &Config,
    l: usize,
    router: &str,
    experts: LayerExperts,
) -> Result<LayerWeights> {
    let (h, e) = (cfg.hidden_size, cfg.num_experts);
    let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
    let names = gpt_oss::layer_tensors(l);
    let bias = |name: &str, len: usize| -> Result<Option<Vec<f32>>> {
        if cfg.attention_bias {
            ck.float_vector(name, &[len]).map(Some)
        } else {
            Ok(None)
        }
    };
    Ok(LayerWeights {
        input_norm: ck.float_vector(&names.input_norm, &[h])?,
        post_attention_norm: ck.float_vector(&names.post_attention_norm, &[h])?,
        q: ck.dense_matrix(&names.q, qd, h)?,
        k: ck.dense_matrix(&names.k, kvd, h)?,
        v: ck.dense_matrix(&names.v, kvd, h)?,
        o: ck.dense_matrix(&names.o, h, qd)?,
        q_bias: bias(&names.q_bias, qd)?,
        k_bias: bias(&names.k_bias, kvd)?,
        v_bias: bias(&names.v_bias, kvd)?,
        o_bias: bias(&names.o_bias, h)?,
        q_norm: None,
        k_norm: None,
        sinks: None,
        router: ck.dense_matrix(router, e, h)?,
        router_bias: None,
        gate_up: experts.gate_up,
        gate_up_bias: None,
        down: experts.down,
        down_bias: None,
    })
}
