//! [`SeqAlloc`]: where a sequence's own growing arrays live (its block table's entries
//! and hashes, its token history).
//!
//! A scheduler step at a large batch touches a little of every sequence's own arrays:
//! a new block entry and hash once every `block_size` steps, a line of its token
//! history once every 16. Allocated one by one from the global allocator, those arrays are spread
//! over thousands of 4 KiB pages, so nearly every such touch misses the TLB, and on a
//! virtual machine a TLB miss walks two page tables. Allocated from an [`Arena`]
//! (2 MiB slabs, advised to transparent huge pages), 16384 sequences' arrays need a
//! few hundred TLB entries.
//!
//! The arena is a size-class allocator: a request is rounded up to one of four sizes
//! per power of two (at most 25% more), from 64 bytes to 1 MiB, and served from that
//! class's free list or carved from the current slab; blocks from 256 bytes start on a
//! cache line. Slabs are fresh memory from the system (`pages`: memory the global
//! allocator recycles may already sit on 4 KiB pages, whatever it is advised), and
//! those after the first are advised to huge pages. A larger request (the scheduler's
//! per-slot arrays at thousands of sequences) gets 2 MiB-aligned huge pages of its
//! own, returned to the system when it is freed; zero-sized ones, and small ones
//! aligned to more than 16 bytes, go to the global allocator. Freed blocks go back to
//! their class's free list; the
//! slabs are returned to the system when the last handle on the arena drops (a
//! scheduler's tables and histories hold handles, so that is after the last of them).
//!
//! [`SeqAlloc`] is the allocator type of those arrays: [`SeqAlloc::Global`] for a
//! table a caller creates ([`BlockTable::new`](crate::block::BlockTable::new)), or an
//! arena the scheduler made.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use allocator_api2::alloc::{AllocError, Allocator, Global};

use super::pages::{HUGE, alloc_pages, free_pages};

/// Bytes in a slab (a transparent huge page on x86-64 Linux).
const SLAB: usize = HUGE;
/// The largest request an arena serves itself.
const MAX_SIZE: usize = 1 << 20;
/// The largest alignment an arena serves itself (every class size is a multiple).
const MAX_ALIGN: usize = 16;
/// Size classes: 64 bytes, then four per power of two up to `MAX_SIZE`.
const CLASSES: usize = 1 + 4 * (MAX_SIZE.trailing_zeros() as usize - 6);

/// The class of a request of `size` bytes (`1..=MAX_SIZE`).
fn class_of(size: usize) -> usize {
    if size <= 64 {
        return 0;
    }
    let k = (usize::BITS - 1 - (size - 1).leading_zeros()) as usize; // 2^k < size ≤ 2^(k+1)
    let q = 1 << (k - 2);
    let m = (size - (1 << k)).div_ceil(q); // 1..=4
    1 + (k - 6) * 4 + (m - 1)
}

/// The bytes of every block of class `c`.
fn class_size(c: usize) -> usize {
    if c == 0 {
        return 64;
    }
    let (k, m) = ((c - 1) / 4 + 6, (c - 1) % 4 + 1);
    (1 << k) + m * (1 << (k - 2))
}

/// The bytes between the starts of consecutive blocks of class `c` carved from a slab:
/// from 256 bytes, the class's size and one cache line more. Without it, the blocks of
/// one class start at multiples of its size, often of 4 KiB: the same offset of many
/// blocks (the ends of histories of equal length, appended to every step) then falls
/// in a handful of the caches' sets and evicts itself; with it, each block's lines
/// fall one set further than the last block's.
fn stride(c: usize) -> usize {
    let size = class_size(c);
    if size >= 256 { size + 64 } else { size }
}

/// The arena's state; addresses are kept as `usize` (they are only handed out and
/// taken back, never read through here).
#[derive(Debug)]
struct Inner {
    /// Base addresses of the slabs (each `SLAB` bytes, `SLAB`-aligned).
    slabs: Vec<usize>,
    /// The unused part of the newest slab.
    bump: usize,
    end: usize,
    /// Freed blocks of each class.
    free: Vec<Vec<usize>>,
    /// Bytes of the live requests above the classes (slabs of their own).
    large: usize,
}

