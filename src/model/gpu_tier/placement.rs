//! The GPU tier's VRAM expert cache and where each chosen expert runs. Once a layer's routing is
//! read back: cache hits keep their slot, misses are uploaded into a slot or computed by the CPU
//! tier from RAM (`MissPolicy`); the CPU's misses run only after the layer's GPU experts were
//! submitted, so both work side by side, and their outputs join the GPU's before the same
//! on-device combine. The next layer's experts, guessed from this layer's MoE input, are read and
//! uploaded into free or evictable slots while the GPU computes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::{GpuModel, MissPolicy};
use crate::cpu::moe::Routing;
use crate::error::{Error, Result};
use crate::experts::{ExpertData, ExpertKey, ExpertStore, Pending};
use crate::gpu::kernels::GpuExperts;
use crate::model::PrefetchProxy;

/// Marks a (token, slot) pair that no cache slot serves: the CPU computed it.
pub(super) const NO_SLOT: u32 = u32::MAX;

/// The VRAM expert cache: slots holding any layer's experts (the weights and biases of one
/// expert per slot), shared by the sessions on the same weights, and its slot table.
pub(super) struct ExpertPool {
    pub gate_up: GpuExperts,
    pub down: GpuExperts,
    /// `[slots, rows]` biases of the expert in each slot, where the family's experts have them.
    pub gate_up_bias: Option<wgpu::Buffer>,
    pub down_bias: Option<wgpu::Buffer>,
    table: Mutex<SlotTable>,
    slots: usize,
}

/// Which expert each slot of the VRAM cache holds: an LRU over the slots, and the map from
/// (layer, expert) to slot.
pub(super) struct SlotTable {
    /// Slots whose expert is written (a prefetch's slot joins once its upload is queued).
    slot_of: HashMap<ExpertKey, usize>,
    /// Who holds or is about to hold each slot.
    owner: Vec<Option<ExpertKey>>,
    last_used: Vec<u64>,
    /// Slots a prefetch filled that no layer has used since.
    prefetched: Vec<bool>,
    clock: u64,
    /// Experts `claim` evicted, and of those the prefetched ones nobody used, not yet counted
    /// in the store's statistics (`GpuModel::count_claims`).
    evicted: u64,
    evicted_unused_prefetches: u64,
}

