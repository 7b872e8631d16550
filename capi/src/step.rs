//! The step cycle: plan a batch, run the model on it, hand back the sampled tokens.
//!
//! Each iteration of an engine's loop is two calls around the model:
//!
//! ```c
//! pagedkv_batch b;
//! pagedkv_step(s, &b);
//! /* 1. swap_out pairs (device -> host), then swap_in pairs (host -> device);
//!  * 2. copies (copy-on-write src -> dst) before any kernel writes;
//!  * 3. kv_append of the new tokens' K/V into b.slot_mapping's slots (-1: skip);
//!  * 4. decode attention with b.block_tables and b.context_lens;
//!  * 5. sample one token per sequence in b.seqs. */
//! for (uint64_t i = 0; i < b.num_seqs; i++)
//!     sampled[i] = (pagedkv_sampled){.seq = b.seqs[i].seq, .token = tok[i]};
//! pagedkv_on_step_done(s, sampled, b.num_seqs, &finished);
//! ```
//!
//! [`pagedkv_step`] fills a [`pagedkv_batch`]: the scheduled sequences
//! ([`pagedkv_scheduled_seq`], prefill or decode), their block tables padded with the
//! null block 0, the slot of every new token, and the block copies and swaps to do
//! first. An empty batch (`num_seqs == 0`) means nothing could run. The library owns
//! every array: they stay valid and unchanged until the next `pagedkv_step` or
//! `pagedkv_scheduler_destroy` on that scheduler (the Rust scheduler defers the row
//! moves of sequences that finish or are aborted to its next step). `block_tables`, `context_lens` and
//! `slot_mapping` point straight into the Rust scheduler's own batch; the sequence list
//! and the pair lists are converted to C layout into the handle's [`StepLists`].
//!
//! [`pagedkv_on_step_done`] takes exactly one [`pagedkv_sampled`] per scheduled
//! sequence. The handle remembers how many the last step scheduled (`awaiting`), so a
//! wrong `n` is refused before the array is read, and a call with no step waiting is
//! `PAGEDKV_ERR_INVALID_STATE`. Sequences that finished (stop token or `max_tokens`)
//! have their blocks freed before it returns.

use pagedkv::host::scheduler::Batch;

use crate::args::slice;
use crate::pagedkv_status::{self, *};
use crate::scheduler::{pagedkv_scheduler, with_scheduler};
use crate::status::{fail, from_error};

/// One sequence's part of a step.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct pagedkv_scheduled_seq {
    /// Sequence id.
    pub seq: u64,
    /// Its request.
    pub request: u64,
    /// 1: prefill (several new tokens); 0: decode (one), or a verify row
    /// (`num_draft_tokens > 0`, or after the decodes: the token sampled last step and
    /// its drafts, causal within the row).
    pub is_prefill: u32,
    /// Position of its first new token.
    pub start_pos: u32,
    /// New tokens this step.
    pub num_new_tokens: u32,
    /// Tokens in its cache after this step.
    pub context_len: u32,
    /// Offset of its first new token in `slot_mapping`.
    pub token_offset: u32,
    /// Draft tokens this verify row checks (`pagedkv_set_lookahead`; since 0.2, in
    /// place of a reserved 0): its `num_new_tokens = num_draft_tokens + 1` queries are
    /// the token sampled last step, then the drafts.
    pub num_draft_tokens: u32,
}

/// A step's batch. Every pointer stays valid, and the arrays unchanged, until the next
/// `pagedkv_step` or `pagedkv_scheduler_destroy` on the same scheduler (whatever
/// `pagedkv_on_step_done` and `pagedkv_abort` do in between); the library owns them.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_batch {
    /// Scheduled sequences.
    pub num_seqs: u64,
    /// `[num_seqs]`.
    pub seqs: *const pagedkv_scheduled_seq,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// Tokens per block of the tables and slots (the scheduler's `block_size`): the
    /// block size every kernel call of the step must be given (slot `b * block_size +
    /// i` is token `i` of block `b` only in a cache of this block size).
    pub block_size: u32,
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

