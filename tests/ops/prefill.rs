//! The prefill kernels (tensor cores for f16/bf16, CUDA cores for f32) in the emulator
//! against the f64 reference: ragged batches over a shuffled pool with shared blocks,
//! NaN in every unused cache slot and in the output, garbage table entries for the
//! blocks before a window, every head_dim, GQA groups up to 16, chunks that start
//! mid-block, and a chunk of one token against the decode kernel.

use crate::common;

use common::case::{Params, build};
use common::{approx_tolerance, cases, lse_error, lse_tolerance, rel_l2, rng, tolerance, uniform};
use pagedkv::host::emulator::{Emulator, MathMode};
use pagedkv::host::ops::SUPPORTED_HEAD_DIMS;
use pagedkv::host::ops::attention::{
    AttentionOptions, AttentionOut, DecodeInputs, DecodeShape, decode_emulated,
};
use pagedkv::host::ops::prefill::{PrefillInputs, prefill_emulated, tree_mask};
use pagedkv::host::reference::{paged_prefill_attention, paged_prefill_lse};
use pagedkv::host::step::{EmuDevice, StepDevice, once};
use pagedkv::host::{DType, Error, HostTensor};
use proptest::prelude::*;
use rand::Rng;

pub(crate) fn params() -> impl Strategy<Value = Params> {
    (
        prop::sample::select(DType::ALL.to_vec()),
        prop::sample::select(SUPPORTED_HEAD_DIMS.to_vec()),
        prop::sample::select(vec![8u32, 16, 32]),
        1u32..=2,
        prop_oneof![3 => 1u32..=4, 1 => Just(8u32), 1 => Just(16u32)],
        prop::sample::select(vec![1u32, 3, 17]),
        (1u32..=90, prop::option::weighted(0.3, 1u32..=40)),
        (
            prop::option::weighted(0.3, 2.0f32..30.0),
            prop::bool::weighted(0.3),
            prop::bool::weighted(0.3),
            any::<u64>(),
        ),
    )
        .prop_map(
            |(dtype, head_dim, block_size, kvh, group, batch, (max_len, window), rest)| {
                let (softcap, alibi, sinks, seed) = rest;
                Params {
                    sinks,
                    dtype,
                    head_dim,
                    block_size,
                    num_kv_heads: if group > 4 { 1 } else { kvh },
                    group,
                    batch,
                    max_len: if batch == 17 {
                        max_len.min(40)
                    } else {
                        max_len
                    },
                    window,
                    softcap,
                    alibi,
                    partition: None,
                    narrow_heads: false,
                    seed,
                    full_length: false,
                }
            },
        )
}

/// A prefill case: the decode case's cache, tables and options, each sequence's last
/// `qo_lens[s]` tokens new, and the blocks wholly before its first new token's window
/// poisoned in the table (freed by the scheduler).
pub(crate) struct Prefill {
    pub(crate) c: common::case::Case,
    pub(crate) qo_indptr: Vec<i32>,
    pub(crate) q: HostTensor,
    /// Each new token's tree mask (`tree_case`), or none.
    pub(crate) tree: Option<Vec<u64>>,
}

pub(crate) fn prefill_case(p: &Params) -> Prefill {
    let mut c = build(&Params {
        window: None,
        ..p.clone()
    });
    c.opts.window = p.window;
    let mut r = rng(p.seed ^ 0x5eed);
    let mut qo_indptr = vec![0i32];
    let w = c.shape.max_blocks_per_seq as usize;
    for s in 0..p.batch as usize {
        let len = c.lens[s];
        // Whole prompts, single tokens (decode's question) and chunks in between.
        let qo = match r.random_range(0..3) {
            0 => len,
            1 => 1,
            _ => r.random_range(1..=len),
        };
        qo_indptr.push(qo_indptr[s] + qo);
        if let Some(win) = p.window {
            let first = (len - qo + 1) as u32;
            if first > win {
                for lb in 0..(first - win) / p.block_size {
                    c.tables[s * w + lb as usize] = -3;
                }
            }
        }
    }
    let total = *qo_indptr.last().unwrap() as usize;
    let qh = c.shape.num_q_heads as usize;
    let d = p.head_dim as usize;
    let q =
        HostTensor::from_f64(p.dtype, &[total, qh, d], &uniform(&mut r, total * qh * d)).unwrap();
    Prefill {
        c,
        qo_indptr,
        q,
        tree: None,
    }
}

