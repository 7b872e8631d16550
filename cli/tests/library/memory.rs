//! What the simulator holds while requests wait: a trace that arrives faster than it is
//! served once grew by some 6.4 KB per waiting request (each was handed to the paged
//! scheduler on arrival, its prompt's tokens and all) until a 10^6-line trace aborted
//! at 5.8 GB. The requests waiting now hold nothing but their place in the workload.
//!
//! The bytes are counted by this test binary's allocator, per thread: a simulation runs
//! on the calling thread, and the other tests' threads count their own.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use pagedkv_cli::sim::{
    GpuSpec, ModelSpec, Policy, SimConfig, TraceRequest, Workload, limits, simulate,
};

/// The system allocator, counting the bytes each thread holds and their peak.
struct Counting;

thread_local! {
    static HELD: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    // (`try_with`: never a panic in the allocator, even as a thread ends.)
    let _ = HELD.try_with(|h| {
        let now = h.get() + delta;
        h.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: every call is the system allocator's, with its arguments; the counting
// allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            count(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) };
        count(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            count(new_size as isize - layout.size() as isize);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The peak of the bytes this thread held during `f`, above what it held before.
fn peak_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = HELD.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, (PEAK.with(Cell::get) - base).max(0) as usize)
}

/// 20000 requests of 1000 + 8 tokens arriving at 10000 a second on OPT-13B and an
/// A100 (some 130 served a second): nearly all of them wait at once. Each policy's
/// peak stays under 16 MB (the paged one's is some 270 KB; before, it was 87 MB, 4.3 KB
/// per request, and grew with the requests, so a 10^6-line trace aborted).
#[test]
fn requests_waiting_for_the_simulator_hold_no_memory_of_their_own() {
    let n = 20_000;
    let w = Workload {
        requests: (0..n)
            .map(|i| TraceRequest {
                arrival_s: i as f64 * 1e-4,
                prompt_len: 1000,
                output_len: 8,
            })
            .collect(),
        description: "20000 requests at 10000/s".into(),
    };
    let cfg = SimConfig::new(
        GpuSpec::preset("a100-40gb").unwrap(),
        ModelSpec::preset("opt-13b").unwrap(),
    );
    for policy in [Policy::Paged(16), Policy::Max] {
        let (r, peak) = peak_during(|| simulate(policy, &w, &cfg, &mut || {}).unwrap());
        assert_eq!(r.completed, n, "{}", r.policy);
        assert!(
            peak < 16 << 20,
            "{}: peaked at {peak} bytes, {} per request",
            r.policy,
            peak / n
        );
    }
}

/// The requests the paged scheduler holds (running, and the few it could admit next)
/// keep their tokens; past `SimConfig::max_live_tokens` of them (at most
/// [`limits::MAX_LIVE_TOKENS`]) the run is an error naming the limit, never an abort.
/// Requests of 20 tokens after a 1000-token system prompt share its blocks, so 256 of
/// them would be held at once: 263168 tokens, past a limit of 100000.
#[test]
fn more_live_tokens_than_the_simulator_keeps_is_an_error_naming_the_limit() {
    let mut cfg = SimConfig::new(
        GpuSpec::preset("a100-40gb").unwrap(),
        ModelSpec::preset("opt-13b").unwrap(),
    );
    assert_eq!(cfg.max_live_tokens, limits::MAX_LIVE_TOKENS);
    cfg.max_live_tokens = 100_000;
    cfg.system_prompt = 1000;
    let base = Workload {
        requests: (0..300)
            .map(|_| TraceRequest {
                arrival_s: 0.0,
                prompt_len: 20,
                output_len: 8,
            })
            .collect(),
        description: "300 requests at once".into(),
    };
    let w = base.with_system_prompt(1000, 2048);
    let e = simulate(Policy::Paged(16), &w, &cfg, &mut || {}).unwrap_err();
    assert!(
        e.0.contains("limit of 100000 tokens") && e.0.contains("--system-prompt"),
        "{e}"
    );
    // Within the limit the same requests run.
    cfg.max_live_tokens = limits::MAX_LIVE_TOKENS;
    let r = simulate(Policy::Paged(16), &w, &cfg, &mut || {}).unwrap();
    assert_eq!(r.completed, 300);
}
