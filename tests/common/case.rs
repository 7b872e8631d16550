//! The decode-attention test case shared by the emulator proptests and the GPU tests:
//! a batch over a shuffled pool with shared blocks, NaN in every unused cache slot,
//! garbage in unused block-table entries, optional window (freeing the blocks before
//! it), soft-cap, ALiBi and attention sinks.

use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape};
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::{DType, HostTensor};
use rand::Rng;
use rand::seq::SliceRandom;

use super::{rng, uniform};

/// What a case is made of.
#[derive(Clone, Debug)]
pub struct Params {
    pub dtype: DType,
    pub head_dim: u32,
    pub block_size: u32,
    pub num_kv_heads: u32,
    pub group: u32,
    pub batch: u32,
    pub max_len: u32,
    pub window: Option<u32>,
    pub softcap: Option<f32>,
    pub alibi: bool,
    /// One attention-sink logit per query head.
    pub sinks: bool,
    pub partition: Option<u32>,
    pub narrow_heads: bool,
    pub seed: u64,
    /// Every sequence has `max_len` tokens (otherwise only the first).
    pub full_length: bool,
}

/// A built case: shapes, options, inputs.
pub struct Case {
    pub shape: DecodeShape,
    pub opts: AttentionOptions,
    pub q: HostTensor,
    pub kc: HostTensor,
    pub vc: HostTensor,
    pub tables: Vec<i32>,
    pub lens: Vec<i32>,
    pub windowed: bool,
    /// An fp8 cache's scales (`fp8::quantise_case` sets them).
    pub scales: Option<KvScales>,
    /// Attention-sink logits, one per query head.
    pub sinks: Option<Vec<f32>>,
}

pub fn build(p: &Params) -> Case {
    let mut r = rng(p.seed);
    let lens: Vec<i32> = (0..p.batch)
        .map(|i| {
            if i == 0 || p.full_length {
                p.max_len
            } else {
                r.random_range(1..=p.max_len)
            }
        } as i32)
        .collect();
    // Some sequences share their first block with the previous one (a prefix).
    build_tables(p, r, lens, |r, s| {
        (s.max(1) - 1, (s > 0 && r.random_bool(0.3)) as u32)
    })
}

/// A case of decode rows that share prefixes as cascade attention finds them: up to
/// three families, each a prompt of `1..=max_len / 2` tokens whose full blocks its
/// rows share (the partial last block each row's own copy), with rows of one family
/// (no cascade), rows in no family, and rows whose suffix is the one new token; each
/// row `1..=max_len / 2` tokens past its prompt (at least one).
pub fn build_shared(p: &Params) -> Case {
    let mut r = rng(p.seed ^ 0xca5c);
    let bs = p.block_size;
    let families: Vec<u32> = (0..r.random_range(1..=3))
        .map(|_| r.random_range(1..=(p.max_len / 2).max(1)))
        .collect();
    let mut first_of = vec![None; families.len()];
    let mut lens = Vec::new();
    let mut prefixes = Vec::new();
    for s in 0..p.batch as usize {
        let f = r.random_range(0..=families.len()); // == len: no family
        let (prompt, owner) = match families.get(f) {
            Some(&t) => (t, *first_of[f].get_or_insert(s)),
            None => (0, s),
        };
        let suffix = if r.random_bool(0.25) {
            1
        } else {
            r.random_range(1..=(p.max_len / 2).max(1))
        };
        lens.push((prompt + suffix) as i32);
        prefixes.push((owner, if owner == s { 0 } else { prompt / bs }));
    }
    build_tables(p, r, lens, |_, s| prefixes[s])
}

/// A case of `p.batch` rows sharing the full blocks of one `prompt`-token prompt, each
/// `1..=p.max_len` tokens past it.
pub fn build_family(p: &Params, prompt: u32) -> Case {
    let mut r = rng(p.seed ^ 0xfa);
    let lens = (0..p.batch)
        .map(|_| (prompt + r.random_range(1..=p.max_len)) as i32)
        .collect();
    build_tables(p, r, lens, |_, _| (0, prompt / p.block_size))
}

