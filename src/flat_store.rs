//! The converted expert store (`picchio convert`): every (layer, expert) one record in one file,
//! each starting on a 4 KiB boundary, so one positioned read (or one O_DIRECT read) loads one
//! expert, with an index holding the layout and a hash per record. The dense tensors go to a
//! plain safetensors file beside it.
//!
//! A record holds, in order: gate_up weights, gate_up scales, down weights, down scales, then zero
//! padding up to the stride. Experts are MXFP4 (copied bit for bit from the checkpoint) or
//! group-scaled INT4 (quantized from the exact weights, 32 inputs per f16 scale: lossy).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::formats::{decode_floats, dequantize_mxfp4_row};
use crate::weights::{
    Checkpoint, ExpertMatrices, ExpertStride, Int4Experts, LayerWeights, ModelWeights,
    Mxfp4Experts, TensorBytes,
};

/// The index file of a converted store.
pub const INDEX_FILE: &str = "experts.json";
/// The records file of a converted store.
pub const RECORDS_FILE: &str = "experts.bin";
/// Every record starts on a multiple of this (the page size and O_DIRECT's usual alignment).
pub const RECORD_ALIGN: usize = 4096;

/// How a converted store holds expert weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FlatFormat {
    Mxfp4,
    Int4,
}

impl FlatFormat {
    /// The format as `--experts` names it.
    pub fn name(self) -> &'static str {
        match self {
            FlatFormat::Mxfp4 => "mxfp4",
            FlatFormat::Int4 => "int4",
        }
    }
}

impl std::str::FromStr for FlatFormat {
    type Err = String;

    fn from_str(text: &str) -> std::result::Result<FlatFormat, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "mxfp4" => Ok(FlatFormat::Mxfp4),
            "int4" => Ok(FlatFormat::Int4),
            _ => Err(format!("{text:?}: expected mxfp4 or int4")),
        }
    }
}

/// A part of a record: offset from the record's start and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub offset: usize,
    pub len: usize,
}

/// One projection's place in a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectionLayout {
    pub rows: usize,
    pub cols: usize,
    pub weights: Span,
    pub scales: Span,
}

/// `experts.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlatIndex {
    pub format_version: u32,
    pub experts_format: FlatFormat,
    pub layers: usize,
    pub experts: usize,
    /// Bytes from one record's start to the next's (a multiple of `RECORD_ALIGN`).
    pub record_stride: usize,
    /// Bytes of a record before its padding.
    pub record_bytes: usize,
    pub gate_up: ProjectionLayout,
    pub down: ProjectionLayout,
    /// FNV-1a 64 of each record's `record_bytes`, in hex, record `layer * experts + expert`.
    pub hashes: Vec<String>,
    /// XXH3-64 of the same bytes, in hex (stores written since this field exists): checked
    /// instead of the FNV-1a hashes where present, at tens of GB/s rather than about one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xxh3: Option<Vec<String>>,
}

impl FlatIndex {
    fn layout(format: FlatFormat, cfg: &Config) -> FlatIndex {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let scale_size = match format {
            FlatFormat::Mxfp4 => 1,
            FlatFormat::Int4 => 2,
        };
        let mut at = 0;
        let mut span = |len: usize| {
            let s = Span { offset: at, len };
            at += len;
            s
        };
        let mut projection = |rows: usize, cols: usize| ProjectionLayout {
            rows,
            cols,
            weights: span(rows * cols / 2),
            scales: span(rows * cols / 32 * scale_size),
        };
        let gate_up = projection(2 * i, h);
        let down = projection(h, i);
        let record_bytes = down.scales.offset + down.scales.len;
        FlatIndex {
            format_version: 1,
            experts_format: format,
            layers: cfg.num_layers,
            experts: cfg.num_experts,
            record_stride: record_bytes.div_ceil(RECORD_ALIGN) * RECORD_ALIGN,
            record_bytes,
            gate_up,
            down,
            hashes: Vec::new(),
            xxh3: Some(Vec::new()),
        }
    }

    /// Byte offset of record (layer, expert) in the records file.
    pub fn record_offset(&self, layer: usize, expert: usize) -> u64 {
        ((layer * self.experts + expert) * self.record_stride) as u64
    }
}

/// FNV-1a, 64 bits: a record checksum with no dependency.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A converted store opened for reading: its index and the mapped records.
pub struct FlatExperts {
    pub index: FlatIndex,
    pub records_path: PathBuf,
    map: Arc<Mmap>,
}

