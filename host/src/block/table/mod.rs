//! [`BlockTable`] and [`KvCacheManager`]: one sequence's blocks, and every operation
//! that changes which sequence holds which block.
//!
//! # Invariants (checked by the proptests in `host/tests/scheduling/scheduler.rs`)
//! * Every entry of a device table is [`NULL_BLOCK`] or a block whose `ref_cnt` counts
//!   it; every entry of a host (swapped) table likewise in the host pool.
//! * Token position `p < num_tokens` of a table lives in slot
//!   `blocks[p / block_size] * block_size + p % block_size` of every layer of the
//!   table's layer group ([`BlockTable::group`]; a manager serves one or more groups
//!   over one pool, see [`crate::block::spec`]): a block id belongs to one group. With a sliding window,
//!   the entries wholly before the window of the first position the table's last
//!   step appended are `NULL_BLOCK` (released), and every later entry is held: a
//!   step's queries read every position any of them attends to (the release rule in
//!   `append`).
//! * A sequence only ever writes into a block it holds alone, but for one case:
//!   [`KvCacheManager::append_slot`] copies a shared partial last block first
//!   (copy-on-write) and reports the `(src, dst)` pair for the `copy_blocks` kernel.
//!   Full blocks are never written again, so sharing them (fork, prefix hits) is free.
//!   The case: a full block a prefill computes may be shared in that same step by
//!   prefills of the same prefix admitted after it (they read it, the computing one
//!   writes it, with the very tokens they have there).
//! * `hashes[i]` is the prefix-cache name of full block `i`
//!   ([`hash_block`](crate::block::hash_block): the chain over the salt and the tokens
//!   up to its end), recorded by [`KvCacheManager::commit`] in the step that computes
//!   the block at the earliest (see `prefix`).
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
//!
//! # Where the code lives
//! The types, their accessors, slot lookup and `free` are here; the rest of the
//! manager's operations sit beside the concern they serve:
//! * `prefix`: prefix caching, hits at prefill and the commits that register
//!   computed blocks;
//! * `append`: appends, with copy-on-write of a shared partial last block, their
//!   block costs, the sliding window, and `fork`, which makes the sharing;
//! * `swap`: moving a sequence group's tables between the device and host pools.
//!
//! [`NULL_BLOCK`]: crate::block::NULL_BLOCK

mod append;
mod entries;
mod prefix;

pub use prefix::PrefixHits;
mod swap;

use std::sync::atomic::{AtomicU64, Ordering};

use rustc_hash::FxHashMap as HashMap;

use super::pool::{BlockHash, BlockId, BlockPool, PAD_SLOT};
use crate::block::spec::{KvSpec, MAX_KV_GROUPS};
use crate::error::{Error, Result};
use crate::mem::SeqAlloc;
use entries::Entries;

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
#[derive(Debug, PartialEq, Eq)]
// `repr(C)`, 56 bytes, the counts and flags first: an in-place append reads and writes
// only the first 18, and a scheduler keeps the whole table and its request id in one
// 64-byte cache line (`scheduler::seqs`).
#[repr(C)]
pub struct BlockTable {
    /// The [`KvCacheManager::id`] of the manager whose blocks these are; 0 while empty.
    owner: u32,
    num_tokens: u32,
    /// The last block id, kept beside the counts so the common append reads no heap
    /// memory. Exact whenever `append_in_place` may use it: after `allocate_prefill`
    /// or `append_slot` (which set it), until a fork or swap sets `last_maybe_shared`
    /// or moves the table to the host.
    last: BlockId,
    first_live: u32,
    location: Location,
    /// The last block may be shared (set by fork and swap-in): only then does an
    /// append look at its reference count for copy-on-write.
    last_maybe_shared: bool,
    /// The layer group whose blocks these are (its manager's window and prefix names
    /// apply; see [`crate::block::spec`]). Kept by `free`: a table serves one group.
    group: u8,
    /// The block ids and hashes, allocated from the global allocator, or from a
    /// scheduler's arena once it reserves the table ([`reserve_in`](Self::reserve_in)).
    entries: Entries,
}

const _: () = assert!(
    size_of::<BlockTable>() == 56,
    "a table and a request id fill a line"
);

impl Default for BlockTable {
    fn default() -> Self {
        Self {
            owner: 0,
            num_tokens: 0,
            last: 0,
            first_live: 0,
            location: Location::Device,
            last_maybe_shared: false,
            group: 0,
            entries: Entries::new_in(SeqAlloc::Global),
        }
    }
}

