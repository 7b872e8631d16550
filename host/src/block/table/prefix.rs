//! Prefix caching: a prompt's leading full blocks are found by their names (a
//! SHA-256 chain over the request's salt and every token up to the block's end,
//! [`hash_block`]) and shared instead of computed again.
//!
//! * A name cannot be forged: finding another prefix with a cached block's name is
//!   finding a SHA-256 collision, and a lookup compares the whole 256-bit name (the
//!   map is only keyed by 64 bits of it). So a hit always holds the K/V of the very
//!   tokens (and salt) it is served for. (A name sharing only the 64-bit key, about
//!   2^64 work to find for a given block, takes the key first and keeps that prefix
//!   from being cached: a denial of hits, never a wrong one.) Why SHA-256 rather than comparing tokens on a
//!   hit: a token comparison needs the whole prefix (a block's K/V depends on every
//!   token before it), so each cached block would have to keep its tokens and a
//!   verified link to its parent; a cryptographic chain carries all of that in 32
//!   bytes, is the same on every machine (a block export carries the name), and costs
//!   one compression per 16-token block (about 2 µs a step at 1024 decoding sequences,
//!   64 of which fill a block each step; see docs/performance.md).
//!
//! * A hit is only ever a full block, and a prefill always leaves at least one token
//!   to compute, so a prompt's last block is never a hit: a prefill's last block is
//!   always newly allocated, its own.
//! * A block is registered in the cache in the step that computes it at the earliest:
//!   a prefill's (or a chunk's) full blocks when the scheduler schedules it, so that a
//!   prompt admitted later in the same step shares them (their K/V is written by the
//!   step's `kv_append`, which an engine runs for the whole step before the step's
//!   attention in each layer; vLLM shares blocks as soon as they are allocated too);
//!   a decode's block after the step that wrote its last token (`on_step_done`).
//! * With sliding windows (and layer groups: [`crate::block::spec`]), a hit is the
//!   longest prefix every group serves: a full-attention group the whole chain, a
//!   window group the blocks its window needs at the first computed position (vLLM's
//!   rule, PR #14097). A block a window releases stays cached in the free queue (it was
//!   committed when it filled), so a later prompt beginning the same way still finds
//!   it. Each group's blocks are cached under its own names
//!   ([`BlockHash::in_group`](crate::block::BlockHash::in_group)).

use super::Parent;
use super::{BlockTable, KvCacheManager, Location, PendingCommit};
use crate::block::pool::{BlockHash, NULL_BLOCK, hash_block};
use crate::error::{Error, Result};
use crate::mem::{prefetch, prefetch_write};

/// A prompt's prefix-cache hits as [`KvCacheManager::find_prefix_hits`] found them: the
/// names of its leading full blocks (capped so at least one token is left to compute)
/// and how many of them every layer group serves, computed once and reused by
/// [`KvCacheManager::prefill_cost_with`] and [`KvCacheManager::allocate_prefill_with`],
/// which only look them up again. (Each name is a SHA-256 compression; an admission
/// once hashed its prompt five times.)
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefixHits {
    /// Chain names of the leading full blocks looked at (at least `blocks` of them).
    names: Vec<BlockHash>,
    blocks: u32,
    free: u32,
}

impl PrefixHits {
    /// Hit blocks: the longest prefix every layer group can serve.
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Of the blocks the hit takes in every group, those that sit in the free queue
    /// (a hit takes them out of it).
    pub fn free(&self) -> u32 {
        self.free
    }
}