impl FlatExperts {
    /// Opens `dir`'s converted store, if it has one, checking the index against `cfg` and the
    /// records file's length.
    pub fn open(dir: &Path, cfg: &Config) -> Result<Option<FlatExperts>> {
        let index_path = dir.join(INDEX_FILE);
        if !index_path.exists() {
            if dir.join(RECORDS_FILE).exists() {
                // The index is written last: records without it are a conversion cut short.
                return Err(Error::Format {
                    path: index_path,
                    message: format!(
                        "missing beside {RECORDS_FILE}: a half-written conversion (convert again)"
                    ),
                });
            }
            return Ok(None);
        }
        let text = std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
        let index: FlatIndex = serde_json::from_str(&text).map_err(|e| Error::Format {
            path: index_path.clone(),
            message: e.to_string(),
        })?;
        let expected = FlatIndex::layout(index.experts_format, cfg);
        let bad = |message: String| Error::Format {
            path: index_path.clone(),
            message,
        };
        if index.format_version != 1 {
            return Err(bad(format!(
                "format_version {} (this picchio reads 1)",
                index.format_version
            )));
        }
        if (
            index.layers,
            index.experts,
            index.gate_up,
            index.down,
            index.record_bytes,
        ) != (
            expected.layers,
            expected.experts,
            expected.gate_up,
            expected.down,
            expected.record_bytes,
        ) || index.record_stride < index.record_bytes
            || !index.record_stride.is_multiple_of(RECORD_ALIGN)
        {
            return Err(bad(format!(
                "the layout does not match config.json ({} layers x {} experts, records of {} bytes expected)",
                expected.layers, expected.experts, expected.record_bytes
            )));
        }
        let records = index.layers * index.experts;
        let xxh3 = index.xxh3.as_ref().map_or(records, Vec::len);
        if index.hashes.len() != records || xxh3 != records {
            return Err(bad(format!(
                "{} hashes ({xxh3} xxh3) for {records} records",
                index.hashes.len(),
            )));
        }
        let records_path = dir.join(RECORDS_FILE);
        let file = std::fs::File::open(&records_path).map_err(|e| Error::io(&records_path, e))?;
        // Safety: the records are only read; picchio never writes a file it has mapped, and a
        // file truncated under a running process is outside what any mmap reader can guard.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&records_path, e))?;
        // Every record must lie in the file before any is read (the stride comes from the index).
        let needed = (index.layers * index.experts)
            .checked_mul(index.record_stride)
            .ok_or_else(|| {
                bad(format!(
                    "record_stride {} puts the records beyond any file",
                    index.record_stride
                ))
            })?;
        if map.len() < needed {
            return Err(Error::Format {
                path: records_path,
                message: format!(
                    "{} bytes, but the index's record_stride ({}) for {} records describes {needed} (a short file or a wrong record_stride)",
                    map.len(),
                    index.record_stride,
                    index.layers * index.experts
                ),
            });
        }
        Ok(Some(FlatExperts {
            index,
            records_path,
            map: Arc::new(map),
        }))
    }

    /// One projection of every expert of `layer`, as strided views of the mapped records.
    pub fn projection(&self, layer: usize, gate_up: bool) -> ExpertMatrices {
        let index = &self.index;
        let p = if gate_up { index.gate_up } else { index.down };
        let base = index.record_offset(layer, 0) as usize;
        let view = |span: Span| {
            let start = base + span.offset;
            let end = start + (index.experts - 1) * index.record_stride + span.len;
            TensorBytes::mapped(self.map.clone(), start..end)
        };
        let stride = ExpertStride::Bytes(index.record_stride);
        match index.experts_format {
            FlatFormat::Mxfp4 => ExpertMatrices::Mxfp4(Mxfp4Experts {
                stride,
                ..Mxfp4Experts::contiguous(
                    index.experts,
                    (p.rows, p.cols),
                    view(p.weights),
                    view(p.scales),
                )
            }),
            FlatFormat::Int4 => ExpertMatrices::Int4(Int4Experts {
                stride,
                ..Int4Experts::contiguous(
                    index.experts,
                    (p.rows, p.cols),
                    view(p.weights),
                    view(p.scales),
                )
            }),
        }
    }

    /// Checks every record against its hash; the first mismatch is an error naming it.
    pub fn verify(&self) -> Result<()> {
        (0..self.index.hashes.len()).try_for_each(|r| self.check_record(r, self.record(r)))
    }

