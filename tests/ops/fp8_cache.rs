//! fp8 KV caches (e4m3, e5m2) in the emulator: `kv_append` quantises bit-exactly as
//! the reference does (saturating, never NaN from a finite input); decode (unsplit
//! and split-K) and prefill read the cache against the f64 reference computed on the
//! *dequantised* cache, so the kernels' own error is isolated from fp8's rounding; and
//! every bad pairing of query type, cache type and scales is an error.
//!
//! The cases are the decode tests' (tests/common/case.rs): shuffled pools with shared
//! blocks, batch 1/3/17, lengths off the block size, NaN in every unused slot (fp8's
//! NaN byte) and in the outputs, windows with freed blocks, soft-cap, ALiBi, GQA.

use crate::common;
use crate::prefill::{Prefill, prefill_case, prefill_holds_emulated};

use common::case::{Case, Params, build};
use common::fp8::{calibrate, head_of, quantise_case};
use common::{approx_tolerance, cases, rel_l2, rng, split_tolerance, tolerance};
use pagedkv::host::emulator::{BlockOrder, Emulator, MathMode};
use pagedkv::host::ops::SUPPORTED_HEAD_DIMS;
use pagedkv::host::ops::attention::{DecodeInputs, decode_emulated, plan};
use pagedkv::host::ops::kv_append::{KvAppendInputs, kv_append_emulated, kv_append_reference};
use pagedkv::host::ops::scales::KvScales;
use pagedkv::host::reference::paged_decode_attention;
use pagedkv::host::{DType, Error, HostTensor};
use pagedkv::kernels::PagedLayout;
use proptest::prelude::*;
use rand::Rng;

