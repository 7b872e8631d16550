//! Unit tests of the machinery behind every entry point, driven through the C
//! functions themselves: a handle inside a call refuses other calls and destroy, a
//! panic becomes `PAGEDKV_ERR_PANIC` with its message and location and leaves its
//! handle poisoned but destroyable, and nothing reaches stderr. (The C programs in
//! `capi/tests/` cover the same ground from C.)

use crate::guard::guard;
use crate::handle::{Handle, Use};
use crate::pagedkv_status::*;
use crate::scheduler::with_scheduler;
use crate::*;

fn create() -> *mut pagedkv_scheduler {
    let mut cfg = std::mem::MaybeUninit::uninit();
    let mut s = std::ptr::null_mut();
    // SAFETY: valid out-pointers.
    unsafe {
        assert_eq!(
            pagedkv_scheduler_config_default(cfg.as_mut_ptr()),
            PAGEDKV_OK
        );
        assert_eq!(pagedkv_scheduler_create(cfg.as_ptr(), &mut s), PAGEDKV_OK);
    }
    s
}

fn last_error() -> String {
    // SAFETY: never null, NUL-terminated.
    unsafe { std::ffi::CStr::from_ptr(pagedkv_last_error_message()) }
        .to_string_lossy()
        .into_owned()
}

/// Sets what the registry says `s` is doing, as a call in progress would.
fn set_use(s: *mut pagedkv_scheduler, u: Use) {
    let mut reg = pagedkv_scheduler::registry().lock();
    let slot = reg.as_mut().unwrap().get_mut(&(s as usize)).unwrap();
    *slot = u;
}

#[test]
fn a_scheduler_inside_a_call_refuses_another_and_cannot_be_destroyed() {
    let s = create();
    // Simulate a call in progress (re-entrance from a callback, or another thread).
    set_use(s, Use::Busy);
    let mut idle = 0;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { pagedkv_is_idle(s, &mut idle) },
        PAGEDKV_ERR_INVALID_STATE
    );
    assert!(
        last_error().contains("already inside a call"),
        "{}",
        last_error()
    );
    // SAFETY: as above.
    assert_eq!(
        unsafe { pagedkv_scheduler_destroy(s) },
        PAGEDKV_ERR_INVALID_STATE
    );
    assert!(last_error().contains("inside a call"), "{}", last_error());
    set_use(s, Use::Idle);
    // SAFETY: valid pointers.
    assert_eq!(unsafe { pagedkv_is_idle(s, &mut idle) }, PAGEDKV_OK);
    assert_eq!(idle, 1);
    assert_eq!(last_error(), "");
    // SAFETY: live handle, destroyed once.
    assert_eq!(unsafe { pagedkv_scheduler_destroy(s) }, PAGEDKV_OK);
}

#[test]
fn a_panic_inside_is_an_error_code_not_an_unwind() {
    let s = guard(|| panic!("boom"));
    assert_eq!(s, PAGEDKV_ERR_PANIC);
    // The message, with where it happened (recorded by the quiet hook).
    assert!(
        last_error().contains("internal panic: boom at "),
        "{}",
        last_error()
    );
    // (This file: the panic is in the closure above.)
    assert!(last_error().contains(file!()), "{}", last_error());
    // Formatted payloads too.
    let n = 3;
    assert_eq!(guard(|| panic!("boom {n}")), PAGEDKV_ERR_PANIC);
    assert!(last_error().contains("boom 3"), "{}", last_error());
    // The next call starts clean.
    assert_eq!(guard(|| PAGEDKV_OK), PAGEDKV_OK);
    assert_eq!(last_error(), "");
}

#[test]
fn a_call_that_panics_leaves_its_handle_poisoned_but_destroyable() {
    let s = create();
    assert_eq!(
        with_scheduler(s, |_| panic!("inside a call")),
        PAGEDKV_ERR_PANIC
    );
    assert!(last_error().contains("inside a call"), "{}", last_error());
    let mut idle = 0;
    // SAFETY: valid pointers.
    assert_eq!(
        unsafe { pagedkv_is_idle(s, &mut idle) },
        PAGEDKV_ERR_INVALID_STATE
    );
    assert!(last_error().contains("panicked"), "{}", last_error());
    // SAFETY: live handle, destroyed once.
    assert_eq!(unsafe { pagedkv_scheduler_destroy(s) }, PAGEDKV_OK);
    // SAFETY: as above; a destroyed handle is detected.
    assert_eq!(
        unsafe { pagedkv_scheduler_destroy(s) },
        PAGEDKV_ERR_INVALID_STATE
    );
}

