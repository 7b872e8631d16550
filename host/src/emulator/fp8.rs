//! A model of the GPU's FP8 conversion instructions, written from the PTX ISA's
//! description of `cvt` and independently of the device layer's software path.
//!
//! On `sm_89` and newer the kernels convert with the hardware instructions
//! (`cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`, `cvt.rn.f16x2.{e4m3x2,e5m2x2}`); on `sm_80`
//! and on the host, where the emulator runs them, with
//! [`pagedkv_kernels::device::fp8::soft`], an integer bit-manipulation implementation.
//! This module is the other half of the pair: each function here is one instruction,
//! with the ISA's operand order, computed with `f64` arithmetic from the ISA's rules
//! (round to nearest even; `.satfinite`: NaN → NaN, a magnitude above the largest
//! finite value, infinity included, → the largest finite value with the input's
//! sign). `host/tests/emulated/fp8.rs` checks that both agree bit for bit on every input class
//! and with a third, table-based reference.
//!
//! NaN results use the same canonical patterns as the software path (`0x7f` for an fp8
//! NaN, `0x7fff` for an f16 NaN), so the two are comparable bit for bit; the ISA itself
//! promises only that NaN stays NaN.

use pagedkv_kernels::device::f32_to_f16;
use pagedkv_kernels::device::fp8::{F16_NAN, FP8_NAN};

/// One fp8 format's parameters.
#[derive(Clone, Copy)]
struct Format {
    /// Mantissa (fraction) bits.
    m: i32,
    /// Exponent bias.
    bias: i32,
    /// Bits of the largest finite magnitude.
    max_code: u8,
}

const E4M3: Format = Format {
    m: 3,
    bias: 7,
    max_code: 0x7e,
};
const E5M2: Format = Format {
    m: 2,
    bias: 15,
    max_code: 0x7b,
};

/// `2^k` as an `f64` (exact for the exponents used here).
fn pow2(k: i32) -> f64 {
    2f64.powi(k)
}

/// One f32 → fp8 byte, by the ISA's rules, in `f64` arithmetic (every f32 and every
/// scaling by a power of two below is exact in `f64`).
fn encode(x: f32, f: Format) -> u8 {
    if x.is_nan() {
        return FP8_NAN;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let v = (x as f64).abs();
    let min_normal_exp = 1 - f.bias;
    let max_finite = decode_mag(f.max_code, f);
    if v > max_finite {
        return sign | f.max_code; // .satfinite (infinity included)
    }
    let code = if v < pow2(min_normal_exp) {
        // Subnormal range: a multiple of the smallest subnormal, 2^(1-bias-m). A
        // result of 2^m is the smallest normal's code, as it should be.
        (v * pow2(f.m - min_normal_exp)).round_ties_even() as u32
    } else {
        // Normal: v = 2^e * s with s in [1, 2); round s to m fraction bits.
        let e = ((v.to_bits() >> 52) as i32) - 1023;
        let s = (v * pow2(f.m - e)).round_ties_even() as u32; // in [2^m, 2^(m+1)]
        // s = 2^(m+1) (rounded up to the next binade) carries into the exponent.
        (((e + f.bias) as u32) << f.m) + s - (1 << f.m)
    };
    // Rounding up past the largest finite value saturates too.
    sign | code.min(f.max_code as u32) as u8
}

/// The magnitude of fp8 code `c` (sign bit ignored; not a NaN or infinity code).
fn decode_mag(c: u8, f: Format) -> f64 {
    let c = (c & 0x7f) as i32;
    let exp = c >> f.m;
    let frac = c & ((1 << f.m) - 1);
    if exp == 0 {
        frac as f64 * pow2(1 - f.bias - f.m)
    } else {
        (1.0 + frac as f64 * pow2(-f.m)) * pow2(exp - f.bias)
    }
}

/// One fp8 byte → f16 bits. Every value of both formats is exact in f32 and in f16, so
/// this narrows the `f64` value with the device layer's f32 → f16 conversion (itself
/// checked against the `half` crate in `host/tests/emulated/convert.rs`), which cannot round.
fn decode_f16(b: u8, f: Format, is_nan: bool, is_inf: bool) -> u16 {
    let neg = b & 0x80 != 0;
    if is_nan {
        return F16_NAN;
    }
    let v = if is_inf {
        f64::INFINITY
    } else {
        decode_mag(b, f)
    };
    f32_to_f16((if neg { -v } else { v }) as f32)
}

fn e4m3_to_f16(b: u8) -> u16 {
    decode_f16(b, E4M3, b & 0x7f == 0x7f, false)
}

fn e5m2_to_f16(b: u8) -> u16 {
    decode_f16(b, E5M2, b & 0x7f > 0x7c, b & 0x7f == 0x7c)
}

/// `cvt.rn.satfinite.e4m3x2.f32 d, a, b`: `d[15:8] = e4m3(a)`, `d[7:0] = e4m3(b)`.
pub fn cvt_rn_satfinite_e4m3x2_f32(a: f32, b: f32) -> u16 {
    (encode(a, E4M3) as u16) << 8 | encode(b, E4M3) as u16
}

/// `cvt.rn.satfinite.e5m2x2.f32 d, a, b`: `d[15:8] = e5m2(a)`, `d[7:0] = e5m2(b)`.
pub fn cvt_rn_satfinite_e5m2x2_f32(a: f32, b: f32) -> u16 {
    (encode(a, E5M2) as u16) << 8 | encode(b, E5M2) as u16
}

/// `cvt.rn.f16x2.e4m3x2 d, a`: `d[31:16] = f16(a[15:8])`, `d[15:0] = f16(a[7:0])`.
pub fn cvt_rn_f16x2_e4m3x2(a: u16) -> u32 {
    (e4m3_to_f16((a >> 8) as u8) as u32) << 16 | e4m3_to_f16(a as u8) as u32
}

/// `cvt.rn.f16x2.e5m2x2 d, a`: `d[31:16] = f16(a[15:8])`, `d[15:0] = f16(a[7:0])`.
pub fn cvt_rn_f16x2_e5m2x2(a: u16) -> u32 {
    (e5m2_to_f16((a >> 8) as u8) as u32) << 16 | e5m2_to_f16(a as u8) as u32
}