impl ExpertPool {
    pub fn new(
        gate_up: GpuExperts,
        down: GpuExperts,
        biases: Option<[wgpu::Buffer; 2]>,
        slots: usize,
    ) -> ExpertPool {
        let [gate_up_bias, down_bias] = match biases {
            Some(biases) => biases.map(Some),
            None => [None, None],
        };
        ExpertPool {
            gate_up,
            down,
            gate_up_bias,
            down_bias,
            table: Mutex::new(SlotTable {
                slot_of: HashMap::new(),
                owner: vec![None; slots],
                last_used: vec![0; slots],
                prefetched: vec![false; slots],
                clock: 0,
                evicted: 0,
                evicted_unused_prefetches: 0,
            }),
            slots,
        }
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    /// The slot table, for one session's block (`GpuWeights::take_turn`).
    pub fn lock_table(&self) -> MutexGuard<'_, SlotTable> {
        // A slot answers for its expert only once written: a session that panicked mid-block
        // left no entry the next one could misread.
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl SlotTable {
    fn slots(&self) -> usize {
        self.owner.len()
    }

    /// A slot for `key`: a free one, else (when `evict`) the least recently used one not used at
    /// `now` (the current layer's experts stay), counting what it evicts.
    fn claim(&mut self, key: ExpertKey, evict: bool, now: u64) -> Option<usize> {
        let slot = match self.owner.iter().position(Option::is_none) {
            Some(free) => free,
            None if evict => (0..self.slots())
                .filter(|&s| self.last_used[s] < now)
                .min_by_key(|&s| self.last_used[s])?,
            None => return None,
        };
        if let Some(old) = self.owner[slot].replace(key) {
            self.slot_of.remove(&old);
            self.evicted += 1;
            self.evicted_unused_prefetches += std::mem::take(&mut self.prefetched[slot]) as u64;
        }
        self.last_used[slot] = now;
        Some(slot)
    }

    /// Adds the evictions the claims made since the last call to `store`'s statistics.
    fn count_claims(&mut self, store: &ExpertStore) {
        let evicted = std::mem::take(&mut self.evicted);
        let wasted = std::mem::take(&mut self.evicted_unused_prefetches);
        store.count_vram_evictions(evicted);
        store.count_prefetch_outcome(0, wasted * store.expert_bytes());
    }

    /// Frees the slots claimed for layer `l`'s `experts` that no written expert answers for.
    fn release_unwritten(&mut self, l: usize, experts: &[usize]) {
        for &expert in experts {
            let key = ExpertKey { layer: l, expert };
            if !self.slot_of.contains_key(&key)
                && let Some(slot) = self.owner.iter().position(|o| *o == Some(key))
            {
                self.owner[slot] = None;
            }
        }
    }
}

/// Routing ids (`[n, top_k]`) as per-position routings (without weights), for scoring guesses.
fn routing_of_ids(ids: &[u32], k: usize) -> Vec<Routing> {
    ids.chunks(k)
        .map(|slots| Routing {
            experts: slots.iter().map(|&e| e as usize).collect(),
            weights: Vec::new(),
        })
        .collect()
}

/// A layer's experts the CPU tier computes, once the GPU's were submitted.
pub(super) struct CpuMisses {
    layer: usize,
    /// The layer's routing ids, `[n, top_k]`.
    ids: Vec<u32>,
    /// The layer's MoE input, `[n, hidden]`.
    x: Vec<f32>,
    experts: Vec<(usize, Pending)>,
}

/// A layer's experts, sorted by where they run.
struct Placed {
    slot_of_expert: HashMap<usize, usize>,
    hits: Vec<usize>,
    uploads: Vec<usize>,
    on_cpu: Vec<usize>,
}

impl GpuModel<'_> {
    /// Places layer `l`'s experts for a block of `n` tokens whose routing and MoE input the last
    /// submission copied to the staging buffer: hits keep their slot, misses are uploaded into
    /// a slot or left for the CPU tier (`run_cpu_misses`), then the slot of every pair is
    /// written. Guesses the next layer's experts and starts their prefetch.
    pub(super) fn place_layer_experts(
        &mut self,
        table: &mut SlotTable,
        l: usize,
        n: usize,
    ) -> Result<()> {
        // The prefetch for this layer: its reads had the GPU's time since the last sync.
        self.finish_prefetch(table);
        let (ids, x) = self.read_routing(n)?;
        let k = self.config.experts_per_token;
        let mut chosen: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        chosen.sort_unstable();
        chosen.dedup();
        if let Some(&bad) = chosen.iter().find(|&&e| e >= self.config.num_experts) {
            return Err(Error::Gpu(format!(
                "layer {l}: the router chose expert {bad}"
            )));
        }
        let placed = self.assign_slots(table, l, &chosen, n)?;
        let filled = self.fill_slots(table, l, &ids, x, &placed);
        if filled.is_err() {
            // A slot whose expert was not written must not answer for it later.
            table.release_unwritten(l, &placed.uploads);
        }
        filled?;
        self.used_slots.fill(false);
        for &slot in placed.slot_of_expert.values() {
            self.used_slots[slot] = true;
        }
        let slots: Vec<u32> = ids
            .iter()
            .map(|&e| {
                let slot = placed.slot_of_expert.get(&(e as usize));
                slot.map_or(NO_SLOT, |&s| s as u32)
            })
            .collect();
        let queue = &self.weights.ctx.queue;
        queue.write_buffer(&self.act.slot_ids, 0, bytemuck::cast_slice(&slots));
        debug_assert_eq!(slots.len(), n * k);
        self.record_placement(l, &placed);
        Ok(())
    }

    /// Reads and uploads layer `l`'s misses into their slots (each slot answers for its expert
    /// once written), starts the reads of its CPU experts, and guesses the next layer's experts
    /// behind those reads.
    fn fill_slots(
        &mut self,
        table: &mut SlotTable,
        l: usize,
        ids: &[u32],
        x: Vec<f32>,
        placed: &Placed,
    ) -> Result<()> {
        let model = self.model;
        // Every read starts before the first is awaited; each expert is used as it arrives.
        let requests = model.experts.request(l, &placed.uploads)?;
        let cpu_requests = model.experts.request(l, &placed.on_cpu)?;
        // Behind this layer's reads: the guess for the next layer and its prefetch.
        self.guess_next(table, l, ids, &x)?;
        for (&e, request) in placed.uploads.iter().zip(requests) {
            let expert = model.experts.wait(request)?;
            let slot = placed.slot_of_expert[&e];
            self.write_expert(slot, l, e, &expert)?;
            let key = ExpertKey {
                layer: l,
                expert: e,
            };
            table.slot_of.insert(key, slot);
        }
        self.cpu_misses = (!placed.on_cpu.is_empty()).then(|| CpuMisses {
            layer: l,
            ids: ids.to_vec(),
            x,
            experts: placed.on_cpu.iter().copied().zip(cpu_requests).collect(),
        });
        Ok(())
    }

    /// The routing ids (`[n, top_k]`) and MoE input (`[n, hidden]`) of the layer being placed.
    fn read_routing(&mut self, n: usize) -> Result<(Vec<u32>, Vec<f32>)> {
        let (h, k) = (self.config.hidden_size, self.config.experts_per_token);
        let ids_capacity = self.options.max_block * k * 4;
        let staging = self.act.routing_staging.clone();
        let bytes = self.read_staging(&staging, (ids_capacity + n * h * 4) as u64)?;
        let ids = bytemuck::pod_collect_to_vec(&bytes[..n * k * 4]);
        let x = bytemuck::pod_collect_to_vec(&bytes[ids_capacity..]);
        Ok((ids, x))
    }

    /// Hits keep their slot (a prefetched one counts as used); misses get a slot while the miss
    /// policy lets them, else go to the CPU.
    fn assign_slots(
        &mut self,
        pool: &mut SlotTable,
        l: usize,
        chosen: &[usize],
        n: usize,
    ) -> Result<Placed> {
        let evict = match self.options.miss_policy {
            MissPolicy::Upload => true,
            MissPolicy::Cpu => false,
            MissPolicy::Auto => n > 1,
        };
        pool.clock += 1;
        let now = pool.clock;
        let mut placed = Placed {
            slot_of_expert: HashMap::new(),
            hits: Vec::new(),
            uploads: Vec::new(),
            on_cpu: Vec::new(),
        };
        let mut prefetch_used = 0;
        for &e in chosen {
            let key = ExpertKey {
                layer: l,
                expert: e,
            };
            if let Some(&slot) = pool.slot_of.get(&key) {
                pool.last_used[slot] = now;
                prefetch_used += std::mem::take(&mut pool.prefetched[slot]) as u64;
                placed.slot_of_expert.insert(e, slot);
                placed.hits.push(e);
            }
        }
        for &e in chosen {
            if placed.slot_of_expert.contains_key(&e) {
                continue;
            }
            let key = ExpertKey {
                layer: l,
                expert: e,
            };
            match pool.claim(key, evict, now) {
                Some(slot) => {
                    placed.slot_of_expert.insert(e, slot);
                    placed.uploads.push(e);
                }
                None => placed.on_cpu.push(e),
            }
        }
        let store = &self.model.experts;
        store.count_vram_hits(l, &placed.hits);
        store.count_prefetch_outcome(prefetch_used, 0);
        pool.count_claims(store);
        Ok(placed)
    }

    /// Scores the guess made at the layer before, then guesses layer `l + 1`'s experts from this
    /// layer's MoE input (proxy A: the only one the host sees here) and, with prefetch on,
    /// starts reading those VRAM lacks into slots the current layer does not use.
    fn guess_next(
        &mut self,
        table: &mut SlotTable,
        l: usize,
        ids: &[u32],
        x: &[f32],
    ) -> Result<()> {
        let model = self.model;
        let k = self.config.experts_per_token;
        if let Some(guess) = self.guess.take() {
            let actual = routing_of_ids(ids, k);
            model.score_prediction(PrefetchProxy::A, 1, &guess, &actual);
        }
        let next = l + 1;
        // Layers with every expert resident have nothing to prefetch.
        if next >= self.weights.layers.len()
            || self.weights.layers[next].experts.is_some()
            || !(model.prefetch.enabled || model.prefetch.measure_accuracy)
        {
            return Ok(());
        }
        let guess = model.predict_experts(next, x, false)?;
        if model.prefetch.enabled {
            self.prefetch(table, next, &guess)?;
        }
        self.guess = Some(guess);
        Ok(())
    }

    /// Claims a slot for each guessed expert of layer `l` that VRAM lacks (never one the current
    /// layer uses; not at all under `--miss-policy cpu`, which never evicts, once no slot is
    /// free) and starts reading it.
    fn prefetch(&mut self, pool: &mut SlotTable, l: usize, guess: &[Vec<usize>]) -> Result<()> {
        let evict = self.options.miss_policy != MissPolicy::Cpu;
        let mut wanted: Vec<usize> = guess.iter().flatten().copied().collect();
        wanted.sort_unstable();
        wanted.dedup();
        let now = pool.clock;
        let mut claimed = Vec::new();
        for e in wanted {
            let key = ExpertKey {
                layer: l,
                expert: e,
            };
            if pool.slot_of.contains_key(&key) {
                continue;
            }
            let Some(slot) = pool.claim(key, evict, now) else {
                break;
            };
            claimed.push((slot, key));
        }
        let store = &self.model.experts;
        pool.count_claims(store);
        let experts: Vec<usize> = claimed.iter().map(|(_, key)| key.expert).collect();
        let reads = match store.request_prefetch(l, &experts) {
            Ok(reads) => reads,
            Err(e) => {
                for (slot, _) in claimed {
                    pool.owner[slot] = None;
                }
                return Err(e);
            }
        };
        self.prefetching = claimed
            .into_iter()
            .zip(reads)
            .map(|((slot, key), read)| (slot, key, read))
            .collect();
        Ok(())
    }

    /// Uploads the prefetched experts as their reads arrive; a failed read frees its slot (the
    /// layer then reads the expert itself, and reports the error if it fails again).
    pub(super) fn finish_prefetch(&mut self, pool: &mut SlotTable) {
        for (slot, key, read) in std::mem::take(&mut self.prefetching) {
            let written = self
                .model
                .experts
                .wait_prefetch(read)
                .and_then(|expert| self.write_expert(slot, key.layer, key.expert, &expert));
            match written {
                Ok(()) => {
                    pool.slot_of.insert(key, slot);
                    pool.prefetched[slot] = true;
                }
                Err(e) => {
                    log::warn!("prefetch of layer {} expert {}: {e}", key.layer, key.expert);
                    pool.owner[slot] = None;
                }
            }
        }
    }

    /// Queues expert `e` of layer `l` (weights in `expert`) into cache slot `slot`.
    fn write_expert(&self, slot: usize, l: usize, e: usize, expert: &ExpertData) -> Result<()> {
        let started = Instant::now();
        let (h, i) = (self.config.hidden_size, self.config.intermediate_size);
        let pool = self.weights.pool.as_ref().expect("a VRAM cache");
        let layer = &self.model.weights.layers[l];
        let queue = &self.weights.ctx.queue;
        self.weights.ctx.count_expert_upload()?;
        pool.gate_up.write_slot(queue, slot, &expert.gate_up)?;
        pool.down.write_slot(queue, slot, &expert.down)?;
        let gate_up_bias = layer
            .gate_up_bias
            .as_deref()
            .map(|b| &b[e * 2 * i..][..2 * i]);
        let down_bias = layer.down_bias.as_deref().map(|b| &b[e * h..][..h]);
        let biases = [
            (&pool.gate_up_bias, slot * 2 * i, gate_up_bias),
            (&pool.down_bias, slot * h, down_bias),
        ];
        let mut bias_bytes = 0;
        for (buffer, first, values) in biases {
            if let (Some(buffer), Some(values)) = (buffer, values) {
                queue.write_buffer(buffer, (first * 4) as u64, bytemuck::cast_slice(values));
                bias_bytes += 4 * values.len();
            }
        }
        let bytes = expert.gate_up.expert_bytes() + expert.down.expert_bytes() + bias_bytes;
        self.model.experts.count_upload(bytes as u64, started);
        Ok(())
    }

    /// Whether the layer just placed left experts for the CPU tier.
    pub(super) fn has_cpu_misses(&self) -> bool {
        self.cpu_misses.is_some()
    }

    /// Computes the placed layer's CPU experts (while the GPU runs its hits, submitted before)
    /// and queues their outputs into the rows of the down-projection buffer the GPU leaves
    /// alone; the combine that follows adds every row in the canonical order.
    pub(super) fn run_cpu_misses(&mut self) -> Result<()> {
        let Some(misses) = self.cpu_misses.take() else {
            return Ok(());
        };
        let started = Instant::now();
        let (model, h, k) = (
            self.model,
            self.config.hidden_size,
            self.config.experts_per_token,
        );
        let queue = &self.weights.ctx.queue;
        for (e, request) in misses.experts {
            let expert: Arc<ExpertData> = model.experts.wait(request)?;
            let pairs: Vec<usize> = (0..misses.ids.len())
                .filter(|&p| misses.ids[p] as usize == e)
                .collect();
            let xs: Vec<f32> = pairs
                .iter()
                .flat_map(|&p| misses.x[(p / k) * h..(p / k + 1) * h].to_vec())
                .collect();
            let out = model.run_expert(misses.layer, e, &expert, &xs);
            for (row, &p) in out.chunks_exact(h).zip(&pairs) {
                let offset = (p * h * 4) as u64;
                queue.write_buffer(&self.act.down, offset, bytemuck::cast_slice(row));
            }
        }
        crate::model::CpuTimings::add(&model.timings.experts_us, started);
        self.counters.cpu_expert_us += started.elapsed().as_micros() as u64;
        Ok(())
    }

    /// Adds the layer's expert counts to its placement record.
    fn record_placement(&mut self, l: usize, placed: &Placed) {
        let record = &mut self.placement[l];
        record.vram_hits += placed.hits.len() as u64;
        record.uploads += placed.uploads.len() as u64;
        record.cpu_experts += placed.on_cpu.len() as u64;
        record.experts = match (
            record.vram_hits + record.uploads > 0,
            record.cpu_experts > 0,
        ) {
            (true, true) => "gpu+cpu",
            (false, true) => "cpu",
            _ => "gpu",
        };
    }
}
