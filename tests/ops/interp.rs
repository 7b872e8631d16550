//! The committed PTX, executed by the PTX interpreter (`ptx-interp/`) for both modules
//! (sm_80 and sm_90), through the same one-shot step path the emulator runs
//! (`pagedkv::host::step::once`, the path engines use): every entry point of both
//! modules runs here, on awkward shapes (batch 17, lengths off the block size, shuffled
//! and shared block tables, windows, soft-cap, ALiBi, split-K, every dtype and fp8
//! cache), and each output equals the emulator's bit for bit in exact math and matches
//! the f64 reference. A test then checks that nothing the modules export went
//! unlaunched, so a new entry point without an interpreter test fails CI.

use std::collections::BTreeSet;
use std::sync::{Arc, LazyLock, Mutex};

use crate::cascade::{cascade_on, shared_case};
use crate::common;
use crate::fp8_cache::fp8_prefill_case;
use crate::prefill::{
    Prefill, chunk_cases, prefill_case, prefill_holds, prefill_on, prefill_on_lse, tree_case,
};
use common::case::{Case, Params, build};
use common::fp8::quantise_case;
use common::{cases, lse_error, lse_tolerance, rel_l2, rng, tolerance, uniform};
use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::SUPPORTED_HEAD_DIMS;
use pagedkv::host::ops::attention::{AttentionOut, DecodeInputs, SplitPlan, plan_unsplit};
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_reference};
use pagedkv::host::ops::merge::{MergeInputs, MergeShape};
use pagedkv::host::ops::prefill::PrefillKernel;
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::reference::{
    self, paged_decode_attention, paged_decode_lse, paged_prefill_attention,
};
use pagedkv::host::step::{EmuDevice, StepDevice, once};
use pagedkv::host::{AlignedBuf, DType, HostTensor};
use pagedkv::kernels::kernels::DecodeParams;
use pagedkv::kernels::kernels::attention::{FIXED_BLOCK_SIZE, FIXED_HEAD_DIMS, MMA_HEAD_DIMS};
use pagedkv::kernels::{F16, PagedLayout};
use pagedkv_ptx_interp::{LaunchLog, MathMode, Module, PtxDevice};
use proptest::prelude::*;
use rand::Rng;
use rand::seq::SliceRandom;

/// A parsed module and, if kept, the log of every launch made on it.
struct Arch {
    module: Arc<Module>,
    logs: Option<Mutex<Vec<LaunchLog>>>,
}

/// Both committed modules, parsed once, shared by the tests that only need devices
/// (their launches and coverage are not what any test counts).
static ARCHS: LazyLock<Vec<Arch>> =
    LazyLock::new(|| (0..2).map(|i| Arch::committed(i, false)).collect());

impl Arch {
    fn new(module: Module, logged: bool) -> Self {
        Self {
            module: Arc::new(module),
            logs: logged.then(|| Mutex::new(Vec::new())),
        }
    }

    /// Committed module `arch` (0: sm_80, 1: sm_90), parsed afresh: its own launch log
    /// and coverage counts when `logged`.
    fn committed(arch: usize, logged: bool) -> Self {
        let m = &pagedkv::ptx::ALL[arch];
        Self::new(
            Module::parse(m.arch, m.ptx).expect("the committed PTX parses"),
            logged,
        )
    }

    /// A fresh interpreter device over this module (logged if the module is).
    fn device(&self) -> PtxDevice {
        let dev = PtxDevice::new(self.module.clone(), MathMode::Exact);
        if let Some(logs) = &self.logs {
            logs.lock().unwrap().push(dev.log());
        }
        dev
    }
}

/// An interpreter device over committed module `arch` (0: sm_80, 1: sm_90), for the
/// other test files' properties.
pub(crate) fn device(arch: usize) -> PtxDevice {
    ARCHS[arch].device()
}

/// What went wrong in a family's run: the first failure, as a message.
type Outcome = Result<(), String>;

/// The first element where two outputs differ, as a message (None: bit-identical).
fn first_difference(what: &str, got: &HostTensor, want: &HostTensor) -> Option<String> {
    let (g, w) = (got.buf().as_bytes(), want.buf().as_bytes());
    if g == w {
        return None;
    }
    let size = got.dtype().size();
    let i = (0..g.len()).find(|&i| g[i] != w[i]).unwrap() / size;
    Some(format!(
        "{what}: element {i} differs: interpreter {} vs emulator {}",
        got.get(i),
        want.get(i)
    ))
}

fn decode_on<D: StepDevice>(dev: D, c: &Case, plan: SplitPlan) -> Result<HostTensor, String> {
    let mut out = HostTensor::full(c.q.dtype(), c.q.shape(), f64::NAN);
    let inputs = DecodeInputs {
        plan: Some(plan),
        ..c.inputs()
    };
    once::decode(dev, None, inputs, &mut out).map_err(|e| format!("decode: {e}"))?;
    Ok(out)
}

/// [`decode_on`], writing each output's log-sum-exp too (poisoned with NaN first).
fn decode_on_lse<D: StepDevice>(
    dev: D,
    c: &Case,
    plan: SplitPlan,
) -> Result<(HostTensor, HostTensor), String> {
    let mut out = HostTensor::full(c.q.dtype(), c.q.shape(), f64::NAN);
    let heads = [c.shape.num_seqs as usize, c.shape.num_q_heads as usize];
    let mut lse = HostTensor::full(DType::F32, &heads, f64::NAN);
    let inputs = DecodeInputs {
        plan: Some(plan),
        ..c.inputs()
    };
    let to = AttentionOut {
        out: &mut out,
        lse: Some(&mut lse),
    };
    once::decode(dev, None, inputs, to).map_err(|e| format!("decode: {e}"))?;
    Ok((out, lse))
}

/// The interpreter's output against the emulator's (bit for bit) and the reference.
fn check(what: &str, got: &HostTensor, emu: &HostTensor, want: &[f64], tol: f64) -> Outcome {
    if let Some(d) = first_difference(what, got, emu) {
        return Err(d);
    }
    let e = rel_l2(&got.to_f64(), want);
    if e.is_nan() || e > tol {
        return Err(format!("{what}: rel L2 {e:e} vs the reference"));
    }
    Ok(())
}

/// Every query dtype with every cache it may use (fp8 under 16-bit queries).
const DTYPES: [(DType, Option<DType>); 7] = [
    (DType::F32, None),
    (DType::F16, None),
    (DType::Bf16, None),
    (DType::F16, Some(DType::E4m3)),
    (DType::F16, Some(DType::E5m2)),
    (DType::Bf16, Some(DType::E4m3)),
    (DType::Bf16, Some(DType::E5m2)),
];