impl KvCacheManager {
    /// Finds the prefix-cache hits of a prompt into `hits` (its buffer reused): the
    /// longest run of leading full blocks every layer group serves, capped so at least
    /// one token is left to compute. A full-attention group serves `n` blocks when all
    /// of them are cached under its names; a sliding-window group when the blocks its
    /// window needs at the first computed position (`n * block_size`) are: those from
    /// [`dead_before`](Self::dead_before) on (vLLM's rule). Changes nothing else. None
    /// without prefix caching. (A full group ends the search at its first miss; a
    /// manager of window groups only names every full block of the prompt, one
    /// SHA-256 compression each, about 33 ns: 67 µs for a 32k-token prompt, at every
    /// admission attempt.)
    pub fn find_prefix_hits(&self, tokens: &[u32], salt: Option<u64>, hits: &mut PrefixHits) {
        hits.names.clear();
        hits.blocks = 0;
        hits.free = 0;
        if !self.prefix_caching || tokens.is_empty() {
            return;
        }
        let bs = self.block_size as usize;
        let max_hits = (tokens.len() - 1) / bs;
        let full: Vec<usize> = (0..self.windows.len())
            .filter(|&g| self.windows[g].is_none())
            .collect();
        let mut parent = None;
        for chunk in tokens.chunks_exact(bs).take(max_hits) {
            let h = hash_block(parent, chunk, salt);
            // A full group serves no block past its first miss; with none, a window
            // group's run may start anywhere.
            if full
                .iter()
                .any(|&g| self.device.lookup(h.in_group(g)).is_none())
            {
                break;
            }
            hits.names.push(h);
            parent = Some(h);
        }
        let (n, free) = self.servable(&hits.names, hits.names.len());
        hits.blocks = n;
        hits.free = free;
    }

    /// The longest prefix of `names` (at most `upto` blocks) that every group serves
    /// from the cache now, and how many blocks a hit of it takes from the free queue.
    fn servable(&self, names: &[BlockHash], upto: usize) -> (u32, u32) {
        let upto = upto.min(names.len());
        let cached = |g: usize, i: usize| self.device.lookup(names[i].in_group(g));
        // Full groups: a prefix.
        let mut n = upto;
        for g in (0..self.windows.len()).filter(|&g| self.windows[g].is_none()) {
            n = (0..n).find(|&i| cached(g, i).is_none()).unwrap_or(n);
        }
        // Window groups: the longest `n` whose window blocks are all cached in each.
        let windowed: Vec<usize> = (0..self.windows.len())
            .filter(|&g| self.windows[g].is_some())
            .collect();
        while n > 0
            && !windowed.iter().all(|&g| {
                let dead = self.dead_before(g, (n * self.block_size as usize) as u32) as usize;
                (dead..n).all(|i| cached(g, i).is_some())
            })
        {
            n -= 1;
        }
        let mut free = 0;
        for g in 0..self.windows.len() {
            let dead = self.dead_before(g, (n * self.block_size as usize) as u32) as usize;
            for i in dead..n {
                let b = cached(g, i).expect("servable");
                free += (self.device.rc(b) == 0) as u32;
            }
        }
        (n as u32, free)
    }

    /// `(hit_blocks, hits_that_are_free)` for a prompt ([`find_prefix_hits`](Self::find_prefix_hits)).
    pub fn count_prefix_hits(&self, tokens: &[u32], salt: Option<u64>) -> (u32, u32) {
        let mut hits = PrefixHits::default();
        self.find_prefix_hits(tokens, salt, &mut hits);
        (hits.blocks(), hits.free())
    }

    /// Free device blocks a prefill of `tokens` would take, in every layer group: its
    /// blocks from the window of its first computed token on (with a sliding window,
    /// the step's queries read them all), less prefix hits, plus the hits that sit in
    /// the free queue.
    pub fn prefill_cost(&self, tokens: &[u32], salt: Option<u64>) -> u32 {
        let mut hits = PrefixHits::default();
        self.find_prefix_hits(tokens, salt, &mut hits);
        self.prefill_cost_with(tokens.len() as u32, &hits)
    }

    /// [`prefill_cost`](Self::prefill_cost) of a prompt of `num_tokens` tokens whose hits
    /// were found (as a prompt of at least as many tokens: at most `(num_tokens - 1) /
    /// block_size` of them count).
    pub fn prefill_cost_with(&self, num_tokens: u32, hits: &PrefixHits) -> u32 {
        let (hits, free) = self.still_cached(num_tokens, hits);
        self.cost_of(num_tokens, hits, free)
    }

