//! The FP8 (`e4m3`, `e5m2`) conversions: the device layer's software path (what `sm_80`
//! and the host run, `pagedkv_kernels::device::fp8::soft`) and the emulator's model of
//! the `sm_89+` hardware instructions (`pagedkv_host::emulator::fp8`) agree bit for bit
//! with each other and with an independent reference written here: decoding from the
//! sign / exponent / mantissa fields in `f64`, encoding by nearest-neighbour search in
//! the table of every finite value, ties to the even code, saturating.
//!
//! `fp8_every_f32_soft_matches_hardware_model` (ignored by default) compares the two
//! encoders on all 2^32 f32 inputs: `cargo test --release -p pagedkv-host --test emulated --
//! --ignored`.

use pagedkv_host::emulator::fp8 as hw;
use pagedkv_kernels::device::fp8::{self as dev, soft};

/// An fp8 format as the reference sees it.
#[derive(Clone, Copy, Debug)]
struct Fmt {
    name: &'static str,
    exp_bits: u32,
    man_bits: u32,
    bias: i32,
    /// The format has infinities (exponent all ones, mantissa 0) and IEEE NaNs.
    ieee_specials: bool,
}

const E4M3: Fmt = Fmt {
    name: "e4m3",
    exp_bits: 4,
    man_bits: 3,
    bias: 7,
    ieee_specials: false,
};
const E5M2: Fmt = Fmt {
    name: "e5m2",
    exp_bits: 5,
    man_bits: 2,
    bias: 15,
    ieee_specials: true,
};

const FORMATS: [Fmt; 2] = [E4M3, E5M2];

/// A named encoder (f32 → fp8 bits).
type Encoder = (&'static str, fn(f32) -> u8);
/// A named two-at-a-time decoder (fp8x2 → f16x2 bits).
type F16x2Decoder = (&'static str, fn(u16) -> u32);
/// A named decoder (fp8 bits → f32).
type F32Decoder = (&'static str, fn(u8) -> f32);

/// The reference decoder: `None` for NaN.
fn ref_decode(b: u8, f: Fmt) -> Option<f64> {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> f.man_bits) as u32 & ((1 << f.exp_bits) - 1)) as i32;
    let m = (b as u32 & ((1 << f.man_bits) - 1)) as f64;
    let e_max = (1 << f.exp_bits) - 1;
    let scale = (1u32 << f.man_bits) as f64;
    if f.ieee_specials && e == e_max {
        return if m == 0.0 {
            Some(sign * f64::INFINITY)
        } else {
            None
        };
    }
    if !f.ieee_specials && e == e_max && m == scale - 1.0 {
        return None; // e4m3: S.1111.111 is the only NaN
    }
    Some(if e == 0 {
        sign * m / scale * 2f64.powi(1 - f.bias)
    } else {
        sign * (1.0 + m / scale) * 2f64.powi(e - f.bias)
    })
}

/// Every finite non-negative value of the format, with its code, ascending.
fn finite_table(f: Fmt) -> Vec<(f64, u8)> {
    let mut t: Vec<(f64, u8)> = (0u8..0x80)
        .filter_map(|c| ref_decode(c, f).filter(|v| v.is_finite()).map(|v| (v, c)))
        .collect();
    t.sort_by(|a, b| a.0.total_cmp(&b.0));
    t
}

/// The reference encoder: nearest finite value, ties to the even code, magnitudes at or
/// above the largest finite value (infinity included) saturate, NaN → 0x7f.
fn ref_encode(x: f32, table: &[(f64, u8)]) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let v = (x as f64).abs();
    let (max, max_code) = *table.last().unwrap();
    if v >= max {
        return sign | max_code;
    }
    // table[i].0 <= v < table[i + 1].0
    let i = table.partition_point(|&(t, _)| t <= v) - 1;
    let (lo, lo_code) = table[i];
    let (hi, hi_code) = table[i + 1];
    let code = match (v - lo).total_cmp(&(hi - v)) {
        std::cmp::Ordering::Less => lo_code,
        std::cmp::Ordering::Greater => hi_code,
        std::cmp::Ordering::Equal => {
            if lo_code % 2 == 0 {
                lo_code
            } else {
                hi_code
            }
        }
    };
    sign | code
}

