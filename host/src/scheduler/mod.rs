//! The decode scheduler: continuous batching over the paged KV cache.
//!
//! ```
//! use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};
//!
//! let mut s = Scheduler::new(SchedulerConfig { num_blocks: 64, block_size: 16, ..SchedulerConfig::default() })?;
//! s.add_request(Request::new(7, vec![1, 2, 3, 4, 5], 3))?;
//! loop {
//!     let batch = s.step()?;
//!     if batch.seqs.is_empty() { break; }
//!     // ... run kv_append and paged_decode_attention with batch.block_tables,
//!     // batch.context_lens and batch.slot_mapping, sample one token per sequence ...
//!     let sampled: Vec<(u64, u32)> = batch.seqs.iter().map(|q| (q.seq, 42)).collect();
//!     s.on_step_done(&sampled)?;
//! }
//! assert_eq!(s.finished().len(), 1);
//! # Ok::<(), pagedkv_host::Error>(())
//! ```
//!
//! # Queues and one step
//! Requests wait, run, or sit swapped out, each queue ordered most urgent first: by
//! arrival (FCFS), or by priority then arrival (a *lower* `Request::priority` is more
//! urgent, as in vLLM). A request is
//! a *sequence group*: its prompt's sequence plus any [`Scheduler::fork`]s of it; groups
//! are admitted, preempted and swapped whole. [`Scheduler::step`]:
//! 1. makes room for every running sequence's next token; if the pool cannot, preempts
//!    the least urgent running groups (FCFS: the newest), by recompute (blocks freed,
//!    the group back to waiting, in its original queue place) or by swap (blocks
//!    copied to the host pool; falls back to recompute when the host pool is full), per
//!    group or by default;
//! 2. swaps groups back in, most urgent first, when no preemption happened this step and
//!    the group's blocks plus its next decode slots fit, with free blocks left above
//!    the watermark while other sequences run;
//! 3. gives every running sequence its decode slot (allocating only when a block
//!    fills, copying a shared partial block on write);
//! 4. admits waiting groups while free blocks stay above the watermark (while other
//!    sequences run), the running sequences stay within `max_num_seqs`, and the step's
//!    tokens within `max_tokens_per_step` (a prefill counts its uncached prompt tokens;
//!    with chunked prefill, step 3 also schedules the next chunk of every mid-prefill
//!    sequence, and step 4 may admit a prompt with its first chunk: see below).
//!
//! The watermark keeps headroom for running sequences to grow into; with nothing
//! running there is nobody to keep it for, so a group alone may take the whole pool.

