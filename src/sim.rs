//! A discrete-event simulation of an LLM server, to show what paged KV memory buys.
//!
//! Requests arrive (Poisson at a rate, or from a trace), are admitted, decode one token
//! per step and finish. The same workload runs under several KV-memory policies:
//!
//! * **paged** (block sizes 8, 16, 32): pagedkv's real [`Scheduler`] and block pool;
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
//! `max(t_mem, t_compute) + step_overhead`. The defaults (80% of the datasheet bandwidth,
//! 50% of the dense peak, 5 ms of per-step overhead for sampling, scheduling and
//! launches) are stated in [`SimConfig`]; every figure the report prints comes from this
//! model and the policies' real admission decisions, not from the paper.
//!
//! # Memory accounting (averaged over time, weighted by step duration)
//! Of the whole KV pool, at every step: *token states* (slots holding a token's K/V),
//! *reserved for future tokens* (contiguous only: slots a live request will still fill),
//! *internal fragmentation* (reserved slots no token will ever fill: the tail of a
//! contiguous reservation, the unfilled part of a paged sequence's last block), and
//! *external fragmentation and free* (slots nobody holds). "tokens / reserved" is token
//! states over the slots held by requests.

use std::collections::{BTreeMap, VecDeque};
use std::fmt::Write as _;
use std::path::Path;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::{Distribution, Exp, LogNormal};
use serde::{Deserialize, Serialize};

use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};

/// An error of the simulator's inputs, with what it is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimError(pub String);

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SimError {}

fn err<T>(msg: impl Into<String>) -> Result<T, SimError> {
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
    /// Requests of one workload (`--num-requests`, lines of a trace).
    pub const MAX_REQUESTS: usize = 1_000_000;
    /// KV token slots the simulator can hold (the pool is simulated block by block).
    pub const MAX_TOKEN_SLOTS: u64 = 1 << 24;
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

/// A GPU: memory, bandwidth and dense 16-bit peak.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// Name for the report.
    pub name: String,
    /// Device memory, GiB.
    pub memory_gib: f64,
    /// Memory bandwidth (datasheet), GB/s.
    pub bandwidth_gbs: f64,
    /// Dense 16-bit matrix peak (datasheet), TFLOP/s.
    pub tflops: f64,
}

impl GpuSpec {
    /// The presets: `a100-40gb`, `h100`, `h200` (datasheet figures).
    pub fn preset(name: &str) -> Result<Self, SimError> {
        let (memory_gib, bandwidth_gbs, tflops) = match name {
            "a100-40gb" => (40.0, 1555.0, 312.0),
            "h100" => (80.0, 3350.0, 989.0),
            "h200" => (141e9 / (1u64 << 30) as f64, 4800.0, 989.0),
            other => {
                return err(format!(
                    "--gpu: unknown preset `{other}` (one of a100-40gb, h100, h200)"
                ));
            }
        };
        Ok(Self {
            name: name.to_string(),
            memory_gib,
            bandwidth_gbs,
            tflops,
        })
    }
}

/// A model: the shapes that set KV bytes per token, and the weight size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Name for the report.
    pub name: String,
    /// Transformer layers.
    pub num_layers: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Parameters.
    pub num_params: f64,
    /// Bytes per weight and per cached element.
    pub dtype_bytes: u32,
    /// Longest sequence (prompt + output).
    pub max_model_len: u32,
}

impl ModelSpec {
    /// The presets of `../shared/workloads.md`: `opt-13b`, `llama-3-8b`, `llama-3-70b`.
    pub fn preset(name: &str) -> Result<Self, SimError> {
        let (l, kvh, params, max_len) = match name {
            "opt-13b" => (40, 40, 13e9, 2048),
            "llama-3-8b" => (32, 8, 8.03e9, 8192),
            "llama-3-70b" => (80, 8, 70.6e9, 8192),
            other => {
                return err(format!(
                    "--model: unknown preset `{other}` (one of opt-13b, llama-3-8b, llama-3-70b, or a JSON file)"
                ));
            }
        };
        Ok(Self {
            name: name.to_string(),
            num_layers: l,
            num_kv_heads: kvh,
            head_dim: 128,
            num_params: params,
            dtype_bytes: 2,
            max_model_len: max_len,
        })
    }