    /// Record `r` (`layer * experts + expert`) as mapped, its padding left out.
    pub fn record(&self, r: usize) -> &[u8] {
        let start = r * self.index.record_stride;
        &self.map[start..start + self.index.record_bytes]
    }

    /// Checks `bytes`, record `r` as read (its padding may follow), against the index's hash:
    /// XXH3 where the index has it, else FNV-1a.
    pub fn check_record(&self, r: usize, bytes: &[u8]) -> Result<()> {
        let index = &self.index;
        let bytes = &bytes[..index.record_bytes];
        let (got, want) = match &index.xxh3 {
            Some(xxh3) => (format!("{:016x}", xxh3_64(bytes)), &xxh3[r]),
            None => (format!("{:016x}", fnv1a64(bytes)), &index.hashes[r]),
        };
        if &got == want {
            return Ok(());
        }
        Err(Error::Format {
            path: self.records_path.clone(),
            message: format!(
                "record {r} (layer {}, expert {}) hashes to {got}, the index says {want}: the file is damaged (convert again)",
                r / index.experts,
                r % index.experts
            ),
        })
    }
}

/// Expert `e` of `m` as f32 rows `[outputs, inputs]` (exact: MXFP4 and float formats decode
/// without rounding).
fn expert_rows(m: &ExpertMatrices, e: usize) -> Result<Vec<f32>> {
    let (rows, cols) = (m.outputs(), m.inputs());
    let mut out = vec![0f32; rows * cols];
    match m {
        ExpertMatrices::Mxfp4(x) => {
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                let (blocks, scales) = x.row(e, r);
                dequantize_mxfp4_row(blocks, scales, row);
            }
        }
        ExpertMatrices::Dense(d) => {
            for i in 0..cols {
                let column = decode_floats(d.format, d.input_row(e, i));
                for (r, v) in column.into_iter().enumerate() {
                    out[r * cols + i] = v;
                }
            }
        }
        ExpertMatrices::Rows(r) => {
            let mut rows = out.chunks_exact_mut(cols);
            for block in r.matrices(e) {
                for (r, row) in (0..block.rows).zip(&mut rows) {
                    row.copy_from_slice(&decode_floats(block.format, block.row(r)));
                }
            }
        }
        ExpertMatrices::Int4(_) => {
            return Err(Error::Unsupported(
                "converting INT4 experts again (convert the original checkpoint)".into(),
            ));
        }
    }
    Ok(out)
}

/// Group-scaled INT4 of `[rows, cols]` f32 weights: per 32 inputs one f16 scale and nibbles
/// `clamp(round(w / scale), -8, 7) + 8` (low nibble first). The scale is the one of
/// `max|w| / d`, d in 5..=8 by halves, with the least squared error over the group (max/7 alone
/// wastes the -8 level and fits non-uniform MXFP4 values poorly). Returns (packed, scales).
pub fn quantize_int4(values: &[f32], cols: usize) -> (Vec<u8>, Vec<u8>) {
    let mut packed = Vec::with_capacity(values.len() / 2);
    let mut scales = Vec::with_capacity(values.len() / 16);
    debug_assert!(cols.is_multiple_of(32));
    let code = |v: f32, s: f32| -> u8 {
        if s == 0.0 {
            8
        } else {
            ((v / s).round().clamp(-8.0, 7.0) as i32 + 8) as u8
        }
    };
    for group in values.chunks_exact(32) {
        let max = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        let error = |scale: half::f16| -> f32 {
            let s = scale.to_f32();
            group
                .iter()
                .map(|&v| (v - (code(v, s) as f32 - 8.0) * s).powi(2))
                .sum()
        };
        // Each candidate's error once; the first of equal errors wins.
        let (scale, _) = [7.0f32, 7.5, 8.0, 6.5, 6.0, 5.5, 5.0]
            .into_iter()
            .map(|d| half::f16::from_f32(max / d))
            .map(|scale| (scale, error(scale)))
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .expect("candidates");
        let s = scale.to_f32();
        scales.extend_from_slice(&scale.to_le_bytes());
        for pair in group.chunks_exact(2) {
            packed.push(code(pair[0], s) | (code(pair[1], s) << 4));
        }
    }
    (packed, scales)
}

