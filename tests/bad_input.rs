//! Bad input is rejected with a message naming the problem and a non-zero exit, never a panic.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use safetensors::Dtype;

/// Runs `picchio args...`; returns (success, stdout, stderr).
fn picchio(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_picchio"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `generate` on `dir` must fail cleanly with every `needles` in its message.
fn rejects(dir: &Path, ids: &str, extra: &[&str], needles: &[&str]) {
    let dir = dir.to_str().unwrap();
    let mut args = vec![
        "generate",
        "--model",
        dir,
        "--ids",
        ids,
        "--max-new-tokens",
        "2",
    ];
    args.extend_from_slice(extra);
    let (ok, stdout, stderr) = picchio(&args);
    assert!(!ok, "expected failure for {args:?}, got stdout {stdout}");
    assert!(!stderr.contains("panicked"), "panic for {args:?}: {stderr}");
    assert!(stdout.is_empty(), "nothing on stdout on failure: {stdout}");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: expected {needle:?} in: {stderr}"
        );
    }
}

#[test]
fn missing_model_directory() {
    rejects(
        Path::new("/nonexistent/model"),
        "1,2",
        &[],
        &["/nonexistent/model", "not found"],
    );
}

#[test]
fn unparsable_config() {
    let dir = copy_fixture("tiny-single");
    std::fs::write(dir.path().join("config.json"), "{\"hidden_size\": 64,").unwrap();
    rejects(dir.path(), "1,2", &[], &["config.json", "invalid config"]);
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    rejects(dir.path(), "1,2", &[], &["config.json"]);
}

#[test]
fn garbage_safetensors() {
    let dir = copy_fixture("tiny-single");
    std::fs::write(
        dir.path().join("model.safetensors"),
        b"this is not a checkpoint at all",
    )
    .unwrap();
    rejects(
        dir.path(),
        "1,2",
        &[],
        &["model.safetensors", "not a valid safetensors file"],
    );
}

