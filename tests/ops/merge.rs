//! The merge of attention states (`MergeStates`) in the emulator against the f64
//! reference, and the property the log-sum-exp outputs exist for: attention over a
//! sequence's keys cut into two disjoint parts (decode over the first tokens, decode
//! over the rest through a window), each written with its log-sum-exp and merged, equals
//! attention over all of them, the attention sink joining once in the merge.

use crate::common;

use common::case::{Params, build, sink_logits};
use common::{approx_tolerance, cases, lse_error, lse_tolerance, rel_l2, rng, tolerance, uniform};
use pagedkv::host::emulator::{Emulator, MathMode};
use pagedkv::host::ops::SUPPORTED_HEAD_DIMS;
use pagedkv::host::ops::attention::{AttentionOut, DecodeInputs, decode_emulated};
use pagedkv::host::ops::merge::{MergeInputs, MergeShape, merge_emulated};
use pagedkv::host::reference::{self, paged_decode_attention, paged_decode_lse};
use pagedkv::host::{DType, HostTensor};
use proptest::prelude::*;
use rand::Rng;

/// One merge: partial states of random log-sum-exp (some `-inf`, whose outputs are
/// NaN and must never be read), outputs poisoned with NaN.
#[derive(Clone, Debug)]
struct MergeCase {
    dtype: DType,
    shape: MergeShape,
    sinks: bool,
    seed: u64,
}

fn merge_cases() -> impl Strategy<Value = MergeCase> {
    (
        prop::sample::select(vec![DType::F32, DType::F16, DType::Bf16]),
        prop::sample::select(SUPPORTED_HEAD_DIMS.to_vec()),
        prop::sample::select(vec![1u32, 3, 17]),
        1u32..=4,
        prop_oneof![1u32..=8, Just(24u32)],
        prop::bool::weighted(0.3),
        any::<u64>(),
    )
        .prop_map(
            |(dtype, head_dim, num_rows, num_states, num_heads, sinks, seed)| MergeCase {
                dtype,
                shape: MergeShape {
                    num_rows,
                    num_states,
                    num_heads,
                    head_dim,
                },
                sinks,
                seed,
            },
        )
}

/// Merged outputs and their log-sum-exp.
type Merged = (Vec<f64>, Vec<f64>);

/// Runs one merge case in `math`: `(out, lse_out)` of the kernel and of the reference.
fn run_merge(c: &MergeCase, math: MathMode) -> (Merged, Merged) {
    let s = c.shape;
    let (rows, states, heads, d) = (
        s.num_rows as usize,
        s.num_states as usize,
        s.num_heads as usize,
        s.head_dim as usize,
    );
    let mut r = rng(c.seed);
    let lse: Vec<f64> = (0..rows * states * heads)
        .map(|_| {
            if r.random_bool(0.2) {
                f64::NEG_INFINITY
            } else {
                r.random_range(-6.0..12.0f32) as f64
            }
        })
        .collect();
    let mut v = uniform(&mut r, rows * states * heads * d);
    for (i, l) in lse.iter().enumerate() {
        if *l == f64::NEG_INFINITY {
            v[i * d..(i + 1) * d].fill(f64::NAN);
        }
    }
    let sinks = c.sinks.then(|| sink_logits(&mut r, s.num_heads));
    let vt = HostTensor::from_f64(c.dtype, &[rows, states, heads, d], &v).unwrap();
    let lt = HostTensor::from_f64(DType::F32, &[rows, states, heads], &lse).unwrap();
    let mut out = HostTensor::full(c.dtype, &[rows, heads, d], f64::NAN);
    let mut lse_out = HostTensor::full(DType::F32, &[rows, heads], f64::NAN);
    let inputs = MergeInputs {
        shape: &s,
        v: &vt,
        lse: &lt,
        sinks: sinks.as_deref(),
    };
    merge_emulated(
        &Emulator::new().with_math(math),
        inputs,
        AttentionOut {
            out: &mut out,
            lse: Some(&mut lse_out),
        },
    )
    .unwrap();
    // The reference sees the values the kernel read (rounded to the dtype).
    let want = reference::merge_states(
        &vt.to_f64(),
        &lt.to_f64(),
        (states, heads, d),
        sinks.as_deref(),
    );
    ((out.to_f64(), lse_out.to_f64()), want)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(48), ..ProptestConfig::default() })]

    /// The kernel against the f64 reference in every dtype, both math modes: parts of
    /// no keys get no weight (their NaN outputs never reach the result); a row whose
    /// every part is empty is 0 with log-sum-exp `-inf` (or the sink alone).
    #[test]
    fn merge_matches_the_f64_reference(c in merge_cases()) {
        for (math, approx) in [(MathMode::Exact, false), (MathMode::Approx { seed: c.seed }, true)] {
            let ((out, lse), (want, want_lse)) = run_merge(&c, math);
            let e = rel_l2(&out, &want);
            prop_assert!(e <= tolerance(c.dtype), "{:?} approx {}: rel L2 {:e}", c, approx, e);
            let e = lse_error(&lse, &want_lse);
            let tol = lse_tolerance(None, approx);
            prop_assert!(e <= tol, "{:?} approx {}: log-sum-exp off by {:e}", c, approx, e);
        }
    }
}

