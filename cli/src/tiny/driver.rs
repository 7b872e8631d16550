//! The serving loop both runs share: the scheduler over the run's requests, the
//! backend's step, greedy sampling, the checks against dense attention, and the report.

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use rand::Rng;

use pagedkv::host::backend::{AttentionBackend, PagedCache};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::reference::{DenseInputs, dense_decode_attention, gather};
use pagedkv::host::scheduler::{Batch, Request, Scheduler, SchedulerConfig, SeqId};
use pagedkv::host::{DType, HostTensor};

use super::model::Model;
use super::spec::{Draft, accept};
use super::{MAX_MODEL_LEN, MAX_PROMPT_LEN, RunConfig, RunReport, SHARED_PREFIX, SpecStats};

/// Checks of attention outputs against dense attention over the gathered cache.
pub(super) struct Check {
    pub(super) verified: usize,
    pub(super) max_error: f64,
}

impl Check {
    /// Checks `got` (one query's `[num_q_heads, head_dim]` output) for query `q` of a
    /// sequence with block-table row `row`, over its first `upto` positions of the host
    /// copies `kc`, `vc` of the cache.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn one(
        &mut self,
        cfg: &RunConfig,
        opts: &AttentionOptions,
        (kc, vc): (&HostTensor, &HostTensor),
        row: &[i32],
        upto: usize,
        q: &[f64],
        got: &[f64],
    ) {
        let shape = cfg.shape().batch(1, row.len() as u32);
        let (kg, vg) = gather(&shape, kc, vc, row, upto, 0);
        let (qh, kvh, d) = (
            cfg.num_q_heads as usize,
            cfg.num_kv_heads as usize,
            cfg.head_dim as usize,
        );
        let want = dense_decode_attention(&DenseInputs {
            q,
            k: &kg,
            v: &vg,
            num_q_heads: qh,
            num_kv_heads: kvh,
            head_dim: d,
            opts,
            sinks: None,
        });
        let num: f64 = got.iter().zip(&want).map(|(a, b)| (a - b) * (a - b)).sum();
        let den: f64 = want.iter().map(|b| b * b).sum();
        let e = (num / den.max(f64::MIN_POSITIVE)).sqrt();
        self.max_error = if e.is_nan() {
            f64::INFINITY
        } else {
            self.max_error.max(e)
        };
        self.verified += 1;
    }
}

/// What a step function sees.
pub(super) struct StepCtx<'a> {
    pub(super) cfg: &'a RunConfig,
    pub(super) model: &'a Model,
    pub(super) sched: &'a Scheduler,
    pub(super) opts: &'a AttentionOptions,
    pub(super) check: &'a mut Check,
    /// Each verify row's draft tokens (speculative decoding).
    pub(super) drafts: &'a HashMap<SeqId, Vec<u32>>,
}

/// `v` as a host tensor of `dtype`.
pub(super) fn to_host(
    dtype: DType,
    shape: &[usize],
    v: &[f32],
) -> pagedkv::host::Result<HostTensor> {
    HostTensor::from_f64(
        dtype,
        shape,
        &v.iter().map(|&a| a as f64).collect::<Vec<_>>(),
    )
}

