//! The scheduler: block pool, block tables and continuous batching, seen from C.
//!
//! A C engine drives one [`pagedkv_scheduler`] per model replica:
//!
//! ```c
//! pagedkv_scheduler_config cfg;
//! pagedkv_scheduler_config_default(&cfg);    /* then adjust: */
//! cfg.num_blocks = 64;
//! cfg.max_model_len = 512;
//! pagedkv_scheduler *s = NULL;
//! pagedkv_scheduler_create(&cfg, &s);
//!
//! pagedkv_request req = {.id = 7, .prompt = prompt, .prompt_len = 5,
//!                        .max_tokens = 3, .stop_token = -1};
//! uint64_t seq;
//! pagedkv_add_request(s, &req, &seq);        /* the prompt is copied */
//!
//! uint32_t idle = 0;
//! while (pagedkv_is_idle(s, &idle) == PAGEDKV_OK && !idle) {
//!     /* pagedkv_step, run the model, pagedkv_on_step_done: see step.rs */
//! }
//! pagedkv_scheduler_destroy(s);
//! ```
//!
//! This module holds the scheduler's life and its queries: the settings
//! ([`pagedkv_scheduler_config`], whose defaults [`pagedkv_scheduler_config_default`]
//! fills in), [`pagedkv_scheduler_create`] and [`pagedkv_scheduler_destroy`], queuing
//! ([`pagedkv_add_request`]) and ending ([`pagedkv_abort`]) requests, and reading state:
//! [`pagedkv_is_idle`], [`pagedkv_get_metrics`] (counters and gauges as of the last
//! step), [`pagedkv_seq_tokens`] (a sequence's tokens; call it with `cap` 0 to ask the
//! length first). The step cycle itself is in [`crate::step`].
//!
//! Each function is a thin conversion: C structs in, the Rust `Scheduler`'s types
//! (`SchedulerConfig`, `Request`) out, its errors back through `from_error`. The flags
//! of the C structs are `u32` (nonzero is true) and "none" is spelled 0 or -1 where
//! Rust has an `Option`. Every call on the handle goes through [`with_scheduler`], i.e.
//! the registry of [`crate::handle`]: a null, destroyed or busy scheduler is refused.

use pagedkv::host::Error;
use pagedkv::host::block::KvSpec;
use pagedkv::host::scheduler::{PreemptionMode, QueuePolicy, Request, Scheduler, SchedulerConfig};

use crate::args::slice;
use crate::guard::guard;
use crate::handle::{Handle, Registry, destroy, enter, register};
use crate::pagedkv_status::{self, *};
use crate::status::{fail, from_error};
use crate::step::StepLists;

/// Scheduler settings (see `pagedkv_scheduler_config_default`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct pagedkv_scheduler_config {
    /// Device blocks, 2 to 2^24 (`MAX_POOL_BLOCKS`; block 0 is the null block).
    pub num_blocks: u32,
    /// Tokens per block: 8, 16 or 32.
    pub block_size: u32,
    /// Host blocks for swapping, at most 2^24 (0: preemption always recomputes).
    pub num_host_blocks: u32,
    /// Longest sequence (prompt + output).
    pub max_model_len: u32,
    /// Most running sequences.
    pub max_num_seqs: u64,
    /// Most tokens one step processes (at least `max_model_len`).
    pub max_tokens_per_step: u64,
    /// Fraction of blocks admission keeps free, in [0, 1).
    pub watermark: f64,
    /// 1: preempt by swapping to the host pool; 0: by recompute.
    pub preempt_by_swap: u32,
    /// 1: waiting queue by priority (then FCFS); 0: FCFS.
    pub priority_policy: u32,
    /// 1: reuse cached full blocks of matching prefixes.
    pub enable_prefix_caching: u32,
    /// Sliding window in tokens; 0: none.
    pub sliding_window: u32,
}

/// A generation request.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_request {
    /// Caller-chosen id, unique among live requests.
    pub id: u64,
    /// `prompt_len` token ids (borrowed for the call).
    pub prompt: *const u32,
    /// Prompt tokens, at least 1.
    pub prompt_len: u64,
    /// Tokens to generate at most, at least 1.
    pub max_tokens: u32,
    /// Stop token id, or -1 for none.
    pub stop_token: i64,
    /// Priority under the priority policy: *lower* values first, as in vLLM (since 0.2;
    /// higher first before).
    pub priority: i32,
    /// 1: `cache_salt` keeps this request's prefix cache apart.
    pub has_cache_salt: u32,
    /// The salt.
    pub cache_salt: u64,
}

