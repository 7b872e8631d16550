//! Admission: what may enter the scheduler, and when it starts running.
//!
//! [`Scheduler::add_request`] and [`Scheduler::fork`] keep the first liveness bound
//! (see the module docs): a group fits the usable pool and a step's token budget
//! alone, so it can always run once nothing else does. Step 4 of
//! [`Scheduler::step`] admits waiting groups in queue order while the running
//! sequences stay within `max_num_seqs`, the step's tokens within
//! `max_tokens_per_step`, and the free blocks above the watermark (when others run).

use super::seqs::{Cold, Group, Hot, Seq, Status};
use super::tokens::History;
use super::{Request, RequestId, ScheduledSeq, Scheduler, SeqId};
use crate::block::BlockTable;
use crate::error::{Error, Result};

impl Scheduler {
    /// Queues a request. Rejects an empty prompt, zero `max_tokens`, a duplicate id,
    /// and a request that could never run: longer than `max_model_len`, or growing to
    /// more blocks than the whole usable pool. A request accepted here finishes if the
    /// caller keeps stepping (see the module docs on liveness). The refusals are
    /// [`check_request`](Self::check_request)'s.
    pub fn add_request(&mut self, req: Request) -> Result<SeqId> {
        self.check_request(req.id, req.prompt.len() as u64, req.max_tokens)?;
        let total = req.prompt.len() as u64 + req.max_tokens as u64;
        let seq = self.seqs.alloc_id();
        let arrival = self.next_arrival;
        self.next_arrival += 1;
        let step = Seq {
            request: req.id,
            table: BlockTable::new(),
        };
        let cold = Cold::new(req.cache_salt, total as u32); // at most max_model_len
        // Room to grow without moving, in the arena (see `initial_room`).
        let tokens = History::new(
            &req.prompt,
            initial_room(req.prompt.len(), total as usize),
            &self.arena,
        );
        let hot = Hot::new(cold.max_len, tokens, req.stop_token);
        let extra = (1..self.specs.len()).map(BlockTable::for_group).collect();
        self.seqs.insert(seq, step, cold, hot, extra);
        let g = Group {
            req,
            arrival,
            seqs: vec![seq],
            status: Status::Waiting,
        };
        self.waiting.insert(g.key(self.cfg.policy), g.req.id);
        self.groups.insert(g.req.id, g);
        Ok(seq)
    }