/// A size-class allocator over huge-page slabs (see the module docs).
pub(crate) struct Arena {
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Arena {
    /// What it holds, not its addresses and free lists (a scheduler's `Debug` prints it).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arena {{ held: {} bytes }}", self.held())
    }
}

impl Arena {
    /// An empty arena (no slab until the first request).
    pub(crate) fn new() -> Self {
        Self {
            inner: Mutex::new(Inner {
                slabs: Vec::new(),
                bump: 0,
                end: 0,
                free: vec![Vec::new(); CLASSES],
                large: 0,
            }),
        }
    }

    /// Bytes the arena holds from the system: its slabs (carved blocks, in use or
    /// free) and the live requests above the classes.
    pub(crate) fn held(&self) -> usize {
        let s = self.lock();
        s.slabs.len() * SLAB + s.large
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // The state is consistent between statements: a panic elsewhere while the lock
        // was held (none can happen inside) leaves nothing half done.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A block of class `c`: a freed one, or carved from the newest slab (a new slab
    /// when it has no room left).
    fn take(&self, c: usize) -> Option<NonNull<u8>> {
        let mut s = self.lock();
        if let Some(p) = s.free[c].pop() {
            return NonNull::new(p as *mut u8);
        }
        let size = stride(c);
        // Blocks from 256 bytes start on a cache line (whole lines of a history can
        // then be written without reading them; see `LineWriter`).
        let align = if size >= 256 { 64 } else { MAX_ALIGN };
        if s.end - s.bump.next_multiple_of(align).min(s.end) < size {
            // The first slab is not advised to huge pages: a small scheduler does not
            // pay for a 2 MiB page (zeroed on its first touch) it does not fill.
            let base = alloc_pages(SLAB, !s.slabs.is_empty())?.as_ptr() as usize;
            s.slabs.push(base);
            (s.bump, s.end) = (base, base + SLAB);
        }
        let p = s.bump.next_multiple_of(align);
        s.bump = p + size;
        NonNull::new(p as *mut u8)
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        let s = self.inner.get_mut().unwrap_or_else(|e| e.into_inner());
        for &base in &s.slabs {
            // SAFETY: `base` came from `alloc_pages(SLAB, _)` in `take`, and is freed
            // once (the arena is dropped once). No block carved from it is in use:
            // every array allocated from the arena holds a handle on it (an `Arc`), so
            // the arena drops only after the last of them.
            unsafe { free_pages(NonNull::new_unchecked(base as *mut u8), SLAB) };
        }
    }
}

/// The allocator of a sequence's growing arrays: the global allocator, or an arena.
/// Cloning an arena handle shares the arena.
#[derive(Clone, Debug, Default)]
pub(crate) enum SeqAlloc {
    /// The global allocator.
    #[default]
    Global,
    /// A scheduler's arena (see the module docs).
    Arena(Arc<Arena>),
}

/// Whether `a` and `b` allocate alike: both global, or the same arena.
pub(crate) fn same_alloc(a: &SeqAlloc, b: &SeqAlloc) -> bool {
    match (a, b) {
        (SeqAlloc::Global, SeqAlloc::Global) => true,
        (SeqAlloc::Arena(x), SeqAlloc::Arena(y)) => Arc::ptr_eq(x, y),
        _ => false,
    }
}

impl SeqAlloc {
    /// Bytes its arena holds from the system ([`Arena::held`]); 0 for `Global`.
    pub(crate) fn held(&self) -> usize {
        match self {
            SeqAlloc::Global => 0,
            SeqAlloc::Arena(a) => a.held(),
        }
    }

    /// A handle on a new, empty arena.
    pub(crate) fn arena() -> Self {
        SeqAlloc::Arena(Arc::new(Arena::new()))
    }

