#![allow(missing_docs)] // criterion_group! generates an undocumented function.
//! Host-side speed: the serving loop's real cycle (`step()` + `on_step_done()`), and
//! the admission of a prefill with prefix-cache lookups.
//!
//! `cargo bench --bench scheduler`.
//!
//! **Decode cycle** (a table printed first; not criterion, which reports neither the
//! worst step nor per-step medians): N running sequences with 2000-token prompts
//! (distinct, so no prefix hits), block_size 16, a pool large enough that nothing is
//! evicted. Each measured step is `step()` + `on_step_done()` (building the sampled
//! list in between is the caller's work and is not timed), for N = 256, 1024, 4096 and
//! 16384, prefix caching off and on, and two arrival patterns:
//! * *staggered*: requests are admitted under a token budget of N/16 prompts a step, so
//!   their lengths differ and about N/16 sequences cross a block boundary every step
//!   (what a serving loop sees);
//! * *lock-step*: everyone is admitted in one step, so all N cross a boundary together
//!   every 16th step (the worst step).
//!
//! After 32 warm-up steps it times `STEPS` steps and reports the median and the worst
//! step, the median per running sequence, and the medians of `step()` and of
//! `on_step_done()` alone (progress goes to stderr). It checks the work is real: over every 16
//! steps each sequence gained exactly one block, and with prefix caching on the prefix
//! cache grew by N blocks (by none when off). `SCHED_BENCH_N=256,1024` picks the sizes,
//! `SCHED_BENCH_STEPS` the measured steps (a multiple of 16, default 512), and
//! `SCHED_BENCH_ONLY=on-staggered` (or `off-lock-step`, ...) one configuration.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use pagedkv::host::scheduler::{Request, Scheduler, SchedulerConfig};

const PROMPT: u32 = 2000;
const BLOCK: u32 = 16;
const WARMUP: u32 = 32;

