//! Appends and sharing: `fork` shares every block of a table; an append gives the
//! next position a slot, copying a shared partial last block first (copy-on-write)
//! and releasing the blocks a sliding window leaves behind.
//!
//! * A sequence writes only into a block it holds alone: `append_slot` copies a shared
//!   partial last block and reports the `(src, dst)` pair for `copy_blocks`; the last
//!   sharer to append keeps the original. Full blocks are never written again.
//! * [`KvCacheManager::append_cost`] (an upper bound for forks) and
//!   [`KvCacheManager::group_append_cost`] (exact for a whole group) count the free
//!   device blocks appends take, so the scheduler can make room before it appends.
//! * The common append (a slot in a partial last block held alone, no window) is
//!   `append_in_place`: inline, reading no heap memory.
//!
//! # The sliding window's release rule
//! The query at position `p` attends to positions `p + 1 - w ..= p`. Every position a
//! step appends is a query of that step, and the kernels read the keys of all of them
//! at once, so the blocks a step may release are those wholly before the window of
//! its *first* new position, the table's `num_tokens` before the step
//! ([`KvCacheManager::dead_before`]): [`KvCacheManager::slide_window`] releases them,
//! and every append ([`append_slot`](KvCacheManager::append_slot), one position, a
//! decode; [`append_chunk`](KvCacheManager::append_chunk), a chunk of a prefill)
//! slides first. A chunk keeps every block its first query still sees; what it leaves
//! behind goes at the sequence's next step. (Releasing by the *last* new position
//! freed blocks the chunk's earlier queries still read: their rows came out NaN.) A
//! scheduler slides every running table at the start of a step, before it counts the
//! free blocks the step's appends take.

use super::{BlockTable, KvCacheManager, Location};
use crate::block::pool::{BlockId, NULL_BLOCK};
use crate::error::{Error, Result};

impl KvCacheManager {
    /// Free device blocks the next [`append_slot`](Self::append_slot) of `t` takes: 1
    /// when its last block is full (or it has none) or is shared (copy-on-write), else
    /// 0. For a swapped-out table, what its first append after a swap-in takes. An
    /// upper bound for the forks of one group: the last of the sharers of a partial
    /// block to append writes in place ([`group_append_cost`](Self::group_append_cost)
    /// is exact).
    pub fn append_cost(&self, t: &BlockTable) -> Result<u32> {
        self.check(t)?;
        Ok(self.append_cost_of(t))
    }

    /// [`append_cost`](Self::append_cost) of a table known to be this manager's.
    fn append_cost_of(&self, t: &BlockTable) -> u32 {
        if t.num_tokens.is_multiple_of(self.block_size) {
            return 1;
        }
        (self.shared_partial_last(t).is_some()) as u32
    }

    /// The partial last block of `t` and its reference count, when it is shared.
    fn shared_partial_last(&self, t: &BlockTable) -> Option<(BlockId, u32)> {
        if t.num_tokens.is_multiple_of(self.block_size) {
            return None;
        }
        let last = *t.blocks().last()?;
        let rc = match t.location {
            Location::Device if !t.last_maybe_shared => return None,
            Location::Device => self.device.rc(last),
            Location::Host => self.host.rc(last),
        };
        (rc > 1).then_some((last, rc))
    }

    /// Free device blocks one append to each of `tables` (in any order) takes, exactly:
    /// a fresh block for each full (or empty) last block, and a copy for each sharer of
    /// a partial last block but the last one to append, which then holds it alone.
    /// For swapped-out tables, what the appends right after their swap-in take. Pass
    /// every running sequence of a group (forks share partial blocks only within their
    /// group) for the exact count; a subset gets an upper bound.
    pub fn group_append_cost<'a, I>(&self, tables: I) -> Result<u32>
    where
        I: IntoIterator<Item = &'a BlockTable>,
        I::IntoIter: Clone,
    {
        let it = tables.into_iter();
        let mut cost = 0;
        for (i, t) in it.clone().enumerate() {
            self.check(t)?;
            if t.num_tokens.is_multiple_of(self.block_size) {
                cost += 1;
                continue;
            }
            let Some((last, rc)) = self.shared_partial_last(t) else {
                continue;
            };
            let same = |o: &BlockTable| {
                o.location == t.location
                    && !o.num_tokens.is_multiple_of(self.block_size)
                    && o.blocks().last() == Some(&last)
            };
            // Count each shared block once, at its first sharer in `tables`.
            if it.clone().take(i).any(same) {
                continue;
            }
            let sharers = it.clone().filter(|o| same(o)).count() as u32;
            cost += sharers.min(rc - 1);
        }
        Ok(cost)
    }

