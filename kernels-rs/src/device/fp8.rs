//! FP8 (`e4m3`, `e5m2`) ⇄ f32 / f16 conversion, for an fp8 KV cache.
//!
//! The two formats (OCP 8-bit floating point, as NVIDIA's `cvt` implements them):
//!
//! | format | sign, exponent, mantissa bits | bias | largest finite | smallest subnormal | specials |
//! |--------|-------------------------------|------|----------------|--------------------|----------|
//! | `e4m3` | 1, 4, 3 | 7  | 448 (`0x7e`)   | 2^-9 (`0x01`)  | NaN `0x7f`/`0xff` only; no infinity |
//! | `e5m2` | 1, 5, 2 | 15 | 57344 (`0x7b`) | 2^-16 (`0x01`) | ±inf `0x7c`/`0xfc`, NaN `0x7d..=0x7f` (and negated) |
//!
//! **Decoding** (byte → f32) is exact. **Encoding** (f32 → byte) is what
//! `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32` does (PTX ISA, `cvt`): round to nearest, ties
//! to even, then `.satfinite`: a NaN input gives NaN, and an input whose magnitude is
//! greater than the format's largest finite value, infinity included, gives that
//! largest finite value with the input's sign. So a finite input never becomes NaN or
//! infinity, and infinity saturates too. f32 subnormals round to ±0 (they are far below
//! half the smallest fp8 subnormal); the sign of zero is kept. (The infinity and NaN
//! cases are also what NVIDIA's `cuda_fp8.hpp` computes in its software fallback for
//! `__NV_SATFINITE`, the mode whose `sm_89`+ path is this instruction.)
//!
//! NaN bit patterns: encoding gives `0x7f` for every NaN input (the canonical NaN of
//! both formats); decoding gives the canonical f16 NaN `0x7fff` (f32 `0x7fff_e000`)
//! for every NaN byte. The PTX ISA guarantees only that a NaN stays a NaN, so the
//! hardware path may return other NaN bits; code must not depend on them.
//!
//! **Packing.** Two values travel in a `u16`, element 0 in the low byte, as they lie in
//! little-endian memory. `cvt.rn.satfinite.e4m3x2.f32 d, a, b` puts `a` in bits 15:8
//! and `b` in bits 7:0 (PTX ISA, `cvt`: "`d[15:8] = convert(a); d[7:0] = convert(b)`"),
//! so [`f32x2_to_e4m3x2`]`(lo, hi)` passes `a = hi, b = lo`. `cvt.rn.f16x2.e4m3x2 d, a`
//! converts bits 7:0 of `a` into bits 15:0 of `d` and bits 15:8 into bits 31:16, so
//! [`e4m3x2_to_f16x2`] keeps element 0 in the low half.
//!
//! **Where each path runs.** On nvptx for `sm_90` and newer (the build's `-C
//! target-cpu=sm_90`, PTX ISA 7.8), or for `sm_89` with the `ptx81` target feature,
//! these are the hardware `cvt` instructions. ptxas 12.9 accepts them for `sm_90` at
//! PTX ISA 7.8 but for `sm_89` only from PTX ISA 8.1 ("cvt with .e4m3x2/.e5m2x2 on
//! sm_89 requires PTX ISA .version 8.1"), and LLVM writes 7.8 for `sm_89` unless told
//! otherwise, hence the gate. Everywhere else (the `sm_80` PTX, and the host, where the
//! emulator runs kernels) they are [`soft`], a bit-exact integer implementation of the
//! same semantics. The emulator also carries
//! an independent model of the instructions (`pagedkv_host::emulator::fp8`); the tests
//! check both against each other and against an f64 reference.

/// The largest finite `e4m3` magnitude, 448 (`0x7e`).
pub const E4M3_MAX: f32 = 448.0;
/// The largest finite `e5m2` magnitude, 57344 (`0x7b`).
pub const E5M2_MAX: f32 = 57344.0;
/// The NaN byte every encoder returns for a NaN input (a NaN in both formats).
pub const FP8_NAN: u8 = 0x7f;
/// The f16 NaN bit pattern the decoders return for a NaN byte (f32 `0x7fff_e000`).
pub const F16_NAN: u16 = 0x7fff;