//! # Chunked prefill
//! Off by default ([`Scheduler::new`]); [`Scheduler::with_chunked_prefill`] turns it
//! on. Then `max_tokens_per_step` need not hold a whole prompt (it must hold
//! `max_num_seqs` tokens), and a prefill runs in chunks over several steps:
//! * Step 4 admits a group when each of its sequences gets at least one token of the
//!   step's remaining budget: its first chunk is its prefix-cache hits (not computed:
//!   [`ScheduledSeq::num_cached_tokens`], `start_pos` past them) and then as many
//!   uncached tokens as the budget leaves; the chunk's blocks (not the whole
//!   prompt's) must fit above the watermark.
//! * A sequence whose prefill is incomplete is *mid-prefill*
//!   ([`Scheduler::is_prefilling`]). It keeps its row, and every step schedules its
//!   next chunk (`is_prefill`, `start_pos` where the last chunk ended, `context_len =
//!   start_pos + num_new_tokens`): in step 3, after the decodes have taken one token
//!   each, as many of its remaining tokens as the budget leaves (keeping one token for
//!   each later chunk) and as fit the free blocks (keeping the next token's block of
//!   every later row, and the watermark while others run), at least one token. Step 1
//!   reserves that one token's block like a decode's, so a mid-prefill sequence is
//!   preempted (whole group, recompute or swap) exactly like a decoding one; a
//!   recomputed one starts its prefill again, a swapped one resumes it.
//! * Only the last chunk samples ([`ScheduledSeq::samples`]): the engine passes every
//!   scheduled sequence to [`Scheduler::on_step_done`] as before, and the token of a
//!   non-final chunk is ignored (its full blocks were registered in the prefix cache
//!   when the chunk was scheduled). The sequence decodes from the next step on.
//! * A mid-prefill sequence cannot be forked (an error): fork after its last chunk.
//! * A first chunk holds at most the blocks one sequence of its request may hold at
//!   once (see liveness below: with a sliding window, fewer than a long prompt's).
//! * With a sliding window, a step's new tokens all get slots, and the blocks wholly
//!   before the window of its *first* new token are all a step releases (a chunk's
//!   early queries still read the blocks its later ones no longer see; see
//!   [`KvCacheManager::append_chunk`](crate::block::KvCacheManager::append_chunk)).
//!
//! A step's [`Batch`] lists its decodes first ([`Batch::num_decodes`] of them), then the
//! continuing chunks (their rows are moved after the decoding rows when needed,
//! rewritten whole), then the admitted prefills, with [`Batch::qo_indptr`] for the prefill kernel
//! and [`Batch::num_cached_tokens`].
//!
//! The result is a [`Batch`]: flat, device-ready arrays. Its block tables are
//! *persistent* rows (one per running sequence, `NULL_BLOCK`-padded): a step rewrites
//! only the entries that changed (a new block's, a copied-on-write block's, those a
//! window released; a new or moved row whole), so a steady decode step costs O(running sequences) with no
//! heap allocation beyond growing buffers. The common decode (a slot in the partial
//! last block) is an inline mask and multiply. A prefill's (or chunk's) full blocks
//! are named and registered in the prefix cache when it is scheduled (so a prompt
//! admitted later in the step shares them); a decode's newly full blocks are queued
//! as the tokens come in and named and registered in one batch at the end of
//! `on_step_done`, their SHA-256 compressions back to back and their cache misses
//! overlapped.
//!
//! After sampling, [`Scheduler::on_step_done`] takes each scheduled sequence's new token;
//! a stop token or `max_tokens` finishes it and frees its blocks at once.
//!
//! # Speculative decoding
//! An engine that drafts tokens (a draft model, EAGLE or multi-token-prediction heads)
//! sets a sequence's *lookahead* `k` ([`Scheduler::set_lookahead`], up to
//! [`MAX_LOOKAHEAD`]; 0, the default, is a plain decode). From the next step on, the
//! sequence's decode is a *verify row*: slots for the token sampled last step and up to
//! `k` drafts, `num_new_tokens = num_draft_tokens + 1` query tokens at positions
//! `start_pos..context_len`, causal within the row, listed after the decodes with the
//! prefills ([`ScheduledSeq::num_draft_tokens`]; the engine runs it through the prefill
//! path with [`Batch::qo_indptr`]). Then [`Scheduler::on_step_done_accepted`] takes,
//! per row, the tokens it keeps (`0..=num_new_tokens`): the accepted drafts and the
//! token sampled after them. Invariants:
//! * *Drafts never preempt.* Step 1 reserves one token per row, as for a decode; a
//!   verify row's drafts take only what is left: the step's token budget after the
//!   decodes and one token for each later chunk or verify row, the free blocks above
//!   the watermark after the later rows' next tokens, and what the sequence may still
//!   generate. A verify row may get fewer drafts than asked, or none. Admission
//!   (step 4) comes after and sees the drafts' blocks taken, so the watermark counts
//!   them. Liveness is as without drafts.
//! * *A rollback is exact.* A row that keeps `n` of its positions gives the rest back:
//!   blocks that held only rejected positions go back to the head of the free queue
//!   (rows last to first, so the queue is as before the step), a copy on write made
//!   for the row is returned for the shared block when nothing is kept (and no fork
//!   kept a token in the shared block), and the row is rewritten at the next step.
//!   With a sliding window, the blocks a step no longer sees are released at the end
//!   of the *previous* `on_step_done` (not at the step's start), so a rollback never
//!   needs a block the window freed. A step that admitted, preempted and swapped
//!   nothing and whose rows all keep nothing leaves the tables, the pool (free-queue
//!   order included) and the prefix map as they were, but for a cached block the step
//!   evicted for a new block (the step wrote into it: its name is gone).
//! * *A rejected token is never a prefix hit.* A decode's full blocks are named in
//!   `on_step_done`, after the rollback, from the kept tokens: no rejected position
//!   is ever named, so nothing needs un-committing.
//! * *Accepting all is `k + 1` plain decodes*: the same tokens, tables, names and pool
//!   counts (block ids too, for one sequence without a window).
//!
//! Drafts form a chain here: the verifier accepts a prefix of them. A tree of drafts
//! is verified by the attention with a tree mask
//! (the prefill kernels' `tree_mask`); its accepted path is then copied
//! into the chain's first positions by the engine before it passes the path's tokens
//! back.
//!
//! # Layer groups (models that mix sliding-window and full-attention layers)
//! [`SchedulerConfig::kv_groups`] gives each layer group's [`KvSpec`] (Gemma 3: window
//! groups and one full group, [`LayerGroups`](crate::block::LayerGroups) cuts a
//! model's layers into them); all groups share the one pool and block size. The
//! hybrid manager keeps, per sequence, one [`BlockTable`] per group (group 0's in the
//! step record, the others beside it), and these invariants, each per group:
//! * *A block id names the same token slots in every layer of its group* (and belongs
//!   to one group: no block is in two groups' tables). Every group's table of a
//!   sequence has the same token count; position `p` is in entry `p / block_size` of
//!   each, so the tables are sparse ([`NULL_BLOCK`](crate::block::NULL_BLOCK) before a
//!   window), not compact: the kernels find a position's block by index, as with one
//!   window, and a row's width is the same in every group.
//! * *A window group holds only its window*: the release rule of one window (the
//!   blocks wholly before the window of a step's first new position go back to the
//!   pool) applies to each group with its own window; a full group releases nothing.
//!   A request of `n` tokens needs `blocks_for(n)` blocks in a full group and, with
//!   chunked prefill, at most `blocks_for(w) + 1` in a window group: admission,
//!   [`add_request`](Scheduler::add_request)'s refusal, preemption (each sequence's
//!   next token may take a block in every group), watermarks and swap count every
//!   group's own need.
//! * *A prefix hit is the longest prefix every group serves*: a full group's cached
//!   chain, a window group's cached blocks of the window at the first computed
//!   position (vLLM's rule), each group's blocks under its own names
//!   ([`BlockHash::in_group`](crate::block::BlockHash::in_group)). The names are
//!   computed once, by group 0's table, and adopted by the others. A block a window
//!   releases was named when it filled, so it stays in the free queue as a cached
//!   block, a hit for the next prompt that begins the same way, until evicted.
//! * *Copies and swaps are of pool blocks*: [`Batch::copies`], `swap_out` and
//!   `swap_in` list blocks of any group; an engine runs them on every K/V tensor (a
//!   block of one group is unused in another group's layers, so the copy is harmless
//!   there). Each group's block tables and slot mapping are [`Batch::group`]'s.
//!
//! # Liveness
//! Every request [`Scheduler::add_request`] accepts finishes if the caller keeps
//! calling `step` and `on_step_done`: while any request is live, every step schedules
//! at least one sequence, and every scheduled sequence keeps the token it gets (a
//! recomputed sequence keeps its generated tokens), so the steps until idle are at most
//! the tokens the live sequences may still generate. (With chunked prefill, a step
//! gives every running sequence at least one token, a mid-prefill one a token of its
//! prompt; the most urgent group, never preempted, finishes its prefill and then its
//! decodes.) Under the priority policy this holds for the requests already queued: a
//! stream of more urgent arrivals can keep a less urgent request waiting or preempted
//! (vLLM's priority scheduling starves the same way). It holds by construction:
//! * *A group fits the pool alone.* `add_request` refuses a request whose sequence
//!   would outgrow the usable pool (`prompt + max_tokens` tokens, at most
//!   `max_model_len`; with a sliding window and chunked prefill, the window's blocks
//!   plus one: without chunked prefill, a (re)computed prefill holds all its
//!   tokens' blocks at once), and
//!   [`Scheduler::fork`] refuses a fork after which the group's sequences together
//!   could outgrow it or a step's token budget, or exceed `max_num_seqs`.
//! * *The most urgent running group (FCFS: the oldest) is never preempted*: step 1
//!   counts each group's next decode slots exactly (forks sharing a partial block copy
//!   it all but once) and preempts less urgent groups first; alone, the group fits.
//! * *With nothing running, something always starts*: the watermark does not apply, the
//!   whole pool is free (waiting and swapped groups hold no device blocks), so the
//!   most urgent swapped group swaps in (it needs its blocks plus its exact next decode
//!   slots, which fit the pool as they did before it was swapped out), or else the
//!   first waiting group is admitted (its prefill fits the pool and a step's budget).
//!
//! # Next to vLLM v1
//! Behaviours vLLM's tests expect of its KV manager and scheduler
//! (tests/v1/core/test_prefix_caching.py, test_scheduler.py) that pagedkv follows, each
//! tested here: freed blocks with nothing reusable are taken before cached ones;
//! `reset_prefix_cache` only once no request holds blocks; a lower priority value is
//! more urgent and the least urgent is preempted first; prompts admitted in one step
//! share the first one's full blocks. Where pagedkv differs, on purpose:
//! * *No per-request cap on a prefill chunk* (vLLM's `long_prefill_token_threshold`):
//!   with chunked prefill a prompt takes what the step's token budget leaves (and,
//!   for its first chunk, what its request may hold at once). A cap would keep one
//!   long prompt from taking a whole step's budget; it is not built yet.
//! * *An admission watermark on by default* (`watermark` 0.01 of the blocks, kept
//!   free while anything runs; vLLM v1 has none): it leaves running sequences room to
//!   grow without preempting the request just admitted. Set it to 0 for vLLM's
//!   behaviour.
//! * *Two blocks of one name keep only the first registered* (vLLM's map keeps every
//!   block of a hash): a second copy arises only where two sequences computed the
//!   same prefix before either registered it, and a hit needs one copy.
//! * *Names are a SHA-256 chain computed in Rust* (vLLM's default `sha256` hashes a
//!   pickled tuple per block): the same guarantee, about 33 ns a 16-token block.
//!
//! # Where the code lives
//! * this file: the public types, the [`Scheduler`] itself, its constructor and
//!   read-only accessors;
//! * `seqs`: the private bookkeeping (sequences by slot id, sequence groups);
//! * `tokens`: the token histories, whose last few tokens sit in one cache line per
//!   sequence slot, and the [`Tokens`] view of them;
//! * `admission`: [`Scheduler::add_request`] and [`Scheduler::fork`], which keep the
//!   liveness bounds, and step 4 (admitting waiting groups);
//! * `preemption`: steps 1 and 2 (making room by preemption, swapping back in) and
//!   the block-cost and watermark arithmetic they share;
//! * `step`: [`Scheduler::step`] itself, step 3 (the decode slots) and the metrics;
//! * `batch`: the [`Batch`] types and the upkeep of its persistent block-table rows;
//! * `completion`: [`Scheduler::on_step_done`] and
//!   [`Scheduler::on_step_done_accepted`] (with the rollback of rejected drafts),
//!   [`Scheduler::abort`] and finishing a sequence.

