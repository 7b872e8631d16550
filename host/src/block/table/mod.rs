//! [`BlockTable`] and [`KvCacheManager`]: one sequence's blocks, and every operation
//! that changes which sequence holds which block.
//!
//! # Invariants (checked by the proptests in `tests/scheduler.rs`)
//! * Every entry of a device table is [`NULL_BLOCK`] or a block whose `ref_cnt` counts
//!   it; every entry of a host (swapped) table likewise in the host pool.
//! * Token position `p < num_tokens` of a table lives in slot
//!   `blocks[p / block_size] * block_size + p % block_size`; entries before a sliding
//!   window are `NULL_BLOCK`.
//! * A sequence only ever writes into a block it holds alone: [`KvCacheManager::append_slot`]
//!   copies a shared partial last block first (copy-on-write) and reports the
//!   `(src, dst)` pair for the `copy_blocks` kernel. Full blocks are never written
//!   again, so sharing them (fork, prefix hits) is free.
//! * `hashes[i]` is the prefix-cache hash chain of full block `i`, recorded once its
//!   contents are computed ([`KvCacheManager::commit`]).
//! * Only a full block is ever shared between sequence groups (prefix hits never
//!   include a prompt's last block); a partial last block is shared only among the
//!   forks of one group, and all its sharers have it as their last block.
//!
//! # Ownership of tables
//! A [`BlockTable`] holds one reference per entry, so it is an *owning* handle:
//! * It is not `Clone`. The only copy is [`KvCacheManager::fork`], which takes the
//!   extra references; [`KvCacheManager::free`] drops them and leaves the table empty,
//!   so a second `free` of the same table frees nothing.
//! * It is bound to the manager that gave it its first block (each manager has a
//!   process-unique [`KvCacheManager::id`]); every other manager refuses it with
//!   [`Error::InvalidArgument`] (`table`). An empty table is bound to nobody.
//! * Dropping a table that still holds blocks leaks them (they stay counted as held);
//!   free it through its manager.

use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::FxHashMap as HashMap;

use super::pool::{BlockHash, BlockId, BlockPool, NULL_BLOCK, PAD_SLOT, hash_block};
use crate::error::{Error, Result};

/// Where a table's blocks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Location {
    /// In the GPU pool (the kernels can read them).
    #[default]
    Device,
    /// Swapped out to the host pool.
    Host,
}

/// One sequence's logical → physical block map: an owning handle on its blocks'
/// references (not `Clone`; see the module docs on ownership).
///
/// ```compile_fail
/// let t = pagedkv_host::block::BlockTable::new();
/// let copy = t.clone(); // a copy would free the same references twice
/// ```
#[derive(Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    /// The [`KvCacheManager::id`] of the manager whose blocks these are; 0 while empty.
    owner: u64,
    blocks: Vec<BlockId>,
    num_tokens: u32,
    hashes: Vec<BlockHash>,
    location: Location,
    first_live: u32,
    /// The last block may be shared (set by fork and swap-in): only then does an
    /// append look at its reference count for copy-on-write.
    last_maybe_shared: bool,
    /// `blocks.last()`, kept beside the counts so the common append reads no heap
    /// memory. Exact whenever `append_in_place` may use it: after `allocate_prefill`
    /// or `append_slot` (which set it), until a fork or swap sets `last_maybe_shared`
    /// or moves the table to the host.
    last: BlockId,
}

impl BlockTable {
    /// An empty table on the device, bound to no manager yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The [`KvCacheManager::id`] of the manager this table's blocks belong to; `None`
    /// for an empty table.
    pub fn owner(&self) -> Option<u64> {
        (self.owner != 0).then_some(self.owner)
    }

    /// A second handle on the same blocks; the caller takes the extra references.
    fn duplicate(&self) -> Self {
        Self {
            owner: self.owner,
            blocks: self.blocks.clone(),
            num_tokens: self.num_tokens,
            hashes: self.hashes.clone(),
            location: self.location,
            first_live: self.first_live,
            last_maybe_shared: self.last_maybe_shared,
            last: self.last,
        }
    }

