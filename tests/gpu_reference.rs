//! L1/L2 for the GPU tier: on every fixture, 32 greedy GPU ids identical to transformers and to
//! the CPU tier, logits within tolerance, full A/B agreement, one submission and one readback per
//! decoded token, and a lost device falling back to the CPU without changing the tokens.

mod common;

use common::*;
use picchio::Model;
use picchio::model::ab::compare_tiers;
use picchio::model::generate::{FallbackSession, Session, generate_observed, generate_with};
use picchio::model::gpu_tier::{GpuModel, GpuTierOptions};

/// GPU logits against float32 transformers (f32 accumulation, other summation orders).
const LOGIT_ATOL: f32 = 1e-3;

fn gpu_model(model: &Model, max_block: usize) -> Option<GpuModel<'_>> {
    let options = GpuTierOptions {
        max_block,
        ..gpu_options()
    };
    gpu_session(model, options)
}

#[test]
fn gpu_greedy_tokens_and_logits_match_transformers() {
    for dir in every_family_fixture_dirs() {
        let model = Model::load(&dir).unwrap();
        let reference = reference(&dir);
        let Some(mut gpu) = gpu_model(&model, 128) else {
            return;
        };
        let mut marks = Vec::new();
        let out = generate_observed(
            &mut gpu,
            &model.config,
            &reference.prompt_ids,
            &greedy_options(32),
            &mut |s, _| marks.push(s.gpu_counters().unwrap()),
        )
        .unwrap();
        assert_eq!(
            out.generated_ids,
            reference.generated_ids,
            "{}",
            dir.display()
        );
        let mut worst = 0f32;
        for (step, (got, want)) in out.steps.iter().zip(&reference.steps).enumerate() {
            // By id: near-ties may order differently within the top 10.
            for (id, logit) in &want.top {
                if let Some((_, ours)) = got.top.iter().find(|(i, _)| i == id) {
                    let err = (ours - logit).abs();
                    assert!(
                        err <= LOGIT_ATOL,
                        "{} step {step} id {id}: {ours} vs {logit}",
                        dir.display()
                    );
                    worst = worst.max(err);
                }
            }
        }
        // Decode phase: one submission and one readback per token.
        let decoded = out.decode_tokens as u64;
        assert_eq!(marks[1].submits - marks[0].submits, decoded, "submissions");
        assert_eq!(
            marks[1].readbacks - marks[0].readbacks,
            decoded,
            "readbacks"
        );
        // Each token's commands were recorded while the GPU ran the one before.
        assert_eq!(
            marks[1].prerecorded - marks[0].prerecorded,
            decoded,
            "decode steps recorded ahead"
        );
        // Every decoded token records the same resident plan.
        let dispatches = marks[1].dispatches - marks[0].dispatches;
        assert!(
            dispatches > 0 && dispatches % decoded == 0,
            "{dispatches} dispatches for {decoded} tokens"
        );
        eprintln!(
            "{}: GPU max |logit error| vs transformers {worst:e}; {} dispatches and {} copies per decoded token",
            dir.display(),
            dispatches / decoded,
            (marks[1].copies - marks[0].copies) as f64 / decoded as f64
        );
    }
}

/// `ab` against the GPU tier and against the CPU tier as sessions run it (every position kept).
#[test]
fn ab_reports_full_agreement() {
    use picchio::model::generate::BackendChoice;
    for dir in every_family_fixture_dirs() {
        if gpu(None).is_none() {
            return;
        }
        let model = Model::load(&dir).unwrap();
        let reference = reference(&dir);
        for (choice, tested) in [(BackendChoice::Gpu, "gpu"), (BackendChoice::Cpu, "cpu")] {
            let report = compare_tiers(
                &model,
                &reference.prompt_ids,
                32,
                choice,
                &GpuTierOptions::default(),
            )
            .unwrap();
            assert_eq!(report.backend, tested);
            assert!(report.agree(), "{}: {report:?}", dir.display());
            assert_eq!(report.tokens_agreeing, 32);
            assert_eq!(report.gpu_ids, reference.generated_ids);
            assert!(
                report.max_logit_difference <= LOGIT_ATOL,
                "{}",
                report.max_logit_difference
            );
        }
    }
}