// The hardware path: `sm_90` and newer, or `sm_89` with PTX ISA 8.1 (ptxas rejects the
// instructions on `sm_89` below 8.1, although the ISA introduced them in 7.8 for
// `sm_90`; the `sm_90` PTX here is 7.8).
#[cfg(not(all(
    target_arch = "nvptx64",
    any(
        target_feature = "sm_90",
        all(target_feature = "sm_89", target_feature = "ptx81")
    )
)))]
use self::soft as imp;
#[cfg(all(
    target_arch = "nvptx64",
    any(
        target_feature = "sm_90",
        all(target_feature = "sm_89", target_feature = "ptx81")
    )
))]
use super::nvptx::fp8 as imp;

/// `e4m3` bits → f32 (exact; NaN bytes give a NaN).
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    imp::e4m3_to_f32(b)
}

/// `e5m2` bits → f32 (exact; NaN bytes give a NaN, `0x7c`/`0xfc` give ±infinity).
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    imp::e5m2_to_f32(b)
}

/// f32 → `e4m3` bits: round to nearest even, saturate to ±448 (infinity included),
/// NaN → [`FP8_NAN`].
#[inline(always)]
pub fn f32_to_e4m3(f: f32) -> u8 {
    imp::f32_to_e4m3(f)
}

/// f32 → `e5m2` bits: round to nearest even, saturate to ±57344 (infinity included),
/// NaN → [`FP8_NAN`].
#[inline(always)]
pub fn f32_to_e5m2(f: f32) -> u8 {
    imp::f32_to_e5m2(f)
}

/// Two f32 → two `e4m3` packed in a `u16`: `lo` in bits 7:0, `hi` in bits 15:8
/// (`cvt.rn.satfinite.e4m3x2.f32 d, hi, lo`). Rounding as [`f32_to_e4m3`].
#[inline(always)]
pub fn f32x2_to_e4m3x2(lo: f32, hi: f32) -> u16 {
    imp::f32x2_to_e4m3x2(lo, hi)
}

/// Two f32 → two `e5m2` packed in a `u16`: `lo` in bits 7:0, `hi` in bits 15:8
/// (`cvt.rn.satfinite.e5m2x2.f32 d, hi, lo`). Rounding as [`f32_to_e5m2`].
#[inline(always)]
pub fn f32x2_to_e5m2x2(lo: f32, hi: f32) -> u16 {
    imp::f32x2_to_e5m2x2(lo, hi)
}

/// Two packed `e4m3` → two packed f16 (exact): bits 7:0 → bits 15:0, bits 15:8 →
/// bits 31:16 (`cvt.rn.f16x2.e4m3x2`). Widen each half with
/// [`f16_to_f32`](super::f16_to_f32). On nvptx without the hardware conversion (the
/// `sm_80` PTX) both bytes are decoded at once ([`packed`]).
#[inline(always)]
pub fn e4m3x2_to_f16x2(v: u16) -> u32 {
    #[cfg(all(
        target_arch = "nvptx64",
        not(any(
            target_feature = "sm_90",
            all(target_feature = "sm_89", target_feature = "ptx81")
        ))
    ))]
    {
        packed::e4m3x2_to_f16x2(v, super::nvptx::mul_rn_f16x2)
    }
    #[cfg(not(all(
        target_arch = "nvptx64",
        not(any(
            target_feature = "sm_90",
            all(target_feature = "sm_89", target_feature = "ptx81")
        ))
    )))]
    {
        imp::e4m3x2_to_f16x2(v)
    }
}

/// Two packed `e5m2` → two packed f16 (exact): bits 7:0 → bits 15:0, bits 15:8 →
/// bits 31:16 (`cvt.rn.f16x2.e5m2x2`). As [`e4m3x2_to_f16x2`], both bytes at once on
/// nvptx without the hardware conversion.
#[inline(always)]
pub fn e5m2x2_to_f16x2(v: u16) -> u32 {
    #[cfg(all(
        target_arch = "nvptx64",
        not(any(
            target_feature = "sm_90",
            all(target_feature = "sm_89", target_feature = "ptx81")
        ))
    ))]
    {
        packed::e5m2x2_to_f16x2(v)
    }
    #[cfg(not(all(
        target_arch = "nvptx64",
        not(any(
            target_feature = "sm_90",
            all(target_feature = "sm_89", target_feature = "ptx81")
        ))
    )))]
    {
        imp::e5m2x2_to_f16x2(v)
    }
}

/// The two-at-a-time software decoders of the `sm_80` PTX: integer operations on both
/// 16-bit halves at once and, for `e4m3`, one `f16x2` multiply (passed in as `mul`:
/// `mul.rn.f16x2` on the GPU; tests pass a software one). Bit-exact with [`soft`]'s
/// pair decoders (NaN bytes give [`F16_NAN`]), checked for all 65536 inputs by this
/// module's tests.
pub mod packed {
    use super::F16_NAN;