    /// Physical block of each logical block.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// Token positions that have a slot.
    pub fn num_tokens(&self) -> u32 {
        self.num_tokens
    }

    /// Where the blocks live.
    pub fn location(&self) -> Location {
        self.location
    }

    /// Prefix-cache hashes of the leading full, computed blocks.
    pub fn hashes(&self) -> &[BlockHash] {
        &self.hashes
    }

    /// Leading entries a sliding window has released (all [`NULL_BLOCK`]).
    pub(crate) fn first_live(&self) -> u32 {
        self.first_live
    }
}

/// The source of [`KvCacheManager::id`]s (0 means "no manager").
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// The KV-cache manager: a device pool, a host pool for swapping, and the rules.
///
/// Not `Clone`: a copy would share its tables' identity while its counts diverge.
#[derive(Debug)]
pub struct KvCacheManager {
    id: u64,
    device: BlockPool,
    host: BlockPool,
    block_size: u32,
    /// `block_size - 1` when it is a power of two (offsets by mask), else 0.
    block_mask: u32,
    prefix_caching: bool,
    window: Option<u32>,
    scratch: HashMap<BlockId, BlockId>,
    /// Registrations [`commit_deferred`](Self::commit_deferred) left for
    /// [`flush_commits`](Self::flush_commits).
    pending: Vec<(BlockId, BlockHash)>,
}