/// A decode case with a 16-bit query type and an fp8 cache type.
pub(crate) fn params() -> impl Strategy<Value = (Params, DType, bool)> {
    (
        prop::sample::select(vec![DType::F16, DType::Bf16]),
        prop::sample::select(DType::FP8.to_vec()),
        prop::sample::select(SUPPORTED_HEAD_DIMS.to_vec()),
        prop::sample::select(vec![8u32, 16, 32]),
        1u32..=2,
        prop_oneof![3 => 1u32..=4, 1 => Just(8u32), 1 => Just(16u32)],
        prop::sample::select(vec![1u32, 3, 17]),
        (1u32..=160, prop::option::weighted(0.3, 1u32..=70)),
        (
            prop::option::weighted(0.3, 2.0f32..30.0),
            prop::bool::weighted(0.3),
            prop::bool::weighted(0.3),
            any::<bool>(),
            any::<u64>(),
        ),
    )
        .prop_map(
            |(dtype, cache, head_dim, block_size, kvh, group, batch, (max_len, window), rest)| {
                let (softcap, alibi, sinks, per_head, seed) = rest;
                let p = Params {
                    sinks,
                    dtype,
                    head_dim,
                    block_size,
                    num_kv_heads: if group > 4 { 1 } else { kvh },
                    group,
                    batch,
                    max_len: if batch == 17 {
                        max_len.min(60)
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
                };
                (p, cache, per_head)
            },
        )
}

fn fp8_case(p: &Params, cache: DType, per_head: bool) -> Case {
    let mut c = build(p);
    quantise_case(&mut c, cache, per_head);
    c
}

/// A prefill case ([`prefill_case`]: whole prompts, single tokens and chunks, freed
/// blocks before windows) of at most 90 tokens a sequence over `cache`, quantised with
/// per-tensor or per-head scales.
pub(crate) fn fp8_prefill_case(p: &Params, cache: DType, per_head: bool) -> Prefill {
    let mut pc = prefill_case(&Params {
        max_len: p.max_len.min(90),
        ..p.clone()
    });
    quantise_case(&mut pc.c, cache, per_head);
    pc
}

fn decode(c: &Case, inputs: DecodeInputs<'_, HostTensor>, emu: &Emulator) -> Vec<f64> {
    let mut out = HostTensor::full(c.q.dtype(), c.q.shape(), f64::NAN);
    decode_emulated(emu, inputs, &mut out).unwrap();
    out.to_f64()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(24), ..ProptestConfig::default() })]

    /// Decode over an fp8 cache, unsplit and split-K, exact and approximate math,
    /// against f64 attention over the dequantised cache.
    #[test]
    fn decode_over_an_fp8_cache_matches_the_dequantised_reference(
        (p, cache, per_head) in params()
    ) {
        let c = fp8_case(&p, cache, per_head);
        let want = paged_decode_attention(&c.inputs());
        let emu = Emulator::new().with_order(BlockOrder::Shuffled(p.seed));
        let got = decode(&c, c.inputs(), &emu);
        let e = rel_l2(&got, &want);
        prop_assert!(e <= tolerance(p.dtype), "unsplit, exact: rel L2 {:e}", e);

        let approx = decode(&c, c.inputs(), &Emulator::new().with_math(MathMode::Approx { seed: p.seed }));
        let e = rel_l2(&approx, &want);
        let tol = approx_tolerance(p.dtype, p.softcap);
        prop_assert!(e <= tol, "unsplit, approximate: rel L2 {:e} > {:e}", e, tol);

        // Split-K as a 132-SM GPU would plan it: the partials carry the V scale.
        let max_len = *c.lens.iter().max().unwrap() as u32;
        let split = plan(&c.shape, cache, max_len, 132);
        let inputs = DecodeInputs { plan: Some(split), ..c.inputs() };
        let got_split = decode(&c, inputs, &emu);
        let e = rel_l2(&got_split, &want);
        prop_assert!(e <= tolerance(p.dtype), "split ({} parts): rel L2 {:e}", split.num_partitions, e);
        let e = rel_l2(&got_split, &got);
        prop_assert!(e <= split_tolerance(p.dtype), "split vs unsplit: rel L2 {:e}", e);
    }

    /// Prefill (tensor cores, the fp8 tile decoded into 16-bit shared memory) over an
    /// fp8 cache against the dequantised reference, exact and approximate math.
    #[test]
    fn prefill_over_an_fp8_cache_matches_the_dequantised_reference(
        (p, cache, per_head) in params()
    ) {
        let pc = fp8_prefill_case(&p, cache, per_head);
        let r = prefill_holds_emulated(&format!("prefill over {cache}"), &pc, p.seed);
        prop_assert!(r.is_ok(), "{}", r.unwrap_err());
    }

    /// kv_append into an fp8 cache writes exactly the reference's bytes (x / scale in
    /// f32, round to nearest even, saturate), leaves every other slot untouched, and
    /// never writes a NaN for a finite input, even 1000x past the calibrated range.
    #[test]
    fn kv_append_quantises_bit_exactly(
        dtype in prop::sample::select(vec![DType::F16, DType::Bf16]),
        cache in prop::sample::select(DType::FP8.to_vec()),
        head_dim in prop::sample::select(SUPPORTED_HEAD_DIMS.to_vec()),
        num_kv_heads in 1u32..=3,
        n in 1usize..=20,
        seed in any::<u64>(),
    ) {
        let l = PagedLayout { num_blocks: 6, num_kv_heads, block_size: 8, head_dim };
        let mut r = rng(seed);
        let row = (num_kv_heads * head_dim) as usize;
        // Mostly in range, some far outside it (saturates), one exact zero.
        let vals = |r: &mut rand::rngs::SmallRng| -> Vec<f64> {
            (0..n * row).map(|i| match r.random_range(0..10) {
                0 => 1000.0 * r.random_range(-2.0..2.0),
                _ if i == 0 => 0.0,
                _ => r.random_range(-2.0..2.0),
            }).collect()
        };
        let k = HostTensor::from_f64(dtype, &[n, row], &vals(&mut r)).unwrap();
        let v = HostTensor::from_f64(dtype, &[n, row], &vals(&mut r)).unwrap();
        let scales = KvScales {
            k: (0..num_kv_heads).map(|_| r.random_range(0.001f32..0.01)).collect(),
            v: (0..num_kv_heads).map(|_| r.random_range(0.001f32..0.01)).collect(),
        };
        let mut slots: Vec<i64> = (0..l.num_slots() as i64).collect();
        use rand::seq::SliceRandom;
        slots.shuffle(&mut r);
        slots.truncate(n);
        slots[n / 2] = -1; // padding
        let pool = [l.pool_elems() as usize];
        let (mut kr, mut vr) = (HostTensor::full(cache, &pool, f64::NAN), HostTensor::full(cache, &pool, f64::NAN));
        let (mut kc, mut vc) = (kr.clone(), vr.clone());
        kv_append_reference(KvAppendInputs { layout: &l, key: &k, value: &v, slot_mapping: &slots,
            key_cache: &mut kr, value_cache: &mut vr, scales: Some(&scales) }).unwrap();
        kv_append_emulated(&Emulator::new(), KvAppendInputs { layout: &l, key: &k, value: &v,
            slot_mapping: &slots, key_cache: &mut kc, value_cache: &mut vc, scales: Some(&scales) }).unwrap();
        prop_assert_eq!(kc.buf().as_bytes(), kr.buf().as_bytes());
        prop_assert_eq!(vc.buf().as_bytes(), vr.buf().as_bytes());
        // Written slots: finite, and within half an fp8 step (or saturated) of x / scale.
        let written: usize = slots.iter().filter(|&&s| s >= 0).count();
        let mut finite = 0;
        for (i, &slot) in slots.iter().enumerate() {
            if slot < 0 {
                continue;
            }
            for h in 0..num_kv_heads {
                let dst = l.slot_offset(slot as u64, h) as usize;
                for e in 0..head_dim as usize {
                    let x = k.get(i * row + (h * head_dim) as usize + e) / scales.k[h as usize] as f64;
                    let got = kc.get(dst + e);
                    prop_assert!(got.is_finite(), "x/scale {} stored as {}", x, got);
                    let max = cache.max_finite() as f64;
                    let want = x.clamp(-max, max);
                    // e4m3: 3 mantissa bits (relative step 2^-3), e5m2: 2 bits.
                    let rel = if cache == DType::E4m3 { 1.0 / 16.0 } else { 1.0 / 8.0 };
                    let sub = if cache == DType::E4m3 { 2f64.powi(-10) } else { 2f64.powi(-17) };
                    prop_assert!((got - want).abs() <= rel * want.abs() + sub,
                        "x/scale {} stored as {}", x, got);
                    finite += 1;
                }
            }
        }
        prop_assert_eq!(finite, written * row);
        // Unwritten slots keep their NaN.
        let untouched = (0..l.pool_elems() as usize).filter(|&i| kc.get(i).is_nan()).count();
        prop_assert_eq!(untouched, l.pool_elems() as usize - written * row);
    }
}

