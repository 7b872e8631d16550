//! The C ABI of pagedkv (`include/pagedkv.h`).
//!
//! Built as `libpagedkv_c.a` and `libpagedkv_c.so`. Every function:
//! * returns a [`pagedkv_status`] (`PAGEDKV_OK` = 0), and on failure leaves a message
//!   for [`pagedkv_last_error_message`] (per thread);
//! * checks its pointers (null is `PAGEDKV_ERR_NULL`) and lengths before use: every
//!   count the library can check against its own state (the shapes, the last step's
//!   sequences) is checked before anything is read, and every size computed from the
//!   caller's numbers uses checked arithmetic;
//! * catches panics: none crosses the boundary (`PAGEDKV_ERR_PANIC`), and none prints:
//!   the panic message goes to the last-error message, not to the host's stderr;
//! * refuses a handle that was destroyed or never created (a registry of live handles)
//!   and a call on a handle that is already inside a call (re-entrance, or two threads
//!   at once): `PAGEDKV_ERR_INVALID_STATE`. The registry's lock covers both the "is it
//!   live" check and the "mark it busy" step, and destroy checks and unregisters under
//!   the same lock, so destroy racing another call is an error for one of them, never a
//!   use after free.
//!
//! Ownership: the library owns every handle (create/destroy) and the arrays a
//! [`pagedkv_batch`] points to, which stay valid until the next `pagedkv_step` or
//! `pagedkv_scheduler_destroy` on that scheduler. The caller owns everything it passes in.
#![allow(non_camel_case_types)]

mod args;
mod guard;
mod handle;
#[cfg(feature = "header-check")]
mod header_check;
mod status;
#[cfg(test)]
mod tests;

pub use args::pagedkv_decode_shape;
pub use status::{pagedkv_last_error_message, pagedkv_status, pagedkv_version};

use args::{check_len, checked_elems, pool_elems, slice, slice_mut};
use guard::guard;
use handle::{Handle, Registry, destroy, enter, register};
use pagedkv::host::ops::attention::{DecodeOptions, DecodeShape};
use pagedkv::host::ops::kv_append::kv_append_reference;
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::scheduler::{
    Batch, PreemptionMode, QueuePolicy, Request, Scheduler, SchedulerConfig,
};
use pagedkv::host::{DType, Error, HostTensor};
use pagedkv::kernels::PagedLayout;
use pagedkv_status::*;
use status::{fail, from_error};

// ---------------------------------------------------------------------------------
// Scheduler
// ---------------------------------------------------------------------------------

/// Scheduler settings (see `pagedkv_scheduler_config_default`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct pagedkv_scheduler_config {
    /// Device blocks (block 0 is the null block).
    pub num_blocks: u32,
    /// Tokens per block: 8, 16 or 32.
    pub block_size: u32,
    /// Host blocks for swapping (0: preemption always recomputes).
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
    /// Priority (higher first) under the priority policy.
    pub priority: i32,
    /// 1: `cache_salt` keeps this request's prefix cache apart.
    pub has_cache_salt: u32,
    /// The salt.
    pub cache_salt: u64,
}

/// One sequence's part of a step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct pagedkv_scheduled_seq {
    /// Sequence id.
    pub seq: u64,
    /// Its request.
    pub request: u64,
    /// 1: prefill (several new tokens); 0: decode (one).
    pub is_prefill: u32,
    /// Position of its first new token.
    pub start_pos: u32,
    /// New tokens this step.
    pub num_new_tokens: u32,
    /// Tokens in its cache after this step.
    pub context_len: u32,
    /// Offset of its first new token in `slot_mapping`.
    pub token_offset: u32,
    /// Padding (0).
    pub reserved: u32,
}