/// The sweep both attention families run: every dtype and cache with every supported
/// head_dim, block sizes 8/16/32 in turn, lengths off the block size, and the options
/// in turn (none; window + soft-cap + sinks; ALiBi + GQA 8 over one KV head + sinks;
/// window + ALiBi),
/// so every branch of the kernels' loops is taken somewhere. Batch 17 for head_dim 128.
fn sweep(max_len: u32) -> Vec<(Params, Option<DType>)> {
    let mut v = Vec::new();
    let mut i = 0u64;
    for (dtype, cache) in DTYPES {
        for head_dim in SUPPORTED_HEAD_DIMS {
            let variant = i % 4;
            v.push((
                Params {
                    sinks: matches!(variant, 1 | 2),
                    dtype,
                    head_dim,
                    block_size: [8, 16, 32][i as usize % 3],
                    num_kv_heads: if variant == 2 { 1 } else { 2 },
                    group: if variant == 2 { 8 } else { 4 },
                    batch: if head_dim == 128 { 17 } else { 3 },
                    max_len,
                    window: matches!(variant, 1 | 3).then_some(23),
                    softcap: (variant == 1).then_some(12.0),
                    alibi: matches!(variant, 2 | 3),
                    partition: Some(64),
                    narrow_heads: false,
                    seed: 100 + i,
                    full_length: false,
                },
                cache,
            ));
            i += 1;
        }
    }
    v
}

fn decode_all(a: &Arch) -> Outcome {
    // Every case, and each compile-time-geometry head_dim once more at block size 16
    // (its own kernel) with a group of 8: the unsplit plan then gives every fixed
    // geometry tiles of 8 tokens, the narrow plan tiles of 2.
    let mut cases = sweep(150);
    for (p, cache) in cases.clone() {
        if FIXED_HEAD_DIMS.contains(&p.head_dim) {
            cases.push((
                Params {
                    block_size: FIXED_BLOCK_SIZE,
                    num_kv_heads: 1,
                    group: 8,
                    batch: 3,
                    seed: p.seed + 1000,
                    ..p
                },
                cache,
            ));
        }
    }
    // The tensor-core kernels past their prologue: contexts of several 64-token
    // stages, so the steady-state loop looks up and copies every block of a stage,
    // with a window that starts mid-stage, soft-cap and ALiBi at once; for every
    // cache type of each q type at both head_dims.
    let caches = [None, Some(DType::E4m3), Some(DType::E5m2)];
    let mut i = 0;
    for dtype in [DType::F16, DType::Bf16] {
        for head_dim in MMA_HEAD_DIMS {
            for cache in caches {
                let long = Params {
                    sinks: true,
                    dtype,
                    head_dim,
                    block_size: FIXED_BLOCK_SIZE,
                    num_kv_heads: 1,
                    group: 4,
                    batch: 2,
                    max_len: 500,
                    window: Some(300),
                    softcap: Some(12.0),
                    alibi: true,
                    partition: Some(128),
                    narrow_heads: false,
                    seed: 300 + i,
                    full_length: false,
                };
                // And once without soft-cap, window or ALiBi (the other side of
                // each of their branches), shorter.
                let plain = Params {
                    max_len: 150,
                    window: None,
                    softcap: None,
                    alibi: false,
                    sinks: false,
                    partition: Some(64),
                    seed: 350 + i,
                    ..long
                };
                cases.push((long, cache));
                cases.push((plain, cache));
                i += 1;
            }
        }
    }
    // The CUDA-core kernels of a compile-time geometry (f32 at every fixed head_dim,
    // 16-bit and fp8 caches at 256) past their prologue too (the sweep's window keeps
    // their stages few), and with fewer stages than the prologue. Each plan below
    // takes another tile loop (tiles of 8 tokens with every head of the group in one
    // CTA, of 2 with fewer).
    // The runtime-geometry kernels over fp8 caches likewise, at head_dim 32 (two
    // chunks a head vector: a thread's first piece may be V), 80 and 112 (seven
    // chunks: a thread's fourth piece exists).
    let mut i = 0;
    for (dtype, cache) in DTYPES {
        let fixed = FIXED_HEAD_DIMS
            .into_iter()
            .filter(|d| dtype == DType::F32 || !MMA_HEAD_DIMS.contains(d))
            .map(|d| (d, FIXED_BLOCK_SIZE));
        let runtime = [(32, 8), (80, 8), (112, 8)]
            .into_iter()
            .filter(|_| cache.is_some());
        for (head_dim, block_size) in fixed.chain(runtime) {
            let long = Params {
                sinks: true,
                dtype,
                head_dim,
                block_size,
                num_kv_heads: 1,
                group: 4,
                batch: 2,
                max_len: 200,
                window: Some(120),
                softcap: Some(12.0),
                alibi: true,
                partition: Some(64),
                narrow_heads: false,
                seed: 500 + i,
                full_length: true,
            };
            let plain = Params {
                window: None,
                softcap: None,
                alibi: false,
                sinks: false,
                seed: 550 + i,
                ..long
            };
            // And a context of fewer stages than the prologue issues.
            let short = Params {
                max_len: 7,
                seed: 600 + i,
                ..plain
            };
            cases.extend([(long, cache), (plain, cache), (short, cache)]);
            i += 1;
        }
    }
    // The runtime-geometry kernels over fp8 caches (tiles of 2) also with one token a
    // tile: one query head a KV head at head_dim 32 (a thread's first piece may be V)
    // and 256 (it is K) gives a token group each row of a stage (per_group 1); with
    // soft-cap, ALiBi and a window, and without.
    let mut k = 0;
    for (dtype, cache) in DTYPES.into_iter().filter(|(_, c)| c.is_some()) {
        for head_dim in [32, 256] {
            let full = Params {
                sinks: true,
                dtype,
                head_dim,
                block_size: 8,
                num_kv_heads: 2,
                group: 1,
                batch: 2,
                max_len: 60,
                window: Some(40),
                softcap: Some(12.0),
                alibi: true,
                partition: Some(64),
                narrow_heads: false,
                seed: 650 + k,
                full_length: true,
            };
            let plain = Params {
                sinks: false,
                window: None,
                softcap: None,
                alibi: false,
                seed: 680 + k,
                ..full
            };
            cases.extend([(full, cache), (plain, cache)]);
            k += 1;
        }
    }
    // More partitions than the reduce has lanes per chunk (REDUCE_LANES), so a lane
    // folds several: 700 tokens in partitions of 64, for each reduce kernel; 3 query
    // heads of head_dim 32 (12 chunks of f16 / bf16: the reduce's last block has lanes
    // past the last head, which join its shuffles and store nothing).
    for (k, dtype) in [DType::F16, DType::Bf16, DType::F32]
        .into_iter()
        .enumerate()
    {
        cases.push((
            Params {
                // (The reduce joins the sinks: once for one of them.)
                sinks: k == 1,
                dtype,
                head_dim: 32,
                block_size: FIXED_BLOCK_SIZE,
                num_kv_heads: 1,
                group: 3,
                batch: 2,
                max_len: 700,
                window: None,
                softcap: None,
                alibi: false,
                partition: Some(64),
                narrow_heads: false,
                seed: 400 + k as u64,
                full_length: true,
            },
            None,
        ));
    }
    for (p, cache) in cases {
        let mut c = build(&p);
        if let Some(cache) = cache {
            quantise_case(&mut c, cache, true);
        }
        let want = paged_decode_attention(&c.inputs());
        let want_lse = paged_decode_lse(&c.inputs());
        let max_len = *c.lens.iter().max().unwrap() as u32;
        let unsplit = plan_unsplit(&c.shape, p.dtype, max_len);
        let part = p.partition.unwrap();
        // Split, with fewer heads per CTA (so other thread geometries: more token
        // groups, another split of the copies between K and V).
        let split = SplitPlan {
            partition_tokens: part,
            num_partitions: max_len.div_ceil(part),
            heads_per_block: 1.max(unsplit.heads_per_block / 2),
        };
        let narrow = SplitPlan {
            heads_per_block: 1,
            ..unsplit
        };
        // The unsplit and split runs write the log-sum-exp (the decode kernel's
        // epilogue, the reduce's), the narrow one none.
        for (pl, with_lse) in [(unsplit, true), (split, true), (narrow, false)] {
            let what = format!("decode {:?} cache {cache:?}, {pl:?}", p.dtype);
            if !with_lse {
                let emu = decode_on(EmuDevice::new(Emulator::new()), &c, pl)?;
                let got = decode_on(a.device(), &c, pl)?;
                check(&what, &got, &emu, &want, tolerance(p.dtype))?;
                continue;
            }
            let (emu, emu_lse) = decode_on_lse(EmuDevice::new(Emulator::new()), &c, pl)?;
            let (got, lse) = decode_on_lse(a.device(), &c, pl)?;
            check(&what, &got, &emu, &want, tolerance(p.dtype))?;
            if let Some(d) = first_difference(&format!("{what} log-sum-exp"), &lse, &emu_lse) {
                return Err(d);
            }
            let e = lse_error(&lse.to_f64(), &want_lse);
            if e.is_nan() || e > lse_tolerance(p.softcap, false) {
                return Err(format!("{what}: log-sum-exp off by {e:e} vs the reference"));
            }
        }
    }
    Ok(())
}