/// Decode over the first `len - w` tokens of each sequence and decode over its last `w`
/// (a window), each with its log-sum-exp, merged with the sinks, equals decode over
/// every token with them: in every dtype and both math modes. A sequence of at most
/// `w` tokens has an empty first part (log-sum-exp `-inf`, output NaN: never read).
/// Lengths off the block size, batch 17, GQA, soft-cap; no ALiBi (a part's positions
/// are relative to its own last token).
#[test]
fn two_parts_merge_into_the_whole() {
    let mut checked = 0;
    for (i, dtype) in [DType::F32, DType::F16, DType::Bf16]
        .into_iter()
        .enumerate()
    {
        for (j, head_dim) in [64u32, 80, 128].into_iter().enumerate() {
            let seed = 40 + 3 * i as u64 + j as u64;
            let p = Params {
                dtype,
                head_dim,
                block_size: [8, 16, 32][j],
                num_kv_heads: 2,
                group: 3,
                batch: 17,
                max_len: 90,
                window: None,
                softcap: (j == 1).then_some(15.0),
                alibi: false,
                sinks: true,
                partition: None,
                narrow_heads: false,
                seed,
                full_length: false,
            };
            let c = build(&p);
            let want = paged_decode_attention(&c.inputs());
            let want_lse = paged_decode_lse(&c.inputs());
            let w = 37u32;
            let (seqs, heads, d) = (17usize, c.shape.num_q_heads as usize, head_dim as usize);
            for (math, approx) in [(MathMode::Exact, false), (MathMode::Approx { seed }, true)] {
                let emu = Emulator::new().with_math(math);
                // Part 1: the first len - w tokens (a placeholder token where none).
                let head_lens: Vec<i32> = c.lens.iter().map(|&l| (l - w as i32).max(1)).collect();
                let mut head_opts = c.opts.clone();
                head_opts.window = None;
                let part = |lens: &[i32], opts, sinks| {
                    let mut out = HostTensor::full(dtype, &[seqs, heads, d], f64::NAN);
                    let mut lse = HostTensor::full(DType::F32, &[seqs, heads], f64::NAN);
                    let inputs = DecodeInputs {
                        context_lens: lens,
                        opts,
                        sinks,
                        ..c.inputs()
                    };
                    let to = AttentionOut {
                        out: &mut out,
                        lse: Some(&mut lse),
                    };
                    decode_emulated(&emu, inputs, to).unwrap();
                    (out.to_f64(), lse.to_f64())
                };
                let (mut o1, mut l1) = part(&head_lens, &head_opts, None);
                let mut tail_opts = c.opts.clone();
                tail_opts.window = Some(w);
                let (o2, l2) = part(&c.lens, &tail_opts, None);
                for s in 0..seqs {
                    if c.lens[s] <= w as i32 {
                        l1[s * heads..(s + 1) * heads].fill(f64::NEG_INFINITY);
                        o1[s * heads * d..(s + 1) * heads * d].fill(f64::NAN);
                    }
                }
                // Stack the parts: [seqs, 2, heads, d] and [seqs, 2, heads].
                let mut v = Vec::new();
                let mut l = Vec::new();
                for s in 0..seqs {
                    v.extend_from_slice(&o1[s * heads * d..(s + 1) * heads * d]);
                    v.extend_from_slice(&o2[s * heads * d..(s + 1) * heads * d]);
                    l.extend_from_slice(&l1[s * heads..(s + 1) * heads]);
                    l.extend_from_slice(&l2[s * heads..(s + 1) * heads]);
                }
                let shape = MergeShape {
                    num_rows: 17,
                    num_states: 2,
                    num_heads: heads as u32,
                    head_dim,
                };
                let vt = HostTensor::from_f64(dtype, &[seqs, 2, heads, d], &v).unwrap();
                let lt = HostTensor::from_f64(DType::F32, &[seqs, 2, heads], &l).unwrap();
                let mut out = HostTensor::full(dtype, &[seqs, heads, d], f64::NAN);
                let mut lse = HostTensor::full(DType::F32, &[seqs, heads], f64::NAN);
                let inputs = MergeInputs {
                    shape: &shape,
                    v: &vt,
                    lse: &lt,
                    sinks: c.sinks.as_deref(),
                };
                let to = AttentionOut {
                    out: &mut out,
                    lse: Some(&mut lse),
                };
                merge_emulated(&emu, inputs, to).unwrap();
                // The parts' outputs are rounded to the dtype before the merge: twice the
                // one-rounding tolerance for 16-bit outputs.
                let tol = if approx {
                    approx_tolerance(dtype, p.softcap)
                } else {
                    tolerance(dtype)
                } * if dtype == DType::F32 { 1.0 } else { 2.0 };
                let e = rel_l2(&out.to_f64(), &want);
                assert!(
                    e <= tol,
                    "{dtype} d{head_dim} approx {approx}: rel L2 {e:e} > {tol:e}"
                );
                let (e, tol) = (
                    lse_error(&lse.to_f64(), &want_lse),
                    2.0 * lse_tolerance(p.softcap, approx),
                );
                assert!(
                    e <= tol,
                    "{dtype} d{head_dim} approx {approx}: log-sum-exp off by {e:e}"
                );
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 18);
}

/// A part whose log-sum-exp is NaN or `+inf` poisons its head of its row, output and
/// log-sum-exp both NaN, before or after finite parts, with or without a sink, in every
/// dtype and both math modes, as the f64 reference does; the other heads and rows are
/// merged as usual. (A NaN part once gave a NaN output with `lse_out = -inf`: a row
/// that looked empty.)
#[test]
fn a_nan_or_infinite_lse_poisons_its_head_not_the_others() {
    let shape = MergeShape {
        num_rows: 2,
        num_states: 3,
        num_heads: 4,
        head_dim: 32,
    };
    let (nan, inf, ninf) = (f64::NAN, f64::INFINITY, f64::NEG_INFINITY);
    // [row][state][head]: row 0 head 0 NaN first, head 1 +inf last, head 2 NaN between
    // finite parts, head 3 finite; row 1 finite (and one empty part).
    let lse = [
        [nan, 1.0, 2.0, 0.5],
        [1.0, 2.0, nan, 1.5],
        [2.0, inf, 3.0, 2.5],
        [1.0, 0.0, 2.0, ninf],
        [2.0, 1.0, 0.0, 3.0],
        [0.5, 0.5, 0.5, 0.5],
    ]
    .concat();
    let poisoned = |r: usize, h: usize| r == 0 && h < 3;
    let v: Vec<f64> = (0..2 * 3 * 4 * 32)
        .map(|i| (i % 7) as f64 * 0.25 - 0.5)
        .collect();
    for dtype in [DType::F32, DType::F16, DType::Bf16] {
        for sinks in [None, Some(vec![0.5f32, -1.0, 2.0, 0.0])] {
            for math in [MathMode::Exact, MathMode::Approx { seed: 3 }] {
                let vt = HostTensor::from_f64(dtype, &[2, 3, 4, 32], &v).unwrap();
                let lt = HostTensor::from_f64(DType::F32, &[2, 3, 4], &lse).unwrap();
                let mut out = HostTensor::full(dtype, &[2, 4, 32], 7.0);
                let mut lse_out = HostTensor::full(DType::F32, &[2, 4], 7.0);
                let inputs = MergeInputs {
                    shape: &shape,
                    v: &vt,
                    lse: &lt,
                    sinks: sinks.as_deref(),
                };
                merge_emulated(
                    &Emulator::new().with_math(math),
                    inputs,
                    AttentionOut {
                        out: &mut out,
                        lse: Some(&mut lse_out),
                    },
                )
                .unwrap();
                let (o, l) = (out.to_f64(), lse_out.to_f64());
                let (want, want_l) =
                    reference::merge_states(&vt.to_f64(), &lse, (3, 4, 32), sinks.as_deref());
                for r in 0..2 {
                    for h in 0..4 {
                        let at = r * 4 + h;
                        let row = &o[at * 32..(at + 1) * 32];
                        let what = format!(
                            "{dtype} sinks {} {math:?} row {r} head {h}",
                            sinks.is_some()
                        );
                        if poisoned(r, h) {
                            assert!(
                                l[at].is_nan() && want_l[at].is_nan(),
                                "{what}: lse {} / {}",
                                l[at],
                                want_l[at]
                            );
                            assert!(row.iter().all(|x| x.is_nan()), "{what}: {row:?}");
                            assert!(
                                want[at * 32..(at + 1) * 32].iter().all(|x| x.is_nan()),
                                "{what}"
                            );
                        } else {
                            assert!(
                                l[at].is_finite() && (l[at] - want_l[at]).abs() < 1e-3,
                                "{what}: lse {} / {}",
                                l[at],
                                want_l[at]
                            );
                            let e = rel_l2(row, &want[at * 32..(at + 1) * 32]);
                            assert!(e <= tolerance(dtype), "{what}: rel L2 {e:e}");
                        }
                    }
                }
            }
        }
    }
}

/// A merge that would read past its inputs or write past its outputs is refused
/// before any launch, with the argument named.
#[test]
fn merge_refuses_mismatched_tensors() {
    let shape = MergeShape {
        num_rows: 2,
        num_states: 2,
        num_heads: 4,
        head_dim: 64,
    };
    let v = HostTensor::full(DType::F16, &[2, 2, 4, 64], 0.0);
    let lse = HostTensor::full(DType::F32, &[2, 2, 4], 0.0);
    let short = HostTensor::full(DType::F32, &[2, 2, 3], 0.0);
    let wrong = HostTensor::full(DType::F16, &[2, 2, 4], 0.0);
    let emu = Emulator::new();
    let err = |inputs: MergeInputs<'_, HostTensor>, out_dtype: DType, lse_out: Option<usize>| {
        let mut out = HostTensor::full(out_dtype, &[2, 4, 64], 0.0);
        let mut l = lse_out.map(|n| HostTensor::full(DType::F32, &[n], 0.0));
        merge_emulated(
            &emu,
            inputs,
            AttentionOut {
                out: &mut out,
                lse: l.as_mut(),
            },
        )
        .unwrap_err()
        .to_string()
    };
    let ok = MergeInputs {
        shape: &shape,
        v: &v,
        lse: &lse,
        sinks: None,
    };
    assert!(err(MergeInputs { lse: &short, ..ok }, DType::F16, None).contains("lse"));
    assert!(err(MergeInputs { lse: &wrong, ..ok }, DType::F16, None).contains("lse"));
    assert!(err(ok, DType::F32, None).contains("out"));
    assert!(err(ok, DType::F16, Some(7)).contains("lse"));
    assert!(
        err(
            MergeInputs {
                sinks: Some(&[1.0; 3]),
                ..ok
            },
            DType::F16,
            None
        )
        .contains("sinks")
    );
    let none = MergeShape {
        num_states: 0,
        ..shape
    };
    assert!(err(MergeInputs { shape: &none, ..ok }, DType::F16, None).contains("num_states"));
    let big = MergeShape {
        num_rows: 70_000,
        ..shape
    };
    assert!(err(MergeInputs { shape: &big, ..ok }, DType::F16, None).contains("num_rows"));
    // And the valid call runs.
    let mut out = HostTensor::full(DType::F16, &[2, 4, 64], f64::NAN);
    merge_emulated(&emu, ok, &mut out).unwrap();
    assert!(out.to_f64().iter().all(|x| *x == 0.0));
}
