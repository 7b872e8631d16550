//! [`LineWriter`]: whole cache lines appended to a token `Vec` with non-temporal
//! (streaming) stores.
//!
//! A scheduler step at a large batch writes a line of token history for 1 sequence in
//! 16, each to its own `Vec`, at random. An ordinary store to a line not in cache
//! first reads it from memory (to own it), then writes it back when it is evicted:
//! two transfers, and the read waits on memory. A line written whole with streaming
//! stores is not read at all: the core gathers the 64 bytes and writes them out once.
//! The line is not brought into the cache either, which suits a history: nothing
//! reads it until the sequence finishes.
//!
//! Streaming stores are weakly ordered: other cores may see them after later
//! ordinary stores (this core's own loads see them in program order). So a
//! [`LineWriter`] only exists inside [`LineWriter::scope`], which ends with a store
//! fence (`sfence`) when its closure returns or unwinds: from then on the lines are
//! ordered like any other store, before whatever this thread does next (such as
//! handing the `Vec`s to another thread, which the closure must not do). Elsewhere
//! than x86-64 it copies the line with ordinary stores.

use allocator_api2::vec::Vec as AVec;

use super::SeqAlloc;

/// Tokens in a cache line.
pub(crate) const LINE_TOKENS: usize = 16;

/// Appends whole cache lines to token `Vec`s with streaming stores (one fence for a
/// batch of them: see [`scope`](Self::scope)).
#[derive(Debug)]
pub(crate) struct LineWriter {
    /// Whether a streaming store has been issued (the scope then fences).
    streamed: bool,
}

impl LineWriter {
    /// Runs `f` with a writer, and fences the writer's streaming stores when `f`
    /// returns or unwinds. `f` must not hand a `Vec` it appended to to another
    /// thread (nothing in this crate does: the scheduler is one thread's at a time).
    pub(crate) fn scope<R>(f: impl FnOnce(&mut LineWriter) -> R) -> R {
        /// The fence, in a drop so an unwinding `f` runs it too.
        struct Fenced(LineWriter);
        impl Drop for Fenced {
            fn drop(&mut self) {
                #[cfg(target_arch = "x86_64")]
                if self.0.streamed {
                    // SAFETY: `sfence` only orders this thread's stores; SSE is part of
                    // the x86-64 baseline.
                    unsafe { std::arch::x86_64::_mm_sfence() };
                }
            }
        }
        let mut w = Fenced(LineWriter { streamed: false });
        f(&mut w.0)
    }

    /// Appends `line` to `v` when its end is 64-byte aligned and it has room for the
    /// line without growing: the line is written whole, without being read first.
    /// Returns whether it did; `false` leaves `v` as it was (append another way).
    pub(crate) fn append(
        &mut self,
        v: &mut AVec<u32, SeqAlloc>,
        line: &[u32; LINE_TOKENS],
    ) -> bool {
        let spare = v.spare_capacity_mut();
        if spare.len() < LINE_TOKENS || !(spare.as_ptr() as usize).is_multiple_of(64) {
            return false;
        }
        let dst = spare.as_mut_ptr().cast::<u32>();
        #[cfg(target_arch = "x86_64")]
        // SAFETY:
        // 1. `dst` points into `v`'s spare capacity, which holds at least `LINE_TOKENS`
        //    elements (checked above): the 64 bytes written are inside `v`'s
        //    allocation and are no element of `v` yet (nothing refers to them).
        // 2. `dst` is 64-byte aligned (checked above), so each 16-byte store is
        //    aligned, as `_mm_stream_si128` requires; `line` is read unaligned.
        // 3. SSE2, the only target feature these intrinsics need, is part of the
        //    x86-64 baseline.
        // 4. The stores are fenced (`_mm_sfence`) when the writer's scope ends, before
        //    any other thread can access `v` (see `scope`); until then this thread's
        //    own accesses see them in program order.
        unsafe {
            use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
            let src = line.as_ptr().cast::<__m128i>();
            let dst = dst.cast::<__m128i>();
            for i in 0..4 {
                _mm_stream_si128(dst.add(i), _mm_loadu_si128(src.add(i)));
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        // SAFETY: as 1. above: `dst` has room for the line, which does not overlap it.
        unsafe {
            std::ptr::copy_nonoverlapping(line.as_ptr(), dst, LINE_TOKENS);
        }
        self.streamed = true;
        // SAFETY: the `LINE_TOKENS` elements after the old length were just written
        // (initialised), and they are within the capacity (checked above).
        unsafe { v.set_len(v.len() + LINE_TOKENS) };
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line goes in only where the `Vec`'s end is aligned and it has room; what it
    /// appends reads back (after the scope), and a refusal changes nothing.
    #[test]
    fn appends_aligned_lines_with_room_and_refuses_the_rest() {
        let line: [u32; LINE_TOKENS] = std::array::from_fn(|i| 100 + i as u32);
        let alloc = SeqAlloc::arena();
        let mut appended = 0;
        for start in 0..LINE_TOKENS {
            for room in [LINE_TOKENS - 1, LINE_TOKENS, 3 * LINE_TOKENS] {
                let mut v: AVec<u32, SeqAlloc> =
                    AVec::with_capacity_in(start + room, alloc.clone());
                v.extend(0..start as u32);
                let aligned = (v.as_ptr() as usize + 4 * start).is_multiple_of(64);
                let before = v.clone();
                let ok = LineWriter::scope(|w| w.append(&mut v, &line));
                assert_eq!(ok, aligned && v.capacity() - start >= LINE_TOKENS);
                if ok {
                    appended += 1;
                    assert_eq!(&v[..start], &before[..]);
                    assert_eq!(&v[start..], &line[..]);
                } else {
                    assert_eq!(v, before);
                }
            }
        }
        assert!(
            appended > 0,
            "no start was aligned: the test tested nothing"
        );
    }
}
