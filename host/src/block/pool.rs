//! [`BlockPool`]: fixed-size KV-cache blocks with reference counts, an LRU free queue,
//! and the prefix-cache map.
//!
//! # Invariants
//! * Block [`NULL_BLOCK`] (id 0, when the pool reserves it) is never allocated and
//!   never freed: block tables use it for padding and for entries a sliding window has
//!   released, so every table entry is a valid id for the kernels.
//! * `ref_cnt[b]` is the number of block-table entries (across all sequences) that
//!   hold `b`. A block is in the *free queue* exactly when `ref_cnt[b] == 0`; so a block
//!   is never owned by a sequence and free at once, and `allocate` never returns a
//!   block somebody holds.
//! * The free queue is a doubly linked list: `allocate` takes the head. A freed block
//!   that holds nothing reusable (no prefix-cache hash) goes to the head, so it is
//!   taken first; a freed cached block goes to the tail, so cached blocks are evicted
//!   least recently freed first, and only once no hash-less block is free (vLLM's
//!   `FreeKVCacheBlockQueue` order, its `test_prefill` / `test_evict`). So the queue
//!   always holds the hash-less blocks first, then the cached ones in LRU order. All
//!   operations are O(1).
//! * A *cached* block carries the hash of its (full) contents and is in the hash map.
//!   Freed cached blocks stay in the map, reusable by a prefix hit ([`BlockPool::touch`]
//!   takes them out of the free queue), until `allocate` evicts them: eviction drops the
//!   map entry, so a hit never returns a block whose contents were overwritten.
//! * The public operations that take a block id ([`BlockPool::ref_cnt`],
//!   [`BlockPool::incref`], [`BlockPool::free`], [`BlockPool::touch`],
//!   [`BlockPool::cache`], [`BlockPool::block_hash`]) check it and return an error,
//!   changing nothing, for an id outside the pool, a double free, or a reference to a
//!   free block: the counts above hold in release builds too, whatever the caller
//!   passes. (The [`KvCacheManager`](super::KvCacheManager) validates its tables once
//!   and then uses unchecked internal versions.)
//! * `held_fill` is the number of token slots holding data, summed over held blocks
//!   (the KV-utilisation metric). Callers report fills as they change
//!   ([`BlockPool::add_fill`]) and when they drop a reference ([`BlockPool::free`]
//!   takes the block's fill as the caller sees it: a block shared by several tables
//!   has the same fill in each, since only a block held alone is ever written).

use crate::error::{Error, Result};
use crate::mem::{prefetch, try_huge_vec, try_zeroed_vec};

/// A physical block id.
pub type BlockId = u32;
/// The name of a full block's contents in the prefix cache: the SHA-256 chaining
/// value after the block's tokens (see [`hash_block`]). Two blocks with the same name
/// hold the K/V of the same tokens after the same prefix, under the same salt and
/// block size: finding two prefixes with one name is finding a SHA-256 collision, so
/// a name cannot be forged to be served (or to make another tenant be served) K/V
/// computed from other tokens.
#[derive(Clone, Copy, PartialEq, Eq, Hash, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(transparent)]
pub struct BlockHash([u32; 8]);

impl BlockHash {
    /// The 32 bytes of the name (its eight words big-endian, as SHA-256 writes a
    /// digest): what a block export carries.
    pub fn to_bytes(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        for (dst, w) in b.chunks_exact_mut(4).zip(self.0) {
            dst.copy_from_slice(&w.to_be_bytes());
        }
        b
    }

    /// The name whose [`to_bytes`](Self::to_bytes) are `b`.
    pub fn from_bytes(b: [u8; 32]) -> Self {
        let mut w = [0u32; 8];
        for (dst, src) in w.iter_mut().zip(b.chunks_exact(4)) {
            *dst = u32::from_be_bytes(src.try_into().unwrap());
        }
        Self(w)
    }

