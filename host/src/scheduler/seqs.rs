//! The scheduler's private bookkeeping: live sequences in a slab addressed by their
//! ids, and the sequence groups they belong to.
//!
//! A [`SeqId`] names a slab slot and that slot's generation, so a finished sequence's
//! id does not name its slot's next occupant: looking it up afterwards finds nothing.
//! A group lists its live sequences; a sequence's `row` is its block-table row while
//! its group runs (`usize::MAX` otherwise).
//!
//! Each slot has three records, each in a dense array of its own: a step record
//! ([`Seq`]: its request and block table, one cache line), a hot one ([`Hot`]: two
//! lines, its tokens and counters) and a cold one ([`Cold`]: its request's settings
//! and its row). A step's common decode touches the step record alone, and
//! `on_step_done` the hot record alone (and the batch's dense row ids and counts);
//! a commit adds the step record and the salt. With thousands of sequences the
//! records do not stay in the core's caches from one half of a cycle to the other,
//! and the bytes a cycle reads per sequence (a record of two lines is read whole even
//! when one is needed: the hardware fetches lines in pairs and streams), and above all
//! the lines it touches out of order, are what it costs.

use allocator_api2::vec::Vec as AVec;

use super::tokens::History;
use super::{QueuePolicy, Request, RequestId, SeqId};
use crate::block::BlockTable;
use crate::mem::{SeqAlloc, prefetch};

/// Where a sequence group is: which of the scheduler's queues holds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Waiting,
    Running,
    Swapped,
}

/// One live sequence's step record: its request and its block table, in one
/// 64-byte cache line (its slot's; a dense array of them is what a step's decode loop
/// walks). Its request's settings and its row are in its [`Cold`] record, its tokens
/// and counters in its [`Hot`] one.
///
/// `Option<Seq>` is one line too (the table holds its niche): a slot's liveness is
/// read from the same line.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct Seq {
    pub(super) request: RequestId,
    pub(super) table: BlockTable,
}

const _: () = assert!(
    size_of::<Option<Seq>>() == 64,
    "a step record is one cache line"
);

/// A slot's cold record: its request's settings and its batch row, which neither
/// half of a cycle reads for a common decode (a commit reads the salt).
#[derive(Clone, Copy, Debug)]
pub(super) struct Cold {
    /// Its request's cache salt.
    pub(super) salt: Option<u64>,
    /// Tokens its current prefill computes (`tokens.len()` when it was last
    /// admitted); while `table.num_tokens()` is below it (and the table is not empty),
    /// it is mid-prefill: chunked prefill runs the rest in later steps.
    pub(super) prefill_end: u32,
    /// Its request's token cap (prompt + `max_tokens`, at most `max_model_len`).
    pub(super) max_len: u32,
    /// Row in the batch while running (`usize::MAX` otherwise).
    pub(super) row: usize,
    /// Draft tokens the engine asks to verify in each of its decode steps
    /// ([`Scheduler::set_lookahead`](super::Scheduler::set_lookahead)); 0: plain
    /// decodes.
    pub(super) lookahead: u32,
}

impl Cold {
    /// The record of a sequence not yet admitted (nothing to prefill, no row).
    pub(super) fn new(salt: Option<u64>, max_len: u32) -> Self {
        Self {
            salt,
            prefill_end: 0,
            max_len,
            row: usize::MAX,
            lookahead: 0,
        }
    }

    /// Whether a sequence whose table holds `num_tokens` is mid-prefill: some but not
    /// all of its prefill's tokens have slots (chunked prefill). A waiting sequence
    /// (empty table) is not.
    pub(super) fn is_prefilling(&self, num_tokens: u32) -> bool {
        num_tokens > 0 && num_tokens < self.prefill_end
    }
}

/// A slot's hot record: everything `on_step_done` needs for a sequence in the common
/// case besides its batch row's id and count, in two cache lines: its tokens (their
/// `Vec`'s header and the pending ones, so an append writes only this record; see
/// [`History`]) and its counters.
///
/// `commit_at` is a copy of the step record's state (its table's), which
/// [`SeqSlab::set_commit_at`] sets whenever the table's hashes may change (every
/// whole-row write: admission, swap-in, fork, a chunk; and every commit): exact for
/// every running sequence (debug builds check it in `on_step_done`). The rest is the
/// record's own state, kept nowhere else.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct Hot {
    /// Its tokens (empty for a free slot).
    pub(super) tokens: History,
    /// The `num_tokens` from which a block of the table is full and not yet
    /// committed to the prefix cache: `KvCacheManager::commit_at` (`u32::MAX`: never).
    pub(super) commit_at: u32,
    /// Tokens whose KV is computed (`table.num_tokens()` after a step).
    pub(super) num_computed: u32,
    /// Tokens it may still append before reaching `Cold::max_len` (0: at or past it).
    pub(super) left: u32,
    /// Its request's stop token.
    pub(super) stop: Option<u32>,
}