mod admission;
mod batch;
mod completion;
mod preemption;
mod seqs;
mod step;
mod tokens;
mod transfer;

pub use transfer::ImportReservation;

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;

pub use batch::{Batch, GroupTables, GroupView, ScheduledSeq};
use seqs::{Group, GroupKey, SeqSlab};
pub use tokens::Tokens;

use crate::block::{BlockTable, KvCacheManager, KvSpec, PrefixHits};
use crate::error::{Error, Result};
use crate::mem::SeqAlloc;
use crate::ops::SUPPORTED_BLOCK_SIZES;

/// The most draft tokens a sequence may verify in one step
/// ([`Scheduler::set_lookahead`]): a verify row's `k + 1` query tokens fit one 64-bit
/// tree-mask word.
pub const MAX_LOOKAHEAD: u32 = 63;

/// A request's id, chosen by the caller.
pub type RequestId = u64;
/// A sequence's id, chosen by the scheduler.
pub type SeqId = u64;

/// How a preempted group gives its blocks back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PreemptionMode {
    /// Free the blocks; the group is prefilled again later (prefix hits may help).
    #[default]
    Recompute,
    /// Copy the blocks to the host pool and back later.
    Swap,
}

/// The order of the waiting queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum QueuePolicy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Lower `Request::priority` first (vLLM's convention: 0 before 1), FCFS among
    /// equals; preemption takes the highest value (then the newest) first.
    Priority,
}

