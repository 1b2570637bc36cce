//! The GPU tier: wgpu device, shader pipelines, weight upload (split to fit binding limits) and
//! kernels prepared once (pipeline + bind group + workgroup counts) and recorded many times.
//!
//! Kernels are tested against the CPU tier's version of the same op (tests/gpu_kernels.rs).

pub mod context;
pub mod kernels;
pub mod pipelines;

pub use context::{GpuContext, GpuOptions, list_adapters};

use wgpu::util::DeviceExt;

use crate::error::{Error, Result};

/// Usage of every storage buffer picchio creates: readable, writable, copyable both ways.
pub const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

impl GpuContext {
    /// A storage buffer holding `bytes` (padded to a multiple of 4).
    pub fn upload(&self, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        let padded;
        let contents = if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
            bytes
        } else {
            let mut v = bytes.to_vec();
            v.resize(bytes.len().div_ceil(4).max(1) * 4, 0);
            padded = v;
            &padded
        };
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: STORAGE,
            })
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
