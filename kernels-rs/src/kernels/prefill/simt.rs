//! [`PagedPrefillSimt`]: the f32 prefill kernel, on CUDA cores: one thread per query
//! row and output pass, walking the positions it may see from global memory.

use super::{Of, PASS_DIMS, PrefillParams, Row, SIMT_THREADS, Seq, cache_at, weight};
use crate::device::{Ctx, Kernel};

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
    let q_at = row.at(p, &sq, 0);
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
        while kpos <= row.qpos {
            let base = cache_at(ctx, p, s, kvh, kpos);
            let mut dot = 0f32;
            let mut c = 0;
            while c < d / 4 {
                let qv = ctx.ld_v4(&p.q, q_at + 4 * c as u64);
                let kv = ctx.ld_nc_v4(&p.key_cache, base + 4 * c as u64);
                for e in 0..4 {
                    dot = ctx.fma(f32::from_bits(qv[e]), f32::from_bits(kv[e]), dot);
                }
                c += 1;
            }
            let sc = row.score(ctx, p, dot, kpos);
            let m_new = if sc > m { sc } else { m };
            let alpha = weight(ctx, m, m_new);
            let pe = weight(ctx, sc, m_new);
            l = ctx.fma(l, alpha, pe);
            m = m_new;
            let mut c = 0;
            while c < CHUNKS as u32 {
                if c < nchunks {
                    let v = ctx.ld_nc_v4(&p.value_cache, base + (pass * PASS_DIMS + 4 * c) as u64);
                    for (e, x) in acc[c as usize].iter_mut().enumerate() {
                        *x = ctx.fma(pe, f32::from_bits(v[e]), *x * alpha);
                    }
                }
                c += 1;
            }
            kpos += 1;
        }
        let mut c = 0;
        while c < CHUNKS as u32 {
            if c < nchunks {
                let a = &acc[c as usize];
                let out = [a[0] / l, a[1] / l, a[2] / l, a[3] / l].map(f32::to_bits);
                ctx.st_v4(&p.out, q_at + (pass * PASS_DIMS + 4 * c) as u64, out);
            }
            c += 1;
        }
        pass += 1;
    }
}
