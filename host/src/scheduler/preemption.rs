//! Steps 1 and 2 of [`Scheduler::step`]: making room for the running sequences'
//! next tokens by preemption, and swapping preempted groups back in.
//!
//! Invariants kept here (see the module docs on liveness). Groups are ordered by their
//! queue key, most urgent first: by arrival (FCFS), or by priority (lower values
//! first, as in vLLM) then arrival.
//! * the most urgent running group (FCFS: the oldest) is never preempted: room is
//!   counted group by group, most urgent first, with each group's exact next decode
//!   cost, and only less urgent groups are preempted for it, the least urgent first
//!   (vLLM's `test_priority_scheduling_preemption`);
//! * a group is preempted whole, by swap when it asks for it and the host pool has
//!   room, else by recompute (its blocks freed, back to waiting in its queue place);
//! * nothing swaps in during a step that preempted; a group swaps in, most urgent
//!   first, only when its blocks plus its next decode slots fit above the watermark
//!   (which applies only while some sequence runs).

use super::seqs::{GroupKey, Status};
use super::{PreemptionMode, RequestId, Scheduler};
use crate::block::BlockTable;
use crate::error::Result;

impl Scheduler {
    /// Step 1: preempts the least urgent running groups (FCFS: the newest) until every
    /// running sequence's next token fits the free blocks.
    pub(super) fn make_room(&mut self) -> Result<()> {
        // Each sequence takes at most one block in each layer group: only a nearly
        // full pool needs the exact count (so the steady state skips this pass).
        let mut reserved = (self.rows.len() * self.specs.len()).min(u32::MAX as usize) as u32;
        if reserved > self.kv.device().num_free() {
            reserved = self.rows_append_cost()?;
        }
        if reserved > self.kv.device().num_free() {
            let order: Vec<(GroupKey, RequestId)> =
                self.running.iter().map(|(k, r)| (*k, *r)).collect();
            reserved = 0;
            for (key, id) in order {
                if !self.running.contains_key(&key) {
                    continue; // preempted already in this loop
                }
                // Exact, so the most urgent group (reserved = 0) never preempts itself:
                // alone, its next tokens fit the pool (`add_request` and `fork` see to
                // that).
                let cost = self.group_append_cost(id)?;
                while reserved + cost > self.kv.device().num_free() {
                    let (&least, &victim) = self.running.last_key_value().unwrap();
                    self.preempt(victim)?;
                    if least == key {
                        break;
                    }
                }
                if self.running.contains_key(&key) {
                    reserved += cost;
                }
            }
        }
        Ok(())
    }

    /// Step 2: swaps groups back in, most urgent first, unless this step preempted.
    pub(super) fn swap_in_groups(&mut self) -> Result<()> {
        if self.swapped.is_empty() {
            return Ok(());
        }
        // Blocks step 3 will take for the running sequences (swap-ins come after them).
        let mut reserved = self.rows_append_cost()?;
        if !self.batch.preempted.is_empty() {
            return Ok(());
        }
        while let Some((&key, &id)) = self.swapped.first_key_value() {
            let seqs = self.groups[&id].seqs.clone();
            if self.rows.len() + seqs.len() > self.cfg.max_num_seqs {
                break;
            }
            let mut tables = self.take_tables(&seqs);
            // Its blocks, plus what this step's decode slots take after the swap-in
            // (exact: a group that fits the pool alone always comes back).
            let append = self.tables_append_cost(&tables);
            let mut refs: Vec<&mut BlockTable> = tables.iter_mut().flatten().collect();
            let cost = match (&append, self.kv.swap_in_cost(&refs)) {
                (Ok(a), Ok(c)) => Some(a + c),
                _ => None,
            };
            let before = self.batch.swap_in.len();
            let ok = cost.is_some_and(|c| {
                c + reserved + self.watermark_now() <= self.kv.device().num_free()
            }) && self.kv.swap_in(&mut refs, &mut self.batch.swap_in).is_ok();
            self.metrics.swapped_in_blocks += (self.batch.swap_in.len() - before) as u64;
            // The tables go back before any error returns.
            self.put_tables(&seqs, tables);
            let append = append?;
            if !ok {
                break;
            }
            reserved += append;
            self.swapped.remove(&key);
            self.running.insert(key, id);
            self.groups.get_mut(&id).unwrap().status = Status::Running;
            for s in seqs {
                self.push_row(s);
            }
        }
        Ok(())
    }