const _: () = assert!(size_of::<Hot>() == 128, "a hot record is two cache lines");

impl Hot {
    /// The record of a sequence capped at `max_len` tokens with `tokens` and its
    /// request's `stop` token, nothing computed, not yet running (`commit_at` unset
    /// until `set_commit_at`).
    pub(super) fn new(max_len: u32, tokens: History, stop: Option<u32>) -> Self {
        Self {
            commit_at: u32::MAX,
            num_computed: 0,
            left: (max_len as usize).saturating_sub(tokens.len()) as u32,
            stop,
            tokens,
        }
    }

    /// A free slot's record (allocates nothing).
    fn free() -> Self {
        Self {
            tokens: History::empty(),
            commit_at: u32::MAX,
            num_computed: 0,
            left: 0,
            stop: None,
        }
    }
}

/// A sequence group: a request's sequences (its prompt's and its forks), which are
/// admitted, preempted and swapped together.
#[derive(Clone, Debug)]
pub(super) struct Group {
    pub(super) req: Request,
    pub(super) arrival: u64,
    pub(super) seqs: Vec<SeqId>,
    pub(super) status: Status,
}

/// A group's place in the waiting, running and swapped queues ([`Group::key`]).
pub(super) type GroupKey = (i64, u64);

impl Group {
    /// The group's place in the queues under `policy`, most urgent first: its arrival
    /// (FCFS), or its priority then arrival (lower priority values first, as in vLLM).
    /// Waiting groups are admitted, swapped ones swapped in, in this order, and
    /// running ones preempted in the reverse order.
    pub(super) fn key(&self, policy: QueuePolicy) -> GroupKey {
        match policy {
            QueuePolicy::Fcfs => (0, self.arrival),
            QueuePolicy::Priority => (self.req.priority as i64, self.arrival),
        }
    }
}

/// Sequences by id, without hashing: a [`SeqId`] is a slot index (low 32 bits) and
/// that slot's generation (high 32 bits), so a finished sequence's id never names the
/// slot's next occupant.
///
/// The per-slot arrays are allocated by the scheduler's arena: past 1 MiB (thousands
/// of sequences) they lie on 2 MiB pages of their own (every step walks them). The
/// 64-byte aligned ones (`slots`, `hot`) come from the global allocator until then:
/// the arena's classes serve alignments up to 16.
#[derive(Debug)]
pub(super) struct SeqSlab {
    pub(super) slots: AVec<Option<Seq>, SeqAlloc>,
    /// Per slot, its sequence's cold record (meaningful while the slot is live).
    pub(super) cold: AVec<Cold, SeqAlloc>,
    generation: AVec<u32, SeqAlloc>,
    free: Vec<u32>,
    /// Per slot, the last `on_step_done` generation that named it (for finding
    /// duplicates when `sampled` is not in the step's order).
    pub(super) stamp: AVec<u64, SeqAlloc>,
    /// Per slot, its sequence's hot record.
    pub(super) hot: AVec<Hot, SeqAlloc>,
    /// Per slot, its sequence's block tables of layer groups 1.. (group 0's is its
    /// step record's); empty for a model of one group (no allocation).
    pub(super) extra: Vec<Vec<BlockTable>>,
}

impl SeqSlab {
    /// An empty slab whose arrays `alloc` allocates (they grow as sequences come; in
    /// an arena, an array past 1 MiB moves to huge pages of its own as it grows).
    pub(super) fn new(alloc: &SeqAlloc) -> Self {
        Self {
            slots: AVec::new_in(alloc.clone()),
            cold: AVec::new_in(alloc.clone()),
            generation: AVec::new_in(alloc.clone()),
            free: Vec::new(),
            stamp: AVec::new_in(alloc.clone()),
            hot: AVec::new_in(alloc.clone()),
            extra: Vec::new(),
        }
    }