/// A tree-verification case: `prefill_case` without a window or ALiBi (a tree takes
/// neither), each sequence of at most 64 new tokens a random tree of drafts (node
/// `i`'s parent drawn from `0..i`; a chain, a star or a forest, whose nodes after the
/// first may be roots too, now and then) with probability 3/4, the rest causal;
/// returns the case and each sequence's parents.
pub(crate) fn tree_case(p: &Params) -> (Prefill, Vec<Option<Vec<i32>>>) {
    let mut pc = prefill_case(&Params {
        window: None,
        alibi: false,
        ..p.clone()
    });
    let mut r = rng(p.seed ^ 0x7ee);
    let parents: Vec<Option<Vec<i32>>> = (0..p.batch as usize)
        .map(|s| {
            let n = (pc.qo_indptr[s + 1] - pc.qo_indptr[s]) as usize;
            (n <= 64 && r.random_range(0..4) != 0).then(|| {
                let shape = r.random_range(0..5);
                (0..n as i32)
                    .map(|i| match (i, shape) {
                        (0, _) => -1,
                        (_, 0) => i - 1,
                        (_, 1) => 0,
                        (_, 4) => r.random_range(-1..i),
                        _ => r.random_range(0..i),
                    })
                    .collect()
            })
        })
        .collect();
    let refs: Vec<Option<&[i32]>> = parents.iter().map(|p| p.as_deref()).collect();
    pc.tree = Some(tree_mask(&pc.qo_indptr, &refs).unwrap());
    (pc, parents)
}

impl Prefill {
    pub(crate) fn inputs(&self) -> PrefillInputs<'_, HostTensor> {
        PrefillInputs {
            tree_mask: self.tree.as_deref(),
            shape: &self.c.shape,
            opts: &self.c.opts,
            q: &self.q,
            key_cache: &self.c.kc,
            value_cache: &self.c.vc,
            block_tables: &self.c.tables,
            qo_indptr: &self.qo_indptr,
            context_lens: &self.c.lens,
            kv_scales: self.c.scales.as_ref(),
            sinks: self.c.sinks.as_deref(),
        }
    }
}

/// `pc` on `dev` through the one-shot step path (the launch engines run), the output
/// poisoned with NaN first.
pub(crate) fn prefill_on<D: StepDevice>(dev: D, pc: &Prefill) -> Result<HostTensor, String> {
    let mut out = HostTensor::full(pc.q.dtype(), pc.q.shape(), f64::NAN);
    once::prefill(dev, pc.inputs(), &mut out).map_err(|e| format!("prefill: {e}"))?;
    Ok(out)
}

/// [`prefill_on`], writing each output's log-sum-exp too (poisoned with NaN first):
/// `(out, lse)`.
pub(crate) fn prefill_on_lse<D: StepDevice>(
    dev: D,
    pc: &Prefill,
) -> Result<(HostTensor, HostTensor), String> {
    let mut out = HostTensor::full(pc.q.dtype(), pc.q.shape(), f64::NAN);
    let rows = *pc.qo_indptr.last().unwrap() as usize;
    let heads = pc.c.shape.num_q_heads as usize;
    let mut lse = HostTensor::full(DType::F32, &[rows, heads], f64::NAN);
    let to = AttentionOut {
        out: &mut out,
        lse: Some(&mut lse),
    };
    once::prefill(dev, pc.inputs(), to).map_err(|e| format!("prefill: {e}"))?;
    Ok((out, lse))
}