    /// Byte 0 of `v` in bits 7:0 and byte 1 in bits 23:16.
    #[inline(always)]
    fn spread(v: u16) -> u32 {
        let v = v as u32;
        (v & 0xff) | ((v & 0xff00) << 8)
    }

    /// `0xffff` in each half whose bit 7 is set in `x`, 0 in the others.
    #[inline(always)]
    fn half_mask(x: u32) -> u32 {
        ((x & 0x0080_0080) >> 7) * 0xffff
    }

    /// See [`super::e4m3x2_to_f16x2`]. The sign and the seven exponent-and-mantissa
    /// bits placed at f16 bits 15 and 13:7 form an f16 of the value times 2^-8 (a
    /// subnormal for `e4m3`'s subnormals); `mul` by 2^8 (`0x5c00`) is exact. A NaN byte
    /// (magnitude `0x7f`) is the only one whose magnitude plus 1 reaches bit 7.
    #[inline(always)]
    pub fn e4m3x2_to_f16x2(v: u16, mul: impl Fn(u32, u32) -> u32) -> u32 {
        let x = spread(v);
        let mag = x & 0x007f_007f;
        let scaled = mul(((x & 0x0080_0080) << 8) | (mag << 7), 0x5c00_5c00);
        let nan = half_mask(mag + 0x0001_0001);
        (scaled & !nan) | ((F16_NAN as u32 * 0x0001_0001) & nan)
    }

    /// See [`super::e5m2x2_to_f16x2`]: each byte is the top byte of its f16; the NaN
    /// bytes (magnitude `0x7d..=0x7f`) are the ones whose magnitude plus 3 reaches
    /// bit 7.
    #[inline(always)]
    pub fn e5m2x2_to_f16x2(v: u16) -> u32 {
        let x = spread(v);
        let nan = half_mask((x & 0x007f_007f) + 0x0003_0003);
        ((x << 8) & !nan) | ((F16_NAN as u32 * 0x0001_0001) & nan)
    }
}

/// The software conversions: integer operations only, bit-exact with the hardware
/// `cvt` semantics described in the [module docs](self). They are what the `sm_80`
/// PTX and the host run; public so tests can check them on any target.
pub mod soft {
    use super::{F16_NAN, FP8_NAN};

    /// An fp8 format's shape: `M` mantissa bits, exponent `BIAS`, and `MAX`, the bits
    /// of the largest finite magnitude.
    trait Format {
        const M: u32;
        const BIAS: i32;
        const MAX: u32;
    }
    struct E4m3;
    impl Format for E4m3 {
        const M: u32 = 3;
        const BIAS: i32 = 7;
        const MAX: u32 = 0x7e;
    }
    struct E5m2;
    impl Format for E5m2 {
        const M: u32 = 2;
        const BIAS: i32 = 15;
        const MAX: u32 = 0x7b;
    }

    /// `kept` plus one if the `shift` bits dropped below it (`rem`) are more than half
    /// of its last place, or exactly half and `kept` is odd: round to nearest even.
    #[inline(always)]
    fn round_even(kept: u32, rem: u32, shift: u32) -> u32 {
        let half = 1u32 << (shift - 1);
        kept + (rem > half || (rem == half && kept & 1 == 1)) as u32
    }

    #[inline(always)]
    fn encode<F: Format>(f: f32) -> u8 {
        let x = f.to_bits();
        let sign = (x >> 24) & 0x80;
        let abs = x & 0x7fff_ffff;
        if abs > 0x7f80_0000 {
            return FP8_NAN;
        }
        if abs == 0x7f80_0000 {
            return (sign | F::MAX) as u8; // .satfinite: ±inf → ±largest finite
        }
        let exp = (abs >> 23) as i32;
        let mant = abs & 0x7f_ffff;
        // The target's biased exponent if the value were normal there.
        let e = exp - 127 + F::BIAS;
        let mag = if e >= 1 {
            let shift = 23 - F::M;
            let kept = ((e as u32) << F::M) | (mant >> shift);
            // A carry out of the mantissa bumps the exponent: still the right code.
            round_even(kept, mant & ((1 << shift) - 1), shift)
        } else if exp == 0 {
            // f32 zero or subnormal: below 2^-126, far under half the smallest fp8
            // subnormal (2^-10 or 2^-17).
            0
        } else {
            // fp8 subnormal (or zero): the significand with its implicit bit, shifted
            // right by the normal shift plus how far below the smallest normal it is.
            let m = mant | 0x80_0000;
            let shift = (23 - F::M) as i32 + 1 - e;
            if shift > 25 {
                0 // below half the smallest subnormal: rounds to zero
            } else {
                let shift = shift as u32;
                round_even(m >> shift, m & ((1 << shift) - 1), shift)
            }
        };
        // .satfinite: a magnitude that rounded past the largest finite value (into
        // e4m3's NaN or e5m2's infinity codes, or beyond) saturates.
        (sign | mag.min(F::MAX)) as u8
    }

