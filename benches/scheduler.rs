#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! Host-side speed: one steady-state decode `step()` of the scheduler, and the
//! admission of a prefill with prefix-cache lookups.
//!
//! `cargo bench --bench scheduler`. Steady state: N running sequences at context
//! 1500..2500 (mean about 2000), block_size 16; each measured step includes the block
//! allocations that fall due (a sequence crosses a block boundary every 16 steps).
//! `on_step_done` (feeding the sampled tokens back) runs between the timed steps and is
//! not timed; neither is rebuilding the state every 1000 steps (so the context stays
//! near 2000 however many iterations criterion asks for).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use pagedkv::host::scheduler::{Request, Scheduler, SchedulerConfig};

const CONTEXT: u32 = 2000;
/// Prompt length of the steady-state sequences, and steps before a rebuild.
const START: u32 = 1500;
const STEPS_PER_STATE: u32 = 1000;

fn steady(n: u32) -> (Scheduler, Vec<(u64, u32)>) {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: n * (CONTEXT / 16 + 80),
        block_size: 16,
        max_num_seqs: n as usize,
        max_tokens_per_step: 1 << 24,
        max_model_len: 4096,
        ..SchedulerConfig::default()
    })
    .expect("config");
    for i in 0..n as u64 {
        let prompt: Vec<u32> = (0..START).map(|t| t ^ i as u32).collect();
        s.add_request(Request::new(i, prompt, 2 * STEPS_PER_STATE))
            .expect("request");
    }
    let mut sampled = Vec::with_capacity(n as usize);
    while s.running_seqs().len() < n as usize {
        let b = s.step().expect("step");
        sampled.clear();
        sampled.extend(b.seqs.iter().map(|q| (q.seq, 7)));
        s.on_step_done(&sampled).expect("done");
    }
    (s, sampled)
}

fn decode_step(c: &mut Criterion) {
    let mut g = c.benchmark_group("scheduler_decode_step");
    g.sample_size(10)
        .sampling_mode(criterion::SamplingMode::Flat)
        .measurement_time(Duration::from_secs(3));
    for n in [256u32, 1024, 4096] {
        let (mut s, mut sampled) = steady(n);
        let mut steps = 0;
        g.bench_with_input(BenchmarkId::from_parameter(n), &n, |b, _| {
            b.iter_custom(|iters| {
                let mut t = Duration::ZERO;
                for _ in 0..iters {
                    if steps == STEPS_PER_STATE {
                        (s, sampled) = steady(n);
                        steps = 0;
                    }
                    let start = Instant::now();
                    let batch = black_box(s.step().expect("step"));
                    t += start.elapsed();
                    sampled.clear();
                    sampled.extend(batch.seqs.iter().map(|q| (q.seq, 7)));
                    s.on_step_done(&sampled).expect("done");
                    steps += 1;
                }
                t
            })
        });
    }
    g.finish();
}

fn prefill_admission(c: &mut Criterion) {
    // A 2000-token prompt whose first 1984 tokens are cached: admission hashes the
    // prompt's 124 full blocks, finds 124 hits, allocates one block.
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 4096,
        block_size: 16,
        enable_prefix_caching: true,
        max_model_len: 4096,
        ..SchedulerConfig::default()
    })
    .expect("config");
    let prompt: Vec<u32> = (0..CONTEXT).collect();
    let first = s
        .add_request(Request::new(0, prompt.clone(), 4000 - CONTEXT))
        .expect("request");
    s.step().expect("step");
    s.on_step_done(&[(first, 1)]).expect("done");
    let mut id = 1u64;
    c.bench_function("scheduler_prefill_admission_2000_tokens_prefix_hit", |b| {
        b.iter(|| {
            s.add_request(Request::new(id, prompt.clone(), 16))
                .expect("request");
            let batch = s.step().expect("step");
            let q = batch
                .seqs
                .iter()
                .find(|q| q.request == id)
                .expect("admitted");
            assert_eq!(q.start_pos, 1984, "the cached prefix was not hit");
            let sampled: Vec<(u64, u32)> = batch.seqs.iter().map(|q| (q.seq, 1)).collect();
            s.on_step_done(&sampled).expect("done");
            s.abort(id).expect("abort");
            id += 1;
        })
    });
}

criterion_group!(benches, decode_step, prefill_admission);
criterion_main!(benches);
