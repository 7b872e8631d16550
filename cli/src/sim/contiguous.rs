//! The contiguous policies, as in Orca: each request reserves one contiguous range of
//! token slots when admitted (first fit) and keeps it until it finishes: the model's
//! maximum length (Max), the next power of two of its real final length (Pow2), or
//! exactly that length (Oracle).

use std::collections::BTreeMap;

use super::policy::Stats;
use super::{Policy, PolicyResult, SimConfig, SimError, StepLoad, Workload, err};

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
    arrival: f64,
}

/// Runs a contiguous policy over a workload (see [`super::simulate`]).
pub(super) fn simulate_contiguous(
    policy: Policy,
    w: &Workload,
    cfg: &SimConfig,
    on_finish: &mut dyn FnMut(),
) -> Result<PolicyResult, SimError> {
    let capacity = cfg.capacity_tokens()?;
    let max_len = cfg.model.max_model_len as u64;
    let mut alloc = Contiguous::new(capacity);
    let mut live: Vec<Live> = Vec::new();
    let mut stats = Stats::new();
    // The requests waiting are `head..next` of the workload, in arrival order (first
    // come, first served): nothing is held per waiting request.
    let (mut t, mut head, mut next, mut done, mut rejected, mut generated) =
        (0.0f64, 0usize, 0usize, 0usize, 0usize, 0u64);
    let n = w.requests.len();
    while done + rejected < n {
        while next < n && w.requests[next].arrival_s <= t {
            next += 1;
        }
        // Decode every running request, then admit FCFS while a hole fits.
        let decodes = live.len() as u64;
        let decode_kv: u64 = live.iter().map(|l| l.stored + 1).sum();
        let (mut prompt_tokens, mut tokens) = (0u64, decodes);
        for l in live.iter_mut() {
            l.stored += 1;
        }
        while head < next {
            let r = &w.requests[head];
            let real = r.prompt_len as u64 + r.output_len as u64;
            let reserve = match policy {
                Policy::Max => max_len,
                Policy::Pow2 => real.next_power_of_two().min(max_len),
                _ => real,
            };
            if reserve > capacity {
                head += 1;
                rejected += 1;
                on_finish();
                continue;
            }
            // (A step holds at least one whole prompt, as the paged policy's does.)
            let step_budget = (cfg.max_tokens_per_step as u64).max(max_len);
            if live.len() >= cfg.max_num_seqs || tokens + r.prompt_len as u64 > step_budget {
                break;
            }
            let Some(start) = alloc.alloc(reserve) else {
                break;
            };
            head += 1;
            tokens += r.prompt_len as u64;
            prompt_tokens += r.prompt_len as u64;
            live.push(Live {
                start,
                reserved: reserve,
                stored: r.prompt_len as u64,
                final_stored: real - 1,
                generated: 0,
                output: r.output_len,
                arrival: r.arrival_s,
            });
        }
        if live.is_empty() {
            if next < n {
                t = t.max(w.requests[next].arrival_s);
                continue;
            }
            if head == next {
                break;
            }
            return err("contiguous simulation stalled");
        }
        // (A prompt's attention reads its own tokens' K/V.)
        let dt = cfg.step_duration(&StepLoad {
            prefill_tokens: prompt_tokens,
            prefill_kv_bytes: cfg.kv_bytes_of(prompt_tokens),
            decode_tokens: decodes,
            decode_kv_bytes: cfg.kv_bytes_of(decode_kv),
        });
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
                stats.request_done(l.arrival, t, l.output);
                done += 1;
                on_finish();
            } else {
                k += 1;
            }
        }
    }
    Ok(stats.finish(policy, done, rejected, t, generated, 0))
}