    /// Reads a JSON model config (the fields of [`ModelSpec`]; unknown fields are an
    /// error). The file is read up to 64 KiB.
    pub fn from_json_file(path: &Path) -> Result<Self, SimError> {
        use std::io::Read as _;
        const MAX_BYTES: u64 = 64 << 10;
        let at = |e: &dyn std::fmt::Display| SimError(format!("--model {}: {e}", path.display()));
        let mut text = String::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(MAX_BYTES + 1).read_to_string(&mut text))
            .map_err(|e| at(&e))?;
        if text.len() as u64 > MAX_BYTES {
            return Err(at(&format!("longer than {MAX_BYTES} bytes")));
        }
        Self::from_json_str(&text).map_err(|e| at(&e))
    }

    /// Parses and checks a JSON model config (see [`ModelSpec::from_json_file`]).
    pub fn from_json_str(text: &str) -> Result<Self, SimError> {
        let m: ModelSpec = serde_json::from_str(text).map_err(|e| SimError(e.to_string()))?;
        m.check()?;
        Ok(m)
    }

    /// Checks that every field is in range and that the sizes computed from them fit;
    /// errors name the field.
    pub fn check(&self) -> Result<(), SimError> {
        for (field, v) in [
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("dtype_bytes", self.dtype_bytes),
        ] {
            if v == 0 {
                return err(format!("{field}: must be positive"));
            }
        }
        check_range("num_params", self.num_params, limits::NUM_PARAMS)?;
        if self.max_model_len < 2 {
            return err("max_model_len: must be at least 2");
        }
        if self.max_model_len as u64 > limits::MAX_TOKEN_SLOTS {
            return err(format!(
                "max_model_len: {} is more than the simulator's {} token slots",
                self.max_model_len,
                limits::MAX_TOKEN_SLOTS
            ));
        }
        if self.checked_kv_bytes_per_token().is_none() {
            return err(format!(
                "num_layers, num_kv_heads, head_dim, dtype_bytes: 2 x {} x {} x {} x {} bytes per token overflows 64 bits",
                self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes
            ));
        }
        Ok(())
    }

    /// K and V bytes of one token, all layers, or `None` when that overflows `u64`.
    pub fn checked_kv_bytes_per_token(&self) -> Option<u64> {
        2u64.checked_mul(self.num_layers as u64)?
            .checked_mul(self.num_kv_heads as u64)?
            .checked_mul(self.head_dim as u64)?
            .checked_mul(self.dtype_bytes as u64)
    }

    /// K and V bytes of one token, all layers (saturating at `u64::MAX`; a spec that
    /// passed [`ModelSpec::check`] never saturates).
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.checked_kv_bytes_per_token().unwrap_or(u64::MAX)
    }

    /// Weight bytes.
    pub fn weight_bytes(&self) -> f64 {
        self.num_params * self.dtype_bytes as f64
    }
}

/// One request of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time, seconds from the start.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Output tokens.
    pub output_len: u32,
}

/// The synthetic workloads, with the paper's mean lengths (Fig. 11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    /// Mean prompt 161.31, mean output 337.99 tokens.
    ShareGpt,
    /// Mean prompt 19.31, mean output 58.45 tokens.
    Alpaca,
}

impl WorkloadKind {
    /// Parses `sharegpt` / `alpaca`.
    pub fn parse(s: &str) -> Result<Self, SimError> {
        match s {
            "sharegpt" => Ok(Self::ShareGpt),
            "alpaca" => Ok(Self::Alpaca),
            other => err(format!(
                "--workload: unknown workload `{other}` (sharegpt or alpaca)"
            )),
        }
    }

    /// The paper's mean (prompt, output) lengths.
    pub fn means(self) -> (f64, f64) {
        match self {
            Self::ShareGpt => (161.31, 337.99),
            Self::Alpaca => (19.31, 58.45),
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::ShareGpt => "ShareGPT",
            Self::Alpaca => "Alpaca",
        }
    }
}

/// A workload: requests sorted by arrival, and how they were made.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// The requests, by arrival time.
    pub requests: Vec<TraceRequest>,
    /// One line saying where they come from.
    pub description: String,
}

/// Log-normal spread of the synthetic lengths (ln-space standard deviation).
pub const LENGTH_SIGMA: f64 = 1.0;

