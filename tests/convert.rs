//! Converted expert stores (`picchio convert`): an MXFP4 store gives transformers' tokens on both
//! tiers (with O_DIRECT reads too), its records are 4 KiB-aligned and hashed, damage is a clear
//! error; an INT4 store runs on both tiers with the same tokens, and its agreement with the exact
//! path is measured.

mod common;

use common::*;
use picchio::Model;
use picchio::experts::{RamBudget, VramBudget};
use picchio::flat_store::{
    FlatExperts, FlatFormat, INDEX_FILE, RECORD_ALIGN, RECORDS_FILE, convert,
};
use picchio::model::generate::{CpuSession, generate_with};
use picchio::model::gpu_tier::GpuTierOptions;
use picchio::model::{KvCache, ModelOptions};

fn converted(dir: &std::path::Path, format: FlatFormat) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    convert(dir, out.path(), format, false, &|_| {}).unwrap();
    // The experts live in the records only: the dense file holds none of their weights (GPT-OSS's
    // expert biases stay dense).
    for tensor in read_tensors(out.path()) {
        let expert = tensor.name.contains(".mlp.experts.");
        assert!(
            !expert || tensor.name.ends_with("_bias"),
            "{} copied",
            tensor.name
        );
    }
    out
}

fn load(dir: &std::path::Path, ram_budget: RamBudget, direct_io: bool) -> Model {
    let options = ModelOptions {
        ram_budget,
        direct_io,
        ..Default::default()
    };
    Model::load_with(dir, &options).unwrap()
}

fn gpu_ids(model: &Model, prompt: &[u32], vram_budget: VramBudget, n: usize) -> Option<Vec<u32>> {
    let options = GpuTierOptions {
        vram_budget,
        ..gpu_options()
    };
    let mut session = gpu_session(model, options)?;
    let out = generate_with(&mut session, &model.config, prompt, &greedy_options(n)).unwrap();
    Some(out.generated_ids)
}

fn cpu_ids(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut session = CpuSession::new(model, 4096);
    generate_with(&mut session, &model.config, prompt, &greedy_options(n))
        .unwrap()
        .generated_ids
}

/// MXFP4 fixtures (the unquantized one has no MXFP4 bytes to copy).
fn mxfp4_fixtures() -> Vec<std::path::PathBuf> {
    fixture_dirs()
        .into_iter()
        .filter(|d| {
            std::fs::read_to_string(d.join("config.json")).is_ok_and(|c| c.contains("mxfp4"))
        })
        .collect()
}

#[test]
fn mxfp4_store_gives_transformers_tokens_on_both_tiers() {
    for dir in mxfp4_fixtures() {
        let reference = reference(&dir);
        let out = converted(&dir, FlatFormat::Mxfp4);
        let what = dir.display().to_string();

        let model = load(out.path(), RamBudget::Bytes(0), false);
        let flat = model.weights.flat.as_ref().expect("a converted store");
        flat.verify().unwrap();
        let index = &flat.index;
        assert!(index.record_stride.is_multiple_of(RECORD_ALIGN));
        let file_len = std::fs::metadata(out.path().join(RECORDS_FILE))
            .unwrap()
            .len();
        assert_eq!(
            file_len as usize,
            index.layers * index.experts * index.record_stride
        );
        // The experts are the checkpoint's bytes.
        let original = Model::load(&dir).unwrap();
        for (a, b) in original.weights.layers.iter().zip(&model.weights.layers) {
            for e in 0..index.experts {
                assert_eq!(
                    a.gate_up.expert_parts(e),
                    b.gate_up.expert_parts(e),
                    "{what}"
                );
                assert_eq!(a.down.expert_parts(e), b.down.expert_parts(e), "{what}");
            }
        }

        assert_eq!(
            cpu_ids(&model, &reference.prompt_ids, 32),
            reference.generated_ids,
            "{what}"
        );
        // One read per expert: disk bytes are whole records.
        let s = model.experts.stats();
        assert_eq!(
            s.disk_bytes,
            s.disk_reads * index.record_bytes as u64,
            "{what}"
        );

        let direct = load(out.path(), RamBudget::Bytes(0), true);
        assert_eq!(
            cpu_ids(&direct, &reference.prompt_ids, 32),
            reference.generated_ids,
            "{what}"
        );
        let s = direct.experts.stats();
        assert_eq!(
            s.disk_bytes,
            s.disk_reads * index.record_stride as u64,
            "{what} (O_DIRECT)"
        );

        for budget in [VramBudget::Auto, VramBudget::Percent(25.0)] {
            let model = load(out.path(), RamBudget::Percent(25.0), false);
            if let Some(ids) = gpu_ids(&model, &reference.prompt_ids, budget, 32) {
                assert_eq!(
                    ids, reference.generated_ids,
                    "{what} on the GPU ({budget:?})"
                );
            }
        }
    }
}

