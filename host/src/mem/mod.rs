//! Memory hints for the host-side bookkeeping: cache-line prefetches, transparent
//! huge pages and streaming stores.
//!
//! At large batches (thousands of running sequences) a scheduler step is bound by
//! memory, not by instructions: every sequence's bookkeeping is touched once a step,
//! and much of it lies outside the caches. Three things help (none changes a result):
//! * [`prefetch`] / [`prefetch_write`]: the per-sequence loops ask for the lines a
//!   sequence a few rows ahead will need, so that their cache misses overlap.
//! * [`try_huge_vec`] and [`grow_huge`]: large arrays backed by 2 MiB pages need a few
//!   dozen TLB entries instead of thousands of 4 KiB ones. On a virtual machine a TLB
//!   miss walks two page tables (guest and host); on the 2-core development VM a
//!   dependent load at random in 64 MiB costs about 175 ns on 2 MiB pages against
//!   about 500 ns on 4 KiB ones (C pointer chase; see docs/scheduler.md).
//!   Where THP is off (or not Linux) nothing changes. [`SeqAlloc`] puts the
//!   sequences' own growing arrays on such pages too, in fresh mappings (`pages`).
//! * [`LineWriter`]: whole cache lines of token history written without reading them
//!   first (non-temporal stores, fenced once per batch).

mod arena;
mod pages;
mod stream;

pub(crate) use arena::{SeqAlloc, same_alloc};
pub(crate) use stream::{LINE_TOKENS, LineWriter};

/// Asks the CPU to bring the cache line at `p` in (a hint: no effect on results).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// [`prefetch`] with intent to write: the line comes in owned, so a store to it does
/// not wait for ownership.
#[inline(always)]
pub(crate) fn prefetch_write<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint; it never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_MM_HINT_ET0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_ET0>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Makes room for `needed` elements in all in `v` when it has less: doubles it (at
/// least), into a new allocation advised to huge pages before the old elements are
/// copied in, so that an array that grows with use lies on huge pages without being
/// reserved ahead of use. Where the allocation fails, leaves `v` as it is (it then
/// grows as a `Vec` does).
pub(crate) fn grow_huge<T: Copy>(v: &mut Vec<T>, needed: usize) {
    if v.capacity() >= needed {
        return;
    }
    let mut w = Vec::new();
    if w.try_reserve_exact(needed.max(v.capacity().saturating_mul(2)))
        .is_ok()
    {
        advise_range(w.as_ptr() as usize, w.capacity() * size_of::<T>());
        w.extend_from_slice(v);
        *v = w;
    }
}

/// `n` zeroed elements (`vec![zero; n]`), from zeroed memory (`alloc_zeroed`, which
/// for large sizes is fresh pages nothing has touched: they become resident only as
/// they are written), advised to huge pages; `None` when the allocation fails (sizes
/// that come from a caller). A prefix map sized for a whole pool stays mostly
/// unmapped this way, as `vec![0; n]` left it.
pub(crate) fn try_zeroed_vec<T: bytemuck::Zeroable>(n: usize) -> Option<Vec<T>> {
    if n == 0 || size_of::<T>() == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    // SAFETY: `layout` has a nonzero size (checked above).
    let p = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if p.is_null() {
        return None;
    }
    advise_range(p as usize, layout.size());
    // SAFETY: 1. `p` was allocated by the global allocator with the layout of `[T; n]`,
    // which is what a `Vec<T>` of capacity `n` frees it with; 2. its `n` elements are
    // initialised: all-zero bytes are a valid `T` (`Zeroable`); 3. nothing else owns it.
    Some(unsafe { Vec::from_raw_parts(p, n, n) })
}

/// `vec![value; n]`, advised to huge pages before its pages are first touched; `None`
/// when the allocation fails (sizes that come from a caller).
pub(crate) fn try_huge_vec<T: Clone>(n: usize, value: T) -> Option<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).ok()?;
    advise_range(v.as_ptr() as usize, v.capacity() * size_of::<T>());
    v.resize(n, value);
    Some(v)
}

/// `madvise(MADV_HUGEPAGE)` on the 2 MiB-aligned part of `len` bytes at `p` (inside
/// one allocation).
fn advise_range(p: usize, len: usize) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let start = p.next_multiple_of(HUGE);
        let end = p.saturating_add(len) / HUGE * HUGE;
        if end > start {
            // SAFETY: `madvise(MADV_HUGEPAGE)` changes only how the kernel backs the
            // pages of `start..end`, a range inside the caller's allocation, never
            // their contents; it reads and writes no memory of this process, and its
            // result (an error where THP is unavailable) is only advice, so it is
            // ignored.
            unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (p, len);
}
