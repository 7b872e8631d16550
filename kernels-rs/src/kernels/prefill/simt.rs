//! [`PagedPrefillSimt`]: the f32 prefill kernel, on CUDA cores: one thread per query
//! row and output pass, walking the positions it may see from global memory.

use super::{Of, PASS_DIMS, PrefillParams, Row, SIMT_THREADS, Seq, cache_at, weight};
use crate::device::{Ctx, Kernel};
use crate::softmax::{SoftmaxState, load_sink};

/// The f32 prefill kernel (see the [module docs](super)): grid `(num_kv_heads,
/// ceil(rows / SIMT_THREADS), num_seqs)`, [`SIMT_THREADS`] threads.
#[derive(Clone, Copy, Debug)]
pub struct PagedPrefillSimt<T>(Of<T>);

impl Kernel for PagedPrefillSimt<f32> {
    type Params = PrefillParams<f32>;
    const NAME: &'static str = "paged_prefill_attention_f32";
    #[inline(always)]
    fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
        prefill(ctx, p)
    }
}

/// 16-byte chunks (4 `f32`) of one pass.
const CHUNKS: usize = (PASS_DIMS / 4) as usize;

/// Calls `f(c, &mut acc[c])` for every chunk, each index a constant after inlining
/// (the accumulators stay in registers, not local memory).
#[inline(always)]
fn each_chunk(acc: &mut [[f32; 4]; CHUNKS], mut f: impl FnMut(u32, &mut [f32; 4])) {
    let [
        a0,
        a1,
        a2,
        a3,
        a4,
        a5,
        a6,
        a7,
        a8,
        a9,
        a10,
        a11,
        a12,
        a13,
        a14,
        a15,
    ] = acc;
    f(0, a0);
    f(1, a1);
    f(2, a2);
    f(3, a3);
    f(4, a4);
    f(5, a5);
    f(6, a6);
    f(7, a7);
    f(8, a8);
    f(9, a9);
    f(10, a10);
    f(11, a11);
    f(12, a12);
    f(13, a13);
    f(14, a14);
    f(15, a15);
}

fn prefill<C: Ctx>(ctx: &C, p: &PrefillParams<f32>) {
    let b = ctx.block_idx();
    let (kvh, s) = (b.x, b.z);
    let sq = Seq::load(ctx, p, s);
    let r = b.y * SIMT_THREADS + ctx.linear_thread();
    let row = Row::new(ctx, p, &sq, kvh, r);
    if !row.valid {
        return; // no barriers in this kernel
    }
    let d = p.layout.head_dim;
    let q_at = row.q_at(ctx, p, &sq, 0);
    let out_at = row.at(p, &sq, 0);
    let sink = load_sink(ctx, &p.sinks, row.head as u64);
    // Every pass sees the same scores: the last one's state is the row's.
    let mut state = SoftmaxState::EMPTY;
    let mut pass = 0;
    while pass * PASS_DIMS < d {
        let width = if d - pass * PASS_DIMS < PASS_DIMS {
            d - pass * PASS_DIMS
        } else {
            PASS_DIMS
        };
        let nchunks = width / 4;
        let mut acc = [[0f32; 4]; CHUNKS];
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        let mut kpos = row.first;
        while kpos <= row.last {
            let base = cache_at(ctx, p, s, kvh, kpos);
            // q . k, 16 dims (four 16-byte chunks) an iteration: every supported
            // head_dim is a multiple of 16, so no remainder iteration exists (one the
            // compiler would emit and no launch would run).
            let mut dot = 0f32;
            let mut c = 0;
            while c < d / 4 {
                for j in 0..4 {
                    let at = 4 * (c + j) as u64;
                    let qv = ctx.ld_v4(&p.q, q_at + at);
                    let kv = ctx.ld_nc_v4(&p.key_cache, base + at);
                    for e in 0..4 {
                        dot = ctx.fma(f32::from_bits(qv[e]), f32::from_bits(kv[e]), dot);
                    }
                }
                c += 4;
            }
            let sc = row.score(ctx, p, &sq, dot, kpos);
            let m_new = if sc > m { sc } else { m };
            let alpha = weight(ctx, m, m_new);
            let pe = weight(ctx, sc, m_new);
            l = ctx.fma(l, alpha, pe);
            m = m_new;
            each_chunk(&mut acc, |c, a| {
                if c < nchunks {
                    let v = ctx.ld_nc_v4(&p.value_cache, base + (pass * PASS_DIMS + 4 * c) as u64);
                    for (e, x) in a.iter_mut().enumerate() {
                        *x = ctx.fma(pe, f32::from_bits(v[e]), *x * alpha);
                    }
                }
            });
            kpos += 1;
        }
        state = SoftmaxState { m, l };
        let inv = state.normaliser(sink, ctx);
        each_chunk(&mut acc, |c, a| {
            if c < nchunks {
                let out = [a[0] * inv, a[1] * inv, a[2] * inv, a[3] * inv].map(f32::to_bits);
                ctx.st_v4(&p.out, out_at + (pass * PASS_DIMS + 4 * c) as u64, out);
            }
        });
        pass += 1;
    }
    if !p.lse.is_empty() {
        ctx.st(&p.lse, row.lse_at(p, &sq), state.lse(sink, ctx));
    }
}
