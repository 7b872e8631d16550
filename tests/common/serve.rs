//! One test body for every [`AttentionBackend`]: a scheduler serves requests with
//! shared prompt prefixes through a pool small enough to preempt (by swapping), and
//! every decoding sequence's output, every step, is checked against f64 attention over
//! the K/V its tokens must have in the cache. K and V are a function of (token,
//! position), as a model's would be for a given prefix, so a block that was swapped,
//! shared by the prefix cache or recomputed must still hold exactly them.
//!
//! `tests/serving/backend.rs` runs it on the CPU backend; `tests/cuda_backend/` on the CUDA
//! backend (ignored without a GPU; `scripts/gpu-check.sh` runs it).

use super::{rel_l2, tolerance};
use pagedkv::host::backend::{
    AsView, AttentionBackend, BackendConfig, DecodeArgs, KvAppendArgs, PrefillArgs, SplitPolicy,
    decode_rows, prefill_rows,
};
use pagedkv::host::block::{KvSpec, LayerGroups};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::ops::prefill::PrefillKernel;
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::reference::{DenseInputs, dense_decode_attention};
use pagedkv::host::scheduler::{PreemptionMode, Request, Scheduler, SchedulerConfig};
use pagedkv::host::step::StepShape;
use pagedkv::host::{DType, HostTensor};

pub const LAYERS: usize = 2;
pub const NUM_BLOCKS: u32 = 12;
pub const BLOCK: u32 = 8;
pub const HOST_BLOCKS: u32 = 64;

/// Prompts and the pool are `scale` times longer than the base case.
pub fn shape(dtype: DType, scale: u32) -> StepShape {
    StepShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: BLOCK,
        num_blocks: NUM_BLOCKS * scale,
        dtype,
        kv_dtype: dtype,
    }
}

pub fn config(dtype: DType, split: SplitPolicy, scale: u32) -> BackendConfig {
    config_kv(dtype, dtype, split, scale)
}

/// As [`config`], with a cache of `kv_dtype` (fp8 under 16-bit queries).
pub fn config_kv(dtype: DType, kv_dtype: DType, split: SplitPolicy, scale: u32) -> BackendConfig {
    let shape = StepShape {
        kv_dtype,
        ..shape(dtype, scale)
    };
    let mut c = BackendConfig::new(shape, LAYERS, 16, 64 * scale / BLOCK);
    c.num_host_blocks = HOST_BLOCKS;
    c.split = split;
    c
}

/// The fp8 scales of layer `li` for the base shape's 2 KV heads (see
/// [`fp8_scales_for`]).
pub fn fp8_scales(kv_dtype: DType, li: usize) -> KvScales {
    fp8_scales_for(kv_dtype, li, 2)
}

/// The fp8 scales of layer `li` for `kvh` KV heads (distinct per layer and KV head; the
/// data is in [-1, 1), so it fits with room to spare).
pub fn fp8_scales_for(kv_dtype: DType, li: usize, kvh: usize) -> KvScales {
    let m = kv_dtype.max_finite();
    let s = |base: f32| (0..kvh).map(|h| (base + 0.5 * h as f32) / m).collect();
    KvScales {
        k: s(1.0 + li as f32),
        v: s(1.25 + li as f32),
    }
}

/// What a cache of `kv_dtype` holds for K (or V) rows `x` (`[n, kvh * d]`) of layer
/// `li`: `x` itself, or for fp8 `decode(encode(x / scale)) * scale` per KV head.
fn as_cached(x: &HostTensor, kv_dtype: DType, scales: Option<&[f32]>, d: usize) -> Vec<f64> {
    let v = x.to_f64();
    let Some(s) = scales else { return v };
    let mut one = HostTensor::full(kv_dtype, &[1], 0.0);
    let kvh = s.len();
    v.iter()
        .enumerate()
        .map(|(i, &x)| {
            let sc = s[i / d % kvh];
            one.set(0, ((x as f32) / sc) as f64);
            one.get(0) * sc as f64
        })
        .collect()
}