fn prefill_all(a: &Arch) -> Outcome {
    // Every multi-warp kernel (each q type and cache type at head_dim 64 and 128, block
    // 16) over several 64-token stages: once with a window, soft-cap and ALiBi, once
    // longer with none of them.
    let mut cases = sweep(45);
    let mut i = 0;
    for dtype in [DType::F16, DType::Bf16] {
        for head_dim in MMA_HEAD_DIMS {
            for cache in [None, Some(DType::E4m3), Some(DType::E5m2)] {
                let long = Params {
                    sinks: false,
                    dtype,
                    head_dim,
                    block_size: FIXED_BLOCK_SIZE,
                    num_kv_heads: 2,
                    group: 4,
                    // Each sequence's chunk is drawn (whole, one token or between):
                    // three make a chunk of more than two tokens (rows g + 8 of a
                    // warp valid) all but certain.
                    batch: 3,
                    max_len: 200,
                    window: Some(90),
                    softcap: Some(9.0),
                    alibi: true,
                    partition: None,
                    narrow_heads: false,
                    seed: 700 + i,
                    full_length: true,
                };
                // Longer: more than 4 stages, so the steady-state loop looks up
                // every block of a stage.
                let plain = Params {
                    max_len: 300,
                    window: None,
                    softcap: None,
                    alibi: false,
                    seed: 750 + i,
                    ..long
                };
                cases.push((long, cache));
                cases.push((plain, cache));
                i += 1;
            }
        }
    }
    for (p, cache) in cases {
        let mut pc = prefill_case(&p);
        if let Some(cache) = cache {
            quantise_case(&mut pc.c, cache, true);
        }
        let what = format!(
            "prefill {:?} cache {cache:?}, window {:?}",
            p.dtype, p.window
        );
        prefill_holds_on_ptx(a, &what, &pc, p.seed)?;
    }
    Ok(())
}

/// The prefill proof ([`prefill_holds`]: exact and approximate math against the f64
/// reference) on module `a`, and its exact output equal to the emulator's bit for bit.
fn prefill_holds_on_ptx(a: &Arch, what: &str, pc: &Prefill, seed: u64) -> Outcome {
    let what = format!("{} {what}", a.module.target());
    let approx = PtxDevice::new(a.module.clone(), MathMode::Approx { seed });
    let (got, lse) = prefill_holds(&what, pc, a.device(), approx)?;
    let (emu, emu_lse) = prefill_on_lse(EmuDevice::new(Emulator::new()), pc)?;
    first_difference(&what, &got, &emu)
        .or_else(|| first_difference(&format!("{what} log-sum-exp"), &lse, &emu_lse))
        .map_or(Ok(()), Err)
}

/// Tree masks (speculative decoding's verify rows) in every kernel that reads them:
/// each 16-bit dtype and cache at head_dim 64 and 128 (block 16: the multi-warp
/// kernels) and 80 (the one-warp `TREE` variant), f32 on CUDA cores; trees, chains
/// and causal rows (some longer than 64 tokens) in one batch.
fn tree_all(a: &Arch) -> Outcome {
    let mut i = 0u64;
    for (dtype, cache) in DTYPES {
        let dims: &[u32] = if dtype == DType::F32 {
            &[80]
        } else {
            &[64, 80, 128]
        };
        for &head_dim in dims {
            // Soft-cap and sinks, then neither: each kernel takes both sides of both.
            for options in [true, false] {
                i += 1;
                let p = Params {
                    sinks: options,
                    dtype,
                    head_dim,
                    block_size: 16,
                    num_kv_heads: 1,
                    group: 2,
                    batch: 4,
                    // Off the block size (the last tile runs past the context), and
                    // whole prompts longer than 64 tokens (causal rows in the mask).
                    max_len: 77,
                    window: None,
                    softcap: options.then_some(11.0),
                    alibi: false,
                    partition: None,
                    narrow_heads: false,
                    seed: 1500 + i,
                    full_length: true,
                };
                let (mut pc, _) = tree_case(&p);
                if let Some(cache) = cache {
                    quantise_case(&mut pc.c, cache, true);
                }
                let what = format!("tree prefill {dtype} cache {cache:?} d{head_dim}");
                prefill_holds_on_ptx(a, &what, &pc, p.seed)?;
            }
        }
    }
    Ok(())
}

