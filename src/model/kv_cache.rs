//! Per-layer key/value cache. Full-attention layers keep every position; sliding layers keep
//! only the last `window` positions in a ring, which is all their queries can see.

use crate::config::Config;

struct LayerCache {
    /// Ring size for sliding layers; `None` = keep everything.
    ring: Option<usize>,
    keys: Vec<f32>,
    values: Vec<f32>,
}

pub struct KvCache {
    kv_dim: usize,
    layers: Vec<LayerCache>,
    /// Positions stored so far (the next token goes at this position).
    len: usize,
    /// Most positions this cache will hold (`--context`).
    context: usize,
}

impl KvCache {
    pub fn new(cfg: &Config, context: usize) -> KvCache {
        KvCache {
            kv_dim: cfg.kv_dim(),
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

    /// Key and value of a stored position; it must still be held (within the window).
    pub fn get(&self, layer: usize, position: usize) -> (&[f32], &[f32]) {
        debug_assert!(position < self.len);
        let s = self.slot(layer, position) * self.kv_dim;
        let c = &self.layers[layer];
        (&c.keys[s..s + self.kv_dim], &c.values[s..s + self.kv_dim])
    }

    /// Stores the keys/values of positions `len..len + n` of one layer (`n * kv_dim` each).
    /// Call for every layer, then `advance(n)`.
    pub fn store(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        let d = self.kv_dim;
        let n = keys.len() / d;
        for t in 0..n {
            let position = self.len + t;
            let slot = self.slot(layer, position);
            let c = &mut self.layers[layer];
            let needed = (slot + 1) * d;
            if c.keys.len() < needed {
                c.keys.resize(needed, 0.0);
                c.values.resize(needed, 0.0);
            }
            c.keys[slot * d..needed].copy_from_slice(&keys[t * d..(t + 1) * d]);
            c.values[slot * d..needed].copy_from_slice(&values[t * d..(t + 1) * d]);
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
