//! The expert store never changes the math: every RAM budget gives transformers' tokens, and the
//! counters add up.

mod common;

use common::*;
use picchio::Model;
use picchio::experts::RamBudget;
use picchio::model::ModelOptions;
use picchio::model::generate::generate;

fn load(dir: &std::path::Path, ram_budget: RamBudget) -> Model {
    Model::load_with(
        dir,
        &ModelOptions {
            ram_budget,
            io_threads: 3,
            ..Default::default()
        },
    )
    .unwrap()
}

#[test]
fn every_ram_budget_gives_transformers_tokens() {
    for dir in every_family_fixture_dirs() {
        let reference = reference(&dir);
        let expert_bytes = load(&dir, RamBudget::Bytes(0)).experts.expert_bytes();
        for budget in [
            RamBudget::Bytes(0),                // stream every expert from disk
            RamBudget::Bytes(expert_bytes + 1), // one expert: evictions at every layer
            RamBudget::Percent(25.0),
            RamBudget::Auto,
        ] {
            let model = load(&dir, budget);
            let out = generate(&model, &reference.prompt_ids, &greedy_options(32)).unwrap();
            assert_eq!(
                out.generated_ids,
                reference.generated_ids,
                "{} with {budget:?}",
                dir.display()
            );

            let s = model.experts.stats();
            assert_eq!(s.requests, s.ram_hits + s.disk_reads, "{budget:?}: {s:?}");
            assert_eq!(
                s.disk_bytes,
                s.disk_reads * expert_bytes,
                "{budget:?}: {s:?}"
            );
            assert!(model.experts.cached_bytes() <= model.experts.budget());
            match budget {
                RamBudget::Bytes(0) => assert_eq!((s.ram_hits, s.evictions), (0, 0), "{s:?}"),
                RamBudget::Bytes(_) => assert!(s.evictions > 0, "{s:?}"),
                _ => {}
            }
        }
    }
}

#[test]
fn a_cached_expert_is_read_once() {
    let dir = fixtures_dir().join("tiny-long");
    let reference = reference(&dir);
    let model = load(&dir, RamBudget::Percent(100.0));
    generate(&model, &reference.prompt_ids, &greedy_options(32)).unwrap();
    let s = model.experts.stats();
    // Every (layer, expert) at most once from disk: 4 layers x 6 experts.
    assert!(s.disk_reads <= 24, "{s:?}");
    assert!(s.ram_hits > 0 && s.evictions == 0, "{s:?}");
}

#[test]
fn bench_sweeps_budgets_and_writes_csv_and_plot() {
    use picchio::bench::{BenchOptions, plot_svg, run_bench, to_csv};
    use picchio::model::generate::BackendChoice;
    // A copy: bench saves expert usage beside the model.
    let dir = copy_fixture("tiny-long");
    let options = BenchOptions {
        backend: BackendChoice::Cpu,
        ram_budgets: vec![RamBudget::Bytes(0), RamBudget::Percent(100.0)],
        vram_budgets: vec![RamBudget::Bytes(0), RamBudget::Auto], // ignored on the CPU tier
        prefetch: vec![false, true],
        prompt_tokens: 8,
        gen_tokens: 6,
        seed: 3,
        ..BenchOptions::new(dir.path().to_path_buf())
    };
    let mut calls = 0;
    let runs = run_bench(&options, &mut |_, _| calls += 1).unwrap();
    assert_eq!((runs.len(), calls), (4, 4));
    // Prefetch off and on for each budget, side by side; with no RAM cache, guesses wait in the
    // staging area, and are scored at every distance.
    assert_eq!(
        runs.iter().map(|r| r.prefetch).collect::<Vec<_>>(),
        [false, true, false, true]
    );
    assert!(runs[1].prefetch_bytes_per_token > 0.0);
    assert!(runs[1].prefetch_used_per_token > 0.0);
    assert!(runs[1].prefetch_staging_experts > 0);
    assert!(runs[1].prefetch_accuracy.is_some_and(|a| a > 0.0));
    assert!(
        runs[1]
            .prefetch_accuracy_by_distance
            .iter()
            .all(|a| a.is_some_and(|a| a > 0.0))
    );
    assert_eq!(
        runs[1].prefetch_accuracy,
        runs[1].prefetch_accuracy_by_distance[0]
    );
    // Without --direct-io no disk figure is measured (the page cache would serve it).
    assert!(runs.iter().all(|r| r.disk_roofline_fraction.is_none()));
    // Without prefetch nothing guesses (the router products would cost decode time).
    assert_eq!(runs[0].prefetch_accuracy, None);
    let runs: Vec<_> = runs.into_iter().filter(|r| !r.prefetch).collect();
    assert!(
        runs.iter()
            .all(|r| r.backend == "cpu" && r.decode_tokens_per_s > 0.0)
    );
    // Streaming reads every expert; a cache holding them all reads none while decoding.
    assert!(runs[0].disk_bytes_per_token > 0.0 && runs[0].ram_hit_rate == Some(0.0));
    assert_eq!(runs[1].disk_bytes_per_token, 0.0);
    assert_eq!(runs[1].ram_hit_rate, Some(1.0));
    assert_eq!(to_csv(&runs).lines().count(), 3);
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("sweep.svg");
    plot_svg(&runs, &svg).unwrap();
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
}