/// The merge of attention states for each output dtype: 1 to 3 parts, some of no keys
/// (`lse = -inf`, outputs NaN: the loop's skip), with and without sinks and a merged
/// log-sum-exp; against the emulator bit for
/// bit and the f64 reference.
fn merge_all(a: &Arch) -> Outcome {
    let mut i = 0u64;
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for (head_dim, num_states, num_heads) in [(32, 1, 3), (64, 2, 8), (128, 3, 5), (256, 2, 2)]
        {
            i += 1;
            let shape = MergeShape {
                num_rows: 5,
                num_states,
                num_heads,
                head_dim,
            };
            let (rows, states, heads, d) = (
                5usize,
                num_states as usize,
                num_heads as usize,
                head_dim as usize,
            );
            let mut r = rng(900 + i);
            let lse: Vec<f64> = (0..rows * states * heads)
                .map(|k| {
                    if k % 4 == 1 {
                        f64::NEG_INFINITY
                    } else {
                        r.random_range(-4.0..9.0f32) as f64
                    }
                })
                .collect();
            let mut v = uniform(&mut r, rows * states * heads * d);
            for (k, l) in lse.iter().enumerate() {
                if *l == f64::NEG_INFINITY {
                    v[k * d..(k + 1) * d].fill(f64::NAN);
                }
            }
            let sinks: Option<Vec<f32>> = i
                .is_multiple_of(2)
                .then(|| (0..heads).map(|h| h as f32 - 1.5).collect());
            let vt = HostTensor::from_f64(dtype, &[rows, states, heads, d], &v).unwrap();
            let lt = HostTensor::from_f64(DType::F32, &[rows, states, heads], &lse).unwrap();
            let inputs = MergeInputs {
                shape: &shape,
                v: &vt,
                lse: &lt,
                sinks: sinks.as_deref(),
            };
            let run = |dev: PtxDevice| -> Result<(HostTensor, HostTensor), String> {
                let mut out = HostTensor::full(dtype, &[rows, heads, d], f64::NAN);
                let mut l = HostTensor::full(DType::F32, &[rows, heads], f64::NAN);
                let to = AttentionOut {
                    out: &mut out,
                    lse: Some(&mut l),
                };
                once::merge(dev, inputs, to).map_err(|e| format!("merge: {e}"))?;
                Ok((out, l))
            };
            let (got, got_lse) = run(a.device())?;
            let mut emu = HostTensor::full(dtype, &[rows, heads, d], f64::NAN);
            let mut emu_lse = HostTensor::full(DType::F32, &[rows, heads], f64::NAN);
            let to = AttentionOut {
                out: &mut emu,
                lse: Some(&mut emu_lse),
            };
            once::merge(EmuDevice::new(Emulator::new()), inputs, to).map_err(|e| e.to_string())?;
            // And without the merged log-sum-exp (the other side of its branch).
            let mut plain = HostTensor::full(dtype, &[rows, heads, d], f64::NAN);
            once::merge(a.device(), inputs, &mut plain).map_err(|e| e.to_string())?;
            let what = format!("merge {dtype} d{head_dim} x{num_states}");
            let (want, want_lse) = reference::merge_states(
                &vt.to_f64(),
                &lt.to_f64(),
                (states, heads, d),
                sinks.as_deref(),
            );
            check(&what, &got, &emu, &want, tolerance(dtype))?;
            if let Some(e) = first_difference(&what, &plain, &emu)
                .or_else(|| first_difference(&format!("{what} log-sum-exp"), &got_lse, &emu_lse))
            {
                return Err(e);
            }
            let e = lse_error(&got_lse.to_f64(), &want_lse);
            if e.is_nan() || e > lse_tolerance(None, false) {
                return Err(format!("{what}: log-sum-exp off by {e:e}"));
            }
        }
    }
    Ok(())
}

/// Cascade attention (the suffix decode from `kv_start`, the shared prefill of
/// gathered `q_rows` at their `q_pos`, the merge by `state_rows`) for every dtype and
/// cache, at head_dim 64 (the multi-warp prefill for 16-bit queries at block size 16)
/// and 80 (the one-warp one), with soft-cap, ALiBi and sinks in turn: the interpreter
/// bit for bit the emulator, within tolerance of flat attention's reference.
fn cascade_all(a: &Arch) -> Outcome {
    let mut i = 0u64;
    for (dtype, cache) in DTYPES {
        for head_dim in [64, 80] {
            i += 1;
            let p = Params {
                dtype,
                head_dim,
                block_size: 16,
                num_kv_heads: 2,
                group: 2,
                batch: 9,
                max_len: 100,
                window: None,
                softcap: i.is_multiple_of(2).then_some(10.0),
                alibi: i.is_multiple_of(3),
                sinks: i % 2 == 1,
                partition: None,
                narrow_heads: false,
                seed: 1200 + i,
                full_length: false,
            };
            // The first seed from 1200 + i whose case has a group.
            let (p, c) = (0..64)
                .map(|k| {
                    let p = Params {
                        seed: p.seed + 100 * k,
                        ..p.clone()
                    };
                    let c = shared_case(&p, cache);
                    (p, c)
                })
                .find(|(_, c)| {
                    let s = &c.shape;
                    !pagedkv::host::ops::cascade::find_groups(
                        &c.tables,
                        s.max_blocks_per_seq,
                        &c.lens,
                        s.block_size,
                        1,
                    )
                    .is_empty()
                })
                .expect("a case with a group");
            let what = format!("cascade {dtype} cache {cache:?} d{head_dim}");
            let got = cascade_on(a.device(), &c, None, 1)?;
            if got.planned.is_none() {
                return Err(format!("{what}: no group (seed {})", p.seed));
            }
            let emu = cascade_on(EmuDevice::new(Emulator::new()), &c, None, 1)?;
            let want = paged_decode_attention(&c.inputs());
            check(&what, &got.out, &emu.out, &want, 2.0 * tolerance(dtype))?;
            if let Some(d) = first_difference(&format!("{what} log-sum-exp"), &got.lse, &emu.lse) {
                return Err(d);
            }
        }
    }
    Ok(())
}

fn kv_append_all(a: &Arch) -> Outcome {
    let cases = [
        (DType::F32, DType::F32),
        (DType::F16, DType::F16),
        (DType::Bf16, DType::Bf16),
        (DType::F16, DType::E4m3),
        (DType::F16, DType::E5m2),
        (DType::Bf16, DType::E4m3),
        (DType::Bf16, DType::E5m2),
    ];
    for (i, (dtype, cache)) in cases.into_iter().enumerate() {
        let mut r = rng(60 + i as u64);
        let layout = PagedLayout {
            num_blocks: 7,
            num_kv_heads: 3,
            block_size: 16,
            head_dim: 64,
        };
        let row = (layout.num_kv_heads * layout.head_dim) as usize;
        let slots = (layout.num_blocks * layout.block_size) as i64;
        // 17 tokens at shuffled slots, two skipped (negative).
        let mut all: Vec<i64> = (0..slots).collect();
        all.shuffle(&mut r);
        let mut mapping: Vec<i64> = all[..17].to_vec();
        mapping[4] = -1;
        mapping[11] = -1;
        let n = mapping.len();
        // Mostly uniform values, and every few elements one the fp8 conversion treats
        // specially once scaled: zeros, values that land in fp8's subnormals, past its
        // largest finite value (saturated), infinities, NaN.
        let special = [
            0.0,
            -0.0,
            1e-7,
            -1.5e-7,
            1e-6,
            -3e-5,
            1e3,
            -5e4,
            f64::INFINITY,
            f64::NEG_INFINITY,
            f64::NAN,
        ];
        let values = |r: &mut rand::rngs::SmallRng| -> Vec<f64> {
            let mut x = uniform(r, n * row);
            for (i, x) in x.iter_mut().enumerate() {
                if i % 5 == 0 {
                    *x = special[(i / 5) % special.len()];
                }
            }
            x
        };
        let k = HostTensor::from_f64(dtype, &[n, row], &values(&mut r)).unwrap();
        let v = HostTensor::from_f64(dtype, &[n, row], &values(&mut r)).unwrap();
        let scales = (cache != dtype).then(|| KvScales {
            k: (0..3)
                .map(|h| 0.002 + 0.001 * h as f32 + r.random_range(0.0..0.001))
                .collect(),
            v: (0..3).map(|h| 0.003 + 0.001 * h as f32).collect(),
        });
        let pool = (slots as usize) * row;
        let run = |which: usize| -> Result<(HostTensor, HostTensor), String> {
            let mut kc = HostTensor::full(cache, &[pool], f64::NAN);
            let mut vc = HostTensor::full(cache, &[pool], f64::NAN);
            let io = KvAppendInputs {
                layout: &layout,
                key: &k,
                value: &v,
                slot_mapping: &mapping,
                key_cache: &mut kc,
                value_cache: &mut vc,
                scales: scales.as_ref(),
            };
            match which {
                0 => kv_append_reference(io),
                1 => once::kv_append(EmuDevice::new(Emulator::new()), io),
                _ => once::kv_append(a.device(), io),
            }
            .map_err(|e| format!("kv_append: {e}"))?;
            Ok((kc, vc))
        };
        let (kr, vr) = run(0)?;
        let (ke, ve) = run(1)?;
        let (kg, vg) = run(2)?;
        let what = format!("kv_append {dtype} into {cache}");
        for (g, e, w) in [(&kg, &ke, &kr), (&vg, &ve, &vr)] {
            if let Some(d) = first_difference(&what, g, e) {
                return Err(d);
            }
            if g.buf().as_bytes() != w.buf().as_bytes() {
                return Err(format!("{what}: differs from the reference"));
            }
        }
    }
    Ok(())
}