/// Why a sequence finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It sampled its stop token.
    Stop,
    /// It generated `max_tokens` tokens.
    MaxTokens,
    /// [`Scheduler::abort`] ended it.
    Aborted,
}

/// Scheduler settings.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Device blocks (block 0 is the null block), 2 to
    /// [`MAX_POOL_BLOCKS`](crate::block::MAX_POOL_BLOCKS).
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Host blocks for swapping (0: swap falls back to recompute), at most
    /// [`MAX_POOL_BLOCKS`](crate::block::MAX_POOL_BLOCKS).
    pub num_host_blocks: u32,
    /// Most running sequences.
    pub max_num_seqs: usize,
    /// Most tokens one step processes (decodes count 1, prefills their new tokens).
    pub max_tokens_per_step: usize,
    /// Fraction of device blocks admission and swap-in keep free.
    pub watermark: f64,
    /// Default preemption mode.
    pub preemption: PreemptionMode,
    /// Waiting-queue order.
    pub policy: QueuePolicy,
    /// Reuse cached full blocks of matching prefixes.
    pub enable_prefix_caching: bool,
    /// Attend only to the last `w` tokens; blocks before the window are freed. The
    /// spec of the one layer group when `kv_groups` is empty (set one or the other).
    pub sliding_window: Option<u32>,
    /// The KV spec of each layer group sharing the pool, for models that mix
    /// sliding-window and full-attention layers ([`LayerGroups::specs`]; see the
    /// module docs on layer groups). Empty: one group, of `sliding_window`'s spec.
    ///
    /// [`LayerGroups::specs`]: crate::block::LayerGroups::specs
    pub kv_groups: Vec<KvSpec>,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_model_len: u32,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            num_blocks: 1024,
            block_size: 16,
            num_host_blocks: 0,
            max_num_seqs: 256,
            max_tokens_per_step: 8192,
            watermark: 0.01,
            preemption: PreemptionMode::Recompute,
            policy: QueuePolicy::Fcfs,
            enable_prefix_caching: false,
            sliding_window: None,
            kv_groups: Vec::new(),
            max_model_len: 4096,
        }
    }
}