/// One layer group's block tables and slot mapping of the last step
/// (`pagedkv_batch_group`): the layers of group `g` write their K/V through its
/// `slot_mapping` and attend through its `block_tables` (rows and tokens as the
/// batch's), within its window. Valid, and unchanged, as long as the batch's arrays.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_group_tables {
    /// `[num_seqs, max_blocks_per_seq]`, padded with the null block 0 (and 0 before
    /// the group's window).
    pub block_tables: *const i32,
    /// `[num_slots]`: slot of each new token in this group's blocks; -1: skip.
    pub slot_mapping: *const i64,
    /// The group's sliding window (tokens); 0: full attention.
    pub sliding_window: u32,
    /// Padding (0).
    pub reserved: u32,
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

/// What one scheduled sequence keeps of a step (`pagedkv_on_step_done_accepted`):
/// its next `num_tokens` tokens of the call's `tokens` array.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct pagedkv_accepted {
    /// Sequence id (from the batch).
    pub seq: u64,
    /// Tokens it keeps: 0 to its `num_new_tokens` (a prefill row: exactly 1).
    pub num_tokens: u32,
    /// Padding (0).
    pub reserved: u32,
}

fn flatten(v: &mut Vec<u32>, pairs: &[(u32, u32)]) {
    v.clear();
    v.extend(pairs.iter().flat_map(|&(a, b)| [a, b]));
}

/// The per-step lists converted to C layout, kept in the handle until the next step.
#[derive(Default)]
pub(crate) struct StepLists {
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
        num_draft_tokens: q.num_draft_tokens,
    }));
    flatten(&mut l.copies, &b.copies);
    flatten(&mut l.swap_out, &b.swap_out);
    flatten(&mut l.swap_in, &b.swap_in);
    pagedkv_batch {
        num_seqs: l.seqs.len() as u64,
        seqs: l.seqs.as_ptr(),
        max_blocks_per_seq: b.max_blocks_per_seq,
        block_size: b.block_size,
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

/// Layer group `group`'s block tables and slot mapping of the last `pagedkv_step` of a
/// scheduler made with `pagedkv_scheduler_create_groups` (group 0's are the batch's
/// own; a scheduler of one group has only that). A group past the scheduler's is
/// `PAGEDKV_ERR_INVALID_ARGUMENT`. The pointers stay valid as the batch's do.
///
/// # Safety
/// `s` is null or a pointer this library returned; `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_batch_group(
    s: *mut pagedkv_scheduler,
    group: u32,
    out: *mut pagedkv_group_tables,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        let b = h.inner.last_batch();
        let Some(v) = b.group(group as usize) else {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `group`: {group} (the scheduler has {} layer groups)",
                    b.num_groups()
                ),
            );
        };
        let t = pagedkv_group_tables {
            block_tables: v.block_tables.as_ptr(),
            slot_mapping: v.slot_mapping.as_ptr(),
            sliding_window: v.sliding_window.unwrap_or(0),
            reserved: 0,
        };
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(t) };
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
        // Checked before anything is read: `sampled` holds `n` entries by the caller's
        // contract, and the library reads exactly as many as the step scheduled.
        if let Err(st) = check_awaiting(h, n, "sampled tokens") {
            return st;
        }
        // SAFETY: `sampled` is non-null (checked in `slice`) and valid for `n` reads
        // (the caller's contract); `n` is the batch's length, so it fits in memory.
        let sampled = match unsafe { slice(sampled, n, "sampled") } {
            Ok(v) => v,
            Err(st) => return st,
        };
        let list: Vec<(u64, u32)> = sampled.iter().map(|x| (x.seq, x.token)).collect();
        let done = h.inner.on_step_done(&list);
        // SAFETY: the caller's: null or valid for a write.
        unsafe { step_done(h, done, out_finished) }
    })
}

/// `PAGEDKV_ERR_INVALID_STATE` when no step waits for its tokens, and
/// `PAGEDKV_ERR_INVALID_ARGUMENT` when `n` (of `what`) is not the number of sequences
/// the last step scheduled: what an `on_step_done` checks before it reads its arrays.
fn check_awaiting(h: &pagedkv_scheduler, n: u64, what: &str) -> Result<(), pagedkv_status> {
    if h.awaiting == 0 {
        return Err(fail(
            PAGEDKV_ERR_INVALID_STATE,
            format!(
                "on_step_done() without a step: no scheduled sequence waits for a token (n is {n})"
            ),
        ));
    }
    if n != h.awaiting {
        return Err(fail(
            PAGEDKV_ERR_INVALID_ARGUMENT,
            format!(
                "invalid argument `n`: {n} {what}, but the last step scheduled {} sequences",
                h.awaiting
            ),
        ));
    }
    Ok(())
}

