//! The scheduler's private bookkeeping: live sequences in a slab addressed by their
//! ids, and the sequence groups they belong to.
//!
//! A [`SeqId`] names a slab slot and that slot's generation, so a finished sequence's
//! id does not name its slot's next occupant: looking it up afterwards finds nothing.
//! A group lists its live sequences; a sequence's `row` is its block-table row while
//! its group runs (`usize::MAX` otherwise).

use allocator_api2::vec::Vec as AVec;

use super::tokens::{History, Recent};
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

/// One live sequence: its tokens, its block table, and its place in the batch.
#[derive(Debug)]
pub(super) struct Seq {
    pub(super) id: SeqId,
    pub(super) request: RequestId,
    /// Its tokens; the last few pending in its slot's `SeqSlab::recent` buffer.
    pub(super) tokens: History,
    pub(super) table: BlockTable,
    /// Tokens whose KV is computed (`table.num_tokens()` after a step).
    pub(super) num_computed: u32,
    /// Tokens its current prefill computes (`tokens.len()` when it was last
    /// admitted); while `table.num_tokens()` is below it (and the table is not empty),
    /// it is mid-prefill: chunked prefill runs the rest in later steps.
    pub(super) prefill_end: u32,
    /// Row in the batch while running.
    pub(super) row: usize,
    /// Its request's stop token, token cap (prompt + `max_tokens`) and cache salt,
    /// copied here so `on_step_done` needs no group lookup.
    pub(super) stop_token: Option<u32>,
    pub(super) max_len: usize,
    pub(super) salt: Option<u64>,
}

impl Seq {
    /// Whether some but not all of its prefill's tokens have slots (chunked prefill).
    /// A waiting sequence (empty table) is not mid-prefill.
    pub(super) fn is_prefilling(&self) -> bool {
        let n = self.table.num_tokens();
        n > 0 && n < self.prefill_end
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

impl Group {
    /// The group's key in the waiting queue under `policy` (smallest first).
    pub(super) fn key(&self, policy: QueuePolicy) -> (i64, u64) {
        match policy {
            QueuePolicy::Fcfs => (0, self.arrival),
            QueuePolicy::Priority => (-(self.req.priority as i64), self.arrival),
        }
    }
}

/// Sequences by id, without hashing: a [`SeqId`] is a slot index (low 32 bits) and
/// that slot's generation (high 32 bits), so a finished sequence's id never names the
/// slot's next occupant.
///
/// The per-slot arrays are allocated by the scheduler's arena: past 1 MiB (thousands
/// of sequences) they lie on 2 MiB pages of their own (every step walks them). The
/// token buffers (`recent`, 64-byte aligned) come from the global allocator until
/// then: the arena's classes serve alignments up to 16.
#[derive(Debug)]
pub(super) struct SeqSlab {
    pub(super) slots: AVec<Option<Seq>, SeqAlloc>,
    generation: AVec<u32, SeqAlloc>,
    free: Vec<u32>,
    /// Per slot, beside the (larger, colder) sequences so that `on_step_done`'s
    /// validation pass reads 16 contiguous bytes per sequence: the step that last
    /// scheduled it, and the last `on_step_done` generation that named it.
    pub(super) scheduled_in: AVec<u64, SeqAlloc>,
    pub(super) stamp: AVec<u64, SeqAlloc>,
    /// Per slot, the pending tokens of its sequence's [`History`].
    pub(super) recent: AVec<Recent, SeqAlloc>,
}

impl SeqSlab {
    /// An empty slab whose arrays `alloc` allocates (they grow as sequences come; in
    /// an arena, an array past 1 MiB moves to huge pages of its own as it grows).
    pub(super) fn new(alloc: &SeqAlloc) -> Self {
        Self {
            slots: AVec::new_in(alloc.clone()),
            generation: AVec::new_in(alloc.clone()),
            free: Vec::new(),
            scheduled_in: AVec::new_in(alloc.clone()),
            stamp: AVec::new_in(alloc.clone()),
            recent: AVec::new_in(alloc.clone()),
        }
    }

    pub(super) fn alloc_id(&mut self) -> SeqId {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                self.generation.push(0);
                self.scheduled_in.push(0);
                self.stamp.push(0);
                self.recent.push(Recent::default());
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

    pub(super) fn insert(&mut self, id: SeqId, seq: Seq) {
        let slot = self.slot(id).expect("id from alloc_id");
        self.slots[slot] = Some(seq);
        self.scheduled_in[slot] = 0;
        self.stamp[slot] = 0;
    }

    pub(super) fn get(&self, id: &SeqId) -> Option<&Seq> {
        self.slots[self.slot(*id)?].as_ref()
    }

    pub(super) fn get_mut(&mut self, id: &SeqId) -> Option<&mut Seq> {
        let slot = self.slot(*id)?;
        self.slots[slot].as_mut()
    }

    /// Takes a live sequence out, with its tokens all flushed.
    pub(super) fn remove(&mut self, id: &SeqId) -> Option<Seq> {
        let slot = self.slot(*id)?;
        let mut s = self.slots[slot].take()?;
        s.tokens.flush(&self.recent[slot]);
        self.scheduled_in[slot] = 0;
        self.free.push(slot as u32);
        Some(s)
    }

    /// Flushes the pending tokens of live sequence `id`, so its
    /// `tokens.flushed()` is its whole history.
    pub(super) fn flush(&mut self, id: &SeqId) {
        if let Some(slot) = self.slot(*id)
            && let Some(s) = self.slots[slot].as_mut()
        {
            s.tokens.flush(&self.recent[slot]);
        }
    }

    /// Prefetches the lines of slot `id`'s sequence (a hint: no load, no check of the
    /// generation), so a loop a few sequences behind finds them in cache.
    #[inline]
    pub(super) fn prefetch(&self, id: SeqId) {
        let slot = (id & 0xffff_ffff) as usize;
        if let Some(s) = self.slots.get(slot) {
            let p = (s as *const Option<Seq>).cast::<u8>();
            let mut off = 0;
            while off < size_of::<Option<Seq>>() {
                prefetch(p.wrapping_add(off));
                off += 64;
            }
            prefetch(p.wrapping_add(size_of::<Option<Seq>>() - 1));
        }
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &SeqId> {
        self.slots.iter().filter_map(|s| s.as_ref().map(|s| &s.id))
    }
}

impl std::ops::Index<&SeqId> for SeqSlab {
    type Output = Seq;
    fn index(&self, id: &SeqId) -> &Seq {
        self.get(id).expect("live sequence")
    }
}