fn copy_blocks_all(a: &Arch) -> Outcome {
    // Blocks of 600 16-byte vectors (past the 4-way unrolled loop's 512 per pass of
    // 128 threads) and of 5 (the tail only), three pools, shuffled disjoint pairs.
    for (seed, vecs) in [(70u64, 600u64), (71, 5)] {
        let mut r = rng(seed);
        let block_bytes = 16 * vecs;
        let blocks = 9u32;
        let pools: Vec<AlignedBuf> = (0..3)
            .map(|_| {
                let bytes: Vec<u8> = (0..blocks as u64 * block_bytes)
                    .map(|_| r.random())
                    .collect();
                AlignedBuf::from_slice(&bytes)
            })
            .collect();
        let mut ids: Vec<u32> = (0..blocks).collect();
        ids.shuffle(&mut r);
        let pairs = vec![(ids[0], ids[5]), (ids[1], ids[6]), (ids[0], ids[7])];
        let run = |on_ptx: bool| -> Result<Vec<AlignedBuf>, String> {
            let mut pools = pools.clone();
            let r = if on_ptx {
                once::copy_blocks_in_host(&mut a.device(), &mut pools, block_bytes, &pairs)
            } else {
                let mut dev = EmuDevice::new(Emulator::new());
                once::copy_blocks_in_host(&mut dev, &mut pools, block_bytes, &pairs)
            };
            r.map_err(|e| format!("copy_blocks: {e}"))?;
            Ok(pools)
        };
        let (emu, got) = (run(false)?, run(true)?);
        for (p, (g, e)) in got.iter().zip(&emu).enumerate() {
            if g.as_bytes() != e.as_bytes() {
                return Err(format!("copy_blocks pool {p}, {vecs} vectors: differs"));
            }
        }
        // And the copies happened.
        let b = block_bytes as usize;
        let (s, d) = (pairs[0].0 as usize, pairs[0].1 as usize);
        assert_eq!(
            got[2].as_bytes()[d * b..(d + 1) * b],
            pools[2].as_bytes()[s * b..(s + 1) * b]
        );
    }
    Ok(())
}

/// Runs every family on module `arch`, then checks every entry point was launched.
fn every_entry_point(arch: usize) {
    // Its own module: what it launches and covers is only what this test ran.
    let a = &Arch::committed(arch, true);
    for family in [
        copy_blocks_all,
        kv_append_all,
        decode_all,
        prefill_all,
        merge_all,
        cascade_all,
        tree_all,
    ] {
        if let Err(e) = family(a) {
            panic!("{}: {e}", a.module.target());
        }
    }
    let launched: BTreeSet<&str> = a
        .logs
        .as_ref()
        .unwrap()
        .lock()
        .unwrap()
        .iter()
        .flat_map(|l| l.take())
        .map(|r| r.kernel)
        .collect();
    let all: BTreeSet<&str> = a.module.entry_points().into_iter().collect();
    let missing: Vec<_> = all.difference(&launched).collect();
    assert!(
        missing.is_empty(),
        "{}: entry points no interpreter test launches: {missing:?}",
        a.module.target()
    );
    // The basic-block coverage: every block of every loop of every kernel runs (panic
    // paths aside: blocks that trap, call a panic function, or lead only to one).
    let mut unrun = Vec::new();
    for c in a.module.coverage() {
        eprintln!(
            "{} {}: {} of {} blocks ran (not run: {} panic paths and branches around \
             loops{})",
            a.module.target(),
            c.kernel,
            c.blocks - c.missed.len(),
            c.blocks,
            c.missed.len() - c.missed_in_loops.len(),
            if c.missed_in_loops.is_empty() {
                String::new()
            } else {
                format!(", loop blocks at PTX lines {:?}", c.missed_in_loops)
            }
        );
        if !c.missed_in_loops.is_empty() {
            unrun.push((c.kernel, c.missed_in_loops));
        }
    }
    assert!(
        unrun.is_empty(),
        "{}: loop blocks no test runs: {unrun:?}",
        a.module.target()
    );
}

#[test]
fn sm_80_every_entry_point_matches_the_emulator_and_the_reference() {
    every_entry_point(0);
}

#[test]
fn sm_90_every_entry_point_matches_the_emulator_and_the_reference() {
    every_entry_point(1);
}

/// `ptx` with the first line of entry `kernel`'s body that contains `needle` rewritten
/// by `f` (None if there is no such line).
fn mutate(ptx: &str, kernel: &str, needle: &str, f: impl Fn(&str) -> String) -> Option<String> {
    let start = ptx.find(&format!(".entry {kernel}("))?;
    let end = ptx[start + 1..]
        .find(".entry ")
        .map_or(ptx.len(), |e| start + 1 + e);
    let at = start + ptx[start..end].find(needle)?;
    let line_start = ptx[..at].rfind('\n').map_or(0, |i| i + 1);
    let line_end = at + ptx[at..].find('\n')?;
    let line = &ptx[line_start..line_end];
    let new = f(line);
    assert_ne!(new, line, "the mutation changes `{line}`");
    Some(format!("{}{}{}", &ptx[..line_start], new, &ptx[line_end..]))
}

/// The registers of the first `{...}` group of `line` at position `group`, swapped
/// pairwise at `i` and `j`.
fn swap_in_group(line: &str, group: usize, i: usize, j: usize) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut rest = line;
    let mut n = 0;
    while let Some(open) = rest.find('{') {
        let close = open + rest[open..].find('}').unwrap();
        parts.push(rest[..open + 1].to_string());
        let inner = &rest[open + 1..close];
        if n == group {
            let mut regs: Vec<&str> = inner.split(", ").collect();
            regs.swap(i, j);
            parts.push(regs.join(", "));
        } else {
            parts.push(inner.to_string());
        }
        rest = &rest[close..];
        n += 1;
    }
    parts.push(rest.to_string());
    parts.concat()
}