/// A step's batch. Every pointer stays valid until the next `pagedkv_step` or
/// `pagedkv_scheduler_destroy` on the same scheduler; the library owns the arrays.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_batch {
    /// Scheduled sequences.
    pub num_seqs: u64,
    /// `[num_seqs]`.
    pub seqs: *const pagedkv_scheduled_seq,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// Padding (0).
    pub reserved: u32,
    /// `[num_seqs, max_blocks_per_seq]`, padded with the null block 0.
    pub block_tables: *const i32,
    /// `[num_seqs]`.
    pub context_lens: *const i32,
    /// New tokens.
    pub num_slots: u64,
    /// `[num_slots]`: slot of each new token; -1: skip.
    pub slot_mapping: *const i64,
    /// Copy-on-write pairs.
    pub num_copies: u64,
    /// `[num_copies, 2]`: (src, dst) blocks, to copy before the kernels write.
    pub copies: *const u32,
    /// Blocks to swap out.
    pub num_swap_out: u64,
    /// `[num_swap_out, 2]`: (device, host) blocks, to copy first of all.
    pub swap_out: *const u32,
    /// Blocks to swap in.
    pub num_swap_in: u64,
    /// `[num_swap_in, 2]`: (host, device) blocks, after the swap-outs.
    pub swap_in: *const u32,
}

/// A sampled token for one scheduled sequence.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_sampled {
    /// Sequence id (from the batch).
    pub seq: u64,
    /// The token id.
    pub token: u32,
    /// Padding (0).
    pub reserved: u32,
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
    inner: Scheduler,
    lists: StepLists,
    /// Sequences the last step scheduled that still wait for their sampled tokens (0:
    /// no step is waiting for `pagedkv_on_step_done`).
    awaiting: u64,
}

static SCHEDULERS: Registry = Registry::new();

impl Handle for pagedkv_scheduler {
    const WHAT: &'static str = "scheduler";
    fn registry() -> &'static Registry {
        &SCHEDULERS
    }
}

/// Runs `f` on a live, idle scheduler.
fn with_scheduler(
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
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
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

/// Queues a request; `*out_seq` receives its first sequence's id.
///
/// # Safety
/// `req` is null or valid for a read, and `req->prompt` for `req->prompt_len` reads;
/// `out_seq` is null or valid for a write.
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
        if r.prompt_len > (1 << 24) {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!("req->prompt_len {} is implausibly large", r.prompt_len),
            );
        }
        if r.stop_token < -1 || r.stop_token > u32::MAX as i64 {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!("req->stop_token {} (a token id, or -1)", r.stop_token),
            );
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

fn flatten(v: &mut Vec<u32>, pairs: &[(u32, u32)]) {
    v.clear();
    v.extend(pairs.iter().flat_map(|&(a, b)| [a, b]));
}

/// The per-step lists converted to C layout, kept in the handle until the next step.
#[derive(Default)]
struct StepLists {
    seqs: Vec<pagedkv_scheduled_seq>,
    copies: Vec<u32>,
    swap_out: Vec<u32>,
    swap_in: Vec<u32>,
}

fn fill_batch(l: &mut StepLists, b: &Batch) -> pagedkv_batch {
    l.seqs.clear();
    l.seqs.extend(b.seqs.iter().map(|q| pagedkv_scheduled_seq {
        seq: q.seq,
        request: q.request,
        is_prefill: q.is_prefill as u32,
        start_pos: q.start_pos,
        num_new_tokens: q.num_new_tokens,
        context_len: q.context_len,
        token_offset: q.token_offset,
        reserved: 0,
    }));
    flatten(&mut l.copies, &b.copies);
    flatten(&mut l.swap_out, &b.swap_out);
    flatten(&mut l.swap_in, &b.swap_in);
    pagedkv_batch {
        num_seqs: l.seqs.len() as u64,
        seqs: l.seqs.as_ptr(),
        max_blocks_per_seq: b.max_blocks_per_seq,
        reserved: 0,
        block_tables: b.block_tables.as_ptr(),
        context_lens: b.context_lens.as_ptr(),
        num_slots: b.slot_mapping.len() as u64,
        slot_mapping: b.slot_mapping.as_ptr(),
        num_copies: b.copies.len() as u64,
        copies: l.copies.as_ptr(),
        num_swap_out: b.swap_out.len() as u64,
        swap_out: l.swap_out.as_ptr(),
        num_swap_in: b.swap_in.len() as u64,
        swap_in: l.swap_in.as_ptr(),
    }
}

