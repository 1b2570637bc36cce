//! Helpers shared by the integration tests: fixture discovery, the transformers reference,
//! tolerance comparison, and checkpoint rewriting (to build bad or differently laid-out inputs).

#![allow(dead_code)]

pub mod http;

use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde::Deserialize;

/// `picchio args...`'s stdout, run from the repository's root; the command must succeed (its
/// stderr is the failure message).
pub fn picchio_stdout(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "picchio {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// Where the fixtures are: the committed ones, or those under `$PICCHIO_FIXTURES` when set (e.g.
/// `tools/make_fixtures.py --random N --out DIR`).
fn fixtures_root() -> PathBuf {
    std::env::var_os("PICCHIO_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(fixtures_dir)
}

/// The fixture checkpoints in `dir` (directories with a `reference.json`), sorted.
fn checkpoints_in(dir: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| entries.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    dirs.retain(|p| p.join("reference.json").is_file());
    dirs.sort();
    dirs
}

/// Every GPT-OSS fixture checkpoint.
pub fn fixture_dirs() -> Vec<PathBuf> {
    let dirs = checkpoints_in(&fixtures_root());
    assert!(
        dirs.len() >= 3,
        "expected at least 3 fixtures, found {dirs:?}"
    );
    dirs
}

/// Every Qwen3-MoE fixture checkpoint (`qwen3-moe/` beside the GPT-OSS ones).
pub fn qwen3_fixture_dirs() -> Vec<PathBuf> {
    let dirs = checkpoints_in(&fixtures_root().join("qwen3-moe"));
    assert!(!dirs.is_empty(), "expected Qwen3-MoE fixtures");
    dirs
}

/// Every fixture of every family: what the CPU tier runs.
pub fn every_family_fixture_dirs() -> Vec<PathBuf> {
    [fixture_dirs(), qwen3_fixture_dirs()].concat()
}

#[derive(Debug, Deserialize)]
pub struct ReferenceStep {
    pub top: Vec<(u32, f32)>,
    pub margin: f32,
}

#[derive(Debug, Deserialize)]
pub struct ReferenceLayer {
    pub after_attention: Vec<f32>,
    pub router_ids: Vec<usize>,
    pub router_weights: Vec<f32>,
    pub after_moe: Vec<f32>,
}

/// What transformers computed on a fixture (see tools/make_fixtures.py).
#[derive(Debug, Deserialize)]
pub struct Reference {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub steps: Vec<ReferenceStep>,
    /// Per-layer values at prompt position 0.
    pub layers: Vec<ReferenceLayer>,
    /// Per-layer values at the last prompt position.
    pub layers_last: Vec<ReferenceLayer>,
}

pub fn reference(dir: &Path) -> Reference {
    let text = std::fs::read_to_string(dir.join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Outcome of an elementwise `|got - want| <= atol + rtol * |want|` comparison.
#[derive(Debug)]
pub struct Comparison {
    pub failures: usize,
    pub max_abs_error: f32,
    pub worst_index: usize,
}

#[allow(clippy::neg_cmp_op_on_partial_ord)] // a NaN error must count as a failure
pub fn compare(got: &[f32], want: &[f32], atol: f32, rtol: f32) -> Comparison {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let mut c = Comparison {
        failures: 0,
        max_abs_error: 0.0,
        worst_index: 0,
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs();
        if !(err <= atol + rtol * w.abs()) {
            c.failures += 1;
        }
        if !(err <= c.max_abs_error) {
            c.max_abs_error = err;
            c.worst_index = i;
        }
    }
    c
}

/// Asserts a comparison passed, reporting count, max error and where.
pub fn assert_close(what: &str, got: &[f32], want: &[f32], atol: f32, rtol: f32) -> Comparison {
    let c = compare(got, want, atol, rtol);
    assert_eq!(
        c.failures,
        0,
        "{what}: {} of {} values outside atol {atol} + rtol {rtol}; max |error| {} at index {} (got {}, want {})",
        c.failures,
        got.len(),
        c.max_abs_error,
        c.worst_index,
        got[c.worst_index],
        want[c.worst_index]
    );
    c
}

/// One tensor of a checkpoint being rewritten.
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// Reads every tensor of a checkpoint directory (all shards), in name order.
pub fn read_tensors(dir: &Path) -> Vec<Tensor> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("safetensors") {
            continue;
        }
        let bytes = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            out.push(Tensor {
                name,
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                data: view.data().to_vec(),
            });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn serialize(tensors: &[Tensor]) -> Vec<u8> {
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                TensorView::new(t.dtype, t.shape.clone(), &t.data).unwrap(),
            )
        })
        .collect();
    safetensors::serialize(views, None).unwrap()
}

/// Writes `tensors` into `dir` as `file_names.len()` shards (round-robin), with an index when
/// `with_index`; copies `config.json` from `config_from`.
pub fn write_checkpoint(
    dir: &Path,
    config_from: &Path,
    tensors: &[Tensor],
    file_names: &[&str],
    with_index: bool,
) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(config_from.join("config.json"), dir.join("config.json")).unwrap();
    let mut weight_map = serde_json::Map::new();
    for (s, file) in file_names.iter().enumerate() {
        let part: Vec<Tensor> = tensors
            .iter()
            .enumerate()
            .filter(|(i, _)| i % file_names.len() == s)
            .map(|(_, t)| Tensor {
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                data: t.data.clone(),
            })
            .collect();
        for t in &part {
            weight_map.insert(t.name.clone(), serde_json::Value::String(file.to_string()));
        }
        std::fs::write(dir.join(file), serialize(&part)).unwrap();
    }
    if with_index {
        let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    }
}