/// A generation request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    /// Caller-chosen id, unique among live requests.
    pub id: RequestId,
    /// Prompt token ids (at least one).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: u32,
    /// Finish when this token is sampled.
    pub stop_token: Option<u32>,
    /// Priority under [`QueuePolicy::Priority`]: *lower* values are more urgent, as in
    /// vLLM (admitted and swapped in first, preempted last). Until 0.2 it was higher
    /// first.
    pub priority: i32,
    /// Prefix-cache salt: requests with different salts never share cached blocks.
    pub cache_salt: Option<u64>,
    /// Preemption mode for this request (default: the config's).
    pub preemption: Option<PreemptionMode>,
}

impl Request {
    /// A request with default options.
    pub fn new(id: RequestId, prompt: Vec<u32>, max_tokens: u32) -> Self {
        Self {
            id,
            prompt,
            max_tokens,
            stop_token: None,
            priority: 0,
            cache_salt: None,
            preemption: None,
        }
    }
}

/// Counters and gauges after a step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Steps run.
    pub steps: u64,
    /// Device blocks held by sequences.
    pub blocks_used: u32,
    /// Device blocks free (cached ones included).
    pub blocks_free: u32,
    /// Free blocks that still hold a reusable prefix.
    pub blocks_cached_free: u32,
    /// Tokens stored / token slots of held blocks.
    pub kv_utilization: f64,
    /// Running, waiting and swapped sequence groups.
    pub running: usize,
    /// Waiting groups.
    pub waiting: usize,
    /// Swapped-out groups.
    pub swapped: usize,
    /// Preemptions by recompute so far.
    pub preempted_recompute: u64,
    /// Preemptions by swap so far.
    pub preempted_swap: u64,
    /// Blocks copied out to the host so far.
    pub swapped_out_blocks: u64,
    /// Blocks copied in from the host so far.
    pub swapped_in_blocks: u64,
    /// Prompt tokens looked up in the prefix cache so far.
    pub prefix_queried_tokens: u64,
    /// Of those, tokens found cached.
    pub prefix_hit_tokens: u64,
    /// Host memory (bytes) the scheduler's arena holds from the system for the
    /// sequences' token histories and block tables and its per-slot arrays: in use or
    /// free for reuse (see docs/scheduler.md, memory layout). Depends on the
    /// allocation history, not only on the scheduler's state.
    pub arena_bytes: usize,
}

impl Metrics {
    /// Prefix-cache hit rate (hit tokens / queried tokens), 0 when nothing was queried.
    pub fn prefix_hit_rate(&self) -> f64 {
        if self.prefix_queried_tokens == 0 {
            0.0
        } else {
            self.prefix_hit_tokens as f64 / self.prefix_queried_tokens as f64
        }
    }
}