/// Each PTX mutation a GPU would run silently wrong (or hang on) fails a test here: an
/// `ld.param` offset, two registers of a vector load, two A registers of an `mma`, a
/// raised `wait_group`, a removed `bar.sync`, a `shfl` member mask. (The unmutated
/// module passes the same families in the tests above.)
#[test]
fn sm_90_mutants_each_fail() {
    let ptx = pagedkv::ptx::ALL[1].ptx;
    type Family = fn(&Arch) -> Outcome;
    let bump_offset = |l: &str| {
        let plus = l.rfind('+').unwrap();
        let close = l.rfind(']').unwrap();
        let off: u32 = l[plus + 1..close].parse().unwrap();
        format!("{}{}{}", &l[..plus + 1], off + 4, &l[close..])
    };
    let window_at = format!(
        "param_0+{}]",
        std::mem::offset_of!(DecodeParams<F16>, window)
    );
    let mutants: Vec<(&str, Option<String>, Family)> = vec![
        (
            "ld.param offset of `window` +4 (decode f16)",
            mutate(ptx, "paged_decode_attention_f16", &window_at, bump_offset),
            decode_all,
        ),
        (
            "two registers of ld.global.nc.v4 swapped (kv_append f16)",
            mutate(ptx, "kv_append_f16", "ld.global.nc.v4.u32", |l| {
                swap_in_group(l, 0, 0, 1)
            }),
            kv_append_all,
        ),
        (
            "two A registers of an mma swapped (prefill f16)",
            mutate(ptx, "paged_prefill_attention_f16", "mma.sync", |l| {
                swap_in_group(l, 1, 0, 1)
            }),
            prefill_all,
        ),
        (
            "cp.async.wait_group raised by one (decode f16)",
            mutate(
                ptx,
                "paged_decode_attention_f16",
                "cp.async.wait_group",
                |l| {
                    let n: u32 = l
                        .trim()
                        .trim_end_matches(';')
                        .rsplit(' ')
                        .next()
                        .unwrap()
                        .parse()
                        .unwrap();
                    l.replace(
                        &format!("wait_group {n};"),
                        &format!("wait_group {};", n + 1),
                    )
                },
            ),
            decode_all,
        ),
        (
            "a bar.sync removed (decode f16)",
            mutate(ptx, "paged_decode_attention_f16", "bar.sync", |_| {
                String::new()
            }),
            decode_all,
        ),
        (
            "a bar.sync removed (prefill f16)",
            mutate(ptx, "paged_prefill_attention_f16", "bar.sync", |_| {
                String::new()
            }),
            prefill_all,
        ),
        (
            "shfl member mask 0x0000ffff (decode f16)",
            mutate(ptx, "paged_decode_attention_f16", "shfl.sync", |l| {
                l.replace("0xffffffff", "0x0000ffff")
            }),
            decode_all,
        ),
    ];
    let mut survivors = Vec::new();
    for (name, text, family) in mutants {
        let text = text.unwrap_or_else(|| panic!("{name}: nothing to mutate"));
        let module = Module::parse("sm_90 (mutant)", &text).expect("a mutant still parses");
        match family(&Arch::new(module, false)) {
            Err(e) => eprintln!("{name}: fails as it should: {e}"),
            Ok(()) => survivors.push(name),
        }
    }
    assert!(
        survivors.is_empty(),
        "mutants no test catches: {survivors:?}"
    );
}

/// The bytes of each input a decode CTA needs, summed over the CTAs of `plan`: CTA
/// (sequence s, KV head h, chunk of `heads_per_block` query heads of h's group,
/// partition p) covers the tokens `[p * partition_tokens, ...)` of s inside its
/// context and window, and needs its query heads' q rows, s's context length, the
/// block-table entries of the blocks those tokens lie in, and their K and V rows of
/// head h. A partition past the context needs only the context length. So K/V are
/// read ⌈group ÷ heads per CTA⌉ times, everything else as often as CTAs need it.
fn ideal_decode_reads(c: &Case, plan: &SplitPlan) -> std::collections::BTreeMap<&'static str, u64> {
    let s = &c.shape;
    let (d, bs) = (s.head_dim as u64, s.block_size as u64);
    let (qsize, kvsize) = (c.q.dtype().size() as u64, c.kc.dtype().size() as u64);
    let group = s.group() as u64;
    let hpb = plan.heads_per_block as u64;
    let chunks = group.div_ceil(hpb);
    let mut m = std::collections::BTreeMap::new();
    let mut add = |k: &'static str, v: u64| *m.entry(k).or_insert(0) += v;
    for (seq, &len) in c.lens.iter().enumerate() {
        let len = len as u64;
        let first = match c.opts.window {
            Some(w) => len.saturating_sub(w as u64),
            None => 0,
        };
        let _ = seq;
        for _h in 0..s.num_kv_heads {
            for chunk in 0..chunks {
                let heads = hpb.min(group - chunk * hpb);
                for p in 0..plan.num_partitions as u64 {
                    add("context_lens", 4);
                    let start = (p * plan.partition_tokens as u64).max(first);
                    let end = ((p + 1) * plan.partition_tokens as u64).min(len);
                    if start >= end {
                        continue;
                    }
                    add("q", heads * d * qsize);
                    if c.opts.alibi_slopes.is_some() {
                        add("alibi_slopes", heads * 4);
                    }
                    add("block_tables", 4 * ((end - 1) / bs - start / bs + 1));
                    add("key_cache", (end - start) * d * kvsize);
                    add("value_cache", (end - start) * d * kvsize);
                }
            }
        }
    }
    m
}

/// Decode reads from memory exactly what its plan needs (distinct bytes per CTA, as
/// the interpreter counts them), unsplit and split, with and without a window.
#[test]
fn decode_reads_what_its_plan_needs() {
    let a = &ARCHS[1];
    for (window, seed) in [(None, 80u64), (Some(37), 81)] {
        let p = Params {
            sinks: false,
            dtype: DType::F16,
            head_dim: 128,
            block_size: 16,
            num_kv_heads: 2,
            group: 4,
            batch: 17,
            max_len: 150,
            window,
            softcap: None,
            alibi: false,
            partition: Some(64),
            narrow_heads: false,
            seed,
            full_length: false,
        };
        let c = build(&p);
        let max_len = *c.lens.iter().max().unwrap() as u32;
        let mut unsplit = plan_unsplit(&c.shape, p.dtype, max_len);
        unsplit.heads_per_block = 3; // chunks of 3 and 1 heads: K/V read twice
        let split = SplitPlan {
            partition_tokens: 64,
            num_partitions: max_len.div_ceil(64),
            ..unsplit
        };
        for pl in [unsplit, split] {
            let dev = a.device();
            let log = dev.log();
            decode_on(dev, &c, pl).unwrap();
            let launch = log.take().into_iter().next().unwrap();
            let mut got = launch.stats.unique_read.clone();
            got.retain(|_, v| *v > 0);
            assert_eq!(
                got,
                ideal_decode_reads(&c, &pl),
                "window {window:?}, {pl:?}"
            );
        }
    }
}

