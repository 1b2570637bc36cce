//! Kernels prepared once and recorded many times: each `Dispatch` owns its pipeline, bind group,
//! parameters and workgroup counts, so recording a forward pass creates no GPU objects.

use std::sync::Arc;

use super::GpuContext;
use crate::arch::{Activation, Gating};
use crate::error::{Error, Result};
use crate::weights::{
    DenseExperts, DenseMatrix, ExpertMatrices, FloatFormat, Int4Experts, Mxfp4Experts,
};

/// The define naming a float storage format in the shaders.
pub fn format_define(format: FloatFormat) -> &'static str {
    match format {
        FloatFormat::Bf16 => "BF16",
        FloatFormat::F16 => "F16",
        FloatFormat::F32 => "F32",
    }
}

/// One prepared kernel launch.
pub struct Dispatch {
    pipeline: Arc<wgpu::ComputePipeline>,
    bind_group: wgpu::BindGroup,
    workgroups: [u32; 3],
    /// Kept alive with the bind group that reads it.
    _params: wgpu::Buffer,
    /// `file:entry`, for the debug mode's log.
    pub label: String,
    /// What the launch must move at least (weights once, inputs and outputs), for a profile's
    /// GB/s; 0 where that depends on the step (attention's cache reads).
    pub bytes: u64,
}

impl Dispatch {
    /// This launch, moving `bytes` at least.
    pub fn moving(mut self, bytes: u64) -> Dispatch {
        self.bytes = bytes;
        self
    }

    pub fn record(&self, pass: &mut wgpu::ComputePass<'_>) {
        pass.set_pipeline(&self.pipeline);
        pass.set_bind_group(0, &self.bind_group, &[]);
        pass.dispatch_workgroups(self.workgroups[0], self.workgroups[1], self.workgroups[2]);
    }
}

pub(crate) fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| Error::Gpu(format!("{what} ({n}) does not fit a GPU index")))
}

impl GpuContext {
    /// Builds a dispatch of `file`/`entry` with `defines`, binding `params` at 0 and `buffers`
    /// at 1, 2, ...
    pub fn prepare(
        &self,
        file: &'static str,
        entry: &'static str,
        defines: super::pipelines::Defines,
        params: &[u32],
        buffers: &[&wgpu::Buffer],
        workgroups: [u32; 3],
    ) -> Result<Dispatch> {
        let bound: Vec<(u32, &wgpu::Buffer)> = (1..).zip(buffers.iter().copied()).collect();
        self.prepare_bound(file, entry, defines, params, &bound, workgroups)
    }

    /// As `prepare`, with each buffer at the binding it names (a variant may leave some out).
    pub fn prepare_bound(
        &self,
        file: &'static str,
        entry: &'static str,
        defines: super::pipelines::Defines,
        params: &[u32],
        buffers: &[(u32, &wgpu::Buffer)],
        workgroups: [u32; 3],
    ) -> Result<Dispatch> {
        let limit = self.max_workgroups_per_dimension;
        if workgroups.iter().any(|w| *w > limit) {
            return Err(Error::Gpu(format!(
                "{entry}: {workgroups:?} workgroups exceed the limit {limit}"
            )));
        }
        // Shaders that include reduce.wgsl reduce with subgroups where the device has them.
        let mut defines = defines.to_vec();
        if let Some(smallest) = self.subgroup_min
            && super::pipelines::shader_source(file)?.contains("#include \"reduce.wgsl\"")
        {
            defines.push(("SUBGROUPS", "1".into()));
            defines.push(("SUBGROUP_MIN", smallest.to_string()));
        }
        let pipeline = self.pipelines.get(&self.device, file, entry, &defines)?;
        let params_buffer = self.uniform(entry, bytemuck::cast_slice(params));
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: params_buffer.as_entire_binding(),
        }];
        for (binding, b) in buffers {
            entries.push(wgpu::BindGroupEntry {
                binding: *binding,
                resource: b.as_entire_binding(),
            });
        }
        let bind_group = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(entry),
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        });
        Ok(Dispatch {
            pipeline,
            bind_group,
            workgroups,
            _params: params_buffer,
            label: format!("{file}:{entry}"),
            bytes: 0,
        })
    }

    /// Workgroup counts (x, y) covering `n` rows with x at most the per-dimension limit.
    fn row_groups(&self, n: usize) -> Result<(u32, u32)> {
        let limit = self.max_workgroups_per_dimension as usize;
        let x = n.clamp(1, limit);
        Ok((u32_of(x, "rows")?, u32_of(n.div_ceil(x), "rows")?))
    }
}

/// A dense `[rows, cols]` matrix on the GPU, split by rows into buffers that each fit one binding.
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    pub format: FloatFormat,
    /// (first row, rows, buffer)
    pub chunks: Vec<(usize, usize, wgpu::Buffer)>,
}

/// Splits `count` units of `unit_bytes` each into runs that fit `max_bytes` (at least one unit).
fn split(
    count: usize,
    unit_bytes: usize,
    max_bytes: u64,
    what: &str,
) -> Result<Vec<(usize, usize)>> {
    let per = (max_bytes as usize / unit_bytes.max(1)).min(count.max(1));
    if per == 0 {
        return Err(Error::Gpu(format!(
            "{what}: one unit of {unit_bytes} bytes exceeds the binding limit of {max_bytes} bytes"
        )));
    }
    Ok((0..count)
        .step_by(per)
        .map(|first| (first, per.min(count - first)))
        .collect())
}

/// The RMSNorm a product applies to its input rows on the way in.
pub struct RowNorm<'b> {
    pub weight: &'b wgpu::Buffer,
    pub eps: f32,
    /// Where a matrix that cannot take the norm in (rows not of whole 16-byte words) gets its
    /// normalized input, written by an RMSNorm dispatch first; None: such a matrix refuses.
    pub scratch: Option<&'b wgpu::Buffer>,
}

/// What a product does with its output buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    Store,
    /// Adds to what is there (the output projection into the residual stream).
    Accumulate,
}

