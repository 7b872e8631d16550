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
//! Requests wait (FCFS, or by priority then FCFS), run, or sit swapped out. A request is
//! a *sequence group*: its prompt's sequence plus any [`Scheduler::fork`]s of it; groups
//! are admitted, preempted and swapped whole. [`Scheduler::step`]:
//! 1. makes room for every running sequence's next token; if the pool cannot, preempts
//!    the newest running groups, by recompute (blocks freed, the group back to waiting,
//!    in its original arrival place) or by swap (blocks copied to the host pool; falls
//!    back to recompute when the host pool is full), per group or by default;
//! 2. swaps groups back in, oldest first, when no preemption happened this step and
//!    the group's blocks plus its next decode slots fit, with free blocks left above
//!    the watermark while other sequences run;
//! 3. gives every running sequence its decode slot (allocating only when a block
//!    fills, copying a shared partial block on write);
//! 4. admits waiting groups while free blocks stay above the watermark (while other
//!    sequences run), the running sequences stay within `max_num_seqs`, and the step's
//!    tokens within `max_tokens_per_step` (a prefill counts its uncached prompt tokens).
//!
//! The watermark keeps headroom for running sequences to grow into; with nothing
//! running there is nobody to keep it for, so a group alone may take the whole pool.
//!
//! The result is a [`Batch`]: flat, device-ready arrays. Its block tables are
//! *persistent* rows (one per running sequence, `NULL_BLOCK`-padded): a step rewrites
//! only the entries that changed (a new block's, a copied-on-write block's, those a
//! window released; a new or moved row whole) and lists them in [`Batch::dirty`] for
//! an incremental upload, so a steady decode step costs O(running sequences) with no
//! heap allocation beyond growing buffers. The common decode (a slot in the partial
//! last block) is an inline mask and multiply; the prefix-cache registrations of a
//! step's newly full blocks are hashed as the tokens come in and registered in one
//! batch at the end of `on_step_done`, their cache misses overlapped.
//!
//! After sampling, [`Scheduler::on_step_done`] takes each scheduled sequence's new token;
//! a stop token or `max_tokens` finishes it and frees its blocks at once.
//!
//! # Liveness
//! Every request [`Scheduler::add_request`] accepts finishes if the caller keeps
//! calling `step` and `on_step_done`: while any request is live, every step schedules
//! at least one sequence, and every scheduled sequence keeps the token it gets (a
//! recomputed sequence keeps its generated tokens), so the steps until idle are at most
//! the tokens the live sequences may still generate. It holds by construction:
//! * *A group fits the pool alone.* `add_request` refuses a request whose sequence
//!   would outgrow the usable pool (`prompt + max_tokens` tokens, at most
//!   `max_model_len`; with a sliding window, the window's blocks plus one), and
//!   [`Scheduler::fork`] refuses a fork after which the group's sequences together
//!   could outgrow it or a step's token budget, or exceed `max_num_seqs`.
//! * *The oldest running group is never preempted*: step 1 counts each group's next
//!   decode slots exactly (forks sharing a partial block copy it all but once) and
//!   preempts newer groups first; alone, the group fits.
//! * *With nothing running, something always starts*: the watermark does not apply, the
//!   whole pool is free (waiting and swapped groups hold no device blocks), so the
//!   oldest swapped group swaps in (it needs its blocks plus its exact next decode
//!   slots, which fit the pool as they did before it was swapped out), or else the
//!   first waiting group is admitted (its prefill fits the pool and a step's budget).

use std::collections::BTreeMap;

use rustc_hash::FxHashMap as HashMap;

use crate::block::pool::{prefetch, prefetch_write};
use crate::block::{BlockTable, KvCacheManager, NULL_BLOCK};
use crate::error::{Error, Result};
use crate::ops::SUPPORTED_BLOCK_SIZES;

/// How many sequences ahead the per-sequence loops prefetch.
const PREFETCH_AHEAD: usize = 16;
/// Batches from this size prefetch: below it a step's per-sequence data stays in the
/// core's caches from one step to the next, and the look-ahead only costs instructions.
const PREFETCH_MIN_BATCH: usize = 2048;

/// The look-ahead distance for a batch of `n` sequences (`usize::MAX`: none).
fn prefetch_distance(n: usize) -> usize {
    if n >= PREFETCH_MIN_BATCH {
        PREFETCH_AHEAD
    } else {
        usize::MAX
    }
}

/// A request's id, chosen by the caller.
pub type RequestId = u64;
/// A sequence's id, chosen by the scheduler.
pub type SeqId = u64;