/// MXFP4 of `[rows, cols]` f32 weights (OCP MX): per 32 inputs one E8M0 scale `2^(floor(log2
/// max|w|) - 2)` (so the largest value lands in E2M1's top binade, whose largest is 6) and each
/// weight rounded to the nearest E2M1 value of `w / scale` (ties to the even code, beyond 6 to 6),
/// low nibble first. Returns (blocks, scales).
pub fn quantize_mxfp4(values: &[f32], cols: usize) -> (Vec<u8>, Vec<u8>) {
    debug_assert!(cols.is_multiple_of(32));
    let mut blocks = Vec::with_capacity(values.len() / 2);
    let mut scales = Vec::with_capacity(values.len() / 32);
    // The non-negative E2M1 values by code 0..=7; code | 8 is the negative.
    let magnitudes = &crate::formats::FP4_VALUES[..8];
    let code = |v: f32| -> u8 {
        let target = v.abs().min(6.0);
        let mut best = 0;
        for (c, m) in magnitudes.iter().enumerate() {
            let (d, best_d) = ((m - target).abs(), (magnitudes[best] - target).abs());
            // Nearer, or as near with an even code (round half to even).
            if d < best_d || (d == best_d && c % 2 == 0) {
                best = c;
            }
        }
        best as u8
            | if v.is_sign_negative() && best != 0 {
                8
            } else {
                0
            }
    };
    for group in values.chunks_exact(32) {
        let max = group.iter().fold(0f32, |m, v| m.max(v.abs()));
        // E8M0 exponents cover 2^-127..=2^127; an all-zero group takes the smallest.
        let exponent = if max > 0.0 {
            (max.log2().floor() as i32 - 2).clamp(-127, 127)
        } else {
            -127
        };
        let byte = (exponent + 127) as u8;
        let scale = crate::formats::e8m0_scale(byte);
        scales.push(byte);
        for pair in group.chunks_exact(2) {
            blocks.push(code(pair[0] / scale) | (code(pair[1] / scale) << 4));
        }
    }
    (blocks, scales)
}

/// Expert `e` of `m` in `format`: (weights, scales).
fn convert_expert(m: &ExpertMatrices, e: usize, format: FlatFormat) -> Result<(Vec<u8>, Vec<u8>)> {
    match (format, m) {
        (FlatFormat::Mxfp4, ExpertMatrices::Mxfp4(_)) => {
            let (w, s) = m.expert_parts(e);
            Ok((w.to_vec(), s.unwrap_or_default().to_vec()))
        }
        // Float experts (Qwen3-MoE's bf16, unquantized GPT-OSS) are quantized.
        (FlatFormat::Mxfp4, ExpertMatrices::Rows(_) | ExpertMatrices::Dense(_)) => {
            Ok(quantize_mxfp4(&expert_rows(m, e)?, m.inputs()))
        }
        (FlatFormat::Mxfp4, ExpertMatrices::Int4(_)) => Err(Error::Unsupported(
            "--experts mxfp4 from INT4 experts (convert the original checkpoint)".into(),
        )),
        (FlatFormat::Int4, _) => Ok(quantize_int4(&expert_rows(m, e)?, m.inputs())),
    }
}

/// Record `e` of `layer` in `format` (`index`'s layout, zero padded to its stride), with its
/// FNV-1a hash and, where the index keeps them, its XXH3 one.
fn expert_record(
    layer: &LayerWeights,
    e: usize,
    index: &FlatIndex,
    format: FlatFormat,
) -> Result<(Vec<u8>, u64, Option<u64>)> {
    let mut record = vec![0u8; index.record_stride];
    for (m, p) in [(&layer.gate_up, index.gate_up), (&layer.down, index.down)] {
        let (w, s) = convert_expert(m, e, format)?;
        record[p.weights.offset..p.weights.offset + w.len()].copy_from_slice(&w);
        record[p.scales.offset..p.scales.offset + s.len()].copy_from_slice(&s);
    }
    let bytes = &record[..index.record_bytes];
    let (fnv, xxh3) = (fnv1a64(bytes), index.xxh3.as_ref().map(|_| xxh3_64(bytes)));
    Ok((record, fnv, xxh3))
}

/// What `convert` wrote.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub index: FlatIndex,
    pub dense_tensors: usize,
    pub dense_bytes: u64,
    pub records_bytes: u64,
}