#[test]
fn prefill_in_small_blocks_gives_the_same_tokens() {
    // Blocks of 5 cross every window (ring of window + 4 slots) and the KV store in pieces.
    for dir in every_family_fixture_dirs() {
        let model = Model::load(&dir).unwrap();
        let reference = reference(&dir);
        let Some(mut gpu) = gpu_model(&model, 5) else {
            return;
        };
        let out = generate_with(
            &mut gpu,
            &model.config,
            &reference.prompt_ids,
            &greedy_options(12),
        )
        .unwrap();
        assert_eq!(
            out.generated_ids,
            reference.generated_ids[..12],
            "{}",
            dir.display()
        );
    }
}

#[test]
fn long_generation_grows_the_gpu_kv_cache() {
    // 300 positions: past the full layers' first 256-slot allocation.
    let dir = fixtures_dir().join("tiny-single");
    let model = Model::load(&dir).unwrap();
    let prompt = reference(&dir).prompt_ids;
    let Some(mut gpu) = gpu_model(&model, 128) else {
        return;
    };
    let mut opts = greedy_options(288);
    opts.top_logits = 0;
    let on_gpu = generate_with(&mut gpu, &model.config, &prompt, &opts).unwrap();
    let on_cpu = picchio::model::generate::generate(&model, &prompt, &opts).unwrap();
    assert_eq!(on_gpu.generated_ids, on_cpu.generated_ids);
}

#[test]
fn lost_device_falls_back_to_the_cpu_tier() {
    let dir = fixtures_dir().join("tiny-long");
    let model = Model::load(&dir).unwrap();
    let reference = reference(&dir);
    let Some(gpu) = gpu_model(&model, 128) else {
        return;
    };
    let mut session = FallbackSession::new(&model, gpu, 4096);
    let mut ids = Vec::new();
    let mut step = session.feed(&reference.prompt_ids, 0).unwrap();
    for i in 0..32 {
        ids.push(step.id);
        if i == 10 {
            // What a driver reset looks like to wgpu.
            session.gpu().unwrap().ctx().device.destroy();
        }
        if i < 31 {
            step = session.feed(&[step.id], 0).unwrap();
        }
    }
    assert_eq!(session.backend(), "cpu");
    assert_eq!(ids, reference.generated_ids);
}

#[test]
fn debug_mode_submits_per_kernel_and_changes_nothing() {
    let dir = fixtures_dir().join("tiny-sharded");
    let model = Model::load(&dir).unwrap();
    let reference = reference(&dir);
    let Some(mut gpu) = gpu_model(&model, 128) else {
        return;
    };
    gpu.set_debug(true);
    let out = generate_with(
        &mut gpu,
        &model.config,
        &reference.prompt_ids,
        &greedy_options(4),
    )
    .unwrap();
    assert_eq!(out.generated_ids, reference.generated_ids[..4]);
    // Many submissions per token, each checked.
    assert!(gpu.counters.submits > 4 * 20, "{:?}", gpu.counters);
}

#[test]
fn routing_traced_block_by_block_matches_the_cpu() {
    // A 120-token prompt traced in blocks of 16, as `picchio ab` does for long prompts.
    let dir = fixtures_dir().join("tiny-long");
    let model = Model::load(&dir).unwrap();
    let prompt = reference(&dir).prompt_ids;
    let Some(mut gpu) = gpu_model(&model, 16) else {
        return;
    };
    let routing = gpu.trace_routing(&prompt).unwrap();
    let mut cache = model.new_cache(4096);
    let mut trace = Vec::new();
    model
        .forward(&mut cache, &prompt, Some(&mut trace))
        .unwrap();
    for (l, (gpu_layer, cpu_layer)) in routing.iter().zip(&trace).enumerate() {
        assert_eq!(gpu_layer.len(), prompt.len());
        for (t, (g, c)) in gpu_layer.iter().zip(&cpu_layer.routings).enumerate() {
            let c: Vec<u32> = c.experts.iter().map(|e| *e as u32).collect();
            assert_eq!(g, &c, "layer {l} position {t}");
        }
    }
}