/// Counters and gauges after the last step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct pagedkv_metrics {
    /// Steps run.
    pub steps: u64,
    /// Blocks held by sequences.
    pub blocks_used: u32,
    /// Blocks free (cached ones included).
    pub blocks_free: u32,
    /// Free blocks holding a reusable prefix.
    pub blocks_cached_free: u32,
    /// Padding (0).
    pub reserved: u32,
    /// Tokens stored / slots of held blocks.
    pub kv_utilization: f64,
    /// Running request groups.
    pub running: u64,
    /// Waiting request groups.
    pub waiting: u64,
    /// Swapped-out request groups.
    pub swapped: u64,
    /// Preemptions by recompute.
    pub preempted_recompute: u64,
    /// Preemptions by swap.
    pub preempted_swap: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queried_tokens: u64,
    /// Of those, found cached.
    pub prefix_hit_tokens: u64,
}

/// An opaque scheduler handle.
pub struct pagedkv_scheduler {
    pub(crate) inner: Scheduler,
    pub(crate) lists: StepLists,
    /// Sequences the last step scheduled that still wait for their sampled tokens (0:
    /// no step is waiting for `pagedkv_on_step_done`).
    pub(crate) awaiting: u64,
}

static SCHEDULERS: Registry = Registry::new();

impl Handle for pagedkv_scheduler {
    const WHAT: &'static str = "scheduler";
    fn registry() -> &'static Registry {
        &SCHEDULERS
    }
}

/// Runs `f` on a live, idle scheduler.
pub(crate) fn with_scheduler(
    s: *mut pagedkv_scheduler,
    f: impl FnOnce(&mut pagedkv_scheduler) -> pagedkv_status,
) -> pagedkv_status {
    enter(s, f)
}

/// Fills `out` with the defaults (1024 blocks of 16 tokens, no swap, FCFS, no prefix
/// caching, no window, max_model_len 4096).
///
/// # Safety
/// `out` is null or valid for writing one `pagedkv_scheduler_config`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_scheduler_config_default(
    out: *mut pagedkv_scheduler_config,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        let d = SchedulerConfig::default();
        let c = pagedkv_scheduler_config {
            num_blocks: d.num_blocks,
            block_size: d.block_size,
            num_host_blocks: d.num_host_blocks,
            max_model_len: d.max_model_len,
            max_num_seqs: d.max_num_seqs as u64,
            max_tokens_per_step: d.max_tokens_per_step as u64,
            watermark: d.watermark,
            preempt_by_swap: 0,
            priority_policy: 0,
            enable_prefix_caching: 0,
            sliding_window: 0,
        };
        // SAFETY: non-null and valid for a write (the caller's contract).
        unsafe { out.write(c) };
        PAGEDKV_OK
    })
}

/// Creates a scheduler. On success `*out` is a new handle, to be released with
/// `pagedkv_scheduler_destroy`.
///
/// # Safety
/// `config` is null or points to a valid config; `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_scheduler_create(
    config: *const pagedkv_scheduler_config,
    out: *mut *mut pagedkv_scheduler,
) -> pagedkv_status {
    guard(|| {
        if config.is_null() || out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "config or out is null");
        }
        // SAFETY: non-null, valid for a read (the caller's contract).
        let c = unsafe { config.read() };
        // SAFETY: `out` is non-null and valid for a write.
        unsafe { create(&c, Vec::new(), out) }
    })
}

/// Creates a scheduler for a model of layer groups (sliding-window and full-attention
/// layers sharing the pool, `LayerGroups` on the Rust side): `group_windows[g]` is
/// group `g`'s sliding window in tokens, 0 for full attention (1 to 64 groups;
/// `config->sliding_window` must be 0). Each step's batch then carries a block table
/// and slot mapping per group: `pagedkv_batch_group`. On success `*out` is a new
/// handle, to be released with `pagedkv_scheduler_destroy`.
///
/// # Safety
/// `config` is null or points to a valid config; `group_windows` is null or valid for
/// `num_groups` reads; `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_scheduler_create_groups(
    config: *const pagedkv_scheduler_config,
    group_windows: *const u32,
    num_groups: u64,
    out: *mut *mut pagedkv_scheduler,
) -> pagedkv_status {
    guard(|| {
        if config.is_null() || out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "config or out is null");
        }
        if num_groups == 0 || num_groups > pagedkv::host::block::MAX_KV_GROUPS as u64 {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `num_groups`: {num_groups} (1 to {})",
                    pagedkv::host::block::MAX_KV_GROUPS
                ),
            );
        }
        // SAFETY: the caller's contract (null is refused).
        let windows = match unsafe { slice(group_windows, num_groups, "group_windows") } {
            Ok(w) => w,
            Err(st) => return st,
        };
        let specs = windows
            .iter()
            .map(|&w| KvSpec::from_window((w != 0).then_some(w)))
            .collect();
        // SAFETY: non-null, valid for a read (the caller's contract).
        let c = unsafe { config.read() };
        // SAFETY: `out` is non-null and valid for a write.
        unsafe { create(&c, specs, out) }
    })
}

