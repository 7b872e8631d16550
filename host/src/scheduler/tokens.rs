//! Token histories: each sequence's tokens (prompt first, then the sampled ones),
//! stored so that appending a sampled token does not touch a cold cache line per
//! sequence each step.
//!
//! A sequence's history lives in its hot record (`seqs::Hot`, which `on_step_done`
//! reads anyway): a `Vec` in the scheduler's arena and its last few tokens, pending,
//! beside it. Appending a token writes only the hot record; every [`RECENT`] tokens,
//! a cache line of them goes to the `Vec` at once (a step writes the cold lines of
//! 1 sequence in 16, not a line of every sequence's own heap memory). The pending
//! tokens are flushed at multiples of [`RECENT`] tokens (the first time, however
//! many bring the `Vec` there), so each later flush writes one whole, aligned line
//! (the arena's blocks from 256 bytes are line-aligned), which goes out with
//! streaming stores ([`LineWriter`]): the line is not read from memory first.
//! (With blocks of 16 tokens, the pending tokens are then exactly the last block's,
//! which its commit hashes.) Admission reserves room for the sequence to grow (see
//! `admission::initial_room`), so the `Vec` rarely reallocates.
//! [`Scheduler::tokens`](super::Scheduler::tokens) reads a history as a [`Tokens`]
//! view.

use std::ops::Index;

use allocator_api2::vec::Vec as AVec;

use crate::mem::{LINE_TOKENS, LineWriter, SeqAlloc, prefetch_write};

/// Tokens a history keeps pending before it writes them to its `Vec`: one cache
/// line of them.
pub(super) const RECENT: usize = LINE_TOKENS;

/// One sequence's tokens, in order: a `Vec`, then up to [`RECENT`] pending ones.
#[derive(Debug)]
pub(super) struct History {
    tokens: AVec<u32, SeqAlloc>,
    recent: [u32; RECENT],
    pending: u8,
    /// Pending tokens after which the next push writes them to the `Vec`: enough to
    /// bring it to a multiple of [`RECENT`] tokens, so that after its first write each
    /// is a whole line (`RECENT - tokens.len() % RECENT`, kept so a push reads only
    /// these last bytes of the record).
    room: u8,
}

impl Clone for History {
    /// The same tokens, with the same room to grow, from the same allocator.
    fn clone(&self) -> Self {
        let mut tokens =
            AVec::with_capacity_in(self.tokens.capacity(), self.tokens.allocator().clone());
        extend(&mut tokens, &self.tokens);
        Self {
            tokens,
            recent: self.recent,
            pending: self.pending,
            room: self.room,
        }
    }
}

/// A history's `room` when its `Vec` holds `len` tokens.
fn room_after(len: usize) -> u8 {
    (RECENT - len % RECENT) as u8
}

/// Appends `src` to `v` with one copy (allocator-api2's `extend_from_slice` copies
/// element by element).
fn extend(v: &mut AVec<u32, SeqAlloc>, src: &[u32]) {
    let at = v.len();
    v.resize(at + src.len(), 0);
    v[at..].copy_from_slice(src);
}

impl History {
    /// An empty history that allocates nothing.
    pub(super) fn empty() -> Self {
        Self {
            tokens: AVec::new_in(SeqAlloc::Global),
            recent: [0; RECENT],
            pending: 0,
            room: RECENT as u8,
        }
    }

    /// A history of `tokens`, with room for `capacity` tokens in all (appends up to
    /// that length never reallocate), allocated by `alloc`.
    pub(super) fn new(tokens: &[u32], capacity: usize, alloc: &SeqAlloc) -> Self {
        let mut v = AVec::with_capacity_in(capacity.max(tokens.len()), alloc.clone());
        extend(&mut v, tokens);
        let room = room_after(v.len());
        Self {
            tokens: v,
            recent: [0; RECENT],
            pending: 0,
            room,
        }
    }

    /// Tokens in all.
    pub(super) fn len(&self) -> usize {
        self.tokens.len() + self.pending as usize
    }

