//! `picchio bench`: prefill and decode speed, cache hit rates and bytes moved, swept over memory
//! budgets, each run on a freshly loaded model.

use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::experts::{ExpertStats, RamBudget};
use crate::model::generate::{
    BackendChoice, GenerateOptions, Session, generate_observed, open_session,
};
use crate::model::gpu_tier::GpuTierOptions;
use crate::model::{Model, ModelOptions};

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub model: PathBuf,
    pub backend: BackendChoice,
    pub ram_budgets: Vec<RamBudget>,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub seed: u64,
}

/// One configuration's measurements. Rates over the decode phase unless named otherwise.
#[derive(Debug, Clone, Serialize)]
pub struct BenchRun {
    pub backend: String,
    pub ram_budget: String,
    pub ram_budget_bytes: u64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    /// RAM hits / expert requests in the decode phase (null when no expert went through RAM).
    pub ram_hit_rate: Option<f64>,
    pub disk_bytes_per_token: f64,
    /// Share of decode time spent waiting for expert reads.
    pub io_wait_share: f64,
    pub expert_requests: u64,
    pub evictions: u64,
    /// Peak resident memory during this run (Linux; null elsewhere).
    pub peak_rss_bytes: Option<u64>,
}

/// Resets the kernel's peak-RSS mark so each run reports its own peak (Linux); false where it
/// cannot, and the peak would then be the process's.
fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

/// A deterministic prompt of `n` ids below `vocab`.
fn prompt(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed ^ 0x5DEE_CE66_D1CE_4E5B;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % vocab as u64) as u32
        })
        .collect()
}

/// Runs every budget in turn; `progress(done, total)` after each.
pub fn run_bench(
    options: &BenchOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<BenchRun>> {
    if options.prompt_tokens == 0 || options.gen_tokens < 2 {
        return Err(Error::InvalidArgument(
            "bench needs --prompt-tokens of at least 1 and --gen-tokens of at least 2".into(),
        ));
    }
    let mut runs = Vec::new();
    for (done, budget) in options.ram_budgets.iter().enumerate() {
        let peak_is_this_runs = reset_peak_rss();
        let model = Model::load_with(
            &options.model,
            &ModelOptions {
                ram_budget: *budget,
                ..Default::default()
            },
        )?;
        let ids = prompt(options.prompt_tokens, model.config.vocab_size, options.seed);
        let context = options.prompt_tokens + options.gen_tokens;
        let gpu_options = GpuTierOptions {
            context,
            ..Default::default()
        };
        let mut session = open_session(&model, options.backend, &gpu_options)?;
        let generate_options = GenerateOptions {
            max_new_tokens: options.gen_tokens,
            top_logits: 0,
            stop_at_eos: false,
            context,
        };
        let mut marks: Vec<ExpertStats> = Vec::new();
        let started = Instant::now();
        let out = generate_observed(
            &mut session,
            &model.config,
            &ids,
            &generate_options,
            &mut |_, _| marks.push(model.experts.stats()),
        )?;
        log::debug!("run took {:.1} s", started.elapsed().as_secs_f64());
        let decode = marks[1].since(&marks[0]);
        let decoded = out.decode_tokens.max(1) as f64;
        runs.push(BenchRun {
            backend: session.backend().to_string(),
            ram_budget: format!("{budget:?}"),
            ram_budget_bytes: model.experts.budget(),
            prefill_tokens_per_s: options.prompt_tokens as f64
                / (out.prefill_ms.max(1e-6) / 1000.0),
            decode_tokens_per_s: out.decode_tokens_per_s().unwrap_or(0.0),
            ram_hit_rate: (decode.requests > 0)
                .then(|| decode.ram_hits as f64 / decode.requests as f64),
            disk_bytes_per_token: decode.disk_bytes as f64 / decoded,
            io_wait_share: if out.decode_ms > 0.0 {
                decode.io_wait_ms / out.decode_ms
            } else {
                0.0
            },
            expert_requests: decode.requests,
            evictions: decode.evictions,
            peak_rss_bytes: peak_is_this_runs.then(peak_rss_bytes).flatten(),
        });
        progress(done + 1, options.ram_budgets.len());
    }
    Ok(runs)
}

/// The runs as CSV, one row each.
pub fn to_csv(runs: &[BenchRun]) -> String {
    let mut out = String::from(
        "backend,ram_budget_bytes,prefill_tokens_per_s,decode_tokens_per_s,ram_hit_rate,disk_bytes_per_token,io_wait_share,peak_rss_bytes\n",
    );
    for r in runs {
        out.push_str(&format!(
            "{},{},{:.4},{:.4},{},{:.0},{:.4},{}\n",
            r.backend,
            r.ram_budget_bytes,
            r.prefill_tokens_per_s,
            r.decode_tokens_per_s,
            r.ram_hit_rate.map_or(String::new(), |h| format!("{h:.4}")),
            r.disk_bytes_per_token,
            r.io_wait_share,
            r.peak_rss_bytes.map_or(String::new(), |b| b.to_string()),
        ));
    }
    out
}

/// An SVG of decode tokens/s and RAM hit rate against the RAM budget.
pub fn plot_svg(runs: &[BenchRun], path: &Path) -> Result<()> {
    use plotters::prelude::*;
    let fail = |e: &dyn std::fmt::Display| Error::io(path, std::io::Error::other(e.to_string()));
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let max_budget = runs
        .iter()
        .map(|r| gib(r.ram_budget_bytes))
        .fold(0.0, f64::max)
        .max(1e-3);
    let max_rate = runs
        .iter()
        .map(|r| r.decode_tokens_per_s)
        .fold(0.0, f64::max)
        .max(1e-3);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "decode speed and RAM hit rate vs RAM budget",
            ("sans-serif", 20),
        )
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .right_y_label_area_size(56)
        .build_cartesian_2d(0.0..max_budget * 1.05, 0.0..max_rate * 1.1)
        .map_err(|e| fail(&e))?
        .set_secondary_coord(0.0..max_budget * 1.05, 0.0..1.05);
    chart
        .configure_mesh()
        .x_desc("RAM budget (GiB)")
        .y_desc("decode tokens/s")
        .draw()
        .map_err(|e| fail(&e))?;
    chart
        .configure_secondary_axes()
        .y_desc("RAM hit rate")
        .draw()
        .map_err(|e| fail(&e))?;
    let mut runs: Vec<&BenchRun> = runs.iter().collect();
    runs.sort_by_key(|r| r.ram_budget_bytes);
    let speed: Vec<(f64, f64)> = runs
        .iter()
        .map(|r| (gib(r.ram_budget_bytes), r.decode_tokens_per_s))
        .collect();
    // Runs without RAM traffic (the GPU tier) have no hit rate to draw.
    let hits: Vec<(f64, f64)> = runs
        .iter()
        .filter_map(|r| Some((gib(r.ram_budget_bytes), r.ram_hit_rate?)))
        .collect();
    chart
        .draw_series(LineSeries::new(speed, &BLUE))
        .map_err(|e| fail(&e))?
        .label("decode tokens/s")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
    chart
        .draw_secondary_series(LineSeries::new(hits, &RED))
        .map_err(|e| fail(&e))?
        .label("RAM hit rate")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| fail(&e))?;
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}