#[test]
fn a_gpu_that_cannot_go_on_hands_over_to_the_cpu_tier() {
    // 32 KiB bindings: tiny-single's full-attention KV cache (128 B per position) holds at most
    // 256 positions on this "GPU", so a 300-position run must finish on the CPU tier.
    let dir = fixtures_dir().join("tiny-single");
    let model = Model::load(&dir).unwrap();
    let prompt = reference(&dir).prompt_ids;
    let Some(ctx) = gpu(Some(32 * 1024)) else {
        return;
    };
    let options = GpuTierOptions {
        context: 4096,
        max_block: 8,
        top_logits: 2,
        ..Default::default()
    };
    let gpu = GpuModel::new(ctx, &model, options).unwrap();
    let mut session = FallbackSession::new(&model, gpu, 4096);
    let mut opts = greedy_options(288);
    opts.top_logits = 0;
    let mixed = generate_with(&mut session, &model.config, &prompt, &opts).unwrap();
    assert_eq!(session.backend(), "cpu");
    let on_cpu = picchio::model::generate::generate(&model, &prompt, &opts).unwrap();
    assert_eq!(mixed.generated_ids, on_cpu.generated_ids);
}

#[test]
fn experts_laid_out_for_the_cpu_tier_are_refused_by_the_gpu_tier() {
    use picchio::model::{MmapMode, ModelOptions};
    let Some(ctx) = gpu(None) else {
        return;
    };
    if picchio::cpu::simd::mxfp4_interleaved_dot().is_none() {
        return; // Nothing is interleaved on this CPU: the GPU tier reads every expert.
    }
    let dir = fixtures_dir().join("tiny-long");
    let options = ModelOptions {
        mmap: MmapMode::Off,
        interleave_experts: true,
        ..Default::default()
    };
    let model = Model::load_with(&dir, &options).unwrap();
    let error = GpuModel::new(ctx, &model, gpu_options())
        .err()
        .expect("the GPU tier cannot read interleaved experts");
    assert!(error.to_string().contains("CPU tier only"), "{error}");
    assert!(model.cpu_only_mode().is_some());
}

#[test]
fn both_tiers_run_the_same_layer_ops() {
    // Qwen3-MoE's layers have two more ops: the per-head norms of the queries and keys.
    let families = [
        (fixtures_dir().join("tiny-routed"), 11),
        (qwen3_fixture_dirs()[0].clone(), 13),
    ];
    for (dir, per_layer) in families {
        let model = Model::load(&dir).unwrap();
        let Some(gpu) = gpu_model(&model, 8) else {
            return;
        };
        let tokens = [3, 1, 4, 1, 5];
        let cpu_ops = model.layer_ops(&tokens).unwrap();
        let gpu_ops = gpu.layer_ops(tokens.len()).unwrap();
        // Per layer: two norms, two projections, two ropes, attention, two adds (residual and
        // combine), route, experts; head norms where the family has them.
        assert_eq!(cpu_ops.len(), model.config.num_layers * per_layer);
        assert_eq!(cpu_ops, gpu_ops, "{}", dir.display());
    }
    let dir = fixtures_dir().join("tiny-routed");
    let model = Model::load(&dir).unwrap();
    let cpu_ops = model.layer_ops(&[3, 1, 4, 1, 5]).unwrap();
    let attention: Vec<&str> = cpu_ops
        .iter()
        .filter(|op| op.op.starts_with("attention"))
        .map(|op| op.op.as_str())
        .collect();
    assert!(
        attention.iter().any(|op| op.contains("Some")),
        "{attention:?}"
    );
    assert!(
        attention.iter().any(|op| op.contains("None")),
        "{attention:?}"
    );
}

/// Runs `turns` (positions to keep, ids after them) on `session`, each followed by `new_tokens`
/// sampled with `sampling` (its seed plus the turn's number); `before` runs ahead of each turn
/// with the turn's number. Returns every token generated.
fn sampled_turns(
    session: &mut picchio::model::session::ChatSession,
    turns: &[(usize, Vec<u32>)],
    sampling: picchio::model::sampler::SamplingOptions,
    new_tokens: usize,
    before: impl Fn(&picchio::model::session::ChatSession, usize),
) -> Vec<u32> {
    let mut out = Vec::new();
    for (turn, (keep, ids)) in turns.iter().enumerate() {
        before(session, turn);
        session.extend(*keep, ids).unwrap();
        let mut sampler =
            picchio::model::sampler::Sampler::new(picchio::model::sampler::SamplingOptions {
                seed: sampling.seed + turn as u64,
                ..sampling
            });
        let (tokens, _) = session
            .generate(new_tokens, &mut sampler, &[], |_| true)
            .unwrap();
        out.extend(tokens);
    }
    out
}

