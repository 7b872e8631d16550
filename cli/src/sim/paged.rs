//! The paged policy: pagedkv's real [`Scheduler`] and block pool, driven step by step
//! over a workload. A model that mixes sliding-window and full layers runs under the
//! hybrid allocator: one block table per layer group, the pool's blocks pages of
//! `layers_per_group` layers (see `pagedkv::host::block::spec`), each window group
//! holding only its window; a step reads each layer's window of each sequence.

use std::collections::VecDeque;

use pagedkv::host::ops::cascade::find_groups;
use pagedkv::host::scheduler::{Batch, Request, Scheduler, SchedulerConfig, SeqId};
use pagedkv::kernels::kernels::attention::FIXED_BLOCK_SIZE;
use pagedkv::kernels::kernels::prefill::{ROWS, TILE_ROWS, TILED_HEAD_DIMS};

use super::policy::{CascadeTraffic, Stats};
use super::{Policy, PolicyResult, SimConfig, SimError, StepLoad, Workload, err};

/// Runs [`Policy::Paged`] with `block_size` over a workload (see [`super::simulate`]).
pub(super) fn simulate_paged(
    block_size: u32,
    w: &Workload,
    cfg: &SimConfig,
    on_finish: &mut dyn FnMut(),
) -> Result<PolicyResult, SimError> {
    let element = cfg.kv_dtype.element_bytes(&cfg.model);
    let (num_blocks, kv_groups) = if cfg.model.is_hybrid() {
        // A block is a page of every tensor a group's layers use.
        let (blocks, groups) = cfg.hybrid_pool(block_size)?;
        (blocks + 1, groups.specs().to_vec())
    } else {
        (cfg.capacity_tokens()? / block_size as u64 + 1, Vec::new())
    };
    // One more block than the budget holds: block 0 is the scheduler's null block.
    let num_blocks = u32::try_from(num_blocks)
        .map_err(|_| SimError(format!("{}: too many blocks", cfg.budget_flag())))?;
    let hybrid = !kv_groups.is_empty();
    let mut s = Scheduler::new(SchedulerConfig {
        kv_groups,
        num_blocks,
        block_size,
        num_host_blocks: 0,
        max_num_seqs: cfg.max_num_seqs,
        max_tokens_per_step: cfg
            .max_tokens_per_step
            .max(cfg.model.max_model_len as usize),
        watermark: 0.01,
        max_model_len: cfg.model.max_model_len,
        enable_prefix_caching: cfg.system_prompt > 0,
        ..SchedulerConfig::default()
    })
    .map_err(|e| SimError(format!("paged scheduler: {e}")))?;
    let pool = (num_blocks - 1) as f64 * block_size as f64;
    let step_tokens = s.config().max_tokens_per_step as u64;
    let mut stats = Stats::new();
    let (mut t, mut arrived, mut fed, mut done, mut rejected, mut generated) =
        (0.0f64, 0usize, 0usize, 0usize, 0usize, 0u64);
    let mut sampled = Vec::new();
    // The live sequences' requests (their index in the workload).
    let mut request_of = std::collections::HashMap::new();
    // Requests that arrived wait in the workload (`fed..arrived`, nothing held per
    // request) until the scheduler could admit them; the scheduler holds the few it
    // could admit in its next step (`queued`, with a lower bound on the prompt tokens
    // each would compute). A request in the scheduler holds its prompt's tokens twice
    // and its block tables, some 4 to 7 KB: fed at arrival, a trace arriving faster than it
    // is served grew by that much per waiting request until the process aborted.
    let mut queued: VecDeque<(SeqId, u64)> = VecDeque::new();
    let mut queued_cost = 0u64;
    // Tokens (prompt + output) of the requests in the scheduler, at most
    // `cfg.max_live_tokens`.
    let mut live_tokens = 0u64;
    let mut started: Vec<SeqId> = Vec::new();
    let n = w.requests.len();
    let mut traffic = (cfg.system_prompt > 0 && !hybrid).then(Traffic::default);
    while done + rejected < n {
        while arrived < n && w.requests[arrived].arrival_s <= t {
            arrived += 1;
        }
        // The scheduler admits from the head of its queue, first come first served,
        // at most `max_num_seqs` groups and `step_tokens` computed tokens a step (and
        // never a request behind one it cannot admit): with that many queued, or
        // prompts of more tokens than that, a request behind them could not start in
        // the next step, so feeding it later changes no decision.
        while fed < arrived && queued.len() < cfg.max_num_seqs && queued_cost <= step_tokens {
            let r = &w.requests[fed];
            let len = r.prompt_len as u64 + r.output_len as u64;
            if live_tokens + len > cfg.max_live_tokens {
                return err(format!(
                    "{}: the requests running and waiting would hold more than the simulator's limit of {} tokens of prompt and output in memory ({} requests live, request {} of {len} tokens next); shorten the requests or --system-prompt",
                    Policy::Paged(block_size).name(),
                    cfg.max_live_tokens,
                    request_of.len(),
                    fed
                ));
            }
            // The system prompt's tokens (the same for every request), then the
            // request's own.
            let shared = cfg.system_prompt.min(r.prompt_len);
            let prompt: Vec<u32> = (0..r.prompt_len)
                .map(|i| {
                    if i < shared {
                        u32::MAX - i
                    } else {
                        (fed as u32).wrapping_mul(7919) ^ i
                    }
                })
                .collect();
            match s.add_request(Request::new(fed as u64, prompt, r.output_len)) {
                Ok(seq) => {
                    request_of.insert(seq, fed);
                    live_tokens += len;
                    // Prefix hits are at most the shared tokens (its own are unique).
                    let cost = ((r.prompt_len - shared) as u64).max(1);
                    queued.push_back((seq, cost));
                    queued_cost += cost;
                }
                Err(_) => {
                    rejected += 1;
                    on_finish();
                }
            }
            fed += 1;
        }
        let batch = s
            .step()
            .map_err(|e| SimError(format!("paged scheduler: {e}")))?;
        if batch.seqs.is_empty() {
            if arrived < n {
                t = t.max(w.requests[arrived].arrival_s);
                continue;
            }
            return err("paged simulation stalled: requests wait but none can be admitted");
        }
        // The queued requests this step admitted (first come, first served makes them
        // a prefix of the queue, but any order is counted right).
        started.clear();
        started.extend(batch.seqs.iter().filter(|q| q.is_prefill).map(|q| q.seq));
        queued.retain(|&(seq, cost)| {
            let admitted = started.contains(&seq);
            if admitted {
                queued_cost -= cost;
            }
            !admitted
        });
        let mut load = StepLoad::default();
        for q in &batch.seqs {
            let kv_bytes = if hybrid {
                cfg.model
                    .kv_bytes_held(q.context_len as u64, element)
                    .unwrap_or(u64::MAX) as f64
            } else {
                cfg.kv_bytes_of(q.context_len as u64)
            };
            if q.is_prefill {
                load.prefill_tokens += q.num_new_tokens as u64;
                load.prefill_kv_bytes += kv_bytes;
            } else {
                load.decode_tokens += q.num_new_tokens as u64;
                load.decode_kv_bytes += kv_bytes;
            }
        }
        if let Some(c) = traffic.as_mut() {
            c.add(batch, cfg, element, block_size);
        }
        let dt = cfg.step_duration(&load);
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
        for (seq, _) in &finished {
            if let Some(i) = request_of.remove(seq) {
                let r = &w.requests[i];
                stats.request_done(r.arrival_s, t, r.output_len);
                live_tokens -= r.prompt_len as u64 + r.output_len as u64;
            }
            done += 1;
            on_finish();
        }
        // The finished sequences' tokens are not needed: memory stays with the live
        // requests, whatever the workload's length.
        drop(s.take_finished());
    }
    let preemptions = s.metrics().preempted_recompute + s.metrics().preempted_swap;
    let mut r = stats.finish(
        Policy::Paged(block_size),
        done,
        rejected,
        t,
        generated,
        preemptions,
    );
    r.cascade = traffic.map(Traffic::finish);
    Ok(r)
}

