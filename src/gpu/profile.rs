//! Per-kernel GPU time from timestamp queries (`generate --profile`): each profiled dispatch
//! runs in a compute pass of its own whose start and end the device stamps; after the
//! submission the stamps are read back and summed by kernel.
//!
//! Profiling changes how work is recorded (a pass per dispatch, a readback per submission), so
//! its totals are for comparing kernels with each other, not for tokens per second.

use std::collections::BTreeMap;

use super::GpuContext;
use crate::error::{Error, Result};

/// Most dispatches stamped per submission (two queries each; wgpu allows 4096 per set).
const CAPACITY: u32 = 2048;

/// Calls and device time of one kernel, summed.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct KernelTime {
    pub calls: u64,
    pub ns: f64,
    /// What the calls moved at least (`Dispatch::bytes`; 0 where not estimated).
    pub bytes: u64,
}

/// Per-kernel totals (by `file:entry`), cumulative like the GPU counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuProfile {
    pub kernels: BTreeMap<String, KernelTime>,
    /// Dispatches recorded without stamps (past `CAPACITY` in one submission).
    pub unstamped: u64,
}

impl GpuProfile {
    /// What was added since `earlier` (a snapshot of the same profile).
    pub fn since(&self, earlier: &GpuProfile) -> GpuProfile {
        let kernels = (self.kernels.iter())
            .map(|(label, now)| {
                let before = earlier.kernels.get(label).copied().unwrap_or_default();
                let time = KernelTime {
                    calls: now.calls - before.calls,
                    ns: now.ns - before.ns,
                    bytes: now.bytes - before.bytes,
                };
                (label.clone(), time)
            })
            .filter(|(_, time)| time.calls > 0)
            .collect();
        GpuProfile {
            kernels,
            unstamped: self.unstamped - earlier.unstamped,
        }
    }

    pub fn total_ns(&self) -> f64 {
        self.kernels.values().map(|k| k.ns).sum()
    }
}

/// Stamps dispatches and sums their device time.
pub struct Profiler {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    /// The kernel each stamped pair belongs to, and the bytes its dispatch moves, in this
    /// submission.
    pending: Vec<(String, u64)>,
    /// Nanoseconds per timestamp tick.
    period_ns: f64,
    pub profile: GpuProfile,
}

impl Profiler {
    /// A profiler on `ctx`, or why there cannot be one.
    pub fn new(ctx: &GpuContext) -> Result<Profiler> {
        if !ctx.timestamps {
            return Err(Error::Gpu(format!(
                "--profile needs timestamp queries, which {} does not offer",
                ctx.adapter.name
            )));
        }
        let queries = ctx.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("profile"),
            ty: wgpu::QueryType::Timestamp,
            count: 2 * CAPACITY,
        });
        let resolved = ctx.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("profile stamps"),
            size: 2 * CAPACITY as u64 * 8,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Ok(Profiler {
            queries,
            resolved,
            pending: Vec::new(),
            period_ns: ctx.queue.get_timestamp_period() as f64,
            profile: GpuProfile::default(),
        })
    }

    /// A compute pass for one dispatch of `label`, stamped at its start and end while this
    /// submission has room (else unstamped, and counted as such).
    pub fn pass<'e>(
        &mut self,
        encoder: &'e mut wgpu::CommandEncoder,
        (label, bytes): (&str, u64),
    ) -> wgpu::ComputePass<'e> {
        let index = self.pending.len() as u32;
        if index >= CAPACITY {
            self.profile.unstamped += 1;
            return encoder.begin_compute_pass(&Default::default());
        }
        self.pending.push((label.to_string(), bytes));
        encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: None,
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: &self.queries,
                beginning_of_pass_write_index: Some(2 * index),
                end_of_pass_write_index: Some(2 * index + 1),
            }),
        })
    }

    /// Resolves this submission's stamps into a buffer; call last in the encoder.
    pub fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        if !self.pending.is_empty() {
            let count = 2 * self.pending.len() as u32;
            encoder.resolve_query_set(&self.queries, 0..count, &self.resolved, 0);
        }
    }

    /// After the submission: reads the stamps back (waiting for the device) and adds each
    /// dispatch's time to its kernel.
    pub fn collect(&mut self, ctx: &GpuContext) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let bytes = ctx.read_back(&self.resolved, self.pending.len() as u64 * 16)?;
        let stamps: Vec<u64> = bytemuck::pod_collect_to_vec(&bytes);
        for ((label, bytes), pair) in self.pending.drain(..).zip(stamps.chunks_exact(2)) {
            let kernel = self.profile.kernels.entry(label).or_default();
            kernel.calls += 1;
            kernel.bytes += bytes;
            kernel.ns += pair[1].saturating_sub(pair[0]) as f64 * self.period_ns;
        }
        Ok(())
    }
}