impl BlockTable {
    /// An empty table on the device, bound to no manager yet, of layer group 0 (a
    /// model of one group has only that).
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty table of layer group `group` (< [`MAX_KV_GROUPS`]: its manager
    /// refuses a group it does not have).
    ///
    /// [`MAX_KV_GROUPS`]: crate::block::MAX_KV_GROUPS
    pub fn for_group(group: usize) -> Self {
        Self {
            group: group.min(u8::MAX as usize) as u8,
            ..Self::default()
        }
    }

    /// The layer group of this table's blocks.
    pub fn group(&self) -> usize {
        self.group as usize
    }

    /// The [`KvCacheManager::id`] of the manager this table's blocks belong to; `None`
    /// for an empty table.
    pub fn owner(&self) -> Option<u64> {
        (self.owner != 0).then_some(self.owner as u64)
    }

    /// Makes room for `blocks` entries (and their hashes) *in all* (not `blocks` more,
    /// unlike `Vec::reserve`), so that appends up to `blocks * block_size` tokens
    /// never reallocate: the table keeps its entries in one place (beside its hashes)
    /// until it outgrows that, instead of moving each time it doubles.
    ///
    /// # Panics
    /// If the room for `blocks` entries and hashes (36 bytes each) overflows
    /// `isize::MAX` bytes, as `Vec::reserve` does.
    pub fn reserve(&mut self, blocks: usize) {
        let alloc = self.entries.allocator().clone();
        self.reserve_in(&alloc, blocks);
    }

    /// [`reserve`](Self::reserve), the entries and hashes (moved if need be) allocated
    /// by `alloc` from now on.
    pub(crate) fn reserve_in(&mut self, alloc: &SeqAlloc, blocks: usize) {
        self.entries.reserve_in(alloc, blocks);
    }

    /// A second handle on the same blocks, with the same room to grow, from the same
    /// allocator; the caller takes the extra references.
    fn duplicate(&self) -> Self {
        Self {
            owner: self.owner,
            num_tokens: self.num_tokens,
            last: self.last,
            first_live: self.first_live,
            location: self.location,
            last_maybe_shared: self.last_maybe_shared,
            group: self.group,
            entries: self.entries.duplicate(),
        }
    }

    /// The block ids, writable (crate-internal: an entry holds a reference).
    fn blocks_mut(&mut self) -> &mut [BlockId] {
        self.entries.blocks_mut()
    }

    /// `blocks().len()`, without making the slice.
    pub(crate) fn num_blocks(&self) -> usize {
        self.entries.num_blocks()
    }

    /// The last block id, as `append_slot` left it (after any other change, a stale
    /// copy until the next `allocate_prefill` or `append_slot`).
    pub(crate) fn last_block(&self) -> BlockId {
        self.last
    }

    /// Where the next block id goes (for prefetching; may point past the storage).
    pub(crate) fn next_entry_ptr(&self) -> *const BlockId {
        self.entries.block_ptr(self.entries.num_blocks())
    }

    /// Physical block of each logical block.
    pub fn blocks(&self) -> &[BlockId] {
        self.entries.blocks()
    }

    /// Token positions that have a slot.
    pub fn num_tokens(&self) -> u32 {
        self.num_tokens
    }

    /// Where the blocks live.
    pub fn location(&self) -> Location {
        self.location
    }

    /// Writes the name [`KvCacheManager::flush_commits`] computed for full block `i`
    /// into its placeholder.
    pub(crate) fn set_hash(&mut self, i: usize, h: BlockHash) {
        self.entries.set_hash(i, h);
    }

    /// Prefix-cache names of the leading full blocks committed so far (computed, or
    /// being computed by the current step: see [`KvCacheManager::commit`]).
    pub fn hashes(&self) -> &[BlockHash] {
        self.entries.hashes()
    }

    /// Leading entries a sliding window has released (all
    /// [`NULL_BLOCK`](crate::block::NULL_BLOCK)).
    pub(crate) fn first_live(&self) -> u32 {
        self.first_live
    }

    /// Marks the last block as possibly shared, so the next append looks at its
    /// reference count (a rollback gave a fork's copy on write back for it).
    pub(crate) fn mark_last_maybe_shared(&mut self) {
        self.last_maybe_shared = true;
    }
}

/// A commit [`KvCacheManager::commit_deferred`] left for
/// [`KvCacheManager::flush_commits`]: full block `block` ([`NULL_BLOCK`] for one a
/// window released: named, not registered), entry `index` of the caller's table
/// `tag`, whose name is that of its tokens after `parent`.
///
/// [`NULL_BLOCK`]: crate::block::NULL_BLOCK
#[derive(Clone, Copy, Debug)]
struct PendingCommit {
    block: BlockId,
    /// The table's layer group (the name is registered as its group's).
    group: u8,
    tag: u32,
    index: u32,
    parent: Parent,
    salt: Option<u64>,
}

/// A pending commit's parent.
#[derive(Clone, Copy, Debug)]
enum Parent {
    /// None: the table's first block (the chain starts from the salt).
    Root,
    /// A name already computed.
    Name(BlockHash),
    /// The commit pending just before (the same table's previous block).
    Previous,
}

/// The source of [`KvCacheManager::id`]s (0 means "no manager").
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// The KV-cache manager: a device pool, a host pool for swapping, and the rules.
///
/// Not `Clone`: a copy would share its tables' identity while its counts diverge.
#[derive(Debug)]
pub struct KvCacheManager {
    /// (32 bits: tables keep it in 4 bytes.)
    id: u32,
    device: BlockPool,
    host: BlockPool,
    block_size: u32,
    /// `block_size - 1` when it is a power of two (offsets by mask), else 0.
    block_mask: u32,
    prefix_caching: bool,
    /// The sliding window of each layer group (`None`: full attention); one entry
    /// for a model of one group.
    windows: Vec<Option<u32>>,
    /// Bit `g` set when group `g` has a window (the inline append reads one word).
    windowed: u64,
    scratch: HashMap<BlockId, BlockId>,
    /// Registrations [`commit_deferred`](Self::commit_deferred) left for
    /// [`flush_commits`](Self::flush_commits).
    pending: Vec<PendingCommit>,
    /// The tokens of the pending commits, one block after another.
    pending_tokens: Vec<u32>,
    /// The names [`flush_commits`](Self::flush_commits) computed, `(tag, entry,
    /// name)`, for the callers to write into their tables' placeholders.
    named: Vec<(u32, u32, BlockHash)>,
    /// The registrations of a flush (reused).
    registrations: Vec<(BlockId, BlockHash)>,
}

impl KvCacheManager {
    /// A manager over `num_blocks` device blocks (block 0 is the null block) and
    /// `num_host_blocks` host blocks for swapping (0 disables swap), each at most
    /// [`MAX_POOL_BLOCKS`](crate::block::pool::MAX_POOL_BLOCKS), for one layer group
    /// whose layers keep the last `window` tokens (`None`: all of them).
    pub fn new(
        num_blocks: u32,
        num_host_blocks: u32,
        block_size: u32,
        prefix_caching: bool,
        window: Option<u32>,
    ) -> Result<Self> {
        if window == Some(0) {
            return Err(Error::invalid("sliding_window", "must be at least 1 token"));
        }
        Self::with_groups(
            num_blocks,
            num_host_blocks,
            block_size,
            prefix_caching,
            &[KvSpec::from_window(window)],
        )
    }