    /// Every refusal of [`add_request`](Self::add_request), from the counts alone: a
    /// request `id` with a prompt of `prompt_len` tokens and `max_tokens` to generate
    /// is refused here exactly when `add_request` would refuse it (an empty prompt,
    /// zero `max_tokens`, a live `id`, more than `max_model_len` tokens, more blocks
    /// than the usable pool). A caller holding the prompt in memory it cannot trust
    /// for `prompt_len` reads (the C ABI) checks before it reads.
    pub fn check_request(&self, id: RequestId, prompt_len: u64, max_tokens: u32) -> Result<()> {
        if prompt_len == 0 {
            return Err(Error::invalid("prompt", "must hold at least one token"));
        }
        if max_tokens == 0 {
            return Err(Error::invalid("max_tokens", "must be at least 1"));
        }
        if self.groups.contains_key(&id) {
            return Err(Error::invalid(
                "id",
                format!("request {id} is already live"),
            ));
        }
        let total = prompt_len.saturating_add(max_tokens as u64);
        if total > self.cfg.max_model_len as u64 {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{prompt_len} prompt + {max_tokens} output tokens exceed max_model_len {}",
                    self.cfg.max_model_len
                ),
            ));
        }
        // At most max_model_len, a u32.
        let need = self.max_blocks(total as u32);
        let usable = self.kv.device().num_usable() as u64;
        if need > usable {
            let hint = if self.specs.iter().any(|s| s.window().is_some()) && !self.chunked {
                " (a sliding window lowers that only with chunked prefill: a whole \
                 prefill or recompute holds every block of its tokens)"
            } else {
                ""
            };
            return Err(Error::invalid(
                "prompt",
                format!("needs {need} blocks, the pool holds {usable}: it could never run{hint}"),
            ));
        }
        Ok(())
    }

    /// Blocks one sequence of `total` tokens (prompt and output, at most
    /// `max_model_len`) holds at its largest, in all its layer groups (in 64 bits: 64
    /// groups of 2^28 blocks overflow `u32`).
    fn max_blocks(&self, total: u32) -> u64 {
        (0..self.specs.len())
            .map(|g| self.max_blocks_in(total, g) as u64)
            .sum()
    }

    /// Blocks one sequence of `total` tokens holds at its largest in layer group `g`:
    /// all of them (`prompt + max_tokens`). With a sliding window and chunked prefill, at most the
    /// window's blocks plus one partial block: a step's queries read every block the
    /// window of its first new token sees, and a chunk takes only the tokens whose
    /// blocks fit. Without chunked prefill a window does not lower it: a prefill's
    /// queries read all its tokens at once, and a recomputed sequence prefills
    /// everything it has in one step.
    fn max_blocks_in(&self, total: u32, g: usize) -> u32 {
        let mut need = self.kv.blocks_for(total);
        if let Some(w) = self.specs[g].window()
            && self.chunked
        {
            need = need.min(self.kv.blocks_for(w) + 1);
        }
        need
    }

    /// A new sequence in `seq`'s group sharing all its blocks (parallel sampling).
    /// The sequence must be running and between steps.
    pub fn fork(&mut self, seq: SeqId) -> Result<SeqId> {
        if self.in_step {
            return Err(Error::InvalidState(
                "fork between step() and on_step_done()".into(),
            ));
        }
        let parent = self.seqs.get(&seq).ok_or(Error::Unknown {
            what: "sequence",
            id: seq,
        })?;
        let g = &self.groups[&parent.request];
        if g.status != Status::Running || self.rows.len() >= self.cfg.max_num_seqs {
            return Err(Error::InvalidState(format!(
                "sequence {seq} cannot fork now (not running, or max_num_seqs reached)"
            )));
        }
        // A fork shares the parent's blocks and its tokens; mid-prefill the forks
        // would compute the same remaining chunks twice: fork after the prefill.
        if self.seqs.is_prefilling(seq) {
            return Err(Error::InvalidState(format!(
                "sequence {seq} is mid-prefill (chunked): fork it after its last chunk"
            )));
        }
        // A preempted group is recomputed (or swapped in) whole: refuse a fork that
        // would make it too large to ever come back.
        let size = g.seqs.len() as u64 + 1;
        let blocks = size.saturating_mul(self.max_blocks(max_len(&g.req)));
        let tokens = size * (g.req.prompt.len() as u64 + g.req.max_tokens as u64);
        // With chunked prefill a recomputed group's prefills take as many steps as
        // they need (one token a sequence at least; `max_num_seqs` bounds the group,
        // and `max_tokens_per_step` is at least that).
        if blocks > self.kv.device().num_usable() as u64
            || (!self.chunked && tokens > self.cfg.max_tokens_per_step as u64)
        {
            return Err(Error::invalid(
                "seq",
                format!(
                    "a group of {size} sequences would need {blocks} blocks and {tokens} prefill tokens if preempted: more than the pool or a step holds"
                ),
            ));
        }
        let (t0, extra) = self.seqs.tables_mut(seq);
        let mut table = self.kv.fork(t0)?;
        let mut forked = Vec::with_capacity(extra.len());
        for t in extra.iter_mut() {
            match self.kv.fork(t) {
                Ok(f) => forked.push(f),
                Err(e) => {
                    // Nothing leaks: the forks made so far give their references back.
                    for mut f in forked.into_iter().chain([std::mem::take(&mut table)]) {
                        self.kv.free(&mut f)?;
                    }
                    return Err(e);
                }
            }
        }
        let extra = forked;
        let child_id = self.seqs.alloc_id();
        let tokens = self.seqs.tokens(seq).unwrap().clone();
        let child = Seq {
            request: self.seqs[&seq].request,
            table,
        };
        // A fork drafts for itself: the engine sets its lookahead.
        let cold = Cold {
            row: usize::MAX,
            lookahead: 0,
            ..*self.seqs.cold(seq)
        };
        let parent_hot = &self.seqs.hot[(seq & 0xffff_ffff) as usize];
        let mut hot = Hot::new(cold.max_len, tokens, parent_hot.stop);
        hot.num_computed = parent_hot.num_computed;
        let (id, request) = (child_id, child.request);
        self.seqs.insert(id, child, cold, hot, extra);
        self.groups.get_mut(&request).unwrap().seqs.push(id);
        self.push_row(id);
        Ok(id)
    }

    /// Step 4: admits waiting groups (prefills), in queue order, while they fit.
    ///
    /// The step's token budget is what the decodes and continuing chunks left. Without
    /// chunked prefill a group is admitted only if all its uncached prompt tokens fit
    /// it; with chunked prefill each of its sequences takes the first chunk the budget
    /// allows (at least one token each), the rest following in later steps. Either way
    /// the chunk's blocks must fit the free pool above the watermark (when others run).
    pub(super) fn admit_waiting(&mut self) -> Result<()> {
        let mut budget = self
            .cfg
            .max_tokens_per_step
            .saturating_sub(self.batch.slot_mapping.len());
        while let Some((&key, &id)) = self.waiting.first_key_value() {
            let seqs = self.groups[&id].seqs.clone();
            if self.rows.len() + seqs.len() > self.cfg.max_num_seqs {
                break;
            }
            let salt = self.groups[&id].req.cache_salt;
            // With chunked prefill a first chunk holds at most the blocks a sequence of
            // the request may hold at once in each layer group (with a sliding window,
            // fewer than its prompt's), so that it fits the pool alone.
            let max_held: Vec<usize> = (0..self.specs.len())
                .map(|g| self.max_blocks_in(max_len(&self.groups[&id].req), g) as usize)
                .collect();
            let bs = self.cfg.block_size as usize;
            let (mut tokens_needed, mut blocks_needed) = (0usize, 0u64);
            // How many leading tokens of each sequence's tokens this step gives slots.
            let mut ends: Vec<u32> = Vec::with_capacity(seqs.len());
            // Some sequence would get no token (chunked prefill, budget spent).
            let mut starved = false;
            for (i, s) in seqs.iter().enumerate() {
                self.seqs.flush(*s);
                let t = self.seqs.tokens(*s).unwrap().as_slice();
                if seqs.len() == 1 {
                    // Found once: each name is a SHA-256 compression.
                    self.kv.find_prefix_hits(t, salt, &mut self.hits);
                    let hits = self.hits.blocks();
                    let cached = (hits * self.cfg.block_size) as usize;
                    let mut take = t.len() - cached;
                    if self.chunked {
                        // It holds `blocks_for(end) - dead` blocks in each group.
                        for (g, &held) in max_held.iter().enumerate() {
                            let dead = self.kv.dead_before(g, cached as u32) as usize;
                            let fit = ((held + dead) * bs).saturating_sub(cached);
                            take = take.min(fit);
                        }
                        take = take.min(budget);
                    }
                    // The prefix has the same hits: they keep at least one token to
                    // compute, and `take >= 1` is past them.
                    let end = cached + take;
                    starved |= take == 0;
                    tokens_needed += take;
                    blocks_needed += self.kv.prefill_cost_with(end as u32, &self.hits) as u64;
                    ends.push(end as u32);
                } else {
                    // One fork's allocations may evict the cached blocks another
                    // counted on: assume no hits (an upper bound).
                    let mut end = t.len();
                    if self.chunked {
                        // At least one token for each of the sequences after this one.
                        let left = seqs.len() - i - 1;
                        let fit = max_held.iter().min().unwrap() * bs;
                        end = end
                            .min(budget.saturating_sub(tokens_needed + left))
                            .min(fit);
                    }
                    let n = end as u32;
                    starved |= n == 0;
                    tokens_needed += end;
                    // (No block is before the window of position 0.)
                    blocks_needed += self.kv.blocks_for(n) as u64 * self.specs.len() as u64;
                    ends.push(n);
                }
            }
            if starved
                || tokens_needed > budget
                || blocks_needed + self.watermark_now() as u64 > self.kv.device().num_free() as u64
            {
                break;
            }
            budget -= tokens_needed;
            self.waiting.remove(&key);
            self.running.insert(key, id);
            self.groups.get_mut(&id).unwrap().status = Status::Running;
            let single = seqs.len() == 1;
            for (s, end) in seqs.into_iter().zip(ends) {
                let slot = (s & 0xffff_ffff) as usize; // a live sequence's id
                let seq = self.seqs.slots[slot].as_mut().unwrap();
                let extra = &mut self.seqs.extra[slot];
                let cold = &mut self.seqs.cold[slot];
                let tokens = self.seqs.hot[slot].tokens.as_slice();
                // Room to grow, in the arena (see `initial_room`).
                let room = initial_room(tokens.len(), cold.max_len as usize);
                let room = self.kv.blocks_for(room as u32) as usize;
                seq.table.reserve_in(&self.arena, room);
                for t in extra.iter_mut() {
                    t.reserve_in(&self.arena, room);
                }
                // Every group's table at once (a hit is the prefix they all serve).
                let mut tables: Vec<&mut BlockTable> = std::iter::once(&mut seq.table)
                    .chain(extra.iter_mut())
                    .collect();
                // A group of one sequence had its hits found above; forks assume none.
                let cached = if single {
                    self.kv.allocate_prefill_with(
                        &mut tables,
                        &tokens[..end as usize],
                        &self.hits,
                    )?
                } else {
                    self.kv
                        .allocate_prefill(&mut tables, &tokens[..end as usize], salt)?
                };
                // Its full blocks are registered now, not after the step: a prompt
                // admitted after it in this step that begins the same way shares them
                // (their K/V is written by this step's kv_append, before any of the
                // step's attention reads it), as vLLM does. The other groups take
                // group 0's names.
                self.kv
                    .commit(&mut seq.table, &tokens[..end as usize], salt)?;
                for t in extra.iter_mut() {
                    self.kv.adopt_names(t, seq.table.hashes())?;
                }
                self.metrics.prefix_queried_tokens += tokens.len() as u64;
                self.metrics.prefix_hit_tokens += cached as u64;
                cold.prefill_end = tokens.len() as u32;
                let samples = end == cold.prefill_end;
                let offset = self.batch.slot_mapping.len() as u32;
                for pos in cached..end {
                    self.batch.slot_mapping.push(self.kv.slot(&seq.table, pos)?);
                }
                for (t, plane) in extra.iter().zip(&mut self.batch.groups) {
                    for pos in cached..end {
                        plane.slot_mapping.push(self.kv.slot(t, pos)?);
                    }
                }
                self.batch.num_cached_tokens += cached;
                let request = seq.request;
                self.push_row(s);
                self.batch.seqs.push(ScheduledSeq {
                    seq: s,
                    request,
                    is_prefill: true,
                    start_pos: cached,
                    num_new_tokens: end - cached,
                    context_len: end,
                    token_offset: offset,
                    num_cached_tokens: cached,
                    samples,
                    num_draft_tokens: 0,
                });
            }
        }
        Ok(())
    }
}

