//! The store's read bandwidth, measured as the engine reads: whole expert records at random,
//! in chunks, by a given number of threads (the queue depth), through the same file handles
//! (O_DIRECT where the store uses it).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use super::reader::{Segment, split};
use super::{ExpertKey, ExpertStore, read_exact_at};
use crate::error::{Error, Result};
use crate::pages::{Page, page_bytes_mut};
use crate::random::splitmix64;

impl ExpertStore {
    /// `records` experts picked uniformly at random (from `seed`).
    pub fn random_keys(&self, records: usize, seed: u64) -> Vec<ExpertKey> {
        let mut state = seed;
        let total = self.disk_reads_by_key.len().max(1) as u64;
        (0..records)
            .map(|_| self.key_of((splitmix64(&mut state) % total) as usize))
            .collect()
    }

    /// `records` experts picked as often as this store has read each from disk (demand and
    /// prefetch reads); at random where it read none yet.
    pub fn keys_as_read(&self, records: usize, seed: u64) -> Vec<ExpertKey> {
        let counts: Vec<u64> = (self.disk_reads_by_key.iter())
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return self.random_keys(records, seed);
        }
        let mut state = seed;
        (0..records)
            .map(|_| {
                let mut pick = splitmix64(&mut state) % total;
                let r = counts
                    .iter()
                    .position(|&c| {
                        let here = pick < c;
                        pick = pick.saturating_sub(c);
                        here
                    })
                    .unwrap_or(0);
                self.key_of(r)
            })
            .collect()
    }

    fn key_of(&self, record: usize) -> ExpertKey {
        let per_layer = self.experts_per_layer.max(1);
        ExpertKey {
            layer: record / per_layer,
            expert: record % per_layer,
        }
    }

    /// Reads the records of `keys` with `depth` threads, each read at most `chunk_bytes`, and
    /// returns the rate in bytes per second. Meaningful where reads bypass the page cache
    /// (`--direct-io`): otherwise experts read before come from memory.
    pub fn measure_read_bandwidth(
        &self,
        depth: usize,
        chunk_bytes: usize,
        keys: &[ExpertKey],
    ) -> Result<f64> {
        let chunks: Vec<Segment> = keys
            .iter()
            .flat_map(|&key| self.shared.plan(key).segments)
            .flat_map(|s| split(s, chunk_bytes.next_multiple_of(4096)))
            .collect();
        let next = AtomicUsize::new(0);
        let largest = chunks.iter().map(|c| c.len).max().unwrap_or(0);
        let started = Instant::now();
        std::thread::scope(|scope| -> Result<()> {
            let workers: Vec<_> = (0..depth.max(1))
                .map(|_| {
                    scope.spawn(|| -> Result<()> {
                        let mut buffer = vec![Page([0; 4096]); largest.div_ceil(4096)];
                        while let Some(c) = chunks.get(next.fetch_add(1, Ordering::Relaxed)) {
                            let (path, file) = &self.shared.files[c.file];
                            read_exact_at(
                                file,
                                &mut page_bytes_mut(&mut buffer)[..c.len],
                                c.offset,
                            )
                            .map_err(|e| Error::io(path, e))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("a bandwidth reader panicked"))
        })?;
        let bytes: u64 = chunks.iter().map(|c| c.len as u64).sum();
        Ok(bytes as f64 / started.elapsed().as_secs_f64().max(1e-9))
    }
}