/// Decoding through the kernel reproduces the reference's per-head dequantisation: a
/// cache where each KV head has its own scale 1000x apart from the next is read back
/// correctly for every head (a kernel that used one head's scale for all fails).
#[test]
fn each_kv_head_is_read_with_its_own_scale() {
    let p = Params {
        sinks: false,
        dtype: DType::F16,
        head_dim: 64,
        block_size: 16,
        num_kv_heads: 3,
        group: 2,
        batch: 3,
        max_len: 40,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed: 7,
        full_length: false,
    };
    for cache in DType::FP8 {
        let mut c = build(&p);
        // Blow each head's values up by 10^(3h): per-head scales absorb it.
        let l = c.shape.layout();
        for t in [&mut c.kc, &mut c.vc] {
            for i in 0..t.len() {
                let x = t.get(i);
                t.set(i, x * 1000f64.powi(head_of(&l, i) as i32) / 1e6);
            }
        }
        quantise_case(&mut c, cache, true);
        let s = c.scales.clone().unwrap();
        assert!(s.k[2] > 1e5 * s.k[0], "{:?}", s.k);
        let want = paged_decode_attention(&c.inputs());
        let got = decode(&c, c.inputs(), &Emulator::new());
        let e = rel_l2(&got, &want);
        assert!(e <= tolerance(DType::F16), "{cache}: rel L2 {e:e}");
        // Swap two heads' scales: the kernel must notice (the values move).
        let mut bad = s.clone();
        bad.v.swap(0, 2);
        let inputs = DecodeInputs {
            kv_scales: Some(&bad),
            ..c.inputs()
        };
        let e = rel_l2(&decode(&c, inputs, &Emulator::new()), &want);
        assert!(e > 0.5, "{cache}: swapped scales still match ({e:e})");
    }
}