/// Serves the run's requests on `be`: `step` computes one batch on the backend and
/// returns the hidden states of its new tokens (`[slot_mapping.len(), hidden]`, row
/// by row) and the tokens whose K/V it computed. With `cfg.spec`, every decoding
/// sequence verifies up to that many drafts of the toy draft model a step (see
/// `spec`).
pub(super) fn serve<B: AttentionBackend>(
    be: &mut B,
    cfg: &RunConfig,
    progress: &mut dyn FnMut(String),
    mut step: impl FnMut(
        &mut B,
        &mut PagedCache<B::Tensor>,
        &Batch,
        StepCtx<'_>,
    ) -> Result<(Vec<f32>, u64), Box<dyn std::error::Error>>,
) -> Result<RunReport, Box<dyn std::error::Error>> {
    let mut model = Model::new(cfg);
    // Unused slots hold NaN: a kernel that read one would poison the output.
    let mut cache = be.alloc_cache()?;
    // Prefix caching on, and chunked prefill: a prompt longer than the step's token
    // budget is prefilled over several steps.
    let mut sched = Scheduler::with_chunked_prefill(
        SchedulerConfig {
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            max_num_seqs: cfg.num_requests,
            max_tokens_per_step: cfg.step_tokens as usize,
            max_model_len: MAX_MODEL_LEN,
            enable_prefix_caching: true,
            ..SchedulerConfig::default()
        },
        true,
    )?;
    // Every prompt starts with the same "system prompt" of SHARED_PREFIX tokens, so a
    // prompt that holds a whole block of it finds that block in the prefix cache.
    let shared: Vec<u32> = (0..SHARED_PREFIX)
        .map(|_| model.rng.random_range(0..cfg.vocab as u32))
        .collect();
    for i in 0..cfg.num_requests {
        let r = &mut model.rng;
        let len = r.random_range(4..=MAX_PROMPT_LEN as usize);
        let prompt: Vec<u32> = (0..len)
            .map(|p| match shared.get(p) {
                Some(&t) => t,
                None => r.random_range(0..cfg.vocab as u32),
            })
            .collect();
        sched.add_request(Request::new(i as u64, prompt, cfg.max_tokens))?;
    }
    let opts = AttentionOptions::new(cfg.head_dim);
    let mut check = Check {
        verified: 0,
        max_error: 0.0,
    };
    let (mut steps, mut tokens, mut util_sum) = (0u64, 0u64, 0.0f64);
    let (mut computed, mut cached_tokens) = (0u64, 0u64);
    let mut step_times = Vec::new();
    let mut outputs: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut margins: BTreeMap<u64, Vec<f32>> = BTreeMap::new();
    let mut draft = (cfg.spec > 0).then(|| Draft::new(&model, cfg));
    let mut spec = SpecStats::default();
    let mut drafts: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let start = Instant::now();
    let hidden = model.hidden;
    while !sched.is_idle() {
        let t0 = Instant::now();
        if cfg.spec > 0 {
            for q in sched.running_seqs().to_vec() {
                sched.set_lookahead(q, cfg.spec)?;
            }
        }
        let batch = sched.step()?.clone();
        if batch.seqs.is_empty() {
            return Err("the scheduler made an empty step with requests left".into());
        }
        // The drafts of every verify row (as many as the scheduler granted).
        drafts.clear();
        if let Some(dm) = draft.as_mut() {
            for q in batch.seqs.iter().filter(|q| q.num_draft_tokens > 0) {
                let history = sched.tokens(q.seq)?.to_vec();
                let k = q.num_draft_tokens as usize;
                drafts.insert(q.seq, dm.propose(cfg, &opts, q.seq, &history, k));
            }
        }
        let (states, computed_now) = step(
            be,
            &mut cache,
            &batch,
            StepCtx {
                cfg,
                model: &model,
                sched: &sched,
                opts: &opts,
                check: &mut check,
                drafts: &drafts,
            },
        )?;
        computed += computed_now;
        cached_tokens += batch.num_cached_tokens as u64;
        // Greedy sampling from each row's last hidden state (a non-final chunk of a
        // prefill samples nothing: the scheduler ignores its token); a verify row
        // keeps its drafts while they are the target's greedy tokens, then the
        // target's own.
        let mut kept: Vec<(SeqId, Vec<u32>)> = Vec::with_capacity(batch.seqs.len());
        for (i, q) in batch.seqs.iter().enumerate() {
            let at = |j: u32| {
                let t = (q.token_offset + j) as usize;
                model.greedy_margin(&states[t * hidden..(t + 1) * hidden], cfg.vocab)
            };
            let verify = i >= batch.num_decodes as usize && !q.is_prefill;
            let (toks, marg): (Vec<u32>, Vec<f32>) = if verify {
                let g: Vec<(u32, f32)> = (0..q.num_new_tokens).map(at).collect();
                let greedy: Vec<u32> = g.iter().map(|x| x.0).collect();
                let d = drafts.get(&q.seq).map_or(&[][..], |d| d.as_slice());
                let toks = accept(d, &greedy);
                spec.verify_rows += 1;
                spec.drafted += d.len() as u64;
                spec.accepted += toks.len() as u64 - 1;
                let marg = g[..toks.len()].iter().map(|x| x.1).collect();
                (toks, marg)
            } else {
                let (t, m) = at(q.num_new_tokens - 1);
                (vec![t], vec![m])
            };
            if q.samples {
                // What the sequence keeps: its cap may cut a verify row's tokens.
                let out = outputs.entry(q.request).or_default();
                let room = (cfg.max_tokens as usize).saturating_sub(out.len());
                let n = toks.len().min(room);
                out.extend_from_slice(&toks[..n]);
                margins
                    .entry(q.request)
                    .or_default()
                    .extend_from_slice(&marg[..n]);
                tokens += n as u64;
            }
            kept.push((q.seq, toks));
        }
        steps += 1;
        util_sum += sched.metrics().kv_utilization;
        let lists: Vec<(SeqId, &[u32])> = kept.iter().map(|(s, t)| (*s, t.as_slice())).collect();
        for (s, _) in sched.on_step_done_accepted(&lists)? {
            if let Some(dm) = draft.as_mut() {
                dm.forget(s);
            }
        }
        let mean_len = batch.context_lens.iter().map(|&c| c as f64).sum::<f64>()
            / batch.context_lens.len() as f64;
        step_times.push((mean_len, t0.elapsed().as_secs_f64()));
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
        verified: check.verified,
        max_error: check.max_error,
        tolerance: match cfg.dtype {
            DType::F32 => 1e-5,
            _ => 1e-2,
        },
        step_times,
        outputs,
        margins,
        computed_tokens: computed,
        cached_tokens,
        spec: (cfg.spec > 0).then_some(spec),
    })
}