#[test]
fn int4_store_runs_on_both_tiers_and_reports_its_agreement() {
    let (mut agreeing, mut steps) = (0, 0);
    for dir in fixture_dirs() {
        let reference = reference(&dir);
        let out = converted(&dir, FlatFormat::Int4);
        let model = load(out.path(), RamBudget::Auto, false);
        let what = dir.display().to_string();
        assert!(matches!(
            model.weights.layers[0].gate_up,
            picchio::weights::ExpertMatrices::Int4(_)
        ));
        // Both tiers run the same INT4 weights: the same tokens.
        let cpu = cpu_ids(&model, &reference.prompt_ids, 32);
        if let Some(gpu) = gpu_ids(&model, &reference.prompt_ids, VramBudget::Percent(50.0), 32) {
            assert_eq!(gpu, cpu, "{what}: INT4 on the GPU vs the CPU");
        }
        // Agreement with the exact path, teacher-forced: at each step both see transformers'
        // tokens so far, and the INT4 model's top-1 is compared with transformers'.
        let mut cache = KvCache::new(&model.config, 4096);
        let mut logits = model
            .forward(&mut cache, &reference.prompt_ids, None)
            .unwrap();
        let mut here = 0;
        for (step, &want) in reference.generated_ids.iter().enumerate() {
            here += (picchio::model::sampler::argmax(&logits) == want) as usize;
            if step + 1 < reference.generated_ids.len() {
                logits = model.forward(&mut cache, &[want], None).unwrap();
            }
        }
        eprintln!("{what}: INT4 top-1 agreement {here}/32 (teacher-forced)");
        agreeing += here;
        steps += reference.generated_ids.len();
    }
    eprintln!("INT4 top-1 agreement over the fixtures: {agreeing}/{steps}");
    assert!(steps > 0);
    // Tiny random models have near-tied logits, far more fragile than trained ones; still, most
    // steps must agree, or the quantizer is broken.
    assert!(agreeing * 2 > steps, "{agreeing}/{steps}");
}