/// A copy of a fixture with its tensors passed through `edit` (which may drop, change or add).
pub fn rewritten_fixture(src: &Path, edit: impl FnOnce(&mut Vec<Tensor>)) -> tempfile::TempDir {
    let mut tensors = read_tensors(src);
    edit(&mut tensors);
    let dir = tempfile::tempdir().unwrap();
    write_checkpoint(dir.path(), src, &tensors, &["model.safetensors"], false);
    dir
}

pub fn bf16_to_f32_bytes(data: &[u8]) -> Vec<u8> {
    data.chunks_exact(2)
        .flat_map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16).to_le_bytes())
        .collect()
}

/// The `--backend` values the binary tests run with: cpu, and gpu where there is one (`gpu`).
pub fn backends() -> Vec<&'static str> {
    let mut backends = vec!["cpu"];
    if gpu(None).is_some() {
        backends.push("gpu");
    }
    backends
}

/// Sends `signal` (a name such as INT or TERM) to `child` with kill(1).
#[cfg(unix)]
pub fn send_signal(child: &std::process::Child, signal: &str) {
    let sent = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{signal} {}", child.id());
}

/// The GPU for GPU tests, or None (with the reason printed) when there is none and CI did not ask
/// for one: `PICCHIO_REQUIRE_GPU=1` (set by .ci/run) turns a missing adapter into a failure, and
/// `PICCHIO_EXPECT_BACKEND` pins the wgpu backend.
pub fn gpu(max_binding_bytes: Option<u64>) -> Option<picchio::gpu::GpuContext> {
    let mut options = picchio::gpu::GpuOptions::from_env();
    options.max_binding_bytes = max_binding_bytes;
    gpu_with(&options)
}

/// The GPU as `gpu` gives it, then, where it reduces with subgroups, the same adapter without:
/// the kernel table runs its cases on both.
pub fn gpu_variants(max_binding_bytes: Option<u64>) -> Vec<picchio::gpu::GpuContext> {
    let Some(first) = gpu(max_binding_bytes) else {
        return Vec::new();
    };
    let mut variants = Vec::new();
    if first.subgroup_min.is_some() {
        let mut options = picchio::gpu::GpuOptions::from_env();
        options.max_binding_bytes = max_binding_bytes;
        options.without_subgroups = true;
        variants.extend(gpu_with(&options));
    }
    variants.insert(0, first);
    variants
}

fn gpu_with(options: &picchio::gpu::GpuOptions) -> Option<picchio::gpu::GpuContext> {
    let required = std::env::var("PICCHIO_REQUIRE_GPU").is_ok_and(|v| v == "1");
    match picchio::gpu::GpuContext::new(options) {
        Ok(ctx) => {
            eprintln!(
                "GPU adapter: {} ({}, {}), reductions: {}",
                ctx.adapter.name,
                ctx.adapter.backend,
                ctx.adapter.device_type,
                ctx.subgroup_min
                    .map_or("workgroup memory".into(), |n| format!("subgroups of {n}+"))
            );
            if let Ok(expected) = std::env::var("PICCHIO_EXPECT_BACKEND") {
                assert_eq!(ctx.adapter.backend, expected, "wrong wgpu backend");
            }
            Some(ctx)
        }
        Err(e) if !required => {
            eprintln!("no GPU, GPU test skipped: {e}");
            None
        }
        Err(e) => panic!("PICCHIO_REQUIRE_GPU=1 but: {e}"),
    }
}

/// GPU tier options for tests: 4096 positions, the top 10 logits read back.
pub fn gpu_options() -> picchio::model::gpu_tier::GpuTierOptions {
    picchio::model::gpu_tier::GpuTierOptions {
        context: 4096,
        top_logits: 10,
        ..Default::default()
    }
}

/// The GPU tier over `model` with `options`, or None when there is no GPU (as `gpu` decides).
pub fn gpu_session(
    model: &picchio::Model,
    options: picchio::model::gpu_tier::GpuTierOptions,
) -> Option<picchio::model::gpu_tier::GpuModel<'_>> {
    let ctx = gpu(None)?;
    Some(picchio::model::gpu_tier::GpuModel::new(ctx, model, options).unwrap())
}

/// Greedy decoding of `max_new_tokens` with EOS ignored and the top 10 logits reported.
pub fn greedy_options(max_new_tokens: usize) -> picchio::model::generate::GenerateOptions {
    picchio::model::generate::GenerateOptions {
        max_new_tokens,
        top_logits: 10,
        stop_at_eos: false,
        context: 4096,
    }
}

/// A private copy of a committed fixture (its checkpoint files only: no usage file or other
/// state a run may have left beside it).
pub fn copy_fixture(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixtures_dir().join(name)).unwrap() {
        let path = entry.unwrap().path();
        let file_name = path.file_name().unwrap();
        if !file_name.to_string_lossy().starts_with('.') {
            std::fs::copy(&path, dir.path().join(file_name)).unwrap();
        }
    }
    dir
}
