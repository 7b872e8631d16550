//! K/V tiles for the tensor-core attention kernels (decode and prefill): the
//! `cp.async` producer that stages [`MMA_STAGE_TOKENS`]-token tiles of a paged cache
//! into shared memory, and the readers that turn a staged tile into `mma.m16n8k16` B
//! fragments for each cache element type ([`MmaCache`]), with the `compute_qk` and
//! `compute_pv` steps over 16 staged rows.
//!
//! # Staged layout
//! [`MMA_STAGES`] slots, each the K rows then the V rows of [`MMA_STAGE_TOKENS`]
//! tokens ([`mma_k_row_words`], [`mma_v_row_words`] words a row: a 16-byte chunk
//! swizzle ([`MmaCache::k_chunk`], [`MmaCache::v_chunk`]) or, for fp8 V, padding, so a
//! warp's loads fall in distinct banks). Rows outside the
//! attended range are zero-filled by `cp.async` (never read from the cache).
//!
//! # Head-dim order
//! A dot product does not depend on the order of its terms, so an element type may
//! order head dims to suit its bytes ([`MmaCache::q_dims`]; q's A fragments take the
//! same dims) and the output's columns likewise ([`MmaCache::o_dim`]).

use crate::device::{Ctx, GlobalSlice, e4m3x2_to_f16x2, e5m2x2_to_f16x2};
use crate::elem::{Bf16, E4m3, E5m2, F16, KvElem};
use crate::kernels::attention::{
    FIXED_BLOCK_SIZE, MMA_STAGE_TOKENS, MMA_STAGES, THREADS, mma_k_row_words, mma_v_row_words,
    stage_span,
};
use crate::kernels::prefill::MmaElem;
use crate::softmax::SoftmaxState;

/// Calls `f(i)` for `i` in `0..n` (`n <= 16`, a constant after inlining), written out
/// so the fragments `f` indexes stay in registers.
#[inline(always)]
pub(crate) fn each_upto(n: u32, mut f: impl FnMut(usize)) {
    crate::kernels::each16(|i| {
        if i < n {
            f(i as usize);
        }
    });
}

/// K's B fragments for k-steps `4u..4u + 4` of the warp's two 8-token tiles,
/// `[k-step][tile]`.
pub(crate) type KFrags = [[[u32; 2]; 2]; 4];

/// A cache element type the tensor-core decode reads, over q and output of `T`: how its
/// K and V rows lie in a stage and how a lane builds its `mma` B fragments from them
/// (see the [module docs](self)). Lane `(g, t) = (lane / 4, lane % 4)` throughout.
pub(crate) trait MmaCache<T: MmaElem>: KvElem {
    /// Bytes per element.
    const BYTES: u32;

    /// The 16-byte chunk of a stage's K row `row` where the row's chunk `c` lies
    /// (`chunks` per row).
    #[inline(always)]
    fn k_chunk(_row: u32, c: u32, _chunks: u32) -> u32 {
        c
    }

    /// The 16-byte chunk of a stage's V row `row` where the row's chunk `c` lies.
    #[inline(always)]
    fn v_chunk(_row: u32, c: u32) -> u32 {
        c
    }

    /// What a lane reads of K for k-steps `4u..4u + 4` (`u < HEAD_DIM / 64`) of the
    /// warp's rows (8-token tile `nt` is rows `8nt..8nt + 8`), the rows at word
    /// `kbase`, `rw` words apart: the B fragments themselves, or the bytes they are
    /// decoded from (one k-step at a time, [`k_frag`](Self::k_frag), so the decoded
    /// registers of all four are never live at once).
    type KRaw: Copy;

    /// Loads [`KRaw`](Self::KRaw) for unit `u`.
    fn k_load<C: Ctx>(ctx: &C, kbase: u32, rw: u32, lane: u32, u: u32) -> Self::KRaw;

    /// K's B fragments of k-step `4u + j` for the two 8-token tiles, from `raw`.
    fn k_frag(raw: &Self::KRaw, j: usize) -> [[u32; 2]; 2];

    /// V's B fragments for dim tiles `4u..4u + 4` (`u < HEAD_DIM / 32`) over the warp's
    /// 16 rows (the tokens of `P`'s columns), the rows at word `vbase`, `rw` words
    /// apart.
    fn v_frags<C: Ctx>(ctx: &C, vbase: u32, rw: u32, lane: u32, u: u32) -> [[u32; 2]; 4];

