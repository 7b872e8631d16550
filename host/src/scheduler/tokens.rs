//! Token histories: each sequence's tokens (prompt first, then the sampled ones),
//! stored so that appending a sampled token does not touch a cold cache line per
//! sequence each step.
//!
//! A sequence's history is a `Vec` (its *flushed* tokens) and a few *pending* tokens
//! in a [`Recent`] buffer: 256 bytes per sequence slot, beside the slots' other
//! per-step data, so a step's appends write one line each of a compact region
//! (16384 sequences: 4 MiB) instead of one line in every sequence's own heap
//! allocation. The token at position `p` is pending at `Recent[p % RECENT]`; the
//! pending tokens are flushed to the `Vec` when `p + 1` is a multiple of [`RECENT`]
//! (once every 64 tokens), so they never wrap around, and before anything reads the
//! history as one slice (admission, fork, finishing). The prefix cache hashes a
//! filled block from both parts, and
//! [`Scheduler::tokens`](super::Scheduler::tokens) reads them as a [`Tokens`] view,
//! neither flushing.

use std::ops::Index;

use allocator_api2::vec::Vec as AVec;

use crate::mem::{SeqAlloc, prefetch_write};

/// Tokens a [`Recent`] buffer holds.
pub(super) const RECENT: usize = 64;

/// The pending tokens of one sequence slot, cache-line aligned.
#[repr(align(64))]
#[derive(Clone, Copy, Debug)]
pub(super) struct Recent([u32; RECENT]);

impl Default for Recent {
    fn default() -> Self {
        Self([0; RECENT])
    }
}

/// One sequence's tokens: the flushed ones, and how many more are pending in its
/// slot's [`Recent`] buffer (see the module docs).
#[derive(Debug)]
pub(super) struct History {
    flushed: AVec<u32, SeqAlloc>,
    pending: u32,
}

impl Clone for History {
    /// The same tokens, with the same room to grow, from the same allocator.
    fn clone(&self) -> Self {
        let mut flushed =
            AVec::with_capacity_in(self.flushed.capacity(), self.flushed.allocator().clone());
        flushed.extend_from_slice(&self.flushed);
        Self {
            flushed,
            pending: self.pending,
        }
    }
}

impl History {
    /// A history of `tokens`, all flushed, with room for `capacity` tokens in all
    /// (flushes up to that length never reallocate), allocated by `alloc`.
    pub(super) fn new(tokens: &[u32], capacity: usize, alloc: &SeqAlloc) -> Self {
        let mut flushed = AVec::with_capacity_in(capacity.max(tokens.len()), alloc.clone());
        flushed.extend_from_slice(tokens);
        Self {
            flushed,
            pending: 0,
        }
    }

    /// Tokens in all.
    pub(super) fn len(&self) -> usize {
        self.flushed.len() + self.pending as usize
    }

    /// Where the pending tokens start in the `Recent` buffer.
    fn start(&self) -> usize {
        self.flushed.len() % RECENT
    }

    /// Appends `tok`, pending in `recent` (this sequence's buffer); flushes when the
    /// buffer's last entry is written.
    #[inline]
    pub(super) fn push(&mut self, recent: &mut Recent, tok: u32) {
        let at = self.start() + self.pending as usize;
        recent.0[at] = tok;
        self.pending += 1;
        if at + 1 == RECENT {
            self.flush(recent);
        }
    }

    /// Prefetches what the next [`push`](Self::push) writes: its entry of `recent`,
    /// and the `Vec`'s end when the push flushes.
    #[inline]
    pub(super) fn prefetch_push(&self, recent: &Recent) {
        let at = self.start() + self.pending as usize;
        prefetch_write(recent.0.as_ptr().wrapping_add(at));
        if at + 1 == RECENT {
            prefetch_write(self.flushed.as_ptr_range().end);
        }
    }

    /// Moves the pending tokens from `recent` (this sequence's buffer) to the `Vec`.
    pub(super) fn flush(&mut self, recent: &Recent) {
        if self.pending > 0 {
            let start = self.start();
            self.flushed
                .extend_from_slice(&recent.0[start..start + self.pending as usize]);
            self.pending = 0;
        }
    }

    /// The whole history as one slice; only after a [`flush`](Self::flush).
    pub(super) fn flushed(&self) -> &[u32] {
        debug_assert_eq!(self.pending, 0, "history read with tokens pending");
        &self.flushed
    }

    /// The whole history as a `Vec` (a copy: the history's own storage goes back to
    /// its allocator); only after a [`flush`](Self::flush).
    pub(super) fn into_flushed(self) -> Vec<u32> {
        debug_assert_eq!(self.pending, 0, "history taken with tokens pending");
        self.flushed.to_vec()
    }

    /// Both parts, without flushing.
    pub(super) fn view<'a>(&'a self, recent: &'a Recent) -> Tokens<'a> {
        let start = self.start();
        Tokens {
            head: &self.flushed,
            tail: &recent.0[start..start + self.pending as usize],
        }
    }
}

