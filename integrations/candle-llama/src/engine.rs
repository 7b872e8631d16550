//! [`Engine`]: the serving loop. Each step, pagedkv's scheduler picks the batch
//! (admitting, preempting, swapping, reusing cached prefixes), the backend runs the
//! batch's swaps and copies and plans it, [`PagedLlama`] runs one forward pass over
//! every scheduled sequence's new tokens, and the engine samples greedily and hands the
//! tokens back to the scheduler.

use std::collections::HashMap;

use candle_transformers::models::llama::Config;
use pagedkv::host::DType;
use pagedkv::host::backend::{BackendConfig, CpuBackend, PagedCache};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::ops::prefill::PrefillKernel;
use pagedkv::host::scheduler::{
    Batch, Metrics, PreemptionMode, Request, RequestId, Scheduler, SchedulerConfig,
};
use pagedkv::host::step::StepShape;

use crate::Result;
use crate::bridge::{CandleBackend, Copies};
use crate::model::PagedLlama;

/// What a request generated.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Generated {
    /// The request.
    pub request: RequestId,
    /// Its prompt.
    pub prompt: Vec<u32>,
    /// The tokens it generated, greedily.
    pub tokens: Vec<u32>,
    /// The logits each generated token was sampled from (`tokens[i]` from
    /// `logits[i]`).
    pub logits: Vec<Vec<f32>>,
}

/// What one step did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Sequences that prefilled (prompt, or prompt and output after a recompute).
    pub prefills: usize,
    /// Sequences that decoded one token.
    pub decodes: usize,
    /// New tokens the step computed.
    pub tokens: usize,
    /// Requests the scheduler preempted in this step, and how.
    pub preempted: Vec<(RequestId, PreemptionMode)>,
    /// Prefills that started after cached tokens (a prefix-cache hit): request and
    /// first computed position.
    pub prefix_hits: Vec<(RequestId, u32)>,
    /// Blocks swapped out and in.
    pub swapped: (usize, usize),
    /// The prefill kernel pagedkv's planner chose for the step's prefilling rows
    /// (`None` when none prefilled).
    pub prefill_kernel: Option<PrefillKernel>,
}

/// The scheduler and cache settings of an [`Engine`].
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// The scheduler's settings (block size, pool, swap space, preemption, caching).
    pub scheduler: SchedulerConfig,
    /// Emulator worker threads (0: the machine's parallelism).
    pub emulator_workers: usize,
    /// The attention's dtype: queries, outputs and the paged cache (f32, f16 or bf16;
    /// the model's other layers run in f32 either way). A 16-bit dtype takes pagedkv's
    /// tensor-core kernels: at block size 16 and head_dim 64 or 128 the multi-warp
    /// prefill ([`PrefillKernel::MultiWarp`]).
    pub dtype: DType,
}

/// A request in flight: everything it has (prompt and output) and what it generated.
#[derive(Debug)]
struct Live {
    all: Vec<u32>,
    out: Generated,
}

/// A model whose attention runs through pagedkv: one forward pass over a scheduler
/// step's batch ([`PagedLlama`], [`PagedGemma3`](crate::gemma3::PagedGemma3)).
pub trait PagedModel {
    /// K/V tensors of its paged cache (the backend's `num_layers`: its layers, or with
    /// layer groups the tensors the groups share).
    fn num_tensors(&self) -> usize;

    /// One forward pass over `batch` (whose `begin_step` already ran on `be`):
    /// `tokens` holds each scheduled sequence's new tokens, in batch order
    /// (`batch.slot_mapping`'s); `opts` are the engine's attention options (scale
    /// `1 / sqrt(head_dim)`, no window), which a model whose attention differs
    /// overrides per layer (Gemma 3: `query_pre_attn_scalar^-0.5`, its windows).
    /// Returns the logits after each sequence's last new token,
    /// `[batch.seqs.len(), vocab]`.
    fn forward<B: CandleBackend>(
        &self,
        be: &mut B,
        cache: &mut PagedCache<B::Tensor>,
        batch: &Batch,
        tokens: &[u32],
        opts: &AttentionOptions,
        copies: &mut Copies,
    ) -> Result<candle_core::Tensor>;
}

impl PagedModel for PagedLlama {
    fn num_tensors(&self) -> usize {
        self.num_layers()
    }