/// Draws a clipped log-normal length whose *clipped* mean is `mean`: the ln-space
/// location is found by bisection on a fixed sample, so clipping to `[1, max]` does not
/// move the mean.
fn calibrated_lognormal(mean: f64, max: u32) -> LogNormal<f64> {
    let mut probe = SmallRng::seed_from_u64(0x5eed);
    let z: Vec<f64> = (0..20_000)
        .map(|_| {
            let n: f64 = rand_distr::StandardNormal.sample(&mut probe);
            n
        })
        .collect();
    let clipped_mean = |mu: f64| {
        z.iter()
            .map(|n| (mu + LENGTH_SIGMA * n).exp().round().clamp(1.0, max as f64))
            .sum::<f64>()
            / z.len() as f64
    };
    let (mut lo, mut hi) = (-5.0, (max as f64).ln() + 5.0);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if clipped_mean(mid) < mean {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    LogNormal::new(0.5 * (lo + hi), LENGTH_SIGMA).expect("finite parameters")
}

impl Workload {
    /// `n` requests arriving as a Poisson process at `rate` per second, lengths drawn
    /// from log-normals (σ = [`LENGTH_SIGMA`]) calibrated so their means, after
    /// clipping (prompt and output each to `[1, max_len / 2]`),
    /// match the paper's.
    pub fn synthetic(
        kind: WorkloadKind,
        rate: f64,
        n: usize,
        max_len: u32,
        seed: u64,
    ) -> Result<Self, SimError> {
        check_range("--rate", rate, limits::RATE)?;
        if n == 0 || n > limits::MAX_REQUESTS {
            return err(format!(
                "--num-requests: {n} is outside 1 to {}",
                limits::MAX_REQUESTS
            ));
        }
        let (mp, mo) = kind.means();
        let prompt_d = calibrated_lognormal(mp, max_len / 2);
        let out_d = calibrated_lognormal(mo, max_len / 2);
        let gap = Exp::new(rate).expect("positive rate");
        let mut r = SmallRng::seed_from_u64(seed);
        let mut t = 0.0;
        let mut requests = Vec::with_capacity(n);
        for _ in 0..n {
            t += gap.sample(&mut r);
            let p = prompt_d
                .sample(&mut r)
                .round()
                .clamp(1.0, (max_len / 2) as f64) as u32;
            let o = out_d
                .sample(&mut r)
                .round()
                .clamp(1.0, (max_len / 2) as f64) as u32;
            requests.push(TraceRequest {
                arrival_s: t,
                prompt_len: p,
                output_len: o,
            });
        }
        let (ap, ao) = mean_lengths(&requests);
        Ok(Self {
            description: format!(
                "{} (synthetic: Poisson arrivals at {rate} req/s; log-normal lengths, sigma {LENGTH_SIGMA}, calibrated to the paper's means {mp}/{mo}; this sample's means {ap:.1}/{ao:.1}), {n} requests, seed {seed}",
                kind.name()
            ),
            requests,
        })
    }

    /// Reads a JSONL trace: one `{"arrival_s": …, "prompt_len": …, "output_len": …}` per
    /// line (blank lines skipped), streamed line by line: a line longer than
    /// [`limits::MAX_TRACE_LINE_BYTES`] or more than [`limits::MAX_REQUESTS`] requests is
    /// an error. Errors name the line.
    pub fn from_trace(path: &Path, max_len: u32) -> Result<Self, SimError> {
        let f = std::fs::File::open(path)
            .map_err(|e| SimError(format!("--trace {}: {e}", path.display())))?;
        Self::read_trace(std::io::BufReader::new(f), max_len)
            .map_err(|e| SimError(format!("--trace {}: {e}", path.display())))
            .map(|mut w| {
                w.description = format!("trace {} ({} requests)", path.display(), w.requests.len());
                w
            })
    }

    /// Parses JSONL trace text (see [`Workload::from_trace`]).
    pub fn parse_trace(text: &str, max_len: u32) -> Result<Self, SimError> {
        Self::read_trace(text.as_bytes(), max_len)
    }

    /// Reads a JSONL trace from any reader (see [`Workload::from_trace`]).
    pub fn read_trace(mut r: impl std::io::BufRead, max_len: u32) -> Result<Self, SimError> {
        use std::io::{BufRead as _, Read as _};
        let mut requests = Vec::new();
        let mut buf = Vec::new();
        let limit = limits::MAX_TRACE_LINE_BYTES;
        for n in 1u64.. {
            buf.clear();
            let got = (&mut r)
                .take(limit as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| SimError(format!("trace line {n}: {e}")))?;
            if got == 0 {
                break;
            }
            if buf.last() == Some(&b'\n') {
                buf.pop();
            } else if buf.len() > limit {
                return err(format!("trace line {n}: longer than {limit} bytes"));
            }
            let line = std::str::from_utf8(&buf)
                .map_err(|e| SimError(format!("trace line {n}: not UTF-8 ({e})")))?;
            if line.trim().is_empty() {
                continue;
            }
            if requests.len() == limits::MAX_REQUESTS {
                return err(format!(
                    "trace line {n}: more than {} requests",
                    limits::MAX_REQUESTS
                ));
            }
            requests.push(
                parse_trace_line(line, max_len)
                    .map_err(|e| SimError(format!("trace line {n}: {e}")))?,
            );
        }
        if requests.is_empty() {
            return err("trace: no requests");
        }
        requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        Ok(Self {
            description: format!("trace ({} requests)", requests.len()),
            requests,
        })
    }
}

/// One trace line, checked: a finite arrival time in `[0, MAX_ARRIVAL_S]`, positive
/// lengths whose sum fits the model.
fn parse_trace_line(line: &str, max_len: u32) -> Result<TraceRequest, SimError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        arrival_s: f64,
        prompt_len: i64,
        output_len: i64,
    }
    let l: Line = serde_json::from_str(line).map_err(|e| SimError(e.to_string()))?;
    if !(0.0..=limits::MAX_ARRIVAL_S).contains(&l.arrival_s) {
        return err(format!(
            "arrival_s {} is not a time from 0 to {:e} s",
            l.arrival_s,
            limits::MAX_ARRIVAL_S
        ));
    }
    let mut lens = [0u32; 2];
    for (slot, (what, v)) in lens
        .iter_mut()
        .zip([("prompt_len", l.prompt_len), ("output_len", l.output_len)])
    {
        if v <= 0 {
            return err(format!("{what} {v} must be positive"));
        }
        *slot = u32::try_from(v)
            .ok()
            .filter(|&x| x <= max_len)
            .ok_or_else(|| {
                SimError(format!(
                    "{what} {v} exceeds the model's maximum length {max_len}"
                ))
            })?;
    }
    let [prompt_len, output_len] = lens;
    if prompt_len as u64 + output_len as u64 > max_len as u64 {
        return err(format!(
            "{prompt_len} + {output_len} tokens exceed the model's maximum length {max_len}"
        ));
    }
    Ok(TraceRequest {
        arrival_s: l.arrival_s,
        prompt_len,
        output_len,
    })
}

