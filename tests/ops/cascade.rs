//! Cascade attention (`ops::cascade`) on the step path against flat attention's f64
//! reference: decode rows in families that share a prompt's full blocks (prompts
//! ending on and off block boundaries, families of one row, rows in no family, rows
//! whose suffix is the one new token), every dtype and fp8 cache, GQA, soft-cap,
//! ALiBi (each row's own position in the shared pass), a window of the attention
//! options (each row's own, in both passes), attention sinks (joined once,
//! in the merge), split-K, both math modes. Outputs and their log-sum-exp poisoned with
//! NaN first, unused cache slots NaN.

use crate::common;

use common::case::{Case, Params, build_shared};
use common::fp8::quantise_case;
use common::{approx_tolerance, cases, lse_error, lse_tolerance, rel_l2, tolerance};
use pagedkv::host::emulator::{Emulator, MathMode};
use pagedkv::host::ops::attention::SplitTarget;
use pagedkv::host::ops::cascade::{CascadeGroup, find_groups};
use pagedkv::host::reference::{paged_decode_attention, paged_decode_lse};
use pagedkv::host::step::{
    DecodeIo, EmuDevice, PlannedCascade, StepCapacity, StepDevice, StepMeta, StepRunner,
    TensorView, TensorViewMut,
};
use pagedkv::host::{DType, HostTensor};
use proptest::prelude::*;

/// What one cascade decode wrote and planned.
pub(crate) struct Cascaded {
    pub(crate) out: HostTensor,
    pub(crate) lse: HostTensor,
    pub(crate) planned: Option<PlannedCascade>,
    pub(crate) groups: Vec<CascadeGroup>,
}

/// Case `c`'s decode on `dev` as cascade attention over the groups
/// [`find_groups`] finds (at least `min_shared_blocks` shared), through a step runner
/// planning split-K for `sms` SMs (`None`: never).
pub(crate) fn cascade_on<D: StepDevice>(
    dev: D,
    c: &Case,
    sms: Option<u32>,
    min_shared_blocks: u32,
) -> Result<Cascaded, String> {
    let e = |e: pagedkv::host::Error| e.to_string();
    let s = &c.shape;
    let shape = s.with_dtypes(c.q.dtype(), c.kc.dtype());
    let cap = StepCapacity {
        max_seqs: s.num_seqs,
        max_blocks_per_seq: s.max_blocks_per_seq,
        max_tokens: 1,
        max_partitions: 64,
    };
    let mut runner =
        StepRunner::with_split(dev, shape, cap, sms.map(SplitTarget::conservative)).map_err(e)?;
    runner.enable_cascade().map_err(e)?;
    runner
        .set_alibi_slopes(c.opts.alibi_slopes.as_deref())
        .map_err(e)?;
    let meta = StepMeta {
        block_tables: &c.tables,
        max_blocks_per_seq: s.max_blocks_per_seq,
        context_lens: &c.lens,
        slot_mapping: &[],
        window: None,
    };
    runner.plan(&meta).map_err(e)?;
    let groups = find_groups(
        &c.tables,
        s.max_blocks_per_seq,
        &c.lens,
        s.block_size,
        min_shared_blocks,
    );
    let planned = runner.plan_cascade(&meta, &groups).map_err(e)?;
    let mut out = HostTensor::full(c.q.dtype(), c.q.shape(), f64::NAN);
    let heads = [s.num_seqs as usize, s.num_q_heads as usize];
    let mut lse = HostTensor::full(DType::F32, &heads, f64::NAN);
    let scales: Option<Vec<f32>> = c
        .scales
        .as_ref()
        .map(|k| k.k.iter().chain(&k.v).copied().collect());
    runner
        .decode(
            &c.opts,
            DecodeIo {
                q: TensorView::of_host(&c.q),
                key_cache: TensorView::of_host(&c.kc),
                value_cache: TensorView::of_host(&c.vc),
                kv_scales: scales.as_deref().map(TensorView::from_slice),
                sinks: c.sinks.as_deref().map(TensorView::from_slice),
                group: 0,
                out: TensorViewMut::of_host(&mut out),
                lse: Some(TensorViewMut::of_host(&mut lse)),
            },
        )
        .map_err(e)?;
    Ok(Cascaded {
        out,
        lse,
        planned,
        groups,
    })
}