/// The decode scheduler; see the module docs.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    seqs: SeqSlab,
    /// Where the sequences' histories and block tables live (see `mem::arena`).
    arena: SeqAlloc,
    groups: HashMap<RequestId, Group>,
    /// The queues, each in [`Group::key`] order (most urgent first).
    waiting: BTreeMap<GroupKey, RequestId>,
    running: BTreeMap<GroupKey, RequestId>,
    swapped: BTreeMap<GroupKey, RequestId>,
    /// Running sequences in row order.
    rows: Vec<SeqId>,
    batch: Batch,
    next_arrival: u64,
    in_step: bool,
    generation: u64,
    /// Chunked prefill (see the module docs); fixed at construction.
    chunked: bool,
    finished: Vec<(RequestId, SeqId, FinishReason, Vec<u32>)>,
    metrics: Metrics,
    watermark_blocks: u32,
    /// The prefix hits of the group admission is looking at (its buffer reused).
    hits: PrefixHits,
    /// The KV spec of each layer group (`cfg.kv_groups`, or the one group of
    /// `cfg.sliding_window`).
    specs: Vec<KvSpec>,
    /// Live sequences with a lookahead (speculative decoding), so a step without
    /// any skips the per-row check.
    lookahead_seqs: usize,
    /// Verify rows (a granted lookahead) in the last step.
    verify_rows: usize,
    /// Sequences whose batch row is rewritten whole at the next step (a rollback
    /// changed their tables while the batch was out).
    stale_rows: Vec<SeqId>,
    /// `(sequence, layer group, from, to)`: entries a window released in
    /// `on_step_done` (the batch was out), written `NULL_BLOCK` at the next step.
    released: Vec<(SeqId, u32, u32, u32)>,
}