    /// The first dims of the two q pairs of lane `t`'s A fragment at k-step `ks`
    /// (words 0 and 1 hold the first pair, of rows `g` and `g + 8`; words 2 and 3 the
    /// second).
    fn q_dims(ks: u32, t: u32) -> (u32, u32);

    /// The head dim of element `e` of lane `t`'s output fragment of dim tile `j`.
    fn o_dim(j: u32, t: u32, e: u32) -> u32;
}

/// The 16-bit caches: `ldmatrix` reads the fragments in the `mma`'s own order.
macro_rules! mma_cache_16 {
    ($t:ty) => {
        impl MmaCache<$t> for $t {
            const BYTES: u32 = 2;

            /// Rows are unpadded; chunk `c` of row `r` lies at `c ^ (r % 8)`, so the 8
            /// rows an `ldmatrix` reads at one logical chunk fall in 8 distinct chunks
            /// of the 32 banks.
            #[inline(always)]
            fn k_chunk(row: u32, c: u32, _chunks: u32) -> u32 {
                c ^ (row % 8)
            }

            /// As [`k_chunk`](Self::k_chunk) (`ldmatrix.trans` reads rows too).
            #[inline(always)]
            fn v_chunk(row: u32, c: u32) -> u32 {
                c ^ (row % 8)
            }

            type KRaw = KFrags;

            #[inline(always)]
            fn k_frag(raw: &KFrags, j: usize) -> [[u32; 2]; 2] {
                raw[j]
            }

            #[inline(always)]
            fn k_load<C: Ctx>(ctx: &C, kbase: u32, rw: u32, lane: u32, u: u32) -> KFrags {
                // ldmatrix row addresses: matrix lane / 8, row lane % 8.
                let (mi, mr) = (lane / 8, lane % 8);
                let mut f = [[[0u32; 2]; 2]; 4];
                each_upto(4, |j| {
                    let ks = 4 * u + j as u32;
                    let row = (mi / 2) * 8 + mr;
                    let c = Self::k_chunk(row, 2 * ks + mi % 2, 0);
                    let kb = ctx.ldmatrix_x4::<false>(kbase + row * rw + 4 * c);
                    f[j] = [[kb[0], kb[1]], [kb[2], kb[3]]];
                });
                f
            }

            #[inline(always)]
            fn v_frags<C: Ctx>(ctx: &C, vbase: u32, rw: u32, lane: u32, u: u32) -> [[u32; 2]; 4] {
                let (mi, mr) = (lane / 8, lane % 8);
                let mut f = [[0u32; 2]; 4];
                each_upto(2, |h| {
                    let jj = 2 * u + h as u32;
                    let row = (mi % 2) * 8 + mr;
                    let c = Self::v_chunk(row, 2 * jj + mi / 2);
                    let vb = ctx.ldmatrix_x4::<true>(vbase + row * rw + 4 * c);
                    f[2 * h] = [vb[0], vb[1]];
                    f[2 * h + 1] = [vb[2], vb[3]];
                });
                f
            }

            #[inline(always)]
            fn q_dims(ks: u32, t: u32) -> (u32, u32) {
                (16 * ks + 2 * t, 16 * ks + 2 * t + 8)
            }

            #[inline(always)]
            fn o_dim(j: u32, t: u32, e: u32) -> u32 {
                8 * j + 2 * t + e % 2
            }
        }
    };
}
mma_cache_16!(F16);
mma_cache_16!(Bf16);

