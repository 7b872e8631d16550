//! Fresh, 2 MiB-aligned memory straight from the system, for the arena's slabs and
//! its large arrays.
//!
//! Advice to use transparent huge pages only helps memory that nothing has touched
//! yet: a page already backed by a 4 KiB frame stays so. Memory from the global
//! allocator may be recycled (a scheduler admitting thousands of prompts frees
//! hundreds of MiB of prompt copies, which the allocator then hands out again), and
//! slabs carved from it ended up on 4 KiB pages: at 16384 sequences, about half of the
//! arena (the block tables' entries and hashes, the token histories, which a step
//! touches at random) was. So on Linux these come from their own `mmap`, advised
//! before their first touch; elsewhere from the global allocator.

use std::ptr::NonNull;

/// Bytes in a huge page (x86-64's transparent huge pages), the alignment here.
pub(crate) const HUGE: usize = 2 << 20;

/// `size` bytes (a non-zero multiple of [`HUGE`]), [`HUGE`]-aligned, never touched
/// before, and advised to huge pages when `advise`; `None` when the system has no
/// memory to give. Free with [`free_pages`].
pub(crate) fn alloc_pages(size: usize, advise: bool) -> Option<NonNull<u8>> {
    debug_assert!(size > 0 && size.is_multiple_of(HUGE));
    #[cfg(target_os = "linux")]
    {
        // Map a huge page more than asked, and unmap what lies outside the aligned
        // part.
        let len = size.checked_add(HUGE)?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choice
        // changes no memory this process uses.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE);
        let (head, tail) = (start - base, base + len - (start + size));
        // SAFETY (each call): the ranges unmapped lie in the mapping just made, before
        // and after `start..start + size`, and nothing refers to them; `madvise`
        // changes only how the kernel backs `start..start + size` (inside it), never
        // its contents, and its result is only advice.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + size) as *mut libc::c_void, tail);
            }
            if advise {
                libc::madvise(start as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
            }
        }
        NonNull::new(start as *mut u8)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = advise;
        let layout = std::alloc::Layout::from_size_align(size, HUGE).ok()?;
        // SAFETY: `layout` has a non-zero size.
        NonNull::new(unsafe { std::alloc::alloc(layout) })
    }
}

/// Returns memory from [`alloc_pages`] to the system.
///
/// # Safety
/// 1. `p` came from `alloc_pages(size, _)`, with this `size`.
/// 2. It is freed once, and nothing uses it afterwards.
pub(crate) unsafe fn free_pages(p: NonNull<u8>, size: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: per 1 and 2, `p..p + size` is a mapping of ours that nothing uses.
    unsafe {
        libc::munmap(p.as_ptr().cast(), size);
    }
    #[cfg(not(target_os = "linux"))]
    // SAFETY: per 1, `p` came from `std::alloc::alloc` with this layout (valid
    // there); per 2, once.
    unsafe {
        std::alloc::dealloc(
            p.as_ptr(),
            std::alloc::Layout::from_size_align_unchecked(size, HUGE),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The memory is aligned, as long as asked, writable and readable throughout.
    #[test]
    fn pages_are_aligned_and_usable() {
        for (size, advise) in [(HUGE, false), (3 * HUGE, true)] {
            let p = alloc_pages(size, advise).expect("memory");
            assert_eq!(p.as_ptr() as usize % HUGE, 0);
            for at in (0..size).step_by(4096).chain([size - 1]) {
                // SAFETY: `p` is valid for `size` bytes (just allocated, ours alone).
                unsafe { p.as_ptr().add(at).write(at as u8 ^ 0x5a) };
            }
            for at in (0..size).step_by(4096).chain([size - 1]) {
                // SAFETY: as above; written just before.
                assert_eq!(unsafe { p.as_ptr().add(at).read() }, at as u8 ^ 0x5a);
            }
            // SAFETY: from `alloc_pages(size, _)`, freed once, unused afterwards.
            unsafe { free_pages(p, size) };
        }
    }
}
