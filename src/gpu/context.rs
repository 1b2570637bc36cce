//! wgpu instance, adapter choice and device creation with the adapter's real limits.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use wgpu::{Backends, DeviceType};

use super::pipelines::PipelineCache;
use crate::error::{Error, Result};

/// Set to `1` to let picchio run on a software adapter (lavapipe, WARP) when no GPU is present.
pub const ALLOW_SOFTWARE_ENV: &str = "PICCHIO_GPU_ALLOW_SOFTWARE";

/// Set to `0` to keep the kernels off subgroup operations.
pub const SUBGROUPS_ENV: &str = "PICCHIO_GPU_SUBGROUPS";

/// How to pick and configure the device.
#[derive(Debug, Clone, Default)]
pub struct GpuOptions {
    /// Accept a CPU-emulated adapter when there is nothing better.
    pub allow_software: bool,
    /// Bind at most this many bytes per storage buffer (below the adapter's limit): tests use it to
    /// force tensor splitting on small tensors.
    pub max_binding_bytes: Option<u64>,
    /// Reduce in workgroup memory only, even where the adapter has subgroup operations (tests
    /// compare both; `PICCHIO_GPU_SUBGROUPS=0` sets it).
    pub without_subgroups: bool,
}

impl GpuOptions {
    /// Defaults, with `allow_software` taken from `PICCHIO_GPU_ALLOW_SOFTWARE`.
    pub fn from_env() -> GpuOptions {
        GpuOptions {
            allow_software: std::env::var(ALLOW_SOFTWARE_ENV).is_ok_and(|v| v == "1"),
            max_binding_bytes: None,
            without_subgroups: std::env::var(SUBGROUPS_ENV).is_ok_and(|v| v == "0"),
        }
    }
}

/// What `picchio devices` shows of one adapter.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AdapterReport {
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub driver_info: String,
    pub max_storage_buffer_binding_size: u64,
    pub max_buffer_size: u64,
    pub max_storage_buffers_per_shader_stage: u32,
    pub max_compute_workgroup_storage_size: u32,
    pub max_compute_invocations_per_workgroup: u32,
    pub shader_f16: bool,
    pub subgroup: bool,
    pub subgroup_sizes: (u32, u32),
    pub timestamp_query: bool,
}

fn report(adapter: &wgpu::Adapter) -> AdapterReport {
    let info = adapter.get_info();
    let limits = adapter.limits();
    let features = adapter.features();
    AdapterReport {
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: info.driver,
        driver_info: info.driver_info,
        max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
        max_buffer_size: limits.max_buffer_size,
        max_storage_buffers_per_shader_stage: limits.max_storage_buffers_per_shader_stage,
        max_compute_workgroup_storage_size: limits.max_compute_workgroup_storage_size,
        max_compute_invocations_per_workgroup: limits.max_compute_invocations_per_workgroup,
        shader_f16: features.contains(wgpu::Features::SHADER_F16),
        subgroup: features.contains(wgpu::Features::SUBGROUP),
        subgroup_sizes: (info.subgroup_min_size, info.subgroup_max_size),
        timestamp_query: features.contains(wgpu::Features::TIMESTAMP_QUERY),
    }
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    // Only the native compute backends: never a silent fallback to GL.
    desc.backends = Backends::VULKAN | Backends::METAL | Backends::DX12;
    // Where the driver reports a memory budget (DX12, Vulkan with VK_EXT_memory_budget), buffer
    // creation fails with an out-of-memory error near it instead of thrashing or losing the device.
    desc.memory_budget_thresholds.for_resource_creation = Some(90);
    wgpu::Instance::new(desc)
}

/// Every adapter wgpu finds, best first.
pub fn list_adapters() -> Vec<AdapterReport> {
    let mut adapters = pollster::block_on(instance().enumerate_adapters(Backends::all()));
    adapters.sort_by_key(|a| preference(a.get_info().device_type));
    adapters.iter().map(report).collect()
}

/// Lower is better: discrete, integrated, virtual, other, then CPU emulation.
fn preference(kind: DeviceType) -> u8 {
    match kind {
        DeviceType::DiscreteGpu => 0,
        DeviceType::IntegratedGpu => 1,
        DeviceType::VirtualGpu => 2,
        DeviceType::Other => 3,
        DeviceType::Cpu => 4,
    }
}

/// A device ready for picchio's kernels.
pub struct GpuContext {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub adapter: AdapterReport,
    /// Bytes one storage binding may cover (tensors larger than this are split).
    pub max_binding_bytes: u64,
    pub max_buffer_bytes: u64,
    pub max_workgroups_per_dimension: u32,
    pub pipelines: PipelineCache,
    /// What weight uploads have queued (`upload`).
    pub uploads: super::UploadMeter,
    lost: Arc<AtomicBool>,
    /// Expert uploads still allowed before an injected fault (`u64::MAX`: no fault).
    expert_uploads_before_fault: AtomicU64,
    /// Whether the device stamps compute passes (`gpu::profile`).
    pub timestamps: bool,
    /// The smallest subgroup size, where the kernels reduce with subgroup operations.
    pub subgroup_min: Option<u32>,
}