    /// Gives position `num_tokens` of `t` a slot and returns it: a step that appends
    /// one position (a decode). Allocates only when the last block is full; copies a
    /// shared partial last block first and pushes the `(src, dst)` pair onto `copies`.
    /// With a sliding window, first releases the blocks wholly before the new
    /// position's window (see the module docs). On error (the pool is out of blocks)
    /// those releases stay done (they were due) and nothing else changes.
    ///
    /// A step that appends several positions whose queries run together (a chunk of a
    /// prefill) is [`append_chunk`](Self::append_chunk): appending them one by one
    /// would release blocks the chunk's first queries still read.
    pub fn append_slot(&mut self, t: &mut BlockTable, copies: &mut Vec<(u32, u32)>) -> Result<i64> {
        self.check_appendable(t)?;
        self.slide(t);
        self.push_slot(t, copies)
    }

    /// Gives the next `n` positions of `t` slots in one step (a chunk of a prefill,
    /// whose queries attend together), pushing each slot onto `slots`: with a sliding
    /// window, first releases only the blocks wholly before the window of the first
    /// of them (see the module docs), then appends as [`append_slot`](Self::append_slot)
    /// does. On error (the pool runs out) the positions appended so far keep their
    /// slots (their slots are pushed) and the error is returned.
    pub fn append_chunk(
        &mut self,
        t: &mut BlockTable,
        n: u32,
        copies: &mut Vec<(u32, u32)>,
        slots: &mut Vec<i64>,
    ) -> Result<()> {
        self.check_appendable(t)?;
        self.slide(t);
        for _ in 0..n {
            slots.push(self.push_slot(t, copies)?);
        }
        Ok(())
    }

    /// Undoes the appends of the current step to device table `t` from position
    /// `keep` on: `t` held `start` tokens before the step (`start <= keep <=
    /// num_tokens`), and the positions from `keep` on were speculative tokens a
    /// verifier rejected. Blocks wholly past `keep` go back to the head of the free
    /// queue, hash-less (a cached block the step evicted for them stays evicted: the
    /// step wrote into it); when `keep == start`
    /// and the step copied a shared partial last block (its pair is in `copies`), the
    /// table takes the shared block back and the copy is returned. Call it before
    /// anything else changes the pool after the step, tables in the reverse order of
    /// their appends, for the pool to be exactly as before those appends (the queue
    /// order included).
    ///
    /// Nothing past `keep` was ever named: a step's commits for appended positions
    /// wait for the tokens (`on_step_done`), so no rejected token is in the prefix
    /// cache.
    pub(crate) fn truncate_appended(
        &mut self,
        t: &mut BlockTable,
        start: u32,
        keep: u32,
        copies: &[(u32, u32)],
    ) -> Result<()> {
        self.check_appendable(t)?;
        let (bs, old) = (self.block_size, t.num_tokens);
        if !(start <= keep && keep <= old) {
            return Err(Error::invalid(
                "keep",
                format!("{keep} tokens of a table that held {start} before the step and {old} now"),
            ));
        }
        if keep == old {
            return Ok(());
        }
        debug_assert!(
            t.entries.num_hashes() <= (keep / bs) as usize,
            "a rejected position was named"
        );
        let target = self.blocks_for(keep) as usize;
        for i in (target..t.num_blocks()).rev() {
            let b = t.blocks()[i];
            self.device.unallocate(b, Self::fill_of(bs, old, i));
            t.entries.pop_block();
        }
        if target > 0 {
            // The kept last block loses the rejected positions it held.
            let i = target - 1;
            let dropped = Self::fill_of(bs, old, i) - Self::fill_of(bs, keep, i);
            self.device.sub_fill(dropped);
        }
        t.num_tokens = keep;
        if keep == start && !keep.is_multiple_of(bs) {
            let i = target - 1;
            let b = t.blocks()[i];
            if let Some(&(src, _)) = copies.iter().rev().find(|&&(_, dst)| dst == b) {
                // The copy-on-write is undone: the shared block is this table's again
                // (its other sharers hold it, so it is live).
                self.device.share(src);
                self.device.unallocate(b, keep % bs);
                t.blocks_mut()[i] = src;
                t.last_maybe_shared = true;
            }
        }
        t.last = t.blocks().last().copied().unwrap_or(0);
        if t.num_blocks() == 0 {
            t.owner = 0;
        }
        Ok(())
    }