/// Plans the next step into `*out` (see `pagedkv_batch` for the arrays' lifetime).
/// Then feed the sampled tokens back with `pagedkv_on_step_done` before the next step.
/// An empty batch (`num_seqs == 0`) means nothing could run.
///
/// # Safety
/// `s` is null or a pointer this library returned; `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_step(
    s: *mut pagedkv_scheduler,
    out: *mut pagedkv_batch,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        // The batch's arrays live in the scheduler (valid until its next step); the
        // per-step lists are converted into the handle's own vectors.
        let c = match h.inner.step() {
            Ok(b) => fill_batch(&mut h.lists, b),
            Err(e) => return from_error(&e),
        };
        // What `pagedkv_on_step_done` checks its `n` against (0: an empty batch waits
        // for nothing).
        h.awaiting = c.num_seqs;
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(c) };
        PAGEDKV_OK
    })
}

/// Takes the token sampled for every sequence of the last step (`n` entries, each
/// scheduled sequence exactly once). `*out_finished` (if not null) receives how many
/// sequences finished (stop token or max_tokens); their blocks are already free.
///
/// `n` is checked against the number of sequences the last step scheduled before
/// `sampled` is read: another `n` is `PAGEDKV_ERR_INVALID_ARGUMENT`, and a call with no
/// step waiting for its tokens is `PAGEDKV_ERR_INVALID_STATE`.
///
/// # Safety
/// `sampled` is null only when `n` is 0, else valid for `n` reads; `out_finished` is
/// null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_on_step_done(
    s: *mut pagedkv_scheduler,
    sampled: *const pagedkv_sampled,
    n: u64,
    out_finished: *mut u64,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if h.awaiting == 0 {
            return fail(
                PAGEDKV_ERR_INVALID_STATE,
                format!(
                    "on_step_done() without a step: no scheduled sequence waits for a token (n is {n})"
                ),
            );
        }
        // Checked before anything is read: `sampled` holds `n` entries by the caller's
        // contract, and the library reads exactly as many as the step scheduled.
        if n != h.awaiting {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `n`: {n} sampled tokens, but the last step scheduled {} sequences",
                    h.awaiting
                ),
            );
        }
        // SAFETY: `sampled` is non-null (checked in `slice`) and valid for `n` reads
        // (the caller's contract); `n` is the batch's length, so it fits in memory.
        let sampled = match unsafe { slice(sampled, n, "sampled") } {
            Ok(v) => v,
            Err(st) => return st,
        };
        let list: Vec<(u64, u32)> = sampled.iter().map(|x| (x.seq, x.token)).collect();
        match h.inner.on_step_done(&list) {
            Ok(done) => {
                h.awaiting = 0;
                if !out_finished.is_null() {
                    // SAFETY: non-null, valid for a write.
                    unsafe { out_finished.write(done.len() as u64) };
                }
                PAGEDKV_OK
            }
            Err(e) => from_error(&e),
        }
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
                if n > 0 {
                    // SAFETY: non-null, valid for `cap >= n` writes.
                    unsafe { std::ptr::copy_nonoverlapping(t.as_ptr(), out, n) };
                }
                // SAFETY: non-null, valid for a write.
                unsafe { out_len.write(t.len() as u64) };
                PAGEDKV_OK
            }
            Err(e) => from_error(&e),
        }
    })
}

// ---------------------------------------------------------------------------------
// CPU reference kernels (f32 buffers)
// ---------------------------------------------------------------------------------

fn tensor(v: &[f32], shape: &[usize]) -> HostTensor {
    let f: Vec<f64> = v.iter().map(|&x| x as f64).collect();
    HostTensor::from_f64(DType::F32, shape, &f).expect("shape matches length")
}

