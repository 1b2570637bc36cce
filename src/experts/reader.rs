//! The IO threads: each expert read is split into chunks that the threads read side by side
//! into a reused page-aligned buffer, demand reads (a layer waits for them) before prefetch
//! reads (a guess), so a guess never delays a read the model needs and the disk serves guesses
//! only in the time demand leaves it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::{ExpertData, ExpertKey, Shared, read_exact_at};
use crate::error::{Error, Result};
use crate::pages::{PageBuffer, PagePool};

/// Where one run of an expert's bytes lies in the store's files and where it lands in the
/// expert's buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct Segment {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    pub dest: usize,
}

/// Which queue a read waits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// A layer chose the expert and will wait for it.
    Demand,
    /// A guess at a later layer's expert.
    Prefetch,
}

/// The reply to one expert read.
pub(super) type Answer = flume::Receiver<Result<Arc<ExpertData>>>;

/// One expert being read: its buffer, filled by chunks in any order, and who gets it.
struct Assembly {
    key: ExpertKey,
    /// Set when nobody wants the expert any more: its queued chunks are dropped, those being
    /// read finish, and nothing is delivered.
    cancelled: AtomicBool,
    target: Target,
    /// Chunks not yet read.
    left: AtomicUsize,
    failure: Mutex<Option<Error>>,
    reply: flume::Sender<Result<Arc<ExpertData>>>,
}

/// The buffer an assembly's chunks write into: taken from the pool by the first chunk that
/// runs (on an IO thread: a new buffer's zeroing and page faults never hold up the thread that
/// asked). Chunks write disjoint ranges of it through its address, outside the lock.
struct Target {
    pool: Arc<PagePool>,
    pages: usize,
    buffer: Mutex<Option<PageBuffer>>,
}

impl Target {
    /// The buffer's address, taking the buffer from the pool if no chunk did yet.
    fn base(&self) -> *mut u8 {
        let mut buffer = self.buffer.lock().unwrap();
        buffer
            .get_or_insert_with(|| self.pool.take(self.pages))
            .as_mut_ptr()
    }

    fn len(&self) -> usize {
        self.pages * 4096
    }

    /// The filled buffer (an empty one from the pool where no chunk read: a mapped expert).
    fn take(&self) -> PageBuffer {
        let taken = self.buffer.lock().unwrap().take();
        taken.unwrap_or_else(|| self.pool.take(self.pages))
    }
}

/// One positioned read into an assembly's buffer (`segment: None`: the expert is mapped, and
/// the read faults it in).
struct Chunk {
    assembly: Arc<Assembly>,
    segment: Option<Segment>,
}

#[derive(Default)]
struct Jobs {
    demand: VecDeque<Chunk>,
    prefetch: VecDeque<Chunk>,
    stopped: bool,
}

/// What the reads did, for `--stats`: chunks read, and at each chunk's start the reads and
/// bytes in flight (the chunk included), summed: their means are the queue depth and bytes in
/// flight the disk saw.
#[derive(Debug, Default)]
pub(super) struct ReadCounters {
    pub chunks: AtomicU64,
    /// Bytes the chunks read (cancelled reads' included).
    pub bytes: AtomicU64,
    pub depth_sum: AtomicU64,
    pub bytes_in_flight_sum: AtomicU64,
    in_flight: AtomicU64,
    bytes_in_flight: AtomicU64,
}

struct Queue {
    jobs: Mutex<Jobs>,
    ready: Condvar,
}

/// A read under way: its answer, and a hold on it to promote or cancel it.
pub(super) struct ReadHandle {
    assembly: Arc<Assembly>,
    pub answer: Answer,
}

impl ReadHandle {
    pub fn key(&self) -> ExpertKey {
        self.assembly.key
    }
}

/// The IO threads and their queues.
pub(super) struct Reader {
    queue: Arc<Queue>,
    pool: Arc<PagePool>,
    /// IO threads, and the largest chunk each reads at once (a multiple of 4 KiB).
    pub threads: usize,
    pub chunk_bytes: usize,
    pub counters: Arc<ReadCounters>,
}

