//! `copy_blocks`: copy whole cache blocks for `(src, dst)` pairs, in every pool.
//!
//! Used for copy-on-write (a forked sequence appends into a block it shares) and for
//! compaction. One block id names `block_bytes` bytes in each pool (each layer's K and
//! V pool), so one pair is copied in all pools in a single launch.
//!
//! Grid: `(num_pairs, num_pools, 1)`; block: any multiple of 32 threads (128 is the
//! default). Thread block `(pair, pool)` copies `block_bytes` bytes of block `src` to
//! block `dst` of pool `pool`, 16 bytes per thread per step, [`UNROLL`] loads in flight
//! before the matching stores.
//!
//! Bytes moved: `2 * num_pairs * num_pools * block_bytes` (read once, written once).

use crate::device::{Access, Ctx, GlobalRange, GlobalSlice, GlobalSliceMut, Kernel, KernelParams};

/// Independent 16-byte loads each thread issues before it stores them.
pub const UNROLL: u64 = 4;

/// One pool: all blocks of one layer's K (or V) cache, seen as bytes.
/// `[num_blocks * block_bytes]` bytes, 16-byte aligned.
pub type PoolView = GlobalSliceMut<u8>;

/// Parameters of [`CopyBlocks`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CopyBlocksParams {
    /// `[num_pools]`: every pool the pairs apply to (K and V of every layer).
    pub pools: GlobalSlice<PoolView>,
    /// `[num_pairs * 2]`: `(src_block_id, dst_block_id)` pairs, flattened. The host
    /// guarantees ids `< num_blocks`, no `dst` repeated, and no block both a `src` and a
    /// `dst` (so the copies are independent and their order does not matter).
    pub pairs: GlobalSlice<i64>,
    /// Bytes per block in each pool; a multiple of 16.
    pub block_bytes: u64,
}

// SAFETY: two views and a u64: 40 bytes, no padding (asserted below).
const _: () = assert!(core::mem::size_of::<CopyBlocksParams>() == 2 * 16 + 8);
unsafe impl KernelParams for CopyBlocksParams {
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(GlobalRange {
            access: Access::Views,
            ..self.pools.range("pools")
        });
        f(self.pairs.range("pairs"));
    }
}

/// The `copy_blocks` kernel.
#[derive(Clone, Copy, Debug)]
pub struct CopyBlocks;

impl Kernel for CopyBlocks {
    type Params = CopyBlocksParams;
    const NAME: &'static str = "copy_blocks";

    #[inline(always)]
    fn run<C: Ctx>(ctx: &C, p: &CopyBlocksParams) {
        let pair = ctx.block_idx().x as u64;
        let pool = ctx.ld(&p.pools, ctx.block_idx().y as u64);
        let src_block = ctx.ld(&p.pairs, 2 * pair) as u64;
        let dst_block = ctx.ld(&p.pairs, 2 * pair + 1) as u64;
        // 64-bit before multiplying by the block stride.
        let src = src_block * p.block_bytes;
        let dst = dst_block * p.block_bytes;
        let src_view = pool.as_const();

        let vecs = p.block_bytes / 16;
        let stride = ctx.block_dim().x as u64;
        let mut v = ctx.thread_idx().x as u64;
        // Main loop: UNROLL independent loads in flight, then their stores.
        while v + (UNROLL - 1) * stride < vecs {
            let mut buf = [[0u32; 4]; UNROLL as usize];
            for (u, b) in buf.iter_mut().enumerate() {
                *b = ctx.ld_v4(&src_view, src + 16 * (v + u as u64 * stride));
            }
            for (u, b) in buf.iter().enumerate() {
                ctx.st_v4(&pool, dst + 16 * (v + u as u64 * stride), *b);
            }
            v += UNROLL * stride;
        }
        // Tail: fewer than UNROLL vectors left for this thread.
        while v < vecs {
            let b = ctx.ld_v4(&src_view, src + 16 * v);
            ctx.st_v4(&pool, dst + 16 * v, b);
            v += stride;
        }
    }
}