/// The prefill proof, one body for every device (the emulator, the PTX interpreter on
/// either module): `pc` on `exact` (exact math, writing the log-sum-exp too) within
/// [`tolerance`] of the f64 reference and its log-sum-exp within [`lse_tolerance`],
/// and on `approx` (the GPU's `ex2.approx` / `tanh.approx` model, no log-sum-exp:
/// the launch without one) within [`approx_tolerance`]. Returns the exact output and
/// log-sum-exp.
pub(crate) fn prefill_holds<D: StepDevice>(
    what: &str,
    pc: &Prefill,
    exact: D,
    approx: D,
) -> Result<(HostTensor, HostTensor), String> {
    let want = paged_prefill_attention(&pc.inputs());
    let dtype = pc.q.dtype();
    let (got, lse) = prefill_on_lse(exact, pc)?;
    let e = rel_l2(&got.to_f64(), &want);
    if e > tolerance(dtype) {
        return Err(format!(
            "{what}, exact math: rel L2 {e:e} > {:e}",
            tolerance(dtype)
        ));
    }
    let (e, tol) = (
        lse_error(&lse.to_f64(), &paged_prefill_lse(&pc.inputs())),
        lse_tolerance(pc.c.opts.softcap, false),
    );
    if e.is_nan() || e > tol {
        return Err(format!(
            "{what}, exact math: log-sum-exp off by {e:e} > {tol:e}"
        ));
    }
    let tol = approx_tolerance(dtype, pc.c.opts.softcap);
    let e = rel_l2(&prefill_on(approx, pc)?.to_f64(), &want);
    if e > tol {
        return Err(format!("{what}, approximate math: rel L2 {e:e} > {tol:e}"));
    }
    Ok((got, lse))
}