impl Reader {
    /// Starts `threads` IO threads reading `shared`'s experts in chunks of at most
    /// `chunk_bytes`, keeping up to `keep_buffers` buffers for reuse.
    pub fn start(
        shared: Arc<Shared>,
        threads: usize,
        chunk_bytes: usize,
        keep_buffers: usize,
    ) -> Result<Reader> {
        let queue = Arc::new(Queue {
            jobs: Mutex::new(Jobs::default()),
            ready: Condvar::new(),
        });
        let counters = Arc::new(ReadCounters::default());
        for n in 0..threads.max(1) {
            let (shared, queue, counters) = (shared.clone(), queue.clone(), counters.clone());
            std::thread::Builder::new()
                .name(format!("picchio-io-{n}"))
                .spawn(move || {
                    while let Some(chunk) = queue.next() {
                        // A chunk that panics never completes its expert: its waiter gets an
                        // error instead of waiting forever (the handle keeps the reply open).
                        let assembly = chunk.assembly.clone();
                        let run = std::panic::AssertUnwindSafe(|| chunk.run(&shared, &counters));
                        if std::panic::catch_unwind(run).is_err() {
                            let failed = std::io::Error::other("an IO thread panicked");
                            let _ = assembly
                                .reply
                                .try_send(Err(Error::io("expert read", failed)));
                        }
                    }
                })
                .map_err(|e| Error::io("IO thread", e))?;
        }
        Ok(Reader {
            queue,
            pool: PagePool::new(keep_buffers),
            threads: threads.max(1),
            chunk_bytes: chunk_bytes.next_multiple_of(4096).max(4096),
            counters,
        })
    }

    /// Queues the read of `key` (its chunks behind those of its priority already queued).
    pub fn submit(&self, shared: &Shared, key: ExpertKey, priority: Priority) -> ReadHandle {
        let (reply, answer) = flume::bounded(1);
        let plan = shared.plan(key);
        let mut segments: Vec<Option<Segment>> = (plan.segments.iter())
            .flat_map(|s| split(*s, self.chunk_bytes))
            .map(Some)
            .collect();
        if segments.is_empty() {
            // A mapped expert (or one of no bytes): one job that finishes it.
            segments.push(None);
        }
        let assembly = Arc::new(Assembly {
            key,
            cancelled: AtomicBool::new(false),
            target: Target {
                pool: self.pool.clone(),
                pages: plan.pages,
                buffer: Mutex::new(None),
            },
            left: AtomicUsize::new(segments.len()),
            failure: Mutex::new(None),
            reply,
        });
        {
            let mut jobs = self.queue.jobs.lock().unwrap();
            let queue = match priority {
                Priority::Demand => &mut jobs.demand,
                Priority::Prefetch => &mut jobs.prefetch,
            };
            queue.extend(segments.into_iter().map(|segment| Chunk {
                assembly: assembly.clone(),
                segment,
            }));
        }
        self.queue.ready.notify_all();
        ReadHandle { assembly, answer }
    }

    /// Moves a prefetch read's chunks still queued ahead of every other prefetch, behind the
    /// demand reads: a layer now waits for it.
    pub fn promote(&self, handle: &ReadHandle) {
        let mut jobs = self.queue.jobs.lock().unwrap();
        let Jobs {
            demand, prefetch, ..
        } = &mut *jobs;
        let (mine, others): (VecDeque<Chunk>, VecDeque<Chunk>) = prefetch
            .drain(..)
            .partition(|c| Arc::ptr_eq(&c.assembly, &handle.assembly));
        *prefetch = others;
        demand.extend(mine);
    }

    /// Gives up a read: its chunks still queued are dropped (those being read finish) and it
    /// delivers nothing.
    pub fn cancel(&self, handle: ReadHandle) {
        let assembly = &handle.assembly;
        assembly.cancelled.store(true, Ordering::SeqCst);
        let removed = {
            let mut jobs = self.queue.jobs.lock().unwrap();
            let before = jobs.demand.len() + jobs.prefetch.len();
            let mine = |c: &Chunk| Arc::ptr_eq(&c.assembly, assembly);
            jobs.prefetch.retain(|c| !mine(c));
            jobs.demand.retain(|c| !mine(c));
            before - jobs.demand.len() - jobs.prefetch.len()
        };
        // The chunks dropped count as done; whoever finishes the last one delivers nothing.
        assembly.left.fetch_sub(removed, Ordering::AcqRel);
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.queue.jobs.lock().unwrap().stopped = true;
        self.queue.ready.notify_all();
    }
}