impl Scheduler {
    /// A scheduler with this configuration (validated), chunked prefill off: a prompt
    /// is prefilled in one step, so `max_tokens_per_step` must be at least
    /// `max_model_len`.
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
        Self::with_chunked_prefill(cfg, false)
    }

    /// A scheduler with this configuration (validated) and chunked prefill on or off
    /// (see the module docs on chunked prefill). With it on, `max_tokens_per_step` need
    /// not hold a whole prompt, but must be at least `max_num_seqs`: every running
    /// sequence takes at least one token a step. `new(cfg)` is
    /// `with_chunked_prefill(cfg, false)`.
    pub fn with_chunked_prefill(cfg: SchedulerConfig, chunked_prefill: bool) -> Result<Self> {
        if !SUPPORTED_BLOCK_SIZES.contains(&cfg.block_size) {
            return Err(Error::invalid(
                "block_size",
                format!("{} (one of {SUPPORTED_BLOCK_SIZES:?})", cfg.block_size),
            ));
        }
        if cfg.max_num_seqs == 0 {
            return Err(Error::invalid("max_num_seqs", "must be at least 1"));
        }
        if cfg.max_model_len == 0 || cfg.max_model_len > i32::MAX as u32 {
            return Err(Error::invalid(
                "max_model_len",
                format!(
                    "{} (must be in 1..={}: context lengths are i32)",
                    cfg.max_model_len,
                    i32::MAX
                ),
            ));
        }
        if cfg.num_blocks > i32::MAX as u32 {
            return Err(Error::invalid(
                "num_blocks",
                format!(
                    "{} (at most {}: block tables are i32)",
                    cfg.num_blocks,
                    i32::MAX
                ),
            ));
        }
        if chunked_prefill && cfg.max_tokens_per_step < cfg.max_num_seqs {
            return Err(Error::invalid(
                "max_tokens_per_step",
                format!(
                    "{} is below max_num_seqs {}: with chunked prefill every running sequence takes a token each step",
                    cfg.max_tokens_per_step, cfg.max_num_seqs
                ),
            ));
        }
        if !chunked_prefill && cfg.max_tokens_per_step < cfg.max_model_len as usize {
            return Err(Error::invalid(
                "max_tokens_per_step",
                format!(
                    "{} is below max_model_len {}: a long prompt could never be admitted",
                    cfg.max_tokens_per_step, cfg.max_model_len
                ),
            ));
        }
        if !(0.0..1.0).contains(&cfg.watermark) {
            return Err(Error::invalid(
                "watermark",
                format!("{} (must be in [0, 1))", cfg.watermark),
            ));
        }
        let specs = if cfg.kv_groups.is_empty() {
            if cfg.sliding_window == Some(0) {
                return Err(Error::invalid("sliding_window", "must be at least 1 token"));
            }
            vec![KvSpec::from_window(cfg.sliding_window)]
        } else if cfg.sliding_window.is_some() {
            return Err(Error::invalid(
                "sliding_window",
                "set with kv_groups: give the window as a group's KvSpec",
            ));
        } else {
            cfg.kv_groups.clone()
        };
        let kv = KvCacheManager::with_groups(
            cfg.num_blocks,
            cfg.num_host_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            &specs,
        )?;

        let watermark_blocks = (cfg.watermark * cfg.num_blocks as f64) as u32;
        let max_blocks = cfg.max_model_len.div_ceil(cfg.block_size);
        // The batch's block tables hold up to `max_num_seqs` rows of `max_blocks` i32s
        // (in each group).
        cfg.max_num_seqs
            .checked_mul(max_blocks as usize)
            .and_then(|n| n.checked_mul(size_of::<i32>()))
            .filter(|&bytes| bytes <= isize::MAX as usize)
            .ok_or_else(|| {
                Error::invalid(
                    "max_num_seqs",
                    format!(
                        "{} rows of {max_blocks} blocks (max_model_len / block_size) overflow the block-table size",
                        cfg.max_num_seqs
                    ),
                )
            })?;
        let arena = SeqAlloc::arena();
        let batch = Batch {
            max_blocks_per_seq: max_blocks,
            block_size: cfg.block_size,
            sliding_window: specs[0].window(),
            groups: specs[1..]
                .iter()
                .map(|s| GroupTables {
                    sliding_window: s.window(),
                    ..GroupTables::default()
                })
                .collect(),
            ..Batch::default()
        };
        Ok(Self {
            batch,
            kv,
            seqs: SeqSlab::new(&arena),
            arena,
            groups: HashMap::default(),
            waiting: BTreeMap::new(),
            running: BTreeMap::new(),
            swapped: BTreeMap::new(),
            rows: Vec::new(),
            next_arrival: 0,
            in_step: false,
            generation: 0,
            chunked: chunked_prefill,
            finished: Vec::new(),
            metrics: Metrics::default(),
            watermark_blocks,
            hits: PrefixHits::default(),
            specs,
            cfg,
            lookahead_seqs: 0,
            verify_rows: 0,
            stale_rows: Vec::new(),
            released: Vec::new(),
        })
    }

    /// Drops every cached prefix (vLLM's `reset_prefix_cache`): after a weight update
    /// the cached blocks' K/V is stale, yet a prefix hit would serve it. Refused
    /// ([`Error::InvalidState`], nothing changed) between [`step`](Self::step) and
    /// [`on_step_done`](Self::on_step_done), and while any request runs or is swapped
    /// out (their tables hold blocks and hashes of the old weights): call it when
    /// only waiting requests are left, as vLLM does. Waiting requests then find no
    /// hits.
    pub fn reset_prefix_cache(&mut self) -> Result<()> {
        if self.in_step {
            return Err(Error::InvalidState(
                "reset_prefix_cache between step() and on_step_done()".into(),
            ));
        }
        if !self.running.is_empty() || !self.swapped.is_empty() {
            return Err(Error::InvalidState(format!(
                "reset_prefix_cache while {} request groups run and {} are swapped out: their blocks are in use",
                self.running.len(),
                self.swapped.len()
            )));
        }
        self.kv.reset_prefix_cache()?;
        self.metrics.blocks_cached_free = 0;
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Whether chunked prefill is on.
    pub fn chunked_prefill(&self) -> bool {
        self.chunked
    }

    /// Whether live sequence `seq` is mid-prefill: its group runs or is swapped out
    /// with only some of its prefill's tokens computed (chunked prefill). Such a
    /// sequence cannot be forked, and the token sampled after one of its non-final
    /// chunks is ignored.
    pub fn is_prefilling(&self, seq: SeqId) -> Result<bool> {
        self.seqs
            .get(&seq)
            .map(|_| self.seqs.is_prefilling(seq))
            .ok_or(Error::Unknown {
                what: "sequence",
                id: seq,
            })
    }

    /// The KV-cache manager (pools and counts), read-only.
    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    /// The metrics as of the last step.
    pub fn metrics(&self) -> Metrics {
        self.metrics
    }

    /// Finished sequences so far: request, sequence, reason, all tokens (prompt first).
    pub fn finished(&self) -> &[(RequestId, SeqId, FinishReason, Vec<u32>)] {
        &self.finished
    }

    /// Takes the finished list, leaving it empty.
    pub fn take_finished(&mut self) -> Vec<(RequestId, SeqId, FinishReason, Vec<u32>)> {
        std::mem::take(&mut self.finished)
    }

    /// Whether nothing waits, runs or is swapped.
    pub fn is_idle(&self) -> bool {
        self.groups.is_empty()
    }

    /// The tokens of a live sequence (its prompt, then the tokens sampled for it), as
    /// a two-part [`Tokens`] view.
    pub fn tokens(&self, seq: SeqId) -> Result<Tokens<'_>> {
        self.seqs
            .tokens(seq)
            .map(|t| t.view())
            .ok_or(Error::Unknown {
                what: "sequence",
                id: seq,
            })
    }

    /// The block table of a live sequence (of layer group 0: see
    /// [`block_table_of`](Self::block_table_of)).
    pub fn block_table(&self, seq: SeqId) -> Result<&BlockTable> {
        self.block_table_of(seq, 0)
    }

    /// The block table of a live sequence in layer group `group`.
    pub fn block_table_of(&self, seq: SeqId, group: usize) -> Result<&BlockTable> {
        let s = self.seqs.get(&seq).ok_or(Error::Unknown {
            what: "sequence",
            id: seq,
        })?;
        match group {
            0 => Ok(&s.table),
            g => self.seqs.extra(seq).get(g - 1).ok_or_else(|| {
                Error::invalid(
                    "group",
                    format!("{g}: the scheduler has {} layer groups", self.specs.len()),
                )
            }),
        }
    }

    /// The batch the last [`step`](Self::step) returned, as it returned it: unchanged
    /// until the next `step` or [`fork`](Self::fork) (see [`Batch`]); empty before the
    /// first step. (The C ABI reads a layer group's tables from it.)
    pub fn last_batch(&self) -> &Batch {
        &self.batch
    }

    /// The KV spec of each layer group (`config().kv_groups`, or the one group of
    /// `config().sliding_window`).
    pub fn kv_specs(&self) -> &[KvSpec] {
        &self.specs
    }

    /// Sets how many draft tokens live sequence `seq` asks to verify in each of its
    /// decode steps from the next [`step`](Self::step) on (0: plain decodes); see the
    /// module docs on speculative decoding. At most [`MAX_LOOKAHEAD`]. Refused
    /// between `step` and [`on_step_done`](Self::on_step_done) ([`Error::InvalidState`]).
    pub fn set_lookahead(&mut self, seq: SeqId, k: u32) -> Result<()> {
        if self.in_step {
            return Err(Error::InvalidState(
                "set_lookahead between step() and on_step_done()".into(),
            ));
        }
        if k > MAX_LOOKAHEAD {
            return Err(Error::invalid(
                "lookahead",
                format!("{k} draft tokens (at most {MAX_LOOKAHEAD})"),
            ));
        }
        if self.seqs.get(&seq).is_none() {
            return Err(Error::Unknown {
                what: "sequence",
                id: seq,
            });
        }
        let cold = self.seqs.cold_mut(seq);
        let before = cold.lookahead;
        cold.lookahead = k;
        self.lookahead_seqs = self.lookahead_seqs + (k > 0) as usize - (before > 0) as usize;
        Ok(())
    }

    /// The lookahead of live sequence `seq` ([`set_lookahead`](Self::set_lookahead)).
    pub fn lookahead(&self, seq: SeqId) -> Result<u32> {
        self.seqs
            .get(&seq)
            .map(|_| self.seqs.cold(seq).lookahead)
            .ok_or(Error::Unknown {
                what: "sequence",
                id: seq,
            })
    }

    /// Tokens whose KV is in the cache, for a live sequence.
    pub fn num_computed(&self, seq: SeqId) -> Result<u32> {
        self.seqs
            .get(&seq)
            .map(|_| self.seqs.hot[(seq & 0xffff_ffff) as usize].num_computed)
            .ok_or(Error::Unknown {
                what: "sequence",
                id: seq,
            })
    }

    /// Running sequences, in batch-row order.
    pub fn running_seqs(&self) -> &[SeqId] {
        &self.rows
    }

    /// Every live sequence (waiting, running or swapped), in no particular order.
    pub fn live_seqs(&self) -> Vec<SeqId> {
        self.seqs.keys().collect()
    }

    /// Live sequence ids of a request.
    pub fn request_seqs(&self, id: RequestId) -> Result<&[SeqId]> {
        self.groups
            .get(&id)
            .map(|g| g.seqs.as_slice())
            .ok_or(Error::Unknown {
                what: "request",
                id,
            })
    }
}