/// The three encoders of one format: device software, emulator hardware model (through
/// its x2 instruction, in the high byte), and the device's dispatching function.
fn encoders(f: Fmt) -> [Encoder; 4] {
    if f.ieee_specials {
        [
            ("soft", soft::f32_to_e5m2),
            ("hw model a", |x| {
                (hw::cvt_rn_satfinite_e5m2x2_f32(x, 1.0) >> 8) as u8
            }),
            ("hw model b", |x| {
                hw::cvt_rn_satfinite_e5m2x2_f32(-1.0, x) as u8
            }),
            ("device", dev::f32_to_e5m2),
        ]
    } else {
        [
            ("soft", soft::f32_to_e4m3),
            ("hw model a", |x| {
                (hw::cvt_rn_satfinite_e4m3x2_f32(x, 1.0) >> 8) as u8
            }),
            ("hw model b", |x| {
                hw::cvt_rn_satfinite_e4m3x2_f32(-1.0, x) as u8
            }),
            ("device", dev::f32_to_e4m3),
        ]
    }
}

/// Checks every encoder against the reference on `x`.
fn check_encode(x: f32, f: Fmt, table: &[(f64, u8)]) {
    let want = ref_encode(x, table);
    for (name, enc) in encoders(f) {
        let got = enc(x);
        assert_eq!(
            got,
            want,
            "{} {name}: encode({x:e} = {:#010x}) = {got:#04x}, reference {want:#04x}",
            f.name,
            x.to_bits()
        );
    }
}

/// `mul.rn.f16x2` in software: each half's product is exact in f32 (11-bit
/// significands), then rounded to f16 once.
fn mul_f16x2(a: u32, b: u32) -> u32 {
    use pagedkv_kernels::device::{f16_to_f32, f32_to_f16};
    let half = |x: u32, y: u32| f32_to_f16(f16_to_f32(x as u16) * f16_to_f32(y as u16)) as u32;
    half(a, b) | half(a >> 16, b >> 16) << 16
}

/// sm_80's two-at-a-time e4m3 decoder, with the software f16x2 multiply.
fn packed_e4m3(v: u16) -> u32 {
    dev::packed::e4m3x2_to_f16x2(v, mul_f16x2)
}

/// The f16 decoders of one format: software (per byte, through the x2 form), the
/// hardware model, the device's (on the host: the software one) and the packed one
/// the sm_80 PTX runs.
fn f16x2_decoders(f: Fmt) -> [F16x2Decoder; 4] {
    if f.ieee_specials {
        [
            ("soft", soft::e5m2x2_to_f16x2),
            ("hw model", hw::cvt_rn_f16x2_e5m2x2),
            ("device", dev::e5m2x2_to_f16x2),
            ("packed", dev::packed::e5m2x2_to_f16x2),
        ]
    } else {
        [
            ("soft", soft::e4m3x2_to_f16x2),
            ("hw model", hw::cvt_rn_f16x2_e4m3x2),
            ("device", dev::e4m3x2_to_f16x2),
            ("packed", packed_e4m3),
        ]
    }
}

fn f32_decoders(f: Fmt) -> [F32Decoder; 2] {
    if f.ieee_specials {
        [("soft", soft::e5m2_to_f32), ("device", dev::e5m2_to_f32)]
    } else {
        [("soft", soft::e4m3_to_f32), ("device", dev::e4m3_to_f32)]
    }
}

#[test]
fn reference_knows_the_formats() {
    // The reference itself, on the values the formats are defined by.
    assert_eq!(ref_decode(0x7e, E4M3), Some(448.0));
    assert_eq!(ref_decode(0x01, E4M3), Some(2f64.powi(-9)));
    assert_eq!(ref_decode(0x08, E4M3), Some(2f64.powi(-6)));
    assert_eq!(ref_decode(0x7f, E4M3), None);
    assert_eq!(ref_decode(0xff, E4M3), None);
    assert_eq!(ref_decode(0x78, E4M3), Some(256.0)); // exponent 15 is a normal binade
    assert_eq!(ref_decode(0x7b, E5M2), Some(57344.0));
    assert_eq!(ref_decode(0x01, E5M2), Some(2f64.powi(-16)));
    assert_eq!(ref_decode(0x7c, E5M2), Some(f64::INFINITY));
    assert_eq!(ref_decode(0xfc, E5M2), Some(f64::NEG_INFINITY));
    for b in [0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff] {
        assert_eq!(ref_decode(b, E5M2), None);
    }
    assert_eq!(finite_table(E4M3).len(), 127);
    assert_eq!(finite_table(E5M2).len(), 124);
    assert_eq!(dev::E4M3_MAX as f64, finite_table(E4M3).last().unwrap().0);
    assert_eq!(dev::E5M2_MAX as f64, finite_table(E5M2).last().unwrap().0);
}

#[test]
fn every_byte_decodes_exactly() {
    for f in FORMATS {
        for b in 0..=255u8 {
            let want = ref_decode(b, f);
            for (name, dec) in f32_decoders(f) {
                let got = dec(b);
                match want {
                    None => assert_eq!(
                        got.to_bits(),
                        0x7fff_e000,
                        "{} {name}: {b:#04x} is NaN",
                        f.name
                    ),
                    Some(w) => assert_eq!(
                        (got as f64).to_bits(),
                        w.to_bits(),
                        "{} {name}: decode({b:#04x}) = {got:e}, reference {w:e}",
                        f.name
                    ),
                }
            }
        }
    }
}

