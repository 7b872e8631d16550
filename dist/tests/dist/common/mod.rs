//! What the dist tests share: a small model shape, deterministic inputs, and one
//! rank's backend running a step's layers over its heads.

#![allow(dead_code)]

pub mod alloc;
pub mod disagg;

use pagedkv_dist::ShardSpec;
use pagedkv_host::backend::{
    AsView, AttentionBackend, BackendConfig, CpuBackend, DecodeArgs, KvAppendArgs, PagedCache,
    PrefillArgs, SplitPolicy, decode_rows, prefill_rows,
};
use pagedkv_host::ops::attention::AttentionOptions;
use pagedkv_host::ops::cascade::CascadePolicy;
use pagedkv_host::scheduler::{Batch, Scheduler, SchedulerConfig};
use pagedkv_host::step::StepShape;
use pagedkv_host::{DType, HostTensor};

pub const LAYERS: usize = 2;
pub const MODEL: &str = "test-model rev 1";

pub fn full_shape() -> StepShape {
    StepShape {
        num_q_heads: 8,
        num_kv_heads: 4,
        head_dim: 64,
        block_size: 16,
        num_blocks: 22,
        dtype: DType::F32,
        kv_dtype: DType::F32,
    }
}

/// A value in [-1, 1) from a tuple (splitmix64): the same on every rank.
pub fn value(parts: [u64; 6]) -> f64 {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for p in parts {
        x = (x ^ p).wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
    }
    // 24 bits: exact in f32.
    (x >> 40) as f64 / (1u64 << 23) as f64 - 1.0
}

/// One rank's backend and cache over its heads.
pub struct Rank {
    pub be: CpuBackend,
    pub cache: PagedCache<HostTensor>,
    pub shard: ShardSpec,
    pub full: StepShape,
}

impl Rank {
    pub fn new(shard: ShardSpec) -> Self {
        let full = full_shape();
        let mut cfg = BackendConfig::new(shard.shape(&full).unwrap(), LAYERS, 8, 8);
        // The same plan on every rank: unsplit, flat.
        cfg.split = SplitPolicy::Never;
        cfg.cascade = CascadePolicy::Off;
        let mut be = CpuBackend::new(cfg).unwrap();
        let cache = be.alloc_cache().unwrap();
        Self {
            be,
            cache,
            shard,
            full,
        }
    }

    /// `[n, heads, d]` of this rank's heads of `kind` (1: K, 2: V, 3: Q) for the new
    /// tokens `tokens[i]` at `pos[i]` in `layer`; `heads` global heads from `first`.
    fn inputs(
        kind: u64,
        layer: usize,
        tokens: &[u32],
        pos: &[u32],
        first: u32,
        heads: u32,
        d: u32,
    ) -> HostTensor {
        let mut v = Vec::with_capacity(tokens.len() * (heads * d) as usize);
        for (&t, &p) in tokens.iter().zip(pos) {
            for h in first..first + heads {
                for j in 0..d {
                    v.push(value([
                        kind,
                        layer as u64,
                        t as u64,
                        p as u64,
                        h as u64,
                        j as u64,
                    ]));
                }
            }
        }
        HostTensor::from_f64(DType::F32, &[tokens.len(), heads as usize, d as usize], &v).unwrap()
    }

    /// A `[n, heads, d]` output poisoned with NaN.
    fn nan(&mut self, n: usize, heads: u32, d: u32) -> HostTensor {
        let t = HostTensor::full(DType::F32, &[n, heads as usize, d as usize], f64::NAN);
        self.be.upload(&t).unwrap()
    }

    /// An output's values.
    fn f32s(&mut self, o: &HostTensor) -> Vec<f32> {
        let v = self.be.download(o).unwrap().to_f64();
        v.iter().map(|&x| x as f32).collect()
    }