/// A live sequence's tokens (its prompt, then its sampled tokens), from
/// [`Scheduler::tokens`](super::Scheduler::tokens): two contiguous parts, like
/// [`VecDeque::as_slices`](std::collections::VecDeque::as_slices), because the last
/// few sampled tokens are kept apart from the rest (so appending one is cheap).
/// Indexing, iteration, [`to_vec`](Self::to_vec) and comparison with slices read it
/// as one sequence of tokens.
#[derive(Clone, Copy, Debug)]
pub struct Tokens<'a> {
    head: &'a [u32],
    tail: &'a [u32],
}

impl<'a> Tokens<'a> {
    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    /// Whether there are none (never, for a live sequence).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i`, if there is one.
    pub fn get(&self, i: usize) -> Option<u32> {
        match i.checked_sub(self.head.len()) {
            None => Some(self.head[i]),
            Some(j) => self.tail.get(j).copied(),
        }
    }

    /// The two parts, in order: all the tokens are `a` followed by `b`.
    pub fn as_slices(&self) -> (&'a [u32], &'a [u32]) {
        (self.head, self.tail)
    }

    /// The tokens in order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = u32> + 'a {
        self.head.iter().chain(self.tail).copied()
    }

    /// Tokens `start..end` in order. Panics if the range is out of bounds, as slicing
    /// does.
    pub fn range(&self, start: usize, end: usize) -> impl Iterator<Item = u32> + 'a {
        assert!(
            start <= end && end <= self.len(),
            "range {start}..{end} out of {} tokens",
            self.len()
        );
        let h = self.head.len();
        let head = &self.head[start.min(h)..end.min(h)];
        let tail = &self.tail[start.saturating_sub(h)..end.saturating_sub(h)];
        head.iter().chain(tail).copied()
    }

    /// The tokens in one `Vec`.
    pub fn to_vec(&self) -> Vec<u32> {
        let mut v = Vec::with_capacity(self.len());
        v.extend_from_slice(self.head);
        v.extend_from_slice(self.tail);
        v
    }

    /// Copies the first `out.len().min(self.len())` tokens into `out`; returns how many.
    pub fn copy_to(&self, out: &mut [u32]) -> usize {
        let n = out.len().min(self.len());
        let h = n.min(self.head.len());
        out[..h].copy_from_slice(&self.head[..h]);
        out[h..n].copy_from_slice(&self.tail[..n - h]);
        n
    }
}

impl Index<usize> for Tokens<'_> {
    type Output = u32;
    fn index(&self, i: usize) -> &u32 {
        match i.checked_sub(self.head.len()) {
            None => &self.head[i],
            Some(j) => &self.tail[j],
        }
    }
}

impl PartialEq for Tokens<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for Tokens<'_> {}

impl PartialEq<[u32]> for Tokens<'_> {
    fn eq(&self, other: &[u32]) -> bool {
        let h = self.head.len();
        self.len() == other.len() && self.head == &other[..h] && self.tail == &other[h..]
    }
}

impl PartialEq<&[u32]> for Tokens<'_> {
    fn eq(&self, other: &&[u32]) -> bool {
        *self == **other
    }
}

impl PartialEq<Vec<u32>> for Tokens<'_> {
    fn eq(&self, other: &Vec<u32>) -> bool {
        *self == other[..]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_tokens_flush_at_buffer_ends_and_read_back_in_order() {
        let mut recent = Recent::default();
        // A prompt ending mid-buffer, then enough tokens to flush twice.
        let prompt: Vec<u32> = (0..21).collect();
        let mut h = History::new(&prompt, 100, &SeqAlloc::arena());
        for t in 21..140 {
            h.push(&mut recent, t);
            let v = h.view(&recent);
            assert_eq!(v.len(), t as usize + 1);
            assert_eq!(v, (0..=t).collect::<Vec<_>>());
            assert_eq!(v[t as usize], t);
            assert_eq!(v.get(t as usize + 1), None);
            // The prompt, then flushed at every multiple of 64: never 64 pending.
            assert_eq!(v.as_slices().0.len(), ((t as usize + 1) / 64 * 64).max(21));
        }
        let v = h.view(&recent);
        assert_eq!(
            v.range(40, 50).collect::<Vec<_>>(),
            (40..50).collect::<Vec<_>>()
        );
        assert_eq!(
            v.range(120, 140).collect::<Vec<_>>(),
            (120..140).collect::<Vec<_>>()
        );
        assert_eq!(v.iter().next_back(), Some(139));
        let mut out = [0; 150];
        assert_eq!(v.copy_to(&mut out), 140);
        assert_eq!(out[..140], (0..140).collect::<Vec<_>>()[..]);
        assert_eq!(out[140..], [0; 10]);
        let mut short = [0; 50];
        assert_eq!(v.copy_to(&mut short), 50);
        assert_eq!(short[49], 49);
        h.flush(&recent);
        assert_eq!(h.flushed(), (0..140).collect::<Vec<_>>());
        assert_eq!(h.into_flushed(), (0..140).collect::<Vec<_>>());
    }
}