/// How a preempted group gives its blocks back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
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
    /// Higher `Request::priority` first, FCFS among equals.
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
    /// Device blocks (block 0 is the null block).
    pub num_blocks: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Host blocks for swapping (0: swap falls back to recompute).
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
    /// Attend only to the last `w` tokens; blocks before the window are freed.
    pub sliding_window: Option<u32>,
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
    /// Priority under [`QueuePolicy::Priority`] (higher first).
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

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The sequence.
    pub seq: SeqId,
    /// Its request.
    pub request: RequestId,
    /// Whether this is its prefill (several new tokens) or a decode (one).
    pub is_prefill: bool,
    /// Position of its first new token.
    pub start_pos: u32,
    /// New tokens this step (their slots are consecutive in `slot_mapping`).
    pub num_new_tokens: u32,
    /// Tokens in its cache after this step (the kernels' context length).
    pub context_len: u32,
    /// Offset of its first new token in `slot_mapping`.
    pub token_offset: u32,
}

/// What one step runs: device-ready arrays for the kernels.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// The scheduled sequences; `seqs[i]` owns row `i` of the block tables.
    pub seqs: Vec<ScheduledSeq>,
    /// `[seqs.len(), max_blocks_per_seq]`, padded with `NULL_BLOCK`.
    pub block_tables: Vec<i32>,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// `[seqs.len()]`: context length of each sequence after this step.
    pub context_lens: Vec<i32>,
    /// `[total new tokens]`: slot of each new token, sequence by sequence.
    pub slot_mapping: Vec<i64>,
    /// Copy-on-write `(src, dst)` block pairs for `copy_blocks`, to run before the
    /// kernels write.
    pub copies: Vec<(u32, u32)>,
    /// `(device, host)` pairs to copy out, first of all.
    pub swap_out: Vec<(u32, u32)>,
    /// `(host, device)` pairs to copy in, after the swap-outs.
    pub swap_in: Vec<(u32, u32)>,
    /// Requests preempted this step, and how.
    pub preempted: Vec<(RequestId, PreemptionMode)>,
    /// The entries of `block_tables` that changed since the previous batch: uploading
    /// `block_tables[r.row * max_blocks_per_seq ..][r.start..r.end]` for each range
    /// brings a device copy of the previous batch's tables up to date (ranges may
    /// overlap; rows past `seqs.len()` are gone). A new or moved row is dirty whole; a
    /// decode step dirties only the entry of a new block (or a copied-on-write one) and
    /// the entries a sliding window released.
    pub dirty: Vec<RowRange>,
    /// `dirty` was handed out by the last `step()`: the next change starts a new list.
    dirty_sent: bool,
}

/// A run of changed entries in one block-table row of a [`Batch`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRange {
    /// The row (the sequence's index in `Batch::seqs`).
    pub row: u32,
    /// First changed entry.
    pub start: u32,
    /// One past the last changed entry.
    pub end: u32,
}