/// Sums of [`CascadeTraffic`] over the steps.
#[derive(Default)]
struct Traffic {
    steps: u64,
    cascade_steps: u64,
    flat: f64,
    cascade: f64,
}

impl Traffic {
    /// One step's decode rows: their K/V bytes flat and as cascade attention.
    fn add(&mut self, batch: &Batch, cfg: &SimConfig, element: u32, block_size: u32) {
        let nd = batch.num_decodes as usize;
        if nd == 0 {
            return;
        }
        let w = batch.max_blocks_per_seq;
        let lens = &batch.context_lens[..nd];
        let groups = find_groups(
            &batch.block_tables[..nd * w as usize],
            w,
            lens,
            block_size,
            1,
        );
        let token = cfg.model.layer_token_bytes(element) as f64 * cfg.model.num_layers as f64;
        // Query rows per CTA tile of the shared pass: the multi-warp prefill's at its
        // head_dims and block size, the one-warp kernel's elsewhere.
        let tiled = TILED_HEAD_DIMS.contains(&cfg.model.head_dim) && block_size == FIXED_BLOCK_SIZE;
        let tile = if tiled { TILE_ROWS } else { ROWS } as u64;
        let flat: f64 = lens.iter().map(|&l| l as f64).sum::<f64>() * token;
        let mut cascade = flat;
        for g in &groups {
            let shared = (g.shared_blocks * block_size) as f64;
            let rows = g.rows.len() as u64 * cfg.model.query_group() as u64;
            let reads = rows.div_ceil(tile) as f64;
            cascade -= (g.rows.len() as f64 - reads) * shared * token;
        }
        self.steps += 1;
        self.cascade_steps += !groups.is_empty() as u64;
        self.flat += flat;
        self.cascade += cascade;
    }

    fn finish(self) -> CascadeTraffic {
        let n = self.steps.max(1) as f64;
        CascadeTraffic {
            decode_steps: self.steps,
            cascade_steps: self.cascade_steps,
            flat_bytes_per_step: self.flat / n,
            cascade_bytes_per_step: self.cascade / n,
        }
    }
}