/// The CPU reference of paged decode attention (f64 arithmetic, f32 buffers): `q`,
/// `out`: `[num_seqs, num_q_heads, head_dim]`; caches `[num_blocks, num_kv_heads,
/// block_size, head_dim]`; `block_tables` `[num_seqs, max_blocks_per_seq]`;
/// `context_lens` `[num_seqs]`. Each `*_len` is the buffer's element count and must
/// match the shape.
///
/// # Safety
/// Each pointer is null or valid for its `*_len` elements (`out` for writes).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_reference_decode_attention(
    shape: *const pagedkv_decode_shape,
    scale: f32,
    q: *const f32,
    q_len: u64,
    key_cache: *const f32,
    value_cache: *const f32,
    cache_len: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: *mut f32,
    out_len: u64,
) -> pagedkv_status {
    guard(|| {
        if shape.is_null() {
            return fail(PAGEDKV_ERR_NULL, "shape is null");
        }
        // SAFETY: non-null, valid for a read.
        let c = unsafe { shape.read() };
        let sh = DecodeShape::from(c);
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // Every length is checked against the shapes (sizes in checked arithmetic)
            // before any buffer is read.
            let l = sh.layout();
            pagedkv::host::ops::check_layout(&l).map_err(|e| from_error(&e))?;
            let pool = pool_elems(&l)?;
            let qn = checked_elems(
                &[c.num_seqs, c.num_q_heads, c.head_dim],
                "num_seqs",
                "num_seqs * num_q_heads * head_dim",
            )?;
            let btn = checked_elems(
                &[c.num_seqs, c.max_blocks_per_seq],
                "max_blocks_per_seq",
                "num_seqs * max_blocks_per_seq",
            )?;
            check_len("q", q_len, qn)?;
            check_len("cache_len", cache_len, pool)?;
            check_len("block_tables", block_tables_len, btn)?;
            check_len("context_lens", context_lens_len, c.num_seqs as u64)?;
            check_len("out", out_len, qn)?;
            // SAFETY: the caller's contract for each pointer and length.
            let (q, kc, vc, bt, cl, o) = unsafe {
                (
                    slice(q, q_len, "q")?,
                    slice(key_cache, cache_len, "key_cache")?,
                    slice(value_cache, cache_len, "value_cache")?,
                    slice(block_tables, block_tables_len, "block_tables")?,
                    slice(context_lens, context_lens_len, "context_lens")?,
                    slice_mut(out, out_len, "out")?,
                )
            };
            let qt = tensor(q, &[q.len()]);
            let kt = tensor(kc, &[kc.len()]);
            let vt = tensor(vc, &[vc.len()]);
            let mut ot = HostTensor::full(DType::F32, &[o.len()], 0.0);
            let mut opts = DecodeOptions::new(sh.head_dim.max(1));
            opts.scale = scale;
            pagedkv::host::ops::attention::validate(&sh, &opts, &qt, &kt, &vt, bt, cl, &ot)
                .map_err(|e| from_error(&e))?;
            let r = paged_decode_attention(&sh, &opts, &qt, &kt, &vt, bt, cl);
            for (i, v) in r.iter().enumerate() {
                ot.set(i, *v);
            }
            o.copy_from_slice(ot.buf().as_slice::<f32>());
            Ok(PAGEDKV_OK)
        };
        run().unwrap_or_else(|s| s)
    })
}

