//! The KV-memory policies, what one policy's run reports ([`PolicyResult`], with its
//! [`MemorySplit`]), the per-step statistics both kinds of policy record, and
//! [`simulate`], which runs one policy.

use serde::Serialize;
use std::collections::BTreeMap;

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
    /// Mean end-to-end latency of the completed requests (arrival to the end of the
    /// step that produced the last token), seconds.
    pub mean_latency_s: f64,
    /// Mean over the completed requests of end-to-end latency divided by output
    /// tokens, seconds per token: the paper's *normalised latency* (Fig. 12).
    pub mean_normalized_latency: f64,
    /// Memory split, time-weighted over busy steps.
    pub split: MemorySplit,
    /// Token states over slots held by requests.
    pub tokens_per_reserved: f64,
    /// `(time s, KV slots held / pool, running requests)`, at most ~600 points.
    pub timeline: Vec<(f64, f64, u32)>,
    /// With a system prompt (`SimConfig::system_prompt`), the paged policies: the K/V
    /// bytes a decode step reads flat and as cascade attention (a model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cascade: Option<CascadeTraffic>,
}

/// K/V bytes per decode step, all layers, under flat and cascade attention, over the
/// steps that decode: a model from the real scheduler's block tables (the groups
/// `pagedkv::host::ops::cascade::find_groups` finds in each step's decode rows), each
/// group's shared blocks read once per CTA tile of query rows (`ceil(rows x query group
/// / tile)` times: 64 rows for the multi-warp prefill kernel, head_dim 64 or 128 at
/// block size 16; 16 for the one-warp kernel), every row's own tokens once. Every
/// group counts, as `CascadePolicy::Always` would run it. Step times still price flat
/// attention.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CascadeTraffic {
    /// Steps with decode rows.
    pub decode_steps: u64,
    /// Of them, steps where some rows shared a full block.
    pub cascade_steps: u64,
    /// Mean K/V bytes a decode step reads, flat.
    pub flat_bytes_per_step: f64,
    /// Mean K/V bytes a decode step reads as cascade attention.
    pub cascade_bytes_per_step: f64,
}

/// Accumulates per-step statistics.
pub(super) struct Stats {
    /// Steps of each batch size (the p99), their count and the sum of their sizes.
    batch: BTreeMap<u32, u64>,
    steps: u64,
    batch_sum: f64,
    split: MemorySplit,
    busy_time: f64,
    tokens_time: f64,
    held_time: f64,
    /// Every `stride`-th step's `(t, held / pool, running)`, at most
    /// [`TIMELINE_KEPT`] of them (the stride doubles as they fill).
    timeline: Vec<(f64, f64, u32)>,
    stride: u64,
    /// Sums over finished requests of latency and of latency per output token.
    latency_sum: f64,
    normalized_latency_sum: f64,
    finished: u64,
}

/// Timeline points kept while a policy runs: memory stays bounded whatever the length
/// of the workload (a 10^6-request trace is some 10^7 steps); the report keeps at most
/// 600 of them.
const TIMELINE_KEPT: usize = 1200;

impl Stats {
    pub(super) fn new() -> Self {
        Self {
            batch: BTreeMap::new(),
            steps: 0,
            batch_sum: 0.0,
            split: MemorySplit::default(),
            busy_time: 0.0,
            tokens_time: 0.0,
            held_time: 0.0,
            timeline: Vec::new(),
            stride: 1,
            latency_sum: 0.0,
            normalized_latency_sum: 0.0,
            finished: 0,
        }
    }

    /// A request that arrived at `arrival` finished at `t` after `output_tokens`
    /// tokens.
    pub(super) fn request_done(&mut self, arrival: f64, t: f64, output_tokens: u32) {
        let latency = t - arrival;
        self.latency_sum += latency;
        self.normalized_latency_sum += latency / output_tokens.max(1) as f64;
        self.finished += 1;
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
        let held = tokens + future + internal;
        self.split.token_states += dt * tokens / pool;
        self.split.reserved_future += dt * future / pool;
        self.split.internal_fragmentation += dt * internal / pool;
        self.split.external_and_free += dt * (pool - held).max(0.0) / pool;
        self.busy_time += dt;
        self.tokens_time += dt * tokens;
        self.held_time += dt * held;
        *self.batch.entry(running).or_default() += 1;
        self.batch_sum += running as f64;
        if self.steps.is_multiple_of(self.stride) {
            if self.timeline.len() == TIMELINE_KEPT {
                // Keep every other point (those of steps that are multiples of the new
                // stride), and from now on every other step.
                let mut keep = false;
                self.timeline.retain(|_| {
                    keep = !keep;
                    keep
                });
                self.stride *= 2;
            }
            if self.steps.is_multiple_of(self.stride) {
                self.timeline.push((t, held / pool, running));
            }
        }
        self.steps += 1;
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
        let mean = self.batch_sum / self.steps.max(1) as f64;
        // The batch size of the step at rank ceil(0.99 n) (1-based) in sorted order.
        let rank = ((self.steps as f64 * 0.99).ceil() as u64).max(1);
        let mut seen = 0;
        let p99 = self
            .batch
            .iter()
            .find(|&(_, &n)| {
                seen += n;
                seen >= rank
            })
            .map_or(0.0, |(&b, _)| b as f64);
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
            mean_latency_s: self.latency_sum / self.finished.max(1) as f64,
            mean_normalized_latency: self.normalized_latency_sum / self.finished.max(1) as f64,
            split: self.split,
            tokens_per_reserved: self.tokens_time / self.held_time.max(f64::MIN_POSITIVE),
            timeline,
            cascade: None,
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The streamed statistics hold a bounded amount whatever the number of steps
    /// (a 10^6-line trace once held some 9 KB a request, 4.3 GB in all, and aborted at
    /// 10^6 lines), and give the mean and p99 batch the whole list of steps gives.
    #[test]
    fn streamed_step_statistics_are_bounded_and_exact() {
        let mut s = Stats::new();
        let mut all = Vec::new();
        let mut x = 7u64;
        for i in 0..1_000_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let running = (x % 300) as u32 + (i / 100_000) as u32;
            all.push(running);
            s.record(i as f64, 1.0, running, 10.0, 0.0, 1.0, 100.0);
        }
        assert!(s.timeline.len() <= TIMELINE_KEPT, "{}", s.timeline.len());
        assert!(s.batch.len() <= 310, "{}", s.batch.len());
        // The kept points are every stride-th step's, in order.
        assert!(
            s.timeline
                .iter()
                .all(|p| (p.0 as u64).is_multiple_of(s.stride))
        );
        let mean = all.iter().map(|&b| b as f64).sum::<f64>() / all.len() as f64;
        let mut sorted = all.clone();
        sorted.sort_unstable();
        let p99 = sorted[(sorted.len() as f64 * 0.99).ceil() as usize - 1] as f64;
        let r = s.finish(Policy::Paged(16), 1, 0, 1.0, 1, 0);
        assert_eq!(r.mean_batch, mean);
        assert_eq!(r.p99_batch, p99);
        assert!(r.timeline.len() <= 600);
    }
}