    /// The name under which layer group `group`'s block of these tokens is cached:
    /// the name itself for group 0, else the name XOR a 256-bit constant of the group
    /// (each group's copy of a prefix is a block of its own). A block served to the
    /// wrong group would need two names whose XOR is a given constant: as hard as a
    /// SHA-256 collision (about 2^128 work, the birthday bound), so groups never serve
    /// each other's blocks. Every word changes, the map's key included.
    pub fn in_group(self, group: usize) -> BlockHash {
        if group == 0 {
            return self;
        }
        // splitmix64 of the group, four times: a fixed, well-mixed constant per group.
        let mut x = group as u64;
        let mut w = self.0;
        for pair in w.chunks_exact_mut(2) {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            pair[0] ^= (z >> 32) as u32;
            pair[1] ^= z as u32;
        }
        BlockHash(w)
    }

    /// The prefix map's key: the first 64 bits. Only a key: a lookup compares the
    /// whole name, so two names that share a key never serve each other's block.
    pub(crate) fn key(&self) -> u64 {
        ((self.0[0] as u64) << 32) | self.0[1] as u64
    }
}

impl std::fmt::Debug for BlockHash {
    /// The first 8 bytes in hex (enough to tell names apart when debugging).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BlockHash({:08x}{:08x}..)", self.0[0], self.0[1])
    }
}

/// The reserved padding block.
pub const NULL_BLOCK: BlockId = 0;
/// The slot of a padding token in a slot mapping (the kernels skip negative slots).
pub const PAD_SLOT: i64 = -1;

const NIL: u32 = u32::MAX;

/// The most blocks one pool may have (2^24), device or host, checked when it is
/// created. A pool's bookkeeping is about 80 to 110 bytes a block (reference count,
/// free-queue links, the block's name, the prefix-cache map at load at most 1/2),
/// 1.2 GiB at this cap, allocated at once; the cap keeps a size that passes
/// validation from asking for more memory than a host has (on a machine that
/// overcommits, such an allocation succeeds and the process is killed when it touches
/// the pages). 2^24 blocks of 16 tokens are 2^28 token slots: more than any GPU's
/// memory holds for a real model, and swap space of that many blocks is terabytes of
/// host memory for one.
pub const MAX_POOL_BLOCKS: u32 = 1 << 24;

/// Bytes of bookkeeping a pool of `num_blocks` blocks allocates (an upper bound).
pub fn pool_bookkeeping_bytes(num_blocks: u32) -> u64 {
    let n = num_blocks as u64;
    let map = (2 * n).next_power_of_two().max(16) * size_of::<[u64; 2]>() as u64;
    n * (3 * size_of::<u32>() + size_of::<NameSlot>()) as u64 + map
}

/// A pool's record of one block's name: all zeros for none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, bytemuck::Zeroable)]
#[repr(C, align(32))]
struct NameSlot([u32; 8]);

impl NameSlot {
    const NONE: Self = Self([0; 8]);

    fn is_some(&self) -> bool {
        self.0 != [0; 8]
    }

    fn get(&self) -> Option<BlockHash> {
        self.is_some().then_some(BlockHash(self.0))
    }

    fn take(&mut self) -> Option<BlockHash> {
        let h = self.get();
        *self = Self::NONE;
        h
    }
}

/// SHA-256's initial chaining value (FIPS 180-4, 5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// The first block of every chain: names the scheme, the block size and the salt.
const HEADER_TAG: &[u8; 24] = b"pagedkv/prefix-cache/v1\0";

/// One 64-byte block through SHA-256's compression function (SHA-NI where the CPU
/// has it: about 33 ns a block on the development VM, bound by its throughput, so two
/// chains interleaved are no faster).
#[inline]
fn compress(state: &mut [u32; 8], block: &[u8; 64]) {
    use sha2::digest::generic_array::GenericArray;
    sha2::compress256(state, std::slice::from_ref(GenericArray::from_slice(block)));
}

