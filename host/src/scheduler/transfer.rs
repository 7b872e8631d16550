//! KV transfer between instances (disaggregated prefill): a request's full blocks,
//! named by their prefix-cache chain, leave one scheduler's pool and enter another's,
//! where a request beginning with the same tokens finds them as prefix hits.
//!
//! * Export: [`Scheduler::block_names`] of the request's tokens, then
//!   [`Scheduler::cached_blocks`] of those names (the blocks holding them, up to the
//!   first not cached), whose bytes the backend reads
//!   ([`AttentionBackend::read_blocks`](crate::backend::AttentionBackend::read_blocks)).
//! * Import, in two phases so that nothing is named before its bytes are in place:
//!   [`Scheduler::reserve_import`] allocates a block per name (held, unnamed, outside
//!   any table), the engine writes the bytes
//!   ([`AttentionBackend::write_blocks`](crate::backend::AttentionBackend::write_blocks)),
//!   then [`Scheduler::commit_import`] names them and frees them into the prefix
//!   cache's free queue (most recently freed: evicted last), or
//!   [`Scheduler::abort_import`] frees them unnamed. A request admitted after the
//!   commit (its hits are looked up when a step admits it) is a prefix hit on them.
//! * Both sides run between steps (not between `step()` and `on_step_done()`): during
//!   a step, blocks are named when scheduled, before the step writes them, and a block
//!   a swap-out gave back is still to be copied; so
//!   [`cached_blocks`](Scheduler::cached_blocks) and
//!   [`reserve_import`](Scheduler::reserve_import) refuse then.
//! * A reservation must be committed or aborted: dropping one leaves its blocks held.
//!
//! What an importer checks before it commits (pagedkv-dist's `transfer` does): that
//! the names are the chain of the request's own tokens under its own salt
//! ([`block_names`](Scheduler::block_names)), so an export cannot name its blocks
//! after other tokens than the ones it says it holds, and the bytes' checksums
//! (corruption in transit). The bytes themselves are the exporter's: an importer
//! trusts its exporters as it trusts its own kernels.
//!
//! Only models of one layer group (no sliding windows) transfer for now: a window
//! group's blocks are cached under their own names.

use super::Scheduler;
use crate::block::{BlockHash, BlockId, hash_block};
use crate::error::{Error, Result};

/// Blocks reserved for an import ([`Scheduler::reserve_import`]): held, unnamed, in
/// no table, until [`Scheduler::commit_import`] or [`Scheduler::abort_import`].
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation holds its blocks until it is committed or aborted"]
pub struct ImportReservation {
    blocks: Vec<BlockId>,
    names: Vec<BlockHash>,
    owner: u64,
}

impl ImportReservation {
    /// The reserved blocks, one per name, in the names' order: where the engine
    /// writes each name's bytes.
    pub fn blocks(&self) -> &[BlockId] {
        &self.blocks
    }

    /// The names the blocks will take.
    pub fn names(&self) -> &[BlockHash] {
        &self.names
    }
}

