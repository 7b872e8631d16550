//! End-to-end accuracy of the KV cache types: decode through the real kernels (in the
//! emulator, exact math) against f64 attention over the *original* K/V.
//!
//! [`Problem::generate`] draws a batch of queries and each sequence's K/V in f64 and
//! computes the exact decode output with [`dense_decode_attention`]. [`measure`] then
//! stores K/V in a cache of the [`Config`]'s type the way an engine does: the new rows,
//! in the query type, go through `kv_append` (for an fp8 cache with scales calibrated on
//! the data, per KV head or per tensor) into a shuffled paged pool; decode reads the
//! cache with the query rounded to the query type; the output (of the query type) is
//! compared with the exact one. The error therefore includes every rounding a serving
//! engine pays: q, K, V and the output to 16 bits, K/V to fp8 with their scales, and the
//! kernels' f32 arithmetic.
//!
//! `cli/examples/fp8_accuracy.rs` prints docs/fp8.md's table from it;
//! `cli/tests/library/fp8_accuracy.rs`
//! asserts its qualitative facts on small shapes.

use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::attention::{AttentionOptions, DecodeInputs, DecodeShape, decode_emulated};
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_emulated};
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::reference::{DenseInputs, dense_decode_attention, paged_decode_attention};
use pagedkv::host::{DType, HostTensor, Result};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, StandardNormal};
use serde::Serialize;

/// The decode shape of a measurement.
#[derive(Clone, Debug, Serialize)]
pub struct Setup {
    /// Elements per head vector.
    pub head_dim: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Query heads per KV head (GQA group).
    pub group: u32,
    /// Tokens per cache block.
    pub block_size: u32,
    /// Each sequence's context length (the batch is one query token per sequence).
    pub context_lens: Vec<u32>,
    /// Seed of the data and of the pool's shuffle.
    pub seed: u64,
}

impl Setup {
    /// docs/fp8.md's shape: head_dim 128, 8 KV heads, GQA group 4 (32 query heads),
    /// block 16, a batch of 4 sequences with contexts drawn from 900..=1100.
    pub fn readme(seed: u64) -> Self {
        let mut r = SmallRng::seed_from_u64(seed ^ 0x5eed);
        Setup {
            head_dim: 128,
            num_kv_heads: 8,
            group: 4,
            block_size: 16,
            context_lens: (0..4).map(|_| r.random_range(900..=1100)).collect(),
            seed,
        }
    }

    fn num_q_heads(&self) -> usize {
        (self.num_kv_heads * self.group) as usize
    }

    fn tokens(&self) -> usize {
        self.context_lens.iter().map(|&n| n as usize).sum()
    }
}

/// KV head whose K and V carry the outlier channel in [`Data::Outliers`].
pub const OUTLIER_HEAD: usize = 0;
/// Channel (element of the head vector) that is the outlier in [`Data::Outliers`].
pub const OUTLIER_CHANNEL: usize = 0;

/// The K/V distribution.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Data {
    /// q, K and V: independent standard normal elements.
    Random,
    /// As `Random`, with channel [`OUTLIER_CHANNEL`] of KV head [`OUTLIER_HEAD`] of
    /// every token's K and V multiplied by `factor`; every other head is untouched.
    Outliers {
        /// How much larger the outlier channel is than the rest.
        factor: f64,
    },
}

impl std::fmt::Display for Data {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Data::Random => write!(f, "random"),
            Data::Outliers { factor } => write!(f, "outliers {factor}x"),
        }
    }
}

/// The data of a measurement and its exact decode output.
pub struct Problem {
    /// The shape.
    pub setup: Setup,
    /// How K/V were drawn.
    pub data: Data,
    /// `[num_seqs, num_q_heads, head_dim]`.
    pub q: Vec<f64>,
    /// `[tokens, num_kv_heads, head_dim]`: the sequences' keys, one after the other.
    pub k: Vec<f64>,
    /// `[tokens, num_kv_heads, head_dim]`: the sequences' values, as `k`.
    pub v: Vec<f64>,
    /// `[num_seqs, num_q_heads, head_dim]`: f64 attention over `q`, `k`, `v`.
    pub exact: Vec<f64>,
}