#[test]
fn every_byte_pair_unpacks_to_f16x2_alike() {
    for f in FORMATS {
        for v in 0..=u16::MAX {
            let [(_, soft_dec), (_, hw_dec), (_, dev_dec), (_, packed_dec)] = f16x2_decoders(f);
            let s = soft_dec(v);
            assert_eq!(s, hw_dec(v), "{} soft vs hw model on {v:#06x}", f.name);
            assert_eq!(s, dev_dec(v), "{} soft vs device on {v:#06x}", f.name);
            assert_eq!(s, packed_dec(v), "{} soft vs packed on {v:#06x}", f.name);
            // Element 0 (low byte) lands in the low half, and each half is the byte's
            // value (exact in f16).
            for (half, byte) in [(s as u16, v as u8), ((s >> 16) as u16, (v >> 8) as u8)] {
                let got = pagedkv_kernels::device::f16_to_f32(half);
                match ref_decode(byte, f) {
                    None => assert_eq!(half, dev::F16_NAN, "{} {v:#06x}", f.name),
                    Some(w) => assert_eq!(
                        (got as f64).to_bits(),
                        w.to_bits(),
                        "{} f16x2 of {v:#06x}",
                        f.name
                    ),
                }
            }
        }
    }
}

#[test]
fn every_non_nan_byte_round_trips() {
    for f in FORMATS {
        let [(_, dec), _] = f32_decoders(f);
        for b in 0..=255u8 {
            let x = dec(b);
            if x.is_nan() {
                continue;
            }
            let want = if x.is_infinite() {
                b - 1 // e5m2 ±inf → ±largest finite (.satfinite)
            } else {
                b
            };
            for (name, enc) in encoders(f) {
                assert_eq!(enc(x), want, "{} {name}: byte {b:#04x} ({x:e})", f.name);
            }
        }
    }
}

#[test]
fn edge_cases_encode_as_specified() {
    let p2 = |k: i32| 2f32.powi(k);
    let next_up = |x: f32| f32::from_bits(x.to_bits() + 1);
    let next_down = |x: f32| f32::from_bits(x.to_bits() - 1);
    // (input, e4m3, e5m2), positive inputs; the negations are checked with the sign bit.
    let cases: &[(f32, u8, u8)] = &[
        (0.0, 0x00, 0x00),
        (f32::from_bits(1), 0x00, 0x00), // smallest f32 subnormal
        (f32::from_bits(0x007f_ffff), 0x00, 0x00), // largest f32 subnormal
        (f32::MIN_POSITIVE, 0x00, 0x00),
        (1.0, 0x38, 0x3c),
        // e4m3 smallest subnormal 2^-9; half of it ties to even (0); just above → 1.
        (p2(-9), 0x01, 0x18),
        (p2(-10), 0x00, 0x14),
        (next_up(p2(-10)), 0x01, 0x14),
        (3.0 * p2(-10), 0x02, 0x1a), // e4m3: tie between codes 1 and 2 → 2
        (p2(-6), 0x08, 0x24),        // e4m3 smallest normal
        // e5m2 smallest subnormal 2^-16; half ties to 0; just above → 1.
        (p2(-16), 0x00, 0x01),
        (p2(-17), 0x00, 0x00),
        (next_up(p2(-17)), 0x00, 0x01),
        (3.0 * p2(-17), 0x00, 0x02),
        (p2(-14), 0x00, 0x04), // e5m2 smallest normal
        // e4m3 largest finite and beyond.
        (448.0, 0x7e, 0x5f),
        (next_up(448.0), 0x7e, 0x5f),
        (464.0, 0x7e, 0x5f), // midpoint 448..480: ties to even 448 (480 would be NaN)
        (next_up(464.0), 0x7e, 0x5f),
        (480.0, 0x7e, 0x60), // e5m2: midpoint 448..512 ties to even 512
        (1e6, 0x7e, 0x7b),
        // e5m2 largest finite and beyond.
        (57344.0, 0x7e, 0x7b),
        (next_up(57344.0), 0x7e, 0x7b),
        (next_down(61440.0), 0x7e, 0x7b),
        (61440.0, 0x7e, 0x7b), // midpoint to 65536 (infinity): saturates
        (65536.0, 0x7e, 0x7b),
        (f32::MAX, 0x7e, 0x7b),
        (f32::INFINITY, 0x7e, 0x7b),
    ];
    for &(x, e4, e5) in cases {
        for (x, sign) in [(x, 0u8), (-x, 0x80)] {
            for (f, want) in [(E4M3, e4 | sign), (E5M2, e5 | sign)] {
                check_encode(x, f, &finite_table(f));
                let got = encoders(f)[0].1(x);
                assert_eq!(got, want, "{} encode({x:e}) = {got:#04x}", f.name);
            }
        }
    }
    // NaN of any sign or payload → 0x7f in both formats.
    for bits in [
        0x7fc0_0000u32,
        0xffc0_0000,
        0x7f80_0001,
        0xff80_0001,
        0x7fff_ffff,
    ] {
        let x = f32::from_bits(bits);
        for f in FORMATS {
            for (name, enc) in encoders(f) {
                assert_eq!(enc(x), 0x7f, "{} {name}: NaN {bits:#010x}", f.name);
            }
        }
    }
}