    /// How an arena serves requests of `layout` (a pure function of the layout, so
    /// a deallocation takes the route of its allocation).
    fn route(layout: Layout) -> Route {
        let size = layout.size();
        if size == 0 || layout.align() > SLAB {
            Route::Global
        } else if size <= MAX_SIZE {
            if layout.align() <= MAX_ALIGN {
                Route::Class(class_of(size))
            } else {
                Route::Global
            }
        } else {
            match Layout::from_size_align(size.next_multiple_of(SLAB), SLAB) {
                Ok(whole) => Route::Slabs(whole),
                Err(_) => Route::Global,
            }
        }
    }
}

/// Where an arena serves a request from.
enum Route {
    /// A block of this size class.
    Class(usize),
    /// Whole slabs of its own (a request larger than the classes: a large per-slot
    /// array), allocated with this layout.
    Slabs(Layout),
    /// The global allocator (zero-sized or over-aligned requests).
    Global,
}

// SAFETY (the `Allocator` contract):
// 1. A block returned by `allocate` is valid for `layout.size()` bytes (the arena's
//    blocks hold `class_size(class_of(size)) >= size` bytes, and the slice we return
//    is exactly that long), aligned to `layout.align()` (class sizes are multiples of
//    16, slabs are 2 MiB-aligned and carved from their start, so every block is
//    16-aligned; a small request aligned to more goes to `Global`, a large one gets
//    2 MiB-aligned slabs), and stays valid until it is
//    deallocated or the allocator and all its clones are dropped (the arena frees its
//    slabs only when its last handle drops).
//    Requests above the classes get whole 2 MiB-aligned slabs of their own (the
//    size rounded up to a multiple of 2 MiB), returned as that many bytes.
// 2. `deallocate` of a block from `allocate` of a clone of this allocator with a layout
//    that fits it takes the allocation's route (`route`): any size between the
//    requested one and the returned length has the same class (a class's size belongs
//    to it), or rounds up to the same multiple of 2 MiB, with the same alignment.
// 3. Clones share one arena (an `Arc`), so a block may be freed through any of them.
unsafe impl Allocator for SeqAlloc {
    fn allocate(&self, layout: Layout) -> Result<NonNull<[u8]>, AllocError> {
        match (self, Self::route(layout)) {
            (SeqAlloc::Arena(arena), Route::Class(c)) => {
                let p = arena.take(c).ok_or(AllocError)?;
                Ok(NonNull::slice_from_raw_parts(p, class_size(c)))
            }
            (SeqAlloc::Arena(arena), Route::Slabs(whole)) => {
                let p = alloc_pages(whole.size(), true).ok_or(AllocError)?;
                arena.lock().large += whole.size();
                Ok(NonNull::slice_from_raw_parts(p, whole.size()))
            }
            _ => Global.allocate(layout),
        }
    }

    unsafe fn deallocate(&self, ptr: NonNull<u8>, layout: Layout) {
        match (self, Self::route(layout)) {
            (SeqAlloc::Arena(arena), Route::Class(c)) => {
                arena.lock().free[c].push(ptr.as_ptr() as usize);
            }
            // SAFETY: per 2 above, `ptr` came from the `Route::Slabs` arm of
            // `allocate` with this same `whole` layout.
            (SeqAlloc::Arena(arena), Route::Slabs(whole)) => {
                arena.lock().large -= whole.size();
                // SAFETY: as above: from `alloc_pages(whole.size(), _)`, and the
                // caller frees it once.
                unsafe { free_pages(ptr, whole.size()) }
            }
            // SAFETY: the caller passes a block this allocator (or a clone) returned
            // for `layout`; per 2 above it came from `Global`, so it goes back there.
            _ => unsafe { Global.deallocate(ptr, layout) },
        }
    }
}

#[cfg(test)]
mod tests {
    use allocator_api2::vec::Vec as AVec;

    use super::*;

    #[test]
    fn every_size_maps_to_the_smallest_class_that_holds_it() {
        assert_eq!(class_size(CLASSES - 1), MAX_SIZE);
        for c in 0..CLASSES {
            assert_eq!(class_of(class_size(c)), c, "class {c}");
            assert_eq!(class_size(c) % MAX_ALIGN, 0);
            if c > 0 {
                assert!(class_size(c) > class_size(c - 1));
                // At most 25% (and 64 bytes) more than asked.
                let s = class_size(c - 1) + 1;
                assert_eq!(class_of(s), c);
                assert!(class_size(c) - s < s / 4 + 64, "class {c} for {s}");
            }
        }
        for s in [1, 63, 64, 65, 100, 4096, 4097, 12_480, MAX_SIZE] {
            let c = class_of(s);
            assert!(
                class_size(c) >= s && (c == 0 || class_size(c - 1) < s),
                "{s}"
            );
        }
    }