impl GpuContext {
    pub fn new(options: &GpuOptions) -> Result<GpuContext> {
        let instance = instance();
        let mut adapters = pollster::block_on(instance.enumerate_adapters(Backends::all()));
        adapters.sort_by_key(|a| preference(a.get_info().device_type));
        let found: Vec<String> = adapters.iter().map(|a| a.get_info().name).collect();
        let adapter = adapters
            .into_iter()
            .find(|a| options.allow_software || a.get_info().device_type != DeviceType::Cpu)
            .ok_or_else(|| {
                Error::Gpu(if found.is_empty() {
                    "no Vulkan, Metal or DX12 adapter found".to_string()
                } else {
                    format!(
                        "only software adapters found ({}); set {ALLOW_SOFTWARE_ENV}=1 to use them",
                        found.join(", ")
                    )
                })
            })?;
        let adapter_report = report(&adapter);
        let limits = adapter.limits();
        // Timestamps cost nothing until a profile asks for them.
        let mut wanted = wgpu::Features::TIMESTAMP_QUERY;
        if !options.without_subgroups {
            wanted |= wgpu::Features::SUBGROUP;
        }
        let features = adapter.features() & wanted;
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("picchio"),
            required_features: features,
            // The adapter's real limits: the defaults (128-256 MiB bindings) are far too small.
            required_limits: limits.clone(),
            experimental_features: wgpu::ExperimentalFeatures::disabled(),
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| {
            Error::Gpu(format!(
                "{}: cannot create a device: {e}",
                adapter_report.name
            ))
        })?;
        let lost = Arc::new(AtomicBool::new(false));
        let flag = lost.clone();
        device.set_device_lost_callback(move |reason, message| {
            log::warn!("GPU device lost ({reason:?}): {message}");
            flag.store(true, Ordering::SeqCst);
        });
        // Binding sizes must stay multiples of 4 (u32 arrays) and of the offset alignment.
        let align = limits.min_storage_buffer_offset_alignment as u64;
        let mut max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        if let Some(cap) = options.max_binding_bytes {
            max_binding = max_binding.min(cap);
        }
        // The shaders index bindings with u32 element offsets.
        max_binding = max_binding.min(u32::MAX as u64);
        max_binding -= max_binding % align.max(4);
        log::info!(
            "GPU: {} ({}, {}), binding limit {} MiB",
            adapter_report.name,
            adapter_report.backend,
            adapter_report.device_type,
            max_binding >> 20
        );
        let mut ctx = GpuContext {
            pipelines: PipelineCache::default(),
            uploads: Default::default(),
            device,
            queue,
            adapter: adapter_report,
            max_binding_bytes: max_binding,
            max_buffer_bytes: limits.max_buffer_size,
            max_workgroups_per_dimension: limits.max_compute_workgroups_per_dimension,
            lost,
            expert_uploads_before_fault: AtomicU64::new(u64::MAX),
            timestamps: features.contains(wgpu::Features::TIMESTAMP_QUERY),
            subgroup_min: None,
        };
        if features.contains(wgpu::Features::SUBGROUP) {
            ctx.subgroup_min = ctx.probe_subgroups();
        }
        Ok(ctx)
    }

    /// The adapter's smallest subgroup size, where its subgroups are runs of consecutive lanes
    /// whose shuffles work, as a probe kernel checks (reduce.wgsl relies on both); else None,
    /// and the kernels reduce in workgroup memory.
    fn probe_subgroups(&self) -> Option<u32> {
        let smallest = self.adapter.subgroup_sizes.0;
        let probe = || -> Result<bool> {
            let ok = self.zeroed("subgroup probe", 64 * 4)?;
            let dispatch = self.prepare(
                "subgroup_probe.wgsl",
                "probe",
                &[],
                &[0; 4],
                &[&ok],
                [1, 1, 1],
            )?;
            self.run(&[&dispatch])?;
            let lanes: Vec<u32> = bytemuck::pod_collect_to_vec(&self.read_back(&ok, 64 * 4)?);
            Ok(lanes.iter().all(|lane| *lane == 1))
        };
        match probe() {
            Ok(true) if smallest.is_power_of_two() => Some(smallest),
            Ok(_) => {
                log::info!("GPU: subgroups are not runs of consecutive lanes here; not using them");
                None
            }
            Err(e) => {
                log::info!("GPU: the subgroup probe failed ({e}); not using subgroups");
                None
            }
        }
    }

    /// True once the driver reported the device lost.
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Makes every expert upload after the next `n` fail as a failed copy to the device would,
    /// for fault-injection tests (`u64::MAX` turns faults off again).
    #[doc(hidden)]
    pub fn fail_expert_uploads_after(&self, n: u64) {
        self.expert_uploads_before_fault.store(n, Ordering::SeqCst);
    }

    /// Counts one expert upload into a cache slot: an error once an injected fault is due.
    pub(crate) fn count_expert_upload(&self) -> Result<()> {
        let left = &self.expert_uploads_before_fault;
        let counted = left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
            0 | u64::MAX => None,
            n => Some(n - 1),
        });
        match counted {
            Err(0) => Err(Error::Gpu(
                "copying an expert into VRAM failed (injected fault)".into(),
            )),
            _ => Ok(()),
        }
    }

    /// Waits for all submitted work.
    pub fn wait(&self) -> Result<()> {
        self.guard(|| {
            self.device
                .poll(wgpu::PollType::wait_indefinitely())
                .map(|_| ())
                .map_err(|e| Error::Gpu(format!("waiting for the device: {e}")))
        })
    }

    /// Runs a device operation; a device already lost, or one that wgpu treats as fatal (it panics
    /// on some driver failures, device loss among them), becomes an error so the caller can fall
    /// back to the CPU tier.
    pub fn guard<T>(&self, operation: impl FnOnce() -> Result<T>) -> Result<T> {
        if self.is_lost() {
            return Err(Error::Gpu("the GPU device was lost".into()));
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(operation)) {
            Ok(result) => result,
            Err(panic) => {
                self.lost.store(true, Ordering::SeqCst);
                let what = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("unknown failure");
                Err(Error::Gpu(format!("the GPU device failed: {what}")))
            }
        }
    }
}