/// The fp8 caches over q of `$t`: `$cvt` decodes two packed fp8 values to two f16s.
macro_rules! mma_cache_fp8 {
    ($t:ty, $k:ty, $cvt:ident) => {
        impl MmaCache<$t> for $k {
            const BYTES: u32 = 1;

            /// Odd rows swap the halves of a row of 8 or more chunks: a quarter-warp
            /// (rows `2i`, `2i + 1`, 4 lanes each reading 16 bytes) then covers all
            /// 32 banks once.
            #[inline(always)]
            fn k_chunk(row: u32, c: u32, chunks: u32) -> u32 {
                if chunks >= 8 { c ^ (4 * (row % 2)) } else { c }
            }

            /// Rows `g` and `8 + g`'s 16 bytes: word j holds k-step 4u + j's 4 values.
            type KRaw = [[u32; 4]; 2];

            #[inline(always)]
            fn k_load<C: Ctx>(ctx: &C, kbase: u32, rw: u32, lane: u32, u: u32) -> Self::KRaw {
                let (g, t) = (lane / 4, lane % 4);
                let chunks = rw / 4;
                let row = |nt: u32| {
                    let r = 8 * nt + g;
                    let c = <$k as MmaCache<$t>>::k_chunk(r, 4 * u + t, chunks);
                    ctx.smem_ld_v4(kbase + r * rw + 4 * c)
                };
                [row(0), row(1)]
            }

            #[inline(always)]
            fn k_frag(raw: &Self::KRaw, j: usize) -> [[u32; 2]; 2] {
                let cv = |w: u32| -> [u32; 2] {
                    [
                        <$t>::from_f16x2($cvt(w as u16)),
                        <$t>::from_f16x2($cvt((w >> 16) as u16)),
                    ]
                };
                [cv(raw[0][j]), cv(raw[1][j])]
            }

            #[inline(always)]
            fn v_frags<C: Ctx>(ctx: &C, vbase: u32, rw: u32, lane: u32, u: u32) -> [[u32; 2]; 4] {
                let (g, t) = (lane / 4, lane % 4);
                // Rows 2t, 2t + 1 (k = 2t, 2t + 1) and 2t + 8, 2t + 9; word 8u + g.
                let w = |r: u32| ctx.smem_ld_u32(vbase + r * rw + 8 * u + g);
                let (w0, w1, w2, w3) = (w(2 * t), w(2 * t + 1), w(2 * t + 8), w(2 * t + 9));
                // Bytes i and i + 1 of two rows, interleaved by one byte permute: the
                // low half pairs the rows' byte i, the high half their byte i + 1, each
                // one fp8 pair decoded to `T`.
                let pairs = |a: u32, b: u32, i: u32| -> [u32; 2] {
                    let sel = if i == 0 { 0x5140 } else { 0x7362 };
                    let x = crate::device::byte_perm(a, b, sel);
                    [
                        <$t>::from_f16x2($cvt(x as u16)),
                        <$t>::from_f16x2($cvt((x >> 16) as u16)),
                    ]
                };
                let (lo01, lo23) = (pairs(w0, w1, 0), pairs(w2, w3, 0));
                let (hi01, hi23) = (pairs(w0, w1, 2), pairs(w2, w3, 2));
                [
                    [lo01[0], lo23[0]],
                    [lo01[1], lo23[1]],
                    [hi01[0], hi23[0]],
                    [hi01[1], hi23[1]],
                ]
            }

            #[inline(always)]
            fn q_dims(ks: u32, t: u32) -> (u32, u32) {
                let d = 64 * (ks / 4) + 16 * t + 4 * (ks % 4);
                (d, d + 2)
            }

            #[inline(always)]
            fn o_dim(j: u32, t: u32, e: u32) -> u32 {
                32 * (j / 4) + 4 * (2 * t + e % 2) + j % 4
            }
        }
    };
}
mma_cache_fp8!(F16, E4m3, e4m3x2_to_f16x2);
mma_cache_fp8!(F16, E5m2, e5m2x2_to_f16x2);
mma_cache_fp8!(Bf16, E4m3, e4m3x2_to_f16x2);
mma_cache_fp8!(Bf16, E5m2, e5m2x2_to_f16x2);

/// `produce_kv`: one thread's share of staging K and V. With `chunks` 16-byte chunks
/// per row, thread `tid` copies chunk `tid % chunks` of rows `tid / chunks + k *
/// (THREADS / chunks)`, of K for `k < chunks / 2` and of V after; rows outside
/// `start..end` are zero-filled. Methods, not closures: LLVM declines to inline a
/// closure this large called from three places, and its captures then live in a stack
/// frame.
pub(crate) struct KvProducer<K, const D: u32> {
    pub tid: u32,
    /// First token of stage 0 (`start` rounded down to a stage).
    pub first: u32,
    /// The attended range `start..end`.
    pub start: u32,
    pub end: u32,
    pub num_stages: u32,
    /// The block table, and the index of the sequence's first entry in it.
    pub block_tables: GlobalSlice<i32>,
    pub table_row: u64,
    /// The layer's K and V caches.
    pub key_cache: GlobalSlice<K>,
    pub value_cache: GlobalSlice<K>,
    /// Elements between physical blocks.
    pub block_stride: u64,
    /// Offset of this thread's chunk in a block, its KV head's rows included.
    pub kv_off: u32,
}

/// What a kernel tells [`KvProducer::start`]: the attended tokens, whose cache, and
/// which KV head.
pub(crate) struct KvSource<K> {
    /// The attended range `start..end`, staged from `start` rounded down to a stage.
    pub start: u32,
    pub end: u32,
    /// The sequence's block-table row: the table and the index of its first entry.
    pub block_tables: GlobalSlice<i32>,
    pub table_row: u64,
    /// The layer's K and V caches, `num_kv_heads` heads of `D` elements a token.
    pub key_cache: GlobalSlice<K>,
    pub value_cache: GlobalSlice<K>,
    pub num_kv_heads: u32,
    pub kv_head: u32,
}