impl Problem {
    /// Draws the data (seeded by `setup.seed`) and computes the exact output.
    pub fn generate(setup: &Setup, data: Data) -> Self {
        let mut r = SmallRng::seed_from_u64(setup.seed);
        let (kvh, d) = (setup.num_kv_heads as usize, setup.head_dim as usize);
        let mut normal = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|_| StandardNormal.sample(&mut r))
                .collect::<Vec<f64>>()
        };
        let q = normal(setup.context_lens.len() * setup.num_q_heads() * d);
        let mut k = normal(setup.tokens() * kvh * d);
        let mut v = normal(setup.tokens() * kvh * d);
        if let Data::Outliers { factor } = data {
            for t in 0..setup.tokens() {
                let i = (t * kvh + OUTLIER_HEAD) * d + OUTLIER_CHANNEL;
                k[i] *= factor;
                v[i] *= factor;
            }
        }
        let opts = AttentionOptions::new(setup.head_dim);
        let (row_q, row_kv) = (setup.num_q_heads() * d, kvh * d);
        let mut exact = Vec::with_capacity(q.len());
        let mut first = 0;
        for (s, &n) in setup.context_lens.iter().enumerate() {
            let kv = first * row_kv..(first + n as usize) * row_kv;
            exact.extend(dense_decode_attention(&DenseInputs {
                q: &q[s * row_q..(s + 1) * row_q],
                k: &k[kv.clone()],
                v: &v[kv],
                num_q_heads: setup.num_q_heads(),
                num_kv_heads: kvh,
                head_dim: d,
                opts: &opts,
                sinks: None,
            }));
            first += n as usize;
        }
        Problem {
            setup: setup.clone(),
            data,
            q,
            k,
            v,
            exact,
        }
    }
}

/// How an fp8 cache's scales are calibrated (on the problem's K/V: each maps the
/// largest magnitude it covers to the format's largest finite value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Scaling {
    /// No scales: the cache is of the query type.
    None,
    /// One K and one V scale per KV head ([`KvScales::calibrate`]).
    PerHead,
    /// One K and one V scale for the whole tensor ([`KvScales::calibrate_per_tensor`]).
    PerTensor,
}

/// One cache configuration: query (and output, and new K/V) type, cache type, scales.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Config {
    /// Type of q, of the output and of the K/V rows handed to `kv_append`.
    #[serde(serialize_with = "by_name")]
    pub q: DType,
    /// Type of the cache.
    #[serde(serialize_with = "by_name")]
    pub cache: DType,
    /// The fp8 cache's scales ([`Scaling::None`] for a 16-bit cache).
    pub scaling: Scaling,
}

/// A dtype as its name (`"e4m3"`).
fn by_name<S: serde::Serializer>(d: &DType, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(d)
}

impl Scaling {
    /// The table's name: `-`, `per head`, `per tensor`.
    pub fn label(self) -> &'static str {
        match self {
            Scaling::None => "-",
            Scaling::PerHead => "per head",
            Scaling::PerTensor => "per tensor",
        }
    }
}

impl std::fmt::Display for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} cache, {} q", self.cache, self.q)?;
        match self.scaling {
            Scaling::None => Ok(()),
            s => write!(f, ", {} scales", s.label()),
        }
    }
}

/// The table's configurations: the 16-bit caches, then each fp8 type with per-head and
/// per-tensor scales under f16 and bf16 queries.
pub const CONFIGS: [Config; 10] = {
    use DType::{Bf16, E4m3, E5m2, F16};
    use Scaling::{None, PerHead, PerTensor};
    const fn c(q: DType, cache: DType, scaling: Scaling) -> Config {
        Config { q, cache, scaling }
    }
    [
        c(F16, F16, None),
        c(Bf16, Bf16, None),
        c(F16, E4m3, PerHead),
        c(F16, E4m3, PerTensor),
        c(F16, E5m2, PerHead),
        c(F16, E5m2, PerTensor),
        c(Bf16, E4m3, PerHead),
        c(Bf16, E4m3, PerTensor),
        c(Bf16, E5m2, PerHead),
        c(Bf16, E5m2, PerTensor),
    ]
};

/// Error of one configuration's decode output against the exact one.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Errors {
    /// `||out - exact|| / ||exact||` over the whole output.
    pub rel_l2: f64,
    /// The same over the query heads served by KV head [`OUTLIER_HEAD`].
    pub rel_l2_head0: f64,
    /// The same over every other query head.
    pub rel_l2_other_heads: f64,
    /// `max |out - exact|` over the whole output.
    pub max_abs: f64,
    /// `||out - ref|| / ||ref||`, `ref` the f64 reference over the cache as stored
    /// (dequantised) and the rounded q: the kernels' own error, without the storage's.
    pub kernel_rel_l2: f64,
}