impl Batch {
    /// Records entries `start..end` of row `row` as changed.
    fn mark_dirty(&mut self, row: usize, start: usize, end: usize) {
        if self.dirty_sent {
            self.dirty.clear();
            self.dirty_sent = false;
        }
        if start < end {
            self.dirty.push(RowRange {
                row: row as u32,
                start: start as u32,
                end: end as u32,
            });
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Waiting,
    Running,
    Swapped,
}

#[derive(Debug)]
struct Seq {
    id: SeqId,
    request: RequestId,
    tokens: Vec<u32>,
    table: BlockTable,
    /// Tokens whose KV is computed (`table.num_tokens()` after a step).
    num_computed: u32,
    /// Row in the batch while running.
    row: usize,
    /// Its request's stop token, token cap (prompt + `max_tokens`) and cache salt,
    /// copied here so `on_step_done` needs no group lookup.
    stop_token: Option<u32>,
    max_len: usize,
    salt: Option<u64>,
}

#[derive(Clone, Debug)]
struct Group {
    req: Request,
    arrival: u64,
    seqs: Vec<SeqId>,
    status: Status,
}

impl Group {
    fn key(&self, policy: QueuePolicy) -> (i64, u64) {
        match policy {
            QueuePolicy::Fcfs => (0, self.arrival),
            QueuePolicy::Priority => (-(self.req.priority as i64), self.arrival),
        }
    }
}

/// Sequences by id, without hashing: a [`SeqId`] is a slot index (low 32 bits) and
/// that slot's generation (high 32 bits), so a finished sequence's id never names the
/// slot's next occupant.
#[derive(Debug, Default)]
struct SeqSlab {
    slots: Vec<Option<Seq>>,
    generation: Vec<u32>,
    free: Vec<u32>,
    /// Per slot, beside the (larger, colder) sequences so that `on_step_done`'s
    /// validation pass reads 16 contiguous bytes per sequence: the step that last
    /// scheduled it, and the last `on_step_done` generation that named it.
    scheduled_in: Vec<u64>,
    stamp: Vec<u64>,
}

impl SeqSlab {
    fn alloc_id(&mut self) -> SeqId {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.generation.push(0);
                self.scheduled_in.push(0);
                self.stamp.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        self.generation[slot as usize] += 1;
        ((self.generation[slot as usize] as u64) << 32) | slot as u64
    }

    fn slot(&self, id: SeqId) -> Option<usize> {
        let slot = (id & 0xffff_ffff) as usize;
        (self.generation.get(slot) == Some(&((id >> 32) as u32))).then_some(slot)
    }

    fn insert(&mut self, id: SeqId, seq: Seq) {
        let slot = self.slot(id).expect("id from alloc_id");
        self.slots[slot] = Some(seq);
        self.scheduled_in[slot] = 0;
        self.stamp[slot] = 0;
    }

    fn get(&self, id: &SeqId) -> Option<&Seq> {
        self.slots[self.slot(*id)?].as_ref()
    }

    fn get_mut(&mut self, id: &SeqId) -> Option<&mut Seq> {
        let slot = self.slot(*id)?;
        self.slots[slot].as_mut()
    }

    fn remove(&mut self, id: &SeqId) -> Option<Seq> {
        let slot = self.slot(*id)?;
        let s = self.slots[slot].take()?;
        self.scheduled_in[slot] = 0;
        self.free.push(slot as u32);
        Some(s)
    }

    fn keys(&self) -> impl Iterator<Item = &SeqId> {
        self.slots.iter().filter_map(|s| s.as_ref().map(|s| &s.id))
    }
}

impl std::ops::Index<&SeqId> for SeqSlab {
    type Output = Seq;
    fn index(&self, id: &SeqId) -> &Seq {
        self.get(id).expect("live sequence")
    }
}

/// The decode scheduler; see the module docs.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    kv: KvCacheManager,
    seqs: SeqSlab,
    groups: HashMap<RequestId, Group>,
    waiting: BTreeMap<(i64, u64), RequestId>,
    running: BTreeMap<u64, RequestId>,
    swapped: BTreeMap<u64, RequestId>,
    /// Running sequences in row order.
    rows: Vec<SeqId>,
    batch: Batch,
    next_arrival: u64,
    in_step: bool,
    generation: u64,
    /// Steps planned so far (`step()` numbers the sequences it schedules with it).
    step_gen: u64,
    finished: Vec<(RequestId, SeqId, FinishReason, Vec<u32>)>,
    metrics: Metrics,
    watermark_blocks: u32,
}

impl Scheduler {
    /// A scheduler with this configuration (validated).
    pub fn new(cfg: SchedulerConfig) -> Result<Self> {
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
        if cfg.max_tokens_per_step < cfg.max_model_len as usize {
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
        let kv = KvCacheManager::new(
            cfg.num_blocks,
            cfg.num_host_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            cfg.sliding_window,
        )?;
        let watermark_blocks = (cfg.watermark * cfg.num_blocks as f64) as u32;
        let max_blocks = cfg.max_model_len.div_ceil(cfg.block_size);
        // The batch's block tables hold up to `max_num_seqs` rows of `max_blocks` i32s.
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
        Ok(Self {
            batch: Batch {
                max_blocks_per_seq: max_blocks,
                ..Batch::default()
            },
            kv,
            seqs: SeqSlab::default(),
            groups: HashMap::default(),
            waiting: BTreeMap::new(),
            running: BTreeMap::new(),
            swapped: BTreeMap::new(),
            rows: Vec::new(),
            next_arrival: 0,
            in_step: false,
            generation: 0,
            step_gen: 0,
            finished: Vec::new(),
            metrics: Metrics::default(),
            watermark_blocks,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
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

    /// The tokens of a live sequence.
    pub fn tokens(&self, seq: SeqId) -> Result<&[u32]> {
        self.seqs
            .get(&seq)
            .map(|s| s.tokens.as_slice())
            .ok_or(Error::Unknown {
                what: "sequence",
                id: seq,
            })
    }

    /// The block table of a live sequence.
    pub fn block_table(&self, seq: SeqId) -> Result<&BlockTable> {
        self.seqs.get(&seq).map(|s| &s.table).ok_or(Error::Unknown {
            what: "sequence",
            id: seq,
        })
    }

    /// Tokens whose KV is in the cache, for a live sequence.
    pub fn num_computed(&self, seq: SeqId) -> Result<u32> {
        self.seqs
            .get(&seq)
            .map(|s| s.num_computed)
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
        self.seqs.keys().copied().collect()
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

    /// Queues a request. Rejects an empty prompt, zero `max_tokens`, a duplicate id,
    /// and a request that could never run: longer than `max_model_len`, or growing to
    /// more blocks than the whole usable pool. A request accepted here finishes if the
    /// caller keeps stepping (see the module docs on liveness).
    pub fn add_request(&mut self, req: Request) -> Result<SeqId> {
        if req.prompt.is_empty() {
            return Err(Error::invalid("prompt", "must hold at least one token"));
        }
        if req.max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        if self.groups.contains_key(&req.id) {
            return Err(Error::invalid(
                "id",
                format!("request {} is already live", req.id),
            ));
        }
        let total = req.prompt.len() as u64 + req.max_tokens as u64;
        if total > self.cfg.max_model_len as u64 {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{} prompt + {} output tokens exceed max_model_len {}",
                    req.prompt.len(),
                    req.max_tokens,
                    self.cfg.max_model_len
                ),
            ));
        }
        let need = self.max_blocks(&req) as u64;
        let usable = self.kv.device().num_usable() as u64;
        if need > usable {
            return Err(Error::invalid(
                "prompt",
                format!("needs {need} blocks, the pool holds {usable}: it could never run"),
            ));
        }
        let seq = self.seqs.alloc_id();
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        self.seqs.insert(
            seq,
            Seq {
                id: seq,
                request: req.id,
                tokens: {
                    // Room for every token it may generate: appends never reallocate.
                    let mut t = Vec::with_capacity(total as usize);
                    t.extend_from_slice(&req.prompt);
                    t
                },
                table: BlockTable::new(),
                num_computed: 0,
                row: usize::MAX,
                stop_token: req.stop_token,
                max_len: req.prompt.len() + req.max_tokens as usize,
                salt: req.cache_salt,
            },
        );
        let g = Group {
            req,
            arrival,
            seqs: vec![seq],
            status: Status::Waiting,
        };
        self.waiting.insert(g.key(self.cfg.policy), g.req.id);
        self.groups.insert(g.req.id, g);
        Ok(seq)
    }

    /// Blocks one sequence of `req` holds at its largest: all of `prompt + max_tokens`,
    /// or with a sliding window the window's blocks plus one partial block.
    fn max_blocks(&self, req: &Request) -> u32 {
        let total = req.prompt.len() as u32 + req.max_tokens;
        let mut need = self.kv.blocks_for(total);
        if let Some(w) = self.cfg.sliding_window {
            need = need.min(self.kv.blocks_for(w) + 1);
        }
        need
    }

    /// Ends a request wherever it is, freeing its blocks at once.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        if self.in_step {
            return Err(Error::InvalidState(
                "abort between step() and on_step_done()".into(),
            ));
        }
        let g = self.groups.get(&id).ok_or(Error::Unknown {
            what: "request",
            id,
        })?;
        let seqs = g.seqs.clone();
        for s in seqs {
            self.finish_seq(s, FinishReason::Aborted)?;
        }
        Ok(())
    }

