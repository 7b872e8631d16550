//! Tensor-parallel shards of a model's KV heads.
//!
//! Under tensor parallelism of size `n`, rank `r` holds `num_kv_heads / n` KV heads,
//! the `r`-th contiguous slice, and the query heads that read them: with `g =
//! num_q_heads / num_kv_heads` query heads per KV head (grouped-query attention), query
//! head `h` reads KV head `h / g`, so the rank's query heads are the `r`-th contiguous
//! slice of `num_q_heads / n`. Attention is independent per head, so each rank's
//! backend runs the same step (the same [`Batch`](pagedkv_host::scheduler::Batch),
//! block tables and all: one scheduler decides for every rank) over its slice, and the
//! ranks' outputs, put side by side along the head axis, are the unsharded output.
//!
//! Everything per KV head is sliced the same way: an fp8 cache's scales
//! ([`KvScales`](pagedkv_host::ops::scales::KvScales), one per KV head) and attention
//! sinks (one per query head). The pool's block ids are the same on every rank (each
//! rank's cache has `num_blocks` blocks of its heads), which is what lets one scheduler
//! serve them all.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use pagedkv_host::step::StepShape;

use crate::DistError;

/// One rank of a tensor-parallel group: `rank` of `size`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardSpec {
    /// This rank, `0..size`.
    pub rank: u32,
    /// Ranks in the group (1: unsharded).
    pub size: u32,
}

impl ShardSpec {
    /// The whole model on one rank.
    pub const WHOLE: ShardSpec = ShardSpec { rank: 0, size: 1 };

    /// Rank `rank` of `size`; an error unless `0 <= rank < size`.
    pub fn new(rank: u32, size: u32) -> Result<Self, DistError> {
        if size == 0 || rank >= size {
            return Err(DistError::Shard(format!(
                "rank {rank} of {size}: a rank is 0 to size - 1, size at least 1"
            )));
        }
        Ok(Self { rank, size })
    }

    /// The shape this rank's backend serves: `full` with `num_kv_heads / size` KV
    /// heads and `num_q_heads / size` query heads (everything else the same). An error
    /// when `size` does not divide the KV heads, or the rank is out of range.
    pub fn shape(&self, full: &StepShape) -> Result<StepShape, DistError> {
        let _ = Self::new(self.rank, self.size)?;
        if full.num_kv_heads == 0 || !full.num_kv_heads.is_multiple_of(self.size) {
            return Err(DistError::Shard(format!(
                "{} KV heads do not split evenly over {} ranks",
                full.num_kv_heads, self.size
            )));
        }
        if !full.num_q_heads.is_multiple_of(full.num_kv_heads) {
            return Err(DistError::Shard(format!(
                "{} query heads are not a multiple of {} KV heads",
                full.num_q_heads, full.num_kv_heads
            )));
        }
        Ok(StepShape {
            num_kv_heads: full.num_kv_heads / self.size,
            num_q_heads: full.num_q_heads / self.size,
            ..*full
        })
    }

    /// The KV heads of `full` this rank holds.
    pub fn kv_heads(&self, full: &StepShape) -> Result<Range<u32>, DistError> {
        let n = self.shape(full)?.num_kv_heads;
        Ok(self.rank * n..(self.rank + 1) * n)
    }

    /// The query heads of `full` this rank computes (those reading its KV heads).
    pub fn q_heads(&self, full: &StepShape) -> Result<Range<u32>, DistError> {
        let n = self.shape(full)?.num_q_heads;
        Ok(self.rank * n..(self.rank + 1) * n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pagedkv_host::DType;

    fn shape(q: u32, kv: u32) -> StepShape {
        StepShape {
            num_q_heads: q,
            num_kv_heads: kv,
            head_dim: 64,
            block_size: 16,
            num_blocks: 8,
            dtype: DType::F32,
            kv_dtype: DType::F32,
        }
    }

    #[test]
    fn ranks_hold_contiguous_slices_whose_query_heads_read_their_kv_heads() {
        let full = shape(32, 8);
        let mut kv_seen = Vec::new();
        for r in 0..4 {
            let s = ShardSpec::new(r, 4).unwrap();
            let sh = s.shape(&full).unwrap();
            assert_eq!((sh.num_q_heads, sh.num_kv_heads), (8, 2));
            let (kv, q) = (s.kv_heads(&full).unwrap(), s.q_heads(&full).unwrap());
            // Query head h reads KV head h / 4 (32 / 8): inside the rank's slice.
            assert!(q.clone().all(|h| kv.contains(&(h / 4))));
            kv_seen.extend(kv);
        }
        assert_eq!(kv_seen, (0..8).collect::<Vec<_>>());
        assert_eq!(ShardSpec::WHOLE.shape(&full).unwrap(), full);
    }

    #[test]
    fn uneven_splits_and_bad_ranks_are_errors() {
        assert!(ShardSpec::new(2, 2).is_err());
        assert!(ShardSpec::new(0, 0).is_err());
        let e = ShardSpec::new(0, 3)
            .unwrap()
            .shape(&shape(8, 4))
            .unwrap_err();
        assert!(e.to_string().contains("4 KV heads"), "{e}");
        // A spec built by hand is checked too.
        let bad = ShardSpec { rank: 5, size: 2 };
        assert!(bad.shape(&shape(8, 4)).is_err());
    }
}
