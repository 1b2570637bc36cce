//! The GPU tier: wgpu device, shader pipelines, weight upload (split to fit binding limits) and
//! kernels prepared once (pipeline + bind group + workgroup counts) and recorded many times.
//!
//! Kernels are tested against the CPU tier's version of the same op (tests/gpu_kernels.rs).

pub mod attention;
pub mod bandwidth;
pub mod context;
pub mod kernels;
pub mod pipelines;
pub mod profile;

pub use context::{GpuContext, GpuOptions, list_adapters};

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use wgpu::util::DeviceExt;

use crate::error::{Error, Result};

/// Usage of every storage buffer picchio creates: readable, writable, copyable both ways.
pub const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Bytes of uploads queued before the device must take them: wgpu keeps a host staging copy of
/// each queued write until the submission carrying it completes, so without a bound a model's
/// load would hold a second copy of every weight in host memory.
pub const STAGING_LIMIT_BYTES: u64 = 256 << 20;

/// Largest single queued write of an upload.
const UPLOAD_PIECE_BYTES: usize = 64 << 20;

/// What uploads have queued: bytes since the device last took them, the most ever queued at
/// once, the total, and a progress bar while a model loads.
#[derive(Default)]
pub struct UploadMeter {
    staged: AtomicU64,
    peak: AtomicU64,
    total: AtomicU64,
    progress: Mutex<Option<indicatif::ProgressBar>>,
}

impl UploadMeter {
    /// Most bytes queued at once so far.
    pub fn peak_staged_bytes(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Bytes uploaded so far.
    pub fn total_bytes(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

impl GpuContext {
    /// A storage buffer holding `bytes` (padded to a multiple of 4), written in pieces with the
    /// host's staging copies bounded by `STAGING_LIMIT_BYTES`. Where the device is out of
    /// memory, wgpu reports it to the current error scope (or its handler).
    pub fn upload(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        let buffer = self.storage_buffer(label, bytes.len());
        self.write_pieces(&buffer, bytes);
        buffer
    }

    /// `upload`, failing with a clear error (and writing nothing) where the buffer does not fit
    /// in the device's memory: what loading a model uses, so that a budget of `auto` can try
    /// fewer experts.
    pub fn try_upload(&self, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.storage_buffer(label, bytes.len());
        if let Some(error) = pollster::block_on(scope.pop()) {
            return Err(Error::Gpu(format!(
                "{label} ({} bytes) does not fit in GPU memory: {error}",
                bytes.len()
            )));
        }
        self.write_pieces(&buffer, bytes);
        Ok(buffer)
    }

    pub fn try_upload_f32(&self, label: &str, values: &[f32]) -> Result<wgpu::Buffer> {
        self.try_upload(label, bytemuck::cast_slice(values))
    }

    /// An unwritten storage buffer for `len` bytes (padded to a multiple of 4, at least 4).
    fn storage_buffer(&self, label: &str, len: usize) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (len.div_ceil(4).max(1) * 4) as u64,
            usage: STORAGE,
            mapped_at_creation: false,
        })
    }

    /// Queues `bytes` into `buffer` from its start, in pieces.
    fn write_pieces(&self, buffer: &wgpu::Buffer, bytes: &[u8]) {
        let mut offset = 0;
        for piece in bytes.chunks(UPLOAD_PIECE_BYTES) {
            self.stage(piece.len() as u64);
            if piece.len().is_multiple_of(4) {
                self.queue.write_buffer(buffer, offset, piece);
            } else {
                // The last piece only: the queue writes whole words.
                let mut padded = piece.to_vec();
                padded.resize(piece.len().div_ceil(4) * 4, 0);
                self.queue.write_buffer(buffer, offset, &padded);
            }
            offset += piece.len() as u64;
        }
    }

    /// Counts `bytes` about to be queued, first letting the device take what is queued when they
    /// would pass the staging limit.
    fn stage(&self, bytes: u64) {
        let meter = &self.uploads;
        let staged = meter.staged.load(Ordering::Relaxed);
        if staged > 0 && staged + bytes > STAGING_LIMIT_BYTES {
            self.flush_uploads();
        }
        let staged = meter.staged.fetch_add(bytes, Ordering::Relaxed) + bytes;
        meter.peak.fetch_max(staged, Ordering::Relaxed);
        meter.total.fetch_add(bytes, Ordering::Relaxed);
        if let Some(bar) = &*meter.progress.lock().unwrap() {
            bar.inc(bytes);
        }
    }

    /// Submits the queued uploads and waits until the device took them (their staging copies are
    /// freed then).
    pub fn flush_uploads(&self) {
        self.queue.submit([]);
        if let Err(e) = self.device.poll(wgpu::PollType::wait_indefinitely()) {
            log::warn!("waiting for uploads: {e}");
        }
        self.uploads.staged.store(0, Ordering::Relaxed);
    }

    /// Shows a progress bar (on a terminal) over the next `bytes` of uploads, until
    /// `end_progress`.
    pub fn start_progress(&self, what: &str, bytes: u64) {
        let bar = indicatif::ProgressBar::new(bytes);
        bar.set_style(
            indicatif::ProgressStyle::with_template("{msg} {bar:40} {bytes}/{total_bytes} {eta}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(what.to_string());
        *self.uploads.progress.lock().unwrap() = Some(bar);
    }

    pub fn end_progress(&self) {
        if let Some(bar) = self.uploads.progress.lock().unwrap().take() {
            bar.finish_and_clear();
        }
    }

    pub fn upload_f32(&self, label: &str, values: &[f32]) -> wgpu::Buffer {
        self.upload(label, bytemuck::cast_slice(values))
    }

    /// A zeroed storage buffer of `bytes` bytes (at least 4).
    pub fn zeroed(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).div_ceil(4) * 4;
        // Every buffer made here is bound whole to a kernel.
        if size > self.max_binding_bytes {
            return Err(Error::Gpu(format!(
                "{label}: {size} bytes exceed what one binding may cover on this adapter ({} bytes)",
                self.max_binding_bytes
            )));
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: STORAGE,
            mapped_at_creation: false,
        }))
    }

    pub fn uniform(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents: bytes,
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            })
    }

    /// Copies `bytes` bytes from the start of `buffer` to the host (one submission, one wait).
    pub fn read_back(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        let size = bytes.div_ceil(4) * 4;
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, size);
        self.queue.submit([encoder.finish()]);
        let (sender, receiver) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = sender.send(r);
        });
        self.wait()?;
        receiver
            .recv()
            .map_err(|_| Error::Gpu("readback never completed".into()))?
            .map_err(|e| Error::Gpu(format!("readback failed: {e}")))?;
        let view = staging
            .get_mapped_range(..)
            .map_err(|e| Error::Gpu(format!("readback mapping: {e}")))?;
        let out = view[..bytes as usize].to_vec();
        drop(view);
        staging.unmap();
        Ok(out)
    }

    pub fn read_f32(&self, buffer: &wgpu::Buffer, count: usize) -> Result<Vec<f32>> {
        let bytes = self.read_back(buffer, (count * 4) as u64)?;
        Ok(bytemuck::pod_collect_to_vec(&bytes))
    }

    /// Records `dispatches` into one compute pass of a new encoder and submits it.
    pub fn run(&self, dispatches: &[&kernels::Dispatch]) -> Result<()> {
        let mut encoder = self.device.create_command_encoder(&Default::default());
        {
            let mut pass = encoder.begin_compute_pass(&Default::default());
            for d in dispatches {
                d.record(&mut pass);
            }
        }
        self.queue.submit([encoder.finish()]);
        self.wait()
    }
}