    /// Free blocks a prefill of `n` tokens takes in every group with `hits` hit blocks,
    /// `free` of the blocks they take in the free queue: each group holds blocks from
    /// its window's start (`dead_before(hits * block_size)`, at most `hits`) on, takes
    /// the hit ones from the cache and allocates the rest.
    fn cost_of(&self, n: u32, hits: u32, free: u32) -> u32 {
        // (64 groups of 2^28 blocks overflow u32: saturate, more than any pool has.)
        let cost = (self.blocks_for(n) - hits) as u64 * self.windows.len() as u64 + free as u64;
        cost.min(u32::MAX as u64) as u32
    }

    /// The leading blocks of `hits` still served by every group (a prompt of
    /// `num_tokens` tokens keeps at least one to compute), and how many of the blocks
    /// they take are free: by lookup, no hashing.
    fn still_cached(&self, num_tokens: u32, hits: &PrefixHits) -> (u32, u32) {
        let max_hits = (num_tokens.saturating_sub(1) / self.block_size) as usize;
        self.servable(&hits.names, max_hits.min(hits.blocks as usize))
    }

    /// Gives one empty table per layer group (`tables[g]` of group `g`, every group
    /// once) slots for every position of `tokens`, reusing cached prefix blocks: one
    /// step's prefill, whose queries attend together, so with a sliding window only
    /// the blocks wholly before the window of its first computed position get no block
    /// ([`NULL_BLOCK`] entries; the rest of the window's release waits for the
    /// sequence's next step, see `append`). Returns the number of leading tokens whose
    /// KV is already cached (a multiple of the block size, less than `tokens.len()`).
    /// Nothing changes on error.
    pub fn allocate_prefill(
        &mut self,
        tables: &mut [&mut BlockTable],
        tokens: &[u32],
        salt: Option<u64>,
    ) -> Result<u32> {
        let mut hits = PrefixHits::default();
        self.find_prefix_hits(tokens, salt, &mut hits);
        self.allocate_prefill_with(tables, tokens, &hits)
    }

    /// [`allocate_prefill`](Self::allocate_prefill) with the hits
    /// [`find_prefix_hits`](Self::find_prefix_hits) found for `tokens` (or for a longer
    /// prompt they begin): the hits every group still serves are taken (in every group
    /// before any block is allocated, so an allocation never evicts a hit), none hashed
    /// again.
    pub fn allocate_prefill_with(
        &mut self,
        tables: &mut [&mut BlockTable],
        tokens: &[u32],
        found: &PrefixHits,
    ) -> Result<u32> {
        self.check_all(tables)?;
        if tables.len() != self.windows.len()
            || tables
                .iter()
                .enumerate()
                .any(|(g, t)| t.group as usize != g)
        {
            return Err(Error::invalid(
                "tables",
                format!(
                    "one table per layer group, in group order ({} groups)",
                    self.windows.len()
                ),
            ));
        }
        if tables
            .iter()
            .any(|t| !t.blocks().is_empty() || t.location != Location::Device)
        {
            return Err(Error::InvalidState(
                "allocate_prefill needs empty device tables".into(),
            ));
        }
        if tokens.is_empty() {
            return Err(Error::invalid(
                "tokens",
                "a prompt needs at least one token",
            ));
        }
        let n = tokens.len() as u32;
        let (hits, free) = self.still_cached(n, found);
        let cost = self.cost_of(n, hits, free);
        if cost > self.device.num_free() {
            return Err(Error::OutOfBlocks {
                needed: cost,
                free: self.device.num_free(),
            });
        }
        let bs = self.block_size;
        // Every group's hits first (out of the free queue), then the new blocks.
        for (g, t) in tables.iter_mut().enumerate() {
            let dead = self.dead_before(g, hits * bs);
            for (i, &h) in found.names[..hits as usize].iter().enumerate() {
                let b = if (i as u32) < dead {
                    NULL_BLOCK
                } else {
                    let b = self.device.lookup(h.in_group(g)).expect("counted hit");
                    self.device.take(b, bs);
                    b
                };
                t.entries.push_block(b);
                t.entries.push_hash(h);
            }
        }
        for (g, t) in tables.iter_mut().enumerate() {
            let dead = self.dead_before(g, hits * bs);
            while (t.blocks().len() as u32) < self.blocks_for(n) {
                let b = if (t.blocks().len() as u32) < dead {
                    NULL_BLOCK
                } else {
                    self.device.allocate().expect("cost checked")
                };
                t.entries.push_block(b);
            }
            t.first_live = dead;
            t.num_tokens = n;
            t.owner = self.id;
            t.last = *t.blocks().last().expect("a prompt has a block");
            // The new blocks' tokens (the hits were counted by `take`).
            let new_from = hits.max(dead);
            self.device.add_fill(n.saturating_sub(new_from * bs));
        }
        Ok(hits * bs)
    }