/// [`prefill_holds`] on the emulator (approximate math seeded with `seed`).
pub(crate) fn prefill_holds_emulated(
    what: &str,
    pc: &Prefill,
    seed: u64,
) -> Result<Vec<f64>, String> {
    let emu = |math| EmuDevice::new(Emulator::new().with_math(math));
    prefill_holds(
        what,
        pc,
        emu(MathMode::Exact),
        emu(MathMode::Approx { seed }),
    )
    .map(|(t, _)| t.to_f64())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    #[test]
    fn prefill_matches_the_f64_reference(p in params()) {
        let pc = prefill_case(&p);
        let got = prefill_holds_emulated("prefill", &pc, p.seed);
        prop_assert!(got.is_ok(), "{}", got.unwrap_err());
        let got = got.unwrap();

        // A chunk of one token asks decode's question: the decode kernel agrees (both
        // with exact math).
        let (qh, d) = (pc.c.shape.num_q_heads as usize, p.head_dim as usize);
        let w = pc.c.shape.max_blocks_per_seq as usize;
        for s in 0..p.batch as usize {
            if pc.qo_indptr[s + 1] - pc.qo_indptr[s] != 1 {
                continue;
            }
            let row = pc.qo_indptr[s] as usize;
            let one = DecodeShape { num_seqs: 1, ..pc.c.shape };
            let qv: Vec<f64> = (0..qh * d).map(|e| pc.q.get(row * qh * d + e)).collect();
            let q1 = HostTensor::from_f64(p.dtype, &[1, qh, d], &qv).unwrap();
            let mut out = HostTensor::full(p.dtype, &[1, qh, d], f64::NAN);
            let inputs = DecodeInputs {
                shape: &one,
                opts: &pc.c.opts,
                q: &q1,
                key_cache: &pc.c.kc,
                value_cache: &pc.c.vc,
                block_tables: &pc.c.tables[s * w..(s + 1) * w],
                context_lens: &pc.c.lens[s..s + 1],
                plan: None,
                kv_scales: None,
                sinks: pc.c.sinks.as_deref(),
            };
            decode_emulated(&Emulator::new(), inputs, &mut out).unwrap();
            let e = rel_l2(&got[row * qh * d..(row + 1) * qh * d], &out.to_f64());
            prop_assert!(e <= tolerance(p.dtype), "chunk of one vs decode, seq {}: {:e}", s, e);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    /// Verify rows whose drafts form random trees (mixed with causal prefills and
    /// chunks in one batch), in every dtype, both math modes, against the f64
    /// reference; and the same batch with every tree replaced by a chain equals the
    /// causal prefill (within the dtype's tolerance: the kernels may take the masked
    /// path where the causal one is plain).
    #[test]
    fn tree_masks_match_the_f64_reference(p in params()) {
        let (mut pc, parents) = tree_case(&p);
        let got = prefill_holds_emulated("tree prefill", &pc, p.seed);
        prop_assert!(got.is_ok(), "{}", got.unwrap_err());
        let chains: Vec<Option<Vec<i32>>> = parents
            .iter()
            .map(|t| t.as_ref().map(|t| (0..t.len() as i32).map(|i| i - 1).collect()))
            .collect();
        let refs: Vec<Option<&[i32]>> = chains.iter().map(|p| p.as_deref()).collect();
        pc.tree = Some(tree_mask(&pc.qo_indptr, &refs).unwrap());
        let chain = prefill_on(EmuDevice::new(Emulator::new()), &pc).unwrap().to_f64();
        pc.tree = None;
        let causal = prefill_on(EmuDevice::new(Emulator::new()), &pc).unwrap().to_f64();
        let e = rel_l2(&chain, &causal);
        prop_assert!(e <= tolerance(p.dtype), "a chain of drafts vs causal: {:e}", e);
    }
}

/// One verify row of 3 new tokens after 17 cached ones (f32, head_dim 64, block 16)
/// with the tree of `parents`, every query 1, and node `huge`'s key 50 along the
/// query with value 7 (a key that takes all the softmax of whoever sees it): the
/// outputs, checked against the f64 reference, one row of 64 per node.
fn outputs_with_one_dominant_node(parents: &[i32], huge: usize, seed: u64) -> Vec<f64> {
    let p = Params {
        sinks: false,
        dtype: DType::F32,
        head_dim: 64,
        block_size: 16,
        num_kv_heads: 1,
        group: 1,
        batch: 1,
        max_len: 20,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed,
        full_length: true,
    };
    let mut pc = prefill_case(&p);
    let n = pc.c.lens[0] as usize;
    pc.qo_indptr = vec![0, 3];
    pc.tree = Some(tree_mask(&pc.qo_indptr, &[Some(parents)]).unwrap());
    let d = 64;
    pc.q = HostTensor::from_f64(DType::F32, &[3, 1, d], &vec![1.0; 3 * d]).unwrap();
    let bs = 16;
    let pos = n - 3 + huge;
    let block = pc.c.tables[pos / bs] as usize;
    let at = (block * bs + pos % bs) * d;
    for e in 0..d {
        pc.c.kc.set(at + e, 50.0);
        pc.c.vc.set(at + e, 7.0);
    }
    let out = prefill_on(EmuDevice::new(Emulator::new()), &pc)
        .unwrap()
        .to_f64();
    let want = paged_prefill_attention(&pc.inputs());
    assert!(rel_l2(&out, &want) < 1e-5);
    out
}

/// A tree hides what it should: a node whose only ancestor is the root never sees
/// its sibling's key, even one that would take all of its softmax.
#[test]
fn a_tree_node_never_attends_to_a_sibling() {
    // The root, then two children of the root: node 2 must not see node 1.
    let out = outputs_with_one_dominant_node(&[-1, 0, 0], 1, 5);
    // Node 1 is dominated by its own key; node 2 never saw it.
    assert!((out[64] - 7.0).abs() < 1e-3, "node 1: {}", out[64]);
    assert!(
        (out[2 * 64] - 7.0).abs() > 0.1,
        "node 2 attended to its sibling"
    );
}

/// A forest (several roots with parent -1, as EAGLE's first-level drafts whose parent
/// is the cached context): a second root and its child never see the first root's
/// key, even one that would take all of their softmax; the first root does. (Such
/// parent arrays were once refused.)
#[test]
fn a_forest_of_drafts_hides_the_other_roots() {
    let forest = [-1, -1, 1];
    let mask = tree_mask(&[0, 3], &[Some(&forest)]).unwrap();
    assert_eq!(mask, [0b1, 0b1, 0b11]);
    let out = outputs_with_one_dominant_node(&forest, 0, 6);
    assert!((out[0] - 7.0).abs() < 1e-3, "node 0: {}", out[0]);
    for node in [1, 2] {
        assert!(
            (out[node * 64] - 7.0).abs() > 0.1,
            "node {node} attended to the first root"
        );
    }
}

#[test]
fn bad_prefill_inputs_are_errors_naming_the_argument() {
    let p = Params {
        sinks: false,
        dtype: DType::F16,
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
        seed: 7,
        full_length: true,
    };
    let pc = prefill_case(&p);
    let names = |e: Error, want: &str| match e {
        Error::InvalidArgument { arg, .. } => assert_eq!(arg, want),
        e => panic!("{want}: {e:?}"),
    };
    let mut out = HostTensor::full(DType::F16, pc.q.shape(), -1.0);
    let emu = Emulator::new();
    // qo_indptr that decreases, is short, or claims more new tokens than the context.
    let mut bad = pc.qo_indptr.clone();
    bad.swap(1, 2);
    let e = prefill_emulated(
        &emu,
        PrefillInputs {
            qo_indptr: &bad,
            ..pc.inputs()
        },
        &mut out,
    );
    assert!(e.is_err());
    let e = prefill_emulated(
        &emu,
        PrefillInputs {
            qo_indptr: &bad[..2],
            ..pc.inputs()
        },
        &mut out,
    );
    names(e.unwrap_err(), "qo_indptr");
    let lens = [1, 1, 1];
    let e = prefill_emulated(
        &emu,
        PrefillInputs {
            context_lens: &lens,
            ..pc.inputs()
        },
        &mut out,
    );
    names(e.unwrap_err(), "context_lens");
    // A block id outside the pool, where the sequence reads.
    let mut tables = pc.c.tables.clone();
    tables[0] = 1 << 20;
    let e = prefill_emulated(
        &emu,
        PrefillInputs {
            block_tables: &tables,
            ..pc.inputs()
        },
        &mut out,
    );
    names(e.unwrap_err(), "block_tables");
    // A tree mask of the wrong length, or with a window or ALiBi.
    let n = *pc.qo_indptr.last().unwrap() as usize;
    let short = vec![u64::MAX; n - 1];
    let e = prefill_emulated(
        &emu,
        PrefillInputs {
            tree_mask: Some(&short),
            ..pc.inputs()
        },
        &mut out,
    );
    names(e.unwrap_err(), "tree_mask");
    let full = vec![u64::MAX; n];
    for opts in [
        AttentionOptions {
            window: Some(8),
            ..pc.c.opts.clone()
        },
        AttentionOptions {
            alibi_slopes: Some(vec![0.5; pc.c.shape.num_q_heads as usize]),
            ..pc.c.opts.clone()
        },
    ] {
        let e = prefill_emulated(
            &emu,
            PrefillInputs {
                opts: &opts,
                tree_mask: Some(&full),
                ..pc.inputs()
            },
            &mut out,
        );
        names(e.unwrap_err(), "tree_mask");
    }
    // The output untouched by every rejected call.
    assert!(out.to_f64().iter().all(|&x| x == -1.0));
    // Parent arrays that are not trees, or do not fit the rows.
    for (indptr, parents) in [
        (vec![0, 3], vec![Some(&[0, 0, 0][..])]),
        (vec![0, 3], vec![Some(&[-1, 2, 0][..])]),
        (vec![0, 3], vec![Some(&[-1, 0][..])]),
        (vec![0, 66], vec![Some(&[-1; 66][..])]),
        (vec![0, 3, 1], vec![None, None]),
    ] {
        assert!(
            tree_mask(&indptr, &parents).is_err(),
            "{indptr:?} {parents:?}"
        );
    }
}

/// Chunks of 1, 7, 64 and 300 new tokens after prefixes that end mid-block (339, 333,
/// 276 and 40 cached tokens, block 16), every dtype, GQA 4 over 2 KV heads, with and
/// without a window that crosses the longest chunk's start (the blocks before each
/// chunk's first window poisoned), with soft-cap and ALiBi and with neither (the
/// multi-warp kernel's plain stages: no per-score masks where a stage lies inside every
/// row's range). f16 at head_dim 128 and bf16 at 64 take the multi-warp kernel (the
/// 300-token chunk spans ten 64-row tiles, partial at both ends: it starts mid-block
/// and ends mid-tile), f32 the CUDA-core one.
pub(crate) fn chunk_cases() -> Vec<(String, Prefill)> {
    let mut cases = Vec::new();
    for (dtype, head_dim) in [(DType::F16, 128), (DType::Bf16, 64), (DType::F32, 32)] {
        for (window, terms) in [
            (None, true),
            (Some(100), true),
            (None, false),
            (Some(100), false),
        ] {
            let p = Params {
                sinks: terms,
                dtype,
                head_dim,
                block_size: 16,
                num_kv_heads: 2,
                group: 2,
                batch: 4,
                max_len: 340,
                window,
                softcap: terms.then_some(20.0),
                alibi: terms,
                partition: None,
                narrow_heads: false,
                seed: 11,
                full_length: true,
            };
            // Built without a window (nothing poisoned for its own random chunks), then
            // given the window and these chunks.
            let mut pc = prefill_case(&Params {
                window: None,
                ..p.clone()
            });
            pc.c.opts.window = window;
            pc.qo_indptr = vec![0, 1, 8, 72, 372];
            let total = 372;
            let (qh, d) = (pc.c.shape.num_q_heads as usize, head_dim as usize);
            let mut r = rng(5);
            pc.q = HostTensor::from_f64(dtype, &[total, qh, d], &uniform(&mut r, total * qh * d))
                .unwrap();
            // The blocks wholly before each first new token's window: freed.
            let w = pc.c.shape.max_blocks_per_seq as usize;
            if let Some(win) = window {
                for s in 0..4 {
                    let qo = (pc.qo_indptr[s + 1] - pc.qo_indptr[s]) as u32;
                    let first = 340 - qo + 1;
                    for lb in 0..first.saturating_sub(win) / 16 {
                        pc.c.tables[s * w + lb as usize] = -3;
                    }
                }
            }
            let terms = if terms { "soft-cap, ALiBi" } else { "plain" };
            cases.push((format!("{dtype} d{head_dim} window {window:?} {terms}"), pc));
        }
    }
    cases
}

/// [`chunk_cases`] in both math modes on the emulator (`tests/ops/interp.rs` runs them
/// on the committed PTX).
#[test]
fn chunks_of_1_7_64_and_300_tokens_after_prefixes_that_end_mid_block() {
    for (what, pc) in chunk_cases() {
        prefill_holds_emulated(&what, &pc, 3).unwrap();
    }
}

/// The multi-warp kernel serves 16-bit queries at head_dim 64 / 128, block 16, only
/// where its stages fit the device's shared memory: at head_dim 128 over a 16-bit cache
/// they need 96 KiB (unpadded, swizzled rows), within sm_86 / sm_89's 99 KiB; a device
/// allowing 64 KiB gets the one-warp kernel there (an fp8 cache's stages, half the
/// bytes, and head_dim 64's still fit).
#[test]
fn prefill_takes_the_multi_warp_kernel_only_where_it_fits() {
    use pagedkv::host::ops::prefill::PrefillKernel;
    let shape = |head_dim, block_size| DecodeShape {
        num_seqs: 1,
        num_q_heads: 8,
        num_kv_heads: 2,
        head_dim,
        block_size,
        num_blocks: 4,
        max_blocks_per_seq: 4,
    };
    let (sm80, sm86, small) = (163 * 1024, 99 * 1024, 64 * 1024);
    let d = |hd, bs, q, kv, smem| PrefillKernel::choose(&shape(hd, bs), q, kv, smem);
    let (multi, one) = (
        |head_dim| PrefillKernel::MultiWarp { head_dim },
        PrefillKernel::OneWarp,
    );
    assert_eq!(d(128, 16, DType::F16, DType::F16, sm80), multi(128));
    assert_eq!(d(128, 16, DType::F16, DType::F16, sm86), multi(128));
    assert_eq!(d(128, 16, DType::F16, DType::F16, small), one);
    assert_eq!(d(128, 16, DType::Bf16, DType::E4m3, small), multi(128));
    assert_eq!(d(64, 16, DType::Bf16, DType::Bf16, small), multi(64));
    assert_eq!(d(128, 8, DType::F16, DType::F16, sm80), one, "block 8");
    assert_eq!(d(80, 16, DType::F16, DType::F16, sm80), one, "head_dim 80");
    assert_eq!(
        d(128, 16, DType::F32, DType::F32, sm80),
        PrefillKernel::Simt,
        "f32"
    );
}