/// A sink 95 above every score: each key's weight, `exp2((s - 95) log2 e)`, is below
/// f32's smallest normal, which `ex2.approx.ftz` flushes to zero, so the f32 output is
/// exactly 0 and the log-sum-exp the sink's alone, in the interpreter and in the
/// emulator's exact math alike, bit for bit. (The emulator once kept the subnormal
/// weights: 4.2e-44 against the PTX's +0.)
#[test]
fn exact_math_flushes_subnormal_weights_as_the_ptx_does() {
    let p = Params {
        sinks: true,
        dtype: DType::F32,
        head_dim: 64,
        block_size: 16,
        num_kv_heads: 2,
        group: 2,
        batch: 3,
        max_len: 40,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed: 77,
        full_length: false,
    };
    let mut c = build(&p);
    c.sinks = Some(vec![95.0; c.shape.num_q_heads as usize]);
    let max_len = *c.lens.iter().max().unwrap() as u32;
    let emu = decode_on_lse(
        EmuDevice::new(Emulator::new()),
        &c,
        plan_unsplit(&c.shape, p.dtype, max_len),
    )
    .unwrap();
    assert!(
        emu.0.to_f64().iter().all(|&x| x == 0.0),
        "the emulator kept subnormal weights: {:?}",
        emu.0.to_f64().iter().find(|&&x| x != 0.0)
    );
    let sink_lse = 95.0 * std::f64::consts::LOG2_E;
    assert!(emu.1.to_f64().iter().all(|&l| (l - sink_lse).abs() < 1e-4));
    for a in ARCHS.iter() {
        let ptx = decode_on_lse(a.device(), &c, plan_unsplit(&c.shape, p.dtype, max_len)).unwrap();
        for (what, got, want) in [("out", &ptx.0, &emu.0), ("lse", &ptx.1, &emu.1)] {
            if let Some(d) = first_difference(what, got, want) {
                panic!("{}: {d}", a.module.target());
            }
        }
    }
}

/// With the approximate `ex2` / `tanh` model (the ISA's documented error bounds), the
/// committed PTX stays within the GPU tolerance of the f64 reference, decode and
/// prefill, with soft-cap (tanh) and without.
#[test]
fn approximate_math_stays_within_the_gpu_tolerance() {
    for (arch, a) in ARCHS.iter().enumerate() {
        for (softcap, dtype) in [(None, DType::F16), (Some(15.0), DType::Bf16)] {
            let p = Params {
                sinks: false,
                dtype,
                head_dim: 128,
                block_size: 16,
                num_kv_heads: 2,
                group: 4,
                batch: 5,
                max_len: 120,
                window: None,
                softcap,
                alibi: false,
                partition: None,
                narrow_heads: false,
                seed: 90 + arch as u64,
                full_length: false,
            };
            let tol = common::approx_tolerance(dtype, softcap);
            let dev = || PtxDevice::new(a.module.clone(), MathMode::Approx { seed: 5 });
            let c = build(&p);
            let want = paged_decode_attention(&c.inputs());
            let max_len = *c.lens.iter().max().unwrap() as u32;
            let got = decode_on(dev(), &c, plan_unsplit(&c.shape, dtype, max_len)).unwrap();
            let exact = decode_on(a.device(), &c, plan_unsplit(&c.shape, dtype, max_len)).unwrap();
            assert_ne!(
                got.buf().as_bytes(),
                exact.buf().as_bytes(),
                "the model perturbs"
            );
            let e = rel_l2(&got.to_f64(), &want);
            assert!(
                e <= tol,
                "{} decode {softcap:?}: {e:e} > {tol:e}",
                a.module.target()
            );
            let pc = prefill_case(&p);
            let want = paged_prefill_attention(&pc.inputs());
            let got = prefill_on(dev(), &pc).unwrap();
            let e = rel_l2(&got.to_f64(), &want);
            assert!(
                e <= tol,
                "{} prefill {softcap:?}: {e:e} > {tol:e}",
                a.module.target()
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(6), ..ProptestConfig::default() })]

    /// The decode, prefill and fp8 properties of `attention.rs`, `prefill.rs` and
    /// `fp8_cache.rs` (their strategies: every dtype and head_dim, GQA and MQA, batch
    /// 1/3/17, windows, soft-cap, ALiBi, narrower head chunks; prefill over a 16-bit
    /// and over an fp8 cache), on the interpreter over a module drawn at random: equal
    /// to the emulator bit for bit, and within the tolerance of the f64 reference; the
    /// prefills also in approximate math.
    #[test]
    fn random_cases_match_the_emulator_on_the_committed_ptx(
        p in crate::attention::params(),
        (p8, cache, per_head) in crate::fp8_cache::params(),
        pp in crate::prefill::params(),
        arch in 0usize..2,
    ) {
        let a = &ARCHS[arch];
        for (p, cache) in [(p, None), (p8.clone(), Some((cache, per_head)))] {
            let mut c = build(&p);
            if let Some((cache, per_head)) = cache {
                quantise_case(&mut c, cache, per_head);
            }
            let want = paged_decode_attention(&c.inputs());
            let max_len = *c.lens.iter().max().unwrap() as u32;
            let mut pl = plan_unsplit(&c.shape, p.dtype, max_len);
            if p.narrow_heads {
                pl.heads_per_block = 1.max(pl.heads_per_block / 2);
            }
            if let Some(part) = p.partition {
                pl.partition_tokens = part;
                pl.num_partitions = max_len.div_ceil(part);
            }
            let what = format!("{} decode {p:?} cache {cache:?} {pl:?}", a.module.target());
            let emu = decode_on(EmuDevice::new(Emulator::new()), &c, pl).unwrap();
            let got = decode_on(a.device(), &c, pl).unwrap();
            let tol = if pl.num_partitions > 1 { common::split_tolerance(p.dtype).max(tolerance(p.dtype)) } else { tolerance(p.dtype) };
            if let Err(e) = check(&what, &got, &emu, &want, tol) {
                prop_assert!(false, "{}", e);
            }
        }
        let prefills = [
            (format!("prefill {pp:?}"), prefill_case(&pp)),
            (
                format!("prefill over {cache} (per head {per_head}) {p8:?}"),
                fp8_prefill_case(&p8, cache, per_head),
            ),
        ];
        for (what, pc) in prefills {
            if let Err(e) = prefill_holds_on_ptx(a, &what, &pc, pp.seed) {
                prop_assert!(false, "{}", e);
            }
        }
    }
}

/// The prefill chunks after prefixes ending mid-block (`chunk_cases`: 1, 7, 64 and 300
/// tokens, every dtype, windows, soft-cap, ALiBi; multi-tile CTAs partial at both ends)
/// on both committed modules, exact and approximate math, bit for bit with the
/// emulator in exact math.
#[test]
fn prefill_chunks_hold_on_the_committed_ptx() {
    for a in ARCHS.iter() {
        for (what, pc) in chunk_cases() {
            prefill_holds_on_ptx(a, &what, &pc, 3).unwrap();
        }
    }
}