    /// Records the hashes of `t`'s full blocks whose contents are now computed (the
    /// first `t.num_tokens()` tokens of `tokens`), and registers them in the prefix cache.
    /// Errors on a table of another manager.
    pub fn commit(&mut self, t: &mut BlockTable, tokens: &[u32], salt: Option<u64>) -> Result<()> {
        self.commit_parts(t, (tokens, &[]), salt)
    }

    /// [`commit`](Self::commit) of tokens in two parts, `head` then `tail` (a
    /// scheduler's history). Not between `commit_deferred` and its flush.
    pub(crate) fn commit_parts(
        &mut self,
        t: &mut BlockTable,
        parts: (&[u32], &[u32]),
        salt: Option<u64>,
    ) -> Result<()> {
        debug_assert!(self.pending.is_empty(), "commits pending");
        self.commit_deferred(t, parts, salt, 0)?;
        self.flush_commits();
        for &(_, i, name) in &self.named {
            t.entries.set_hash(i as usize, name);
        }
        self.named.clear();
        Ok(())
    }

    /// [`commit`](Self::commit), except that the names are computed, and the blocks
    /// registered, by [`flush_commits`](Self::flush_commits), which must run before
    /// any block is freed or allocated (a registration is of a held block): until then
    /// `t` holds placeholder names, and the caller writes the real ones into the table
    /// it tagged `tag` from [`named`](Self::named) (so that the SHA-256 compressions of
    /// a step's commits run back to back, not between the scheduler's per-sequence
    /// work: measured, `on_step_done` at 1024 sequences about 0.5 µs faster). The
    /// tokens come in
    /// two parts, `head` then `tail` (the scheduler keeps a sequence's last few tokens
    /// apart from the rest).
    pub(crate) fn commit_deferred(
        &mut self,
        t: &mut BlockTable,
        (head, tail): (&[u32], &[u32]),
        salt: Option<u64>,
        tag: u32,
    ) -> Result<()> {
        self.check(t)?;
        if !self.prefix_caching || t.location != Location::Device {
            return Ok(());
        }
        let bs = self.block_size as usize;
        let h = head.len();
        let full = (t.num_tokens as usize).min(h + tail.len()) / bs;
        let mut parent = match t.entries.last_hash() {
            Some(p) => Parent::Name(p),
            None => Parent::Root,
        };
        while t.entries.num_hashes() < full {
            let i = t.entries.num_hashes();
            let (lo, hi) = (i * bs, (i + 1) * bs);
            // The block's tokens, from either part or across both.
            if hi <= h {
                self.pending_tokens.extend_from_slice(&head[lo..hi]);
            } else if lo >= h {
                self.pending_tokens.extend_from_slice(&tail[lo - h..hi - h]);
            } else {
                self.pending_tokens.extend_from_slice(&head[lo..]);
                self.pending_tokens.extend_from_slice(&tail[..hi - h]);
            }
            self.pending.push(PendingCommit {
                block: committed_block(t, i),
                group: t.group,
                tag,
                index: i as u32,
                parent,
                salt,
            });
            parent = Parent::Previous;
            t.entries.push_hash(BlockHash::from_bytes([0; 32]));
        }
        Ok(())
    }