/// Builds and registers a scheduler of `c` and layer groups `kv_groups` into `*out`.
///
/// # Safety
/// `out` is non-null and valid for a write.
unsafe fn create(
    c: &pagedkv_scheduler_config,
    kv_groups: Vec<KvSpec>,
    out: *mut *mut pagedkv_scheduler,
) -> pagedkv_status {
    let cfg = SchedulerConfig {
        num_blocks: c.num_blocks,
        block_size: c.block_size,
        num_host_blocks: c.num_host_blocks,
        max_num_seqs: c.max_num_seqs.min(usize::MAX as u64) as usize,
        max_tokens_per_step: c.max_tokens_per_step.min(usize::MAX as u64) as usize,
        watermark: c.watermark,
        preemption: if c.preempt_by_swap != 0 {
            PreemptionMode::Swap
        } else {
            PreemptionMode::Recompute
        },
        policy: if c.priority_policy != 0 {
            QueuePolicy::Priority
        } else {
            QueuePolicy::Fcfs
        },
        enable_prefix_caching: c.enable_prefix_caching != 0,
        sliding_window: (c.sliding_window != 0).then_some(c.sliding_window),
        kv_groups,
        max_model_len: c.max_model_len,
    };
    let inner = match Scheduler::new(cfg) {
        Ok(s) => s,
        Err(e) => return from_error(&e),
    };
    let h = register(pagedkv_scheduler {
        inner,
        lists: StepLists::default(),
        awaiting: 0,
    });
    // SAFETY: non-null, valid for a write (the caller's contract).
    unsafe { out.write(h) };
    PAGEDKV_OK
}

/// Destroys a scheduler and everything it owns (batch arrays included). A second
/// destroy of the same handle is `PAGEDKV_ERR_INVALID_STATE`, and so is a destroy while
/// another call on it runs (another thread, or re-entrance): then the scheduler stays
/// alive, and the caller destroys it after that call returns. Never waits.
///
/// # Safety
/// `s` is null or a pointer this library returned (a destroyed one is detected).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_scheduler_destroy(s: *mut pagedkv_scheduler) -> pagedkv_status {
    guard(|| match destroy(s) {
        Ok(h) => {
            drop(h);
            PAGEDKV_OK
        }
        Err(st) => st,
    })
}

/// Queues a request; `*out_seq` receives its first sequence's id. Every refusal comes
/// before `req->prompt` is read: an empty prompt, zero `max_tokens`, an id already
/// live, `prompt_len + max_tokens` over `max_model_len`, or a request needing more
/// blocks than the pool holds (`PAGEDKV_ERR_INVALID_ARGUMENT`, the message ends
/// "(nothing was read)").
///
/// # Safety
/// `req` is null or valid for a read, and `req->prompt` for `req->prompt_len` reads
/// (only read once the request passed every check above); `out_seq` is null or valid
/// for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_add_request(
    s: *mut pagedkv_scheduler,
    req: *const pagedkv_request,
    out_seq: *mut u64,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if req.is_null() || out_seq.is_null() {
            return fail(PAGEDKV_ERR_NULL, "req or out_seq is null");
        }
        // SAFETY: non-null, valid for a read.
        let r = unsafe { req.read() };
        if r.prompt.is_null() {
            return fail(PAGEDKV_ERR_NULL, "req->prompt is null");
        }
        if r.stop_token < -1 || r.stop_token > u32::MAX as i64 {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!("req->stop_token {} (a token id, or -1)", r.stop_token),
            );
        }
        // Every refusal the scheduler would give, from the counts, before the prompt
        // is read: `prompt` is only trusted for `prompt_len` reads when that many
        // tokens would be accepted (max_model_len, the pool's size, a live id, ...).
        if let Err(e) = h.inner.check_request(r.id, r.prompt_len, r.max_tokens) {
            return from_error(&match e {
                Error::InvalidArgument { arg, reason } => Error::invalid(
                    match arg {
                        "id" => "req->id",
                        "max_tokens" => "req->max_tokens",
                        _ => "req->prompt_len",
                    },
                    format!("{reason} (nothing was read)"),
                ),
                e => e,
            });
        }
        // SAFETY: non-null, valid for `prompt_len` reads (the caller's contract).
        let prompt = match unsafe { slice(r.prompt, r.prompt_len, "req->prompt") } {
            Ok(p) => p,
            Err(st) => return st,
        };
        let request = Request {
            id: r.id,
            prompt: prompt.to_vec(),
            max_tokens: r.max_tokens,
            stop_token: (r.stop_token >= 0).then_some(r.stop_token as u32),
            priority: r.priority,
            cache_salt: (r.has_cache_salt != 0).then_some(r.cache_salt),
            preemption: None,
        };
        match h.inner.add_request(request) {
            Ok(seq) => {
                // SAFETY: non-null, valid for a write.
                unsafe { out_seq.write(seq) };
                PAGEDKV_OK
            }
            Err(e) => from_error(&e),
        }
    })
}

