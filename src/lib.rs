//! picchio: an inference engine for mixture-of-experts language models (GPT-OSS).
//!
//! Layers of the crate, from the files up:
//! - [`config`]: `config.json` mirrored with serde, every dimension read from it.
//! - [`arch`]: model families as data: what each decoder layer computes.
//! - [`weights`]: safetensors checkpoints (single or sharded) mapped with memmap2, L0 validation.
//! - [`formats`]: decoding of the storage formats (bf16, f16, MXFP4, INT4) into f32.
//! - [`cpu`]: the CPU tier's kernels, the reference for every other tier.
//! - [`gpu`]: the GPU tier's device, pipelines and kernels (wgpu + WGSL).
//! - [`model`]: the forward passes (CPU and GPU tiers), KV cache, sampler and generation loop.
//! - [`experts`]: the expert store (disk -> RAM LRU, read by IO threads).
//! - [`flat_store`]: converted expert stores (`picchio convert`): aligned records, MXFP4 or INT4.
//! - [`synth`]: random checkpoints in the real layout, for benchmarks.

pub mod arch;
pub mod bench;
pub mod chat;
pub mod config;
pub mod cpu;
pub mod error;
pub mod experts;
pub mod flat_store;
pub mod formats;
pub mod gpu;
pub mod model;
pub mod pages;
pub mod random;
pub mod serve;
pub mod synth;
pub mod weights;

pub use config::Config;
pub use error::{Error, Result};
pub use model::Model;