#[test]
fn damaged_or_mismatched_stores_are_clear_errors() {
    let dir = fixtures_dir().join("tiny-single");
    let out = converted(&dir, FlatFormat::Mxfp4);
    let records = out.path().join(RECORDS_FILE);
    let config = picchio::Config::load(out.path()).unwrap();

    // A flipped byte: verify names the record.
    let mut bytes = std::fs::read(&records).unwrap();
    let index: picchio::flat_store::FlatIndex =
        serde_json::from_str(&std::fs::read_to_string(out.path().join(INDEX_FILE)).unwrap())
            .unwrap();
    bytes[index.record_stride + 5] ^= 0x10;
    std::fs::write(&records, &bytes).unwrap();
    let store = FlatExperts::open(out.path(), &config).unwrap().unwrap();
    let error = store.verify().unwrap_err().to_string();
    assert!(error.contains("record 1 (layer 0, expert 1)"), "{error}");

    // A short records file: loading fails naming it.
    bytes.truncate(bytes.len() - 100);
    std::fs::write(&records, &bytes).unwrap();
    let error = Model::load(out.path()).err().unwrap().to_string();
    assert!(
        error.contains(RECORDS_FILE) && error.contains("short"),
        "{error}"
    );

    // An index that does not match the config.
    let text = std::fs::read_to_string(out.path().join(INDEX_FILE)).unwrap();
    let edited = text.replacen("\"experts\": ", "\"experts\": 1", 1);
    std::fs::write(out.path().join(INDEX_FILE), edited).unwrap();
    let error = Model::load(out.path()).err().unwrap().to_string();
    assert!(error.contains(INDEX_FILE), "{error}");

    // Direct IO needs a converted store; converting into a non-empty directory is refused;
    // unquantized experts cannot be copied as MXFP4.
    let error = Model::load_with(
        &dir,
        &ModelOptions {
            direct_io: true,
            ..Default::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(error.contains("convert"), "{error}");
    let error = convert(&dir, out.path(), FlatFormat::Mxfp4, false, &|_| {})
        .unwrap_err()
        .to_string();
    assert!(error.contains("not empty"), "{error}");
    // INT4 experts are not quantized again.
    let int4 = converted(&fixtures_dir().join("tiny-unquantized"), FlatFormat::Int4);
    let fresh = tempfile::tempdir().unwrap();
    let error = convert(
        int4.path(),
        &fresh.path().join("x"),
        FlatFormat::Mxfp4,
        false,
        &|_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("INT4"), "{error}");
}

/// Fault injection: the records file cut short in the middle of a run (every expert read from
/// disk, nothing kept in RAM, with and without direct IO) makes the next token an error naming
/// the file, never a token computed from a short read.
#[test]
fn records_cut_short_mid_run_are_an_error_not_wrong_tokens() {
    use picchio::model::generate::Session;
    let src = fixtures_dir().join("tiny-long");
    let reference = reference(&src);
    for direct_io in [false, true] {
        let out = converted(&src, FlatFormat::Mxfp4);
        let model = load(out.path(), RamBudget::Bytes(0), direct_io);
        let mut session = CpuSession::new(&model, 4096);
        let first = session.feed(&reference.prompt_ids, 0).unwrap();
        assert_eq!(first.id, reference.generated_ids[0]);
        let records = out.path().join(RECORDS_FILE);
        let length = std::fs::metadata(&records).unwrap().len();
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&records)
            .unwrap();
        file.set_len(length / 3).unwrap();
        let error = session.feed(&[first.id], 0).unwrap_err().to_string();
        assert!(error.contains(RECORDS_FILE), "direct {direct_io}: {error}");
    }
}

/// Streaming from a converted store past the page cache: experts read in small chunks by
/// several threads, guesses staged up to three layers ahead, at every budget, give
/// transformers' tokens; and bench judges each run against the disk it measured.
#[test]
fn direct_io_streaming_with_staged_prefetch_keeps_the_tokens() {
    use picchio::bench::{BenchOptions, run_bench};
    use picchio::model::{PrefetchOptions, PrefetchProxy};
    let src = fixtures_dir().join("tiny-long");
    let reference = reference(&src);
    let out = converted(&src, FlatFormat::Mxfp4);
    let n = reference.generated_ids.len();
    for (budget, distance, proxy) in [
        (RamBudget::Bytes(0), 1, PrefetchProxy::B),
        (RamBudget::Bytes(0), 3, PrefetchProxy::A),
        (RamBudget::Percent(30.0), 2, PrefetchProxy::B),
    ] {
        let model = Model::load_with(
            out.path(),
            &ModelOptions {
                ram_budget: budget,
                direct_io: true,
                io_threads: 3,
                // Records span several chunks, read side by side.
                read_chunk_bytes: 4096,
                prefetch: PrefetchOptions {
                    enabled: true,
                    proxy,
                    distance,
                    measure_accuracy: true,
                },
                ..Default::default()
            },
        )
        .unwrap();
        let ids = cpu_ids(&model, &reference.prompt_ids, n);
        assert_eq!(
            ids, reference.generated_ids,
            "{budget:?}, distance {distance}"
        );
        let stats = model.experts.stats();
        assert!(stats.prefetch.issued > 0 && stats.prefetch.used > 0);
        assert!(
            stats.reads.chunks > stats.disk_reads,
            "records read in chunks"
        );
        assert!(stats.reads.mean_depth().is_some_and(|d| d >= 1.0));
        for d in 1..=3 {
            assert!(
                model.prediction_accuracy_at(proxy, d).is_some(),
                "distance {d}"
            );
        }
        assert_eq!(model.experts.layer_wait_ms().len(), model.config.num_layers);
    }
    let options = BenchOptions {
        backend: picchio::model::generate::BackendChoice::Cpu,
        ram_budgets: vec![RamBudget::Bytes(0)],
        direct_io: true,
        prefetch: vec![true],
        prefetch_distance: 2,
        prompt_tokens: 4,
        gen_tokens: 4,
        seed: 1,
        ..BenchOptions::new(out.path().to_path_buf())
    };
    let run = run_bench(&options, &mut |_, _| {}).unwrap().remove(0);
    assert!(run.disk_bandwidth_bytes_per_s.is_some_and(|b| b > 0.0));
    assert!(run.disk_best_depth.is_some());
    assert!(run.disk_bandwidth_at_io_threads_bytes_per_s <= run.disk_bandwidth_bytes_per_s);
    assert!(run.disk_bound_s_per_token.is_some_and(|s| s > 0.0));
    assert!(run.disk_roofline_fraction.is_some_and(|f| f > 0.0));
    assert_eq!(run.prefetch_distance, 2);
}

/// Qwen3-MoE's bf16 experts quantized by `convert` (MXFP4 and INT4): both tiers run the quantized
/// store with the same tokens, and its top-1 agreement with the exact path over 256 steps,
/// teacher-forced on the exact path's tokens, is reported per fixture.
#[test]
fn qwen3_experts_quantize_to_mxfp4_and_int4_and_report_their_agreement() {
    use picchio::model::agreement::top1_agreement;
    const STEPS: usize = 256;
    for format in [FlatFormat::Mxfp4, FlatFormat::Int4] {
        let (mut agreeing, mut steps) = (0, 0);
        for dir in qwen3_fixture_dirs() {
            let reference = reference(&dir);
            let config = picchio::Config::load(&dir).unwrap();
            if !config.intermediate_size.is_multiple_of(32) {
                // 4-bit formats scale whole groups of 32 inputs: refused by name.
                let out = tempfile::tempdir().unwrap();
                let error = convert(&dir, out.path(), format, false, &|_| {}).unwrap_err();
                assert!(error.to_string().contains("multiple of 32"), "{error}");
                continue;
            }
            let out = converted(&dir, format);
            let quantized = load(out.path(), RamBudget::Auto, false);
            let what = format!("{} as {format:?}", dir.display());
            let cpu = cpu_ids(&quantized, &reference.prompt_ids, 32);
            let vram = VramBudget::Percent(50.0);
            if let Some(gpu) = gpu_ids(&quantized, &reference.prompt_ids, vram, 32) {
                assert_eq!(gpu, cpu, "{what}: the GPU vs the CPU");
            }
            let exact = Model::load(&dir).unwrap();
            let report = top1_agreement(&exact, &quantized, &reference.prompt_ids, STEPS).unwrap();
            eprintln!(
                "{what}: top-1 agrees at {} of {STEPS} steps (first difference at {:?})",
                report.agreeing, report.first_disagreement
            );
            // Random tiny models have top-2 margins down to 1e-2: some steps flip.
            assert!(report.rate >= 0.5, "{what}: {} of {STEPS}", report.agreeing);
            agreeing += report.agreeing;
            steps += report.steps;
        }
        eprintln!("{format:?} total: {agreeing} of {steps} steps agree");
    }
}