/// An `on_step_done`'s outcome: on success the step no longer waits, and
/// `*out_finished` (if not null) receives how many sequences finished.
///
/// # Safety
/// `out_finished` is null or valid for a write.
unsafe fn step_done(
    h: &mut pagedkv_scheduler,
    done: pagedkv::host::Result<Vec<(u64, pagedkv::host::scheduler::FinishReason)>>,
    out_finished: *mut u64,
) -> pagedkv_status {
    match done {
        Ok(done) => {
            h.awaiting = 0;
            if !out_finished.is_null() {
                // SAFETY: non-null, valid for a write (the caller's contract).
                unsafe { out_finished.write(done.len() as u64) };
            }
            PAGEDKV_OK
        }
        Err(e) => from_error(&e),
    }
}

/// Takes what every sequence of the last step keeps (speculative decoding, since
/// 0.2): `rows[i]` names a scheduled sequence and how many of `tokens` are its own,
/// in order (the accepted drafts, then the token sampled after them; 0 rolls the row
/// back). `n` is checked against the last step's sequences before `rows` is read, and
/// the counts' sum against `num_tokens` before `tokens` is read. Otherwise as
/// `pagedkv_on_step_done`.
///
/// # Safety
/// `rows` is null only when `n` is 0, else valid for `n` reads; `tokens` null only
/// when `num_tokens` is 0, else valid for `num_tokens` reads; `out_finished` is null
/// or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_on_step_done_accepted(
    s: *mut pagedkv_scheduler,
    rows: *const pagedkv_accepted,
    n: u64,
    tokens: *const u32,
    num_tokens: u64,
    out_finished: *mut u64,
) -> pagedkv_status {
    with_scheduler(s, |h| {
        if let Err(st) = check_awaiting(h, n, "rows") {
            return st;
        }
        // SAFETY: valid for `n` reads (the caller's contract), `n` the batch's length.
        let rows = match unsafe { slice(rows, n, "rows") } {
            Ok(v) => v,
            Err(st) => return st,
        };
        let total = rows
            .iter()
            .try_fold(0u64, |acc, r| acc.checked_add(r.num_tokens as u64));
        if total != Some(num_tokens) {
            return fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `num_tokens`: {num_tokens}, but the rows keep {} tokens in all",
                    total.map_or("more than 2^64".to_string(), |t| t.to_string())
                ),
            );
        }
        let tokens: &[u32] = if num_tokens == 0 {
            &[]
        } else {
            // SAFETY: valid for `num_tokens` reads (the caller's contract); the sum of
            // the rows' counts, each at most 2^32, over at most the batch's rows.
            match unsafe { slice(tokens, num_tokens, "tokens") } {
                Ok(v) => v,
                Err(st) => return st,
            }
        };
        let mut at = 0usize;
        let list: Vec<(u64, &[u32])> = rows
            .iter()
            .map(|r| {
                let t = &tokens[at..at + r.num_tokens as usize];
                at += r.num_tokens as usize;
                (r.seq, t)
            })
            .collect();
        let done = h.inner.on_step_done_accepted(&list);
        // SAFETY: the caller's: null or valid for a write.
        unsafe { step_done(h, done, out_finished) }
    })
}

/// Sets how many draft tokens sequence `seq` asks to verify in each of its decode
/// steps from the next `pagedkv_step` on (since 0.2; 0: plain decodes; at most 63).
/// An unknown sequence is `PAGEDKV_ERR_UNKNOWN_ID`, more than 63
/// `PAGEDKV_ERR_INVALID_ARGUMENT`, a call between a step and its `on_step_done`
/// `PAGEDKV_ERR_INVALID_STATE`.
///
/// # Safety
/// `s` is a live handle (or null, an error).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_set_lookahead(
    s: *mut pagedkv_scheduler,
    seq: u64,
    k: u32,
) -> pagedkv_status {
    with_scheduler(s, |h| match h.inner.set_lookahead(seq, k) {
        Ok(()) => PAGEDKV_OK,
        Err(e) => from_error(&e),
    })
}