impl<K: KvElem, const D: u32> KvProducer<K, D> {
    /// Thread `tid`'s producer for `src`, with the pipeline's prologue issued: stages
    /// `0..MMA_STAGES - 1` in flight (slots of the same index), and `phys` holding the
    /// blocks of the next stage. Returns the producer and its stage count.
    #[inline(always)]
    pub(crate) fn start<T: MmaElem, C: Ctx>(
        ctx: &C,
        tid: u32,
        src: KvSource<K>,
        phys: &mut [u32; 4],
    ) -> Self
    where
        K: MmaCache<T>,
    {
        let (first, num_stages) = stage_span(src.start, src.end, MMA_STAGE_TOKENS);
        let chunks = D * K::BYTES / 16;
        let producer = KvProducer {
            tid,
            first,
            start: src.start,
            end: src.end,
            num_stages,
            block_tables: src.block_tables,
            table_row: src.table_row,
            key_cache: src.key_cache,
            value_cache: src.value_cache,
            block_stride: src.num_kv_heads as u64 * (FIXED_BLOCK_SIZE * D) as u64,
            kv_off: src.kv_head * FIXED_BLOCK_SIZE * D + (tid % chunks) * (16 / K::BYTES),
        };
        producer.lookup(ctx, phys, 0);
        let mut s = 0;
        while s < MMA_STAGES - 1 {
            producer.issue::<T, C>(ctx, phys, s, s);
            producer.lookup(ctx, phys, s + 1);
            s += 1;
        }
        producer
    }

    /// Looks up the physical blocks of stage `s` that hold an attended token (the
    /// others keep a stale entry, never read through).
    #[inline(always)]
    pub(crate) fn lookup<C: Ctx>(&self, ctx: &C, phys: &mut [u32; 4], s: u32) {
        each_upto(4, |blk| {
            let t0 = self.first + s * MMA_STAGE_TOKENS + blk as u32 * FIXED_BLOCK_SIZE;
            if s < self.num_stages && t0 + FIXED_BLOCK_SIZE > self.start && t0 < self.end {
                phys[blk] = ctx.ld(
                    &self.block_tables,
                    self.table_row + (t0 / FIXED_BLOCK_SIZE) as u64,
                ) as u32;
            }
        });
    }

    /// Issues stage `s`'s copies into `slot` (none past the last stage) and commits a
    /// group either way, so the group count per stage stays fixed.
    #[inline(always)]
    pub(crate) fn issue<T: MmaElem, C: Ctx>(&self, ctx: &C, phys: &[u32; 4], s: u32, slot: u32)
    where
        K: MmaCache<T>,
    {
        let chunks = D * K::BYTES / 16;
        let (krw, vrw) = (mma_k_row_words(D, K::BYTES), mma_v_row_words(D, K::BYTES));
        let k_words = MMA_STAGE_TOKENS * krw;
        let rows_per_pass = THREADS / chunks;
        if s < self.num_stages {
            let base = slot * (k_words + MMA_STAGE_TOKENS * vrw);
            let span = self.end - self.start;
            let c = self.tid % chunks;
            each_upto(chunks, |k| {
                let kv = k as u32 / (chunks / 2); // 0: K, 1: V
                let pass = k as u32 % (chunks / 2);
                let row = self.tid / chunks + pass * rows_per_pass;
                // The row's block: a constant when `rows_per_pass` (8 or 16) divides
                // or is the block size; of two when it is 32 (fp8 at head_dim 64).
                let lo = (pass * rows_per_pass / FIXED_BLOCK_SIZE) as usize;
                let block =
                    if rows_per_pass > FIXED_BLOCK_SIZE && self.tid / chunks >= FIXED_BLOCK_SIZE {
                        phys[lo + 1]
                    } else {
                        phys[lo]
                    };
                let tok = self.first + s * MMA_STAGE_TOKENS + row;
                let src = block as u64 * self.block_stride
                    + (self.kv_off + (row % FIXED_BLOCK_SIZE) * D) as u64;
                let read = tok.wrapping_sub(self.start) < span;
                if kv == 0 {
                    let word = base + row * krw + 4 * K::k_chunk(row, c, chunks);
                    ctx.cp_async_16_or_zero(word, &self.key_cache, src, read);
                } else {
                    let word = base + k_words + row * vrw + 4 * K::v_chunk(row, c);
                    ctx.cp_async_16_or_zero(word, &self.value_cache, src, read);
                }
            });
        }
        ctx.cp_async_commit();
    }
}

