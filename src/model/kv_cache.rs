//! Per-layer key/value cache. Full-attention layers keep every position; sliding layers keep
//! only the last `window` positions in a ring, which is all their queries can see.
//!
//! Slots go in chunks of `CHUNK_SLOTS`, and a chunk holds each kv head's rows back to back:
//! the attention reads one kv head's keys and values at a time, which then lie next to each
//! other instead of a whole position (all kv heads) apart, and the hardware prefetchers follow
//! them.

use crate::config::Config;

/// Slots per chunk of a layer's cache: the unit it grows by.
const CHUNK_SLOTS: usize = 64;

struct LayerCache {
    /// Ring size for sliding layers; `None` = keep everything.
    ring: Option<usize>,
    /// `[chunk][kv head][CHUNK_SLOTS][head_dim]`.
    keys: Vec<f32>,
    values: Vec<f32>,
}

pub struct KvCache {
    kv_heads: usize,
    head_dim: usize,
    layers: Vec<LayerCache>,
    /// Positions stored so far (the next token goes at this position).
    len: usize,
    /// Most positions this cache will hold (`--context`).
    context: usize,
}

impl KvCache {
    pub fn new(cfg: &Config, context: usize) -> KvCache {
        KvCache {
            kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            layers: (0..cfg.num_layers)
                .map(|l| LayerCache {
                    ring: cfg.window_of(l),
                    keys: Vec::new(),
                    values: Vec::new(),
                })
                .collect(),
            len: 0,
            context,
        }
    }

    /// A cache that keeps every position of every layer (sliding layers too, at the cost of
    /// memory), so that it can be cut back to any earlier length (`truncate`): what a chat
    /// session reusing a prefix needs.
    pub fn keeping_all(cfg: &Config, context: usize) -> KvCache {
        let mut cache = KvCache::new(cfg, context);
        for layer in &mut cache.layers {
            layer.ring = None;
        }
        cache
    }

    /// `keeping_all` when `keep_all` (a session that may cut back anywhere), else `new`.
    pub fn with_layout(cfg: &Config, context: usize, keep_all: bool) -> KvCache {
        if keep_all {
            KvCache::keeping_all(cfg, context)
        } else {
            KvCache::new(cfg, context)
        }
    }