    /// [`Error::InvalidArgument`] for a table of another manager, [`Error::InvalidState`]
    /// for a swapped-out one.
    fn check_appendable(&self, t: &BlockTable) -> Result<()> {
        self.check(t)?;
        if t.location != Location::Device {
            return Err(Error::InvalidState("append to a swapped-out table".into()));
        }
        Ok(())
    }

    /// The append of one position to a checked device table, the window left as is.
    fn push_slot(&mut self, t: &mut BlockTable, copies: &mut Vec<(u32, u32)>) -> Result<i64> {
        let bs = self.block_size;
        let pos = t.num_tokens;
        let b = if pos.is_multiple_of(bs) {
            let b = self.device.allocate()?;
            t.entries.push_block(b);
            b
        } else {
            // A partial last block: this table has one.
            let i = t.num_blocks() - 1;
            let last = t.blocks()[i];
            if t.last_maybe_shared && self.device.rc(last) > 1 {
                let dst = self.device.allocate()?;
                self.device.add_fill(pos % bs);
                copies.push((last, dst));
                self.device.release(last, pos % bs);
                t.blocks_mut()[i] = dst;
                dst
            } else {
                last
            }
        };
        t.owner = self.id;
        t.last_maybe_shared = false;
        t.num_tokens = pos + 1;
        self.device.add_fill(1);
        t.last = b;
        Ok(b as i64 * bs as i64 + (pos % bs) as i64)
    }

    /// [`append_slot`](Self::append_slot) in its common case, inline: a device table
    /// of this manager whose partial last block it holds alone (no allocation, no
    /// copy, no window). `None`, changing nothing, for every other case.
    #[inline]
    pub(crate) fn append_in_place(&mut self, t: &mut BlockTable) -> Option<i64> {
        let pos = t.num_tokens;
        let off = pos & self.block_mask;
        if off == 0
            || self.block_mask == 0
            || t.last_maybe_shared
            || (self.windowed >> (t.group & 63)) & 1 != 0
            || t.owner != self.id
            || t.location != Location::Device
        {
            return None;
        }
        let b = t.last;
        debug_assert_eq!(t.blocks().last(), Some(&b), "stale last block");
        t.num_tokens = pos + 1;
        self.device.add_fill(1);
        Some(b as i64 * self.block_size as i64 + off as i64)
    }

    /// Releases the blocks of device table `t` wholly before the sliding window of its
    /// next position (`num_tokens`, the first its next step appends; entries become
    /// [`NULL_BLOCK`]), and returns how many entries it released. Idempotent until the
    /// table grows; does nothing without a window or for a swapped-out table. Errors
    /// on a table of another manager.
    pub fn slide_window(&mut self, t: &mut BlockTable) -> Result<u32> {
        self.check(t)?;
        if t.location != Location::Device {
            return Ok(0);
        }
        let before = t.first_live;
        self.slide(t);
        Ok(t.first_live - before)
    }

    /// [`slide_window`](Self::slide_window) of a checked device table.
    fn slide(&mut self, t: &mut BlockTable) {
        let dead = self.dead_before(t.group as usize, t.num_tokens);
        while t.first_live < dead {
            let i = t.first_live as usize;
            if t.blocks()[i] != NULL_BLOCK {
                self.device.release(t.blocks()[i], self.block_size);
                t.blocks_mut()[i] = NULL_BLOCK;
            }
            t.first_live += 1;
        }
    }

    /// A new table sharing every block of `t` (each `ref_cnt` + 1): the only way to
    /// copy a table. Errors on a table of another manager or swapped out.
    pub fn fork(&mut self, t: &mut BlockTable) -> Result<BlockTable> {
        self.check(t)?;
        if t.location != Location::Device {
            return Err(Error::InvalidState("fork of a swapped-out table".into()));
        }
        for &b in t.blocks() {
            self.device.share(b);
        }
        t.last_maybe_shared = true;
        Ok(t.duplicate())
    }
}