/// The CPU reference of `kv_append` (f32 buffers): writes token `i`'s K and V rows
/// (`key`, `value`: `[num_tokens, num_kv_heads, head_dim]`) into slot
/// `slot_mapping[i]` of the caches (`[num_blocks, num_kv_heads, block_size,
/// head_dim]`, `cache_len` elements each); negative slots are skipped.
///
/// # Safety
/// Each pointer is null or valid for its length (`key`/`value` for `num_tokens *
/// num_kv_heads * head_dim`, the caches for `cache_len` writes).
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_reference_kv_append(
    num_blocks: u32,
    num_kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    key: *const f32,
    value: *const f32,
    num_tokens: u64,
    slot_mapping: *const i64,
    key_cache: *mut f32,
    value_cache: *mut f32,
    cache_len: u64,
) -> pagedkv_status {
    guard(|| {
        let layout = PagedLayout {
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
        };
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // The sizes in checked arithmetic, and the caches' length checked against
            // the layout, before any buffer is read.
            pagedkv::host::ops::check_layout(&layout).map_err(|e| from_error(&e))?;
            check_len("cache_len", cache_len, pool_elems(&layout)?)?;
            let row = num_kv_heads as u64 * head_dim as u64;
            let n = num_tokens
                .checked_mul(row)
                .filter(|&n| usize::try_from(n).is_ok())
                .ok_or_else(|| {
                    fail(
                        PAGEDKV_ERR_INVALID_ARGUMENT,
                        format!(
                            "invalid argument `num_tokens`: num_tokens * num_kv_heads * head_dim = {num_tokens} * {num_kv_heads} * {head_dim} overflows"
                        ),
                    )
                })?;
            // SAFETY: the caller's contract for each pointer and length.
            let (k, v, sm, kc, vc) = unsafe {
                (
                    slice(key, n, "key")?,
                    slice(value, n, "value")?,
                    slice(slot_mapping, num_tokens, "slot_mapping")?,
                    slice_mut(key_cache, cache_len, "key_cache")?,
                    slice_mut(value_cache, cache_len, "value_cache")?,
                )
            };
            let (kt, vt) = (tensor(k, &[k.len()]), tensor(v, &[v.len()]));
            let (mut kct, mut vct) = (tensor(kc, &[kc.len()]), tensor(vc, &[vc.len()]));
            kv_append_reference(&layout, &kt, &vt, sm, &mut kct, &mut vct)
                .map_err(|e| from_error(&e))?;
            kc.copy_from_slice(kct.buf().as_slice::<f32>());
            vc.copy_from_slice(vct.buf().as_slice::<f32>());
            Ok(PAGEDKV_OK)
        };
        run().unwrap_or_else(|s| s)
    })
}

// ---------------------------------------------------------------------------------
// CUDA backend on caller-supplied device pointers
// ---------------------------------------------------------------------------------

/// Element type of device buffers.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pagedkv_dtype {
    /// IEEE half precision.
    PAGEDKV_F16 = 0,
    /// bfloat16.
    PAGEDKV_BF16 = 1,
    /// IEEE single precision.
    PAGEDKV_F32 = 2,
}

fn dtype_of(d: i32) -> Result<DType, pagedkv_status> {
    match d {
        0 => Ok(DType::F16),
        1 => Ok(DType::Bf16),
        2 => Ok(DType::F32),
        other => Err(fail(
            PAGEDKV_ERR_INVALID_ARGUMENT,
            format!("dtype {other} (0 f16, 1 bf16, 2 f32)"),
        )),
    }
}

/// An opaque CUDA backend handle (a context, a stream, the loaded kernels).
pub struct pagedkv_cuda_backend {
    inner: pagedkv::cuda::CudaBackend,
}

static CUDA_BACKENDS: Registry = Registry::new();

impl Handle for pagedkv_cuda_backend {
    const WHAT: &'static str = "backend";
    fn registry() -> &'static Registry {
        &CUDA_BACKENDS
    }
}

fn with_cuda(
    b: *mut pagedkv_cuda_backend,
    f: impl FnOnce(&pagedkv::cuda::CudaBackend) -> Result<(), pagedkv_status>,
) -> pagedkv_status {
    enter(b, |h| f(&h.inner).err().unwrap_or(PAGEDKV_OK))
}

/// Creates a CUDA backend on device `ordinal` with the embedded PTX. Without an NVIDIA
/// driver or device this is `PAGEDKV_ERR_CUDA` ("no CUDA driver found" / "no CUDA
/// device"). Release with `pagedkv_cuda_backend_destroy`.
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_create(
    ordinal: i32,
    out: *mut *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        if ordinal < 0 {
            return fail(PAGEDKV_ERR_INVALID_ARGUMENT, format!("ordinal {ordinal}"));
        }
        let inner = match pagedkv::cuda::backend(ordinal as usize) {
            Ok(b) => b,
            Err(e) => return from_error(&e),
        };
        let h = register(pagedkv_cuda_backend { inner });
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
}