/// The tensor-core prefill's reads, by its tiling: CTA (KV head h, tile of `R` rows,
/// sequence s) serves rows `R * tile ..` of s's `(token, head of h's group)` rows,
/// token-major, and stages the positions `[lo, hi)` its rows see (`lo`: the first
/// row's first visible position, window included; `hi`: the last row's position + 1).
/// So per CTA it needs `(hi - lo) * head_dim` elements of K and of V (distinct bytes)
/// and q for its rows. The one-warp kernel (`R` = 16) loads V once but K once per pass
/// of 64 output columns (`S` is recomputed each pass); the multi-warp kernel (`R` = 64,
/// head_dim 64 / 128 at block 16) loads each once (`S` once over the whole head_dim).
fn ideal_prefill_reads(pc: &Prefill) -> [(&'static str, u64, u64); 3] {
    let c = &pc.c;
    let s = &c.shape;
    let (d, group) = (s.head_dim as u64, s.group() as u64);
    let (qsize, kvsize) = (pc.q.dtype().size() as u64, c.kc.dtype().size() as u64);
    let tiled = matches!(
        PrefillKernel::choose(s, pc.q.dtype(), c.kc.dtype(), u32::MAX),
        PrefillKernel::MultiWarp { .. }
    );
    let (tile_rows, passes) = if tiled { (64, 1) } else { (16, d.div_ceil(64)) };
    let (mut k, mut k_all, mut q) = (0u64, 0u64, 0u64);
    for seq in 0..s.num_seqs as usize {
        let qo = (pc.qo_indptr[seq + 1] - pc.qo_indptr[seq]) as u64;
        let len = c.lens[seq] as u64;
        let rows = qo * group;
        let pos = |row: u64| len - qo + row / group;
        for tile in 0..rows.div_ceil(tile_rows) {
            let (r0, last) = (
                tile_rows * tile,
                (tile_rows * tile + tile_rows - 1).min(rows - 1),
            );
            let lo = match c.opts.window {
                Some(w) => (pos(r0) + 1).saturating_sub(w as u64),
                None => 0,
            };
            let hi = pos(last) + 1;
            let per = (hi - lo) * d * kvsize * s.num_kv_heads as u64;
            k += per;
            k_all += passes * per;
            q += (last - r0 + 1) * d * qsize * s.num_kv_heads as u64;
        }
    }
    [("key_cache", k, k_all), ("value_cache", k, k), ("q", q, q)]
}

/// Prefill reads K, V and q exactly as its tiling says (see `ideal_prefill_reads`),
/// f16 and bf16, with and without a window: the multi-warp kernel at head_dim 64 and
/// 128 (K once), the one-warp kernel at 256 (K once per pass) and at 128 with block 8.
#[test]
fn prefill_reads_what_its_tiling_says() {
    let a = &ARCHS[1];
    for (dtype, head_dim, block_size, window, seed) in [
        (DType::F16, 128, 16, None, 85u64),
        (DType::Bf16, 64, 16, Some(19), 86),
        (DType::F16, 256, 16, Some(40), 87),
        (DType::Bf16, 128, 8, Some(30), 88),
    ] {
        let p = Params {
            sinks: false,
            dtype,
            head_dim,
            block_size,
            num_kv_heads: 2,
            group: 3,
            batch: 3,
            max_len: 70,
            window,
            softcap: None,
            alibi: false,
            partition: None,
            narrow_heads: false,
            seed,
            full_length: false,
        };
        let pc = prefill_case(&p);
        let dev = a.device();
        let log = dev.log();
        prefill_on(dev, &pc).unwrap();
        let stats = log.take().into_iter().next().unwrap().stats;
        for (range, unique, all) in ideal_prefill_reads(&pc) {
            let got = (
                stats.unique_read.get(range).copied(),
                stats.read.get(range).copied(),
            );
            assert_eq!(
                got,
                (Some(unique), Some(all)),
                "{dtype} d{head_dim} window {window:?}: {range} (distinct, all)"
            );
        }
    }
}

/// The traffic cascade attention saves, counted by the interpreter on the committed
/// sm_90 PTX: 64 decode rows sharing a 2048-token prompt (f16, head_dim 64, one KV
/// head, block size 16). Flat decode reads the prompt's K and V once per row (64
/// times); the cascade's shared pass reads them once per CTA tile of query rows
/// (`ceil(64 rows / TILE_ROWS)` = 1 time), its suffix pass only each row's own
/// tokens, and the output equals flat attention's.
#[test]
fn cascade_reads_a_shared_prefix_once_per_tile() {
    use pagedkv::kernels::kernels::prefill::TILE_ROWS;
    let a = &ARCHS[1];
    let p = Params {
        dtype: DType::F16,
        head_dim: 64,
        block_size: 16,
        num_kv_heads: 1,
        group: 1,
        batch: 64,
        max_len: 40,
        window: None,
        softcap: None,
        alibi: false,
        sinks: false,
        partition: None,
        narrow_heads: false,
        seed: 64,
        full_length: false,
    };
    let prompt = 2048u32;
    let c = common::case::build_family(&p, prompt);
    let row_bytes = (p.head_dim * 2) as u64; // one token's K (or V) of the KV head
    let suffixes: u64 = c.lens.iter().map(|&l| l as u64 - prompt as u64).sum();
    let reads = |log: &pagedkv_ptx_interp::LaunchLog| -> (u64, u64) {
        let mut k = 0;
        let mut v = 0;
        for l in log.take() {
            k += l.stats.unique_read.get("key_cache").copied().unwrap_or(0);
            v += l.stats.unique_read.get("value_cache").copied().unwrap_or(0);
            eprintln!(
                "{}: key_cache {:?}",
                l.kernel,
                l.stats.unique_read.get("key_cache")
            );
        }
        (k, v)
    };
    // Flat: every row reads the whole prompt and its suffix.
    let dev = a.device();
    let log = dev.log();
    let max_len = *c.lens.iter().max().unwrap() as u32;
    let flat = decode_on(dev, &c, plan_unsplit(&c.shape, p.dtype, max_len)).unwrap();
    let (fk, fv) = reads(&log);
    assert_eq!(
        (fk, fv),
        (
            (64 * prompt as u64 + suffixes) * row_bytes,
            (64 * prompt as u64 + suffixes) * row_bytes
        )
    );
    // Cascade: the prompt once per tile of query rows, each suffix once.
    let dev = a.device();
    let log = dev.log();
    let got = crate::cascade::cascade_on(dev, &c, None, 1).unwrap();
    assert_eq!(got.groups.len(), 1);
    assert_eq!(got.groups[0].shared_blocks, prompt / 16);
    let tiles = 64u64.div_ceil(TILE_ROWS as u64);
    let (ck, cv) = reads(&log);
    let want = (tiles * prompt as u64 + suffixes) * row_bytes;
    assert_eq!((ck, cv), (want, want));
    eprintln!(
        "K/V bytes read per layer: flat {} KiB, cascade {} KiB (prompt read {tiles} time(s) instead of 64)",
        (fk + fv) / 1024,
        (ck + cv) / 1024
    );
    let e = rel_l2(&got.out.to_f64(), &flat.to_f64());
    assert!(e <= 2.0 * tolerance(DType::F16), "cascade vs flat: {e:e}");
}