/// Tokens a sequence of `len` tokens (at most `max_len` in its life) gets room for at
/// admission, for its history and (in blocks) its table: twice its length and a little,
/// up to `max_len`. Within that room an append never reallocates, beyond it the arrays
/// double; so a sequence holds at most about twice what it uses (the arena's slabs are
/// huge pages, all resident once touched: reserving every sequence's `max_len` would
/// make memory that most sequences never use resident).
fn initial_room(len: usize, max_len: usize) -> usize {
    max_len.min(len.saturating_mul(2).saturating_add(64))
}

/// The most tokens a sequence of `req` holds: its prompt and every output token (an
/// accepted request's is at most `max_model_len`, a `u32`).
fn max_len(req: &Request) -> u32 {
    req.prompt.len() as u32 + req.max_tokens
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::SchedulerConfig;

    /// A configuration for 8M rows of 65536 blocks is valid (its block tables' byte
    /// size fits an `isize`), but nothing is reserved ahead of use: the arrays grow
    /// with the rows and sequences (reserving for `max_num_seqs` asked for 2.7 TB
    /// where the fuzzer's AddressSanitizer aborted, and a system may well grant the
    /// slab's 1.5 GB, never used). Then they grow with use.
    #[test]
    fn absurd_but_valid_sizes_reserve_nothing_ahead() {
        let mut s = Scheduler::new(SchedulerConfig {
            max_num_seqs: 1 << 23,
            max_model_len: 1 << 20,
            max_tokens_per_step: 1 << 20,
            ..SchedulerConfig::default()
        })
        .unwrap();
        assert_eq!(s.batch.block_tables.capacity(), 0);
        assert_eq!(s.batch.seqs.capacity(), 0);
        assert_eq!(s.seqs.slots.capacity(), 0);
        assert_eq!(s.seqs.hot.capacity(), 0);
        s.add_request(Request::new(1, vec![3; 40], 8)).unwrap();
        let b = s.step().unwrap();
        assert_eq!(b.block_tables.len(), 1 << 16);
        assert_eq!(b.block_tables[..3], [1, 2, 3]);
    }

    /// A sequence takes arena memory for what it holds (twice its length at most), not
    /// for the `max_tokens` it may never generate: the arena's huge pages are resident
    /// once touched. Reserving `max_len` here held 64 × 2 MiB.
    #[test]
    fn admission_reserves_room_for_the_length_not_for_max_tokens() {
        let mut s = Scheduler::new(SchedulerConfig {
            num_blocks: 1 << 16,
            block_size: 16,
            max_num_seqs: 64,
            max_tokens_per_step: 1 << 20,
            max_model_len: 1 << 20,
            ..SchedulerConfig::default()
        })
        .unwrap();
        for i in 0..64 {
            s.add_request(Request::new(i, vec![7; 100], 1 << 19))
                .unwrap();
        }
        let b = s.step().unwrap();
        assert_eq!(b.seqs.len(), 64);
        let sampled: Vec<_> = b.seqs.iter().map(|q| (q.seq, 1)).collect();
        s.on_step_done(&sampled).unwrap();
        let held = s.metrics().arena_bytes;
        assert!(held > 0 && held <= 2 << 20, "{held} bytes held");
    }
}