/// Every bad pairing of query type, cache type and scales is an error naming it.
#[test]
fn bad_cache_types_and_scales_are_errors() {
    let p = Params {
        sinks: false,
        dtype: DType::F16,
        head_dim: 64,
        block_size: 16,
        num_kv_heads: 2,
        group: 2,
        batch: 1,
        max_len: 20,
        window: None,
        softcap: None,
        alibi: false,
        partition: None,
        narrow_heads: false,
        seed: 3,
        full_length: false,
    };
    let f16 = build(&p);
    let mut e4 = build(&p);
    quantise_case(&mut e4, DType::E4m3, true);
    let emu = Emulator::new();
    let run = |c: &Case, scales: Option<&KvScales>, q: &HostTensor| {
        let mut out = HostTensor::full(q.dtype(), q.shape(), f64::NAN);
        let inputs = DecodeInputs {
            kv_scales: scales,
            q,
            ..c.inputs()
        };
        match decode_emulated(&emu, inputs, &mut out) {
            Err(Error::InvalidArgument { arg, reason }) => format!("{arg}: {reason}"),
            other => panic!("accepted: {other:?}"),
        }
    };
    // fp8 cache without scales.
    assert!(
        run(&e4, None, &e4.q).starts_with("kv_scales"),
        "missing scales"
    );
    // Scales with an f16 cache.
    assert!(run(&f16, e4.scales.as_ref(), &f16.q).starts_with("kv_scales"));
    // Wrong count, zero, NaN, infinite scales.
    for bad in [
        vec![1.0],
        vec![1.0, 0.0],
        vec![f32::NAN, 1.0],
        vec![1.0, f32::INFINITY],
        vec![-1.0, 1.0],
    ] {
        let mut o = e4.scales.clone().unwrap();
        o.k = bad.clone();
        assert!(
            run(&e4, Some(&o), &e4.q).starts_with("kv_scales.k"),
            "{bad:?}"
        );
    }
    // f32 queries over an fp8 cache; fp8 queries.
    let q32 = HostTensor::full(DType::F32, e4.q.shape(), 0.5);
    assert!(run(&e4, e4.scales.as_ref(), &q32).starts_with("dtype"));
    let q8 = HostTensor::full(DType::E4m3, e4.q.shape(), 0.5);
    assert!(run(&e4, e4.scales.as_ref(), &q8).starts_with("dtype"));
    // A bf16 cache with f16 queries.
    let mut bf = build(&Params {
        dtype: DType::Bf16,
        ..p.clone()
    });
    bf.q = f16.q.clone();
    assert!(run(&bf, None, &bf.q).starts_with("q:"));
    // The same checks guard kv_append.
    let l = e4.shape.layout();
    let k = HostTensor::full(DType::F16, &[1, 2 * 64], 1.0);
    let (mut kc, mut vc) = (e4.kc.clone(), e4.vc.clone());
    let r = kv_append_emulated(
        &emu,
        KvAppendInputs {
            layout: &l,
            key: &k,
            value: &k,
            slot_mapping: &[0],
            key_cache: &mut kc,
            value_cache: &mut vc,
            scales: None,
        },
    );
    assert!(
        matches!(
            r,
            Err(Error::InvalidArgument {
                arg: "kv_scales",
                ..
            })
        ),
        "{r:?}"
    );
    // Calibration refuses a non-fp8 type and non-finite data.
    assert!(KvScales::calibrate(DType::F16, 1, 2, &[1.0, 2.0], &[1.0, 2.0]).is_err());
    assert!(KvScales::calibrate(DType::E4m3, 1, 2, &[1.0, f64::NAN], &[1.0, 2.0]).is_err());
    let _ = calibrate(&l, &e4.kc, DType::E4m3, true);
}

/// Calibration over values beyond any query type (near 1e300) once returned infinite
/// scales (Ok); it is an error naming the input and the element.
#[test]
fn calibration_beyond_f32_is_an_error_naming_the_input() {
    let ok = [1.0, 2.0, 3.0, 4.0];
    for big in [1e300, -1e300, 1e40, f32::MAX as f64 * 1.001] {
        let k = [1.0, 2.0, big, 4.0];
        for (keys, values, arg) in [(&k, &ok, "keys"), (&ok, &k, "values")] {
            match KvScales::calibrate(DType::E4m3, 2, 2, keys, values) {
                Err(Error::InvalidArgument { arg: a, reason }) => {
                    assert_eq!(a, arg, "{reason}");
                    assert!(
                        reason.contains("element 2") && reason.contains("beyond f32"),
                        "{reason}"
                    );
                }
                other => panic!("{big:e} in {arg}: expected an error, got {other:?}"),
            }
        }
    }
    // Values up to f32::MAX make finite scales.
    let s = KvScales::calibrate(DType::E4m3, 1, 2, &[f32::MAX as f64, 1.0], &[1.0, 1.0]).unwrap();
    assert!(s.k[0].is_finite() && s.k[0] > 0.0);
}