impl KvCacheManager {
    /// A manager over `num_blocks` device blocks (block 0 is the null block) and
    /// `num_host_blocks` host blocks for swapping (0 disables swap).
    pub fn new(
        num_blocks: u32,
        num_host_blocks: u32,
        block_size: u32,
        prefix_caching: bool,
        window: Option<u32>,
    ) -> Result<Self> {
        if block_size == 0 || block_size > u16::MAX as u32 {
            return Err(Error::invalid("block_size", format!("{block_size}")));
        }
        if window == Some(0) {
            return Err(Error::invalid("sliding_window", "must be at least 1 token"));
        }
        let host = if num_host_blocks == 0 {
            BlockPool::new(1, false).map(|mut p| {
                // A pool with its only block taken: swap always finds it full.
                let _ = p.allocate();
                p
            })?
        } else {
            BlockPool::new(num_host_blocks, false)?
        };
        Ok(Self {
            id: NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed),
            device: BlockPool::new(num_blocks, true)?,
            host,
            block_size,
            block_mask: if block_size.is_power_of_two() {
                block_size - 1
            } else {
                0
            },
            prefix_caching,
            window,
            scratch: HashMap::default(),
            pending: Vec::new(),
        })
    }

    /// This manager's process-unique id; the tables it fills carry it.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// [`Error::InvalidArgument`] (`table`) unless `t` is empty or this manager's.
    fn check(&self, t: &BlockTable) -> Result<()> {
        if t.owner == self.id || (t.owner == 0 && t.blocks.is_empty()) {
            Ok(())
        } else {
            Err(Error::invalid(
                "table",
                format!(
                    "belongs to KV-cache manager {}, not to manager {}",
                    t.owner, self.id
                ),
            ))
        }
    }

    fn check_all(&self, tables: &[&mut BlockTable]) -> Result<()> {
        tables.iter().try_for_each(|t| self.check(t))
    }

    /// The device pool.
    pub fn device(&self) -> &BlockPool {
        &self.device
    }

    /// The host (swap) pool.
    pub fn host(&self) -> &BlockPool {
        &self.host
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The sliding window, if any.
    pub fn window(&self) -> Option<u32> {
        self.window
    }

    /// Slot of token position `pos` of a device table; [`PAD_SLOT`] for a position a
    /// sliding window has already released (a prefill longer than the window computes
    /// those tokens, but their K/V is never stored). Errors: a table of another manager
    /// or swapped out, a position without a slot (`pos >= num_tokens`).
    pub fn slot(&self, t: &BlockTable, pos: u32) -> Result<i64> {
        self.check(t)?;
        if t.location != Location::Device {
            return Err(Error::InvalidState("slot of a swapped-out table".into()));
        }
        if pos >= t.num_tokens {
            return Err(Error::invalid(
                "pos",
                format!("{pos}: the table has {} token slots", t.num_tokens),
            ));
        }
        let bs = self.block_size;
        let i = (pos / bs) as usize;
        if (i as u32) < t.first_live {
            return Ok(PAD_SLOT);
        }
        Ok(t.blocks[i] as i64 * bs as i64 + (pos % bs) as i64)
    }

    /// Blocks a table of `num_tokens` tokens spans.
    pub fn blocks_for(&self, num_tokens: u32) -> u32 {
        num_tokens.div_ceil(self.block_size)
    }

    /// Leading blocks a table of `num_tokens` tokens no longer needs: those wholly
    /// before the sliding window.
    pub fn dead_blocks(&self, num_tokens: u32) -> u32 {
        match self.window {
            Some(w) => num_tokens.saturating_sub(w) / self.block_size,
            None => 0,
        }
    }

    /// `(hit_blocks, hits_that_are_free)` for a prompt: the leading full blocks whose
    /// hash chain is cached, capped so at least one token is left to compute. Changes
    /// nothing. Always `(0, 0)` without prefix caching, and with a sliding window (a
    /// prefill may need cached tokens the window has already released).
    pub fn count_prefix_hits(&self, tokens: &[u32], salt: Option<u64>) -> (u32, u32) {
        if !self.prefix_caching || self.window.is_some() || tokens.is_empty() {
            return (0, 0);
        }
        let bs = self.block_size as usize;
        let max_hits = (tokens.len() - 1) / bs;
        let (mut hits, mut free) = (0, 0);
        let mut parent = None;
        for chunk in tokens.chunks_exact(bs).take(max_hits) {
            let h = hash_block(parent, chunk, salt);
            match self.device.lookup(h) {
                Some(b) => {
                    hits += 1;
                    free += (self.device.rc(b) == 0) as u32;
                    parent = Some(h);
                }
                None => break,
            }
        }
        (hits, free)
    }

    /// Free device blocks a prefill of `tokens` would take: its blocks inside the
    /// window, less prefix hits, plus the hits that sit in the free queue.
    pub fn prefill_cost(&self, tokens: &[u32], salt: Option<u64>) -> u32 {
        let n = tokens.len() as u32;
        let (hits, hits_free) = self.count_prefix_hits(tokens, salt);
        self.blocks_for(n) - self.dead_blocks(n) - hits + hits_free
    }

    /// Gives an empty table slots for every position of `tokens`, reusing cached prefix
    /// blocks. Positions before a sliding window get no block ([`NULL_BLOCK`] entries,
    /// [`PAD_SLOT`] slots). Returns the number of leading tokens whose KV is already
    /// cached (a multiple of the block size, less than `tokens.len()`). Nothing
    /// changes on error.
    pub fn allocate_prefill(
        &mut self,
        t: &mut BlockTable,
        tokens: &[u32],
        salt: Option<u64>,
    ) -> Result<u32> {
        self.check(t)?;
        if !t.blocks.is_empty() || t.location != Location::Device {
            return Err(Error::InvalidState(
                "allocate_prefill needs an empty device table".into(),
            ));
        }
        if tokens.is_empty() {
            return Err(Error::invalid(
                "tokens",
                "a prompt needs at least one token",
            ));
        }
        let cost = self.prefill_cost(tokens, salt);
        if cost > self.device.num_free() {
            return Err(Error::OutOfBlocks {
                needed: cost,
                free: self.device.num_free(),
            });
        }
        let (hits, _) = self.count_prefix_hits(tokens, salt);
        let bs = self.block_size as usize;
        let mut parent = None;
        for chunk in tokens.chunks_exact(bs).take(hits as usize) {
            let h = hash_block(parent, chunk, salt);
            let b = self.device.lookup(h).expect("counted hit");
            self.device.take(b, self.block_size);
            t.blocks.push(b);
            t.hashes.push(h);
            parent = Some(h);
        }
        let n = tokens.len() as u32;
        let dead = self.dead_blocks(n);
        while (t.blocks.len() as u32) < self.blocks_for(n) {
            let b = if (t.blocks.len() as u32) < dead {
                NULL_BLOCK
            } else {
                self.device.allocate().expect("cost checked")
            };
            t.blocks.push(b);
        }
        t.first_live = dead;
        t.num_tokens = n;
        t.owner = self.id;
        t.last = *t.blocks.last().expect("a prompt has a block");
        // The new blocks' tokens (the hits were counted by `touch`).
        let new_from = hits.max(dead);
        self.device
            .add_fill(n.saturating_sub(new_from * self.block_size));
        Ok(hits * self.block_size)
    }

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
        let last = *t.blocks.last()?;
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
                    && o.blocks.last() == Some(&last)
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

    /// Gives position `num_tokens` of `t` a slot and returns it. Allocates only when
    /// the last block is full; copies a shared partial last block first and pushes the
    /// `(src, dst)` pair onto `copies`. Nothing changes on error.
    pub fn append_slot(&mut self, t: &mut BlockTable, copies: &mut Vec<(u32, u32)>) -> Result<i64> {
        self.check(t)?;
        if t.location != Location::Device {
            return Err(Error::InvalidState("append to a swapped-out table".into()));
        }
        let bs = self.block_size;
        let pos = t.num_tokens;
        if pos.is_multiple_of(bs) {
            let b = self.device.allocate()?;
            t.blocks.push(b);
        } else if t.last_maybe_shared {
            let i = t.blocks.len() - 1;
            let last = t.blocks[i];
            if self.device.rc(last) > 1 {
                let dst = self.device.allocate()?;
                self.device.add_fill(pos % bs);
                copies.push((last, dst));
                self.device.release(last, pos % bs);
                t.blocks[i] = dst;
            }
        }
        t.owner = self.id;
        t.last_maybe_shared = false;
        t.num_tokens = pos + 1;
        self.device.add_fill(1);
        let b = *t.blocks.last().unwrap();
        t.last = b;
        self.slide_window(t);
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
            || self.window.is_some()
            || t.owner != self.id
            || t.location != Location::Device
        {
            return None;
        }
        let b = t.last;
        debug_assert_eq!(t.blocks.last(), Some(&b), "stale last block");
        t.num_tokens = pos + 1;
        self.device.add_fill(1);
        Some(b as i64 * self.block_size as i64 + off as i64)
    }

    /// Records the hashes of `t`'s full blocks whose contents are now computed (the
    /// first `t.num_tokens()` tokens of `tokens`), and registers them in the prefix cache.
    /// Errors on a table of another manager.
    pub fn commit(&mut self, t: &mut BlockTable, tokens: &[u32], salt: Option<u64>) -> Result<()> {
        self.commit_deferred(t, tokens, salt)?;
        self.flush_commits();
        Ok(())
    }

    /// [`commit`](Self::commit), except that the prefix-cache registrations wait for
    /// [`flush_commits`](Self::flush_commits), which must run before any block is
    /// freed or allocated (a registration is of a held block).
    pub(crate) fn commit_deferred(
        &mut self,
        t: &mut BlockTable,
        tokens: &[u32],
        salt: Option<u64>,
    ) -> Result<()> {
        self.check(t)?;
        if !self.prefix_caching || self.window.is_some() || t.location != Location::Device {
            return Ok(());
        }
        let bs = self.block_size as usize;
        let full = (t.num_tokens as usize).min(tokens.len()) / bs;
        while t.hashes.len() < full {
            let i = t.hashes.len();
            let h = hash_block(
                t.hashes.last().copied(),
                &tokens[i * bs..(i + 1) * bs],
                salt,
            );
            if t.blocks[i] != NULL_BLOCK {
                // Start the map's cache miss now; the flush finds the line in cache.
                self.device.prefetch_register(t.blocks[i], h);
                self.pending.push((t.blocks[i], h));
            }
            t.hashes.push(h);
        }
        Ok(())
    }

    /// Whether [`commit`](Self::commit) of `t` would record anything: prefix caching
    /// is on (without a window) and a full block of `t` has no hash yet.
    pub(crate) fn has_uncommitted(&self, t: &BlockTable) -> bool {
        self.prefix_caching
            && self.window.is_none()
            && (t.num_tokens as usize) >= (t.hashes.len() + 1) * self.block_size as usize
    }

    /// Registers the pending commits in order (their map slots were prefetched when
    /// they were hashed, so their cache misses overlap with the caller's other work).
    pub(crate) fn flush_commits(&mut self) {
        for &(b, h) in &self.pending {
            self.device.register(b, h);
        }
        self.pending.clear();
    }

    /// A new table sharing every block of `t` (each `ref_cnt` + 1): the only way to
    /// copy a table. Errors on a table of another manager or swapped out.
    pub fn fork(&mut self, t: &mut BlockTable) -> Result<BlockTable> {
        self.check(t)?;
        if t.location != Location::Device {
            return Err(Error::InvalidState("fork of a swapped-out table".into()));
        }
        for &b in &t.blocks {
            self.device.share(b);
        }
        t.last_maybe_shared = true;
        Ok(t.duplicate())
    }

    /// Releases every block of `t` (last block first, so a freed sequence's prefix
    /// stays cached longest) and empties it, so freeing it again does nothing. Errors,
    /// changing nothing, on a table of another manager.
    pub fn free(&mut self, t: &mut BlockTable) -> Result<()> {
        self.check(t)?;
        let pool = match t.location {
            Location::Device => &mut self.device,
            Location::Host => &mut self.host,
        };
        // Only the device pool counts filled slots (the utilisation metric).
        let counts = t.location == Location::Device;
        let live = t.first_live as usize;
        for (i, &b) in t.blocks.iter().enumerate().skip(live).rev() {
            let fill = if counts {
                Self::fill_of(self.block_size, t.num_tokens, i)
            } else {
                0
            };
            pool.release(b, fill);
        }
        *t = BlockTable::new();
        Ok(())
    }

    /// Tokens in block `i` of a table of `num_tokens` tokens.
    fn fill_of(block_size: u32, num_tokens: u32, i: usize) -> u32 {
        (num_tokens - i as u32 * block_size).min(block_size)
    }

    /// Releases the blocks wholly before the sliding window (entries become
    /// [`NULL_BLOCK`]).
    fn slide_window(&mut self, t: &mut BlockTable) {
        let Some(w) = self.window else { return };
        let first_pos = t.num_tokens.saturating_sub(w);
        let dead = first_pos / self.block_size;
        while t.first_live < dead {
            let i = t.first_live as usize;
            if t.blocks[i] != NULL_BLOCK {
                self.device.release(t.blocks[i], self.block_size);
                t.blocks[i] = NULL_BLOCK;
            }
            t.first_live += 1;
        }
    }

    /// Distinct live blocks of the tables (entries before a window are null), in
    /// first-seen order.
    fn distinct(&mut self, tables: &[&mut BlockTable]) -> Vec<BlockId> {
        self.scratch.clear();
        let mut v = Vec::new();
        for t in tables {
            for &b in &t.blocks[t.first_live as usize..] {
                if self.scratch.insert(b, 0).is_none() {
                    v.push(b);
                }
            }
        }
        v
    }

    /// Host blocks a swap-out of these tables takes.
    pub fn swap_out_cost(&mut self, tables: &[&mut BlockTable]) -> Result<u32> {
        self.check_all(tables)?;
        Ok(self.distinct(tables).len() as u32)
    }

    /// Device blocks a swap-in of these tables takes (their blocks; the appends after
    /// it take [`group_append_cost`](Self::group_append_cost) more).
    pub fn swap_in_cost(&mut self, tables: &[&mut BlockTable]) -> Result<u32> {
        self.check_all(tables)?;
        Ok(self.distinct(tables).len() as u32)
    }

    /// Moves a sequence group's tables to the host pool (blocks shared within the group
    /// stay shared) and pushes one `(device, host)` copy per distinct block. Nothing
    /// changes when the host pool is too small.
    pub fn swap_out(
        &mut self,
        tables: &mut [&mut BlockTable],
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        self.check_all(tables)?;
        if tables.iter().any(|t| t.location != Location::Device) {
            return Err(Error::InvalidState(
                "swap_out of a swapped-out table".into(),
            ));
        }
        let distinct = self.distinct(tables);
        if distinct.len() as u32 > self.host.num_free() {
            return Err(Error::OutOfBlocks {
                needed: distinct.len() as u32,
                free: self.host.num_free(),
            });
        }
        self.scratch.clear();
        for &d in &distinct {
            let h = self.host.allocate().expect("checked");
            self.scratch.insert(d, h);
            pairs.push((d, h));
        }
        // Each entry takes a reference; the one `allocate` made is dropped afterwards,
        // so every host block ends with one reference per entry that holds it.
        for t in tables.iter_mut() {
            let (live, n) = (t.first_live as usize, t.num_tokens);
            for (i, e) in t.blocks.iter_mut().enumerate().skip(live) {
                let h = self.scratch[e];
                self.host.share(h);
                self.device
                    .release(*e, Self::fill_of(self.block_size, n, i));
                *e = h;
            }
            t.location = Location::Host;
        }
        for &d in &distinct {
            self.host.release(self.scratch[&d], 0);
        }
        Ok(())
    }

    /// Moves a sequence group's tables back to the device pool, pushing one
    /// `(host, device)` copy per distinct block. Nothing changes when the device pool
    /// is too small.
    pub fn swap_in(
        &mut self,
        tables: &mut [&mut BlockTable],
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        self.check_all(tables)?;
        if tables.iter().any(|t| t.location != Location::Host) {
            return Err(Error::InvalidState(
                "swap_in of a table on the device".into(),
            ));
        }
        let distinct = self.distinct(tables);
        if distinct.len() as u32 > self.device.num_free() {
            return Err(Error::OutOfBlocks {
                needed: distinct.len() as u32,
                free: self.device.num_free(),
            });
        }
        self.scratch.clear();
        for &h in &distinct {
            let d = self.device.allocate().expect("checked");
            self.scratch.insert(h, d);
            pairs.push((h, d));
        }
        let bs = self.block_size;
        for t in tables.iter_mut() {
            let live = t.first_live as usize;
            for (i, e) in t.blocks.iter_mut().enumerate().skip(live) {
                let d = self.scratch[e];
                self.device.share(d);
                // The allocation's reference plus the first entry's: count its tokens once.
                if self.device.rc(d) == 2 {
                    self.device.add_fill(Self::fill_of(bs, t.num_tokens, i));
                }
                self.host.release(*e, 0);
                *e = d;
            }
            t.location = Location::Device;
            t.last_maybe_shared = true;
        }
        for &h in &distinct {
            // Drops the allocation's reference; the entries keep theirs (never zero).
            self.device.release(self.scratch[&h], 0);
        }
        Ok(())
    }
}