fn params() -> impl Strategy<Value = (Params, Option<DType>)> {
    (
        prop::sample::select(vec![
            (DType::F32, None),
            (DType::F16, None),
            (DType::Bf16, None),
            (DType::F16, Some(DType::E4m3)),
            (DType::Bf16, Some(DType::E5m2)),
        ]),
        prop::sample::select(vec![64u32, 80, 128]),
        prop::sample::select(vec![8u32, 16, 32]),
        prop_oneof![1u32..=4, Just(8u32)],
        prop::sample::select(vec![3u32, 9, 17]),
        (
            prop::option::weighted(0.3, 5.0f32..30.0),
            prop::bool::weighted(0.3),
            prop::bool::weighted(0.3),
            prop::option::weighted(0.25, 1u32..=100),
            any::<u64>(),
        ),
    )
        .prop_map(
            |((dtype, cache), head_dim, block_size, group, batch, rest)| {
                let (softcap, alibi, sinks, window, seed) = rest;
                (
                    Params {
                        dtype,
                        head_dim,
                        block_size,
                        num_kv_heads: if group == 8 { 1 } else { 2 },
                        group,
                        batch,
                        max_len: 120,
                        // The attention options' window only (`shared_case`).
                        window,
                        softcap,
                        alibi,
                        sinks,
                        partition: None,
                        narrow_heads: false,
                        seed,
                        full_length: false,
                    },
                    cache,
                )
            },
        )
}

/// The case of `p`, its cache quantised to `cache` when given.
pub(crate) fn shared_case(p: &Params, cache: Option<DType>) -> Case {
    // (The window is the attention's, not the tables': no block is released.)
    let mut c = build_shared(&Params {
        window: None,
        ..p.clone()
    });
    c.opts.window = p.window;
    if let Some(cache) = cache {
        quantise_case(&mut c, cache, true);
    }
    c
}

/// Cascade against flat attention's reference: exact and approximate math, unsplit
/// and planned for a GPU of 132 SMs (split-K on the small batches).
fn check(p: &Params, cache: Option<DType>) -> Result<(), TestCaseError> {
    let c = shared_case(p, cache);
    let want = paged_decode_attention(&c.inputs());
    let want_lse = paged_decode_lse(&c.inputs());
    // The parts are rounded to the output type before the merge: up to twice the
    // one-rounding tolerance for 16-bit outputs.
    let twice = if p.dtype == DType::F32 { 1.0 } else { 2.0 };
    for (math, approx, sms) in [
        (MathMode::Exact, false, None),
        (MathMode::Approx { seed: p.seed }, true, Some(132)),
    ] {
        let dev = EmuDevice::new(Emulator::new().with_math(math));
        let got = cascade_on(dev, &c, sms, 1).map_err(TestCaseError::fail)?;
        prop_assert_eq!(got.planned.is_some(), !got.groups.is_empty());
        let tol = twice
            * if approx {
                approx_tolerance(p.dtype, p.softcap)
            } else {
                tolerance(p.dtype)
            };
        let e = rel_l2(&got.out.to_f64(), &want);
        prop_assert!(
            e <= tol,
            "approx {}: rel L2 {:e} > {:e}, groups {:?}",
            approx,
            e,
            tol,
            got.groups
        );
        let (e, tol) = (
            lse_error(&got.lse.to_f64(), &want_lse),
            2.0 * lse_tolerance(p.softcap, approx),
        );
        prop_assert!(e <= tol, "approx {}: log-sum-exp off by {:e}", approx, e);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(32), ..ProptestConfig::default() })]

    #[test]
    fn cascade_equals_flat_attention((p, cache) in params()) {
        check(&p, cache)?;
    }
}