    pub(super) fn alloc_id(&mut self) -> SeqId {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.cold.push(Cold::new(None, 0));
                self.generation.push(0);
                self.stamp.push(0);
                self.hot.push(Hot::free());
                self.extra.push(Vec::new());
                (self.slots.len() - 1) as u32
            }
        };
        self.generation[slot as usize] += 1;
        ((self.generation[slot as usize] as u64) << 32) | slot as u64
    }

    pub(super) fn slot(&self, id: SeqId) -> Option<usize> {
        let slot = (id & 0xffff_ffff) as usize;
        (self.generation.get(slot) == Some(&((id >> 32) as u32))).then_some(slot)
    }

    /// Puts `seq`, its cold and hot records and its tables of layer groups 1.. in
    /// `id`'s slot.
    pub(super) fn insert(
        &mut self,
        id: SeqId,
        seq: Seq,
        cold: Cold,
        hot: Hot,
        extra: Vec<BlockTable>,
    ) {
        let slot = self.slot(id).expect("id from alloc_id");
        self.cold[slot] = cold;
        self.hot[slot] = hot;
        self.slots[slot] = Some(seq);
        self.stamp[slot] = 0;
        self.extra[slot] = extra;
    }

    /// Live sequence `id`'s block tables of layer groups 1...
    pub(super) fn extra(&self, id: SeqId) -> &[BlockTable] {
        &self.extra[self.slot(id).expect("live sequence")]
    }

    /// Live sequence `id`'s block tables, group 0's first, mutably.
    pub(super) fn tables_mut(&mut self, id: SeqId) -> (&mut BlockTable, &mut [BlockTable]) {
        let slot = self.slot(id).expect("live sequence");
        (
            &mut self.slots[slot].as_mut().expect("live sequence").table,
            &mut self.extra[slot],
        )
    }

    pub(super) fn get(&self, id: &SeqId) -> Option<&Seq> {
        self.slots[self.slot(*id)?].as_ref()
    }

    /// Live sequence `id`'s cold record.
    pub(super) fn cold(&self, id: SeqId) -> &Cold {
        let slot = self.slot(id).expect("live sequence");
        debug_assert!(self.slots[slot].is_some(), "live sequence");
        &self.cold[slot]
    }

    /// Live sequence `id`'s cold record, writable.
    pub(super) fn cold_mut(&mut self, id: SeqId) -> &mut Cold {
        let slot = self.slot(id).expect("live sequence");
        debug_assert!(self.slots[slot].is_some(), "live sequence");
        &mut self.cold[slot]
    }

    /// Whether live sequence `id` is mid-prefill (see [`Cold::is_prefilling`]).
    pub(super) fn is_prefilling(&self, id: SeqId) -> bool {
        self.cold(id).is_prefilling(self[&id].table.num_tokens())
    }

    /// Takes a live sequence out, with its tokens and its tables of groups 1...
    pub(super) fn remove(&mut self, id: &SeqId) -> Option<(Seq, History, Vec<BlockTable>)> {
        let slot = self.slot(*id)?;
        let s = self.slots[slot].take()?;
        let tokens = std::mem::replace(&mut self.hot[slot], Hot::free()).tokens;
        let extra = std::mem::take(&mut self.extra[slot]);
        self.free.push(slot as u32);
        Some((s, tokens, extra))
    }

    /// Writes live sequence `id`'s pending tokens to its `Vec`, so that
    /// [`History::as_slice`] holds them all.
    pub(super) fn flush(&mut self, id: SeqId) {
        if let Some(slot) = self.slot(id)
            && self.slots[slot].is_some()
        {
            self.hot[slot].tokens.flush();
        }
    }

    /// The tokens of live sequence `id`.
    pub(super) fn tokens(&self, id: SeqId) -> Option<&History> {
        let slot = self.slot(id)?;
        self.slots[slot].as_ref()?;
        Some(&self.hot[slot].tokens)
    }

    /// Sets live sequence `id`'s `Hot::commit_at` (the cache manager's `commit_at`
    /// of its table).
    pub(super) fn set_commit_at(&mut self, id: SeqId, commit_at: u32) {
        let slot = self.slot(id).expect("live sequence");
        self.hot[slot].commit_at = commit_at;
    }

    /// Prefetches slot `id`'s step record, what a step's decode reads and writes (a
    /// hint: no load, no check of the generation).
    #[inline]
    pub(super) fn prefetch_step(&self, id: SeqId) {
        if let Some(s) = self.slots.get((id & 0xffff_ffff) as usize) {
            prefetch(s);
        }
    }

    /// Prefetches slot `id`'s step record and its cold record's line (a hint: no
    /// load, no check of the generation), so a loop a few sequences behind finds them
    /// in cache.
    #[inline]
    pub(super) fn prefetch(&self, id: SeqId) {
        let slot = (id & 0xffff_ffff) as usize;
        if let Some(s) = self.slots.get(slot) {
            prefetch(s);
        }
        if let Some(c) = self.cold.get(slot) {
            prefetch(c);
        }
    }

    /// The ids of the live sequences.
    pub(super) fn keys(&self) -> impl Iterator<Item = SeqId> {
        self.slots
            .iter()
            .zip(self.generation.iter())
            .enumerate()
            .filter(|(_, (s, _))| s.is_some())
            .map(|(i, (_, &g))| ((g as u64) << 32) | i as u64)
    }
}

impl std::ops::Index<&SeqId> for SeqSlab {
    type Output = Seq;
    fn index(&self, id: &SeqId) -> &Seq {
        self.get(id).expect("live sequence")
    }
}