/// Runs `config` on `problem` through the real `kv_append` and decode kernels in
/// `emu` (see the module docs) and returns its errors, against the exact output and
/// against the f64 reference over the stored cache.
pub fn measure(emu: &Emulator, problem: &Problem, config: Config) -> Result<Errors> {
    let s = &problem.setup;
    let (kvh, d, bs) = (s.num_kv_heads, s.head_dim, s.block_size);
    let blocks: Vec<u32> = s.context_lens.iter().map(|n| n.div_ceil(bs)).collect();
    let max_blocks = *blocks.iter().max().unwrap_or(&1);
    let num_blocks = blocks.iter().sum::<u32>() + 2;
    let shape = DecodeShape {
        num_seqs: s.context_lens.len() as u32,
        num_q_heads: kvh * s.group,
        num_kv_heads: kvh,
        head_dim: d,
        block_size: bs,
        num_blocks,
        max_blocks_per_seq: max_blocks,
    };
    let layout = shape.layout();

    // A shuffled pool: each sequence's blocks are scattered, the spare ones unused.
    let mut r = SmallRng::seed_from_u64(s.seed ^ 0xb10c);
    let mut pool: Vec<u32> = (0..num_blocks).collect();
    pool.shuffle(&mut r);
    let mut free = pool.into_iter();
    let mut tables = vec![-1i32; (shape.num_seqs * max_blocks) as usize];
    let mut slots = Vec::with_capacity(s.tokens());
    for (seq, &n) in s.context_lens.iter().enumerate() {
        let row = &mut tables[seq * max_blocks as usize..][..max_blocks as usize];
        for b in row.iter_mut().take(n.div_ceil(bs) as usize) {
            *b = free.next().expect("the pool has a block for each") as i32;
        }
        slots.extend((0..n).map(|t| row[(t / bs) as usize] as i64 * bs as i64 + (t % bs) as i64));
    }

    let (kvh_u, d_u) = (kvh as usize, d as usize);
    let scales = match config.scaling {
        Scaling::None => None,
        Scaling::PerHead => Some(KvScales::calibrate(
            config.cache,
            kvh,
            d,
            &problem.k,
            &problem.v,
        )?),
        Scaling::PerTensor => Some(KvScales::calibrate_per_tensor(
            config.cache,
            kvh,
            d,
            &problem.k,
            &problem.v,
        )?),
    };
    let rows = [s.tokens(), kvh_u, d_u];
    let key = HostTensor::from_f64(config.q, &rows, &problem.k)?;
    let value = HostTensor::from_f64(config.q, &rows, &problem.v)?;
    let pool_shape = [layout.pool_elems() as usize];
    let mut key_cache = HostTensor::full(config.cache, &pool_shape, f64::NAN);
    let mut value_cache = HostTensor::full(config.cache, &pool_shape, f64::NAN);
    kv_append_emulated(
        emu,
        KvAppendInputs {
            layout: &layout,
            key: &key,
            value: &value,
            slot_mapping: &slots,
            key_cache: &mut key_cache,
            value_cache: &mut value_cache,
            scales: scales.as_ref(),
        },
    )?;

    let q_shape = [shape.num_seqs as usize, shape.num_q_heads as usize, d_u];
    let q = HostTensor::from_f64(config.q, &q_shape, &problem.q)?;
    let opts = AttentionOptions::new(d);
    let lens: Vec<i32> = s.context_lens.iter().map(|&n| n as i32).collect();
    let mut out = HostTensor::full(config.q, &q_shape, f64::NAN);
    let inputs = DecodeInputs {
        shape: &shape,
        opts: &opts,
        q: &q,
        key_cache: &key_cache,
        value_cache: &value_cache,
        block_tables: &tables,
        context_lens: &lens,
        plan: None,
        kv_scales: scales.as_ref(),
        sinks: None,
    };
    decode_emulated(emu, inputs, &mut out)?;
    let got = out.to_f64();
    let mut e = errors(&got, &problem.exact, s);
    e.kernel_rel_l2 = errors(&got, &paged_decode_attention(&inputs), s).rel_l2;
    Ok(e)
}

/// The errors of `got` against `want` (`[num_seqs, num_q_heads, head_dim]`).
fn errors(got: &[f64], want: &[f64], s: &Setup) -> Errors {
    let per_kv_head = (s.group * s.head_dim) as usize;
    let of_head0 = |i: &usize| i / per_kv_head % s.num_kv_heads as usize == OUTLIER_HEAD;
    let rel = |keep: &dyn Fn(&usize) -> bool| {
        let (mut num, mut den) = (0.0, 0.0);
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            if keep(&i) {
                num += (a - b) * (a - b);
                den += b * b;
            }
        }
        (num / den).sqrt()
    };
    Errors {
        rel_l2: rel(&|_| true),
        rel_l2_head0: rel(&of_head0),
        rel_l2_other_heads: rel(&|i| !of_head0(i)),
        // NaN (a slot read before it was written) must not vanish in `max`.
        max_abs: got.iter().zip(want).fold(0.0, |m: f64, (a, b)| {
            let e = (a - b).abs();
            if e.is_nan() || m.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        }),
        kernel_rel_l2: f64::NAN,
    }
}