/// `compute_qk` for k-steps `4u..4u + 4` (head dims of unit `u`): adds their
/// products to the scores of the warp's two 8-token tiles. A function, not a closure,
/// called once per unit: the closure LLVM would not inline (its captures then go to
/// local memory).
#[inline(always)]
pub(crate) fn compute_qk<T: MmaElem, K: MmaCache<T>, C: Ctx>(
    ctx: &C,
    kbase: u32,
    krw: u32,
    lane: u32,
    u: u32,
    qa: &[[u32; 4]; 8],
    sc: &mut [[f32; 4]; 2],
) {
    let raw = K::k_load(ctx, kbase, krw, lane, u);
    each_upto(4, |j| {
        let ks = (4 * u) as usize + j;
        let kb = K::k_frag(&raw, j);
        sc[0] = T::mma(ctx, qa[ks], kb[0], sc[0]);
        sc[1] = T::mma(ctx, qa[ks], kb[1], sc[1]);
    });
}

/// `compute_pv` for dim tiles `4u..4u + 4`: adds `P V` to their output fragments (see
/// [`compute_qk`] for why a function).
#[inline(always)]
pub(crate) fn compute_pv<T: MmaElem, K: MmaCache<T>, C: Ctx>(
    ctx: &C,
    vbase: u32,
    vrw: u32,
    lane: u32,
    u: u32,
    pa: &[u32; 4],
    o: &mut [[f32; 4]; 16],
) {
    let vb = K::v_frags(ctx, vbase, vrw, lane, u);
    each_upto(4, |i| {
        let j = (4 * u) as usize + i;
        o[j] = T::mma(ctx, *pa, vb[i], o[j]);
    });
}

/// `update_local_state` once a stage's scores are in: each of a lane's two rows (`g`,
/// `g + 8`) takes its maximum `mx` over the row's 4 lanes (two xor-shuffles), its
/// state's `m` moves to the larger, and its `l` and the first `dim_tiles` output
/// fragments of `o` are rescaled once. Returns the maximum to subtract from the scores
/// (0 for a row that has seen nothing yet: its scores are `-inf`, its weights 0).
#[inline(always)]
pub(crate) fn update_rows<C: Ctx>(
    ctx: &C,
    mx: &[f32; 2],
    state: &mut [SoftmaxState; 2],
    o: &mut [[f32; 4]; 16],
    dim_tiles: u32,
) -> [f32; 2] {
    let mut alpha = [0.0f32; 2];
    let mut m_use = [0.0f32; 2];
    each_upto(2, |h| {
        let a = ctx.shfl_xor_f32(mx[h], 1);
        let m1 = if a > mx[h] { a } else { mx[h] };
        let b2 = ctx.shfl_xor_f32(m1, 2);
        let m2 = if b2 > m1 { b2 } else { m1 };
        let m_new = if m2 > state[h].m { m2 } else { state[h].m };
        m_use[h] = if m_new == f32::NEG_INFINITY {
            0.0
        } else {
            m_new
        };
        alpha[h] = ctx.exp2(state[h].m - m_use[h]);
        state[h] = SoftmaxState {
            m: m_new,
            l: state[h].l * alpha[h],
        };
    });
    each_upto(dim_tiles, |j| {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
    });
    m_use
}

/// 16 staged tokens' softmax weights `exp2(x - m)` from their scores `sc` (two 8-token
/// tiles of C fragments), added to the rows' `l` and packed as `P`'s A fragment.
#[inline(always)]
pub(crate) fn weights<T: MmaElem, C: Ctx>(
    ctx: &C,
    sc: &[[f32; 4]; 2],
    m_use: &[f32; 2],
    state: &mut [SoftmaxState; 2],
) -> [u32; 4] {
    let mut w = [[0.0f32; 4]; 2];
    each_upto(2, |nt| {
        each_upto(4, |e| {
            let h = e / 2;
            let x = ctx.exp2(sc[nt][e] - m_use[h]);
            state[h].l += x;
            w[nt][e] = x;
        });
    });
    [
        T::pack2(w[0][0], w[0][1]),
        T::pack2(w[0][2], w[0][3]),
        T::pack2(w[1][0], w[1][1]),
        T::pack2(w[1][2], w[1][3]),
    ]
}