#[test]
fn midpoints_round_to_even_across_the_range() {
    for f in FORMATS {
        let table = finite_table(f);
        for w in table.windows(2) {
            let ((lo, lo_code), (hi, hi_code)) = (w[0], w[1]);
            // At most man_bits + 2 significant bits: exact in f32.
            let mid = ((lo + hi) / 2.0) as f32;
            assert_eq!(mid as f64, (lo + hi) / 2.0);
            let even = if lo_code % 2 == 0 { lo_code } else { hi_code };
            for sign in [0u8, 0x80] {
                let s = |x: f32| if sign != 0 { -x } else { x };
                let below = f32::from_bits(mid.to_bits() - 1);
                let above = f32::from_bits(mid.to_bits() + 1);
                for (x, want) in [(mid, even), (below, lo_code), (above, hi_code)] {
                    for (name, enc) in encoders(f) {
                        assert_eq!(
                            enc(s(x)),
                            sign | want,
                            "{} {name}: {x:e} between {lo:e} and {hi:e}",
                            f.name
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn f32x2_packs_element_zero_low() {
    let vals = [
        0.0f32,
        -0.0,
        1.0,
        -1.5,
        3.25,
        448.0,
        -1e9,
        1e-3,
        f32::NAN,
        7.0e4,
    ];
    for f in FORMATS {
        let table = finite_table(f);
        for &lo in &vals {
            for &hi in &vals {
                let want = ref_encode(lo, &table) as u16 | (ref_encode(hi, &table) as u16) << 8;
                let (s, d, h) = if f.ieee_specials {
                    (
                        soft::f32x2_to_e5m2x2(lo, hi),
                        dev::f32x2_to_e5m2x2(lo, hi),
                        hw::cvt_rn_satfinite_e5m2x2_f32(hi, lo), // ISA order: d, a=hi, b=lo
                    )
                } else {
                    (
                        soft::f32x2_to_e4m3x2(lo, hi),
                        dev::f32x2_to_e4m3x2(lo, hi),
                        hw::cvt_rn_satfinite_e4m3x2_f32(hi, lo),
                    )
                };
                assert_eq!(s, want, "{} soft ({lo}, {hi})", f.name);
                assert_eq!(d, want, "{} device ({lo}, {hi})", f.name);
                assert_eq!(h, want, "{} hw model ({lo}, {hi})", f.name);
            }
        }
    }
}

/// Every f32 whose top 20 bits vary (sign, exponent, 11 mantissa bits: more than every
/// fp8 rounding boundary), with the low 12 bits at the values that matter for rounding
/// (0, 1, just below / at / above half, all ones) and one arbitrary pattern.
#[test]
fn sweep_of_f32_matches_reference() {
    let lows = [0x000u32, 0x001, 0x7ff, 0x800, 0x801, 0xfff, 0x5a5];
    for f in FORMATS {
        let table = finite_table(f);
        for top in 0..(1u32 << 20) {
            for low in lows {
                check_encode(f32::from_bits(top << 12 | low), f, &table);
            }
        }
    }
}

/// All 2^32 f32 inputs: the software encoder against the hardware model, on every core
/// (slow in debug; run in release with `--ignored`).
#[test]
#[ignore]
fn fp8_every_f32_soft_matches_hardware_model() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
    let chunk = (1u64 << 32).div_ceil(threads);
    std::thread::scope(|s| {
        for t in 0..threads {
            s.spawn(move || {
                let end = ((t + 1) * chunk).min(1 << 32);
                for bits in t * chunk..end {
                    let x = f32::from_bits(bits as u32);
                    let s = soft::f32_to_e4m3(x) as u16 | (soft::f32_to_e5m2(x) as u16) << 8;
                    let h = hw::cvt_rn_satfinite_e4m3x2_f32(0.0, x) & 0xff
                        | (hw::cvt_rn_satfinite_e5m2x2_f32(0.0, x) & 0xff) << 8;
                    assert_eq!(s, h, "{bits:#010x}");
                }
            });
        }
    });
}