/// The name of a full block: the SHA-256 chaining value after its tokens, chained from
/// its parent's name, or for a sequence's first block from a header block naming the
/// scheme, the block size (`tokens.len()`) and the salt.
///
/// The chain is SHA-256's Merkle-Damgård iteration of its compression function over
/// `[header, block 0's tokens, block 1's tokens, ...]`, each block's token ids as
/// little-endian `u32`s zero-padded to a multiple of 64 bytes (unambiguous: the block
/// size is fixed by the header), without the final padding: a block of 16 tokens costs
/// one compression (about 32 ns with SHA-NI on the development VM, against some 110 ns
/// for a whole SHA-256 of parent digest and tokens, which has two and a finalisation).
/// Two different prefixes with the same name would give a collision of the
/// compression function (or a preimage of SHA-256's IV), which is what SHA-256's
/// collision resistance rests on: names cannot be forged. (The 64-bit XXH3 chain this
/// replaced could be searched offline for a collision with a known prompt's block; vLLM
/// treated that class as a security advisory, GHSA-rm76-4mrf-v9r8, and hashes with
/// SHA-256.) The salt separates tenants: chains of different salts never meet; with a
/// parent it is already in the chain and `salt` is not read.
pub fn hash_block(parent: Option<BlockHash>, tokens: &[u32], salt: Option<u64>) -> BlockHash {
    let mut state = match parent {
        Some(p) => p.0,
        None => {
            let mut header = [0u8; 64];
            header[..24].copy_from_slice(HEADER_TAG);
            header[24..28].copy_from_slice(&(tokens.len() as u32).to_le_bytes());
            if let Some(s) = salt {
                header[28] = 1;
                header[29..37].copy_from_slice(&s.to_le_bytes());
            }
            let mut state = SHA256_IV;
            compress(&mut state, &header);
            state
        }
    };
    let mut chunks = tokens.chunks_exact(16);
    let mut block = [0u8; 64];
    for c in &mut chunks {
        if cfg!(target_endian = "little") {
            // The tokens' own bytes, no copy.
            compress(&mut state, bytemuck::cast_slice(c).try_into().unwrap());
        } else {
            for (dst, t) in block.chunks_exact_mut(4).zip(c) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            compress(&mut state, &block);
        }
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        block = [0u8; 64];
        for (dst, t) in block.chunks_exact_mut(4).zip(rest) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        compress(&mut state, &block);
    }
    BlockHash(state)
}

/// The prefix-cache map, key → block, the key being the first 64 bits of a block's
/// [`BlockHash`] (the pool keeps each cached block's whole name and compares it on a
/// lookup): a flat open-addressing table (linear probing, backward-shift deletion)
/// preallocated for every block of the pool at load ≤ 1/2, so an insert or a lookup is
/// one or two cache lines whatever the map holds, and it never grows or rehashes. A
/// slot is `[key, block + 1]`; `block + 1 == 0` marks it empty (an all-zero table is
/// empty, so its pages are only touched as they fill).
#[derive(Clone, Debug)]
struct PrefixMap {
    slots: Vec<[u64; 2]>,
    shift: u32,
    len: usize,
}

impl PrefixMap {
    /// A map for at most `max_entries` entries; `None` when the allocation fails.
    fn new(max_entries: usize) -> Option<Self> {
        let cap = (2 * max_entries).next_power_of_two().max(16);
        let slots = try_zeroed_vec(cap)?;
        Some(Self {
            slots,
            shift: 64 - cap.trailing_zeros(),
            len: 0,
        })
    }

    fn home(&self, h: u64) -> usize {
        // Fibonacci hashing of the (already uniform) key: the top bits pick the slot.
        (h.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> self.shift) as usize
    }

    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Prefetches the slot where a probe for `h` starts.
    fn prefetch(&self, h: u64) {
        prefetch(&self.slots[self.home(h)]);
    }

    /// The slot holding `h`, or the empty slot where it would go.
    fn find(&self, h: u64) -> (usize, bool) {
        let mut i = self.home(h);
        loop {
            let [k, v] = self.slots[i];
            if v == 0 {
                return (i, false);
            }
            if k == h {
                return (i, true);
            }
            i = (i + 1) & self.mask();
        }
    }

    fn get(&self, h: u64) -> Option<BlockId> {
        match self.find(h) {
            (i, true) => Some((self.slots[i][1] - 1) as BlockId),
            _ => None,
        }
    }