/// A scheduler with `n` sequences running (prefills done).
fn running(n: u32, caching: bool, staggered: bool, steps: u32) -> (Scheduler, Vec<(u64, u32)>) {
    let per_step = if staggered { n.div_ceil(BLOCK) } else { n };
    let mut s = Scheduler::new(SchedulerConfig {
        // The prompts, the measured growth, and slack: nothing is ever evicted.
        num_blocks: n * (PROMPT / BLOCK + (WARMUP + steps) / BLOCK + 4) + 1,
        block_size: BLOCK,
        max_num_seqs: n as usize,
        max_tokens_per_step: (per_step * PROMPT + n) as usize,
        max_model_len: PROMPT + 2 * (WARMUP + steps + 16),
        watermark: 0.0,
        enable_prefix_caching: caching,
        ..SchedulerConfig::default()
    })
    .expect("config");
    for i in 0..n as u64 {
        // Distinct prompts: the first token differs, so every hash chain does.
        let prompt: Vec<u32> = (0..PROMPT)
            .map(|t| if t == 0 { i as u32 } else { t })
            .collect();
        s.add_request(Request::new(i, prompt, 2 * (WARMUP + steps + 16)))
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

/// One timed cycle: the times of `step()` and of `on_step_done()`, building
/// `sampled` in between untimed.
fn cycle(s: &mut Scheduler, sampled: &mut Vec<(u64, u32)>) -> (Duration, Duration) {
    let start = Instant::now();
    let b = black_box(s.step().expect("step"));
    let step = start.elapsed();
    sampled.clear();
    sampled.extend(b.seqs.iter().map(|q| (q.seq, 7)));
    let start = Instant::now();
    black_box(s.on_step_done(sampled).expect("done"));
    (step, start.elapsed())
}

struct Row {
    /// Of the whole cycle.
    median: Duration,
    worst: Duration,
    /// Of each half alone (they need not add up to the cycle's median).
    step_median: Duration,
    done_median: Duration,
}

/// The median of `times` (sorted in place).
fn median(times: &mut [Duration]) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn measure(n: u32, caching: bool, staggered: bool, steps: u32) -> Row {
    let (mut s, mut sampled) = running(n, caching, staggered, steps);
    for _ in 0..WARMUP {
        cycle(&mut s, &mut sampled);
    }
    let mut times = Vec::with_capacity(steps as usize);
    let mut halves = Vec::with_capacity(steps as usize);
    let seqs: Vec<u64> = s.running_seqs().to_vec();
    for _ in 0..steps / BLOCK {
        let blocks: Vec<usize> = seqs
            .iter()
            .map(|&q| s.block_table(q).expect("live").blocks().len())
            .collect();
        let cached = s.kv().device().num_cached();
        for _ in 0..BLOCK {
            let (step, done) = cycle(&mut s, &mut sampled);
            times.push(step + done);
            halves.push((step, done));
        }
        // The work is real: every sequence gained one block, and each filled a block
        // the prefix cache registered.
        assert_eq!(s.running_seqs().len(), n as usize, "a sequence finished");
        for (&q, &before) in seqs.iter().zip(&blocks) {
            let now = s.block_table(q).expect("live").blocks().len();
            assert_eq!(
                now,
                before + 1,
                "sequence {q} gained {} blocks",
                now - before
            );
        }
        let grown = s.kv().device().num_cached() - cached;
        assert_eq!(
            grown,
            if caching { n as usize } else { 0 },
            "prefix cache growth"
        );
    }
    let mut step: Vec<Duration> = halves.iter().map(|h| h.0).collect();
    let mut done: Vec<Duration> = halves.iter().map(|h| h.1).collect();
    Row {
        median: median(&mut times),
        worst: *times.last().expect("steps"),
        step_median: median(&mut step),
        done_median: median(&mut done),
    }
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn decode_cycle() {
    let sizes: Vec<u32> = std::env::var("SCHED_BENCH_N")
        .map(|v| v.split(',').map(|x| x.trim().parse().expect("N")).collect())
        .unwrap_or_else(|_| vec![256, 1024, 4096, 16384]);
    let steps: u32 = std::env::var("SCHED_BENCH_STEPS")
        .map(|v| v.parse().expect("steps"))
        .unwrap_or(512);
    assert!(
        steps >= BLOCK && steps.is_multiple_of(BLOCK),
        "steps: a multiple of 16"
    );
    println!(
        "scheduler decode cycle: step() + on_step_done(), {steps} steps, prompts {PROMPT}, block {BLOCK}"
    );
    println!(
        "{:>6} {:>7} {:>10} | {:>11} {:>11} {:>10} | {:>8} {:>8}",
        "N", "caching", "boundaries", "median µs", "worst µs", "ns/seq", "step µs", "done µs"
    );
    let only = std::env::var("SCHED_BENCH_ONLY").ok();
    for &n in &sizes {
        for caching in [false, true] {
            for staggered in [true, false] {
                let name = format!(
                    "{}-{}",
                    if caching { "on" } else { "off" },
                    if staggered { "staggered" } else { "lock-step" }
                );
                if only.as_ref().is_some_and(|o| *o != name) {
                    continue;
                }
                eprintln!("  [N = {n}, {name}: admitting {n} prompts, then {steps} steps]");
                let r = measure(n, caching, staggered, steps);
                println!(
                    "{:>6} {:>7} {:>10} | {:>11.1} {:>11.1} {:>10.1} | {:>8.1} {:>8.1}",
                    n,
                    if caching { "on" } else { "off" },
                    if staggered { "staggered" } else { "lock-step" },
                    us(r.median),
                    us(r.worst),
                    r.median.as_secs_f64() * 1e9 / n as f64,
                    us(r.step_median),
                    us(r.done_median),
                );
            }
        }
    }
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
    let prompt: Vec<u32> = (0..PROMPT).collect();
    let first = s
        .add_request(Request::new(0, prompt.clone(), 4000 - PROMPT))
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

fn main() {
    // `cargo bench -- <filter>`: the cycle table runs unless the filter names only
    // the criterion benchmark.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    if filter.is_empty()
        || filter
            .iter()
            .any(|f| "scheduler_decode_cycle".contains(f.as_str()))
    {
        decode_cycle();
    }
    let mut c = Criterion::default().configure_from_args();
    prefill_admission(&mut c);
    c.final_summary();
}