/// Ends a request wherever it is and frees its blocks.
///
/// # Safety
/// `s` is null or a pointer this library returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_abort(
    s: *mut pagedkv_scheduler,
    request_id: u64,
) -> pagedkv_status {
    with_scheduler(s, |h| match h.inner.abort(request_id) {
        Ok(()) => PAGEDKV_OK,
        Err(e) => from_error(&e),
    })
}

/// Drops every cached prefix (after a weight update the cached K/V is stale):
/// `PAGEDKV_ERR_INVALID_STATE`, nothing changed, while a request runs or is swapped
/// out, or between a step and its `pagedkv_on_step_done`.
///
/// # Safety
/// `s` is null or a pointer this library returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_reset_prefix_cache(s: *mut pagedkv_scheduler) -> pagedkv_status {
    with_scheduler(s, |h| match h.inner.reset_prefix_cache() {
        Ok(()) => PAGEDKV_OK,
        Err(e) => from_error(&e),
    })
}

/// `*out_idle` = 1 when nothing waits, runs or is swapped out, else 0.
///
/// # Safety
/// `s` is null or a pointer this library returned; `out_idle` null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_is_idle(
    s: *mut pagedkv_scheduler,
    out_idle: *mut u32,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if out_idle.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out_idle is null");
        }
        // SAFETY: non-null, valid for a write.
        unsafe { out_idle.write(h.inner.is_idle() as u32) };
        PAGEDKV_OK
    })
}

/// The scheduler's metrics as of the last step.
///
/// # Safety
/// `s` is null or a pointer this library returned; `out` null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_get_metrics(
    s: *mut pagedkv_scheduler,
    out: *mut pagedkv_metrics,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        let m = h.inner.metrics();
        let c = pagedkv_metrics {
            steps: m.steps,
            blocks_used: m.blocks_used,
            blocks_free: m.blocks_free,
            blocks_cached_free: m.blocks_cached_free,
            reserved: 0,
            kv_utilization: m.kv_utilization,
            running: m.running as u64,
            waiting: m.waiting as u64,
            swapped: m.swapped as u64,
            preempted_recompute: m.preempted_recompute,
            preempted_swap: m.preempted_swap,
            prefix_queried_tokens: m.prefix_queried_tokens,
            prefix_hit_tokens: m.prefix_hit_tokens,
        };
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(c) };
        PAGEDKV_OK
    })
}

/// Copies up to `cap` token ids of live sequence `seq` (prompt first) into `out`, and
/// its total token count into `*out_len` (call with `cap` 0 to ask the length).
///
/// # Safety
/// `out` is null only when `cap` is 0, else valid for `cap` writes; `out_len` valid
/// for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_seq_tokens(
    s: *mut pagedkv_scheduler,
    seq: u64,
    out: *mut u32,
    cap: u64,
    out_len: *mut u64,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if out_len.is_null() || (out.is_null() && cap > 0) {
            return fail(PAGEDKV_ERR_NULL, "out_len (or out with cap > 0) is null");
        }
        match h.inner.tokens(seq) {
            Ok(t) => {
                // A `cap` beyond the address space is as good as unlimited.
                let n = t.len().min(usize::try_from(cap).unwrap_or(usize::MAX));
                // The two parts of the history, in order (raw copies: `out` may be
                // uninitialised memory).
                let (head, tail) = t.as_slices();
                let h = n.min(head.len());
                if h > 0 {
                    // SAFETY: non-null, valid for `cap >= n >= h` writes.
                    unsafe { std::ptr::copy_nonoverlapping(head.as_ptr(), out, h) };
                }
                if n > h {
                    // SAFETY: as above; `out + h` is valid for the other `n - h` writes.
                    unsafe { std::ptr::copy_nonoverlapping(tail.as_ptr(), out.add(h), n - h) };
                }
                // SAFETY: non-null, valid for a write.
                unsafe { out_len.write(t.len() as u64) };
                PAGEDKV_OK
            }
            Err(e) => from_error(&e),
        }
    })
}

/// Test-only (feature `testing`; not in `include/pagedkv.h`): a call on `s` that
/// panics inside, so that C tests can check the panic becomes `PAGEDKV_ERR_PANIC` with
/// its message, prints nothing, and leaves `s` refusing calls but destroyable.
///
/// # Safety
/// `s` is null or a pointer this library returned.
#[cfg(feature = "testing")]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_testing_panic(s: *mut pagedkv_scheduler) -> pagedkv_status {
    with_scheduler(s, |_| panic!("pagedkv_testing_panic: a deliberate panic"))
}
