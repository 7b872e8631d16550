//! The paged policy: pagedkv's real [`Scheduler`] and block pool, driven step by step
//! over a workload.

use pagedkv::host::scheduler::{Request, Scheduler, SchedulerConfig};

use super::policy::Stats;
use super::{Policy, PolicyResult, SimConfig, SimError, Workload, err};

/// Runs [`Policy::Paged`] with `block_size` over a workload (see [`super::simulate`]).
pub(super) fn simulate_paged(
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
        // The finished sequences' tokens are not needed: memory stays with the live
        // requests, whatever the workload's length.
        drop(s.take_finished());
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
