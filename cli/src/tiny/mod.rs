//! `pagedkv run`: real decode through pagedkv's kernels over the paged cache, for a
//! small synthetic transformer.
//!
//! The model is a few layers of random Q/K/V/O projections with residual connections
//! and RMS normalisation, a random embedding, a random output matrix of its own (tied
//! to the embedding, the residual stream made every greedy token the one before it),
//! and greedy sampling: the point is the cache and the kernels, not the text. Every
//! step:
//!
//! 1. the scheduler plans the batch (admissions, block allocations, slots);
//! 2. per layer, Q/K/V of the step's new tokens are computed on the CPU, `kv_append`
//!    writes K and V into the layer's paged cache through `slot_mapping`, and
//!    `paged_decode_attention` attends each decoding sequence's query over its cache
//!    through its block table; `paged_prefill_attention` attends each prefilling
//!    sequence's new tokens causally over its cache (tensor cores for f16/bf16);
//! 3. the last hidden state of each sequence picks its next token.
//!
//! The layer loop is written once, over `AttentionBackend`: `Backend::Cpu` runs it on
//! [`CpuBackend`] (the real kernel bodies in the SIMT emulator), `Backend::Cuda` on
//! [`CudaBackend`] (a GPU). [`run_without_cache`] serves the same requests without a
//! KV cache (every step recomputes every token's K/V: the O(n²) way) for comparison. The cache stays in the backend's memory; only layer 0's
//! comes back to the host, for the check: after every step a sample of decoding
//! sequences and the first and last new token of a prefilling one are checked against
//! dense attention over their gathered cache; the report gives the worst error.

mod cached;
mod driver;
mod model;
mod plot;
mod recompute;
mod spec;

pub use spec::{MAX_SPEC, PERTURBATION};

pub use plot::render_step_times;

use std::collections::BTreeMap;
use std::fmt;

use pagedkv::host::DType;
use pagedkv::host::backend::{BackendConfig, CpuBackend, SplitPolicy};
use pagedkv::host::cuda::CudaBackend;
use pagedkv::host::step::{StepCapacity, StepShape};

/// Where the kernels run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// The SIMT emulator on the CPU (the real kernel bodies).
    Cpu,
    /// An NVIDIA GPU through the CUDA backend.
    Cuda,
}

/// Longest sequence (prompt + output) of a run's model.
pub const MAX_MODEL_LEN: u32 = 256;
/// Prompts are drawn with 4 to `MAX_PROMPT_LEN` tokens.
pub const MAX_PROMPT_LEN: u32 = 39;
/// Most tokens a request may generate: every request fits the model with any prompt.
pub const MAX_TOKENS: u32 = MAX_MODEL_LEN - MAX_PROMPT_LEN;
/// Fewest tokens a request may generate: 1, its prefill's token alone (a scoring or
/// classification request; no decode step runs for it, its prefill is verified).
pub const MIN_TOKENS: u32 = 1;
/// Most requests in one run.
pub const MAX_REQUESTS: usize = 4096;

/// The run's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// Where the kernels run.
    pub backend: Backend,
    /// Requests to decode.
    pub num_requests: usize,
    /// Tokens each request generates.
    pub max_tokens: u32,
    /// Seed of weights and prompts.
    pub seed: u64,
    /// Transformer layers.
    pub num_layers: usize,
    /// Query heads.
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens per cache block.
    pub block_size: u32,
    /// Blocks in the cache pool.
    pub num_blocks: u32,
    /// Cache, query and output element type.
    pub dtype: DType,
    /// Decoding sequences checked against dense attention per step.
    pub verify_per_step: usize,
    /// Tokens the scheduler may put in one step (at least the number of requests); a
    /// prompt longer than what a step has left is prefilled in chunks.
    pub step_tokens: u32,
    /// Speculative decoding: draft tokens of the toy draft model each decoding
    /// sequence verifies a step (0: off; at most [`MAX_SPEC`]).
    pub spec: u32,
}

