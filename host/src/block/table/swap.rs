//! Swap: moving a sequence group's tables between the device pool and the host pool.
//!
//! A group moves whole: each distinct live block is copied once (one `(from, to)` pair
//! per block), so blocks shared within the group stay shared on the other side, and
//! every entry keeps one reference. Either the whole group moves or nothing changes.
//! Entries a sliding window has released stay [`NULL_BLOCK`](crate::block::NULL_BLOCK).

use super::{BlockTable, KvCacheManager, Location};
use crate::block::pool::BlockId;
use crate::error::{Error, Result};

impl KvCacheManager {
    /// Distinct live blocks of the tables (entries before a window are null), in
    /// first-seen order.
    fn distinct(&mut self, tables: &[&mut BlockTable]) -> Vec<BlockId> {
        self.scratch.clear();
        let mut v = Vec::new();
        for t in tables {
            for &b in &t.blocks()[t.first_live as usize..] {
                if self.scratch.insert(b, 0).is_none() {
                    v.push(b);
                }
            }
        }
        v
    }

    /// Host blocks a swap-out of these tables takes.
    pub fn swap_out_cost(&mut self, tables: &[&mut BlockTable]) -> Result<u32> {
        self.check_all(tables)?;
        Ok(self.distinct(tables).len() as u32)
    }

    /// Device blocks a swap-in of these tables takes (their blocks; the appends after
    /// it take [`group_append_cost`](Self::group_append_cost) more).
    pub fn swap_in_cost(&mut self, tables: &[&mut BlockTable]) -> Result<u32> {
        self.check_all(tables)?;
        Ok(self.distinct(tables).len() as u32)
    }

    /// Moves a sequence group's tables to the host pool (blocks shared within the group
    /// stay shared) and pushes one `(device, host)` copy per distinct block. Nothing
    /// changes when the host pool is too small.
    pub fn swap_out(
        &mut self,
        tables: &mut [&mut BlockTable],
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        self.check_all(tables)?;
        if tables.iter().any(|t| t.location != Location::Device) {
            return Err(Error::InvalidState(
                "swap_out of a swapped-out table".into(),
            ));
        }
        let distinct = self.distinct(tables);
        if distinct.len() as u32 > self.host.num_free() {
            return Err(Error::OutOfBlocks {
                needed: distinct.len() as u32,
                free: self.host.num_free(),
            });
        }
        self.scratch.clear();
        for &d in &distinct {
            let h = self.host.allocate().expect("checked");
            self.scratch.insert(d, h);
            pairs.push((d, h));
        }
        // Each entry takes a reference; the one `allocate` made is dropped afterwards,
        // so every host block ends with one reference per entry that holds it.
        for t in tables.iter_mut() {
            let (live, n) = (t.first_live as usize, t.num_tokens);
            for (i, e) in t.blocks_mut().iter_mut().enumerate().skip(live) {
                let h = self.scratch[e];
                self.host.share(h);
                self.device
                    .release(*e, Self::fill_of(self.block_size, n, i));
                *e = h;
            }
            t.location = Location::Host;
        }
        for &d in &distinct {
            self.host.release(self.scratch[&d], 0);
        }
        Ok(())
    }

    /// Moves a sequence group's tables back to the device pool, pushing one
    /// `(host, device)` copy per distinct block. Nothing changes when the device pool
    /// is too small.
    pub fn swap_in(
        &mut self,
        tables: &mut [&mut BlockTable],
        pairs: &mut Vec<(u32, u32)>,
    ) -> Result<()> {
        self.check_all(tables)?;
        if tables.iter().any(|t| t.location != Location::Host) {
            return Err(Error::InvalidState(
                "swap_in of a table on the device".into(),
            ));
        }
        let distinct = self.distinct(tables);
        if distinct.len() as u32 > self.device.num_free() {
            return Err(Error::OutOfBlocks {
                needed: distinct.len() as u32,
                free: self.device.num_free(),
            });
        }
        self.scratch.clear();
        for &h in &distinct {
            let d = self.device.allocate().expect("checked");
            self.scratch.insert(h, d);
            pairs.push((h, d));
        }
        let bs = self.block_size;
        for t in tables.iter_mut() {
            let (live, n) = (t.first_live as usize, t.num_tokens);
            for (i, e) in t.blocks_mut().iter_mut().enumerate().skip(live) {
                let d = self.scratch[e];
                self.device.share(d);
                // The allocation's reference plus the first entry's: count its tokens once.
                if self.device.rc(d) == 2 {
                    self.device.add_fill(Self::fill_of(bs, n, i));
                }
                self.host.release(*e, 0);
                *e = d;
            }
            t.location = Location::Device;
            t.last_maybe_shared = true;
        }
        for &h in &distinct {
            // Drops the allocation's reference; the entries keep theirs (never zero).
            self.device.release(self.scratch[&h], 0);
        }
        Ok(())
    }
}
