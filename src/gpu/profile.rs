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
    /// The kernel each stamped pair belongs to, in this submission.
    pending: Vec<String>,
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
        label: &str,
    ) -> wgpu::ComputePass<'e> {
        let index = self.pending.len() as u32;
        if index >= CAPACITY {
            self.profile.unstamped += 1;
            return encoder.begin_compute_pass(&Default::default());
        }
        self.pending.push(label.to_string());
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
        for (label, pair) in self.pending.drain(..).zip(stamps.chunks_exact(2)) {
            let kernel = self.profile.kernels.entry(label).or_default();
            kernel.calls += 1;
            kernel.ns += pair[1].saturating_sub(pair[0]) as f64 * self.period_ns;
        }
        Ok(())
    }
}