    /// Inserts `h → b` unless key `h` is present; whether it did.
    fn insert(&mut self, h: u64, b: BlockId) -> bool {
        let (i, found) = self.find(h);
        if !found {
            debug_assert!(self.len < self.slots.len() / 2, "prefix map over capacity");
            self.slots[i] = [h, b as u64 + 1];
            self.len += 1;
        }
        !found
    }

    /// Removes `h` if it maps to `b`.
    fn remove_if(&mut self, h: u64, b: BlockId) {
        let (mut hole, found) = self.find(h);
        if !found || self.slots[hole][1] != b as u64 + 1 {
            return;
        }
        self.len -= 1;
        // Backward shift: move later entries of the run into the hole when their home
        // is not between the hole and them (cyclically), so no tombstones are needed.
        let mask = self.mask();
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let [k, v] = self.slots[j];
            if v == 0 {
                break;
            }
            let home = self.home(k);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = [k, v];
                hole = j;
            }
        }
        self.slots[hole] = [0, 0];
    }
}

/// A pool of blocks; see the module docs for its invariants.
#[derive(Clone, Debug)]
pub struct BlockPool {
    ref_cnt: Vec<u32>,
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    num_free: u32,
    reserve_null: bool,
    /// Each block's name while it is cached, all zeros when it is not (a real name of
    /// all zeros would take 2^256 tries to find); 32-byte aligned, so a registration or
    /// a lookup touches one cache line of it.
    names: Vec<NameSlot>,
    cached: PrefixMap,
    num_cached_free: u32,
    held_fill: u64,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks; with `reserve_null`, block 0 is the null block and
    /// `num_blocks - 1` are allocatable. Errors ([`Error::InvalidArgument`] naming
    /// `num_blocks`): fewer than 2 blocks (1 without `reserve_null`), more than
    /// [`MAX_POOL_BLOCKS`], or bookkeeping that cannot be allocated.
    pub fn new(num_blocks: u32, reserve_null: bool) -> Result<Self> {
        Self::named(num_blocks, reserve_null, "num_blocks")
    }

    /// [`new`](Self::new), its errors naming the caller's argument `arg`.
    pub(crate) fn named(num_blocks: u32, reserve_null: bool, arg: &'static str) -> Result<Self> {
        let min = if reserve_null { 2 } else { 1 };
        if num_blocks < min {
            return Err(Error::invalid(
                arg,
                format!("{num_blocks} (must be at least {min})"),
            ));
        }
        if num_blocks > MAX_POOL_BLOCKS {
            return Err(Error::invalid(
                arg,
                format!(
                    "{num_blocks} blocks: more than a pool may have ({MAX_POOL_BLOCKS}, MAX_POOL_BLOCKS; its bookkeeping alone would be {} bytes)",
                    pool_bookkeeping_bytes(num_blocks)
                ),
            ));
        }
        let n = num_blocks as usize;
        let oom = || {
            Error::invalid(
                arg,
                format!(
                    "{num_blocks} blocks: their bookkeeping ({} bytes) could not be allocated",
                    pool_bookkeeping_bytes(num_blocks)
                ),
            )
        };
        let mut p = BlockPool {
            ref_cnt: try_zeroed_vec(n).ok_or_else(oom)?,
            prev: try_huge_vec(n, NIL).ok_or_else(oom)?,
            next: try_huge_vec(n, NIL).ok_or_else(oom)?,
            head: NIL,
            tail: NIL,
            num_free: 0,
            reserve_null,
            names: try_zeroed_vec(n).ok_or_else(oom)?,
            cached: PrefixMap::new(n).ok_or_else(oom)?,
            num_cached_free: 0,
            held_fill: 0,
        };
        let first = if reserve_null {
            p.ref_cnt[0] = 1;
            1
        } else {
            0
        };
        for b in first..num_blocks {
            p.push_back(b);
        }
        Ok(p)
    }

    /// Blocks in the pool, the null block included.
    pub fn num_blocks(&self) -> u32 {
        self.ref_cnt.len() as u32
    }

    /// Blocks that can ever be allocated.
    pub fn num_usable(&self) -> u32 {
        self.num_blocks() - self.reserve_null as u32
    }

