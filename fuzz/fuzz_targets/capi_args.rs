//! Fuzzes the C ABI's argument checking: each input decodes into a sequence of C ABI
//! calls on real handles (schedulers created, used, destroyed, used after destroy) with
//! arbitrary counts, nulls, shapes, layout fields, dtypes, block ids and request ids.
//! Every call must return a status, never `PAGEDKV_ERR_PANIC`, with a message exactly
//! when it failed; AddressSanitizer (on by default with cargo fuzz) catches any read or
//! write outside a buffer.
//!
//! The buffers passed are real and as long as the API contract says ("valid for n
//! reads") wherever the library cannot know the length. Counts the library must check
//! against its own state are fuzzed freely, with buffers only as long as what the
//! library may read once its check passed: `on_step_done`'s `n` against the last step
//! (the buffer holds `min(n, scheduled)` entries), `add_request`'s `prompt_len`
//! against `max_model_len` (near the `u64` limits, over a buffer of the longest prompt
//! a scheduler here accepts), the reference kernels' `*_len` against the shape. Pool
//! sizes beyond the cap, and the strided decode's row strides near `u64::MAX`, are
//! fuzzed too (the latter reaches its stride arithmetic only on a GPU machine).
//!
//! The calls live in three modules and the values they are built from in a fourth,
//! under `capi_args/`: `scheduler_calls.rs` (the scheduler's handles and calls),
//! `kernel_calls.rs` (the CPU reference and CUDA entry points), `fp8_calls.rs` (the
//! fp8 entry points' type and scale checks, and scale calibration) and `generate.rs`
//! (argument generators).
#![no_main]

#[path = "capi_args/fp8_calls.rs"]
mod fp8_calls;
#[path = "capi_args/generate.rs"]
mod generate;
#[path = "capi_args/kernel_calls.rs"]
mod kernel_calls;
#[path = "capi_args/scheduler_calls.rs"]
mod scheduler_calls;

use std::ffi::CStr;
use std::ptr::null_mut;

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use pagedkv_c::pagedkv_status::*;
use pagedkv_c::*;

use kernel_calls::{cuda, merge_states, reference_attention, reference_kv_append};
use scheduler_calls::{Sched, State, add_request, create, destroy, queries, step, step_done};

/// Most calls per input.
const MAX_CALLS: usize = 48;

fn message() -> String {
    let p = pagedkv_last_error_message();
    assert!(!p.is_null(), "pagedkv_last_error_message() is null");
    // SAFETY: never null, NUL-terminated, valid until the next call on this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Every call: a status, never a panic, with a message exactly when it failed.
fn check(st: pagedkv_status, what: &str) -> pagedkv_status {
    let m = message();
    assert_ne!(st, PAGEDKV_ERR_PANIC, "{what}: {m}");
    if st == PAGEDKV_OK {
        assert!(m.is_empty(), "{what}: OK but message `{m}`");
    } else {
        assert!(!m.is_empty(), "{what}: status {st:?} without a message");
    }
    st
}

fn run(st: &mut State, u: &mut Unstructured) -> Result<()> {
    for _ in 0..MAX_CALLS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=17)? {
            0 | 1 => create(st, u)?,
            2 => destroy(st, u)?,
            3..=5 => add_request(st, u)?,
            6 | 7 => step(st, u)?,
            8 | 9 => step_done(st, u)?,
            10 | 11 => queries(st, u)?,
            12 => reference_kv_append(u)?,
            13 => reference_attention(u)?,
            14 => cuda(u)?,
            15 => fp8_calls::fp8(u)?,
            16 => merge_states(u)?,
            _ => {
                // SAFETY: static, NUL-terminated.
                let v = unsafe { CStr::from_ptr(pagedkv_version()) };
                assert!(!v.to_bytes().is_empty());
                // SAFETY: a null out is refused.
                let r = unsafe { pagedkv_scheduler_config_default(null_mut()) };
                assert_eq!(check(r, "config_default"), PAGEDKV_ERR_NULL);
            }
        }
    }
    Ok(())
}

/// A scheduler with a small valid configuration, so that most inputs reach the
/// scheduler's own checks.
fn create_small(st: &mut State) {
    let mut c = std::mem::MaybeUninit::<pagedkv_scheduler_config>::uninit();
    let mut s: Sched = null_mut();
    // SAFETY: valid out-pointers; the config is filled before it is read.
    unsafe {
        assert_eq!(pagedkv_scheduler_config_default(c.as_mut_ptr()), PAGEDKV_OK);
        let mut c = c.assume_init();
        c.num_blocks = 64;
        c.max_model_len = 512;
        c.num_host_blocks = 16;
        c.enable_prefix_caching = 1;
        assert_eq!(pagedkv_scheduler_create(&c, &mut s), PAGEDKV_OK);
    }
    st.live.push((s, Vec::new()));
}

fuzz_target!(|data: &[u8]| {
    let mut st = State::default();
    create_small(&mut st);
    let mut u = Unstructured::new(data);
    let _ = run(&mut st, &mut u);
    // Nothing runs on another thread: every live handle is idle and destroys once.
    for (s, _) in st.live.drain(..) {
        // SAFETY: live, destroyed once.
        let r = unsafe { pagedkv_scheduler_destroy(s) };
        assert_eq!(check(r, "final destroy"), PAGEDKV_OK);
    }
});