/// Writes `out`: config files, the dense tensors as `model.safetensors`, the expert records and
/// their index. `progress(records_done)` after each record. `out` must be empty or absent.
pub fn convert(
    model_dir: &Path,
    out: &Path,
    format: FlatFormat,
    overwrite: bool,
    progress: &dyn Fn(u64),
) -> Result<ConvertReport> {
    crate::weights::require_dir(model_dir)?;
    if !overwrite {
        crate::synth::require_empty_dir(out)?;
    }
    let cfg = Config::load(model_dir)?;
    let ck = Checkpoint::open(model_dir)?;
    let weights = ModelWeights::load(&ck, &cfg)?;
    // 4-bit formats scale groups of 32 inputs: every row must be whole groups.
    for inputs in [cfg.hidden_size, cfg.intermediate_size] {
        if !inputs.is_multiple_of(32) {
            return Err(Error::Unsupported(format!(
                "--experts {}: an expert input size of {inputs} is not a multiple of 32, which 4-bit experts need",
                format.name()
            )));
        }
    }
    // Written beside `out` and renamed when complete: an interrupted run leaves no `out` to
    // mistake for a store, and its leftovers are removed by the next run.
    let partial = partial_dir(out)?;
    if partial.exists() {
        log::warn!(
            "removing {}: a conversion that did not finish",
            partial.display()
        );
        std::fs::remove_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
    }
    std::fs::create_dir_all(&partial).map_err(|e| Error::io(&partial, e))?;
    let marker = partial.join(PARTIAL_MARKER);
    std::fs::write(
        &marker,
        "picchio convert did not finish writing this directory\n",
    )
    .map_err(|e| Error::io(&marker, e))?;
    let written = write_store(model_dir, &ck, &cfg, &weights, &partial, format, progress);
    let report = match written {
        Ok(report) => report,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&partial);
            return Err(e);
        }
    };
    std::fs::remove_file(&marker).map_err(|e| Error::io(&marker, e))?;
    if overwrite && out.exists() {
        std::fs::remove_dir_all(out).map_err(|e| Error::io(out, e))?;
    }
    std::fs::rename(&partial, out).map_err(|e| Error::io(out, e))?;
    Ok(report)
}

/// Marks a directory `convert` is still writing (`Checkpoint::open` refuses one).
pub const PARTIAL_MARKER: &str = "CONVERTING";

/// Where `convert` writes `out` before renaming it: a hidden sibling.
fn partial_dir(out: &Path) -> Result<PathBuf> {
    let name = out.file_name().ok_or_else(|| {
        Error::InvalidArgument(format!("{} does not name a directory", out.display()))
    })?;
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty());
    let mut hidden = std::ffi::OsString::from(".");
    hidden.push(name);
    hidden.push(".partial");
    Ok(parent.unwrap_or(Path::new(".")).join(hidden))
}