/// Creates a CUDA backend like `pagedkv_cuda_backend_create`, whose every copy and
/// launch goes to `stream` (a `CUstream` / `cudaStream_t` of device `ordinal`'s primary
/// context that the caller owns), or to the context's default stream when `stream` is
/// null.
///
/// # Safety
/// `out` is null or valid for a write; a non-null `stream` is a live stream of that
/// context, kept alive until the backend is destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_create_on_stream(
    ordinal: i32,
    stream: *mut std::ffi::c_void,
    out: *mut *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        if ordinal < 0 {
            return fail(PAGEDKV_ERR_INVALID_ARGUMENT, format!("ordinal {ordinal}"));
        }
        // SAFETY: the caller's contract on `stream`.
        let inner = match unsafe { pagedkv::cuda::backend_on_stream(ordinal as usize, stream) } {
            Ok(b) => b,
            Err(e) => return from_error(&e),
        };
        let h = register(pagedkv_cuda_backend { inner });
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
}

/// Destroys a CUDA backend (after waiting for its stream).
///
/// # Safety
/// `b` is null or a pointer this library returned (a destroyed one is detected).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_destroy(
    b: *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| match destroy(b) {
        Ok(h) => {
            let _ = h.inner.synchronize();
            PAGEDKV_OK
        }
        Err(st) => st,
    })
}

/// Waits for all work the backend queued.
///
/// # Safety
/// `b` is null or a pointer this library returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_synchronize(b: *mut pagedkv_cuda_backend) -> pagedkv_status {
    with_cuda(b, |g| g.synchronize().map_err(|e| from_error(&e)))
}

/// `kv_append` on the GPU, on device buffers the caller owns: `key`, `value`:
/// `[num_tokens, num_kv_heads, head_dim]`; the caches `[num_blocks, num_kv_heads,
/// block_size, head_dim]`, all of `dtype`. `slot_mapping` is host memory
/// (`num_tokens` entries; negative: skip), validated before the launch. Asynchronous on
/// the backend's stream.
///
/// # Safety
/// The device pointers are allocations in the backend's context of at least the sizes
/// the shapes imply, unused by other work until the launch completes; `slot_mapping` is
/// null only when `num_tokens` is 0, else valid for `num_tokens` reads.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_kv_append(
    b: *mut pagedkv_cuda_backend,
    num_blocks: u32,
    num_kv_heads: u32,
    block_size: u32,
    head_dim: u32,
    dtype: i32,
    key: u64,
    value: u64,
    num_tokens: u64,
    slot_mapping: *const i64,
    key_cache: u64,
    value_cache: u64,
) -> pagedkv_status {
    with_cuda(b, |g| {
        let dt = dtype_of(dtype)?;
        let layout = PagedLayout {
            num_blocks,
            num_kv_heads,
            block_size,
            head_dim,
        };
        pagedkv::host::ops::check_layout(&layout).map_err(|e| from_error(&e))?;
        // Sizes in checked arithmetic: both fit in `usize` (so do the shapes' products,
        // every factor being at least 1 past `check_layout` and the early return).
        let pool = [pool_elems(&layout)? as usize];
        if num_tokens == 0 {
            return Ok(());
        }
        let rows = usize::try_from(num_tokens)
            .ok()
            .filter(|_| {
                num_tokens
                    .checked_mul(num_kv_heads as u64 * head_dim as u64)
                    .is_some_and(|n| usize::try_from(n).is_ok())
            })
            .ok_or_else(|| {
                fail(
                    PAGEDKV_ERR_INVALID_ARGUMENT,
                    format!(
                        "invalid argument `num_tokens`: {num_tokens} * num_kv_heads * head_dim overflows"
                    ),
                )
            })?;
        // SAFETY: the caller's contract.
        let sm = unsafe { slice(slot_mapping, num_tokens, "slot_mapping")? };
        let tok = [rows, num_kv_heads as usize, head_dim as usize];
        // SAFETY: the caller's contract (device allocations of these sizes, unused by
        // other work until the launch completes).
        let (k, v, mut kc, mut vc) = unsafe {
            use pagedkv::cuda::BorrowedDeviceTensor as B;
            let m = |e: Error| from_error(&e);
            (
                B::new(g, key, dt, &tok).map_err(m)?,
                B::new(g, value, dt, &tok).map_err(m)?,
                B::new(g, key_cache, dt, &pool).map_err(m)?,
                B::new(g, value_cache, dt, &pool).map_err(m)?,
            )
        };
        g.kv_append(&layout, &k, &v, sm, &mut kc, &mut vc)
            .map_err(|e| from_error(&e))
    })
}