fn mean_lengths(r: &[TraceRequest]) -> (f64, f64) {
    let n = r.len().max(1) as f64;
    (
        r.iter().map(|x| x.prompt_len as f64).sum::<f64>() / n,
        r.iter().map(|x| x.output_len as f64).sum::<f64>() / n,
    )
}

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

/// Simulation settings beyond the workload.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// The GPU.
    pub gpu: GpuSpec,
    /// The model.
    pub model: ModelSpec,
    /// KV-cache budget in GiB; `None`: `gpu_memory_utilization * memory - weights`.
    pub kv_budget_gib: Option<f64>,
    /// Share of device memory the server may use (weights + KV).
    pub gpu_memory_utilization: f64,
    /// Achieved share of the datasheet bandwidth.
    pub bandwidth_efficiency: f64,
    /// Achieved share of the datasheet FLOP rate.
    pub flops_efficiency: f64,
    /// Fixed time per step, seconds.
    pub step_overhead_s: f64,
    /// Most running sequences (both kinds of policy).
    pub max_num_seqs: usize,
    /// Most tokens one step processes.
    pub max_tokens_per_step: usize,
}

impl SimConfig {
    /// Defaults for a GPU and model (see the module docs for the step-time model).
    pub fn new(gpu: GpuSpec, model: ModelSpec) -> Self {
        Self {
            gpu,
            model,
            kv_budget_gib: None,
            gpu_memory_utilization: 0.9,
            bandwidth_efficiency: 0.8,
            flops_efficiency: 0.5,
            step_overhead_s: 0.005,
            max_num_seqs: 256,
            max_tokens_per_step: 4096,
        }
    }

    /// Checks the GPU, the model and the budget against [`limits`]: every figure the
    /// simulation computes from them is then finite.
    pub fn check(&self) -> Result<(), SimError> {
        check_range("--memory-gib", self.gpu.memory_gib, limits::MEMORY_GIB)?;
        check_range(
            "--bandwidth-gbs",
            self.gpu.bandwidth_gbs,
            limits::BANDWIDTH_GBS,
        )?;
        check_range("GPU tflops", self.gpu.tflops, limits::TFLOPS)?;
        self.model
            .check()
            .map_err(|e| SimError(format!("--model {}: {e}", self.model.name)))?;
        if let Some(g) = self.kv_budget_gib {
            check_range("--kv-budget-gib", g, limits::KV_BUDGET_GIB)?;
        }
        for (what, v) in [
            ("gpu_memory_utilization", self.gpu_memory_utilization),
            ("bandwidth_efficiency", self.bandwidth_efficiency),
            ("flops_efficiency", self.flops_efficiency),
        ] {
            if !(v > 0.0 && v <= 1.0) {
                return err(format!("{what}: {v} is not in (0, 1]"));
            }
        }
        if !(0.0..=10.0).contains(&self.step_overhead_s) {
            return err(format!(
                "step_overhead_s: {} is not in [0, 10] s",
                self.step_overhead_s
            ));
        }
        if self.max_num_seqs == 0 || self.max_tokens_per_step == 0 {
            return err("max_num_seqs and max_tokens_per_step must be positive");
        }
        Ok(())
    }