/// A value in [-1, 1) that depends on every argument.
fn hash(a: u64, b: u64, c: u64, salt: u64) -> f64 {
    let mut x = a.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ b.wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
        ^ c.wrapping_mul(0x1656_67B1_9E37_79F9)
        ^ salt.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^= x >> 31;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^= x >> 29;
    (x >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// `[n, width]` rows of `f(token, pos)` for `(token, pos)` pairs, in `dtype` (so the
/// reference sees the rounded values the cache holds).
fn rows(dtype: DType, width: usize, keys: &[(u32, u32)], salt: u64) -> HostTensor {
    let v: Vec<f64> = keys
        .iter()
        .flat_map(|&(t, p)| (0..width).map(move |e| hash(t as u64, p as u64, e as u64, salt)))
        .collect();
    HostTensor::from_f64(dtype, &[keys.len(), width], &v).unwrap()
}

#[derive(Debug)]
pub struct Served {
    pub checked: usize,
    pub swapped_out: usize,
    pub swapped_in: usize,
    pub preempted: usize,
    /// Prefill outputs checked (every new token of every prefilling row).
    pub prefill_checked: usize,
    /// Steps whose decode launch used split-K.
    pub split_steps: usize,
    /// Steps whose prefill the plan gave the multi-warp tensor-core kernel, and those of
    /// them that also decoded rows (a step mixing decodes with prefill chunks).
    pub multi_warp_steps: usize,
    pub mixed_multi_warp_steps: usize,
    /// Steps whose decode ran as cascade attention.
    pub cascade_steps: usize,
    /// Prompt tokens served from the prefix cache, in all, and in the first step.
    pub cached_tokens: usize,
    pub cached_first_step: usize,
}

/// What [`serve_case`] serves: a scheduler's settings, its requests, and the attention
/// options every layer runs with.
pub struct ServeCase {
    /// The scheduler (its block size and pool must match the backend's shape).
    pub sched: SchedulerConfig,
    /// Chunked prefill on.
    pub chunked: bool,
    /// Each request's prompt and `max_tokens`.
    pub requests: Vec<(Vec<u32>, u32)>,
    /// Scale, window, soft-cap, ALiBi.
    pub opts: AttentionOptions,
    /// Every layer with attention sinks of its own ([`sink_logits`]).
    pub sinks: bool,
    /// The model's layer groups (a hybrid model: the scheduler's `kv_groups` are their
    /// specs, the backend made with `BackendConfig::for_groups`, each layer attending
    /// with its group's window); `None`: every layer one tensor of one group, with
    /// `opts`' window.
    pub layer_groups: Option<LayerGroups>,
}

/// Layer `li`'s attention-sink logits for `heads` query heads (different in every
/// layer and head, some above the scores, some below).
pub fn sink_logits(li: usize, heads: usize) -> Vec<f32> {
    (0..heads)
        .map(|h| 0.75 * h as f32 - 1.0 + li as f32)
        .collect()
}

/// The base case at `scale`: seven requests, four of them sharing a 17-token prefix
/// (two full blocks and a bit), through a pool small enough to swap, prefix caching
/// on, soft-cap, ALiBi and attention sinks.
pub fn shared_prefix_case(scale: u32) -> ServeCase {
    let sc = scale as usize;
    let requests = (0..7u64)
        .map(|i| {
            let len = sc
                * if i % 2 == 0 {
                    18 + i as usize
                } else {
                    5 + 2 * i as usize
                };
            let prompt: Vec<u32> = (0..len)
                .map(|p| {
                    if i % 2 == 0 && p < 17 * sc {
                        100 + p as u32
                    } else {
                        (i * 31 + p as u64) as u32 % 97
                    }
                })
                .collect();
            (prompt, 10 + (i as u32 % 4))
        })
        .collect();
    ServeCase {
        sched: SchedulerConfig {
            num_blocks: NUM_BLOCKS * scale,
            block_size: BLOCK,
            num_host_blocks: HOST_BLOCKS,
            max_num_seqs: 16,
            preemption: PreemptionMode::Swap,
            enable_prefix_caching: true,
            watermark: 0.0,
            max_model_len: 64 * scale,
            ..SchedulerConfig::default()
        },
        chunked: false,
        requests,
        opts: AttentionOptions {
            softcap: Some(8.0),
            alibi_slopes: Some(vec![0.25, 0.125, 0.0625, 0.03125]),
            ..AttentionOptions::new(64)
        },
        sinks: true,
        layer_groups: None,
    }
}

/// Serves [`shared_prefix_case`] on `be`, checking every output; returns what happened.
pub fn serve_and_check<B: AttentionBackend>(be: &mut B, scale: u32) -> Served {
    serve_case(be, &shared_prefix_case(scale))
}

/// Serves `case` on `be`, every layer of the backend's cache: every new token's K and V
/// are a function of (token, position) and appended, and every prefilling token's and
/// every decoding row's output, every step and layer, is checked against f64 attention
/// (with the case's window) over the K/V its history appended, computed densely from
/// those functions, never read back from the cache. Returns what happened.
pub fn serve_case<B: AttentionBackend>(be: &mut B, case: &ServeCase) -> Served {
    let c = *be.config();
    let groups = case
        .layer_groups
        .clone()
        .unwrap_or_else(|| LayerGroups::uniform(KvSpec::Full, c.num_layers).unwrap());
    assert_eq!(groups.layers_per_group(), c.num_layers);
    // Model layers (with groups, more than the cache's tensors).
    let layers = groups.num_layers();
    let (qh, kvh, d) = (
        c.shape.num_q_heads as usize,
        c.shape.num_kv_heads as usize,
        c.shape.head_dim as usize,
    );
    let (dtype, kv_dtype) = (c.shape.dtype, c.shape.kv_dtype);
    let mut cache = be.alloc_cache().unwrap();
    // One set of fp8 scales per cache tensor (shared by the layers of every group that
    // use it).
    let scales: Vec<Option<KvScales>> = (0..c.num_layers)
        .map(|li| kv_dtype.is_fp8().then(|| fp8_scales_for(kv_dtype, li, kvh)))
        .collect();
    for (li, s) in scales.iter().enumerate() {
        if let Some(s) = s {
            be.set_kv_scales(&mut cache, li, s).unwrap();
        }
    }
    // The K and V rows a layer's cache (tensor `ti`) holds for `(token, position)`
    // pairs.
    let cached = |keys: &[(u32, u32)], ti: usize, salt: u64, v: bool| {
        let s = scales[ti]
            .as_ref()
            .map(|s| if v { &s.v[..] } else { &s.k[..] });
        as_cached(&rows(dtype, kvh * d, keys, salt), kv_dtype, s, d)
    };
    let mut sched = Scheduler::with_chunked_prefill(case.sched.clone(), case.chunked).unwrap();
    for (i, (prompt, max_tokens)) in case.requests.iter().enumerate() {
        sched
            .add_request(Request::new(i as u64, prompt.clone(), *max_tokens))
            .unwrap();
    }
    // Each layer's sinks, on the backend's device (as a model's weights would be).
    let sinks: Vec<Option<Vec<f32>>> = (0..layers)
        .map(|li| case.sinks.then(|| sink_logits(li, qh)))
        .collect();
    let sink_bufs: Vec<_> = sinks
        .iter()
        .map(|s| {
            s.as_ref().map(|s| {
                let v: Vec<f64> = s.iter().map(|&x| x as f64).collect();
                be.upload(&HostTensor::from_f64(DType::F32, &[qh], &v).unwrap())
                    .unwrap()
            })
        })
        .collect();
    let mut s = Served {
        checked: 0,
        swapped_out: 0,
        swapped_in: 0,
        preempted: 0,
        split_steps: 0,
        multi_warp_steps: 0,
        mixed_multi_warp_steps: 0,
        cascade_steps: 0,
        prefill_checked: 0,
        cached_tokens: 0,
        cached_first_step: 0,
    };
    let mut steps = 0;
    while !sched.is_idle() {
        steps += 1;
        assert!(steps < 2000, "the scheduler does not finish");
        let batch = sched.step().unwrap().clone();
        s.cached_tokens += batch.num_cached_tokens as usize;
        if steps == 1 {
            s.cached_first_step = batch.num_cached_tokens as usize;
        }
        s.swapped_out += batch.swap_out.len();
        s.swapped_in += batch.swap_in.len();
        s.preempted += batch.preempted.len();
        let planned = be.begin_step(&batch, &mut cache).unwrap();
        s.split_steps += planned.decode.is_some_and(|(_, p)| p.is_split()) as usize;
        s.cascade_steps += planned.cascade.is_some() as usize;
        assert_eq!(
            planned.prefill.is_some(),
            !prefill_rows(&batch).is_empty(),
            "a prefill plan exactly when the step prefills"
        );
        if let Some(p) = planned.prefill
            && matches!(p.kernel, PrefillKernel::MultiWarp { .. })
        {
            s.multi_warp_steps += 1;
            s.mixed_multi_warp_steps += planned.decode.is_some() as usize;
        }
        // (token, position) of every new token, and of every decoding row's query.
        let mut new = Vec::new();
        for q in &batch.seqs {
            let toks = sched.tokens(q.seq).unwrap();
            for p in q.start_pos..q.start_pos + q.num_new_tokens {
                new.push((toks[p as usize], p));
            }
        }
        let dec: Vec<usize> = decode_rows(&batch).collect();
        let queries: Vec<(u32, u32)> = dec
            .iter()
            .map(|&i| {
                let q = &batch.seqs[i];
                (
                    sched.tokens(q.seq).unwrap()[q.start_pos as usize],
                    q.start_pos,
                )
            })
            .collect();
        for li in 0..layers {
            let (group, ti) = (groups.group_of(li), groups.tensor_of(li));
            let layer = &mut cache.layers[ti];
            // A hybrid model's layer attends with its group's window.
            let lopts = match case.layer_groups {
                Some(_) => AttentionOptions {
                    window: groups.specs()[group].window(),
                    ..case.opts.clone()
                },
                None => case.opts.clone(),
            };
            let opts = &lopts;
            let salt = 10 * li as u64;
            let key = be.upload(&rows(dtype, kvh * d, &new, salt + 1)).unwrap();
            let value = be.upload(&rows(dtype, kvh * d, &new, salt + 2)).unwrap();
            be.kv_append(KvAppendArgs {
                key: key.view(),
                value: value.view(),
                cache: layer,
                group,
            })
            .unwrap();
            // Prefilling rows: every new token against attention over its prefix.
            let pre: Vec<usize> = prefill_rows(&batch).collect();
            if !pre.is_empty() {
                // (sequence, position) of every new token of the prefilling rows.
                let owners: Vec<_> = pre
                    .iter()
                    .flat_map(|&i| {
                        let q = &batch.seqs[i];
                        (q.start_pos..q.start_pos + q.num_new_tokens).map(move |p| (q.seq, p))
                    })
                    .collect();
                let pq: Vec<(u32, u32)> = owners
                    .iter()
                    .map(|&(seq, p)| (sched.tokens(seq).unwrap()[p as usize], p))
                    .collect();
                let qt = rows(dtype, qh * d, &pq, salt + 3);
                let q = be.upload(&qt).unwrap();
                let nan = HostTensor::full(dtype, &[pq.len(), qh, d], f64::NAN);
                let mut out = be.upload(&nan).unwrap();
                be.prefill(PrefillArgs {
                    lse: None,
                    opts,
                    q: q.view(),
                    cache: layer,
                    sinks: sink_bufs[li].as_ref().map(|b| b.view()),
                    out: out.view_mut(),
                    group,
                })
                .unwrap();
                let got = be.download(&out).unwrap().to_f64();
                for (j, &(seq, pos)) in owners.iter().enumerate() {
                    let toks = sched.tokens(seq).unwrap();
                    let hist: Vec<(u32, u32)> = (0..=pos).map(|p| (toks[p as usize], p)).collect();
                    let k = cached(&hist, ti, salt + 1, false);
                    let v = cached(&hist, ti, salt + 2, true);
                    let qs: Vec<f64> = (0..qh * d).map(|e| qt.get(j * qh * d + e)).collect();
                    let want = dense_decode_attention(&DenseInputs {
                        q: &qs,
                        k: &k,
                        v: &v,
                        num_q_heads: qh,
                        num_kv_heads: kvh,
                        head_dim: d,
                        opts,
                        sinks: sinks[li].as_deref(),
                    });
                    let e = rel_l2(&got[j * qh * d..(j + 1) * qh * d], &want);
                    assert!(
                        e <= tolerance(dtype),
                        "{} step {steps} layer {li} prefill token {j} (pos {pos}): rel L2 {e:e}",
                        be.name()
                    );
                    s.prefill_checked += 1;
                }
            }
            if dec.is_empty() {
                continue;
            }
            let qt = rows(dtype, qh * d, &queries, salt + 3);
            let q = be.upload(&qt).unwrap();
            let nan = HostTensor::full(dtype, &[dec.len(), qh, d], f64::NAN);
            let mut out = be.upload(&nan).unwrap();
            be.decode(DecodeArgs {
                lse: None,
                opts,
                q: q.view(),
                cache: layer,
                sinks: sink_bufs[li].as_ref().map(|b| b.view()),
                out: out.view_mut(),
                group,
            })
            .unwrap();
            let got = be.download(&out).unwrap().to_f64();
            for (j, &i) in dec.iter().enumerate() {
                let seq = batch.seqs[i].seq;
                let ctx = batch.context_lens[i] as u32;
                let toks = sched.tokens(seq).unwrap();
                let hist: Vec<(u32, u32)> = (0..ctx).map(|p| (toks[p as usize], p)).collect();
                let k = cached(&hist, ti, salt + 1, false);
                let v = cached(&hist, ti, salt + 2, true);
                let qs: Vec<f64> = (0..qh * d).map(|e| qt.get(j * qh * d + e)).collect();
                let want = dense_decode_attention(&DenseInputs {
                    q: &qs,
                    k: &k,
                    v: &v,
                    num_q_heads: qh,
                    num_kv_heads: kvh,
                    head_dim: d,
                    opts,
                    sinks: sinks[li].as_deref(),
                });
                let e = rel_l2(&got[j * qh * d..(j + 1) * qh * d], &want);
                assert!(
                    e <= tolerance(dtype),
                    "{} step {steps} layer {li} seq {seq:?} ctx {ctx}: rel L2 {e:e}",
                    be.name()
                );
                s.checked += 1;
            }
        }
        let sampled: Vec<_> = batch
            .seqs
            .iter()
            .map(|q| (q.seq, (q.context_len * 7 + q.request as u32) % 97))
            .collect();
        sched.on_step_done(&sampled).unwrap();
    }
    be.synchronize().unwrap();
    s
}