/// Rows one workgroup of experts.wgsl computes (`ROWS` there).
const FUSED_EXPERT_ROWS: usize = 8;
/// Rows and pairs of one tile of the grouped expert kernels (`TILE_ROWS`, `TILE_PAIRS`).
const GROUPED_TILE_ROWS: usize = 64;
const GROUPED_TILE_PAIRS: usize = 32;

/// A prompt block's (token, slot) pairs listed by expert, and the tiles of at most 32 pairs of one
/// expert the grouped kernels take (`prepare_sort_pairs` writes both).
pub struct PairTiles<'b> {
    /// Pair indices, by expert.
    pub order: &'b wgpu::Buffer,
    /// The tile count, then (expert, first index into `order`, pairs) per tile.
    pub tiles: &'b wgpu::Buffer,
}

impl PairTiles<'_> {
    /// Most tiles of `pairs` pairs over `experts` experts: each expert's last tile may be partial.
    pub fn max_tiles(pairs: usize, experts: usize) -> usize {
        pairs.div_ceil(GROUPED_TILE_PAIRS) + experts.min(pairs)
    }

    /// Bytes of `order` and of `tiles` for `pairs` pairs over `experts` experts.
    pub fn bytes(pairs: usize, experts: usize) -> (u64, u64) {
        let tiles = 1 + 3 * Self::max_tiles(pairs, experts);
        ((4 * pairs.max(1)) as u64, (4 * tiles) as u64)
    }
}

/// Lists a block's `tokens * top_k` (token, slot) pairs (expert `ids[p]` each, below `experts`)
/// by expert into `tiles` (router.wgsl's `sort_pairs`, one workgroup).
pub fn prepare_sort_pairs(
    ctx: &GpuContext,
    ids: &wgpu::Buffer,
    (tokens, top_k, experts): (usize, usize, usize),
    tiles: &PairTiles,
) -> Result<Dispatch> {
    let pairs = tokens * top_k;
    let (order_bytes, tile_bytes) = PairTiles::bytes(pairs, experts);
    if tiles.order.size() < order_bytes || tiles.tiles.size() < tile_bytes {
        return Err(Error::Gpu(format!(
            "sort_pairs: {pairs} pairs over {experts} experts need {order_bytes} + {tile_bytes} bytes"
        )));
    }
    let params = router_params((tokens, experts, top_k, 0), 0.0, 0)?;
    let defines = [
        ("SORT", "1".to_string()),
        ("EXPERTS", experts.to_string()),
        ("TILE_PAIRS", GROUPED_TILE_PAIRS.to_string()),
    ];
    let dispatch = ctx.prepare_bound(
        "router.wgsl",
        "sort_pairs",
        &defines,
        &params,
        &[(2, ids), (9, tiles.order), (10, tiles.tiles)],
        [1, 1, 1],
    )?;
    Ok(dispatch.moving(order_bytes + tile_bytes + 4 * pairs as u64))
}

/// Bindings of expert weights (and as many of scales) experts.wgsl reads.
const FUSED_EXPERT_CHUNKS: usize = 4;
/// experts.wgsl's first binding after the weights and scales.
const FUSED_EXPERT_INPUTS: u32 = 1 + 2 * FUSED_EXPERT_CHUNKS as u32;