    /// Blocks in the free queue (cached ones included: they are evictable).
    pub fn num_free(&self) -> u32 {
        self.num_free
    }

    /// Blocks held by at least one table.
    pub fn num_used(&self) -> u32 {
        self.num_usable() - self.num_free
    }

    /// Free blocks that still hold a prefix-cache entry.
    pub fn num_cached_free(&self) -> u32 {
        self.num_cached_free
    }

    /// Entries in the prefix-cache map (held or free).
    pub fn num_cached(&self) -> usize {
        self.cached.len
    }

    /// The reference count of `b`; [`Error::Unknown`] for an id outside the pool.
    pub fn ref_cnt(&self, b: BlockId) -> Result<u32> {
        self.check_id(b)?;
        Ok(self.ref_cnt[b as usize])
    }

    /// The reference count of a block id the caller knows is in the pool.
    pub(super) fn rc(&self, b: BlockId) -> u32 {
        self.ref_cnt[b as usize]
    }

    /// [`Error::Unknown`] unless `b` names a block of this pool.
    fn check_id(&self, b: BlockId) -> Result<()> {
        if (b as usize) < self.ref_cnt.len() {
            Ok(())
        } else {
            Err(Error::Unknown {
                what: "block",
                id: b as u64,
            })
        }
    }

    /// [`Error::InvalidState`] unless `b` is held (`ref_cnt > 0`) and not the null block.
    fn check_held(&self, b: BlockId, what: &str) -> Result<()> {
        self.check_id(b)?;
        if self.ref_cnt[b as usize] == 0 {
            return Err(Error::InvalidState(format!("{what} of free block {b}")));
        }
        Ok(())
    }

    /// Token slots holding data, summed over held blocks.
    pub fn held_fill(&self) -> u64 {
        self.held_fill
    }

    /// The prefix-cache hash of `b`, if it is cached; [`Error::Unknown`] for an id
    /// outside the pool.
    pub fn block_hash(&self, b: BlockId) -> Result<Option<BlockHash>> {
        self.check_id(b)?;
        Ok(self.names[b as usize].get())
    }

    fn is_null(&self, b: BlockId) -> bool {
        self.reserve_null && b == NULL_BLOCK
    }

    fn push_back(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.num_free += 1;
        if self.names[i].is_some() {
            self.num_cached_free += 1;
        }
    }

    /// Puts free block `b` at the head of the free queue (taken next).
    fn push_front(&mut self, b: BlockId) {
        let i = b as usize;
        debug_assert!(!self.names[i].is_some(), "a cached block goes to the tail");
        self.prev[i] = NIL;
        self.next[i] = self.head;
        if self.head == NIL {
            self.tail = b;
        } else {
            self.prev[self.head as usize] = b;
        }
        self.head = b;
        self.num_free += 1;
    }

    fn unlink(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.num_free -= 1;
        if self.names[i].is_some() {
            self.num_cached_free -= 1;
        }
    }

    /// Takes the least recently freed block (evicting its cache entry, if any) with
    /// `ref_cnt = 1` and no data. Running out is [`Error::OutOfBlocks`].
    pub fn allocate(&mut self) -> Result<BlockId> {
        let b = self.head;
        if b == NIL {
            return Err(Error::OutOfBlocks { needed: 1, free: 0 });
        }
        self.unlink(b);
        if let Some(h) = self.names[b as usize].take() {
            self.cached.remove_if(h.key(), b);
        }
        self.ref_cnt[b as usize] = 1;
        Ok(b)
    }

    /// Undoes the [`allocate`](Self::allocate) of `b`, held once and holding `fill`
    /// tokens: `b` goes back to the head of the free queue, hash-less. When the
    /// allocations since were undone first (last in, first out) and the pool changed
    /// otherwise only by operations on held blocks, the queue is exactly as before the
    /// allocation. A cached block the allocation evicted stays evicted: the step
    /// wrote into it, so its name no longer names its contents.
    pub(crate) fn unallocate(&mut self, b: BlockId, fill: u32) {
        debug_assert_eq!(self.ref_cnt[b as usize], 1, "unallocate of a shared block");
        self.ref_cnt[b as usize] = 0;
        self.held_fill -= fill as u64;
        self.push_front(b);
    }