impl Scheduler {
    /// The prefix-cache names of the full blocks of `tokens` under `salt` (a
    /// request's `cache_salt`): the chain [`hash_block`] computes, one name per
    /// `block_size` tokens (a last partial block has none).
    pub fn block_names(&self, tokens: &[u32], salt: Option<u64>) -> Vec<BlockHash> {
        let bs = self.kv.block_size() as usize;
        let mut parent = None;
        tokens
            .chunks_exact(bs)
            .map(|chunk| {
                let h = hash_block(parent, chunk, salt);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// The cached blocks holding `names`, in order, up to the first name not cached.
    /// Refused during a step (between `step()` and `on_step_done()`): the step's
    /// blocks are named before it writes them.
    pub fn cached_blocks(&self, names: &[BlockHash]) -> Result<Vec<BlockId>> {
        self.check_between_steps("cached_blocks")?;
        Ok(names
            .iter()
            .map_while(|&h| self.kv.device().lookup(h))
            .collect())
    }

    fn check_between_steps(&self, what: &str) -> Result<()> {
        if self.in_step {
            return Err(Error::InvalidState(format!(
                "{what} during a step: call it before step() or after on_step_done()"
            )));
        }
        Ok(())
    }

    /// Reserves one free block per name for an import (see the module docs). Errors,
    /// reserving nothing: during a step, prefix caching off, a model of several layer
    /// groups, a name listed twice, or fewer free blocks than names.
    pub fn reserve_import(&mut self, names: &[BlockHash]) -> Result<ImportReservation> {
        self.check_between_steps("reserve_import")?;
        if !self.kv.prefix_caching() {
            return Err(Error::InvalidState(
                "reserve_import: prefix caching is off, so imported blocks could not be found"
                    .into(),
            ));
        }
        if self.kv.num_groups() > 1 {
            return Err(Error::InvalidState(
                "reserve_import: models of several layer groups do not transfer blocks yet".into(),
            ));
        }
        let mut seen = std::collections::HashSet::with_capacity(names.len());
        if let Some(h) = names.iter().find(|h| !seen.insert(h.to_bytes())) {
            return Err(Error::invalid("names", format!("{h:?} is listed twice")));
        }
        let free = self.kv.device().num_free() as usize;
        if names.len() > free {
            return Err(Error::invalid(
                "names",
                format!("{} blocks to import, {free} free", names.len()),
            ));
        }
        let pool = self.kv.device_mut();
        let mut blocks = Vec::with_capacity(names.len());
        for _ in names {
            match pool.allocate() {
                Ok(b) => blocks.push(b),
                Err(e) => {
                    for &b in &blocks {
                        pool.free(b, 0).expect("a block this call allocated");
                    }
                    return Err(e);
                }
            }
        }
        Ok(ImportReservation {
            blocks,
            names: names.to_vec(),
            owner: self.kv.id(),
        })
    }

    /// Names the reserved blocks (their bytes written) and frees them into the
    /// prefix cache: a request whose tokens begin with them is a prefix hit. A name
    /// already cached keeps its block (the reserved one is freed unnamed). Returns how
    /// many blocks took their names. A reservation of another scheduler is an error,
    /// nothing changed.
    pub fn commit_import(&mut self, r: ImportReservation) -> Result<usize> {
        self.check_owner(&r)?;
        let pool = self.kv.device_mut();
        let mut named = 0;
        for (&b, &h) in r.blocks.iter().zip(&r.names) {
            // (A reserved block is held and not null: naming it cannot fail, and every
            // block is freed whatever happens.)
            if pool.lookup(h).is_none() && pool.cache(b, h).is_ok() {
                named += 1;
            }
            pool.free(b, 0)?;
        }
        Ok(named)
    }

    /// Frees the reserved blocks unnamed (the transfer failed). A reservation of
    /// another scheduler is an error, nothing changed.
    pub fn abort_import(&mut self, r: ImportReservation) -> Result<()> {
        self.check_owner(&r)?;
        let pool = self.kv.device_mut();
        for &b in &r.blocks {
            pool.free(b, 0)?;
        }
        Ok(())
    }

    fn check_owner(&self, r: &ImportReservation) -> Result<()> {
        if r.owner != self.kv.id() {
            return Err(Error::invalid(
                "reservation",
                "it was made by another scheduler",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::scheduler::{Request, Scheduler, SchedulerConfig};

    fn sched(prefix: bool) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            num_blocks: 16,
            block_size: 16,
            max_model_len: 128,
            enable_prefix_caching: prefix,
            ..SchedulerConfig::default()
        })
        .unwrap()
    }

    /// An import's blocks are hits for a request added after the commit, and not
    /// before it or after an abort; the pool's free count comes back.
    #[test]
    fn committed_imports_are_prefix_hits_and_aborted_ones_are_not() {
        let prompt: Vec<u32> = (0..40).collect();
        for commit in [true, false] {
            let mut s = sched(true);
            let free = s.kv().device().num_free();
            let names = s.block_names(&prompt, None);
            assert_eq!(names.len(), 2);
            let r = s.reserve_import(&names).unwrap();
            assert_eq!(s.kv().device().num_free(), free - 2);
            let cached = |s: &Scheduler| s.cached_blocks(&names).unwrap().len();
            assert_eq!(cached(&s), 0, "named before the commit");
            if commit {
                assert_eq!(s.commit_import(r).unwrap(), 2);
                assert_eq!(cached(&s), 2);
            } else {
                s.abort_import(r).unwrap();
                assert_eq!(cached(&s), 0);
            }
            assert_eq!(s.kv().device().num_free(), free);
            s.add_request(Request::new(1, prompt.clone(), 4)).unwrap();
            let b = s.step().unwrap();
            let want = if commit { 32 } else { 0 };
            assert_eq!(b.seqs[0].num_cached_tokens, want, "commit {commit}");
        }
    }

    #[test]
    fn imports_are_refused_without_prefix_caching_twice_named_or_too_large() {
        let prompt: Vec<u32> = (0..64).collect();
        let mut off = sched(false);
        let names = off.block_names(&prompt, None);
        assert!(off.reserve_import(&names).is_err());
        let mut s = sched(true);
        let twice = [names[0], names[0]];
        assert!(s.reserve_import(&twice).is_err());
        let many: Vec<_> = (0..20u32)
            .map(|i| crate::block::hash_block(None, &[i; 16], None))
            .collect();
        let free = s.kv().device().num_free();
        assert!(s.reserve_import(&many).is_err());
        assert_eq!(
            s.kv().device().num_free(),
            free,
            "a refusal reserves nothing"
        );
        // Another scheduler's reservation.
        let mut other = sched(true);
        let r = other.reserve_import(&names[..1]).unwrap();
        assert!(s.commit_import(r).is_err());
        // (The salt separates chains.)
        assert_ne!(s.block_names(&prompt, Some(7)), names);
    }

    /// During a step the pool holds blocks named but not yet written, and blocks a
    /// swap-out gave back but not yet copied: neither side of a transfer runs then.
    #[test]
    fn transfers_are_refused_during_a_step() {
        let mut s = sched(true);
        let prompt: Vec<u32> = (0..40).collect();
        s.add_request(Request::new(1, prompt.clone(), 4)).unwrap();
        let names = s.block_names(&prompt, None);
        let b = s.step().unwrap().clone();
        assert!(s.cached_blocks(&names).is_err());
        assert!(s.reserve_import(&names[..1]).is_err());
        s.on_step_done(&[(b.seqs[0].seq, 9)]).unwrap();
        assert_eq!(s.cached_blocks(&names).unwrap().len(), 2);
        let r = s.reserve_import(&[crate::block::hash_block(None, &[5; 16], None)]);
        s.abort_import(r.unwrap()).unwrap();
    }
}
