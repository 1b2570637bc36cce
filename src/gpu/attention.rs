//! Attention on the GPU (shaders/attention.wgsl): one workgroup per (token, KV head, split of the
//! keys) serving the KV head's query heads from one read of each key, with a merge of the splits
//! where a decode's keys are split across workgroups (flash-decoding).

use super::GpuContext;
use super::kernels::{Dispatch, u32_of};
use crate::error::{Error, Result};
use crate::formats::KvFormat;

/// Keys one workgroup takes at least before a decode splits them across workgroups: below it the
/// merge dispatch costs more than the parallelism gains.
const SPLIT_KEYS: usize = 256;

/// Most splits of one decode's keys.
pub const MAX_SPLITS: usize = 32;

/// Largest key tile a workgroup stages in its memory.
const MAX_TILE: usize = 64;

/// Bytes of the partial results (running max, sum and `head_dim` accumulators per head and
/// split) of `tokens` queries of `num_heads` heads with `splits` splits.
pub fn partials_bytes(num_heads: usize, head_dim: usize, tokens: usize, splits: usize) -> u64 {
    (tokens * num_heads * splits * (head_dim + 2) * 4) as u64
}

/// Shape of one layer's attention on the GPU.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Cache slots (positions modulo this); every key a query sees fits in them.
    pub capacity: usize,
    /// Keys a query sees, itself included (`None` = all).
    pub window: Option<usize>,
    pub kv_format: KvFormat,
    /// Workgroups each query's keys are split across, in equal shares (1: no merge dispatch).
    pub splits: usize,
}

/// A block's queries, keys and values as rows of one buffer (the stacked q/k/v product): row `t`
/// holds token t's queries, keys and values at their offsets (floats), `stride` floats apart.
#[derive(Clone, Copy)]
pub struct QkvRows<'b> {
    pub buffer: &'b wgpu::Buffer,
    pub stride: usize,
    pub query: usize,
    pub key: usize,
    pub value: usize,
    /// The queries, the keys still need their rotary embedding: the kernels apply it as they
    /// read them.
    pub rotate_query: bool,
    pub rotate_key: bool,
}

/// What the attention kernel reads: the step (block start), the block's q/k/v rows, the per-token
/// rotary tables (`[tokens, head_dim / 2]`, attention factor applied) and the cache (which it
/// also writes the block's keys and values to); with splits, the buffer their partial results
/// go through (`partials_bytes`).
pub struct AttentionInputs<'b> {
    pub step: &'b wgpu::Buffer,
    pub rows: QkvRows<'b>,
    pub cos: &'b wgpu::Buffer,
    pub sin: &'b wgpu::Buffer,
    pub keys: &'b wgpu::Buffer,
    pub values: &'b wgpu::Buffer,
    pub partials: Option<&'b wgpu::Buffer>,
}

impl AttentionShape {
    /// The splits for a block of `tokens` queries that see up to `visible` keys each: a decode
    /// over many keys spreads them over more workgroups than there are KV heads; a prompt's
    /// tokens already give every KV head many.
    pub fn splits_for(tokens: usize, visible: usize) -> usize {
        match tokens {
            1 => visible.div_ceil(SPLIT_KEYS).clamp(1, MAX_SPLITS),
            _ => 1,
        }
    }

    /// The most keys one query sees: the window, or every slot of the cache.
    pub fn most_visible_keys(&self) -> usize {
        self.window.map_or(self.capacity, |w| w.min(self.capacity))
    }

    /// Bytes of the partial results of `tokens` queries with `splits` splits.
    pub fn partials_bytes(&self, tokens: usize, splits: usize) -> u64 {
        partials_bytes(self.num_heads, self.head_dim, tokens, splits)
    }

    /// Cache bytes per position (keys or values).
    pub fn cache_row_bytes(&self) -> u64 {
        (self.num_kv_heads * self.head_dim * self.kv_format.bytes_per_value()) as u64
    }

    fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Gpu(format!("attention: {what}")));
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} heads do not share {} kv heads evenly",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is not even", self.head_dim));
        }
        if self.splits == 0 || self.splits > MAX_SPLITS || self.capacity == 0 {
            return bad(format!("{} splits of {} slots", self.splits, self.capacity));
        }
        Ok(())
    }

    /// Keys per tile: the largest power of two up to `MAX_TILE` whose tile, the group's queries
    /// and their scores fit the workgroup memory.
    fn tile(&self, workgroup_bytes: usize) -> Result<usize> {
        let (d, group) = (self.head_dim, self.group());
        let bytes = |tile: usize| 4 * (tile * (d + 1) + group * d + group * tile + 3 * group);
        (0..=MAX_TILE.ilog2())
            .rev()
            .map(|p| 1usize << p)
            .find(|tile| bytes(*tile) <= workgroup_bytes)
            .ok_or_else(|| {
                Error::Gpu(format!(
                    "attention: {group} query heads of {d} per kv head exceed this GPU's \
                     workgroup memory ({workgroup_bytes} bytes)"
                ))
            })
    }

    fn params(&self, tokens: usize, rows: &QkvRows) -> Result<[u32; 16]> {
        let scaling = (self.head_dim as f64).powf(-0.5) as f32;
        Ok([
            u32_of(self.num_heads, "heads")?,
            u32_of(self.num_kv_heads, "kv heads")?,
            u32_of(self.head_dim, "head_dim")?,
            u32_of(tokens, "tokens")?,
            u32_of(self.capacity, "capacity")?,
            u32_of(self.window.unwrap_or(0), "window")?,
            scaling.to_bits(),
            u32_of(self.splits, "splits")?,
            u32_of(rows.stride, "row stride")?,
            u32_of(rows.query, "query offset")?,
            u32_of(rows.key, "key offset")?,
            u32_of(rows.value, "value offset")?,
            rows.rotate_query as u32,
            rows.rotate_key as u32,
            0,
            0,
        ])
    }
}

/// Stores the block's keys and values in the cache and attends `tokens` queries at positions
/// `step.start + t` to the keys they see, with `sinks` where the model has them: one dispatch, or
/// two where the keys are split (`shape.splits` > 1).
pub fn prepare_attention(
    ctx: &GpuContext,
    shape: AttentionShape,
    tokens: usize,
    inputs: &AttentionInputs,
    sinks: Option<&wgpu::Buffer>,
    out: &wgpu::Buffer,
) -> Result<Vec<Dispatch>> {
    shape.check()?;
    let workgroup_bytes = ctx.device.limits().max_compute_workgroup_storage_size as usize;
    let tile = shape.tile(workgroup_bytes)?;
    let split = shape.splits > 1;
    let mut defines = vec![
        ("ATTEND", "1".to_string()),
        ("HEAD_DIM", shape.head_dim.to_string()),
        ("GROUP", shape.group().to_string()),
        ("TILE", tile.to_string()),
    ];
    if shape.kv_format == KvFormat::F16 {
        defines.push(("KV_F16", "1".into()));
    }
    if sinks.is_some() {
        defines.push(("SINKS", "1".into()));
    }
    let i = inputs;
    let mut buffers = vec![
        (1, i.step),
        (2, i.rows.buffer),
        (3, i.cos),
        (4, i.sin),
        (5, i.keys),
        (6, i.values),
    ];
    let partials = match (split, i.partials) {
        (false, _) => None,
        (true, Some(p)) if p.size() >= shape.partials_bytes(tokens, shape.splits) => Some(p),
        (true, _) => {
            return Err(Error::Gpu(format!(
                "attention: {} splits need a partials buffer of {} bytes",
                shape.splits,
                shape.partials_bytes(tokens, shape.splits)
            )));
        }
    };
    match partials {
        Some(p) => {
            defines.push(("SPLIT", "1".into()));
            buffers.push((8, p));
        }
        None => {
            buffers.extend(sinks.map(|sinks| (7, sinks)));
            buffers.push((8, out));
        }
    }
    let workgroups = [
        u32_of(tokens, "tokens")?,
        u32_of(shape.num_kv_heads, "kv heads")?,
        u32_of(shape.splits, "splits")?,
    ];
    let params = shape.params(tokens, &i.rows)?;
    let attend = ctx.prepare_bound(
        "attention.wgsl",
        "attend",
        &defines,
        &params,
        &buffers,
        workgroups,
    )?;
    let Some(partials) = partials else {
        return Ok(vec![attend]);
    };
    let mut merge_defines = vec![
        ("MERGE", "1".to_string()),
        ("HEAD_DIM", shape.head_dim.to_string()),
    ];
    let mut merge_buffers = vec![(8, out), (9, partials)];
    if let Some(sinks) = sinks {
        merge_defines.push(("SINKS", "1".into()));
        merge_buffers.push((7, sinks));
    }
    let merge = ctx.prepare_bound(
        "attention.wgsl",
        "merge",
        &merge_defines,
        &params,
        &merge_buffers,
        [
            u32_of(tokens, "tokens")?,
            u32_of(shape.num_heads, "heads")?,
            1,
        ],
    )?;
    Ok(vec![attend, merge])
}