impl RunConfig {
    /// The model's attention geometry and dtype (the cache of the query type).
    pub fn shape(&self) -> StepShape {
        StepShape {
            num_q_heads: self.num_q_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            dtype: self.dtype,
            kv_dtype: self.dtype,
        }
    }

    /// Checks every setting; an error names the `pagedkv run` flag or the field.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_REQUESTS).contains(&self.num_requests) {
            return Err(format!(
                "--requests: {} is outside 1 to {MAX_REQUESTS}",
                self.num_requests
            ));
        }
        if self.step_tokens < self.num_requests as u32 || self.step_tokens > 1 << 20 {
            return Err(format!(
                "--step-tokens: {} is outside {} (the number of requests: every running one takes a token a step) to {}",
                self.step_tokens,
                self.num_requests,
                1 << 20
            ));
        }
        if self.spec > MAX_SPEC {
            return Err(format!(
                "--spec: {} draft tokens a step (at most {MAX_SPEC})",
                self.spec
            ));
        }
        if !(MIN_TOKENS..=MAX_TOKENS).contains(&self.max_tokens) {
            return Err(format!(
                "--max-tokens: {} is outside {MIN_TOKENS} to {MAX_TOKENS} (prompt + output must fit the model's {MAX_MODEL_LEN} tokens with prompts of up to {MAX_PROMPT_LEN})",
                self.max_tokens
            ));
        }
        for (field, v, max) in [
            ("num_layers", self.num_layers, 64),
            ("vocab", self.vocab, 1 << 16),
            ("num_q_heads", self.num_q_heads as usize, 64),
            ("verify_per_step", self.verify_per_step, 1 << 16),
        ] {
            if !(1..=max).contains(&v) {
                return Err(format!("{field}: {v} is outside 1 to {max}"));
            }
        }
        if self.num_kv_heads == 0 || !self.num_q_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_kv_heads: {} does not divide num_q_heads {}",
                self.num_kv_heads, self.num_q_heads
            ));
        }
        if self.num_blocks > 1 << 16 {
            return Err(format!(
                "num_blocks: {} is more than {}",
                self.num_blocks,
                1 << 16
            ));
        }
        pagedkv::host::ops::check_layout(&pagedkv::kernels::PagedLayout {
            num_blocks: self.num_blocks,
            num_kv_heads: self.num_kv_heads,
            block_size: self.block_size,
            head_dim: self.head_dim,
        })
        .map_err(|e| e.to_string())
    }
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            backend: Backend::Cpu,
            num_requests: 12,
            max_tokens: 24,
            seed: 0,
            num_layers: 2,
            num_q_heads: 8,
            num_kv_heads: 2,
            head_dim: 64,
            vocab: 512,
            block_size: 16,
            num_blocks: 64,
            dtype: DType::F16,
            verify_per_step: 2,
            step_tokens: 2048,
            spec: 0,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, PartialEq)]
pub struct RunReport {
    /// Decode steps.
    pub steps: u64,
    /// Tokens generated.
    pub tokens: u64,
    /// Wall-clock seconds.
    pub seconds: f64,
    /// Mean KV utilisation (tokens stored / slots of held blocks) over the steps.
    pub mean_kv_utilization: f64,
    /// Preemptions.
    pub preemptions: u64,
    /// Attention outputs checked against dense attention.
    pub verified: usize,
    /// The worst relative L2 error among them.
    pub max_error: f64,
    /// The error allowed for the dtype.
    pub tolerance: f64,
    /// Per step: the scheduled sequences' mean context length and the step's wall-clock
    /// seconds (scheduler, model and kernels).
    pub step_times: Vec<(f64, f64)>,
    /// The tokens each request generated, by request id.
    pub outputs: BTreeMap<u64, Vec<u32>>,
    /// The relative logit margin (the chosen token's logit less the runner-up's, over
    /// the chosen one's magnitude) of each token in `outputs`, as the target
    /// computed it.
    pub margins: BTreeMap<u64, Vec<f32>>,
    /// Tokens whose K/V the run computed (prompt and generated, every chunk).
    pub computed_tokens: u64,
    /// Prompt tokens served from the prefix cache instead (their K/V already in the
    /// pool).
    pub cached_tokens: u64,
    /// Speculative decoding's counts (`--spec`), or none.
    pub spec: Option<SpecStats>,
}