/// Writes the converted store into `out` (an empty directory): config files, the dense tensors,
/// the expert records and their index.
fn write_store(
    model_dir: &Path,
    ck: &Checkpoint,
    cfg: &Config,
    weights: &ModelWeights,
    out: &Path,
    format: FlatFormat,
    progress: &dyn Fn(u64),
) -> Result<ConvertReport> {
    for name in ["config.json", "generation_config.json"] {
        let from = model_dir.join(name);
        if from.exists() {
            let to = out.join(name);
            std::fs::copy(&from, &to).map_err(|e| Error::io(&to, e))?;
        }
    }

    // Dense tensors, byte for byte.
    let mut dense = BTreeMap::new();
    let mut dense_bytes = 0u64;
    for entry in ck
        .tensors()
        .filter(|e| !cfg.family.is_expert_weight(&e.name))
    {
        let bytes = ck.bytes_of(entry);
        dense_bytes += bytes.bytes().len() as u64;
        dense.insert(
            entry.name.clone(),
            (entry.dtype, entry.shape.clone(), bytes),
        );
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = dense
        .iter()
        .map(|(name, (dtype, shape, bytes))| {
            safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes.bytes())
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::Format {
                    path: model_dir.to_path_buf(),
                    message: format!("{name}: {e}"),
                })
        })
        .collect::<Result<_>>()?;
    let dense_path = out.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &dense_path).map_err(|e| Error::Format {
        path: dense_path.clone(),
        message: e.to_string(),
    })?;

    // Expert records.
    let mut index = FlatIndex::layout(format, cfg);
    let records_path = out.join(RECORDS_FILE);
    let file = std::fs::File::create(&records_path).map_err(|e| Error::io(&records_path, e))?;
    let mut writer = std::io::BufWriter::with_capacity(8 << 20, file);
    // Records are built in parallel (quantizing float experts is the slow part), a few per
    // thread at a time to bound the memory, and written in order.
    let batch = 2 * rayon::current_num_threads();
    for layer in &weights.layers {
        for first in (0..cfg.num_experts).step_by(batch) {
            let experts = first..(first + batch).min(cfg.num_experts);
            let records: Vec<(Vec<u8>, u64, Option<u64>)> = experts
                .into_par_iter()
                .map(|e| expert_record(layer, e, &index, format))
                .collect::<Result<_>>()?;
            for (record, fnv, xxh3) in records {
                index.hashes.push(format!("{fnv:016x}"));
                if let (Some(hashes), Some(xxh3)) = (&mut index.xxh3, xxh3) {
                    hashes.push(format!("{xxh3:016x}"));
                }
                writer
                    .write_all(&record)
                    .map_err(|e| Error::io(&records_path, e))?;
                progress(1);
            }
        }
    }
    writer
        .into_inner()
        .map_err(|e| Error::io(&records_path, e.into_error()))?
        .sync_all()
        .map_err(|e| Error::io(&records_path, e))?;
    let index_path = out.join(INDEX_FILE);
    let text = serde_json::to_string_pretty(&index).expect("the index serializes");
    std::fs::write(&index_path, text).map_err(|e| Error::io(&index_path, e))?;
    // safetensors writes through a private temporary file: give the tensors the permissions
    // every other file here got.
    let usual = std::fs::metadata(&records_path)
        .map_err(|e| Error::io(&records_path, e))?
        .permissions();
    std::fs::set_permissions(&dense_path, usual).map_err(|e| Error::io(&dense_path, e))?;
    Ok(ConvertReport {
        records_bytes: (index.hashes.len() * index.record_stride) as u64,
        index,
        dense_tensors: dense.len(),
        dense_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mxfp4_keeps_representable_values_and_rounds_the_rest_to_the_nearest() {
        // A group whose values are E2M1 codes times 2^-3: stored exactly.
        let fp4 = crate::formats::FP4_VALUES;
        let exact: Vec<f32> = (0..32).map(|i| fp4[i % 16] * 0.125).collect();
        let (blocks, scales) = quantize_mxfp4(&exact, 32);
        let mut back = vec![0f32; 32];
        crate::formats::dequantize_mxfp4_row(&blocks, &scales, &mut back);
        for (got, want) in back.iter().zip(&exact) {
            assert_eq!(got, want);
        }
        // max 6 * 2^-3 = 0.75: scale 2^-3; 0.3 / 0.125 = 2.4 rounds to 2, 0.32 -> 2.56 to 3,
        // 0.3125 -> 2.5 (a tie) to 2 (even code 4), -0.8 beyond the top to -6.
        let mut values = vec![0f32; 32];
        values[..5].copy_from_slice(&[0.75, 0.3, 0.32, 0.3125, -0.8]);
        let (blocks, scales) = quantize_mxfp4(&values, 32);
        crate::formats::dequantize_mxfp4_row(&blocks, &scales, &mut back);
        assert_eq!(scales, [124]);
        assert_eq!(&back[..5], &[0.75, 0.25, 0.375, 0.25, -0.75]);
        assert!(back[5..].iter().all(|v| *v == 0.0));
    }

    #[test]
    fn int4_round_trips_within_half_a_step() {
        let values: Vec<f32> = (0..64)
            .map(|i| ((i * 37) % 23) as f32 * 0.1 - 1.1)
            .collect();
        let (packed, scales) = quantize_int4(&values, 64);
        let mut out = vec![0f32; 64];
        for (g, chunk) in out.chunks_exact_mut(32).enumerate() {
            crate::formats::dequantize_int4_row(
                &packed[g * 16..(g + 1) * 16],
                &scales[g * 2..(g + 1) * 2],
                chunk,
            );
        }
        for (got, want) in out.chunks(32).zip(values.chunks(32)) {
            // No worse than the plain max/7 quantizer, whose error is at most half a step.
            let max = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let plain = half::f16::from_f32(max / 7.0).to_f32();
            let plain_sse: f32 = want
                .iter()
                .map(|v| (v - (v / plain).round() * plain).powi(2))
                .sum();
            let sse: f32 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
            assert!(sse <= plain_sse + 1e-6, "{sse} vs {plain_sse}");
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() <= max / 5.0, "{a} vs {b}");
            }
        }
        // All-zero groups stay zero.
        let (packed, _) = quantize_int4(&[0.0; 32], 32);
        assert!(packed.iter().all(|&b| b == 0x88));
    }

    #[test]
    fn fnv_matches_the_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf29ce484222325);
        assert_eq!(fnv1a64(b"a"), 0xaf63dc4c8601ec8c);
    }
}