/// The child half of the next test: panics inside guarded calls, with output
/// capture off. Does nothing unless the parent runs it.
#[test]
fn quiet_panic_child() {
    if std::env::var_os("PAGEDKV_QUIET_PANIC_CHILD").is_none() {
        return;
    }
    assert_eq!(guard(|| panic!("quiet boom")), PAGEDKV_ERR_PANIC);
    let s = create();
    assert_eq!(
        with_scheduler(s, |_| panic!("quiet boom")),
        PAGEDKV_ERR_PANIC
    );
    // SAFETY: live handle, destroyed once.
    assert_eq!(unsafe { pagedkv_scheduler_destroy(s) }, PAGEDKV_OK);
    // A panic outside any C ABI call still goes to the previous (default) hook.
    assert!(
        std::thread::spawn(|| panic!("loud outside"))
            .join()
            .is_err()
    );
    println!("child done");
}

#[test]
fn a_panic_inside_a_call_prints_nothing_to_stderr() {
    let o = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "tests::quiet_panic_child", "--nocapture"])
        .args(["--test-threads", "1"])
        .env("PAGEDKV_QUIET_PANIC_CHILD", "1")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{out}\n{err}");
    assert!(out.contains("child done"), "{out}");
    assert!(!err.contains("quiet boom"), "{err}");
    assert!(!out.contains("quiet boom"), "{out}");
    // Only the panic outside a call printed (through the default hook).
    assert_eq!(err.matches("panicked").count(), 1, "{err}");
    assert!(err.contains("loud outside"), "{err}");
}