    /// The names the last [`flush_commits`](Self::flush_commits) computed: `(tag,
    /// entry, name)` for each pending commit, to be written into entry `entry` of the
    /// table the caller tagged `tag` ([`BlockTable::set_hash`]). Cleared by the next
    /// `commit_deferred` batch's flush.
    pub(crate) fn named(&self) -> &[(u32, u32, BlockHash)] {
        &self.named
    }

    /// Prefetches what [`commit_deferred`](Self::commit_deferred) of `t` reads first:
    /// its last hash, the entry of the block it commits next, and that block's
    /// tokens (a hint; a loop a few sequences behind finds them in cache).
    pub(crate) fn prefetch_commit(&self, t: &BlockTable, (head, tail): (&[u32], &[u32])) {
        let i = t.entries.num_hashes();
        // The last name (read) and the next one's place (written: 32 bytes each, so
        // they may lie on two lines).
        prefetch(t.entries.hash_ptr(i.saturating_sub(1)));
        prefetch_write(t.entries.hash_ptr(i));
        if !reads_last(t, i) {
            prefetch(t.entries.block_ptr(i));
        }
        let bs = self.block_size as usize;
        let (lo, hi) = (i * bs, (i + 1) * bs);
        for at in [lo, hi - 1] {
            match at.checked_sub(head.len()) {
                None => prefetch(head.as_ptr().wrapping_add(at)),
                Some(j) => prefetch(tail.as_ptr().wrapping_add(j)),
            }
        }
    }