/// What speculative decoding did in a run.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpecStats {
    /// Verify rows (a decoding sequence's step with drafts asked for).
    pub verify_rows: u64,
    /// Draft tokens verified.
    pub drafted: u64,
    /// Of those, accepted.
    pub accepted: u64,
}

impl SpecStats {
    /// Accepted drafts / verified drafts (0 with none).
    pub fn acceptance_rate(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }

    /// Tokens a verify row gains a step: its accepted drafts and the target's token.
    pub fn tokens_per_row(&self) -> f64 {
        (self.accepted + self.verify_rows) as f64 / self.verify_rows.max(1) as f64
    }
}

impl RunReport {
    /// Whether every check passed (and there was at least one).
    pub fn verified(&self) -> bool {
        self.verified > 0 && self.max_error <= self.tolerance
    }
}

impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "generated {} tokens in {} steps, {:.3} s wall clock: {:.1} tokens/s",
            self.tokens,
            self.steps,
            self.seconds,
            self.tokens as f64 / self.seconds.max(1e-9)
        )?;
        writeln!(
            f,
            "mean KV utilisation {:.1}% (tokens stored / slots of held blocks), {} preemptions",
            100.0 * self.mean_kv_utilization,
            self.preemptions
        )?;
        writeln!(
            f,
            "K/V computed for {} tokens, {} prompt tokens served from the prefix cache",
            self.computed_tokens, self.cached_tokens
        )?;
        if let Some(s) = &self.spec {
            writeln!(
                f,
                "speculative decoding: {} of {} drafts accepted ({:.1}%), {:.2} tokens per decoding sequence a step (1 without drafts)",
                s.accepted,
                s.drafted,
                100.0 * s.acceptance_rate(),
                s.tokens_per_row()
            )?;
        }
        write!(
            f,
            "verification: {} attention outputs vs dense attention over the gathered cache, max relative L2 error {:.2e} (tolerance {:.0e}): {}",
            self.verified,
            self.max_error,
            self.tolerance,
            if self.verified() { "PASS" } else { "FAIL" }
        )
    }
}

/// Runs the model with its KV cache; `progress` receives a line every few steps.
pub fn run(
    cfg: &RunConfig,
    progress: &mut dyn FnMut(String),
) -> Result<RunReport, Box<dyn std::error::Error>> {
    run_mode(cfg, false, progress)
}

/// Runs the same requests without a KV cache: every step recomputes every token's K and
/// V through every layer (the O(n²) way), for the comparison `pagedkv run --no-cache`
/// prints.
pub fn run_without_cache(
    cfg: &RunConfig,
    progress: &mut dyn FnMut(String),
) -> Result<RunReport, Box<dyn std::error::Error>> {
    run_mode(cfg, true, progress)
}