/// The header's version macros are the crate's version, which `pagedkv_version()`
/// returns: a header shipped with another library version would fail this.
#[test]
fn the_header_version_macros_are_the_library_version() {
    let header = include_str!("../include/pagedkv.h");
    let define = |name: &str| -> String {
        let prefix = format!("#define {name} ");
        header
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("{name} is not defined"))
            .trim()
            .to_owned()
    };
    assert_eq!(
        define("PAGEDKV_VERSION_MAJOR"),
        env!("CARGO_PKG_VERSION_MAJOR")
    );
    assert_eq!(
        define("PAGEDKV_VERSION_MINOR"),
        env!("CARGO_PKG_VERSION_MINOR")
    );
    assert_eq!(
        define("PAGEDKV_VERSION_PATCH"),
        env!("CARGO_PKG_VERSION_PATCH")
    );
    let v = format!("\"{}\"", env!("CARGO_PKG_VERSION"));
    assert_eq!(define("PAGEDKV_VERSION_STRING"), v);
    // SAFETY: a static NUL-terminated string.
    let lib = unsafe { std::ffi::CStr::from_ptr(pagedkv_version()) };
    assert_eq!(lib.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

/// A scheduler of layer groups through the C functions: each group's tables and slot
/// mapping of a step, the group's window, group 0's equal to the batch's own, and the
/// argument errors (no windows, no or too many groups, a scheduler window beside
/// groups, a group past the scheduler's).
#[test]
fn a_scheduler_of_layer_groups_hands_out_each_groups_tables() {
    let mut cfg = std::mem::MaybeUninit::uninit();
    // SAFETY: a valid out-pointer.
    assert_eq!(
        unsafe { pagedkv_scheduler_config_default(cfg.as_mut_ptr()) },
        PAGEDKV_OK
    );
    // SAFETY: written above.
    let mut cfg = unsafe { cfg.assume_init() };
    cfg.num_blocks = 64;
    let windows = [16u32, 0];
    let mut s = std::ptr::null_mut();
    // SAFETY: valid pointers and counts throughout.
    unsafe {
        assert_eq!(
            pagedkv_scheduler_create_groups(&cfg, std::ptr::null(), 2, &mut s),
            PAGEDKV_ERR_NULL
        );
        for n in [0, 65] {
            assert_eq!(
                pagedkv_scheduler_create_groups(&cfg, windows.as_ptr(), n, &mut s),
                PAGEDKV_ERR_INVALID_ARGUMENT
            );
        }
        let mut both = cfg;
        both.sliding_window = 8;
        assert_eq!(
            pagedkv_scheduler_create_groups(&both, windows.as_ptr(), 2, &mut s),
            PAGEDKV_ERR_INVALID_ARGUMENT
        );
        assert_eq!(
            pagedkv_scheduler_create_groups(&cfg, windows.as_ptr(), 2, &mut s),
            PAGEDKV_OK
        );
        let prompt: Vec<u32> = (0..40).collect();
        let req = pagedkv_request {
            id: 1,
            prompt: prompt.as_ptr(),
            prompt_len: prompt.len() as u64,
            max_tokens: 4,
            stop_token: -1,
            priority: 0,
            has_cache_salt: 0,
            cache_salt: 0,
        };
        let mut seq = 0;
        assert_eq!(pagedkv_add_request(s, &req, &mut seq), PAGEDKV_OK);
        let mut b = std::mem::MaybeUninit::uninit();
        assert_eq!(pagedkv_step(s, b.as_mut_ptr()), PAGEDKV_OK);
        let b = b.assume_init();
        // The batch says the block size its slots are in (the config's).
        assert_eq!(b.block_size, cfg.block_size);
        let (w, n) = (b.max_blocks_per_seq as usize, b.num_slots as usize);
        let mut g = [
            std::mem::MaybeUninit::uninit(),
            std::mem::MaybeUninit::uninit(),
        ];
        for (i, t) in g.iter_mut().enumerate() {
            assert_eq!(pagedkv_batch_group(s, i as u32, t.as_mut_ptr()), PAGEDKV_OK);
        }
        let [g0, g1] = g.map(|t| t.assume_init());
        assert_eq!((g0.sliding_window, g1.sliding_window), (16, 0));
        assert_eq!(g0.block_tables, b.block_tables);
        assert_eq!(g0.slot_mapping, b.slot_mapping);
        let t0 = std::slice::from_raw_parts(g0.block_tables, w);
        let t1 = std::slice::from_raw_parts(g1.block_tables, w);
        let s1 = std::slice::from_raw_parts(g1.slot_mapping, n);
        // 40 tokens: three blocks of 16 in each group, none shared between them.
        assert!(t0[..3].iter().chain(&t1[..3]).all(|&x| x > 0));
        assert!(t0[..3].iter().all(|x| !t1[..3].contains(x)));
        assert_eq!(s1[0] / 16, t1[0] as i64);
        let mut t = std::mem::MaybeUninit::uninit();
        assert_eq!(
            pagedkv_batch_group(s, 2, t.as_mut_ptr()),
            PAGEDKV_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("group"), "{}", last_error());
        assert_eq!(pagedkv_scheduler_destroy(s), PAGEDKV_OK);
    }
}

#[test]
fn speculative_rows_verify_drafts_and_roll_back_what_is_rejected() {
    let s = create();
    let prompt: Vec<u32> = (0..10).collect();
    let req = pagedkv_request {
        id: 1,
        prompt: prompt.as_ptr(),
        prompt_len: prompt.len() as u64,
        max_tokens: 20,
        stop_token: -1,
        priority: 0,
        has_cache_salt: 0,
        cache_salt: 0,
    };
    let mut seq = 0;
    // SAFETY: valid pointers and counts throughout; the batch read before the next step.
    unsafe {
        assert_eq!(pagedkv_add_request(s, &req, &mut seq), PAGEDKV_OK);
        assert_eq!(pagedkv_set_lookahead(s, seq + 1, 2), PAGEDKV_ERR_UNKNOWN_ID);
        assert_eq!(
            pagedkv_set_lookahead(s, seq, 64),
            PAGEDKV_ERR_INVALID_ARGUMENT
        );
        let mut b = std::mem::MaybeUninit::uninit();
        assert_eq!(pagedkv_step(s, b.as_mut_ptr()), PAGEDKV_OK);
        let one = pagedkv_sampled {
            seq,
            token: 50,
            reserved: 0,
        };
        assert_eq!(
            pagedkv_on_step_done(s, &one, 1, std::ptr::null_mut()),
            PAGEDKV_OK
        );
        assert_eq!(pagedkv_set_lookahead(s, seq, 3), PAGEDKV_OK);
        assert_eq!(pagedkv_step(s, b.as_mut_ptr()), PAGEDKV_OK);
        let b = b.assume_init();
        let q = *b.seqs;
        assert_eq!(
            (q.is_prefill, q.num_draft_tokens, q.num_new_tokens),
            (0, 3, 4)
        );
        assert_eq!((q.start_pos, q.context_len), (10, 14));
        // The counts must add up to num_tokens before the tokens are read.
        let rows = [pagedkv_accepted {
            seq,
            num_tokens: 3,
            reserved: 0,
        }];
        let tokens = [51u32, 52, 53];
        assert_eq!(
            pagedkv_on_step_done_accepted(
                s,
                rows.as_ptr(),
                1,
                tokens.as_ptr(),
                2,
                std::ptr::null_mut()
            ),
            PAGEDKV_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("num_tokens"), "{}", last_error());
        // Two drafts accepted, then a correction: 13 tokens computed, 14 known.
        assert_eq!(
            pagedkv_on_step_done_accepted(
                s,
                rows.as_ptr(),
                1,
                tokens.as_ptr(),
                3,
                std::ptr::null_mut()
            ),
            PAGEDKV_OK
        );
        let mut n = 0;
        let mut out = [0u32; 32];
        assert_eq!(
            pagedkv_seq_tokens(s, seq, out.as_mut_ptr(), 32, &mut n),
            PAGEDKV_OK
        );
        assert_eq!(&out[10..n as usize], &[50, 51, 52, 53]);
        assert_eq!(pagedkv_scheduler_destroy(s), PAGEDKV_OK);
    }
}