    /// Adds a reference to a held block (a fork sharing it). The null block is a
    /// no-op. Errors, changing nothing: an id outside the pool ([`Error::Unknown`]), a
    /// free block or a count at `u32::MAX` ([`Error::InvalidState`]).
    pub fn incref(&mut self, b: BlockId) -> Result<()> {
        if self.is_null(b) {
            return Ok(());
        }
        self.check_held(b, "incref")?;
        if self.ref_cnt[b as usize] == u32::MAX {
            return Err(Error::InvalidState(format!(
                "reference count of block {b} would overflow"
            )));
        }
        self.share(b);
        Ok(())
    }

    /// [`incref`](Self::incref) of a block the caller knows is held.
    pub(super) fn share(&mut self, b: BlockId) {
        if self.is_null(b) {
            return;
        }
        debug_assert!(self.ref_cnt[b as usize] > 0, "incref of free block {b}");
        self.ref_cnt[b as usize] += 1;
    }

    /// Drops a reference to `b`, which holds `fill` tokens; at zero the block joins
    /// the free queue: at the tail when it is cached (keeping its cache entry, so it
    /// stays reusable until evicted), at the head when it holds nothing reusable. The null block is a no-op. Errors, changing nothing: an id outside the
    /// pool ([`Error::Unknown`]), a free block (a double free, [`Error::InvalidState`]),
    /// a last reference whose `fill` exceeds the held fill ([`Error::InvalidArgument`]).
    pub fn free(&mut self, b: BlockId, fill: u32) -> Result<()> {
        if self.is_null(b) {
            return Ok(());
        }
        self.check_held(b, "free")?;
        if self.ref_cnt[b as usize] == 1 && fill as u64 > self.held_fill {
            return Err(Error::invalid(
                "fill",
                format!(
                    "{fill} tokens, but held blocks hold {} in all",
                    self.held_fill
                ),
            ));
        }
        self.release(b, fill);
        Ok(())
    }

    /// [`free`](Self::free) of a block the caller knows is held.
    pub(super) fn release(&mut self, b: BlockId, fill: u32) {
        if self.is_null(b) {
            return;
        }
        let i = b as usize;
        debug_assert!(self.ref_cnt[i] > 0, "double free of block {b}");
        self.ref_cnt[i] -= 1;
        if self.ref_cnt[i] == 0 {
            self.held_fill -= fill as u64;
            if self.names[i].is_some() {
                self.push_back(b);
            } else {
                self.push_front(b);
            }
        }
    }

    /// The block cached under `h`, if any, without taking a reference.
    pub fn lookup(&self, h: BlockHash) -> Option<BlockId> {
        // The map's key is 64 bits of the name: a block that only shares the key
        // (found by chance or by search) is no hit.
        self.cached
            .get(h.key())
            .filter(|&b| self.names[b as usize].get() == Some(h))
    }

    /// Takes a reference to cached block `b` (a prefix hit), which holds `fill`
    /// tokens: out of the free queue if it was free. Errors, changing nothing: an id
    /// outside the pool ([`Error::Unknown`]), the null block or a count at `u32::MAX`
    /// ([`Error::InvalidState`]).
    pub fn touch(&mut self, b: BlockId, fill: u32) -> Result<()> {
        self.check_id(b)?;
        if self.is_null(b) || self.ref_cnt[b as usize] == u32::MAX {
            return Err(Error::InvalidState(format!("touch of block {b}")));
        }
        self.take(b, fill);
        Ok(())
    }

    /// [`touch`](Self::touch) of a block the caller knows is a valid, non-null id.
    pub(super) fn take(&mut self, b: BlockId, fill: u32) {
        let i = b as usize;
        if self.ref_cnt[i] == 0 {
            self.unlink(b);
            self.held_fill += fill as u64;
        }
        self.ref_cnt[i] += 1;
    }