    /// [`new`](Self::new) for layer groups of specs `groups` (one to
    /// [`MAX_KV_GROUPS`] of them), sharing the pool: a table of group `g`
    /// ([`BlockTable::for_group`]) follows `groups[g]`'s window, and its full blocks
    /// are cached under that group's names ([`BlockHash::in_group`]).
    pub fn with_groups(
        num_blocks: u32,
        num_host_blocks: u32,
        block_size: u32,
        prefix_caching: bool,
        groups: &[KvSpec],
    ) -> Result<Self> {
        if block_size == 0 || block_size > u16::MAX as u32 {
            return Err(Error::invalid("block_size", format!("{block_size}")));
        }
        if groups.is_empty() || groups.len() > MAX_KV_GROUPS {
            return Err(Error::invalid(
                "kv_groups",
                format!("{} groups (1 to {MAX_KV_GROUPS})", groups.len()),
            ));
        }
        for s in groups {
            s.check("kv_groups")?;
        }
        let windows: Vec<Option<u32>> = groups.iter().map(|s| s.window()).collect();
        let windowed = windows
            .iter()
            .enumerate()
            .fold(0u64, |m, (g, w)| m | ((w.is_some() as u64) << g));
        let host = if num_host_blocks == 0 {
            BlockPool::new(1, false).map(|mut p| {
                // A pool with its only block taken: swap always finds it full.
                let _ = p.allocate();
                p
            })?
        } else {
            BlockPool::named(num_host_blocks, false, "num_host_blocks")?
        };
        let id = u32::try_from(NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed)).map_err(|_| {
            Error::InvalidState("no KV-cache manager id left (ids are 32-bit)".into())
        })?;
        Ok(Self {
            id,
            device: BlockPool::named(num_blocks, true, "num_blocks")?,
            host,
            block_size,
            block_mask: if block_size.is_power_of_two() {
                block_size - 1
            } else {
                0
            },
            prefix_caching,
            windows,
            windowed,
            scratch: HashMap::default(),
            pending: Vec::new(),
            pending_tokens: Vec::new(),
            named: Vec::new(),
            registrations: Vec::new(),
        })
    }