/// One kernel's share of a decoded token on the GPU (`generate --profile`, `bench --profile`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct KernelRow {
    pub kernel: String,
    pub calls_per_token: f64,
    pub ms_per_token: f64,
    /// Of the device time every stamped kernel took.
    pub share: f64,
    /// What the kernel moved per token at least (weights once, inputs, outputs); null where not
    /// estimated (attention, whose cache reads grow with the position).
    pub mb_per_token: Option<f64>,
    /// `mb_per_token` over `ms_per_token`.
    pub gb_per_s: Option<f64>,
}

/// The decode phase's per-kernel times from the profiles at the end of the prefill and of the
/// run (the whole run's when nothing was decoded), busiest first; None without a GPU profile.
pub fn decode_profile(profiles: &[Option<GpuProfile>], decoded: usize) -> Option<Vec<KernelRow>> {
    let (profile, tokens) = match profiles {
        [Some(prefill), Some(end)] if decoded > 0 => (end.since(prefill), decoded),
        [.., Some(last)] => (last.clone(), 1),
        _ => return None,
    };
    if profile.unstamped > 0 {
        log::warn!("--profile: {} dispatches were not timed", profile.unstamped);
    }
    let total = profile.total_ns().max(f64::MIN_POSITIVE);
    let tokens = tokens as f64;
    let mut rows: Vec<KernelRow> = (profile.kernels.iter())
        .map(|(kernel, time)| {
            let moved = (time.bytes > 0).then_some(time.bytes as f64);
            KernelRow {
                kernel: kernel.clone(),
                calls_per_token: time.calls as f64 / tokens,
                ms_per_token: time.ns / 1e6 / tokens,
                share: time.ns / total,
                mb_per_token: moved.map(|b| b / 1e6 / tokens),
                gb_per_s: moved.map(|b| b / time.ns.max(f64::MIN_POSITIVE)),
            }
        })
        .collect();
    rows.sort_by(|a, b| b.ms_per_token.total_cmp(&a.ms_per_token));
    Some(rows)
}

/// The profile as a table on stderr (stdout keeps the ids).
pub fn print_profile(rows: &[KernelRow]) {
    eprintln!(
        "{:<34} {:>10} {:>12} {:>7} {:>10} {:>8}",
        "kernel", "calls/tok", "ms/token", "share", "MB/token", "GB/s"
    );
    let or_dash = |v: Option<f64>, precision: usize| {
        v.map_or("-".to_string(), |v| format!("{v:.precision$}"))
    };
    for row in rows {
        eprintln!(
            "{:<34} {:>10.1} {:>12.3} {:>6.1}% {:>10} {:>8}",
            row.kernel,
            row.calls_per_token,
            row.ms_per_token,
            100.0 * row.share,
            or_dash(row.mb_per_token, 1),
            or_dash(row.gb_per_s, 1)
        );
    }
    let total: f64 = rows.iter().map(|r| r.ms_per_token).sum();
    eprintln!("{:<34} {:>10} {:>12.3}", "all kernels", "", total);
}