    /// Registers held block `b` as holding the full block named `h`. A hash already
    /// cached under another block keeps that block (the first copy wins), and a block
    /// already cached keeps its hash. Errors, changing nothing: an id outside the pool
    /// ([`Error::Unknown`]), a free block or the null block ([`Error::InvalidState`]).
    pub fn cache(&mut self, b: BlockId, h: BlockHash) -> Result<()> {
        self.check_held(b, "cache")?;
        if self.is_null(b) {
            return Err(Error::InvalidState("cache of the null block".into()));
        }
        if h == BlockHash([0; 8]) {
            // The pool's record of "no name" (no chain makes it but by a 2^-256 chance).
            return Err(Error::invalid("h", "the all-zero name is reserved"));
        }
        self.register(b, h);
        Ok(())
    }

    /// Prefetches what [`register`](Self::register) of `(b, h)` reads, so a batch of
    /// registrations waits for its cache misses together rather than one by one.
    pub(super) fn prefetch_register(&self, b: BlockId, h: BlockHash) {
        prefetch(&self.names[b as usize]);
        self.cached.prefetch(h.key());
    }

    /// [`cache`](Self::cache) of a block the caller knows is held and not null.
    pub(super) fn register(&mut self, b: BlockId, h: BlockHash) {
        let i = b as usize;
        if !self.names[i].is_some() && self.cached.insert(h.key(), b) {
            self.names[i] = NameSlot(h.0);
        }
    }

    /// Drops every prefix-cache entry (vLLM's `reset_prefix_cache`: after a weight
    /// update every cached block holds stale K/V): no block is a hit any more, and
    /// every free block is hash-less. Refused ([`Error::InvalidState`], nothing
    /// changed) while any block is held: a running sequence's blocks would keep the
    /// stale hashes its later commits chain from.
    pub fn reset_prefix_cache(&mut self) -> Result<()> {
        if self.num_used() > 0 {
            return Err(Error::InvalidState(format!(
                "reset_prefix_cache with {} blocks in use: finish or abort the running requests first",
                self.num_used()
            )));
        }
        self.cached.slots.fill([0, 0]);
        self.cached.len = 0;
        self.names.fill(NameSlot::NONE);
        self.num_cached_free = 0;
        Ok(())
    }

    /// Records `n` fewer token slots holding data in held blocks (a rollback of
    /// rejected speculative tokens).
    pub(crate) fn sub_fill(&mut self, n: u32) {
        self.held_fill = self.held_fill.saturating_sub(n as u64);
    }

    /// Records `n` more token slots holding data in held blocks.
    pub fn add_fill(&mut self, n: u32) {
        self.held_fill = self.held_fill.saturating_add(n as u64);
    }