/// The case of sequences of `lens` tokens, sequence `s` sharing the first `n` blocks of
/// sequence `o < s` for `prefix(r, s) = (o, n)` (its other blocks its own, from a
/// shuffled pool; `prefix` is asked in sequence order, after the shuffle, and may
/// draw from `r`: `build` draws what it drew before there was a `build_tables`).
fn build_tables(
    p: &Params,
    mut r: rand::rngs::SmallRng,
    lens: Vec<i32>,
    mut prefix: impl FnMut(&mut rand::rngs::SmallRng, usize) -> (usize, u32),
) -> Case {
    let bs = p.block_size;
    let nblk: Vec<u32> = lens.iter().map(|&l| (l as u32).div_ceil(bs)).collect();
    let max_blocks = *nblk.iter().max().unwrap() + 1;
    let extra = 3;
    let num_blocks = nblk.iter().sum::<u32>() + extra;
    let mut pool: Vec<u32> = (0..num_blocks).collect();
    pool.shuffle(&mut r);
    let mut next = 0;
    // Garbage in unused table entries: reading one fails the test (out-of-pool id).
    let mut tables = vec![-7i32; (p.batch * max_blocks) as usize];
    for s in 0..p.batch as usize {
        let (o, n) = prefix(&mut r, s);
        for lb in 0..nblk[s] as usize {
            tables[s * max_blocks as usize + lb] = if (lb as u32) < n && o < s {
                tables[o * max_blocks as usize + lb]
            } else {
                next += 1;
                pool[next - 1] as i32
            };
        }
    }
    let shape = DecodeShape {
        num_seqs: p.batch,
        num_q_heads: p.num_kv_heads * p.group,
        num_kv_heads: p.num_kv_heads,
        head_dim: p.head_dim,
        block_size: bs,
        num_blocks,
        max_blocks_per_seq: max_blocks,
    };
    let l = shape.layout();
    let pool_shape = [l.pool_elems() as usize];
    let mut kc = HostTensor::full(p.dtype, &pool_shape, f64::NAN);
    let mut vc = HostTensor::full(p.dtype, &pool_shape, f64::NAN);
    // Fill exactly the slots some sequence reads; everything else stays NaN.
    let row = p.head_dim as usize;
    for s in 0..p.batch as usize {
        for t in 0..lens[s] as u32 {
            let phys = tables[s * max_blocks as usize + (t / bs) as usize] as u32;
            for h in 0..p.num_kv_heads {
                let o = l.offset(phys, h, t % bs) as usize;
                if kc.get(o).is_nan() {
                    for (e, (kv, vv)) in uniform(&mut r, row)
                        .into_iter()
                        .zip(uniform(&mut r, row))
                        .enumerate()
                    {
                        kc.set(o + e, 2.0 * kv);
                        vc.set(o + e, vv);
                    }
                }
            }
        }
    }
    let mut opts = AttentionOptions::new(p.head_dim);
    opts.scale *= r.random_range(0.5..2.0);
    opts.softcap = p.softcap;
    opts.window = p.window;
    if p.alibi {
        opts.alibi_slopes = Some(
            (0..shape.num_q_heads)
                .map(|h| 2f32.powf(-((h + 1) as f32) * 8.0 / shape.num_q_heads as f32))
                .collect(),
        );
    }
    // With a window, the blocks wholly before it are freed: poison their table entries.
    let mut windowed = false;
    if let Some(w) = p.window {
        for s in 0..p.batch as usize {
            let len = lens[s] as u32;
            if len > w {
                for lb in 0..(len - w) / bs {
                    tables[s * max_blocks as usize + lb as usize] = -3;
                    windowed = true;
                }
            }
        }
    }
    let qn = (p.batch * shape.num_q_heads * p.head_dim) as usize;
    let q = HostTensor::from_f64(
        p.dtype,
        &[
            p.batch as usize,
            shape.num_q_heads as usize,
            p.head_dim as usize,
        ],
        &uniform(&mut r, qn),
    )
    .unwrap();
    Case {
        shape,
        opts,
        q,
        kc,
        vc,
        tables,
        lens,
        windowed,
        scales: None,
        sinks: p.sinks.then(|| sink_logits(&mut r, shape.num_q_heads)),
    }
}

/// Attention-sink logits for `heads` query heads (drawn last, so a case without sinks
/// draws what it drew before they existed): mostly of the scores' size, so each takes a
/// real share of its head's denominator, and one far above every score (the merge's
/// rescale of the output, the sink as the maximum).
pub fn sink_logits(r: &mut impl Rng, heads: u32) -> Vec<f32> {
    (0..heads)
        .map(|h| {
            if h == heads / 2 {
                8.0
            } else {
                r.random_range(-3.0..3.0)
            }
        })
        .collect()
}

impl Case {
    /// The case as named decode inputs (no plan: the backend decides).
    pub fn inputs(&self) -> DecodeInputs<'_, HostTensor> {
        DecodeInputs {
            shape: &self.shape,
            opts: &self.opts,
            q: &self.q,
            key_cache: &self.kc,
            value_cache: &self.vc,
            block_tables: &self.tables,
            context_lens: &self.lens,
            plan: None,
            kv_scales: self.scales.as_ref(),
            sinks: self.sinks.as_deref(),
        }
    }
}