#[test]
fn usage_is_saved_and_pins_hot_experts_next_time() {
    let reference = reference(&fixtures_dir().join("tiny-long"));
    let dir = copy_fixture("tiny-long");
    let cache = tempfile::tempdir().unwrap();
    let hot = |budget| {
        let options = ModelOptions {
            ram_budget: budget,
            io_threads: 3,
            hot_experts: true,
            usage_dir: Some(cache.path().to_path_buf()),
            ..Default::default()
        };
        Model::load_with(dir.path(), &options).unwrap()
    };
    let first = hot(RamBudget::Percent(50.0));
    generate(&first, &reference.prompt_ids, &greedy_options(32)).unwrap();
    assert_eq!(first.experts.pinned(), 0, "nothing to pin from yet");
    first.experts.save_usage();
    let saved = first.experts.usage_path().expect("a usage file");
    assert!(
        saved.starts_with(cache.path()) && saved.is_file(),
        "{saved:?}"
    );
    assert!(!dir.path().join(picchio::experts::USAGE_FILE).exists());

    let second = hot(RamBudget::Percent(50.0));
    assert_eq!(
        second.experts.pinned(),
        0,
        "pinning waits for the first fetch"
    );
    let out = generate(&second, &reference.prompt_ids, &greedy_options(32)).unwrap();
    assert_eq!(out.generated_ids, reference.generated_ids);
    // Up to half the budget: 50% of 24 experts is 12, half of that 6.
    assert!(
        (1..=6).contains(&second.experts.pinned()),
        "{}",
        second.experts.pinned()
    );
    // Start-up reads are not the run's: the same run makes the same requests.
    assert_eq!(
        second.experts.stats().requests,
        first.experts.stats().requests
    );
    assert!(second.experts.stats().ram_hits > first.experts.stats().ram_hits);
    assert!(second.experts.cached_bytes() <= second.experts.budget());

    // Without hot experts nothing is pinned or saved.
    let plain = load(dir.path(), RamBudget::Percent(50.0));
    generate(&plain, &reference.prompt_ids, &greedy_options(4)).unwrap();
    assert_eq!(plain.experts.pinned(), 0);
}

#[test]
fn qwen3_tokens_hold_with_prefetch_at_every_distance_and_starved_budgets() {
    use picchio::model::{MmapMode, PrefetchOptions, PrefetchProxy};
    for dir in qwen3_fixture_dirs() {
        let reference = reference(&dir);
        let cases = [RamBudget::Bytes(0), RamBudget::Percent(25.0)]
            .into_iter()
            .flat_map(|budget| [PrefetchProxy::A, PrefetchProxy::B].map(|p| (budget, p)))
            .flat_map(|(budget, proxy)| (1..=3).map(move |d| (budget, proxy, d)));
        for (ram_budget, proxy, distance) in cases {
            let options = ModelOptions {
                ram_budget,
                io_threads: 3,
                // Mapped, so that per-expert tensors are read where the checkpoint has them.
                mmap: MmapMode::On,
                prefetch: PrefetchOptions {
                    enabled: true,
                    proxy,
                    distance,
                    measure_accuracy: true,
                },
                ..Default::default()
            };
            let model = Model::load_with(&dir, &options).unwrap();
            let out = generate(&model, &reference.prompt_ids, &greedy_options(32)).unwrap();
            let what = format!(
                "{} {ram_budget:?} {proxy:?} distance {distance}",
                dir.display()
            );
            assert_eq!(out.generated_ids, reference.generated_ids, "{what}");
            let s = model.experts.stats();
            assert!(s.prefetch.issued > 0, "{what}: nothing prefetched: {s:?}");
        }
    }
}