impl Queue {
    /// The next chunk, demand first; None once the reader is dropped.
    fn next(&self) -> Option<Chunk> {
        let mut jobs = self.jobs.lock().unwrap();
        loop {
            if jobs.stopped {
                return None;
            }
            if let Some(chunk) = jobs
                .demand
                .pop_front()
                .or_else(|| jobs.prefetch.pop_front())
            {
                return Some(chunk);
            }
            jobs = self.ready.wait(jobs).unwrap();
        }
    }
}

/// `segment` in pieces of at most `chunk_bytes`.
pub(super) fn split(segment: Segment, chunk_bytes: usize) -> impl Iterator<Item = Segment> {
    (0..segment.len)
        .step_by(chunk_bytes)
        .map(move |start| Segment {
            offset: segment.offset + start as u64,
            dest: segment.dest + start,
            len: chunk_bytes.min(segment.len - start),
            ..segment
        })
}

impl Chunk {
    fn run(self, shared: &Shared, counters: &ReadCounters) {
        let assembly = &self.assembly;
        // A chunk taken just before its expert was cancelled is not read.
        let wanted = !assembly.cancelled.load(Ordering::SeqCst);
        if let Some(s) = self.segment.filter(|_| wanted) {
            let depth = counters.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
            let bytes = counters
                .bytes_in_flight
                .fetch_add(s.len as u64, Ordering::Relaxed)
                + s.len as u64;
            counters.chunks.fetch_add(1, Ordering::Relaxed);
            counters.bytes.fetch_add(s.len as u64, Ordering::Relaxed);
            counters.depth_sum.fetch_add(depth, Ordering::Relaxed);
            counters
                .bytes_in_flight_sum
                .fetch_add(bytes, Ordering::Relaxed);
            let target = &assembly.target;
            assert!(s.dest + s.len <= target.len(), "a chunk inside its buffer");
            // Safety: the buffer's heap pages stay put until the last chunk takes the buffer out
            // (below, once `left` says every chunk is done); this chunk's range is its own
            // (segments do not overlap) and inside them, and nothing reads them before then.
            let into = unsafe { std::slice::from_raw_parts_mut(target.base().add(s.dest), s.len) };
            let (path, file) = &shared.files[s.file];
            if let Err(e) = read_exact_at(file, into, s.offset) {
                *assembly.failure.lock().unwrap() = Some(Error::io(path, e));
            }
            counters.in_flight.fetch_sub(1, Ordering::Relaxed);
            counters
                .bytes_in_flight
                .fetch_sub(s.len as u64, Ordering::Relaxed);
        }
        if assembly.left.fetch_sub(1, Ordering::AcqRel) == 1
            && !assembly.cancelled.load(Ordering::SeqCst)
        {
            let failure = assembly.failure.lock().unwrap().take();
            let data = match failure {
                Some(e) => Err(e),
                None => (shared.finish(assembly.key, assembly.target.take())).map(Arc::new),
            };
            let _ = assembly.reply.send(data);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_split_into_chunks_that_cover_them_in_order() {
        let s = Segment {
            file: 1,
            offset: 8192,
            len: 10_000,
            dest: 100,
        };
        let pieces: Vec<Segment> = split(s, 4096).collect();
        assert_eq!(pieces.len(), 3);
        assert_eq!(
            pieces.iter().map(|p| p.len).collect::<Vec<_>>(),
            [4096, 4096, 1808]
        );
        for (i, p) in pieces.iter().enumerate() {
            assert_eq!(p.offset, 8192 + 4096 * i as u64);
            assert_eq!(p.dest, 100 + 4096 * i);
            assert_eq!(p.file, 1);
        }
    }
}