    /// A new sequence in `seq`'s group sharing all its blocks (parallel sampling).
    /// The sequence must be running and between steps.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        if self.in_step {
            return Err(Error::InvalidState(
                "fork between step() and on_step_done()".into(),
            ));
        }
        let parent = self.seqs.get(&seq).ok_or(Error::Unknown {
            what: "sequence",
            id: seq,
        })?;
        let g = &self.groups[&parent.request];
        if g.status != Status::Running || self.rows.len() >= self.cfg.max_num_seqs {
            return Err(Error::InvalidState(format!(
                "sequence {seq} cannot fork now (not running, or max_num_seqs reached)"
            )));
        }
        // A preempted group is recomputed (or swapped in) whole: refuse a fork that
        // would make it too large to ever come back.
        let size = g.seqs.len() as u64 + 1;
        let blocks = size * self.max_blocks(&g.req) as u64;
        let tokens = size * (g.req.prompt.len() as u64 + g.req.max_tokens as u64);
        if blocks > self.kv.device().num_usable() as u64
            || tokens > self.cfg.max_tokens_per_step as u64
        {
            return Err(Error::invalid(
                "seq",
                format!(
                    "a group of {size} sequences would need {blocks} blocks and {tokens} prefill tokens if preempted: more than the pool or a step holds"
                ),
            ));
        }
        let table = self.kv.fork(&mut self.seqs.get_mut(&seq).unwrap().table)?;
        let child_id = self.seqs.alloc_id();
        let parent = &self.seqs[&seq];
        let child = Seq {
            id: child_id,
            request: parent.request,
            tokens: parent.tokens.clone(),
            table,
            num_computed: parent.num_computed,
            row: usize::MAX,
            stop_token: parent.stop_token,
            max_len: parent.max_len,
            salt: parent.salt,
        };
        let id = child.id;
        let request = child.request;
        self.seqs.insert(id, child);
        self.groups.get_mut(&request).unwrap().seqs.push(id);
        self.push_row(id);
        Ok(id)
    }

    fn write_row(&mut self, row: usize, seq: SeqId) {
        let w = self.batch.max_blocks_per_seq as usize;
        let s = &self.seqs[&seq];
        let r = &mut self.batch.block_tables[row * w..(row + 1) * w];
        let blocks = s.table.blocks();
        for (dst, b) in r.iter_mut().zip(blocks) {
            *dst = *b as i32;
        }
        for dst in r[blocks.len().min(w)..].iter_mut() {
            *dst = NULL_BLOCK as i32;
        }
        self.batch.context_lens[row] = s.table.num_tokens() as i32;
        self.batch.mark_dirty(row, 0, w);
    }

    fn push_row(&mut self, seq: SeqId) {
        let row = self.rows.len();
        self.rows.push(seq);
        let w = self.batch.max_blocks_per_seq as usize;
        self.batch
            .block_tables
            .resize((row + 1) * w, NULL_BLOCK as i32);
        self.batch.context_lens.resize(row + 1, 0);
        self.seqs.get_mut(&seq).unwrap().row = row;
        self.write_row(row, seq);
    }

    fn remove_row(&mut self, seq: SeqId) {
        let row = self.seqs[&seq].row;
        let last = self.rows.len() - 1;
        let w = self.batch.max_blocks_per_seq as usize;
        if row != last {
            let moved = self.rows[last];
            self.rows[row] = moved;
            self.batch
                .block_tables
                .copy_within(last * w..(last + 1) * w, row * w);
            self.batch.context_lens[row] = self.batch.context_lens[last];
            self.seqs.get_mut(&moved).unwrap().row = row;
            self.batch.mark_dirty(row, 0, w);
        }
        self.rows.pop();
        self.batch.block_tables.truncate(last * w);
        self.batch.context_lens.truncate(last);
        self.seqs.get_mut(&seq).unwrap().row = usize::MAX;
    }

    fn finish_seq(&mut self, seq: SeqId, why: FinishReason) -> Result<()> {
        let request = self.seqs[&seq].request;
        let status = self.groups[&request].status;
        if status == Status::Running {
            self.remove_row(seq);
        }
        let mut s = self.seqs.remove(&seq).unwrap();
        self.kv.free(&mut s.table)?;
        self.finished.push((request, seq, why, s.tokens));
        let g = self.groups.get_mut(&request).unwrap();
        g.seqs.retain(|&x| x != seq);
        if g.seqs.is_empty() {
            let g = self.groups.remove(&request).unwrap();
            match g.status {
                Status::Waiting => {
                    self.waiting.remove(&g.key(self.cfg.policy));
                }
                Status::Running => {
                    self.running.remove(&g.arrival);
                }
                Status::Swapped => {
                    self.swapped.remove(&g.arrival);
                }
            }
        }
        Ok(())
    }

    /// Preempts running group `id`: swap if asked and the host pool has room, else
    /// recompute.
    fn preempt(&mut self, id: RequestId) -> Result<()> {
        let g = &self.groups[&id];
        let mode = g.req.preemption.unwrap_or(self.cfg.preemption);
        let seqs = g.seqs.clone();
        let arrival = g.arrival;
        for &s in &seqs {
            self.remove_row(s);
        }
        self.running.remove(&arrival);
        let mut done = false;
        if mode == PreemptionMode::Swap {
            let mut tables: Vec<BlockTable> = seqs
                .iter()
                .map(|s| std::mem::take(&mut self.seqs.get_mut(s).unwrap().table))
                .collect();
            let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
            let before = self.batch.swap_out.len();
            if self
                .kv
                .swap_out(&mut refs, &mut self.batch.swap_out)
                .is_ok()
            {
                done = true;
                self.metrics.preempted_swap += 1;
                self.metrics.swapped_out_blocks += (self.batch.swap_out.len() - before) as u64;
                self.swapped.insert(arrival, id);
                self.groups.get_mut(&id).unwrap().status = Status::Swapped;
                self.batch.preempted.push((id, PreemptionMode::Swap));
            }
            for (s, t) in seqs.iter().zip(tables) {
                self.seqs.get_mut(s).unwrap().table = t;
            }
        }
        if !done {
            for &s in &seqs {
                let seq = self.seqs.get_mut(&s).unwrap();
                self.kv.free(&mut seq.table)?;
                seq.num_computed = 0;
            }
            self.metrics.preempted_recompute += 1;
            let g = self.groups.get_mut(&id).unwrap();
            g.status = Status::Waiting;
            let key = g.key(self.cfg.policy);
            self.waiting.insert(key, id);
            self.batch.preempted.push((id, PreemptionMode::Recompute));
        }
        Ok(())
    }

    /// Free blocks the next decode of every sequence of group `id` takes, exactly
    /// (forks sharing a partial block copy it all but one).
    fn group_append_cost(&self, id: RequestId) -> Result<u32> {
        let seqs = &self.seqs;
        self.kv
            .group_append_cost(self.groups[&id].seqs.iter().map(move |s| &seqs[s].table))
    }

    /// An upper bound of the free blocks the next decode of every running sequence
    /// takes.
    fn rows_append_cost(&self) -> Result<u32> {
        self.rows
            .iter()
            .map(|s| self.kv.append_cost(&self.seqs[s].table))
            .sum()
    }

    /// The watermark admission and swap-in keep free, which applies only while some
    /// sequence runs: a group alone may use the whole pool (nothing else can need the
    /// headroom), so every request `add_request` accepts can run.
    fn watermark_now(&self) -> u32 {
        if self.rows.is_empty() {
            0
        } else {
            self.watermark_blocks
        }
    }

    /// Plans and returns the next step's batch; see the module docs. Call
    /// [`on_step_done`](Self::on_step_done) with the sampled tokens before the next step.
    pub fn step(&mut self) -> Result<&Batch> {
        if self.in_step {
            return Err(Error::InvalidState(
                "step() called again before on_step_done()".into(),
            ));
        }
        self.step_gen += 1;
        let b = &mut self.batch;
        b.mark_dirty(0, 0, 0); // starts a new list if the last one was handed out
        b.seqs.clear();
        b.slot_mapping.clear();
        b.copies.clear();
        b.swap_out.clear();
        b.swap_in.clear();
        b.preempted.clear();

        // 1. Room for every running sequence's next token, oldest groups first.
        // Each sequence takes at most one block: only a nearly full pool needs the
        // exact count (so the steady state skips this pass).
        let mut reserved = self.rows.len() as u32;
        if reserved > self.kv.device().num_free() {
            reserved = self.rows_append_cost()?;
        }
        if reserved > self.kv.device().num_free() {
            let order: Vec<(u64, RequestId)> = self.running.iter().map(|(a, r)| (*a, *r)).collect();
            reserved = 0;
            for (arrival, id) in order {
                if !self.running.contains_key(&arrival) {
                    continue; // preempted already in this loop
                }
                // Exact, so the oldest group (reserved = 0) never preempts itself: alone,
                // its next tokens fit the pool (`add_request` and `fork` see to that).
                let cost = self.group_append_cost(id)?;
                while reserved + cost > self.kv.device().num_free() {
                    let (&newest, &victim) = self.running.last_key_value().unwrap();
                    self.preempt(victim)?;
                    if newest == arrival {
                        break;
                    }
                }
                if self.running.contains_key(&arrival) {
                    reserved += cost;
                }
            }
        }
        let preempted_now = !self.batch.preempted.is_empty();
        // Blocks step 3 will take for the running sequences (swap-ins come after them):
        // the upper bound unless the swapped queue needs the exact count.
        if !self.swapped.is_empty() {
            reserved = self.rows_append_cost()?;
        }

        // 2. Swap in, oldest first, above the watermark (when others run), when nobody
        // was preempted.
        if !preempted_now {
            while let Some((&arrival, &id)) = self.swapped.first_key_value() {
                let seqs = self.groups[&id].seqs.clone();
                if self.rows.len() + seqs.len() > self.cfg.max_num_seqs {
                    break;
                }
                let mut tables: Vec<BlockTable> = seqs
                    .iter()
                    .map(|s| std::mem::take(&mut self.seqs.get_mut(s).unwrap().table))
                    .collect();
                // Its blocks, plus what this step's decode slots take after the swap-in
                // (exact: a group that fits the pool alone always comes back).
                let append = self.kv.group_append_cost(tables.iter());
                let mut refs: Vec<&mut BlockTable> = tables.iter_mut().collect();
                let cost = match (&append, self.kv.swap_in_cost(&refs)) {
                    (Ok(a), Ok(c)) => Some(a + c),
                    _ => None,
                };
                let before = self.batch.swap_in.len();
                let ok = cost.is_some_and(|c| {
                    c + reserved + self.watermark_now() <= self.kv.device().num_free()
                }) && self.kv.swap_in(&mut refs, &mut self.batch.swap_in).is_ok();
                self.metrics.swapped_in_blocks += (self.batch.swap_in.len() - before) as u64;
                // The tables go back before any error returns.
                for (s, t) in seqs.iter().zip(tables) {
                    self.seqs.get_mut(s).unwrap().table = t;
                }
                let append = append?;
                if !ok {
                    break;
                }
                reserved += append;
                self.swapped.remove(&arrival);
                self.running.insert(arrival, id);
                self.groups.get_mut(&id).unwrap().status = Status::Running;
                for s in seqs {
                    self.push_row(s);
                }
            }
        }

        // 3. Decode slots for every running sequence, in row order.
        let w = self.batch.max_blocks_per_seq as usize;
        let ahead = prefetch_distance(self.rows.len());
        for row in 0..self.rows.len() {
            let id = self.rows[row];
            // The last block entry of a sequence a few rows ahead (a cache miss
            // otherwise, at large batches).
            if let Some(ahead) = self.rows.get(row.saturating_add(ahead))
                && let Some(q) = self.seqs.get(ahead)
            {
                let b = q.table.blocks();
                prefetch(b.as_ptr().wrapping_add(b.len().saturating_sub(1)));
            }
            self.seqs.scheduled_in[(id & 0xffff_ffff) as usize] = self.step_gen;
            let seq = self.seqs.get_mut(&id).unwrap();
            let start = seq.table.num_tokens();
            let offset = self.batch.slot_mapping.len() as u32;
            if let Some(slot) = self.kv.append_in_place(&mut seq.table) {
                // The common case: a slot in the partial last block; the row is as is.
                self.batch.slot_mapping.push(slot);
            } else {
                let before = seq.table.blocks().len();
                let live_before = seq.table.first_live() as usize;
                let copies_before = self.batch.copies.len();
                let slot = self
                    .kv
                    .append_slot(&mut seq.table, &mut self.batch.copies)?;
                self.batch.slot_mapping.push(slot);
                // Only entries that changed: a new (or copied-on-write) last block,
                // and the entries a sliding window released.
                let blocks = seq.table.blocks();
                let last = blocks.len() - 1;
                if (blocks.len() != before || self.batch.copies.len() != copies_before) && last < w
                {
                    self.batch.block_tables[row * w + last] = blocks[last] as i32;
                    self.batch.mark_dirty(row, last, last + 1);
                }
                let live = (seq.table.first_live() as usize).min(w);
                if live > live_before {
                    self.batch.block_tables[row * w + live_before..row * w + live]
                        .fill(NULL_BLOCK as i32);
                    self.batch.mark_dirty(row, live_before, live);
                }
            }
            self.batch.context_lens[row] = (start + 1) as i32;
            self.batch.seqs.push(ScheduledSeq {
                seq: id,
                request: seq.request,
                is_prefill: false,
                start_pos: start,
                num_new_tokens: 1,
                context_len: start + 1,
                token_offset: offset,
            });
        }

        // 4. Admit waiting groups.
        let mut budget = self.cfg.max_tokens_per_step.saturating_sub(self.rows.len());
        while let Some((&key, &id)) = self.waiting.first_key_value() {
            let seqs = self.groups[&id].seqs.clone();
            if self.rows.len() + seqs.len() > self.cfg.max_num_seqs {
                break;
            }
            let salt = self.groups[&id].req.cache_salt;
            let (mut tokens_needed, mut blocks_needed) = (0usize, 0u32);
            for s in &seqs {
                let t = &self.seqs[s].tokens;
                if seqs.len() == 1 {
                    let (hits, _) = self.kv.count_prefix_hits(t, salt);
                    tokens_needed += t.len() - (hits * self.cfg.block_size) as usize;
                    blocks_needed += self.kv.prefill_cost(t, salt);
                } else {
                    // One fork's allocations may evict the cached blocks another
                    // counted on: assume no hits (an upper bound).
                    let n = t.len() as u32;
                    tokens_needed += t.len();
                    blocks_needed += self.kv.blocks_for(n) - self.kv.dead_blocks(n);
                }
            }
            if tokens_needed > budget
                || blocks_needed + self.watermark_now() > self.kv.device().num_free()
            {
                break;
            }
            budget -= tokens_needed;
            self.waiting.remove(&key);
            let arrival = self.groups[&id].arrival;
            self.running.insert(arrival, id);
            self.groups.get_mut(&id).unwrap().status = Status::Running;
            for s in seqs {
                self.seqs.scheduled_in[(s & 0xffff_ffff) as usize] = self.step_gen;
                let seq = self.seqs.get_mut(&s).unwrap();
                let cached = self
                    .kv
                    .allocate_prefill(&mut seq.table, &seq.tokens, salt)?;
                self.metrics.prefix_queried_tokens += seq.tokens.len() as u64;
                self.metrics.prefix_hit_tokens += cached as u64;
                let n = seq.tokens.len() as u32;
                let offset = self.batch.slot_mapping.len() as u32;
                for pos in cached..n {
                    self.batch.slot_mapping.push(self.kv.slot(&seq.table, pos)?);
                }
                let request = seq.request;
                self.push_row(s);
                self.batch.seqs.push(ScheduledSeq {
                    seq: s,
                    request,
                    is_prefill: true,
                    start_pos: cached,
                    num_new_tokens: n - cached,
                    context_len: n,
                    token_offset: offset,
                });
            }
        }

        // Decodes were pushed in row order and admissions appended rows in push order,
        // so the batch lists sequences in row order.
        debug_assert!(
            self.batch
                .seqs
                .iter()
                .zip(&self.rows)
                .all(|(q, r)| q.seq == *r)
        );

        let rows = self.rows.len() as u32;
        self.batch.dirty.retain(|r| r.row < rows);
        self.batch.dirty_sent = true;
        self.in_step = !self.batch.seqs.is_empty();
        self.update_metrics();
        Ok(&self.batch)
    }

    fn update_metrics(&mut self) {
        let m = &mut self.metrics;
        m.steps += 1;
        let pool = self.kv.device();
        m.blocks_used = pool.num_used();
        m.blocks_free = pool.num_free();
        m.blocks_cached_free = pool.num_cached_free();
        m.kv_utilization = if m.blocks_used == 0 {
            0.0
        } else {
            pool.held_fill() as f64 / (m.blocks_used as f64 * self.cfg.block_size as f64)
        };
        m.running = self.running.len();
        m.waiting = self.waiting.len();
        m.swapped = self.swapped.len();
    }

    /// Takes the token sampled for every sequence of the last step. Every scheduled
    /// sequence must appear exactly once; otherwise nothing changes and an error says
    /// which. Returns the sequences that finished (their blocks are already free).
    pub fn on_step_done(&mut self, sampled: &[(SeqId, u32)]) -> Result<Vec<(SeqId, FinishReason)>> {
        if !self.in_step {
            return Err(Error::InvalidState("on_step_done() without a step".into()));
        }
        // Validate first (no state changes on error). Duplicates are found by stamping
        // each sequence with this call's generation: no allocation per step.
        self.generation += 1;
        let generation = self.generation;
        for &(s, _) in sampled {
            let slot = self.seqs.slot(s).ok_or(Error::Unknown {
                what: "sequence",
                id: s,
            })?;
            // A removed sequence's slot is never `scheduled_in` this step, so the
            // sequence itself is read only on the error path.
            if self.seqs.scheduled_in[slot] != self.step_gen {
                if self.seqs.slots[slot].is_none() {
                    return Err(Error::Unknown {
                        what: "sequence",
                        id: s,
                    });
                }
                return Err(Error::invalid(
                    "sampled",
                    format!("sequence {s} was not scheduled"),
                ));
            }
            if self.seqs.stamp[slot] == generation {
                return Err(Error::invalid(
                    "sampled",
                    format!("sequence {s} appears twice"),
                ));
            }
            self.seqs.stamp[slot] = generation;
        }
        if sampled.len() != self.batch.seqs.len() {
            return Err(Error::invalid(
                "sampled",
                format!(
                    "{} tokens for {} scheduled sequences",
                    sampled.len(),
                    self.batch.seqs.len()
                ),
            ));
        }
        self.in_step = false;
        // Apply in order; the sequences that finish are freed after the loop (their
        // blocks' prefix-cache registrations, deferred and batched, come first).
        let mut done = Vec::new();
        let mut result = Ok(());
        let ahead = prefetch_distance(sampled.len());
        for (k, &(s, tok)) in sampled.iter().enumerate() {
            // The tail of a sequence a few ahead, whose token append would otherwise
            // wait for a cache miss.
            if let Some(ahead) = sampled.get(k.saturating_add(ahead))
                && let Some(q) = self.seqs.get(&ahead.0)
            {
                prefetch_write(q.tokens.as_ptr_range().end);
            }
            let seq = self.seqs.get_mut(&s).unwrap();
            seq.num_computed = seq.table.num_tokens();
            // Only a sequence that filled a block has anything to commit (1 in 16).
            if self.kv.has_uncommitted(&seq.table)
                && let Err(e) = self
                    .kv
                    .commit_deferred(&mut seq.table, &seq.tokens, seq.salt)
            {
                result = Err(e);
                break;
            }
            seq.tokens.push(tok);
            let why = if seq.stop_token == Some(tok) {
                Some(FinishReason::Stop)
            } else if seq.tokens.len() >= seq.max_len {
                Some(FinishReason::MaxTokens)
            } else {
                None
            };
            if let Some(why) = why {
                done.push((s, why));
            }
        }
        self.kv.flush_commits();
        result?;
        for &(s, why) in &done {
            self.finish_seq(s, why)?;
        }
        Ok(done)
    }
}