    fn forward<B: CandleBackend>(
        &self,
        be: &mut B,
        cache: &mut PagedCache<B::Tensor>,
        batch: &Batch,
        tokens: &[u32],
        opts: &AttentionOptions,
        copies: &mut Copies,
    ) -> Result<candle_core::Tensor> {
        PagedLlama::forward(self, be, cache, batch, tokens, opts, copies)
    }
}

/// pagedkv's scheduler, a backend and its paged cache, serving a [`PagedModel`]
/// ([`PagedLlama`] by default).
pub struct Engine<B: CandleBackend, M: PagedModel = PagedLlama> {
    model: M,
    be: B,
    cache: PagedCache<B::Tensor>,
    sched: Scheduler,
    opts: AttentionOptions,
    live: HashMap<RequestId, Live>,
    done: Vec<Generated>,
    /// How candle tensors reached the backend so far.
    pub copies: Copies,
}

impl<B: CandleBackend, M: PagedModel> std::fmt::Debug for Engine<B, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("backend", &self.be.name())
            .field("metrics", &self.sched.metrics())
            .finish_non_exhaustive()
    }
}

/// The backend configuration for `cfg`'s attention under `sched`'s pool: queries and
/// cache of `dtype`, the scheduler's blocks and swap space, steps of up to
/// `max_num_seqs` sequences.
pub fn backend_config(
    cfg: &Config,
    sched: &SchedulerConfig,
    dtype: DType,
) -> Result<BackendConfig> {
    let shape = StepShape {
        num_q_heads: cfg.num_attention_heads as u32,
        num_kv_heads: cfg.num_key_value_heads as u32,
        head_dim: (cfg.hidden_size / cfg.num_attention_heads) as u32,
        block_size: sched.block_size,
        num_blocks: sched.num_blocks,
        dtype,
        kv_dtype: dtype,
    };
    let max_blocks = sched.max_model_len.div_ceil(sched.block_size);
    let mut c = BackendConfig::new(
        shape,
        cfg.num_hidden_layers,
        u32::try_from(sched.max_num_seqs)?,
        max_blocks,
    );
    c.num_host_blocks = sched.num_host_blocks;
    Ok(c)
}

impl Engine<CpuBackend> {
    /// An engine on the CPU backend (pagedkv's kernels in the emulator).
    pub fn on_cpu(model: PagedLlama, cfg: &Config, ec: &EngineConfig) -> Result<Self> {
        Self::on_cpu_with(model, backend_config(cfg, &ec.scheduler, ec.dtype)?, ec)
    }
}

impl<M: PagedModel> Engine<CpuBackend, M> {
    /// An engine serving `model` on the CPU backend made with `bc` (pagedkv's kernels
    /// in the emulator; `ec.dtype` is `bc`'s).
    pub fn on_cpu_with(model: M, bc: BackendConfig, ec: &EngineConfig) -> Result<Self> {
        let mut emu = pagedkv::host::emulator::Emulator::new();
        if ec.emulator_workers > 0 {
            emu = emu.with_workers(ec.emulator_workers);
        }
        let be = CpuBackend::with_emulator(bc, emu)?;
        Self::new(model, be, ec.scheduler.clone())
    }
}

impl<B: CandleBackend, M: PagedModel> Engine<B, M> {
    /// An engine serving `model` on `be` (made for the model's attention and the
    /// scheduler's pool) under the scheduler settings `sched`.
    pub fn new(model: M, mut be: B, sched: SchedulerConfig) -> Result<Self> {
        let c = be.config();
        if c.num_layers != model.num_tensors()
            || c.shape.num_blocks != sched.num_blocks
            || c.shape.block_size != sched.block_size
            || c.num_host_blocks != sched.num_host_blocks
        {
            return Err("the backend was not made for this model and scheduler".into());
        }
        let opts = AttentionOptions::new(c.shape.head_dim);
        let cache = be.alloc_cache()?;
        Ok(Self {
            model,
            be,
            cache,
            sched: Scheduler::new(sched)?,
            opts,
            live: HashMap::new(),
            done: Vec::new(),
            copies: Copies::default(),
        })
    }

    /// Queues a request: `prompt`, then up to `max_tokens` greedy tokens.
    pub fn add_request(&mut self, id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> Result<()> {
        self.sched
            .add_request(Request::new(id, prompt.clone(), max_tokens))?;
        self.live.insert(
            id,
            Live {
                all: prompt.clone(),
                out: Generated {
                    request: id,
                    prompt,
                    ..Generated::default()
                },
            },
        );
        Ok(())
    }

    /// Whether every request finished.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle()
    }