    /// Forgets positions `len..`. False (and nothing changes) when a sliding layer's ring may
    /// already have overwritten positions before `len` that its queries would see; a cache from
    /// `keeping_all` can always be cut.
    pub fn truncate(&mut self, len: usize) -> bool {
        if len > self.len {
            return false;
        }
        if len < self.len && self.layers.iter().any(|l| l.ring.is_some()) {
            return false;
        }
        self.len = len;
        true
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn context(&self) -> usize {
        self.context
    }

    fn slot(&self, layer: usize, position: usize) -> usize {
        match self.layers[layer].ring {
            Some(w) => position % w,
            None => position,
        }
    }

    /// Where kv head `head`'s row of `slot` starts in its layer's keys (and values).
    fn offset(&self, slot: usize, head: usize) -> usize {
        let (chunk, row) = (slot / CHUNK_SLOTS, slot % CHUNK_SLOTS);
        ((chunk * self.kv_heads + head) * CHUNK_SLOTS + row) * self.head_dim
    }

    /// Key and value of kv head `head` at a stored position (`head_dim` values each); the
    /// position must still be held (within the window).
    pub fn get(&self, layer: usize, position: usize, head: usize) -> (&[f32], &[f32]) {
        debug_assert!(position < self.len && head < self.kv_heads);
        let at = self.offset(self.slot(layer, position), head);
        let c = &self.layers[layer];
        let d = self.head_dim;
        (&c.keys[at..at + d], &c.values[at..at + d])
    }

    /// Stores the keys/values of positions `len..len + n` of one layer (`n * kv_dim` each, a
    /// position's kv heads one after the other). Call for every layer, then `advance(n)`.
    pub fn store(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let (heads, d) = (self.kv_heads, self.head_dim);
        let kv_dim = heads * d;
        let n = keys.len() / kv_dim;
        for t in 0..n {
            let slot = self.slot(layer, self.len + t);
            let chunk_end = (slot / CHUNK_SLOTS + 1) * CHUNK_SLOTS * kv_dim;
            let c = &mut self.layers[layer];
            if c.keys.len() < chunk_end {
                c.keys.resize(chunk_end, 0.0);
                c.values.resize(chunk_end, 0.0);
            }
            for head in 0..heads {
                let at = self.offset(slot, head);
                let from = t * kv_dim + head * d;
                let c = &mut self.layers[layer];
                c.keys[at..at + d].copy_from_slice(&keys[from..from + d]);
                c.values[at..at + d].copy_from_slice(&values[from..from + d]);
            }
        }
    }

    pub fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Bytes held by the cache now.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|c| (c.keys.len() + c.values.len()) * 4)
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stores 200 positions of two layers (one sliding with a ring of `window`, one full) in
    /// blocks of one position and of many, and reads every position each layer still holds back
    /// for every kv head.
    fn check_reads_back(window: usize) {
        let cfg = Config::from_json(
            &format!(
                r#"{{"hidden_size": 24, "num_attention_heads": 6, "num_key_value_heads": 3,
                    "head_dim": 4, "num_hidden_layers": 2, "sliding_window": {window},
                    "layer_types": ["sliding_attention", "full_attention"]}}"#
            ),
            std::path::Path::new("config.json"),
        )
        .unwrap();
        let (heads, d) = (3, 4);
        // Element i of kv head h at position p, of layer l's keys (0) or values (1).
        let element = |l: usize, p: usize, h: usize, i: usize, which: usize| {
            (((l * 1000 + p) * 10 + h) * 10 + i) as f32 + which as f32 * 0.5
        };
        let mut cache = KvCache::new(&cfg, 400);
        // Across chunk boundaries (64 slots), and past the ring within one block.
        for n in [1, 7, 64, 3, 100, 1, 24] {
            let start = cache.len();
            for l in 0..2 {
                let rows = |which: usize| -> Vec<f32> {
                    (start..start + n)
                        .flat_map(|p| {
                            (0..heads)
                                .flat_map(move |h| (0..d).map(move |i| (h, i)))
                                .map(move |(h, i)| element(l, p, h, i, which))
                        })
                        .collect()
                };
                cache.store(l, &rows(0), &rows(1));
            }
            cache.advance(n);
            let end = cache.len();
            for (l, first_held) in [(0, end.saturating_sub(window)), (1, 0)] {
                for p in first_held..end {
                    for h in 0..heads {
                        let (k, v) = cache.get(l, p, h);
                        let want = |which| -> Vec<f32> {
                            (0..d).map(|i| element(l, p, h, i, which)).collect()
                        };
                        assert_eq!(k, &want(0)[..], "key of layer {l}, position {p}, head {h}");
                        assert_eq!(
                            v,
                            &want(1)[..],
                            "value of layer {l}, position {p}, head {h}"
                        );
                    }
                }
            }
        }
        assert_eq!(cache.len(), 200);
        // Within a chunk, a head's rows follow each other.
        for p in (0..199).filter(|p| p % CHUNK_SLOTS != CHUNK_SLOTS - 1) {
            for h in 0..heads {
                let (this, next) = (cache.get(1, p, h).0, cache.get(1, p + 1, h).0);
                assert_eq!(
                    this.as_ptr().wrapping_add(d),
                    next.as_ptr(),
                    "position {p}, head {h}"
                );
            }
        }
    }

    #[test]
    fn each_head_reads_back_what_was_stored_across_chunks_and_rings() {
        // A ring inside one chunk, and one over two chunks that is not a whole number of them.
        check_reads_back(5);
        check_reads_back(100);
    }
}
