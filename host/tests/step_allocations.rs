//! A steady-state decode `step()` makes no heap allocation (counted with a global
//! allocator wrapper in this test binary only, on the test's own thread: the test
//! harness's other threads allocate when they please).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};

struct Counting;

thread_local! {
    /// Allocations made by this thread (const-initialised: reading it never allocates).
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: a thread being torn down has no slot left; it is not the test thread.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        count();
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn steady_state_decode_steps_do_not_allocate() {
    let n = 64;
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: n * 80,
        block_size: 16,
        max_num_seqs: n as usize,
        max_tokens_per_step: 1 << 20,
        max_model_len: 2048,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap();
    for i in 0..n as u64 {
        s.add_request(Request::new(i, (0..1000).map(|t| t as u32).collect(), 1000))
            .unwrap();
    }
    let mut sampled: Vec<(u64, u32)> = Vec::with_capacity(n as usize);
    // Admit everyone and let the buffers reach their steady size.
    for _ in 0..40 {
        let b = s.step().unwrap();
        sampled.clear();
        sampled.extend(b.seqs.iter().map(|q| (q.seq, 5)));
        s.on_step_done(&sampled).unwrap();
    }
    assert_eq!(s.running_seqs().len(), n as usize);
    let (mut step_allocs, mut done_allocs) = (0, 0);
    for _ in 0..200 {
        let before = allocs();
        let b = s.step().unwrap();
        step_allocs += allocs() - before;
        sampled.clear();
        sampled.extend(b.seqs.iter().map(|q| (q.seq, 5)));
        let before = allocs();
        s.on_step_done(&sampled).unwrap();
        done_allocs += allocs() - before;
    }
    // 200 steps of 64 sequences cross many block boundaries (a new block every 16
    // tokens): the pool allocates from its free queue, not from the heap. The
    // prompts (1000 tokens) end mid-block, so each filled block is hashed from
    // tokens on both sides of a history's pending ones as well.
    assert_eq!(step_allocs, 0, "heap allocations in 200 steady-state steps");
    assert_eq!(
        done_allocs, 0,
        "heap allocations in 200 steady-state on_step_done calls"
    );
}