    /// The flag that sets the KV budget, for error messages.
    fn budget_flag(&self) -> &'static str {
        if self.kv_budget_gib.is_some() {
            "--kv-budget-gib"
        } else {
            "--memory-gib (or --gpu)"
        }
    }

    /// The KV budget in bytes, or an error when an input is out of range
    /// ([`SimConfig::check`]) or the budget cannot hold one maximum-length request.
    pub fn kv_budget_bytes(&self) -> Result<f64, SimError> {
        self.check()?;
        let gib = (1u64 << 30) as f64;
        let b = match self.kv_budget_gib {
            Some(g) => g * gib,
            None => {
                self.gpu_memory_utilization * self.gpu.memory_gib * gib - self.model.weight_bytes()
            }
        };
        let need = self.model.kv_bytes_per_token() as f64 * self.model.max_model_len as f64;
        if b < need {
            return err(format!(
                "{}: memory budget too small: {:.2} GiB of KV cache for {} on {} cannot hold even one {}-token request ({:.2} GiB); use a larger --gpu or --kv-budget-gib",
                self.budget_flag(),
                b / gib,
                self.model.name,
                self.gpu.name,
                self.model.max_model_len,
                need / gib
            ));
        }
        Ok(b)
    }

    /// KV token slots in the budget; an error naming the flag when they are more than
    /// the simulator can hold ([`limits::MAX_TOKEN_SLOTS`]).
    pub fn capacity_tokens(&self) -> Result<u64, SimError> {
        let slots = (self.kv_budget_bytes()? / self.model.kv_bytes_per_token() as f64).floor();
        if slots > limits::MAX_TOKEN_SLOTS as f64 {
            return err(format!(
                "{}: a KV budget of {:.4e} token slots for {} is more than the simulator's limit of {} (2^24); use a smaller budget",
                self.budget_flag(),
                slots,
                self.model.name,
                limits::MAX_TOKEN_SLOTS
            ));
        }
        Ok(slots as u64)
    }

    /// Duration of a step that processes `tokens` tokens and reads `kv_tokens` cached
    /// tokens' K/V (the roofline of the module docs).
    pub fn step_time(&self, tokens: u64, kv_tokens: u64) -> f64 {
        let bytes =
            self.model.weight_bytes() + kv_tokens as f64 * self.model.kv_bytes_per_token() as f64;
        let t_mem = bytes / (self.gpu.bandwidth_gbs * 1e9 * self.bandwidth_efficiency);
        let t_compute = 2.0 * self.model.num_params * tokens as f64
            / (self.gpu.tflops * 1e12 * self.flops_efficiency);
        t_mem.max(t_compute) + self.step_overhead_s
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
struct Stats {
    batch: Vec<u32>,
    split: MemorySplit,
    busy_time: f64,
    tokens_time: f64,
    held_time: f64,
    timeline: Vec<(f64, f64, u32)>,
}

impl Stats {
    fn new() -> Self {
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
    fn record(
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

    fn finish(
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

fn simulate_paged(
    block_size: u32,
    w: &Workload,
    cfg: &SimConfig,
    on_finish: &mut dyn FnMut(),
) -> Result<PolicyResult, SimError> {
    let capacity = cfg.capacity_tokens()?;
    // One more block than the budget holds: block 0 is the scheduler's null block.
    let num_blocks = u32::try_from(capacity / block_size as u64 + 1)
        .map_err(|_| SimError(format!("{}: too many blocks", cfg.budget_flag())))?;
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks,
        block_size,
        num_host_blocks: 0,
        max_num_seqs: cfg.max_num_seqs,
        max_tokens_per_step: cfg
            .max_tokens_per_step
            .max(cfg.model.max_model_len as usize),
        watermark: 0.01,
        max_model_len: cfg.model.max_model_len,
        ..SchedulerConfig::default()
    })
    .map_err(|e| SimError(format!("paged scheduler: {e}")))?;
    let pool = (num_blocks - 1) as f64 * block_size as f64;
    let mut stats = Stats::new();
    let (mut t, mut next, mut done, mut rejected, mut generated) =
        (0.0f64, 0usize, 0usize, 0usize, 0u64);
    let mut sampled = Vec::new();
    let n = w.requests.len();
    while done + rejected < n {
        while next < n && w.requests[next].arrival_s <= t {
            let r = &w.requests[next];
            let prompt: Vec<u32> = (0..r.prompt_len)
                .map(|i| (next as u32).wrapping_mul(7919) ^ i)
                .collect();
            if s.add_request(Request::new(next as u64, prompt, r.output_len))
                .is_err()
            {
                rejected += 1;
                on_finish();
            }
            next += 1;
        }
        let batch = s
            .step()
            .map_err(|e| SimError(format!("paged scheduler: {e}")))?;
        if batch.seqs.is_empty() {
            if next < n {
                t = t.max(w.requests[next].arrival_s);
                continue;
            }
            return err("paged simulation stalled: requests wait but none can be admitted");
        }
        let (mut tokens, mut kv) = (0u64, 0u64);
        for q in &batch.seqs {
            tokens += q.num_new_tokens as u64;
            kv += q.context_len as u64;
        }
        let dt = cfg.step_time(tokens, kv);
        t += dt;
        let running = batch.seqs.len() as u32;
        sampled.clear();
        sampled.extend(batch.seqs.iter().map(|q| (q.seq, 1u32)));
        generated += sampled.len() as u64;
        let m = s.metrics();
        let held = m.blocks_used as f64 * block_size as f64;
        let stored = m.kv_utilization * held;
        stats.record(t, dt, running, stored, 0.0, held - stored, pool);
        let finished = s
            .on_step_done(&sampled)
            .map_err(|e| SimError(format!("paged scheduler: {e}")))?;
        for _ in &finished {
            done += 1;
            on_finish();
        }
    }
    let preemptions = s.metrics().preempted_recompute + s.metrics().preempted_swap;
    Ok(stats.finish(
        Policy::Paged(block_size),
        done,
        rejected,
        t,
        generated,
        preemptions,
    ))
}

/// First-fit allocator over `[0, capacity)` token slots.
struct Contiguous {
    free: BTreeMap<u64, u64>,
}

impl Contiguous {
    fn new(capacity: u64) -> Self {
        let mut free = BTreeMap::new();
        free.insert(0, capacity);
        Self { free }
    }

    fn alloc(&mut self, n: u64) -> Option<u64> {
        let (&start, &len) = self.free.iter().find(|(_, l)| **l >= n)?;
        self.free.remove(&start);
        if len > n {
            self.free.insert(start + n, len - n);
        }
        Some(start)
    }

    fn release(&mut self, start: u64, n: u64) {
        let (mut s, mut l) = (start, n);
        if let Some((&ps, &pl)) = self.free.range(..start).next_back()
            && ps + pl == start
        {
            self.free.remove(&ps);
            s = ps;
            l += pl;
        }
        if let Some(&nl) = self.free.get(&(start + n)) {
            self.free.remove(&(start + n));
            l += nl;
        }
        self.free.insert(s, l);
    }
}

struct Live {
    start: u64,
    reserved: u64,
    stored: u64,
    final_stored: u64,
    generated: u32,
    output: u32,
}

fn simulate_contiguous(
    policy: Policy,
    w: &Workload,
    cfg: &SimConfig,
    on_finish: &mut dyn FnMut(),
) -> Result<PolicyResult, SimError> {
    let capacity = cfg.capacity_tokens()?;
    let max_len = cfg.model.max_model_len as u64;
    let mut alloc = Contiguous::new(capacity);
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let mut live: Vec<Live> = Vec::new();
    let mut stats = Stats::new();
    let (mut t, mut next, mut done, mut rejected, mut generated) =
        (0.0f64, 0usize, 0usize, 0usize, 0u64);
    let n = w.requests.len();
    while done + rejected < n {
        while next < n && w.requests[next].arrival_s <= t {
            waiting.push_back(next);
            next += 1;
        }
        // Decode every running request, then admit FCFS while a hole fits.
        let mut tokens = live.len() as u64;
        let mut kv: u64 = live.iter().map(|l| l.stored + 1).sum();
        for l in live.iter_mut() {
            l.stored += 1;
        }
        while let Some(&i) = waiting.front() {
            let r = &w.requests[i];
            let real = r.prompt_len as u64 + r.output_len as u64;
            let reserve = match policy {
                Policy::Max => max_len,
                Policy::Pow2 => real.next_power_of_two().min(max_len),
                _ => real,
            };
            if reserve > capacity {
                waiting.pop_front();
                rejected += 1;
                on_finish();
                continue;
            }
            if live.len() >= cfg.max_num_seqs
                || tokens + r.prompt_len as u64 > cfg.max_tokens_per_step as u64
            {
                break;
            }
            let Some(start) = alloc.alloc(reserve) else {
                break;
            };
            waiting.pop_front();
            tokens += r.prompt_len as u64;
            kv += r.prompt_len as u64;
            live.push(Live {
                start,
                reserved: reserve,
                stored: r.prompt_len as u64,
                final_stored: real - 1,
                generated: 0,
                output: r.output_len,
            });
        }
        if live.is_empty() {
            if next < n {
                t = t.max(w.requests[next].arrival_s);
                continue;
            }
            if waiting.is_empty() {
                break;
            }
            return err("contiguous simulation stalled");
        }
        let dt = cfg.step_time(tokens, kv);
        t += dt;
        let stored: u64 = live.iter().map(|l| l.stored).sum();
        let future: u64 = live.iter().map(|l| l.final_stored - l.stored).sum();
        let internal: u64 = live.iter().map(|l| l.reserved - l.final_stored).sum();
        stats.record(
            t,
            dt,
            live.len() as u32,
            stored as f64,
            future as f64,
            internal as f64,
            capacity as f64,
        );
        generated += live.len() as u64;
        let mut k = 0;
        while k < live.len() {
            live[k].generated += 1;
            if live[k].generated >= live[k].output {
                let l = live.swap_remove(k);
                alloc.release(l.start, l.reserved);
                done += 1;
                on_finish();
            } else {
                k += 1;
            }
        }
    }
    Ok(stats.finish(policy, done, rejected, t, generated, 0))
}

/// The paper's Fig. 13 mean batch sizes for OPT-13B on one A100 (vLLM, Orca Oracle,
/// Pow2, Max), for the two published scenarios.
pub fn paper_batch(kind: WorkloadKind, rate: f64, policy: Policy) -> Option<f64> {
    let row = match (kind, rate) {
        (WorkloadKind::ShareGpt, r) if (r - 2.0).abs() < 1e-9 => [30.42, 13.62, 9.81, 7.00],
        (WorkloadKind::Alpaca, r) if (r - 30.0).abs() < 1e-9 => [132.44, 72.75, 43.24, 7.00],
        _ => return None,
    };
    Some(match policy {
        Policy::Paged(_) => row[0],
        Policy::Oracle => row[1],
        Policy::Pow2 => row[2],
        Policy::Max => row[3],
    })
}

/// A scenario's results, ready to print or serialise.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScenarioReport {
    /// Where the requests come from.
    pub workload: String,
    /// The GPU.
    pub gpu: String,
    /// The model.
    pub model: String,
    /// KV budget, GiB.
    pub kv_budget_gib: f64,
    /// KV token slots.
    pub kv_capacity_tokens: u64,
    /// Whether the paper's Fig. 13 has this scenario (OPT-13B, A100-40GB, ShareGPT
    /// 2 req/s or Alpaca 30 req/s).
    pub paper_scenario: Option<String>,
    /// One entry per policy.
    pub policies: Vec<PolicyReport>,
}

/// One policy's results next to the paper's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Our results.
    #[serde(flatten)]
    pub result: PolicyResult,
    /// The paper's Fig. 2 token-states share for the matching system.
    pub paper_token_share: Option<f64>,
    /// The paper's Fig. 13 mean batch size, when the scenario is the paper's.
    pub paper_mean_batch: Option<f64>,
}

impl ScenarioReport {
    /// An error naming the first figure that is NaN or infinite: [`run_scenario`]
    /// refuses to return such a report, so no NaN or infinity reaches a table, a JSON
    /// file or a plot.
    pub fn check_finite(&self) -> Result<(), SimError> {
        let bad = |what: &str, policy: &str| {
            err(format!(
                "internal error: {what} of {policy} is not a finite number; please report the inputs"
            ))
        };
        if !self.kv_budget_gib.is_finite() {
            return bad("kv_budget_gib", "the scenario");
        }
        for p in &self.policies {
            let r = &p.result;
            let s = &r.split;
            for (what, v) in [
                ("sim_seconds", r.sim_seconds),
                ("requests_per_s", r.requests_per_s),
                ("tokens_per_s", r.tokens_per_s),
                ("mean_batch", r.mean_batch),
                ("p99_batch", r.p99_batch),
                ("token_states", s.token_states),
                ("reserved_future", s.reserved_future),
                ("internal_fragmentation", s.internal_fragmentation),
                ("external_and_free", s.external_and_free),
                ("tokens_per_reserved", r.tokens_per_reserved),
            ] {
                if !v.is_finite() {
                    return bad(what, &r.policy);
                }
            }
            if r.timeline
                .iter()
                .any(|&(t, h, _)| !(t.is_finite() && h.is_finite()))
            {
                return bad("timeline", &r.policy);
            }
        }
        Ok(())
    }

    /// The report as a text table.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "\n{} on {}: {}", self.model, self.gpu, self.workload);
        let _ = writeln!(
            o,
            "KV cache: {:.2} GiB = {} token slots{}",
            self.kv_budget_gib,
            self.kv_capacity_tokens,
            match &self.paper_scenario {
                Some(s) => format!("; paper scenario: {s}"),
                None => String::new(),
            }
        );
        let _ = writeln!(
            o,
            "{:<20} {:>7} {:>8} {:>6} {:>5} {:>6} | {:>7} {:>7} {:>7} {:>7} | {:>8} {:>7} {:>6} | {:>6} {:>6} {:>6}",
            "policy",
            "req/s",
            "tok/s",
            "batch",
            "p99",
            "preem",
            "tokens",
            "future",
            "intfrag",
            "ext+free",
            "tok/rsv",
            "paper",
            "ratio",
            "paperB",
            "ratioB",
            "done"
        );
        for p in &self.policies {
            let r = &p.result;
            let (ours_share, paper) = match p.paper_token_share {
                // Paged systems: share of held memory (the paper's vLLM bar); contiguous:
                // share of the whole pool (the paper's Orca bars).
                Some(x) if r.policy.starts_with("paged") => (r.tokens_per_reserved, Some(x)),
                Some(x) => (r.split.token_states, Some(x)),
                None => (r.split.token_states, None),
            };
            let f = |x: Option<f64>, d: usize| x.map_or("-".to_string(), |v| format!("{v:.d$}"));
            let _ = writeln!(
                o,
                "{:<20} {:>7.2} {:>8.0} {:>6.2} {:>5.0} {:>6} | {:>6.1}% {:>6.1}% {:>6.1}% {:>7.1}% | {:>7.1}% {:>7} {:>6} | {:>6} {:>6} {:>6}",
                r.policy,
                r.requests_per_s,
                r.tokens_per_s,
                r.mean_batch,
                r.p99_batch,
                r.preemptions,
                100.0 * r.split.token_states,
                100.0 * r.split.reserved_future,
                100.0 * r.split.internal_fragmentation,
                100.0 * r.split.external_and_free,
                100.0 * r.tokens_per_reserved,
                f(paper.map(|x| 100.0 * x), 1),
                f(paper.map(|x| ours_share / x), 2),
                f(p.paper_mean_batch, 2),
                f(p.paper_mean_batch.map(|x| r.mean_batch / x), 2),
                r.completed,
            );
        }
        o
    }
}