    /// Blocks in free-queue order (taken first first: the hash-less ones, then the
    /// cached ones least recently freed first). O(n); for tests and debugging.
    pub fn free_queue(&self) -> Vec<BlockId> {
        let mut v = Vec::with_capacity(self.num_free as usize);
        let mut b = self.head;
        while b != NIL {
            v.push(b);
            b = self.next[b as usize];
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// The chain is SHA-256's own iteration: finishing a chain with SHA-256's padding
    /// gives the SHA-256 digest (from the `sha2` crate's hasher) of the header block
    /// and the zero-padded token blocks, for block sizes of 1, 8, 16, 32 and 40 tokens.
    #[test]
    fn the_chain_is_sha256s_compression_iteration() {
        use sha2::{Digest, Sha256};
        for bs in [1usize, 8, 16, 32, 40] {
            let tokens: Vec<u32> = (0..3 * bs as u32)
                .map(|t| t.wrapping_mul(2_654_435_761))
                .collect();
            let raw_salt = 0x1234_5678_9abc_def0u64;
            let salt = Some(raw_salt);
            let mut h = None;
            let mut msg = Vec::new();
            let mut header = [0u8; 64];
            header[..24].copy_from_slice(HEADER_TAG);
            header[24..28].copy_from_slice(&(bs as u32).to_le_bytes());
            header[28] = 1;
            header[29..37].copy_from_slice(&raw_salt.to_le_bytes());
            msg.extend_from_slice(&header);
            for block in tokens.chunks(bs) {
                h = Some(hash_block(h, block, salt));
                let mut bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
                bytes.resize(bytes.len().div_ceil(64) * 64, 0);
                msg.extend_from_slice(&bytes);
            }
            // SHA-256's final padding of a message of whole 64-byte blocks.
            let mut state = h.unwrap().0;
            let mut pad = [0u8; 64];
            pad[0] = 0x80;
            pad[56..].copy_from_slice(&(msg.len() as u64 * 8).to_be_bytes());
            compress(&mut state, &pad);
            let digest: Vec<u8> = state.iter().flat_map(|w| w.to_be_bytes()).collect();
            assert_eq!(digest, Sha256::digest(&msg).to_vec(), "block size {bs}");
        }
    }

    /// A name depends on every token, the parent, the salt (for a first block) and the
    /// block size, and survives `to_bytes` / `from_bytes`.
    #[test]
    fn names_depend_on_every_token_the_parent_salt_and_block_size() {
        let t: Vec<u32> = (100..116).collect();
        let base = hash_block(None, &t, None);
        let mut seen = vec![base];
        for i in 0..t.len() {
            let mut u = t.clone();
            u[i] ^= 1;
            seen.push(hash_block(None, &u, None));
        }
        seen.push(hash_block(None, &t, Some(0)));
        seen.push(hash_block(None, &t, Some(1)));
        seen.push(hash_block(Some(base), &t, None));
        seen.push(hash_block(None, &t[..8], None));
        let mut padded = t[..8].to_vec();
        padded.extend([0; 8]);
        // Zero padding is not confused with zero tokens: the block size is in the header.
        assert_ne!(
            hash_block(None, &t[..8], None),
            hash_block(None, &padded, None)
        );
        for (i, a) in seen.iter().enumerate() {
            assert_eq!(BlockHash::from_bytes(a.to_bytes()), *a);
            for b in &seen[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    /// The prefix map is keyed by 64 bits of a name, but a lookup compares the whole
    /// name: a name that shares only the key (found by a search: the old 64-bit XXH3
    /// chain could be searched offline for a collision with a known prompt's block) is
    /// never a hit, and cannot take the key's place.
    #[test]
    fn a_name_that_shares_only_the_map_key_is_never_a_hit() {
        let mut p = BlockPool::new(8, true).unwrap();
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        let h = hash_block(None, &[1, 2, 3, 4], Some(7));
        let mut forged = h;
        forged.0[7] ^= 1;
        assert_eq!(forged.key(), h.key());
        p.cache(a, h).unwrap();
        assert_eq!(p.lookup(h), Some(a));
        assert_eq!(p.lookup(forged), None);
        p.cache(b, forged).unwrap();
        assert_eq!(
            p.lookup(forged),
            None,
            "the key is taken: first registered wins"
        );
        assert_eq!(p.lookup(h), Some(a));
        assert_eq!(p.block_hash(b).unwrap(), None);
        // The all-zero name is the pool's "none": refused, so no map entry outlives
        // its block's name.
        let zero = BlockHash::from_bytes([0; 32]);
        assert!(matches!(
            p.cache(b, zero),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(p.num_cached(), 1);
    }

    #[test]
    fn prefix_map_matches_a_hash_map() {
        // Few home slots (many collisions, wrapped runs): keys differ in low bits only
        // after the multiply, and removals shift runs back.
        let mut m = PrefixMap::new(64).unwrap();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let mut x = 12345u64;
        for step in 0..20_000u32 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = x % 97; // a small key space: repeats, hits and misses
            if x.is_multiple_of(3) || model.len() >= 64 {
                let b = model.get(&key).copied().unwrap_or(step % 5);
                m.remove_if(key, b);
                model.remove(&key);
            } else {
                let inserted = m.insert(key, step);
                assert_eq!(inserted, !model.contains_key(&key));
                model.entry(key).or_insert(step);
            }
            assert_eq!(m.len, model.len());
            for k in 0..97 {
                assert_eq!(m.get(k), model.get(&k).copied(), "key {k} at step {step}");
            }
        }
    }
}