/// A chat session on the GPU cuts its cache back to a kept prefix like the CPU tier's, and one
/// whose device is lost mid-conversation goes on on the CPU tier with the same tokens.
#[test]
fn gpu_chat_sessions_truncate_and_survive_a_lost_device() {
    use picchio::model::generate::{BackendChoice, SessionTier};
    use picchio::model::sampler::SamplingOptions;
    use picchio::model::session::ChatSession;
    let dir = fixtures_dir().join("tiny-routed");
    let model = Model::load(&dir).unwrap();
    if gpu(None).is_none() {
        return;
    }
    let tier = |backend| SessionTier {
        backend,
        gpu: gpu_options(),
    };
    let sampling = SamplingOptions {
        temperature: 0.8,
        top_p: 0.95,
        seed: 7,
        ..Default::default()
    };
    // Three turns: a prompt, a turn keeping part of it, a turn after the device is gone.
    let turns = [(0, vec![3, 1, 4, 1, 5]), (3, vec![9, 2]), (6, vec![6])];
    let converse = |session: &mut ChatSession, lose_device: bool| -> Vec<u32> {
        sampled_turns(session, &turns, sampling, 4, |session, turn| {
            if lose_device && turn == 2 {
                session.tier().gpu().unwrap().ctx().device.destroy();
            }
        })
    };
    let mut cpu = ChatSession::open(&model, &tier(BackendChoice::Cpu), 256).unwrap();
    let mut gpu = ChatSession::open(&model, &tier(BackendChoice::Gpu), 256).unwrap();
    assert_eq!(gpu.tier().backend(), "gpu");
    let on_cpu = converse(&mut cpu, false);
    let on_gpu = converse(&mut gpu, true);
    assert_eq!(gpu.tier().backend(), "cpu", "the lost device handed over");
    assert_eq!(on_gpu, on_cpu);
    assert_eq!(gpu.position(), cpu.position());
}

/// Sessions opened in one runtime share the weights uploaded once (and, with a VRAM cache, its
/// slots), yet each keeps its own cache: two conversations run side by side on two threads give
/// the tokens each gives alone on the CPU tier.
#[test]
fn sessions_of_one_runtime_share_the_weights_and_keep_their_own_caches() {
    use picchio::experts::VramBudget;
    use picchio::model::generate::{BackendChoice, Runtime};
    use picchio::model::gpu_tier::MissPolicy;
    use picchio::model::sampler::SamplingOptions;
    use picchio::model::session::ChatSession;
    let dir = fixtures_dir().join("tiny-routed");
    let model = Model::load(&dir).unwrap();
    if gpu(None).is_none() {
        return;
    }
    let sampling = SamplingOptions {
        temperature: 0.8,
        ..Default::default()
    };
    let converse = |session: &mut ChatSession, first: u32| -> Vec<u32> {
        let turns = [(0, vec![first, 1, 4, 1, 5]), (3, vec![9, 2]), (6, vec![6])];
        sampled_turns(session, &turns, sampling, 5, |_, _| {})
    };
    let cpu = Runtime::open(&model, BackendChoice::Cpu, &gpu_options()).unwrap();
    let alone: Vec<Vec<u32>> = [3, 7]
        .map(|first| converse(&mut ChatSession::in_runtime(&cpu, 256).unwrap(), first))
        .into();
    for vram_budget in [VramBudget::Auto, VramBudget::Percent(25.0)] {
        let options = GpuTierOptions {
            vram_budget,
            miss_policy: MissPolicy::Upload,
            ..gpu_options()
        };
        let runtime = Runtime::open(&model, BackendChoice::Gpu, &options).unwrap();
        let weights = runtime.gpu().expect("on the GPU");
        let uploaded = weights.ctx.uploads.total_bytes();
        let mut sessions: Vec<ChatSession> = (0..2)
            .map(|_| ChatSession::in_runtime(&runtime, 256).unwrap())
            .collect();
        assert_eq!(
            weights.ctx.uploads.total_bytes(),
            uploaded,
            "no second upload"
        );
        for session in &sessions {
            let on = session.tier().gpu().expect("a GPU session").weights();
            assert!(std::sync::Arc::ptr_eq(on, weights));
        }
        let side_by_side: Vec<Vec<u32>> = std::thread::scope(|scope| {
            let runs: Vec<_> = sessions
                .iter_mut()
                .zip([3, 7])
                .map(|(session, first)| scope.spawn(move || converse(session, first)))
                .collect();
            runs.into_iter().map(|run| run.join().unwrap()).collect()
        });
        assert_eq!(side_by_side, alone, "{vram_budget:?}");
    }
}

