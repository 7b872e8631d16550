//! The KV-memory policies, what one policy's run reports ([`PolicyResult`], with its
//! [`MemorySplit`]), the per-step statistics both kinds of policy record, and
//! [`simulate`], which runs one policy.

use serde::Serialize;

use super::contiguous::simulate_contiguous;
use super::paged::simulate_paged;
use super::{SimConfig, SimError, Workload};

/// A KV-memory policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// pagedkv's scheduler and block pool with this block size.
    Paged(u32),
    /// Reserve the model's maximum length per request.
    Max,
    /// Reserve the next power of two of the real final length.
    Pow2,
    /// Reserve exactly the real final length.
    Oracle,
}

impl Policy {
    /// Every policy, contiguous first.
    pub const ALL: [Policy; 6] = [
        Policy::Max,
        Policy::Pow2,
        Policy::Oracle,
        Policy::Paged(8),
        Policy::Paged(16),
        Policy::Paged(32),
    ];

    /// The report's name.
    pub fn name(self) -> String {
        match self {
            Policy::Paged(b) => format!("paged (block {b})"),
            Policy::Max => "contiguous Max".into(),
            Policy::Pow2 => "contiguous Pow2".into(),
            Policy::Oracle => "contiguous Oracle".into(),
        }
    }

    /// The paper's Fig. 2 token-states share for the matching system, if any.
    pub fn paper_token_share(self) -> Option<f64> {
        match self {
            Policy::Max => Some(0.204),
            Policy::Pow2 => Some(0.268),
            Policy::Oracle => Some(0.382),
            Policy::Paged(_) => Some(0.963),
        }
    }
}

/// Where the KV pool's slots are, as time-weighted shares of the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct MemorySplit {
    /// Slots holding a token's K/V.
    pub token_states: f64,
    /// Slots reserved for tokens a live request will still produce.
    pub reserved_future: f64,
    /// Held slots no token will ever fill.
    pub internal_fragmentation: f64,
    /// Slots nobody holds (holes between reservations, free blocks).
    pub external_and_free: f64,
}

/// One policy's results.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyResult {
    /// The policy's name.
    pub policy: String,
    /// Requests completed.
    pub completed: usize,
    /// Requests that could not run at all under this policy.
    pub rejected: usize,
    /// Simulated seconds until the last request finished.
    pub sim_seconds: f64,
    /// Completed requests per simulated second.
    pub requests_per_s: f64,
    /// Generated tokens per simulated second.
    pub tokens_per_s: f64,
    /// Mean running requests per step.
    pub mean_batch: f64,
    /// 99th percentile of running requests per step.
    pub p99_batch: f64,
    /// Preemptions.
    pub preemptions: u64,
    /// Memory split, time-weighted over busy steps.
    pub split: MemorySplit,
    /// Token states over slots held by requests.
    pub tokens_per_reserved: f64,
    /// `(time s, KV slots held / pool, running requests)`, at most ~600 points.
    pub timeline: Vec<(f64, f64, u32)>,
}

/// Accumulates per-step statistics.
pub(super) struct Stats {
    batch: Vec<u32>,
    split: MemorySplit,
    busy_time: f64,
    tokens_time: f64,
    held_time: f64,
    timeline: Vec<(f64, f64, u32)>,
}

impl Stats {
    pub(super) fn new() -> Self {
        Self {
            batch: Vec::new(),
            split: MemorySplit::default(),
            busy_time: 0.0,
            tokens_time: 0.0,
            held_time: 0.0,
            timeline: Vec::new(),
        }
    }

    /// One step of duration `dt` ending at `t`: slots of each kind, and the pool.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn record(
        &mut self,
        t: f64,
        dt: f64,
        running: u32,
        tokens: f64,
        future: f64,
        internal: f64,
        pool: f64,
    ) {
        self.batch.push(running);
        let held = tokens + future + internal;
        self.split.token_states += dt * tokens / pool;
        self.split.reserved_future += dt * future / pool;
        self.split.internal_fragmentation += dt * internal / pool;
        self.split.external_and_free += dt * (pool - held).max(0.0) / pool;
        self.busy_time += dt;
        self.tokens_time += dt * tokens;
        self.held_time += dt * held;
        self.timeline.push((t, held / pool, running));
    }

    pub(super) fn finish(
        mut self,
        policy: Policy,
        completed: usize,
        rejected: usize,
        end: f64,
        generated: u64,
        preemptions: u64,
    ) -> PolicyResult {
        let bt = self.busy_time.max(f64::MIN_POSITIVE);
        let s = &mut self.split;
        s.token_states /= bt;
        s.reserved_future /= bt;
        s.internal_fragmentation /= bt;
        s.external_and_free /= bt;
        let mean =
            self.batch.iter().map(|&b| b as f64).sum::<f64>() / self.batch.len().max(1) as f64;
        let mut sorted = self.batch.clone();
        sorted.sort_unstable();
        let p99 = sorted
            .get(((sorted.len() as f64 * 0.99).ceil() as usize).saturating_sub(1))
            .copied()
            .unwrap_or(0) as f64;
        let stride = self.timeline.len().div_ceil(600).max(1);
        let timeline = self.timeline.iter().step_by(stride).copied().collect();
        PolicyResult {
            policy: policy.name(),
            completed,
            rejected,
            sim_seconds: end,
            requests_per_s: completed as f64 / end.max(f64::MIN_POSITIVE),
            tokens_per_s: generated as f64 / end.max(f64::MIN_POSITIVE),
            mean_batch: mean,
            p99_batch: p99,
            preemptions,
            split: self.split,
            tokens_per_reserved: self.tokens_time / self.held_time.max(f64::MIN_POSITIVE),
            timeline,
        }
    }
}

/// Runs one policy over a workload. `on_finish` is called once per finished request
/// (for a progress bar).
pub fn simulate(
    policy: Policy,
    workload: &Workload,
    cfg: &SimConfig,
    on_finish: &mut dyn FnMut(),
) -> Result<PolicyResult, SimError> {
    match policy {
        Policy::Paged(bs) => simulate_paged(bs, workload, cfg, on_finish),
        _ => simulate_contiguous(policy, workload, cfg, on_finish),
    }
}
