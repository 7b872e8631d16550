//! [`Entries`]: a block table's block ids and prefix-cache hashes, in one allocation.
//!
//! A scheduler keeps each running sequence's table in one 64-byte record, next to
//! its request id, so that a step's common decode reads and writes one cache line
//! per sequence (see `scheduler::seqs`). Two `Vec`s (32 bytes of header each) did not
//! fit; one boxed slice (24 bytes) and two counts do. The slice holds `9k` words:
//! the first `k` hold `2k` block ids (two `u32`s a word, read as one `&[BlockId]`),
//! the next `8k` the `2k` hashes (a [`BlockHash`] is 32 bytes, 4 words), so both have
//! room for `2k` entries.
//!
//! Everything here is safe code: the ids are viewed through `bytemuck`.

use allocator_api2::boxed::Box as ABox;
use allocator_api2::vec::Vec as AVec;

use crate::block::pool::{BlockHash, BlockId};
use crate::mem::{SeqAlloc, same_alloc};

/// Words a [`BlockHash`] takes.
const HASH_WORDS: usize = size_of::<BlockHash>() / size_of::<u64>();

/// A table's entries and hashes, each with room for [`capacity`](Self::capacity).
pub(crate) struct Entries {
    /// `[k words of ids (2k ids), 2k hashes of HASH_WORDS words]`.
    buf: ABox<[u64], SeqAlloc>,
    blocks: u32,
    hashes: u32,
}

impl std::fmt::Debug for Entries {
    /// The ids and hashes (not the packed storage).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entries")
            .field("blocks", &self.blocks())
            .field("hashes", &self.hashes())
            .finish()
    }
}

impl PartialEq for Entries {
    /// The same ids and hashes (room and allocator aside).
    fn eq(&self, other: &Self) -> bool {
        self.blocks() == other.blocks() && self.hashes() == other.hashes()
    }
}

impl Eq for Entries {}

impl Entries {
    /// No entries, no room, no allocation; grows with `alloc`.
    pub(crate) fn new_in(alloc: SeqAlloc) -> Self {
        Self::with_room(0, alloc)
    }

    /// Room for `n` entries and hashes (rounded up to an even number), from `alloc`.
    fn with_room(n: usize, alloc: SeqAlloc) -> Self {
        let k = n.div_ceil(2);
        let words = k
            .checked_mul(1 + 2 * HASH_WORDS)
            .expect("table capacity overflows");
        let mut v = AVec::with_capacity_in(words, alloc);
        v.resize(words, 0u64);
        Self {
            buf: v.into_boxed_slice(),
            blocks: 0,
            hashes: 0,
        }
    }

    /// Words holding ids (half the capacity).
    fn k(&self) -> usize {
        self.buf.len() / (1 + 2 * HASH_WORDS)
    }

    /// The hash region, as hashes (room for the capacity).
    fn hash_room(&self) -> &[BlockHash] {
        bytemuck::cast_slice(&self.buf[self.k()..])
    }

    fn hash_room_mut(&mut self) -> &mut [BlockHash] {
        let k = self.k();
        bytemuck::cast_slice_mut(&mut self.buf[k..])
    }

    /// Entries (and hashes) it holds without moving.
    pub(crate) fn capacity(&self) -> usize {
        2 * self.k()
    }

    /// The allocator its storage comes from.
    pub(crate) fn allocator(&self) -> &SeqAlloc {
        ABox::allocator(&self.buf)
    }

    /// How many block ids it holds.
    pub(crate) fn num_blocks(&self) -> usize {
        self.blocks as usize
    }

    /// How many hashes it holds.
    pub(crate) fn num_hashes(&self) -> usize {
        self.hashes as usize
    }

    /// The last hash, if any.
    pub(crate) fn last_hash(&self) -> Option<BlockHash> {
        let n = self.hashes as usize;
        (n > 0).then(|| self.hash_room()[n - 1])
    }

    /// The block ids.
    pub(crate) fn blocks(&self) -> &[BlockId] {
        &bytemuck::cast_slice::<u64, u32>(&self.buf[..self.k()])[..self.blocks as usize]
    }

    /// The block ids, writable.
    pub(crate) fn blocks_mut(&mut self) -> &mut [BlockId] {
        let (k, n) = (self.k(), self.blocks as usize);
        &mut bytemuck::cast_slice_mut::<u64, u32>(&mut self.buf[..k])[..n]
    }

    /// The hashes.
    pub(crate) fn hashes(&self) -> &[BlockHash] {
        &self.hash_room()[..self.hashes as usize]
    }

    /// Where id `i` is (or would be): for prefetching; may point past the storage.
    pub(crate) fn block_ptr(&self, i: usize) -> *const BlockId {
        self.buf.as_ptr().cast::<BlockId>().wrapping_add(i)
    }

    /// Where hash `i` is (or would be): for prefetching; may point past the storage.
    pub(crate) fn hash_ptr(&self, i: usize) -> *const BlockHash {
        self.buf
            .as_ptr()
            .wrapping_add(self.k())
            .cast::<BlockHash>()
            .wrapping_add(i)
    }