fn run_mode(
    cfg: &RunConfig,
    recompute: bool,
    progress: &mut dyn FnMut(String),
) -> Result<RunReport, Box<dyn std::error::Error>> {
    cfg.check()?;
    if recompute && cfg.spec > 0 {
        return Err("--spec with --no-cache: the run without a cache has no verify path".into());
    }
    let max_seqs = cfg.num_requests as u32;
    let backend = BackendConfig {
        cascade: pagedkv::host::ops::cascade::CascadePolicy::Auto,
        shape: cfg.shape(),
        num_layers: cfg.num_layers,
        capacity: StepCapacity {
            max_seqs,
            max_blocks_per_seq: MAX_MODEL_LEN.div_ceil(cfg.block_size),
            // Without a cache a step holds every scheduled sequence's whole history.
            max_tokens: if recompute {
                max_seqs * MAX_MODEL_LEN
            } else {
                cfg.step_tokens
            },
            max_partitions: 64,
        },
        num_host_blocks: 0,
        split: SplitPolicy::Auto,
        num_groups: 1,
    };
    // One layer loop per mode for every backend: only the backend differs.
    macro_rules! on {
        ($be:expr) => {
            if recompute {
                driver::serve($be, cfg, progress, recompute::step)
            } else {
                driver::serve($be, cfg, progress, cached::step)
            }
        };
    }
    match cfg.backend {
        Backend::Cpu => on!(&mut CpuBackend::new(backend)?),
        Backend::Cuda => {
            let gpu = pagedkv::cuda::device(0)?;
            on!(&mut CudaBackend::new(&gpu, backend)?)
        }
    }
}

/// Tokens every prompt starts with (a shared "system prompt"): a prompt that holds a
/// whole block of them gets it from the prefix cache.
pub const SHARED_PREFIX: usize = 16;

/// How a speculative run's outputs compare with a plain run's, token for token.
#[derive(Clone, Debug, PartialEq)]
pub struct GreedyMatch {
    /// Requests whose outputs are identical.
    pub identical: usize,
    /// Requests compared.
    pub requests: usize,
    /// The relative margin below which two greedy choices are within numerical error:
    /// `4 x` the larger of the two runs' worst attention errors (relative L2 against
    /// f64, measured during the runs).
    pub bound: f64,
    /// `(request, index, margin)` of each first divergence within the bound: the two
    /// runs' logits were a tie within error there (the smaller of the two runs'
    /// margins is given). Every later token of that request may differ.
    pub explained: Vec<(u64, usize, f64)>,
    /// The same of each divergence above the bound: a real difference.
    pub unexplained: Vec<(u64, usize, f64)>,
}

impl GreedyMatch {
    /// Whether the outputs match wherever the margin exceeds the bound.
    pub fn holds(&self) -> bool {
        self.unexplained.is_empty() && self.requests > 0
    }
}

/// Compares a speculative run's outputs with a plain run's of the same requests:
/// greedy decoding is deterministic, so they must be identical wherever the target's
/// choice is not a tie within numerical error. The two runs compute a position's
/// attention by different kernels (a verify row through prefill, a decode through
/// decode: another summation order), so where the two best logits are closer than
/// the error of the hidden state they may pick differently. That error is bounded
/// here from the runs' own checks: each attention output is within the run's worst
/// measured relative error `e` of f64 attention; a relative error `e` of the hidden
/// state moves a logit by about `e` of its magnitude, through the two layers and in
/// either run, hence the bound `4e` on the relative margin (a heuristic bound: the
/// model's dense parts run in f32 and add far less).
pub fn compare_greedy(spec: &RunReport, plain: &RunReport) -> GreedyMatch {
    let bound = 4.0 * spec.max_error.max(plain.max_error);
    let mut m = GreedyMatch {
        identical: 0,
        requests: plain.outputs.len(),
        bound,
        explained: Vec::new(),
        unexplained: Vec::new(),
    };
    for (id, want) in &plain.outputs {
        let got = spec.outputs.get(id).map_or(&[][..], |v| v.as_slice());
        let Some(i) = (0..want.len().max(got.len())).find(|&i| want.get(i) != got.get(i)) else {
            m.identical += 1;
            continue;
        };
        let margin = |r: &RunReport| {
            r.margins
                .get(id)
                .and_then(|v| v.get(i))
                .map_or(0.0, |&x| x as f64)
        };
        let at = (*id, i, margin(spec).min(margin(plain)));
        if at.2 <= bound {
            m.explained.push(at);
        } else {
            m.unexplained.push(at);
        }
    }
    m
}