/// A family of 12 rows sharing a 70-token prompt (4 full blocks of 16) and 5 rows of
/// their own: one group of the 12 at 4 blocks, the others flat; the result equals the
/// reference. (A hand-made case the proptest draws only sometimes.)
#[test]
fn one_long_family_is_one_group() {
    let p = Params {
        dtype: DType::F16,
        head_dim: 128,
        block_size: 16,
        num_kv_heads: 2,
        group: 4,
        batch: 17,
        max_len: 140,
        window: None,
        softcap: None,
        alibi: true,
        sinks: true,
        partition: None,
        narrow_heads: false,
        seed: 3,
        full_length: false,
    };
    let c = shared_case(&p, None);
    let got = cascade_on(EmuDevice::new(Emulator::new()), &c, None, 1).unwrap();
    assert!(!got.groups.is_empty(), "no group in {:?}", c.tables);
    let e = rel_l2(&got.out.to_f64(), &paged_decode_attention(&c.inputs()));
    assert!(e <= 2.0 * tolerance(DType::F16), "{e:e}");
}

/// Cascade attention is refused, with the reason named, where it would read released
/// blocks (a step planned with a sliding window, a runner of layer groups), and a
/// cascade planned before its buffers, for groups that do not hold, or over tables
/// other than the step's is an error, not a launch.
#[test]
fn cascade_refuses_windows_layer_groups_and_bad_groups() {
    let p = Params {
        dtype: DType::F32,
        head_dim: 64,
        block_size: 16,
        num_kv_heads: 1,
        group: 1,
        batch: 8,
        max_len: 60,
        window: None,
        softcap: None,
        alibi: false,
        sinks: false,
        partition: None,
        narrow_heads: false,
        seed: 5,
        full_length: false,
    };
    let c = common::case::build_family(&p, 64);
    let s = &c.shape;
    let shape = s.with_dtypes(DType::F32, DType::F32);
    let cap = StepCapacity {
        max_seqs: s.num_seqs,
        max_blocks_per_seq: s.max_blocks_per_seq,
        max_tokens: 1,
        max_partitions: 1,
    };
    let runner =
        || StepRunner::with_split(EmuDevice::new(Emulator::new()), shape, cap, None).unwrap();
    let meta = |window| StepMeta {
        block_tables: &c.tables,
        max_blocks_per_seq: s.max_blocks_per_seq,
        context_lens: &c.lens,
        slot_mapping: &[],
        window,
    };
    let groups = find_groups(&c.tables, s.max_blocks_per_seq, &c.lens, 16, 1);
    assert_eq!(groups.len(), 1);
    let err = |r: pagedkv::host::Result<Option<PlannedCascade>>| r.unwrap_err().to_string();
    // No buffers yet.
    let mut r = runner();
    r.plan(&meta(None)).unwrap();
    assert!(err(r.plan_cascade(&meta(None), &groups)).contains("enable_cascade"));
    // A sliding window.
    r.enable_cascade().unwrap();
    r.plan(&meta(Some(200))).unwrap();
    assert!(err(r.plan_cascade(&meta(Some(200)), &groups)).contains("sliding window"));
    // Groups that do not hold: more shared blocks than the rows have.
    r.plan(&meta(None)).unwrap();
    let bad = [CascadeGroup {
        shared_blocks: groups[0].shared_blocks + 2,
        ..groups[0].clone()
    }];
    assert!(err(r.plan_cascade(&meta(None), &bad)).contains("cannot share"));
    // Tables other than those `plan` validated (a block far outside the pool in every
    // row's shared prefix): refused before any upload.
    let mut crafted = c.tables.clone();
    for row in 0..s.num_seqs as usize {
        crafted[row * s.max_blocks_per_seq as usize] = 1_000_000;
    }
    let other = StepMeta {
        block_tables: &crafted,
        ..meta(None)
    };
    assert!(err(r.plan_cascade(&other, &groups)).contains("not the step plan() planned"));
    // Layer groups, either order.
    let mut r = runner();
    r.set_groups(2).unwrap();
    let e = r.enable_cascade().unwrap_err().to_string();
    assert!(e.contains("layer groups"), "{e}");
    let mut r = runner();
    r.enable_cascade().unwrap();
    assert!(r.set_groups(2).unwrap_err().to_string().contains("cascade"));
}
