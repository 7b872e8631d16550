//! `pagedkv run`: real decode through pagedkv's kernels over the paged cache, for a
//! small synthetic transformer.
//!
//! The model is a few layers of random Q/K/V/O projections with residual connections
//! and RMS normalisation, a random embedding shared with the output layer, and greedy
//! sampling: the point is the cache and the kernels, not the text. Every step:
//!
//! 1. the [`Scheduler`] plans the batch (admissions, block allocations, slots);
//! 2. per layer, Q/K/V of the step's new tokens are computed on the CPU, `kv_append`
//!    writes K and V into the layer's paged cache through `slot_mapping`, and
//!    `paged_decode_attention` attends each decoding sequence's query over its cache
//!    through its block table; `paged_prefill_attention` attends each prefilling
//!    sequence's new tokens causally over its cache (tensor cores for f16/bf16);
//! 3. the last hidden state of each sequence picks its next token.
//!
//! The layer loop is written once, over [`AttentionBackend`]: `Backend::Cpu` runs it on
//! [`CpuBackend`] (the real kernel bodies in the SIMT emulator), `Backend::Cuda` on
//! [`CudaAttention`] (a GPU). The cache stays in the backend's memory; only layer 0's
//! comes back to the host, for the check: after every step a sample of decoding
//! sequences and the first and last new token of a prefilling one are checked against
//! dense attention over their gathered cache; the report gives the worst error.

use std::fmt;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use pagedkv_host::backend::{
    AppendArgs, AttentionBackend, BackendConfig, CpuBackend, DecodeArgs, PrefillArgs, SplitPolicy,
    decode_rows, prefill_rows,
};
use pagedkv_host::cuda::CudaAttention;
use pagedkv_host::ops::attention::{DecodeOptions, DecodeShape};
use pagedkv_host::reference::{dense_decode_attention, gather};
use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};
use pagedkv_host::step::{StepCapacity, StepShape};
use pagedkv_host::{DType, HostTensor};

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
/// Fewest tokens a request may generate: the first comes from the prefill, so only
/// from the second on does a decode step run (and get verified).
pub const MIN_TOKENS: u32 = 2;
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
}