    /// The scheduler's counters (preemptions, prefix-cache hits, swaps).
    pub fn metrics(&self) -> Metrics {
        self.sched.metrics()
    }

    /// Takes the requests finished so far.
    pub fn take_finished(&mut self) -> Vec<Generated> {
        std::mem::take(&mut self.done)
    }

    /// Runs one step: schedule, forward, sample, report.
    pub fn step(&mut self) -> Result<StepReport> {
        let batch = self.sched.step()?.clone();
        if batch.seqs.is_empty() {
            return Err("the scheduler scheduled nothing with requests in flight".into());
        }
        let mut report = StepReport {
            preempted: batch.preempted.clone(),
            swapped: (batch.swap_out.len(), batch.swap_in.len()),
            ..StepReport::default()
        };
        let mut tokens = Vec::with_capacity(batch.slot_mapping.len());
        for s in &batch.seqs {
            let live = self.live.get(&s.request).ok_or("unknown request")?;
            let (start, end) = (
                s.start_pos as usize,
                (s.start_pos + s.num_new_tokens) as usize,
            );
            // The step computes a sequence's tokens up to its last (the one sampled
            // last, or the prompt's), and the cache then holds them all.
            if end != live.all.len() || s.context_len as usize != end {
                return Err(format!(
                    "request {}: new tokens {start}..{end}, context {}, but it has {} tokens",
                    s.request,
                    s.context_len,
                    live.all.len()
                )
                .into());
            }
            tokens.extend_from_slice(&live.all[start..end]);
            if s.is_prefill {
                report.prefills += 1;
                if start > 0 {
                    report.prefix_hits.push((s.request, s.start_pos));
                }
            } else {
                report.decodes += 1;
            }
        }
        report.tokens = tokens.len();

        report.prefill_kernel = self
            .be
            .begin_step(&batch, &mut self.cache)?
            .prefill
            .map(|p| p.kernel);
        let logits = self.model.forward(
            &mut self.be,
            &mut self.cache,
            &batch,
            &tokens,
            &self.opts,
            &mut self.copies,
        )?;
        let logits = logits.to_vec2::<f32>()?;
        let mut sampled = Vec::with_capacity(batch.seqs.len());
        for (s, row) in batch.seqs.iter().zip(logits) {
            let t = argmax(&row);
            let live = self.live.get_mut(&s.request).ok_or("unknown request")?;
            live.all.push(t);
            live.out.tokens.push(t);
            live.out.logits.push(row);
            sampled.push((s.seq, t));
        }
        for (seq, _) in self.sched.on_step_done(&sampled)? {
            let s = batch
                .seqs
                .iter()
                .find(|s| s.seq == seq)
                .ok_or("a sequence finished that was not scheduled")?;
            let live = self.live.remove(&s.request).ok_or("unknown request")?;
            self.done.push(live.out);
        }
        Ok(report)
    }
}

/// The index of the largest value (the first of equals): greedy sampling.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// A request of a workload: it arrives before step `at` (0: before the first).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// The step before which it is added.
    pub at: usize,
    /// Its id.
    pub id: RequestId,
    /// Its prompt.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: u32,
}

/// What serving a workload did.
#[derive(Clone, Debug, Default)]
pub struct Served {
    /// Every request's output, by request id.
    pub generated: Vec<Generated>,
    /// Every step's report.
    pub steps: Vec<StepReport>,
    /// The scheduler's counters at the end.
    pub metrics: Metrics,
}

/// Serves `arrivals` on `engine` to the end: each request is added before its step,
/// then steps run until everything finished.
pub fn serve<B: CandleBackend, M: PagedModel>(
    engine: &mut Engine<B, M>,
    arrivals: &[Arrival],
) -> Result<Served> {
    let mut served = Served::default();
    let mut next = 0;
    let mut step = 0;
    loop {
        while next < arrivals.len() && arrivals[next].at <= step {
            let a = &arrivals[next];
            engine.add_request(a.id, a.prompt.clone(), a.max_tokens)?;
            next += 1;
        }
        if engine.is_idle() {
            if next == arrivals.len() {
                break;
            }
            step = arrivals[next].at;
            continue;
        }
        served.steps.push(engine.step()?);
        step += 1;
    }
    served.generated = engine.take_finished();
    served.generated.sort_by_key(|g| g.request);
    served.metrics = engine.metrics();
    Ok(served)
}