#[test]
fn truncated_safetensors() {
    let dir = copy_fixture("tiny-sharded");
    let shard = dir.path().join("model-00001-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 1000]).unwrap();
    rejects(
        dir.path(),
        "1,2",
        &[],
        &["model-00001-of-00002.safetensors", "truncated"],
    );
    // Cut inside the header as well.
    std::fs::write(&shard, &bytes[..100]).unwrap();
    rejects(
        dir.path(),
        "1,2",
        &[],
        &["model-00001-of-00002.safetensors", "truncated"],
    );
}

#[test]
fn missing_shard_named_by_the_index() {
    let dir = copy_fixture("tiny-sharded");
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    rejects(
        dir.path(),
        "1,2",
        &[],
        &["model-00002-of-00002.safetensors"],
    );
}

#[test]
fn missing_mandatory_tensors_are_named() {
    for name in [
        "model.layers.1.self_attn.sinks",
        "model.layers.0.mlp.experts.down_proj_bias",
        "model.layers.0.mlp.experts.gate_up_proj_scales",
        "lm_head.weight",
    ] {
        let dir = rewritten_fixture(&fixtures_dir().join("tiny-single"), |ts| {
            ts.retain(|t| t.name != name)
        });
        rejects(dir.path(), "1,2", &[], &[name, "missing"]);
    }
}

#[test]
fn shape_disagreeing_with_config_is_named() {
    let name = "model.layers.0.self_attn.sinks";
    let dir = rewritten_fixture(&fixtures_dir().join("tiny-single"), |ts| {
        let t = ts.iter_mut().find(|t| t.name == name).unwrap();
        t.shape = vec![t.shape[0] + 1];
        t.data.extend_from_slice(&[0, 0]);
    });
    rejects(dir.path(), "1,2", &[], &[name, "shape [5]", "[4]"]);

    // A config that disagrees with every tensor: the first checked one is named.
    let dir = copy_fixture("tiny-single");
    let path = dir.path().join("config.json");
    let text = std::fs::read_to_string(&path)
        .unwrap()
        .replace("\"intermediate_size\": 64", "\"intermediate_size\": 96");
    std::fs::write(&path, text).unwrap();
    rejects(dir.path(), "1,2", &[], &["gate_up_proj_blocks", "shape"]);
}

#[test]
fn wrong_dtype_is_named() {
    let name = "model.norm.weight";
    let dir = rewritten_fixture(&fixtures_dir().join("tiny-single"), |ts| {
        ts.iter_mut().find(|t| t.name == name).unwrap().dtype = Dtype::I16;
    });
    rejects(dir.path(), "1,2", &[], &[name, "dtype I16"]);
}

#[test]
fn token_id_out_of_vocabulary() {
    let dir = fixtures_dir().join("tiny-single");
    rejects(
        &dir,
        "1,256,3",
        &[],
        &["token id 256", "position 1", "vocab_size is 256"],
    );
}

#[test]
fn prompt_longer_than_context() {
    let dir = fixtures_dir().join("tiny-single");
    rejects(
        &dir,
        "1,2,3,4,5",
        &["--context", "4"],
        &["5 tokens", "context of 4"],
    );
}

#[test]
fn malformed_ids_are_rejected_by_the_parser() {
    let dir = fixtures_dir().join("tiny-single");
    rejects(&dir, "1,x,3", &[], &["invalid value"]);
    rejects(&dir, "-1", &[], &["unexpected argument"]);
}

#[test]
fn good_input_still_works_through_the_cli() {
    // A copy: generate saves expert usage beside the model.
    let copy = copy_fixture("tiny-long");
    let reference = reference(&fixtures_dir().join("tiny-long"));
    let ids: Vec<String> = reference.prompt_ids.iter().map(u32::to_string).collect();
    let ids = ids.join(",");
    let d = copy.path().to_str().unwrap();
    let plain = [
        "generate",
        "--model",
        d,
        "--ids",
        &ids,
        "--max-new-tokens",
        "32",
        "--ignore-eos",
    ];
    let (ok, stdout, stderr) = picchio(&plain);
    assert!(ok, "{stderr}");
    let want: Vec<String> = reference.generated_ids.iter().map(u32::to_string).collect();
    assert_eq!(stdout.trim(), want.join(" "));

    let (ok, stdout, stderr) = picchio(&[&plain[..], &["--json", "--top-logits", "10"]].concat());
    assert!(ok, "{stderr}");
    let v: serde_json::Value =
        serde_json::from_str(stdout.trim()).expect("exactly one JSON object on stdout");
    // The default backend is auto: the GPU when there is a usable one, else the CPU.
    match v["backend"].as_str() {
        Some("gpu") => assert!(v["adapter"].is_string()),
        Some("cpu") => assert!(v["adapter"].is_null()),
        other => panic!("backend {other:?}"),
    }
    assert_eq!(
        v["prompt_ids"].as_array().unwrap().len(),
        reference.prompt_ids.len()
    );
    let generated: Vec<u32> = serde_json::from_value(v["generated_ids"].clone()).unwrap();
    assert_eq!(generated, reference.generated_ids);
    let steps = v["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 32);
    assert_eq!(steps[0]["id"], reference.generated_ids[0]);
    assert_eq!(steps[0]["top"].as_array().unwrap().len(), 10);
    assert!(v["prefill_ms"].as_f64().unwrap() >= 0.0);
    assert!(v["decode_tokens_per_s"].as_f64().unwrap() > 0.0);

    let (ok, stdout, stderr) = picchio(&["inspect", "--model", d]);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("model.layers.3.mlp.experts.down_proj_blocks"));
    assert!(stdout.contains("experts (weights, scales, biases)"));

    // The CPU tier reads experts and saves their usage in the user's cache directory, keyed by
    // the model; beside the model only when asked.
    let cache = tempfile::tempdir().unwrap();
    for beside in ["0", "1"] {
        let out = Command::new(env!("CARGO_BIN_EXE_picchio"))
            .args([
                "generate",
                "--model",
                d,
                "--ids",
                "1,2",
                "--max-new-tokens",
                "2",
            ])
            .args(["--backend", "cpu"])
            .env("PICCHIO_CACHE_DIR", cache.path())
            .env("PICCHIO_USAGE_BESIDE_MODEL", beside)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let saved: Vec<_> = std::fs::read_dir(cache.path().join("usage"))
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .collect();
    assert_eq!(saved.len(), 1, "{saved:?}");
    assert!(saved[0].extension().is_some_and(|e| e == "json"));
    assert!(
        copy.path().join(picchio::experts::USAGE_FILE).is_file(),
        "asked for, the usage goes beside the model"
    );

    // --stats: the expert store's counters add up, every part has a time, every layer a place.
    let (ok, stdout, stderr) = picchio(&[
        "generate",
        "--model",
        d,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "3",
        "--backend",
        "cpu",
        "--json",
        "--stats",
        "--ram-budget",
        "0",
    ]);
    assert!(ok, "{stderr}");
    let v: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let experts = &v["stats"]["experts"];
    let n = |key: &str| {
        experts[key]
            .as_u64()
            .unwrap_or_else(|| panic!("stats.experts.{key}: {v}"))
    };
    assert_eq!(
        n("requests"),
        n("vram_hits") + n("ram_hits") + n("disk_reads")
    );
    assert_eq!(
        (n("ram_hits"), n("evictions"), n("ram_budget_bytes")),
        (0, 0, 0)
    );
    assert_eq!(
        (n("vram_hits"), n("upload_bytes"), n("vram_evictions")),
        (0, 0, 0)
    );
    assert_eq!(n("disk_bytes"), n("disk_reads") * n("expert_record_bytes"));
    assert!(n("disk_bytes") > 0);
    for key in ["attention", "experts", "io_wait", "upload", "head"] {
        assert!(
            v["stats"]["time_ms"][key].as_f64().is_some(),
            "time_ms.{key}: {v}"
        );
    }
    assert_eq!(v["stats"]["placement"].as_array().unwrap().len(), 4);
    assert!(v["stats"]["gpu"].is_null());
    // Prefetch is off, but --stats asks for every proxy's accuracy, so both guess.
    for proxy in ["a", "b"] {
        let accuracy = &v["stats"]["prefetch"]["accuracy_by_proxy"][proxy];
        assert!(
            accuracy.as_f64().is_some_and(|a| (0.0..=1.0).contains(&a)),
            "accuracy_by_proxy.{proxy}: {v}"
        );
    }

    // Budgets and policies that do not parse are refused before anything runs.
    for (flag, value) in [
        ("--vram-budget", "12X"),
        ("--vram-budget", "150%"),
        ("--miss-policy", "sideways"),
    ] {
        let (ok, _, stderr) = picchio(&["generate", "--model", d, "--ids", "1", flag, value]);
        assert!(!ok && stderr.contains(value), "{flag} {value}: {stderr}");
    }
}

#[test]
fn bad_input_is_rejected_the_same_way_with_the_gpu_backend() {
    let dir = fixtures_dir().join("tiny-single");
    let gpu = ["--backend", "gpu"];
    rejects(
        &dir,
        "1,256,3",
        &gpu,
        &["token id 256", "vocab_size is 256"],
    );
    rejects(
        &dir,
        "1,2,3,4,5",
        &[&gpu[..], &["--context", "4"]].concat(),
        &["5 tokens", "context of 4"],
    );
    rejects(
        Path::new("/nonexistent/model"),
        "1,2",
        &gpu,
        &["/nonexistent/model"],
    );
    let name = "model.layers.1.self_attn.sinks";
    let broken = rewritten_fixture(&dir, |ts| ts.retain(|t| t.name != name));
    rejects(broken.path(), "1,2", &gpu, &[name, "missing"]);
}

#[test]
fn gpu_backend_without_a_usable_adapter_is_a_clear_error() {
    // Software adapters are refused unless allowed: with the permission removed, a machine whose
    // only adapter is lavapipe (CI) has no usable GPU, and one with a real GPU runs on it.
    let copy = copy_fixture("tiny-single");
    let d = copy.path().to_str().unwrap();
    let without_software = |backend: &str| {
        Command::new(env!("CARGO_BIN_EXE_picchio"))
            .args([
                "generate",
                "--model",
                d,
                "--ids",
                "1,2",
                "--max-new-tokens",
                "2",
                "--backend",
                backend,
            ])
            .env_remove("PICCHIO_GPU_ALLOW_SOFTWARE")
            .output()
            .unwrap()
    };
    let out = without_software("gpu");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    if !out.status.success() {
        assert!(stderr.contains("GPU:"), "{stderr}");
        assert!(stderr.contains("adapter"), "{stderr}");
    }
    // auto never fails for want of a GPU: it runs on the CPU tier instead.
    let out = without_software("auto");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn speed_options_out_of_range_are_clear_errors() {
    let dir = fixtures_dir().join("tiny-single");
    // q8 dense weights are the CPU tier's own numeric mode.
    rejects(
        &dir,
        "1,2,3",
        &["--dense-format", "q8", "--backend", "gpu"],
        &["--dense-format q8 runs on the CPU tier only"],
    );
    rejects(
        &dir,
        "1,2,3",
        &["--expert-activations", "q8", "--backend", "gpu"],
        &["--expert-activations q8 runs on the CPU tier only"],
    );
    rejects(
        &dir,
        "1,2,3",
        &["--expert-activations", "int4"],
        &["expected exact"],
    );
    rejects(
        &dir,
        "1,2,3",
        &["--dense-format", "q4"],
        &["expected checkpoint"],
    );
    rejects(
        &dir,
        "1,2,3",
        &["--mmap", "maybe"],
        &["expected auto, on or off"],
    );
    rejects(
        &dir,
        "1,2,3",
        &["--threads", "0"],
        &["--threads must be at least 1"],
    );
    // `agree` compares a faster mode with the exact path: there must be one.
    let (ok, stdout, stderr) =
        picchio(&["agree", "--model", dir.to_str().unwrap(), "--ids", "1,2,3"]);
    assert!(!ok && stdout.is_empty(), "{stdout}");
    assert!(stderr.contains("pass --dense-format q8"), "{stderr}");
}

#[test]
fn q8_and_thread_options_run_through_the_cli() {
    let dir = fixtures_dir().join("tiny-single");
    let dir = dir.to_str().unwrap();
    // `generate` of `max_new_tokens` after the prompt 1,2,3 on the CPU tier, plus `extra`.
    let generate = |max_new_tokens: &'static str, extra: &[&'static str]| {
        let mut args = vec![
            "generate",
            "--model",
            dir,
            "--ids",
            "1,2,3",
            "--max-new-tokens",
            max_new_tokens,
            "--backend",
            "cpu",
        ];
        args.extend_from_slice(extra);
        args
    };
    for extra in [
        &["--dense-format", "q8"][..],
        &["--mmap", "on", "--threads", "1"][..],
        &["--mmap", "off"][..],
    ] {
        let args = generate("4", extra);
        let (ok, stdout, stderr) = picchio(&args);
        assert!(ok, "{args:?}: {stderr}");
        assert_eq!(stdout.split_whitespace().count(), 4, "{args:?}: {stdout}");
    }
    // Mapped or copied, one thread or several: the same tokens.
    let tokens = |extra: &[&'static str]| picchio(&generate("8", extra)).1;
    let reference = tokens(&[]);
    assert_eq!(tokens(&["--mmap", "on", "--threads", "1"]), reference);
    assert_eq!(tokens(&["--mmap", "off", "--threads", "2"]), reference);
    let (ok, stdout, stderr) = picchio(&[
        "agree",
        "--model",
        dir,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "16",
        "--dense-format",
        "q8",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(report["steps"], 16);
    assert!(report["agreeing"].as_u64().unwrap() <= 16);
}

/// config.json values that would give garbage rather than an error are rejected at load, named.
#[test]
fn invalid_rope_stop_token_and_position_values_are_named() {
    let cases = [
        (
            "\"factor\": 32.0",
            "\"factor\": 0",
            "rope factor (0) must be a positive number",
        ),
        (
            "\"factor\": 32.0",
            "\"factor\": -5",
            "rope factor (-5) must be a positive number",
        ),
        (
            "\"beta_fast\": 32.0",
            "\"beta_fast\": -1",
            "rope beta_fast (-1) and beta_slow (1) must be positive numbers",
        ),
        (
            "\"eos_token_id\": 2",
            "\"eos_token_id\": 256",
            "eos_token_id 256 is beyond the vocabulary (vocab_size 256)",
        ),
        (
            "\"max_position_embeddings\": 131072",
            "\"max_position_embeddings\": 0",
            "max_position_embeddings must be positive",
        ),
    ];
    for (from, to, needle) in cases {
        let dir = copy_fixture("tiny-single");
        let path = dir.path().join("config.json");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{from}");
        std::fs::write(&path, text.replace(from, to)).unwrap();
        rejects(dir.path(), "1,2", &[], &["config.json", needle]);
    }
    let dir = copy_fixture("tiny-single");
    let generation = dir.path().join("generation_config.json");
    std::fs::write(&generation, r#"{"eos_token_id": [2, 300]}"#).unwrap();
    rejects(
        dir.path(),
        "1,2",
        &[],
        &[
            "generation_config.json",
            "eos_token_id 300 is beyond the vocabulary",
        ],
    );
}

/// NaN or infinity in a weight stops generation (no token printed, non-zero exit) with an error
/// naming where the non-finite values first appear, on every backend.
#[test]
fn non_finite_weights_stop_generation_naming_where_they_appear() {
    const NAN: [u8; 2] = 0x7fc0u16.to_le_bytes();
    const INFINITY: [u8; 2] = 0x7f80u16.to_le_bytes();
    let cases = [
        ("lm_head.weight", NAN, "the head"),
        ("model.embed_tokens.weight", INFINITY, "the embeddings"),
        (
            "model.layers.1.self_attn.q_proj.weight",
            NAN,
            "layer 1's attention",
        ),
        ("model.layers.0.mlp.router.weight", NAN, "layer 0's router"),
    ];
    for (name, value, origin) in cases {
        let dir = rewritten_fixture(&fixtures_dir().join("tiny-single"), |ts| {
            let t = ts.iter_mut().find(|t| t.name == name).unwrap();
            assert_eq!(t.dtype, Dtype::BF16, "{name}");
            for element in t.data.chunks_exact_mut(2) {
                element.copy_from_slice(&value);
            }
        });
        for backend in backends() {
            rejects(
                dir.path(),
                "1,2,3",
                &["--backend", backend],
                &["not finite (NaN or infinity)", origin],
            );
        }
    }
}

/// `--context` beyond the model's positions is clamped to them (and said so); `--threads` far
/// beyond the CPUs is clamped too, and the run finishes.
#[test]
fn context_and_threads_beyond_the_machine_are_clamped() {
    let dir = fixtures_dir().join("tiny-single");
    let dir = dir.to_str().unwrap();
    let (ok, stdout, stderr) = picchio(&[
        "generate",
        "--model",
        dir,
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--backend",
        "cpu",
        "--context",
        "1000000000000",
        "--threads",
        "100000",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(stdout.split_whitespace().count(), 2, "{stdout}");
    assert!(stderr.contains("using 131072"), "{stderr}");
    assert!(stderr.contains("--threads 100000"), "{stderr}");
}

/// tiny-single converted by `picchio convert` into a new directory (kept while the first value
/// lives): the store's path and its index.
fn converted_tiny_single() -> (tempfile::TempDir, std::path::PathBuf, serde_json::Value) {
    let store = tempfile::tempdir().unwrap();
    let out = store.path().join("flat");
    let source = fixtures_dir().join("tiny-single");
    picchio_stdout(&[
        "convert",
        "--model",
        source.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let index = std::fs::read_to_string(out.join("experts.json")).unwrap();
    (store, out, serde_json::from_str(&index).unwrap())
}

/// A converted store whose index gives a record stride past the records file is refused before
/// any read, naming the field, by `verify` and by `generate`.
#[test]
fn crafted_record_stride_is_refused_before_any_read() {
    let (_store, out, mut index) = converted_tiny_single();
    let index_path = out.join("experts.json");
    for stride in [4096u64 << 50, 4096 * 1000] {
        index["record_stride"] = stride.into();
        std::fs::write(&index_path, index.to_string()).unwrap();
        let (ok, stdout, stderr) = picchio(&["verify", "--model", out.to_str().unwrap()]);
        assert!(!ok && stdout.is_empty(), "{stdout}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(stderr.contains("record_stride"), "{stderr}");
        rejects(&out, "1,2", &[], &["experts.", "record_stride"]);
    }
}

/// A model.safetensors that is a FIFO or a directory is a clear error, not a hang or "No such
/// device".
#[cfg(unix)]
#[test]
fn checkpoint_files_that_are_not_regular_files_are_named() {
    for make in ["fifo", "directory"] {
        let dir = copy_fixture("tiny-single");
        let file = dir.path().join("model.safetensors");
        std::fs::remove_file(&file).unwrap();
        match make {
            "fifo" => assert!(
                Command::new("mkfifo")
                    .arg(&file)
                    .status()
                    .unwrap()
                    .success()
            ),
            _ => std::fs::create_dir(&file).unwrap(),
        }
        rejects(
            dir.path(),
            "1,2",
            &[],
            &["model.safetensors", "not a regular file"],
        );
    }
}

/// `convert` writes beside its output and renames when done: the leftovers of an interrupted
/// run are removed by the next, a half-written directory is refused as such, `--force`
/// replaces an output, and every file gets the usual permissions.
#[test]
fn interrupted_conversions_are_recognised_and_retried() {
    let source = fixtures_dir().join("tiny-single");
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("flat");
    let partial = work.path().join(".flat.partial");
    // What a run killed mid-way leaves: the marked sibling, a temporary file in it.
    std::fs::create_dir(&partial).unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(source.join(name), partial.join(name)).unwrap();
    }
    std::fs::write(partial.join("CONVERTING"), "").unwrap();
    std::fs::write(partial.join(".tmpK1ll3d"), b"partial bytes").unwrap();
    std::fs::write(partial.join("experts.bin"), b"short").unwrap();
    rejects(&partial, "1,2", &[], &["half-written", "convert again"]);
    std::fs::remove_file(partial.join("CONVERTING")).unwrap();
    rejects(&partial, "1,2", &[], &["experts.json", "half-written"]);

    let convert = |extra: &[&str]| {
        let mut args = vec![
            "convert",
            "--model",
            source.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        picchio(&args)
    };
    let (ok, _, stderr) = convert(&[]);
    assert!(ok, "{stderr}");
    assert!(!partial.exists(), "the leftovers are gone");
    let (ok, stdout, stderr) = picchio(&["verify", "--model", out.to_str().unwrap()]);
    assert!(ok, "{stdout}{stderr}");
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |name: &str| {
            let metadata = std::fs::metadata(out.join(name)).unwrap();
            metadata.permissions().mode() & 0o777
        };
        assert_eq!(mode("model.safetensors"), mode("experts.json"));
        assert_eq!(mode("model.safetensors"), mode("experts.bin"));
    }
    let (ok, _, stderr) = convert(&[]);
    assert!(!ok && stderr.contains("not empty"), "{stderr}");
    let (ok, _, stderr) = convert(&["--force"]);
    assert!(ok, "{stderr}");
    let (ok, _, stderr) = picchio(&["verify", "--model", out.to_str().unwrap()]);
    assert!(ok, "{stderr}");
}

/// A byte flipped in a converted store's records is caught by the record's hash when it is first
/// read, on every backend and with direct IO; `--check-records off` skips the check.
#[test]
fn damaged_expert_records_are_errors_not_different_tokens() {
    let (_store, out, index) = converted_tiny_single();
    let stride = index["record_stride"].as_u64().unwrap() as usize;
    let records = out.join("experts.bin");
    let mut bytes = std::fs::read(&records).unwrap();
    for record in bytes.chunks_exact_mut(stride) {
        record[10] ^= 0x40;
    }
    std::fs::write(&records, bytes).unwrap();
    for backend in backends() {
        rejects(
            &out,
            "1,2,3",
            &["--backend", backend],
            &["experts.bin", "hashes to", "damaged"],
        );
    }
    rejects(
        &out,
        "1,2,3",
        &["--backend", "cpu", "--direct-io", "--ram-budget", "0"],
        &["experts.bin", "hashes to"],
    );
    // A store from before the XXH3 hashes: its FNV-1a hashes are checked.
    let mut index = index;
    index
        .as_object_mut()
        .unwrap()
        .remove("xxh3")
        .expect("convert writes xxh3");
    std::fs::write(out.join("experts.json"), index.to_string()).unwrap();
    rejects(
        &out,
        "1,2,3",
        &["--backend", "cpu"],
        &["experts.bin", "hashes to"],
    );
    let (ok, stdout, stderr) = picchio(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "2",
        "--check-records",
        "off",
    ]);
    assert!(ok, "{stderr}");
    assert_eq!(stdout.split_whitespace().count(), 2, "{stdout}");
}

/// Ctrl-C during `generate` keeps what was generated: plain ids are printed as they come and
/// end with a newline, `--json` is still one object (`"interrupted": true`); exit code 130.
#[cfg(unix)]
#[test]
fn an_interrupted_generation_prints_what_it_has() {
    use std::io::Read;
    let dir = fixtures_dir().join("tiny-single");
    for json in [false, true] {
        let mut command = Command::new(env!("CARGO_BIN_EXE_picchio"));
        command
            .args([
                "generate",
                "--model",
                dir.to_str().unwrap(),
                "--ids",
                "1,2,3",
            ])
            .args([
                "--max-new-tokens",
                "1000000",
                "--ignore-eos",
                "--backend",
                "cpu",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        if json {
            command.arg("--json");
        }
        let mut child = command.spawn().unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut seen = Vec::new();
        if json {
            std::thread::sleep(std::time::Duration::from_millis(1500));
        } else {
            // The first ids arrive before the end.
            let mut byte = [0u8; 1];
            while seen.iter().filter(|&&b| b == b' ').count() < 3 {
                stdout.read_exact(&mut byte).unwrap();
                seen.push(byte[0]);
            }
        }
        send_signal(&child, "INT");
        stdout.read_to_end(&mut seen).unwrap();
        let status = child.wait().unwrap();
        assert_eq!(status.code(), Some(130), "json {json}");
        let text = String::from_utf8(seen).unwrap();
        let ids: Vec<u32> = if json {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["interrupted"], true);
            assert_eq!(v["stop_reason"], "interrupted");
            serde_json::from_value(v["generated_ids"].clone()).unwrap()
        } else {
            assert!(text.ends_with('\n'), "{text:?}");
            text.split_whitespace()
                .map(|w| w.parse().unwrap())
                .collect()
        };
        assert!(
            !ids.is_empty() && ids.len() < 1_000_000,
            "json {json}: {}",
            ids.len()
        );
        assert!(ids.iter().all(|&id| id < 256));
    }
}
