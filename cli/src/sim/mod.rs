//! A discrete-event simulation of an LLM server, to show what paged KV memory buys.
//!
//! Requests arrive (Poisson at a rate, or from a trace), are admitted, decode one token
//! per step and finish. The same workload runs under several KV-memory policies:
//!
//! * **paged** (block sizes 8, 16, 32): pagedkv's real
//!   [`Scheduler`](pagedkv::host::scheduler::Scheduler) and block pool;
//! * **contiguous reservation**, as in Orca: each request reserves one contiguous range
//!   of token slots when admitted, first fit, and keeps it until it finishes:
//!   **Max** reserves the model's maximum length, **Pow2** the next power of two of the
//!   request's real final length, **Oracle** exactly the real final length.
//!
//! # The step-time model (a roofline)
//! A decode step reads every weight once and every cached K/V byte of the batch once:
//! `t_mem = (weight_bytes + kv_bytes_read) / (bandwidth * bandwidth_efficiency)`. It
//! also does `2 * params` FLOPs per processed token:
//! `t_compute = 2 * params * tokens / (peak_flops * flops_efficiency)`. A step takes
//! `max(t_mem, t_compute) + step_overhead`. A step that also computes prompt tokens is,
//! by default, a prefill pass followed by the decode pass, each priced so
//! ([`PrefillModel::Separate`]: the 2023 systems the paper measured ran prompts apart
//! from decodes, which waited), or one pass over all its tokens
//! ([`PrefillModel::Mixed`]: chunked prefill, as current engines batch them). The
//! defaults (80% of the datasheet bandwidth, 50% of the dense peak, 5 ms of per-step
//! overhead for sampling, scheduling and launches) are stated in [`SimConfig`]; every
//! figure the report prints comes from this model and the policies' real admission
//! decisions, not from the paper.
//!
//! # Memory accounting (averaged over time, weighted by step duration)
//! Of the whole KV pool, at every step: *token states* (slots holding a token's K/V),
//! *reserved for future tokens* (contiguous only: slots a live request will still fill),
//! *internal fragmentation* (reserved slots no token will ever fill: the tail of a
//! contiguous reservation, the unfilled part of a paged sequence's last block), and
//! *external fragmentation and free* (slots nobody holds). "tokens / reserved" is token
//! states over the slots held by requests.
//!
//! # Source layout
//! The code is cut by concern into private modules, each public item re-exported here
//! (`pagedkv_cli::sim::X`): `workload` (requests, synthetic workloads, JSONL traces), `spec`
//! (GPU and model specs, [`SimConfig`] and the step-time model), `policy` ([`Policy`],
//! [`PolicyResult`], [`simulate`]), `contiguous` and `paged` (the two kinds of policy),
//! `report` ([`ScenarioReport`], its table, the paper's figures), and `sweep` (the
//! paper's Fig. 12: normalised latency against request rate, [`sweep`]).

mod contiguous;
mod paged;
mod policy;
mod report;
mod spec;
mod sweep;
mod workload;

pub use policy::{MemorySplit, Policy, PolicyResult, simulate};
pub use report::{
    DtypeRow, HybridComparison, HybridRequest, HybridRow, KvDtypeComparison, PolicyReport,
    ScenarioReport, binary_size, paper_batch, run_scenario, run_scenario_kv_dtypes,
};
pub use spec::{
    GpuSpec, KvDtype, KvFootprint, ModelSpec, PrefillModel, RequestKv, SimConfig, StepLoad,
};
pub use sweep::{
    AUTO_GRID_POINTS, MAX_EXTENSIONS, PaperFig12, PolicySweep, SWEEP_POLICIES, SweepConfig,
    SweepPoint, SweepReport, sweep,
};
pub use workload::{LENGTH_SIGMA, TraceRequest, Workload, WorkloadKind};

/// An error of the simulator's inputs, with what it is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimError(pub String);

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

pub(crate) fn err<T>(msg: impl Into<String>) -> Result<T, SimError> {
    Err(SimError(msg.into()))
}

/// The ranges the simulator accepts. Outside them a run would mean nothing (a GPU with
/// a bandwidth of 1e-320 GB/s) or overflow what it computes (times beyond `f64`, a pool
/// too large to hold in memory); each is an error naming the flag, never a NaN in a
/// report or a hung plot.
pub mod limits {
    use std::ops::RangeInclusive;

    /// `--rate`, requests per second.
    pub const RATE: RangeInclusive<f64> = 1e-6..=1e6;
    /// `--bandwidth-gbs`, GB/s.
    pub const BANDWIDTH_GBS: RangeInclusive<f64> = 1e-3..=1e6;
    /// `--memory-gib` (GPU memory), GiB.
    pub const MEMORY_GIB: RangeInclusive<f64> = 1e-3..=1e6;
    /// `--kv-budget-gib`, GiB.
    pub const KV_BUDGET_GIB: RangeInclusive<f64> = 1e-6..=1e6;
    /// Dense peak of a GPU, TFLOP/s.
    pub const TFLOPS: RangeInclusive<f64> = 1e-3..=1e6;
    /// A model's parameter count.
    pub const NUM_PARAMS: RangeInclusive<f64> = 1.0..=1e15;
    /// A model's stored weight bytes (`stored_weight_bytes`).
    pub const WEIGHT_BYTES: RangeInclusive<f64> = 1.0..=1e16;
    /// Requests of one workload (`--num-requests`, lines of a trace).
    pub const MAX_REQUESTS: usize = 1_000_000;
    /// KV token slots the simulator can hold (the pool is simulated block by block).
    pub const MAX_TOKEN_SLOTS: u64 = 1 << 24;
    /// Tokens (prompt + output) of the requests the paged policies' scheduler holds at
    /// once, running or waiting (it keeps each one's tokens, some 8 bytes a token: at
    /// most about 256 MiB). Requests that arrived wait outside it, holding nothing,
    /// until it could admit them, so only running requests and the few it could admit
    /// next count.
    pub const MAX_LIVE_TOKENS: u64 = 1 << 25;
    /// A trace's latest arrival time, seconds (about 31.7 years).
    pub const MAX_ARRIVAL_S: f64 = 1e9;
    /// Bytes of one trace line (a line is three numbers).
    pub const MAX_TRACE_LINE_BYTES: usize = 4096;
}

/// `v`, or an error naming `flag` when it is not a number within `range`.
pub fn check_range(
    flag: &str,
    v: f64,
    range: std::ops::RangeInclusive<f64>,
) -> Result<f64, SimError> {
    if range.contains(&v) {
        Ok(v)
    } else {
        err(format!(
            "{flag}: {} is outside the range this simulator accepts ({:e} to {:e})",
            short(v),
            range.start(),
            range.end()
        ))
    }
}

/// `v` as a user typed it when it is ordinary, in scientific notation when tiny or huge.
fn short(v: f64) -> String {
    if v == 0.0 || !v.is_finite() || (1e-4..1e9).contains(&v.abs()) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}