/// Paged decode attention on the GPU, on device buffers the caller owns: `q`, `out`:
/// `[num_seqs, num_q_heads, head_dim]`; caches `[num_blocks, num_kv_heads, block_size,
/// head_dim]`, all of `dtype`. `block_tables` (`[num_seqs, max_blocks_per_seq]`) and
/// `context_lens` (`[num_seqs]`) are host memory, validated (ids in the pool, lengths in
/// the tables) before anything is launched; split-K is planned from the device's SM
/// count. Asynchronous on the backend's stream.
///
/// # Safety
/// As `pagedkv_cuda_kv_append`; the host arrays are valid for their `*_len` reads.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_cuda_decode_attention(
    b: *mut pagedkv_cuda_backend,
    shape: *const pagedkv_decode_shape,
    dtype: i32,
    scale: f32,
    q: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: u64,
) -> pagedkv_status {
    with_cuda(b, |g| {
        let dt = dtype_of(dtype)?;
        if shape.is_null() {
            return Err(fail(PAGEDKV_ERR_NULL, "shape is null"));
        }
        // SAFETY: non-null, valid for a read.
        let c = unsafe { shape.read() };
        let sh = DecodeShape::from(c);
        pagedkv::host::ops::check_layout(&sh.layout()).map_err(|e| from_error(&e))?;
        // Sizes in checked arithmetic (each fits in `usize`, so do the shapes' partial
        // products: head_dim >= 1 past `check_layout`), and the host arrays' lengths
        // checked against the shape before they are read.
        let pool = [pool_elems(&sh.layout())? as usize];
        checked_elems(
            &[c.num_seqs, c.num_q_heads, c.head_dim],
            "num_seqs",
            "num_seqs * num_q_heads * head_dim",
        )?;
        let btn = checked_elems(
            &[c.num_seqs, c.max_blocks_per_seq],
            "max_blocks_per_seq",
            "num_seqs * max_blocks_per_seq",
        )?;
        check_len("block_tables", block_tables_len, btn)?;
        check_len("context_lens", context_lens_len, c.num_seqs as u64)?;
        // SAFETY: the caller's contract.
        let (bt, cl) = unsafe {
            (
                slice(block_tables, block_tables_len, "block_tables")?,
                slice(context_lens, context_lens_len, "context_lens")?,
            )
        };
        let qs = [
            c.num_seqs as usize,
            c.num_q_heads as usize,
            c.head_dim as usize,
        ];
        // SAFETY: the caller's contract (device allocations of these sizes).
        let (qt, kc, vc, mut ot) = unsafe {
            use pagedkv::cuda::BorrowedDeviceTensor as B;
            let m = |e: Error| from_error(&e);
            (
                B::new(g, q, dt, &qs).map_err(m)?,
                B::new(g, key_cache, dt, &pool).map_err(m)?,
                B::new(g, value_cache, dt, &pool).map_err(m)?,
                B::new(g, out, dt, &qs).map_err(m)?,
            )
        };
        let mut opts = DecodeOptions::new(c.head_dim.max(1));
        opts.scale = scale;
        g.paged_decode_attention(&sh, &opts, &qt, &kc, &vc, bt, cl, &mut ot, None)
            .map(|_| ())
            .map_err(|e| from_error(&e))
    })
}