impl RunConfig {
    /// Checks every setting; an error names the `pagedkv run` flag or the field.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_REQUESTS).contains(&self.num_requests) {
            return Err(format!(
                "--requests: {} is outside 1 to {MAX_REQUESTS}",
                self.num_requests
            ));
        }
        if !(MIN_TOKENS..=MAX_TOKENS).contains(&self.max_tokens) {
            return Err(format!(
                "--max-tokens: {} is outside {MIN_TOKENS} to {MAX_TOKENS} (the first token comes from the prefill, and prompt + output must fit the model's {MAX_MODEL_LEN} tokens with prompts of up to {MAX_PROMPT_LEN})",
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
        pagedkv_host::ops::check_layout(&pagedkv_kernels::PagedLayout {
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

/// One layer's weights (the cache lives in the backend's `PagedCache`).
struct Layer {
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
}

/// `x [n, k] @ w [k, m]`.
fn matmul(x: &[f32], w: &[f32], k: usize, m: usize) -> Vec<f32> {
    let n = x.len() / k;
    let mut out = vec![0.0f32; n * m];
    for i in 0..n {
        for (j, xv) in x[i * k..(i + 1) * k].iter().enumerate() {
            let row = &w[j * m..(j + 1) * m];
            for (o, wv) in out[i * m..(i + 1) * m].iter_mut().zip(row) {
                *o += xv * wv;
            }
        }
    }
    out
}

fn rms_norm(x: &mut [f32], width: usize) {
    for row in x.chunks_mut(width) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / width as f32;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// The layer's output projection, residual and normalisation: `x = norm(x + attn @ wo)`.
fn finish_layer(x: &mut [f32], attn: &[f32], wo: &[f32], hidden: usize) {
    let o = matmul(attn, wo, hidden, hidden);
    for (xv, ov) in x.iter_mut().zip(&o) {
        *xv += ov;
    }
    rms_norm(x, hidden);
}

fn random(r: &mut SmallRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

/// Runs the model; `progress` receives a line every few steps.
pub fn run(
    cfg: &RunConfig,
    progress: &mut dyn FnMut(String),
) -> Result<RunReport, Box<dyn std::error::Error>> {
    cfg.check()?;
    let backend = BackendConfig {
        shape: StepShape {
            num_q_heads: cfg.num_q_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            block_size: cfg.block_size,
            num_blocks: cfg.num_blocks,
            dtype: cfg.dtype,
        },
        num_layers: cfg.num_layers,
        capacity: StepCapacity {
            max_seqs: cfg.num_requests as u32,
            max_blocks_per_seq: MAX_MODEL_LEN.div_ceil(cfg.block_size),
            max_tokens: MAX_TOKENS_PER_STEP as u32,
            max_partitions: 64,
        },
        num_host_blocks: 0,
        split: SplitPolicy::Auto,
    };
    // One layer loop for every backend: only the backend differs.
    match cfg.backend {
        Backend::Cpu => run_on(&mut CpuBackend::new(backend)?, cfg, progress),
        Backend::Cuda => {
            let gpu = crate::cuda::backend(0)?;
            run_on(&mut CudaAttention::new(&gpu, backend)?, cfg, progress)
        }
    }
}

/// Tokens the scheduler may put in one step.
const MAX_TOKENS_PER_STEP: usize = 2048;

fn run_on<B: AttentionBackend>(
    be: &mut B,
    cfg: &RunConfig,
    progress: &mut dyn FnMut(String),
) -> Result<RunReport, Box<dyn std::error::Error>> {
    let (qh, kvh, d) = (
        cfg.num_q_heads as usize,
        cfg.num_kv_heads as usize,
        cfg.head_dim as usize,
    );
    let hidden = qh * d;
    let mut r = SmallRng::seed_from_u64(cfg.seed);
    let embed = random(&mut r, cfg.vocab * hidden, 1.0);
    let scale = 1.0 / (hidden as f32).sqrt();
    let layers: Vec<Layer> = (0..cfg.num_layers)
        .map(|_| Layer {
            wq: random(&mut r, hidden * hidden, scale),
            wk: random(&mut r, hidden * kvh * d, scale),
            wv: random(&mut r, hidden * kvh * d, scale),
            wo: random(&mut r, hidden * hidden, scale),
        })
        .collect();
    // Unused slots hold NaN: a kernel that read one would poison the output.
    let mut cache = be.alloc_cache()?;
    let mut sched = Scheduler::new(SchedulerConfig {
        num_blocks: cfg.num_blocks,
        block_size: cfg.block_size,
        max_num_seqs: cfg.num_requests,
        max_tokens_per_step: MAX_TOKENS_PER_STEP,
        max_model_len: MAX_MODEL_LEN,
        ..SchedulerConfig::default()
    })?;
    for i in 0..cfg.num_requests {
        let len = r.random_range(4..=MAX_PROMPT_LEN as usize);
        let prompt: Vec<u32> = (0..len)
            .map(|_| r.random_range(0..cfg.vocab as u32))
            .collect();
        sched.add_request(Request::new(i as u64, prompt, cfg.max_tokens))?;
    }
    // The decode shapes of one sequence with block-table rows of `w` (for `gather`).
    let shape_for = |w: usize| DecodeShape {
        num_seqs: 1,
        num_q_heads: cfg.num_q_heads,
        num_kv_heads: cfg.num_kv_heads,
        head_dim: cfg.head_dim,
        block_size: cfg.block_size,
        num_blocks: cfg.num_blocks,
        max_blocks_per_seq: w as u32,
    };
    let to_host = |dtype, shape: &[usize], v: &[f32]| {
        HostTensor::from_f64(
            dtype,
            shape,
            &v.iter().map(|&a| a as f64).collect::<Vec<_>>(),
        )
    };
    let opts = DecodeOptions::new(cfg.head_dim);
    let (mut steps, mut tokens, mut util_sum) = (0u64, 0u64, 0.0f64);
    let (mut verified, mut max_error) = (0usize, 0.0f64);
    let start = Instant::now();
    while !sched.is_idle() {
        let batch = sched.step()?.clone();
        if batch.seqs.is_empty() {
            return Err("the scheduler made an empty step with requests left".into());
        }
        be.begin_step(&batch, &mut cache)?;
        let n_new = batch.slot_mapping.len();
        // Hidden states of every new token, sequence by sequence.
        let mut x = Vec::with_capacity(n_new * hidden);
        for q in &batch.seqs {
            let toks = sched.tokens(q.seq)?;
            for p in q.start_pos..q.start_pos + q.num_new_tokens {
                let t = toks[p as usize] as usize;
                x.extend_from_slice(&embed[t * hidden..(t + 1) * hidden]);
            }
        }
        let decode: Vec<usize> = decode_rows(&batch).collect();
        let w = batch.max_blocks_per_seq as usize;
        for (li, layer) in layers.iter().enumerate() {
            let q = matmul(&x, &layer.wq, hidden, hidden);
            let k = matmul(&x, &layer.wk, hidden, kvh * d);
            let v = matmul(&x, &layer.wv, hidden, kvh * d);
            let key = be.upload(&to_host(cfg.dtype, &[n_new, kvh, d], &k)?)?;
            let value = be.upload(&to_host(cfg.dtype, &[n_new, kvh, d], &v)?)?;
            let lc = &mut cache.layers[li];
            be.kv_append(AppendArgs {
                key: &key,
                value: &value,
                cache: lc,
            })?;

            let mut attn = vec![0.0f32; n_new * hidden];
            // Decoding sequences: the paged decode kernel over the cache.
            let mut qrows: Vec<f32> = Vec::with_capacity(decode.len() * hidden);
            for &i in &decode {
                let o = batch.seqs[i].token_offset as usize * hidden;
                qrows.extend_from_slice(&q[o..o + hidden]);
            }
            let qt = to_host(cfg.dtype, &[decode.len(), qh, d], &qrows)?;
            let mut outv = Vec::new();
            if !decode.is_empty() {
                let qd = be.upload(&qt)?;
                let nan = HostTensor::full(cfg.dtype, &[decode.len(), qh, d], f64::NAN);
                let mut out = be.upload(&nan)?;
                be.decode(DecodeArgs {
                    opts: &opts,
                    q: &qd,
                    cache: lc,
                    out: &mut out,
                })?;
                outv = be.download(&out)?.to_f64();
                for (j, &i) in decode.iter().enumerate() {
                    let o = batch.seqs[i].token_offset as usize * hidden;
                    for e in 0..hidden {
                        attn[o + e] = outv[j * hidden + e] as f32;
                    }
                }
            }
            // Prefilling sequences: the paged prefill kernel, each new token over its
            // sequence's cache up to itself.
            let prefill: Vec<usize> = prefill_rows(&batch).collect();
            let mut pq: Vec<f32> = Vec::new();
            let mut pout = Vec::new();
            if !prefill.is_empty() {
                for &i in &prefill {
                    let sq = &batch.seqs[i];
                    let o = sq.token_offset as usize * hidden;
                    pq.extend_from_slice(&q[o..o + sq.num_new_tokens as usize * hidden]);
                }
                let n = pq.len() / hidden;
                let qd = be.upload(&to_host(cfg.dtype, &[n, qh, d], &pq)?)?;
                let nan = HostTensor::full(cfg.dtype, &[n, qh, d], f64::NAN);
                let mut out = be.upload(&nan)?;
                be.prefill(PrefillArgs {
                    opts: &opts,
                    q: &qd,
                    cache: lc,
                    out: &mut out,
                })?;
                pout = be.download(&out)?.to_f64();
                let mut j = 0;
                for &i in &prefill {
                    let sq = &batch.seqs[i];
                    let o = sq.token_offset as usize * hidden;
                    let len = sq.num_new_tokens as usize * hidden;
                    for e in 0..len {
                        attn[o + e] = pout[j + e] as f32;
                    }
                    j += len;
                }
            }
            if li == 0 && !batch.seqs.is_empty() {
                // Check a sample of layer 0's outputs against dense attention over the
                // gathered cache (the only copy of the cache to the host).
                let (kc, vc) = (be.download(&lc.key)?, be.download(&lc.value)?);
                let mut check = |qs: &[f64], got: &[f64], row: &[i32], upto: usize| {
                    let (kg, vg) = gather(&shape_for(w), &kc, &vc, row, upto, 0);
                    let want = dense_decode_attention(qs, &kg, &vg, qh, kvh, d, &opts);
                    let num: f64 = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum();
                    let den: f64 = want.iter().map(|b| b * b).sum();
                    let e = (num / den.max(f64::MIN_POSITIVE)).sqrt();
                    max_error = if e.is_nan() {
                        f64::INFINITY
                    } else {
                        max_error.max(e)
                    };
                    verified += 1;
                };
                for (j, &i) in decode.iter().enumerate().take(cfg.verify_per_step) {
                    let qs: Vec<f64> = (0..hidden).map(|e| qt.get(j * hidden + e)).collect();
                    let row = &batch.block_tables[i * w..(i + 1) * w];
                    let got = &outv[j * hidden..(j + 1) * hidden];
                    check(&qs, got, row, batch.context_lens[i] as usize);
                }
                // The first and the last new token of the first prefilling sequence.
                if let Some(&i) = prefill.first() {
                    let sq = &batch.seqs[i];
                    let row = &batch.block_tables[i * w..(i + 1) * w];
                    let n = sq.num_new_tokens as usize;
                    for t in [0, n - 1] {
                        let (a, b) = (t * hidden, (t + 1) * hidden);
                        // The query as the kernel saw it (rounded to the dtype).
                        let qs = to_host(cfg.dtype, &[hidden], &pq[a..b])?.to_f64();
                        check(&qs, &pout[a..b], row, sq.start_pos as usize + t + 1);
                    }
                }
            }
            finish_layer(&mut x, &attn, &layer.wo, hidden);
        }
        // Greedy sampling from each sequence's last new token.
        let mut sampled = Vec::with_capacity(batch.seqs.len());
        for q in &batch.seqs {
            let last = (q.token_offset + q.num_new_tokens - 1) as usize;
            let h = &x[last * hidden..(last + 1) * hidden];
            let best = (0..cfg.vocab)
                .map(|t| {
                    (
                        t,
                        embed[t * hidden..(t + 1) * hidden]
                            .iter()
                            .zip(h)
                            .map(|(a, b)| a * b)
                            .sum::<f32>(),
                    )
                })
                .max_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(t, _)| t as u32)
                .unwrap_or(0);
            sampled.push((q.seq, best));
        }
        tokens += sampled.len() as u64;
        steps += 1;
        util_sum += sched.metrics().kv_utilization;
        sched.on_step_done(&sampled)?;
        if steps.is_multiple_of(8) {
            progress(format!(
                "step {steps}: {} running, {} waiting, {} tokens, KV blocks used {}",
                sched.metrics().running,
                sched.metrics().waiting,
                tokens,
                sched.metrics().blocks_used
            ));
        }
    }
    let m = sched.metrics();
    Ok(RunReport {
        steps,
        tokens,
        seconds: start.elapsed().as_secs_f64(),
        mean_kv_utilization: util_sum / steps.max(1) as f64,
        preemptions: m.preempted_recompute + m.preempted_swap,
        verified,
        max_error,
        tolerance: match cfg.dtype {
            DType::F32 => 1e-5,
            _ => 1e-2,
        },
    })
}
