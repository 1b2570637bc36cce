//! The server's counters, and `/metrics` in the Prometheus text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use crate::experts::ExpertStats;

/// What the server has done since it started.
#[derive(Default)]
pub struct Metrics {
    /// Responses by HTTP status.
    responses: Mutex<BTreeMap<u16, u64>>,
    prompt_tokens: AtomicU64,
    /// Prompt positions a request found in the session's cache.
    reused_tokens: AtomicU64,
    completion_tokens: AtomicU64,
    /// Microseconds the model spent on requests (prefill and generation).
    model_us: AtomicU64,
    /// Connections open now.
    connections: AtomicI64,
    /// Connections answered 503 because the server had its most open.
    refused_connections: AtomicU64,
}

impl Metrics {
    pub fn count_response(&self, status: u16) {
        let mut responses = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        *responses.entry(status).or_default() += 1;
    }

    /// A connection opened (+1) or closed (-1).
    pub fn count_connection(&self, change: i64) {
        self.connections.fetch_add(change, Ordering::Relaxed);
    }

    pub fn count_refused_connection(&self) {
        self.refused_connections.fetch_add(1, Ordering::Relaxed);
    }

    /// One request the model ran: its prompt, positions reused, tokens generated, time taken.
    pub fn count_request(&self, prompt: usize, reused: usize, generated: usize, micros: u64) {
        self.prompt_tokens
            .fetch_add(prompt as u64, Ordering::Relaxed);
        self.reused_tokens
            .fetch_add(reused as u64, Ordering::Relaxed);
        (self.completion_tokens).fetch_add(generated as u64, Ordering::Relaxed);
        self.model_us.fetch_add(micros, Ordering::Relaxed);
    }

    /// The Prometheus text exposition of these counters, the queue's depth and the expert
    /// store's counters.
    pub fn render(&self, queued: usize, experts: &ExpertStats) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP picchio_{name} {help}");
            let _ = writeln!(out, "# TYPE picchio_{name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "picchio_{name}{labels} {value}");
            }
        };
        let plain = |value: f64| vec![(String::new(), value)];
        let responses: Vec<(String, f64)> = (self.responses.lock())
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(status, n)| (format!("{{status=\"{status}\"}}"), *n as f64))
            .collect();
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed) as f64;
        let completion = load(&self.completion_tokens);
        let seconds = load(&self.model_us) / 1e6;
        metric(
            "http_responses_total",
            "counter",
            "HTTP responses by status.",
            &responses,
        );
        let prompt = plain(load(&self.prompt_tokens));
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of requests the model ran.",
            &prompt,
        );
        let reused = plain(load(&self.reused_tokens));
        metric(
            "reused_tokens_total",
            "counter",
            "Prompt positions found in the session's cache.",
            &reused,
        );
        let generated = plain(completion);
        metric(
            "completion_tokens_total",
            "counter",
            "Tokens generated.",
            &generated,
        );
        metric(
            "model_seconds_total",
            "counter",
            "Time the model spent on requests.",
            &plain(seconds),
        );
        let rate = if seconds > 0.0 {
            completion / seconds
        } else {
            0.0
        };
        metric(
            "tokens_per_second",
            "gauge",
            "Tokens generated per second of model time.",
            &plain(rate),
        );
        metric(
            "queue_depth",
            "gauge",
            "Requests waiting for the model.",
            &plain(queued as f64),
        );
        let open = self.connections.load(Ordering::Relaxed);
        metric(
            "http_connections",
            "gauge",
            "HTTP connections open.",
            &plain(open as f64),
        );
        let refused = plain(load(&self.refused_connections));
        metric(
            "http_connections_refused_total",
            "counter",
            "Connections answered 503 because the server had its most open.",
            &refused,
        );
        let experts = [
            (
                "expert_requests_total",
                "Experts the routing asked for.",
                experts.requests,
            ),
            (
                "expert_vram_hits_total",
                "Expert requests VRAM served.",
                experts.vram_hits,
            ),
            (
                "expert_ram_hits_total",
                "Expert requests the RAM cache served.",
                experts.ram_hits,
            ),
            (
                "expert_disk_reads_total",
                "Expert requests read from disk.",
                experts.disk_reads,
            ),
        ];
        for (name, help, value) in experts {
            metric(name, "counter", help, &plain(value as f64));
        }
        out
    }
}