    /// One step over this rank's heads: per layer, the decode rows' outputs then the
    /// prefill tokens', `[tokens, q heads of this rank, head_dim]` each, as f32.
    pub fn step(&mut self, batch: &Batch, tokens: &[u32]) -> Vec<f32> {
        let shape = self.shard.shape(&self.full).unwrap();
        let (qh, kvh, d) = (shape.num_q_heads, shape.num_kv_heads, shape.head_dim);
        let q0 = self.shard.q_heads(&self.full).unwrap().start;
        let kv0 = self.shard.kv_heads(&self.full).unwrap().start;
        let mut pos = Vec::with_capacity(tokens.len());
        for s in &batch.seqs {
            pos.extend(s.start_pos..s.start_pos + s.num_new_tokens);
        }
        assert_eq!(pos.len(), tokens.len());
        self.be.begin_step(batch, &mut self.cache).unwrap();
        let opts = AttentionOptions::new(d);
        let decodes: Vec<usize> = decode_rows(batch)
            .map(|i| batch.seqs[i].token_offset as usize)
            .collect();
        let first_prefill = prefill_rows(batch)
            .next()
            .map(|i| batch.seqs[i].token_offset as usize);
        let mut out = Vec::new();
        for layer in 0..LAYERS {
            let k = Self::inputs(1, layer, tokens, &pos, kv0, kvh, d);
            let v = Self::inputs(2, layer, tokens, &pos, kv0, kvh, d);
            let (k, v) = (self.be.upload(&k).unwrap(), self.be.upload(&v).unwrap());
            self.be
                .kv_append(KvAppendArgs {
                    key: k.view(),
                    value: v.view(),
                    cache: &mut self.cache.layers[layer],
                    group: 0,
                })
                .unwrap();
            if !decodes.is_empty() {
                let dt: Vec<u32> = decodes.iter().map(|&i| tokens[i]).collect();
                let dp: Vec<u32> = decodes.iter().map(|&i| pos[i]).collect();
                let q = self
                    .be
                    .upload(&Self::inputs(3, layer, &dt, &dp, q0, qh, d))
                    .unwrap();
                let n = decodes.len();
                let mut o = self.nan(n, qh, d);
                self.be
                    .decode(DecodeArgs {
                        opts: &opts,
                        q: q.view(),
                        cache: &self.cache.layers[layer],
                        sinks: None,
                        group: 0,
                        out: o.view_mut(),
                        lse: None,
                    })
                    .unwrap();
                out.extend(self.f32s(&o));
            }
            if let Some(first) = first_prefill {
                let q = self
                    .be
                    .upload(&Self::inputs(
                        3,
                        layer,
                        &tokens[first..],
                        &pos[first..],
                        q0,
                        qh,
                        d,
                    ))
                    .unwrap();
                let n = tokens.len() - first;
                let mut o = self.nan(n, qh, d);
                self.be
                    .prefill(PrefillArgs {
                        opts: &opts,
                        q: q.view(),
                        cache: &self.cache.layers[layer],
                        sinks: None,
                        group: 0,
                        out: o.view_mut(),
                        lse: None,
                    })
                    .unwrap();
                out.extend(self.f32s(&o));
            }
        }
        assert!(out.iter().all(|x| x.is_finite()), "a NaN output");
        out
    }
}

/// The token sampled for a request at a position: the same in every run.
pub fn sampled_token(request: u64, pos: u32) -> u32 {
    (request as u32 * 31 + pos * 7) % 1000
}

/// The step's input tokens, in `slot_mapping` order.
pub fn input_tokens(s: &Scheduler, batch: &Batch) -> Vec<u32> {
    let mut t = Vec::with_capacity(batch.slot_mapping.len());
    for q in &batch.seqs {
        let toks = s.tokens(q.seq).unwrap();
        t.extend(toks.range(
            q.start_pos as usize,
            (q.start_pos + q.num_new_tokens) as usize,
        ));
    }
    t
}

/// What a step sampled: each of `batch`'s sequences its [`sampled_token`].
pub fn sampled(batch: &Batch) -> Vec<(u64, u32)> {
    batch
        .seqs
        .iter()
        .map(|q| (q.seq, sampled_token(q.request, q.context_len)))
        .collect()
}

/// The scheduler of every run: a pool small enough to preempt, prefix caching on.
pub fn scheduler() -> Scheduler {
    Scheduler::new(SchedulerConfig {
        num_blocks: full_shape().num_blocks,
        block_size: 16,
        max_num_seqs: 8,
        max_model_len: 128,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap()
}