    /// Blocks of one class from 256 bytes start one cache line further from a page
    /// boundary than the block before them: the same offset in 64 histories of
    /// equal length falls in 64 different cache sets (with 16 KiB blocks at
    /// multiples of 16 KiB, all 64 would fall in one).
    #[test]
    fn consecutive_blocks_of_a_class_start_at_different_cache_sets() {
        let a = SeqAlloc::arena();
        let layout = Layout::from_size_align(16 << 10, 4).unwrap();
        let blocks: std::vec::Vec<_> = (0..64).map(|_| a.allocate(layout).unwrap()).collect();
        let mut offsets: std::vec::Vec<usize> = blocks
            .iter()
            .map(|p| p.as_ptr().cast::<u8>() as usize % 4096)
            .collect();
        offsets.sort();
        offsets.dedup();
        assert_eq!(
            offsets.len(),
            64,
            "block offsets within a page: {offsets:?}"
        );
        for p in blocks {
            // SAFETY: each came from `a.allocate(layout)` and is freed once.
            unsafe { a.deallocate(p.cast(), layout) };
        }
    }

    /// Blocks from 256 bytes start on a cache line even when smaller blocks (16-byte
    /// multiples) were carved between them: a history's whole lines can then be
    /// streamed (`LineWriter`).
    #[test]
    fn blocks_from_256_bytes_start_on_a_cache_line() {
        let a = SeqAlloc::arena();
        let mut taken = std::vec::Vec::new();
        for i in 0..200usize {
            let small = Layout::from_size_align(80 + 16 * (i % 3), 4).unwrap();
            let large = Layout::from_size_align(256 + 48 * (i % 7), 4).unwrap();
            let p = a.allocate(small).unwrap();
            taken.push((p, small));
            let q = a.allocate(large).unwrap();
            assert_eq!(
                q.as_ptr().cast::<u8>() as usize % 64,
                0,
                "block {i} of {large:?}"
            );
            taken.push((q, large));
        }
        for (p, layout) in taken {
            // SAFETY: each came from `a.allocate(layout)` and is freed once.
            unsafe { a.deallocate(p.cast(), layout) };
        }
    }

    /// Arrays in one arena hold their contents through growth, frees and reuse, do not
    /// overlap, and are aligned; the arena outlives its allocator handle while arrays
    /// still use it.
    #[test]
    fn arena_arrays_keep_their_contents_and_never_overlap() {
        let a = SeqAlloc::arena();
        let mut arrays: std::vec::Vec<AVec<u64, SeqAlloc>> = std::vec::Vec::new();
        for i in 0..300u64 {
            let mut v = AVec::new_in(a.clone());
            // Sizes across many classes, and beyond the arena's largest (global).
            let n = (i * 997) % 5000 + i * i * 3;
            for x in 0..n {
                v.push(i << 32 | x);
            }
            assert_eq!(v.as_ptr() as usize % 8, 0);
            arrays.push(v);
            if i % 3 == 0 {
                // Free one in three: later arrays reuse their blocks.
                let gone = arrays.swap_remove((i as usize * 7) % arrays.len());
                drop(gone);
            }
        }
        drop(a);
        let mut ranges: std::vec::Vec<(usize, usize)> = arrays
            .iter()
            .filter(|v| v.capacity() > 0)
            .map(|v| (v.as_ptr() as usize, v.as_ptr() as usize + v.capacity() * 8))
            .collect();
        ranges.sort();
        for w in ranges.windows(2) {
            assert!(w[0].1 <= w[1].0, "arrays overlap: {w:?}");
        }
        for v in &arrays {
            let i = v.first().map_or(0, |x| x >> 32);
            assert!(v.iter().enumerate().all(|(x, &e)| e == i << 32 | x as u64));
        }
    }
}