    /// Appends `tok`, pending; when the pending ones fill their room already, they go
    /// to the `Vec` together first (a whole line through `lines` when they can). (Full,
    /// they wait for the next push: a block the last of them filled is committed, and
    /// hashed from them, before it, while they are still in the hot record.)
    #[inline]
    pub(super) fn push(&mut self, tok: u32, lines: &mut LineWriter) {
        if self.pending == self.room {
            if self.pending as usize == RECENT && lines.append(&mut self.tokens, &self.recent) {
                self.pending = 0; // (`room` stays RECENT)
            } else {
                self.flush();
            }
        }
        self.recent[self.pending as usize] = tok;
        self.pending += 1;
    }

    /// Whether the next [`push`](Self::push) writes to the `Vec`.
    #[inline]
    pub(super) fn flushes_next(&self) -> bool {
        self.pending == self.room
    }

    /// Prefetches where the next write to the `Vec` goes (a hint), unless it will be a
    /// whole line (not read: see [`LineWriter`]).
    #[inline]
    pub(super) fn prefetch_flush(&self) {
        let end = self.tokens.as_ptr_range().end;
        if self.pending as usize == RECENT
            && (end as usize).is_multiple_of(64)
            && self.tokens.capacity() - self.tokens.len() >= RECENT
        {
            return;
        }
        prefetch_write(end);
        prefetch_write(end.wrapping_add(RECENT - 1));
    }

    /// Writes the pending tokens to the `Vec`.
    pub(super) fn flush(&mut self) {
        extend(&mut self.tokens, &self.recent[..self.pending as usize]);
        self.pending = 0;
        self.room = room_after(self.tokens.len());
    }

    /// The tokens as one slice; only after a [`flush`](Self::flush).
    pub(super) fn as_slice(&self) -> &[u32] {
        debug_assert_eq!(self.pending, 0, "history read with tokens pending");
        &self.tokens
    }

    /// The tokens as a `Vec` (a copy: the history's own storage goes back to its
    /// allocator).
    pub(super) fn into_vec(mut self) -> Vec<u32> {
        self.flush();
        self.tokens.to_vec()
    }

    /// The tokens as a [`Tokens`] view, without flushing.
    pub(super) fn view(&self) -> Tokens<'_> {
        Tokens {
            head: &self.tokens,
            tail: &self.recent[..self.pending as usize],
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
    fn appended_tokens_read_back_in_order_and_clones_keep_their_room() {
        let prompt: Vec<u32> = (0..21).collect();
        let mut h = History::new(&prompt, 100, &SeqAlloc::arena());
        for t in 21..140 {
            LineWriter::scope(|w| h.push(t, w));
            let v = h.view();
            assert_eq!(v.len(), t as usize + 1);
            assert_eq!(h.len(), t as usize + 1);
            assert_eq!(h.room, room_after(h.tokens.len()));
            // The prompt, then sampled tokens up to a multiple of RECENT, in the
            // `Vec`; 1 to RECENT pending (at first, up to that multiple).
            let n = t as usize + 1;
            let head = if n <= 32 {
                21
            } else {
                (n - 1) / RECENT * RECENT
            };
            assert_eq!(v.as_slices().0.len(), head);
            assert_eq!(v, (0..=t).collect::<Vec<_>>());
            assert_eq!(v[t as usize], t);
            assert_eq!(v.get(t as usize + 1), None);
        }
        let v = h.view();
        assert_eq!(
            v.range(40, 50).collect::<Vec<_>>(),
            (40..50).collect::<Vec<_>>()
        );
        assert_eq!(v.iter().next_back(), Some(139));
        let mut out = [0; 150];
        assert_eq!(v.copy_to(&mut out), 140);
        assert_eq!(out[..140], (0..140).collect::<Vec<_>>()[..]);
        assert_eq!(out[140..], [0; 10]);
        let c = h.clone();
        assert_eq!(c.view(), h.view());
        h.flush();
        assert_eq!(h.as_slice(), (0..140).collect::<Vec<_>>());
        assert_eq!(c.tokens.capacity(), h.tokens.capacity());
        assert_eq!(h.into_vec(), (0..140).collect::<Vec<_>>());
        assert_eq!(History::empty().len(), 0);
    }
}