    /// The token count from which [`commit`](Self::commit) of `t` records something
    /// (prefix caching is on, and a full block of `t` has no hash yet): `u32::MAX`
    /// when no count does.
    pub(crate) fn commit_at(&self, t: &BlockTable) -> u32 {
        if !self.prefix_caching {
            return u32::MAX;
        }
        (t.entries.num_hashes() as u64 + 1)
            .checked_mul(self.block_size as u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(u32::MAX)
    }

    /// Records in `t` the names `names` of its sequence's full blocks, computed by the
    /// commits of the same sequence's table in another layer group (the chain depends
    /// on the tokens alone), and registers `t`'s blocks under its group's names: a
    /// commit without hashing. Entries a window released are named, not registered.
    pub(crate) fn adopt_names(&mut self, t: &mut BlockTable, names: &[BlockHash]) -> Result<()> {
        self.check(t)?;
        if !self.prefix_caching || t.location != Location::Device {
            return Ok(());
        }
        let full = (t.num_tokens / self.block_size) as usize;
        let g = t.group as usize;
        while t.entries.num_hashes() < full.min(names.len()) {
            let i = t.entries.num_hashes();
            let b = t.blocks()[i];
            if b != NULL_BLOCK {
                self.device.register(b, names[i].in_group(g));
            }
            t.entries.push_hash(names[i]);
        }
        Ok(())
    }

    /// Names the pending commits (SHA-256 compressions back to back, into
    /// [`named`](Self::named)), then registers them in order, after prefetching their
    /// map slots a fixed distance ahead so that their cache misses overlap.
    pub(crate) fn flush_commits(&mut self) {
        self.named.clear();
        let bs = self.block_size as usize;
        let mut last = None;
        for (c, tokens) in self
            .pending
            .iter()
            .zip(self.pending_tokens.chunks_exact(bs))
        {
            let parent = match c.parent {
                Parent::Root => None,
                Parent::Name(p) => Some(p),
                Parent::Previous => last,
            };
            let name = hash_block(parent, tokens, c.salt);
            self.named.push((c.tag, c.index, name));
            last = Some(name);
        }
        // The map slots in a batch of their own, a fixed distance ahead of the
        // registrations: a prefetch into a large map waits for a page walk before it
        // retires, and only prefetches issued close together have their walks and
        // cache misses overlap (issued one per hash, between the hashing, they were
        // serialised: about a quarter of `on_step_done` at 1024 sequences, and a
        // third more at 16384). All of them first, before any registration, was
        // slower at 16384 sequences (1024 registrations a step) than a fixed
        // distance ahead (measured: 5% of `on_step_done`; our reading: the prefetches
        // held the core's miss buffers full, and the registrations then read lines
        // long since moved out of L1).
        const AHEAD: usize = 48;
        let regs = &mut self.registrations;
        regs.clear();
        regs.extend(
            self.pending
                .iter()
                .zip(&self.named)
                .map(|(c, n)| (c.block, n.2.in_group(c.group as usize)))
                .filter(|&(b, _)| b != NULL_BLOCK),
        );
        for &(b, h) in regs.iter().take(AHEAD) {
            self.device.prefetch_register(b, h);
        }
        for i in 0..regs.len() {
            if let Some(&(b, h)) = regs.get(i + AHEAD) {
                self.device.prefetch_register(b, h);
            }
            let (b, h) = regs[i];
            self.device.register(b, h);
        }
        self.pending.clear();
        self.pending_tokens.clear();
    }
}

/// Whether block `i` of `t` is its last and `t.last` holds it exactly (see
/// [`BlockTable`]'s `last`): a commit then reads the table's own copy instead of its
/// entries' heap memory (the common decode commits the block its last token filled,
/// one step before the next block is taken: the last).
fn reads_last(t: &BlockTable, i: usize) -> bool {
    i + 1 == t.num_blocks() && !t.last_maybe_shared && t.location == Location::Device
}

/// The block id of entry `i` of `t`, read from `t.last` when that is exact.
fn committed_block(t: &BlockTable, i: usize) -> crate::block::BlockId {
    if reads_last(t, i) {
        debug_assert_eq!(t.last, t.blocks()[i], "stale last block");
        t.last
    } else {
        t.blocks()[i]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deferred commit of tokens in two parts records the hashes a commit of one
    /// slice does, wherever the parts split (a block spanning both parts is copied),
    /// for block sizes below, at and above the stack buffer's 64 tokens.
    #[test]
    fn deferred_commits_of_split_tokens_hash_as_one_slice() {
        for bs in [8u32, 32, 128] {
            let tokens: Vec<u32> = (0..4 * bs + 5).map(|t| t * 7 + 1).collect();
            let fill = |m: &mut KvCacheManager, t: &mut BlockTable| {
                m.allocate_prefill(&mut [t], &tokens[..1], None).unwrap();
                let mut copies = Vec::new();
                for _ in 1..tokens.len() {
                    m.append_slot(t, &mut copies).unwrap();
                }
            };
            let mut m = KvCacheManager::new(64, 0, bs, true, None).unwrap();
            let mut whole = BlockTable::new();
            fill(&mut m, &mut whole);
            m.commit(&mut whole, &tokens, Some(9)).unwrap();
            assert_eq!(whole.hashes().len(), 4);
            for split in [0, 1, bs as usize - 1, bs as usize + 3, tokens.len()] {
                let mut m = KvCacheManager::new(64, 0, bs, true, None).unwrap();
                let mut t = BlockTable::new();
                fill(&mut m, &mut t);
                let parts = tokens.split_at(split);
                m.commit_deferred(&mut t, parts, Some(9), 0).unwrap();
                m.flush_commits();
                for &(_, i, name) in m.named() {
                    t.set_hash(i as usize, name);
                }
                assert_eq!(t.hashes(), whole.hashes(), "block {bs}, split at {split}");
            }
        }
    }
}