    /// Appends block id `b` (doubling the room when it is full).
    pub(crate) fn push_block(&mut self, b: BlockId) {
        let n = self.blocks as usize;
        self.grow_for(n + 1);
        let (word, half) = (n / 2, n % 2);
        // The id's half of its word, as the `u32` view of `blocks` reads it.
        let w = &mut self.buf[word];
        let mut pair: [u32; 2] = bytemuck::cast(*w);
        pair[half] = b;
        *w = bytemuck::cast(pair);
        self.blocks += 1;
    }

    /// Drops the last block id (one without a hash).
    pub(crate) fn pop_block(&mut self) {
        assert!(self.blocks > self.hashes, "pop of a named block");
        self.blocks -= 1;
    }

    /// Appends hash `h` (doubling the room when it is full).
    pub(crate) fn push_hash(&mut self, h: BlockHash) {
        let n = self.hashes as usize;
        self.grow_for(n + 1);
        self.hash_room_mut()[n] = h;
        self.hashes += 1;
    }

    /// Overwrites hash `i` (one it holds).
    pub(crate) fn set_hash(&mut self, i: usize, h: BlockHash) {
        assert!(i < self.hashes as usize, "hash {i} of {}", self.hashes);
        self.hash_room_mut()[i] = h;
    }

    /// Makes room for `n` entries, doubling (at least) when it has less.
    fn grow_for(&mut self, n: usize) {
        if n > self.capacity() {
            let alloc = self.allocator().clone();
            self.move_to(&alloc, n.max(2 * self.capacity()).max(4));
        }
    }

    /// Moves the contents to new storage with room for `n` entries (at least those
    /// it holds) from `alloc`.
    fn move_to(&mut self, alloc: &SeqAlloc, n: usize) {
        let (b, h) = (self.blocks as usize, self.hashes as usize);
        let mut new = Self::with_room(n.max(b).max(h), alloc.clone());
        let k = new.k();
        bytemuck::cast_slice_mut::<u64, u32>(&mut new.buf[..k])[..b].copy_from_slice(self.blocks());
        new.hash_room_mut()[..h].copy_from_slice(self.hashes());
        (new.blocks, new.hashes) = (self.blocks, self.hashes);
        *self = new;
    }

    /// Makes room for `n` entries *in all*, allocated by `alloc` from now on (moved
    /// if it had less room or another allocator).
    pub(crate) fn reserve_in(&mut self, alloc: &SeqAlloc, n: usize) {
        if self.capacity() < n || !same_alloc(self.allocator(), alloc) {
            self.move_to(alloc, n.max(self.capacity()));
        }
    }

    /// A copy with the same room, from the same allocator.
    pub(crate) fn duplicate(&self) -> Self {
        let mut c = Self::with_room(self.capacity(), self.allocator().clone());
        c.buf.copy_from_slice(&self.buf);
        (c.blocks, c.hashes) = (self.blocks, self.hashes);
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A distinct hash for `i`.
    fn name(i: u32) -> BlockHash {
        crate::block::hash_block(None, &[i], None)
    }

    /// Ids and hashes read back in order through growth, moves and copies, and
    /// neither overwrites the other.
    #[test]
    fn ids_and_hashes_keep_their_contents_through_growth_and_moves() {
        for alloc in [SeqAlloc::Global, SeqAlloc::arena()] {
            let mut e = Entries::new_in(alloc.clone());
            assert_eq!(
                (e.blocks(), e.hashes(), e.capacity()),
                (&[][..], &[][..], 0)
            );
            for i in 0..300u32 {
                e.push_block(i * 3 + 1);
                if i % 3 != 2 {
                    e.push_hash(name(i));
                }
                assert!(e.capacity() >= e.blocks().len());
            }
            let ids: Vec<u32> = (0..300).map(|i| i * 3 + 1).collect();
            let hashes: Vec<BlockHash> = (0..300u32).filter(|i| i % 3 != 2).map(name).collect();
            assert_eq!(e.blocks(), &ids[..]);
            assert_eq!(e.hashes(), &hashes[..]);
            let c = e.duplicate();
            assert_eq!((c.blocks(), c.hashes()), (e.blocks(), e.hashes()));
            assert_eq!(c.capacity(), e.capacity());
            let at = e.blocks().as_ptr();
            e.reserve_in(&alloc, 10);
            assert_eq!(e.blocks().as_ptr(), at, "enough room: no move");
            e.reserve_in(&alloc, 1001);
            assert!(e.capacity() >= 1001);
            assert_eq!((e.blocks(), e.hashes()), (&ids[..], &hashes[..]));
            e.blocks_mut()[7] = 99;
            assert_eq!(e.blocks()[7], 99);
            assert!(format!("{e:?}").starts_with("Entries { blocks: [1, 4, 7, 10,"));
            assert_eq!(e.hashes(), &hashes[..]);
        }
    }
}