/// What a fused expert kernel binds and is compiled with.
struct FusedOperands<'b> {
    bound: Vec<(u32, &'b wgpu::Buffer)>,
    defines: Vec<(&'static str, String)>,
    per_chunk: usize,
}

impl<'b> FusedOperands<'b> {
    /// Binds `buffers` after the weights and scales.
    fn bind<const N: usize>(&mut self, buffers: [&'b wgpu::Buffer; N]) {
        self.bound.extend((FUSED_EXPERT_INPUTS..).zip(buffers));
    }
}

/// Values in one 16-byte word of bf16/f16 weights (`dense_rows` needs whole words per row).
const DENSE_WORD_VALUES: usize = 8;
/// Rows one `dense_rows` workgroup computes (`ROWS` in matmul.wgsl).
const DENSE_ROWS_PER_GROUP: usize = 4;
/// Chunks of a split matrix one `dense_rows` dispatch reads.
const DENSE_CHUNKS: usize = 4;
/// Tokens of a prompt block one `dense_rows` workgroup multiplies each weight word with.
const DENSE_TOKENS_PER_GROUP: usize = 8;
/// `dense_tiled`'s tile: rows and tokens per workgroup, columns per step (`TILE_*` in
/// matmul.wgsl).
const DENSE_TILE_ROWS: usize = 64;
const DENSE_TILE_TOKENS: usize = 32;
const DENSE_TILE_K: usize = 32;
/// Tokens from which a block's product runs as tiles: below, most of a tile's tokens would be
/// padding, and `dense_rows`' batches of 8 read the weights as few times.
const DENSE_TILE_MIN_TOKENS: usize = 16;

impl GpuMatrix {
    pub fn upload(ctx: &GpuContext, name: &str, m: &DenseMatrix) -> Result<GpuMatrix> {
        let row_bytes = m.cols * m.format.size();
        let chunks = split(m.rows, row_bytes, ctx.max_binding_bytes, name)?
            .into_iter()
            .map(|(first, rows)| {
                let bytes = &m.data.bytes()[first * row_bytes..(first + rows) * row_bytes];
                Ok((first, rows, ctx.try_upload(name, bytes)?))
            })
            .collect::<Result<_>>()?;
        Ok(GpuMatrix {
            rows: m.rows,
            cols: m.cols,
            format: m.format,
            chunks,
        })
    }

    /// The rows of `parts` one after the other as one matrix (q, k and v, for one product).
    pub fn upload_stacked(
        ctx: &GpuContext,
        name: &str,
        parts: &[&DenseMatrix],
    ) -> Result<GpuMatrix> {
        if let Some(stacked) = DenseMatrix::stacked(parts) {
            return Self::upload(ctx, name, &stacked);
        }
        let Some(first) = parts.first() else {
            return Err(Error::Gpu(format!("{name}: nothing to stack")));
        };
        if parts
            .iter()
            .any(|m| m.format != first.format || m.cols != first.cols)
        {
            return Err(Error::Gpu(format!(
                "{name}: the matrices differ in format or width, so they cannot be stacked"
            )));
        }
        let bytes: Vec<u8> = parts.iter().flat_map(|m| m.data.bytes()).copied().collect();
        let length = bytes.len();
        let stacked = DenseMatrix {
            rows: parts.iter().map(|m| m.rows).sum(),
            cols: first.cols,
            format: first.format,
            data: crate::weights::TensorBytes::shared(Arc::new(bytes), 0..length),
        };
        Self::upload(ctx, name, &stacked)
    }

    /// `y[t][r] = W[r] . x[t] + bias[r]` for `tokens` rows of `x` (row stride `cols`); `y` has
    /// row stride `rows`. One dispatch per chunk.
    pub fn prepare(
        &self,
        ctx: &GpuContext,
        x: &wgpu::Buffer,
        tokens: usize,
        bias: Option<&wgpu::Buffer>,
        y: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
    ) -> Result<Vec<Dispatch>> {
        self.prepare_product(ctx, (x, tokens), None, bias, (y, Output::Store), dummy)
    }

    /// Half-precision rows of whole 16-byte words: `dense_rows` (several rows per workgroup,
    /// vector loads), which can also take the RMSNorm of its input in.
    pub fn by_words(&self) -> bool {
        self.format != FloatFormat::F32 && self.cols.is_multiple_of(DENSE_WORD_VALUES)
    }

    /// As `prepare`, with `y[t][r] += W[r] . x[t] + bias[r]` where `output` says so, and of
    /// RMSNorm(x[t]) where `norm` is given: taken into the product for matrices `by_words`, else
    /// a norm dispatch into `norm.scratch` first.
    pub fn prepare_product(
        &self,
        ctx: &GpuContext,
        (x, tokens): (&wgpu::Buffer, usize),
        norm: Option<RowNorm>,
        bias: Option<&wgpu::Buffer>,
        (y, output): (&wgpu::Buffer, Output),
        dummy: &wgpu::Buffer,
    ) -> Result<Vec<Dispatch>> {
        if let Some(RowNorm {
            weight,
            eps,
            scratch: Some(scratch),
        }) = norm
            && !self.by_words()
        {
            let cols = self.cols;
            let mut dispatches = vec![prepare_rms_norm(
                ctx, x, weight, tokens, cols, eps, scratch,
            )?];
            let input = (scratch, tokens);
            dispatches.extend(self.prepare_product(ctx, input, None, bias, (y, output), dummy)?);
            return Ok(dispatches);
        }
        let format = format_define(self.format);
        let tiled = self.by_words()
            && tokens >= DENSE_TILE_MIN_TOKENS
            && self.cols.is_multiple_of(DENSE_TILE_K);
        let (variant, entry, rows_per_group) = if tiled {
            ("DENSE_ROWS", "dense_tiled", DENSE_TILE_ROWS)
        } else if self.by_words() {
            ("DENSE_ROWS", "dense_rows", DENSE_ROWS_PER_GROUP)
        } else if norm.is_none() {
            ("DENSE", "dense", 1)
        } else {
            return Err(Error::Gpu(format!(
                "a {:?} matrix of {} columns cannot take a norm in",
                self.format, self.cols
            )));
        };
        let mut defines = vec![(variant, "1".to_string()), (format, "1".to_string())];
        if norm.is_some() {
            defines.push(("NORMED", "1".to_string()));
        }
        // A prompt block's tokens share each weight load: in tiles, or in dense_rows' batches.
        let batch = if tiled {
            defines.push(("TILED", "1".to_string()));
            DENSE_TILE_TOKENS
        } else if rows_per_group > 1 && tokens > 1 {
            defines.push(("BATCHED", "1".to_string()));
            defines.push(("TOKENS", DENSE_TOKENS_PER_GROUP.to_string()));
            DENSE_TOKENS_PER_GROUP
        } else {
            1
        };
        let eps = norm.as_ref().map_or(0.0, |n| n.eps);
        // dense_rows reads up to four chunks per dispatch, dense one.
        let span = if rows_per_group > 1 { DENSE_CHUNKS } else { 1 };
        let chunk_rows = self.chunks[0].1;
        self.chunks
            .chunks(span)
            .map(|spanned| {
                let first = spanned[0].0;
                let rows: usize = spanned.iter().map(|c| c.1).sum();
                let (gx, gy) = ctx.row_groups(rows.div_ceil(rows_per_group))?;
                let params = [
                    u32_of(rows, "rows")?,
                    u32_of(self.cols, "cols")?,
                    u32_of(first, "row offset")?,
                    u32_of(self.rows, "rows")?,
                    u32_of(self.cols, "cols")?,
                    bias.is_some() as u32,
                    gx,
                    0,
                    0,
                    1,
                    u32_of(tokens, "tokens")?,
                    (output == Output::Accumulate) as u32,
                    eps.to_bits(),
                    u32_of(chunk_rows, "rows per chunk")?,
                    0,
                    0,
                ];
                // dense_rows: weights at 1 (CHUNKED: 1 to 4), the rest from 5; dense from 2.
                let chunked = span > 1 && self.chunks.len() > 1;
                let weights = (0..if chunked { span } else { 1 })
                    .map(|c| &spanned.get(c).unwrap_or(&spanned[0]).2);
                let mut bound: Vec<(u32, &wgpu::Buffer)> = (1..).zip(weights).collect();
                let rest = [x, bias.unwrap_or(dummy), y]
                    .into_iter()
                    .chain(norm.as_ref().map(|n| n.weight));
                let first_input = if span > 1 { 1 + DENSE_CHUNKS as u32 } else { 2 };
                bound.extend((first_input..).zip(rest));
                let mut defines = defines.clone();
                if chunked {
                    defines.push(("CHUNKED", "1".to_string()));
                }
                let weight_bytes = rows * self.cols * self.format.size();
                let bytes = weight_bytes + 4 * tokens * (self.cols + rows);
                let dispatch = ctx.prepare_bound(
                    "matmul.wgsl",
                    entry,
                    &defines,
                    &params,
                    &bound,
                    [gx, gy, u32_of(tokens.div_ceil(batch), "tokens")?],
                )?;
                Ok(dispatch.moving(bytes as u64))
            })
            .collect()
    }
}

/// The experts of one projection on the GPU, split by experts to fit binding limits: the whole
/// set as the checkpoint stores it, or a pool of slots that the VRAM expert cache fills.
pub struct GpuExperts {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// Variant defines of the kernel that reads this format.
    defines: [(&'static str, String); 3],
    /// Weight and scale bytes of one expert (scales: 0 for float experts).
    expert_bytes: usize,
    scale_bytes: usize,
    /// (first expert, experts, weights, scales: absent for float experts)
    chunks: Vec<(usize, usize, wgpu::Buffer, Option<wgpu::Buffer>)>,
}

/// Where one projection's experts sit in memory, per expert.
struct ExpertLayout {
    defines: [(&'static str, String); 3],
    rows: usize,
    cols: usize,
    expert_bytes: usize,
    scale_bytes: usize,
}

impl ExpertLayout {
    fn of(m: &ExpertMatrices) -> ExpertLayout {
        let (expert_bytes, scale_bytes) = m.part_sizes();
        let kind = match m {
            ExpertMatrices::Mxfp4(_) => ("EXPERTS", "MXFP4"),
            ExpertMatrices::Int4(_) => ("EXPERTS", "INT4"),
            ExpertMatrices::Dense(d) => ("EXPERTS_UNQUANTIZED", format_define(d.format)),
            ExpertMatrices::Rows(r) => ("EXPERTS_ROWS", format_define(r.format)),
        };
        ExpertLayout {
            defines: [
                (kind.0, "1".into()),
                (kind.1, "1".into()),
                ("EXPERT_PAIRS", "1".into()),
            ],
            rows: m.outputs(),
            cols: m.inputs(),
            expert_bytes,
            scale_bytes,
        }
    }
}

impl GpuExperts {
    /// `experts` experts laid out as `layout`, chunk buffers made by `make(first, count)`.
    fn build(
        ctx: &GpuContext,
        name: &str,
        layout: ExpertLayout,
        experts: usize,
        mut make: impl FnMut(usize, usize) -> Result<(wgpu::Buffer, Option<wgpu::Buffer>)>,
    ) -> Result<GpuExperts> {
        let unit = layout.expert_bytes.max(layout.scale_bytes);
        let chunks = if experts == 0 {
            Vec::new()
        } else {
            split(experts, unit, ctx.max_binding_bytes, name)?
                .into_iter()
                .map(|(first, n)| make(first, n).map(|(w, s)| (first, n, w, s)))
                .collect::<Result<_>>()?
        };
        Ok(GpuExperts {
            experts,
            rows: layout.rows,
            cols: layout.cols,
            defines: layout.defines,
            expert_bytes: layout.expert_bytes,
            scale_bytes: layout.scale_bytes,
            chunks,
        })
    }

    /// Uploads every expert of whatever format the checkpoint stores.
    pub fn upload(ctx: &GpuContext, name: &str, m: &ExpertMatrices) -> Result<GpuExperts> {
        let layout = ExpertLayout::of(m);
        let has_scales = layout.scale_bytes > 0;
        Self::build(ctx, name, layout, m.experts(), |first, n| {
            let upload = |w: &[u8], s: Option<&[u8]>| {
                let scales = s.filter(|_| has_scales).map(|s| ctx.try_upload(name, s));
                Ok((ctx.try_upload(name, w)?, scales.transpose()?))
            };
            if let Some((w, s)) = m.expert_run(first..first + n) {
                return upload(w, s);
            }
            // A converted store's padded records (or Qwen3-MoE's per-expert tensors): gathered
            // expert by expert.
            let (mut w, mut s) = (Vec::new(), Vec::new());
            for e in first..first + n {
                let (weights, scales) = m.expert_pieces(e);
                weights.iter().for_each(|piece| w.extend_from_slice(piece));
                s.extend_from_slice(scales.unwrap_or_default());
            }
            upload(&w, Some(&s))
        })
    }

    /// `slots` empty expert slots shaped like the experts of `like`, for the VRAM expert cache.
    /// Fails when a slot's bytes are not whole 4-byte words (the queue writes words).
    pub fn pool(
        ctx: &GpuContext,
        name: &str,
        like: &ExpertMatrices,
        slots: usize,
    ) -> Result<GpuExperts> {
        let layout = ExpertLayout::of(like);
        let (eb, sb) = (layout.expert_bytes, layout.scale_bytes);
        if slots > 0 && (!eb.is_multiple_of(4) || !sb.is_multiple_of(4)) {
            return Err(Error::Gpu(format!(
                "{name}: experts of {eb} + {sb} bytes are not whole 4-byte words, which a VRAM expert cache needs; keep every expert resident (--vram-budget 100%)"
            )));
        }
        Self::build(ctx, name, layout, slots, |_, n| {
            let w = ctx.zeroed(name, (n * eb) as u64)?;
            let s = (sb > 0)
                .then(|| ctx.zeroed(name, (n * sb) as u64))
                .transpose()?;
            Ok((w, s))
        })
    }

    /// Writes one expert (`m` holding exactly one, in this pool's format) into `slot`; the copy
    /// lands before the next submission's commands run.
    pub fn write_slot(&self, queue: &wgpu::Queue, slot: usize, m: &ExpertMatrices) -> Result<()> {
        let (weights, scales) = m.expert_pieces(0);
        let weight_bytes: usize = weights.iter().map(|piece| piece.len()).sum();
        let fits =
            weight_bytes == self.expert_bytes && scales.map_or(0, <[u8]>::len) == self.scale_bytes;
        let chunk = self
            .chunks
            .iter()
            .find(|(first, n, _, _)| (*first..first + n).contains(&slot));
        let (Some((first, _, w, s)), true) = (chunk, fits) else {
            return Err(Error::Gpu(format!(
                "expert slot {slot}: no such slot, or an expert of another shape"
            )));
        };
        let at = (slot - first) as u64;
        let mut offset = at * self.expert_bytes as u64;
        for piece in weights {
            queue.write_buffer(w, offset, piece);
            offset += piece.len() as u64;
        }
        if let (Some(s), Some(scales)) = (s, scales) {
            queue.write_buffer(s, at * self.scale_bytes as u64, scales);
        }
        Ok(())
    }

    /// Bytes of one expert (weights and scales).
    pub fn bytes_per_expert(&self) -> usize {
        self.expert_bytes + self.scale_bytes
    }

    pub fn upload_mxfp4(ctx: &GpuContext, name: &str, m: &Mxfp4Experts) -> Result<GpuExperts> {
        Self::upload(ctx, name, &ExpertMatrices::Mxfp4(m.clone()))
    }

    pub fn upload_int4(ctx: &GpuContext, name: &str, m: &Int4Experts) -> Result<GpuExperts> {
        Self::upload(ctx, name, &ExpertMatrices::Int4(m.clone()))
    }

    /// Unquantized experts, `[E, in, out]` as transformers stores them.
    pub fn upload_unquantized(
        ctx: &GpuContext,
        name: &str,
        m: &DenseExperts,
    ) -> Result<GpuExperts> {
        Self::upload(ctx, name, &ExpertMatrices::Dense(m.clone()))
    }

    /// For each of `pairs` (token, slot) pairs `p`: `y[p] = W[ids[p]] . x[p / x_div] + bias[ids[p]]`
    /// (`bias` is `[experts, rows]`). One dispatch per chunk; pairs routed to other chunks skip.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare(
        &self,
        ctx: &GpuContext,
        x: &wgpu::Buffer,
        x_div: usize,
        ids: &wgpu::Buffer,
        pairs: usize,
        bias: Option<&wgpu::Buffer>,
        y: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
    ) -> Result<Vec<Dispatch>> {
        let (gx, gy) = ctx.row_groups(self.rows)?;
        let entry = match self.defines[0].0 {
            "EXPERTS" => "experts",
            "EXPERTS_ROWS" => "experts_rows",
            _ => "experts_unquantized",
        };
        self.chunks
            .iter()
            .map(|(first, n, weights, scales)| {
                let params = [
                    u32_of(self.rows, "rows")?,
                    u32_of(self.cols, "cols")?,
                    0,
                    u32_of(self.rows, "rows")?,
                    u32_of(self.cols, "cols")?,
                    bias.is_some() as u32,
                    gx,
                    u32_of(*first, "expert")?,
                    u32_of(*n, "experts")?,
                    u32_of(x_div, "x_div")?,
                    u32_of(pairs, "pairs")?,
                    0,
                    0,
                    0,
                    0,
                    0,
                ];
                let head = [weights, x, bias.unwrap_or(dummy), y];
                let buffers: Vec<&wgpu::Buffer> = match scales {
                    Some(scales) => head.into_iter().chain([scales, ids]).collect(),
                    None => head.into_iter().chain([ids]).collect(),
                };
                // Each chunk's share of the routed experts is unknown here: counted once, in
                // the first chunk.
                let bytes = if *first == 0 {
                    self.routed_bytes(pairs)
                } else {
                    0
                };
                let dispatch = ctx.prepare(
                    "matmul.wgsl",
                    entry,
                    &self.defines,
                    &params,
                    &buffers,
                    [gx, gy, u32_of(pairs, "pairs")?],
                )?;
                Ok(dispatch.moving(bytes as u64))
            })
            .collect()
    }

    /// The weights and scales of quantized experts whose rows are whole 32-value groups, at the
    /// bindings experts.wgsl reads them from (chunk c at 1 + 2c and 2 + 2c; with several
    /// chunks, of equal expert counts, the CHUNKED variant, unused bindings repeating the first),
    /// its defines and the experts per chunk. None where the fused kernels cannot read them
    /// (float experts, more than `FUSED_EXPERT_CHUNKS` chunks, too few storage bindings per
    /// shader for the chunked variant): the caller runs the separate kernels.
    fn fused_operands(&self, ctx: &GpuContext, kernel: &'static str) -> Option<FusedOperands<'_>> {
        let quantized = self.defines[0].0 == "EXPERTS" && self.cols.is_multiple_of(32);
        let bindings = ctx.adapter.max_storage_buffers_per_shader_stage as usize;
        let chunks = self.chunks.len();
        let chunked = chunks > 1;
        if !quantized || !(1..=FUSED_EXPERT_CHUNKS).contains(&chunks) || (chunked && bindings < 13)
        {
            return None;
        }
        let per_chunk = self.chunks[0].1;
        let mut bound = Vec::with_capacity(2 * FUSED_EXPERT_CHUNKS);
        for c in 0..if chunked { FUSED_EXPERT_CHUNKS } else { 1 } {
            let (first, _, weights, scales) = &self.chunks[if c < chunks { c } else { 0 }];
            if c < chunks && *first != c * per_chunk {
                return None;
            }
            let at = 1 + 2 * c as u32;
            bound.extend([(at, weights), (at + 1, scales.as_ref()?)]);
        }
        let mut defines = vec![
            (kernel, "1".to_string()),
            (self.defines[1].0, "1".to_string()),
        ];
        if chunked {
            defines.push(("CHUNKED", "1".to_string()));
        }
        Some(FusedOperands {
            bound,
            defines,
            per_chunk,
        })
    }

    /// Parameters of experts.wgsl and its workgroups for `z` along z.
    fn fused_params(
        &self,
        ctx: &GpuContext,
        (top_k, has_bias, per_chunk): (usize, bool, usize),
        (alpha, limit): (f32, f32),
        (rows_per_group, z): (usize, usize),
    ) -> Result<([u32; 12], [u32; 3])> {
        let (gx, gy) = ctx.row_groups(self.rows.div_ceil(rows_per_group))?;
        let params = [
            u32_of(self.rows, "rows")?,
            u32_of(self.cols, "cols")?,
            u32_of(top_k, "top_k")?,
            has_bias as u32,
            alpha.to_bits(),
            limit.to_bits(),
            gx,
            u32_of(per_chunk, "experts per chunk")?,
            0,
            1,
            0,
            0,
        ];
        Ok((params, [gx, gy, u32_of(z, "workgroups")?]))
    }

    /// For each of `tokens * top_k` (token, slot) pairs `p` routed by `ids`, the clamped SwiGLU
    /// of this gate/up projection (interleaved rows) of `x[p / top_k]`, into `act[p]`: one
    /// dispatch for the product and the activation, one workgroup per (row block, pair), or with
    /// `grouped` (a prompt block, its pairs sorted into tiles by `prepare_sort_pairs`) per (row
    /// tile, pair tile). None where `fused_operands` is.
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_gate_up_swiglu(
        &self,
        ctx: &GpuContext,
        (x, tokens, top_k): (&wgpu::Buffer, usize, usize),
        ids: &wgpu::Buffer,
        bias: Option<&wgpu::Buffer>,
        alpha_limit: (f32, f32),
        grouped: Option<&PairTiles>,
        act: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
    ) -> Result<Option<Dispatch>> {
        let fused = self.fused_operands(ctx, "SWIGLU");
        let Some(mut fused) = fused.filter(|_| self.rows.is_multiple_of(2)) else {
            return Ok(None);
        };
        let pairs = tokens * top_k;
        let dispatch = if let Some(tiles) = grouped {
            fused.bind([x, bias.unwrap_or(dummy), tiles.order, act, tiles.tiles]);
            let shape = (pairs, top_k, bias.is_some());
            self.prepare_grouped(ctx, fused, shape, alpha_limit)?
        } else {
            fused.bind([x, bias.unwrap_or(dummy), ids, act]);
            let shape = (top_k, bias.is_some(), fused.per_chunk);
            let grid = (FUSED_EXPERT_ROWS, pairs);
            let (params, groups) = self.fused_params(ctx, shape, alpha_limit, grid)?;
            let (defines, bound) = (&fused.defines, &fused.bound);
            ctx.prepare_bound(
                "experts.wgsl",
                "gate_up_swiglu",
                defines,
                &params,
                bound,
                groups,
            )?
        };
        let bytes = self.routed_bytes(pairs) + 4 * tokens * self.cols;
        Ok(Some(dispatch.moving(bytes as u64)))
    }

    /// `hidden[t] +=` the sum over token t's slots, in ascending expert id, of
    /// `route_weights[p] * (W[ids[p]] . act[p] + bias[ids[p]])`: this down projection and the
    /// combine in one dispatch (None where `fused_operands` is).
    #[allow(clippy::too_many_arguments)]
    pub fn prepare_down_combine(
        &self,
        ctx: &GpuContext,
        (act, tokens, top_k): (&wgpu::Buffer, usize, usize),
        (ids, route_weights): (&wgpu::Buffer, &wgpu::Buffer),
        bias: Option<&wgpu::Buffer>,
        hidden: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
    ) -> Result<Option<Dispatch>> {
        let Some(mut fused) = self.fused_operands(ctx, "COMBINE") else {
            return Ok(None);
        };
        let shape = (top_k, bias.is_some(), fused.per_chunk);
        let grid = (FUSED_EXPERT_ROWS, tokens);
        let (params, groups) = self.fused_params(ctx, shape, (0.0, 0.0), grid)?;
        fused.bind([act, bias.unwrap_or(dummy), ids, route_weights, hidden]);
        let bytes = self.routed_bytes(tokens * top_k) + 8 * tokens * self.rows;
        ctx.prepare_bound(
            "experts.wgsl",
            "down_combine",
            &fused.defines,
            &params,
            &fused.bound,
            groups,
        )
        .map(|dispatch| Some(dispatch.moving(bytes as u64)))
    }

    /// Grouped by expert, for a prompt block: `y[p] = W[e] . act[p] + bias[e]` for every pair,
    /// e its expert (moe.wgsl's combine then adds them up), one workgroup per (row tile, pair
    /// tile) of the tiles `prepare_sort_pairs` listed.
    pub fn prepare_down_grouped(
        &self,
        ctx: &GpuContext,
        (act, pairs): (&wgpu::Buffer, usize),
        tiles: &PairTiles,
        bias: Option<&wgpu::Buffer>,
        y: &wgpu::Buffer,
        dummy: &wgpu::Buffer,
    ) -> Result<Option<Dispatch>> {
        let Some(mut fused) = self.fused_operands(ctx, "DOWN") else {
            return Ok(None);
        };
        fused.bind([act, bias.unwrap_or(dummy), tiles.order, y, tiles.tiles]);
        let dispatch = self.prepare_grouped(ctx, fused, (pairs, 1, bias.is_some()), (0.0, 0.0))?;
        Ok(Some(dispatch.moving(self.routed_bytes(pairs) as u64)))
    }

    /// A GROUPED kernel of experts.wgsl over `pairs` pairs, pair q reading input row q / x_div:
    /// one workgroup per (row tile, possible pair tile); those past the listed tiles return.
    fn prepare_grouped(
        &self,
        ctx: &GpuContext,
        mut fused: FusedOperands,
        (pairs, x_div, has_bias): (usize, usize, bool),
        alpha_limit: (f32, f32),
    ) -> Result<Dispatch> {
        let shape = (1, has_bias, fused.per_chunk);
        let grid = (GROUPED_TILE_ROWS, PairTiles::max_tiles(pairs, self.experts));
        let (mut params, groups) = self.fused_params(ctx, shape, alpha_limit, grid)?;
        params[8] = u32_of(pairs, "pairs")?;
        params[9] = u32_of(x_div, "x_div")?;
        fused.defines.push(("GROUPED", "1".to_string()));
        let entry = if fused.defines[0].0 == "SWIGLU" {
            "gate_up_swiglu_grouped"
        } else {
            "down_grouped"
        };
        ctx.prepare_bound(
            "experts.wgsl",
            entry,
            &fused.defines,
            &params,
            &fused.bound,
            groups,
        )
    }

    /// Weight bytes `pairs` routed (token, slot) pairs read at least (each distinct expert once,
    /// at most every expert), with each pair's output.
    fn routed_bytes(&self, pairs: usize) -> usize {
        let experts = pairs.min(self.experts);
        experts * self.bytes_per_expert() + 4 * pairs * self.rows
    }

    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The experts (or cache slots) each chunk holds, in the order `prepare` returns dispatches.
    pub fn chunk_ranges(&self) -> Vec<std::ops::Range<usize>> {
        self.chunks
            .iter()
            .map(|(first, n, _, _)| *first..first + n)
            .collect()
    }
}

/// RMSNorm of `rows` rows of `cols` values: `y = w * x / sqrt(mean(x^2) + eps)`.
#[allow(clippy::too_many_arguments)]
pub fn prepare_rms_norm(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    w: &wgpu::Buffer,
    rows: usize,
    cols: usize,
    eps: f32,
    y: &wgpu::Buffer,
) -> Result<Dispatch> {
    let params = [u32_of(cols, "cols")?, eps.to_bits(), 0, 0];
    let dispatch = ctx.prepare(
        "norm.wgsl",
        "rms_norm",
        &[],
        &params,
        &[x, w, y],
        [u32_of(rows, "rows")?, 1, 1],
    )?;
    Ok(dispatch.moving((4 * (2 * rows + 1) * cols) as u64))
}

/// A strided view of rows in a buffer: row t starts `offset + t * stride` floats in.
pub struct RowView<'b> {
    pub buffer: &'b wgpu::Buffer,
    pub offset: usize,
    pub stride: usize,
}

/// RMSNorm in place of each of `heads` heads of `head_dim` values in each of `tokens` rows of
/// `view`, with the per-head weights `w` (Qwen3's q_norm and k_norm).
pub fn prepare_head_norm(
    ctx: &GpuContext,
    view: &RowView,
    w: &wgpu::Buffer,
    (tokens, heads, head_dim): (usize, usize, usize),
    eps: f32,
) -> Result<Dispatch> {
    let params = [
        u32_of(head_dim, "head_dim")?,
        eps.to_bits(),
        u32_of(heads, "heads")?,
        u32_of(view.offset, "offset")?,
        u32_of(view.stride, "stride")?,
        0,
        0,
        0,
    ];
    let groups = [u32_of(tokens, "tokens")?, u32_of(heads, "heads")?, 1];
    let dispatch = ctx.prepare(
        "norm.wgsl",
        "head_norm",
        &[("HEADS", "1".to_string())],
        &params,
        &[view.buffer, w],
        groups,
    )?;
    Ok(dispatch.moving((4 * (2 * tokens * heads + 1) * head_dim) as u64))
}

impl GpuContext {
    /// A grid for `n` invocations in workgroups of `size`: (x, y) with x within the per-dimension
    /// limit; the kernel's index is `gid.x + gid.y * x * size`.
    fn flat_groups(&self, n: usize, size: usize) -> Result<[u32; 3]> {
        let (x, y) = self.row_groups(n.div_ceil(size))?;
        Ok([x, y, 1])
    }
}

/// The MoE kernels' parameters: (tokens or rows, experts, top_k, width), (alpha, limit), groups_x.
fn moe_params(
    (rows, experts, top_k, width): (usize, usize, usize, usize),
    (alpha, limit): (f32, f32),
    groups_x: u32,
) -> Result<[u32; 8]> {
    Ok([
        u32_of(rows, "rows")?,
        u32_of(experts, "experts")?,
        u32_of(top_k, "top_k")?,
        u32_of(width, "width")?,
        alpha.to_bits(),
        limit.to_bits(),
        groups_x,
        0,
    ])
}

/// The router kernels' parameters: (tokens, experts, top_k, cols), eps, groups_x.
fn router_params(
    (tokens, experts, top_k, cols): (usize, usize, usize, usize),
    eps: f32,
    groups_x: u32,
) -> Result<[u32; 8]> {
    Ok([
        u32_of(tokens, "tokens")?,
        u32_of(experts, "experts")?,
        u32_of(top_k, "top_k")?,
        u32_of(cols, "cols")?,
        eps.to_bits(),
        groups_x,
        0,
        0,
    ])
}

/// router.wgsl's defines for `gating`.
fn gating_defines(gating: Gating) -> Vec<(&'static str, String)> {
    match gating {
        Gating::TopKThenSoftmax => Vec::new(),
        Gating::SoftmaxThenTopK { renormalize } => {
            let mut defines = vec![("SOFTMAX_FIRST", "1".to_string())];
            if renormalize {
                defines.push(("RENORMALIZE", "1".to_string()));
            }
            defines
        }
    }
}

/// Top-k of `[tokens, experts]` router logits and their weights as `gating` says: `ids`,
/// `weights`.
pub fn prepare_route(
    ctx: &GpuContext,
    logits: &wgpu::Buffer,
    (tokens, experts, top_k): (usize, usize, usize),
    gating: Gating,
    ids: &wgpu::Buffer,
    weights: &wgpu::Buffer,
) -> Result<Dispatch> {
    let groups = ctx.flat_groups(tokens, 64)?;
    let params = router_params((tokens, experts, top_k, 0), 0.0, groups[0])?;
    ctx.prepare(
        "router.wgsl",
        "route",
        &gating_defines(gating),
        &params,
        &[logits, ids, weights],
        groups,
    )
}

/// A router on the GPU: its product and bias (where it has one), top-k and gating.
pub struct RouterWeights<'b> {
    pub matrix: &'b GpuMatrix,
    pub bias: Option<&'b wgpu::Buffer>,
    pub top_k: usize,
    pub gating: Gating,
}

/// The routing's outputs: the logits, then each (token, slot)'s expert id and weight.
pub struct RoutingBuffers<'b> {
    pub logits: &'b wgpu::Buffer,
    pub ids: &'b wgpu::Buffer,
    pub weights: &'b wgpu::Buffer,
}

/// RMSNorm of `tokens` residual rows of `x` into `normed` (with `norm_weight` and `eps`), the
/// router's product of them and its top-k, in one dispatch (one workgroup per token). None when
/// the router's weights span several bindings: the caller runs the three kernels.
#[allow(clippy::too_many_arguments)]
pub fn prepare_route_normed(
    ctx: &GpuContext,
    (x, tokens): (&wgpu::Buffer, usize),
    (norm_weight, eps): (&wgpu::Buffer, f32),
    normed: &wgpu::Buffer,
    router: &RouterWeights,
    out: &RoutingBuffers,
) -> Result<Option<Dispatch>> {
    let [(_, _, weights)] = router.matrix.chunks.as_slice() else {
        return Ok(None);
    };
    let shape = (tokens, router.matrix.rows, router.top_k, router.matrix.cols);
    let params = router_params(shape, eps, 0)?;
    let mut defines = vec![
        ("NORMED", "1".to_string()),
        (format_define(router.matrix.format), "1".to_string()),
    ];
    defines.extend(gating_defines(router.gating));
    let mut buffers = vec![
        out.logits,
        out.ids,
        out.weights,
        x,
        norm_weight,
        normed,
        weights,
    ];
    if let Some(bias) = router.bias {
        defines.push(("BIAS", "1".to_string()));
        buffers.push(bias);
    }
    let groups = [u32_of(tokens, "tokens")?, 1, 1];
    let router_bytes = router.matrix.rows * router.matrix.cols * router.matrix.format.size();
    let bytes = router_bytes + 4 * tokens * (2 * router.matrix.cols + router.matrix.rows);
    let dispatch = ctx.prepare(
        "router.wgsl",
        "route_normed",
        &defines,
        &params,
        &buffers,
        groups,
    )?;
    Ok(Some(dispatch.moving(bytes as u64)))
}

/// `activation` of `rows` gate/up rows of `2 * width` into `[rows, width]`: GPT-OSS's clamped
/// SwiGLU over interleaved rows, or the plain one over gate then up halves.
pub fn prepare_swiglu(
    ctx: &GpuContext,
    gate_up: &wgpu::Buffer,
    (rows, width): (usize, usize),
    activation: Activation,
    act: &wgpu::Buffer,
) -> Result<Dispatch> {
    let groups = ctx.flat_groups(rows * width, 64)?;
    let (alpha_limit, mut defines) = match activation {
        Activation::ClampedSwiglu { alpha, limit } => ((alpha, limit), vec![]),
        Activation::Swiglu => ((0.0, 0.0), vec![("PLAIN", "1".to_string())]),
    };
    defines.push(("SWIGLU", "1".to_string()));
    let params = moe_params((rows, 0, 0, width), alpha_limit, groups[0])?;
    ctx.prepare(
        "moe.wgsl",
        "swiglu",
        &defines,
        &params,
        &[gate_up, act],
        groups,
    )
}

/// `hidden[t] += sum_s weights[t, s] * down[t * top_k + s]`, experts in ascending id order.
pub fn prepare_combine(
    ctx: &GpuContext,
    (ids, weights, down): (&wgpu::Buffer, &wgpu::Buffer, &wgpu::Buffer),
    (tokens, top_k, width): (usize, usize, usize),
    hidden: &wgpu::Buffer,
) -> Result<Dispatch> {
    let groups = ctx.flat_groups(tokens * width, 64)?;
    let params = moe_params((tokens, 0, top_k, width), (0.0, 0.0), groups[0])?;
    let defines = [("COMBINE", "1".to_string())];
    ctx.prepare(
        "moe.wgsl",
        "combine",
        &defines,
        &params,
        &[ids, weights, down, hidden],
        groups,
    )
}

/// The elementwise kernels' parameters.
fn elementwise_params(
    count: usize,
    tokens: usize,
    (row_first, rows): (usize, usize),
    groups_x: u32,
) -> Result<[u32; 8]> {
    Ok([
        u32_of(count, "count")?,
        u32_of(tokens, "tokens")?,
        u32_of(row_first, "row")?,
        u32_of(rows, "rows")?,
        groups_x,
        0,
        0,
        0,
    ])
}

/// `y += x` over `count` values.
pub fn prepare_add(
    ctx: &GpuContext,
    x: &wgpu::Buffer,
    y: &wgpu::Buffer,
    count: usize,
) -> Result<Dispatch> {
    let groups = ctx.flat_groups(count, 256)?;
    let params = elementwise_params(count, 0, (0, 0), groups[0])?;
    let defines = [("ADD", "1".to_string())];
    ctx.prepare(
        "elementwise.wgsl",
        "add",
        &defines,
        &params,
        &[x, y],
        groups,
    )
}

/// The index of the largest of `count` values into `result[0]` (first on ties).
pub fn prepare_argmax(
    ctx: &GpuContext,
    values: &wgpu::Buffer,
    count: usize,
    result: &wgpu::Buffer,
) -> Result<Dispatch> {
    let params = elementwise_params(count, 0, (0, 0), 1)?;
    let defines = [("SELECT", "1".to_string())];
    ctx.prepare(
        "elementwise.wgsl",
        "argmax",
        &defines,
        &params,
        &[values, result],
        [1, 1, 1],
    )
}

/// Most logits the GPU's top-k reads back per step (it makes k passes over the vocabulary).
pub const MAX_GPU_TOP_LOGITS: usize = 64;

/// The `k` largest of `count` values, largest first, as `result[2s] = index`,
/// `result[2s + 1] = value bits` (`2k` words).
pub fn prepare_top_k(
    ctx: &GpuContext,
    values: &wgpu::Buffer,
    count: usize,
    k: usize,
    result: &wgpu::Buffer,
) -> Result<Dispatch> {
    let params = elementwise_params(count, 0, (0, k), 1)?;
    let defines = [("SELECT", "1".to_string())];
    let dispatch = ctx.prepare(
        "elementwise.wgsl",
        "top_k",
        &defines,
        &params,
        &[values, result],
        [1, 1, 1],
    )?;
    Ok(dispatch.moving((4 * count + 8 * k) as u64))
}