/// Runs every policy over a workload and assembles the report.
pub fn run_scenario(
    workload: &Workload,
    kind_rate: Option<(WorkloadKind, f64)>,
    cfg: &SimConfig,
    policies: &[Policy],
    on_finish: &mut dyn FnMut(),
) -> Result<ScenarioReport, SimError> {
    let budget = cfg.kv_budget_bytes()?;
    let paper_scenario = match kind_rate {
        Some((k, r))
            if cfg.model.name == "opt-13b"
                && cfg.gpu.name == "a100-40gb"
                && paper_batch(k, r, Policy::Max).is_some() =>
        {
            Some(format!("Fig. 13, {} at {r} req/s", k.name()))
        }
        _ => None,
    };
    let mut out = Vec::new();
    for &p in policies {
        let result = simulate(p, workload, cfg, on_finish)?;
        out.push(PolicyReport {
            result,
            paper_token_share: p.paper_token_share(),
            paper_mean_batch: match (&paper_scenario, kind_rate) {
                (Some(_), Some((k, r))) => paper_batch(k, r, p),
                _ => None,
            },
        });
    }
    let report = ScenarioReport {
        workload: workload.description.clone(),
        gpu: cfg.gpu.name.clone(),
        model: cfg.model.name.clone(),
        kv_budget_gib: budget / (1u64 << 30) as f64,
        kv_capacity_tokens: cfg.capacity_tokens()?,
        paper_scenario,
        policies: out,
    };
    report.check_finite()?;
    Ok(report)
}