/// A profiled run (`generate --profile`) stamps every dispatch it records, gives each kernel
/// some device time, and changes no token.
#[test]
fn a_profile_times_every_dispatch_and_changes_no_token() {
    let dir = fixtures_dir().join("tiny-routed");
    let model = Model::load(&dir).unwrap();
    let reference = reference(&dir);
    let options = GpuTierOptions {
        profile: true,
        ..gpu_options()
    };
    let Some(mut gpu) = gpu_session(&model, options) else {
        return;
    };
    let out = generate_with(
        &mut gpu,
        &model.config,
        &reference.prompt_ids,
        &greedy_options(8),
    )
    .unwrap();
    assert_eq!(out.generated_ids, reference.generated_ids[..8]);
    let profile = gpu.profile().unwrap();
    let stamped: u64 = profile.kernels.values().map(|k| k.calls).sum();
    assert_eq!(profile.unstamped, 0);
    assert_eq!(stamped, gpu.counters.dispatches, "{profile:?}");
    assert!(
        profile.kernels.contains_key("experts.wgsl:gate_up_swiglu"),
        "{profile:?}"
    );
    assert!(profile.total_ns() > 0.0, "{profile:?}");
}

/// A prompt block's experts grouped by expert (the default on hardware adapters only) give
/// transformers' tokens, as the per-pair kernels do; the grouped plan differs where a fixture's
/// prompt has enough pairs per expert (down and combine are then two kernels, not one).
#[test]
fn prompt_experts_grouped_by_expert_give_transformers_tokens() {
    let mut grouped_somewhere = false;
    for dir in every_family_fixture_dirs() {
        let model = Model::load(&dir).unwrap();
        let reference = reference(&dir);
        let mut prefill_dispatches = Vec::new();
        for grouped in [false, true] {
            let options = GpuTierOptions {
                group_prompt_experts: Some(grouped),
                ..gpu_options()
            };
            let Some(mut gpu) = gpu_session(&model, options) else {
                return;
            };
            let mut marks = Vec::new();
            let out = generate_observed(
                &mut gpu,
                &model.config,
                &reference.prompt_ids,
                &greedy_options(8),
                &mut |s, _| marks.push(s.gpu_counters().unwrap()),
            )
            .unwrap();
            assert_eq!(
                out.generated_ids,
                reference.generated_ids[..8],
                "{} grouped {grouped}",
                dir.display()
            );
            prefill_dispatches.push(marks[0].dispatches);
        }
        grouped_somewhere |= prefill_dispatches[1] > prefill_dispatches[0];
    }
    assert!(grouped_somewhere, "no fixture's prompt ran grouped");
}

/// The f16 KV cache (`--kv-cache f16`): both tiers round keys and values alike, so they give the
/// same tokens on every fixture, over a long generation too (decode keys split across
/// workgroups); whether those are still transformers' tokens is reported, not required.
#[test]
fn f16_kv_cache_gives_the_same_tokens_on_both_tiers() {
    let options = picchio::model::ModelOptions {
        kv_format: picchio::formats::KvFormat::F16,
        ..Default::default()
    };
    for dir in every_family_fixture_dirs() {
        let model = Model::load_with(&dir, &options).unwrap();
        let reference = reference(&dir);
        let Some(mut gpu) = gpu_model(&model, 128) else {
            return;
        };
        let long = dir.ends_with("tiny-single");
        let mut opts = greedy_options(if long { 288 } else { 32 });
        opts.top_logits = 0;
        let prompt = &reference.prompt_ids;
        let on_gpu = generate_with(&mut gpu, &model.config, prompt, &opts).unwrap();
        let on_cpu = picchio::model::generate::generate(&model, prompt, &opts).unwrap();
        assert_eq!(
            on_gpu.generated_ids,
            on_cpu.generated_ids,
            "{}",
            dir.display()
        );
        let agree = on_gpu
            .generated_ids
            .iter()
            .zip(&reference.generated_ids)
            .take_while(|(ours, theirs)| ours == theirs)
            .count();
        eprintln!(
            "{}: f16 cache, first {agree} of {} ids as transformers'",
            dir.display(),
            reference.generated_ids.len()
        );
    }
}