    /// f32 → `e4m3` bits, see [`super::f32_to_e4m3`].
    #[inline(always)]
    pub fn f32_to_e4m3(f: f32) -> u8 {
        encode::<E4m3>(f)
    }

    /// f32 → `e5m2` bits, see [`super::f32_to_e5m2`].
    #[inline(always)]
    pub fn f32_to_e5m2(f: f32) -> u8 {
        encode::<E5m2>(f)
    }

    /// See [`super::f32x2_to_e4m3x2`]: `lo` in bits 7:0, `hi` in bits 15:8.
    #[inline(always)]
    pub fn f32x2_to_e4m3x2(lo: f32, hi: f32) -> u16 {
        f32_to_e4m3(lo) as u16 | (f32_to_e4m3(hi) as u16) << 8
    }

    /// See [`super::f32x2_to_e5m2x2`]: `lo` in bits 7:0, `hi` in bits 15:8.
    #[inline(always)]
    pub fn f32x2_to_e5m2x2(lo: f32, hi: f32) -> u16 {
        f32_to_e5m2(lo) as u16 | (f32_to_e5m2(hi) as u16) << 8
    }

    /// `e4m3` bits → f16 bits (exact: every `e4m3` value is an f16 normal).
    /// Branch-free, as [`e4m3_to_f32`] (whose product is exact) followed by an exact
    /// f32 → f16 conversion: the sm_80 decode kernels run it per element, and the
    /// branchy normalisation it replaced compiled to a local-memory jump table there.
    #[inline(always)]
    pub fn e4m3_to_f16(b: u8) -> u16 {
        let mag = (b & 0x7f) as u32;
        let sign = ((b & 0x80) as u16) << 8;
        let x = f32::from_bits(mag << 20) * f32::from_bits(0x7b80_0000);
        let h = sign | crate::device::f32_to_f16(x);
        if mag == 0x7f { F16_NAN } else { h }
    }

    /// `e5m2` bits → f16 bits (exact: `e5m2` is the top byte of an f16).
    #[inline(always)]
    pub fn e5m2_to_f16(b: u8) -> u16 {
        if b & 0x7f > 0x7c {
            return F16_NAN;
        }
        (b as u16) << 8
    }

    /// `e4m3` bits → f32, see [`super::e4m3_to_f32`]. Branch-free: the seven
    /// exponent-and-mantissa bits placed at f32's bits 26:20 form an f32 of value
    /// `x * 2^-120` (a normal for `e4m3` normals, a denormal for its subnormals), and
    /// the multiply by `2^120` is exact.
    #[inline(always)]
    pub fn e4m3_to_f32(b: u8) -> f32 {
        let mag = (b & 0x7f) as u32;
        let sign = ((b & 0x80) as u32) << 24;
        let x = f32::from_bits(sign | (mag << 20)) * f32::from_bits(0x7b80_0000);
        // NaN as the f16 path widens it (F16_NAN's bits, widened), the hardware's.
        if mag == 0x7f {
            f32::from_bits(0x7fff_e000)
        } else {
            x
        }
    }

    /// `e5m2` bits → f32, see [`super::e5m2_to_f32`].
    #[inline(always)]
    pub fn e5m2_to_f32(b: u8) -> f32 {
        crate::device::f16_to_f32(e5m2_to_f16(b))
    }

    /// See [`super::e4m3x2_to_f16x2`].
    #[inline(always)]
    pub fn e4m3x2_to_f16x2(v: u16) -> u32 {
        e4m3_to_f16(v as u8) as u32 | (e4m3_to_f16((v >> 8) as u8) as u32) << 16
    }

    /// See [`super::e5m2x2_to_f16x2`].
    #[inline(always)]
    pub fn e5m2x2_to_f16x2(v: u16) -> u32 {
        e5m2_to_f16(v as u8) as u32 | (e5m2_to_f16((v >> 8) as u8) as u32) << 16
    }
}