    /// This manager's process-unique id; the tables it fills carry it. Ids are 32-bit:
    /// a process that made 2^32 - 1 managers gets an error from [`new`](Self::new).
    pub fn id(&self) -> u64 {
        self.id as u64
    }

    /// [`Error::InvalidArgument`] (`table`) unless `t` is empty or this manager's, of
    /// one of its groups.
    fn check(&self, t: &BlockTable) -> Result<()> {
        if t.group as usize >= self.windows.len() {
            return Err(Error::invalid(
                "table",
                format!(
                    "of layer group {}: the manager has {}",
                    t.group,
                    self.windows.len()
                ),
            ));
        }
        if t.owner == self.id || (t.owner == 0 && t.blocks().is_empty()) {
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

    /// The device pool, mutably: a KV transfer's import allocates and names blocks
    /// outside any table (`Scheduler::reserve_import`).
    pub(crate) fn device_mut(&mut self) -> &mut BlockPool {
        &mut self.device
    }

    /// Whether full blocks are cached by name (the scheduler's
    /// `enable_prefix_caching`).
    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// The host (swap) pool.
    pub fn host(&self) -> &BlockPool {
        &self.host
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The sliding window of each layer group (`None`: full attention).
    pub fn windows(&self) -> &[Option<u32>] {
        &self.windows
    }

    /// Layer groups.
    pub fn num_groups(&self) -> usize {
        self.windows.len()
    }

    /// Slot of token position `pos` of a device table; [`PAD_SLOT`] for a position
    /// whose block a sliding window has released (one an earlier step appended: a
    /// step's own positions always have slots). Errors: a table of another manager
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
        Ok(t.blocks()[i] as i64 * bs as i64 + (pos % bs) as i64)
    }

    /// Drops the device pool's prefix cache ([`BlockPool::reset_prefix_cache`]):
    /// refused while any device block is held.
    pub fn reset_prefix_cache(&mut self) -> Result<()> {
        debug_assert!(self.pending.is_empty(), "commits pending at a reset");
        self.device.reset_prefix_cache()
    }

    /// Blocks a table of `num_tokens` tokens spans.
    pub fn blocks_for(&self, num_tokens: u32) -> u32 {
        num_tokens.div_ceil(self.block_size)
    }

    /// Leading blocks of layer group `group` that no query at position `first` or
    /// later attends to: those wholly before the sliding window of position `first`
    /// (`first + 1 - w ..= first`); 0 without a window. A step whose first new
    /// position is `first` may release them, and needs every later block (see the
    /// window's release rule in `append`). A group the manager does not have has no
    /// window (0).
    pub fn dead_before(&self, group: usize, first: u32) -> u32 {
        match self.windows.get(group).copied().flatten() {
            Some(w) => (first as u64 + 1).saturating_sub(w as u64) as u32 / self.block_size,
            None => 0,
        }
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
        for (i, &b) in t.blocks().iter().enumerate().skip(live).rev() {
            let fill = if counts {
                Self::fill_of(self.block_size, t.num_tokens, i)
            } else {
                0
            };
            pool.release(b, fill);
        }
        *t = BlockTable::for_group(t.group as usize);
        Ok(())
    }

    /// Tokens in block `i` of a table of `num_tokens` tokens.
    fn fill_of(block_size: u32, num_tokens: u32, i: usize) -> u32 {
        (num_tokens - i as u32 * block_size).min(block_size)
    }
}