/// Decode attention on the GPU like `pagedkv_cuda_decode_attention`, with `q` and `out`
/// as rows `q_row_stride` / `out_row_stride` elements apart (0: dense,
/// `num_q_heads * head_dim`): q can be a view into a fused QKV projection. A stride is
/// at least `num_q_heads * head_dim` and a multiple of 16 bytes, and every device
/// pointer 16-byte aligned, or the call is `PAGEDKV_ERR_INVALID_ARGUMENT` naming it.
/// Runs through the step path (one plan, one launch or two); asynchronous on the
/// backend's stream.
///
/// # Safety
/// As `pagedkv_cuda_decode_attention`, with `q` valid for `(num_seqs - 1) *
/// q_row_stride + num_q_heads * head_dim` elements and `out` likewise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_decode_attention_strided(
    b: *mut pagedkv_cuda_backend,
    shape: *const pagedkv_decode_shape,
    dtype: i32,
    scale: f32,
    q: u64,
    q_row_stride: u64,
    key_cache: u64,
    value_cache: u64,
    block_tables: *const i32,
    block_tables_len: u64,
    context_lens: *const i32,
    context_lens_len: u64,
    out: u64,
    out_row_stride: u64,
) -> pagedkv_status {
    use pagedkv::cuda::CudaStepDevice;
    use pagedkv::host::step::{
        DecodeIo, StepCapacity, StepDevice, StepMeta, StepRunner, StepShape, TensorView,
        TensorViewMut,
    };
    with_cuda(b, |g| {
        let dt = dtype_of(dtype)?;
        if shape.is_null() {
            return Err(fail(PAGEDKV_ERR_NULL, "shape is null"));
        }
        // SAFETY: non-null, valid for a read.
        let c = unsafe { shape.read() };
        let sh = DecodeShape::from(c);
        let m = |e: Error| from_error(&e);
        pagedkv::host::ops::check_layout(&sh.layout()).map_err(m)?;
        let pool = pool_elems(&sh.layout())?;
        let row = checked_elems(
            &[c.num_q_heads, c.head_dim],
            "num_q_heads",
            "num_q_heads * head_dim",
        )?;
        let btn = checked_elems(
            &[c.num_seqs, c.max_blocks_per_seq],
            "max_blocks_per_seq",
            "num_seqs * max_blocks_per_seq",
        )?;
        check_len("block_tables", block_tables_len, btn)?;
        check_len("context_lens", context_lens_len, c.num_seqs as u64)?;
        // SAFETY: the caller's contract.
        let (bt, cl) = unsafe {
            (
                slice(block_tables, block_tables_len, "block_tables")?,
                slice(context_lens, context_lens_len, "context_lens")?,
            )
        };
        // Elements a strided view spans: (num_seqs - 1) * stride + row, checked.
        let span = |what: &str, stride: u64| -> Result<(u64, u64), pagedkv_status> {
            let stride = if stride == 0 { row } else { stride };
            (c.num_seqs.max(1) as u64 - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(row))
                .map(|n| (n, stride))
                .ok_or_else(|| {
                    fail(
                        PAGEDKV_ERR_INVALID_ARGUMENT,
                        format!("`{what}`: num_seqs * row stride overflows"),
                    )
                })
        };
        let (q_elems, q_stride) = span("q_row_stride", q_row_stride)?;
        let (out_elems, out_stride) = span("out_row_stride", out_row_stride)?;
        let step_shape = StepShape {
            num_q_heads: c.num_q_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            dtype: dt,
        };
        let cap = StepCapacity {
            max_seqs: c.num_seqs.max(1),
            max_blocks_per_seq: c.max_blocks_per_seq.max(1),
            max_tokens: 1,
            max_partitions: 1024,
        };
        let mut r =
            StepRunner::new(CudaStepDevice::new(g), step_shape, cap, g.sm_count()).map_err(m)?;
        r.plan(&StepMeta {
            block_tables: bt,
            max_blocks_per_seq: c.max_blocks_per_seq,
            context_lens: cl,
            slot_mapping: &[],
        })
        .map_err(m)?;
        let space = r.device().space();
        // SAFETY: the caller's contract: device allocations in the backend's context of
        // these sizes, unused by other work until the launch completes.
        let (qv, kv, vv, ov) = unsafe {
            (
                TensorView::from_raw(q, q_elems, dt, space).with_row_stride(q_stride),
                TensorView::from_raw(key_cache, pool, dt, space),
                TensorView::from_raw(value_cache, pool, dt, space),
                TensorViewMut::from_raw(out, out_elems, dt, space).with_row_stride(out_stride),
            )
        };
        let mut opts = DecodeOptions::new(c.head_dim.max(1));
        opts.scale = scale;
        r.decode(
            &opts,
            DecodeIo {
                q: qv,
                key_cache: kv,
                value_cache: vv,
                out: ov,
            },
        )
        .map(|_| ())
        .map_err(m)
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