    /// Preempts running group `id`: swap if asked and the host pool has room, else
    /// recompute.
    fn preempt(&mut self, id: RequestId) -> Result<()> {
        let g = &self.groups[&id];
        let mode = g.req.preemption.unwrap_or(self.cfg.preemption);
        let seqs = g.seqs.clone();
        let key = g.key(self.cfg.policy);
        for &s in &seqs {
            self.remove_row(s);
        }
        self.running.remove(&key);
        let mut done = false;
        if mode == PreemptionMode::Swap {
            let mut tables = self.take_tables(&seqs);
            let mut refs: Vec<&mut BlockTable> = tables.iter_mut().flatten().collect();
            let before = self.batch.swap_out.len();
            if self
                .kv
                .swap_out(&mut refs, &mut self.batch.swap_out)
                .is_ok()
            {
                done = true;
                self.metrics.preempted_swap += 1;
                self.metrics.swapped_out_blocks += (self.batch.swap_out.len() - before) as u64;
                self.swapped.insert(key, id);
                self.groups.get_mut(&id).unwrap().status = Status::Swapped;
                self.batch.preempted.push((id, PreemptionMode::Swap));
            }
            self.put_tables(&seqs, tables);
        }
        if !done {
            for &s in &seqs {
                let (t0, extra) = self.seqs.tables_mut(s);
                self.kv.free(t0)?;
                for t in extra {
                    self.kv.free(t)?;
                }
                self.seqs.hot[(s & 0xffff_ffff) as usize].num_computed = 0;
            }
            self.metrics.preempted_recompute += 1;
            self.groups.get_mut(&id).unwrap().status = Status::Waiting;
            self.waiting.insert(key, id);
            self.batch.preempted.push((id, PreemptionMode::Recompute));
        }
        Ok(())
    }

    /// Free blocks the next decode of every sequence of group `id` takes in every
    /// layer group, exactly (forks sharing a partial block copy it all but one).
    fn group_append_cost(&self, id: RequestId) -> Result<u32> {
        let seqs = &self.seqs;
        let ids = &self.groups[&id].seqs;
        let mut cost = self
            .kv
            .group_append_cost(ids.iter().map(move |s| &seqs[s].table))?;
        for g in 0..self.specs.len() - 1 {
            cost += self
                .kv
                .group_append_cost(ids.iter().map(move |&s| &seqs.extra(s)[g]))?;
        }
        Ok(cost)
    }

    /// [`group_append_cost`](Self::group_append_cost) of the tables
    /// [`take_tables`](Self::take_tables) took (swapped out: what the appends right
    /// after their swap-in take).
    fn tables_append_cost(&self, tables: &[Vec<BlockTable>]) -> Result<u32> {
        (0..self.specs.len())
            .map(|g| self.kv.group_append_cost(tables.iter().map(|t| &t[g])))
            .sum()
    }

    /// An upper bound of the free blocks the next decode of every running sequence
    /// takes.
    fn rows_append_cost(&self) -> Result<u32> {
        self.rows.iter().map(|&s| self.append_cost(s)).sum()
    }

    /// An upper bound of the free blocks the next decode of sequence `id` takes, in
    /// every layer group (exact for a sequence without forks).
    pub(super) fn append_cost(&self, id: u64) -> Result<u32> {
        let mut cost = self.kv.append_cost(&self.seqs[&id].table)?;
        for t in self.seqs.extra(id) {
            cost += self.kv.append_cost(t)?;
        }
        Ok(cost)
    }

    /// Takes every table of sequences `seqs` out (group 0's first, for each), to hand
    /// them to the manager together; [`put_tables`](Self::put_tables) puts them back.
    fn take_tables(&mut self, seqs: &[u64]) -> Vec<Vec<BlockTable>> {
        seqs.iter()
            .map(|&s| {
                let (t0, extra) = self.seqs.tables_mut(s);
                let mut v = Vec::with_capacity(1 + extra.len());
                v.push(std::mem::take(t0));
                v.extend(extra.iter_mut().map(std::mem::take));
                v
            })
            .collect()
    }

    /// Puts back the tables [`take_tables`](Self::take_tables) took.
    fn put_tables(&mut self, seqs: &[u64], tables: Vec<Vec<BlockTable>>) {
        for (&s, v) in seqs.iter().zip(tables) {
            let (t0, extra) = self.seqs.tables_mut(s);
            let mut it = v.into_iter();
            *t0 = it.next().expect("group 0's table");
            for (dst, t) in extra.iter_mut().zip(it) {
                *dst = t;
            }
        }
    }

    /// Records in sequence `id`'s tables of layer groups 1.. the names its group-0
    /// table's commits computed (one hashing for every group), registering their
    /// blocks under each group's names.
    pub(super) fn adopt_names(&mut self, id: u64) -> Result<()> {
        let slot = self.seqs.slot(id).expect("live sequence");
        let names = self.seqs.slots[slot].as_ref().unwrap().table.hashes();
        for t in self.seqs.extra[slot].iter_mut() {
            self.kv.adopt_names(t, names)?;
        }
        Ok(())
    }

    /// The watermark admission and swap-in keep free, which applies only while some
    /// sequence runs: a group alone may use the whole pool (nothing else can need the
    /// headroom), so every request `add_request` accepts can run.
    pub(super) fn watermark_now(&self) -> u32 {
        if self.rows.is_empty() {
            0
        } else {
            self.watermark_blocks
        }
    }
}
