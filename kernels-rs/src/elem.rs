//! [`Elem`]: the element types of the cache, the queries and the outputs.
//!
//! Kernels move 16-byte vectors (`[u32; 4]`): 8 elements of a 16-bit type or 4 `f32`.
//! `Elem` unpacks and packs those vectors; arithmetic is always in `f32`. [`KvElem`] is
//! what the cache may store: every `Elem`, and the scaled fp8 types [`E4m3`], [`E5m2`].

use crate::device::fp8::{e4m3x2_to_f16x2, e5m2_to_f32, f32x2_to_e4m3x2, f32x2_to_e5m2x2};
use crate::device::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

/// IEEE half precision, as its bit pattern.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct F16(pub u16);

/// bfloat16, as its bit pattern.
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bf16(pub u16);

/// An element type a kernel reads and writes.
pub trait Elem: Copy + 'static {
    /// Elements per 16-byte vector.
    const PER_V4: u32;
    /// A short name (`"f16"`, `"bf16"`, `"f32"`), used in entry-point names.
    const NAME: &'static str;
    /// Widens one element to `f32` (exact).
    fn to_f32(self) -> f32;
    /// Narrows an `f32`, rounding to nearest even.
    fn from_f32(v: f32) -> Self;
    /// Element `e` (`< PER_V4`) of a 16-byte vector, widened.
    fn unpack(v: &[u32; 4], e: u32) -> f32;
    /// Packs the first `PER_V4` values into a 16-byte vector.
    fn pack(vals: &[f32; 8]) -> [u32; 4];
}

#[inline(always)]
fn half_of(v: &[u32; 4], e: u32) -> u16 {
    (v[(e / 2) as usize] >> (16 * (e % 2))) as u16
}

#[inline(always)]
fn pack_halves(f: impl Fn(f32) -> u16, vals: &[f32; 8]) -> [u32; 4] {
    let mut out = [0u32; 4];
    for (w, o) in out.iter_mut().enumerate() {
        *o = f(vals[2 * w]) as u32 | ((f(vals[2 * w + 1]) as u32) << 16);
    }
    out
}

impl Elem for F16 {
    const PER_V4: u32 = 8;
    const NAME: &'static str = "f16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        F16(f32_to_f16(v))
    }
    #[inline(always)]
    fn unpack(v: &[u32; 4], e: u32) -> f32 {
        f16_to_f32(half_of(v, e))
    }
    #[inline(always)]
    fn pack(vals: &[f32; 8]) -> [u32; 4] {
        pack_halves(f32_to_f16, vals)
    }
}

impl Elem for Bf16 {
    const PER_V4: u32 = 8;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16_to_f32(self.0)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Bf16(f32_to_bf16(v))
    }
    #[inline(always)]
    fn unpack(v: &[u32; 4], e: u32) -> f32 {
        bf16_to_f32(half_of(v, e))
    }
    #[inline(always)]
    fn pack(vals: &[f32; 8]) -> [u32; 4] {
        pack_halves(f32_to_bf16, vals)
    }
}

impl Elem for f32 {
    const PER_V4: u32 = 4;
    const NAME: &'static str = "f32";
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    #[inline(always)]
    fn unpack(v: &[u32; 4], e: u32) -> f32 {
        f32::from_bits(v[e as usize])
    }
    #[inline(always)]
    fn pack(vals: &[f32; 8]) -> [u32; 4] {
        [
            vals[0].to_bits(),
            vals[1].to_bits(),
            vals[2].to_bits(),
            vals[3].to_bits(),
        ]
    }
}

/// OCP fp8 `e4m3` (4 exponent, 3 mantissa bits; finite to ±448, no infinity), as its bit
/// pattern: a KV-cache element type only (see [`KvElem`]).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct E4m3(pub u8);

/// OCP fp8 `e5m2` (5 exponent, 2 mantissa bits; finite to ±57344), as its bit pattern:
/// a KV-cache element type only (see [`KvElem`]).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct E5m2(pub u8);

/// An element type the paged KV cache stores.
///
/// Every [`Elem`] is one, stored as is (the cache has the queries' type). The fp8 types
/// [`E4m3`] and [`E5m2`] are *scaled*: the value a stored byte `b` stands for is
/// `decode(b) * scale[kv_head]`, with one f32 scale per KV head for K and one for V
/// passed with the launch; `kv_append` stores `encode(x / scale)` (round to nearest
/// even, saturating to the format's finite range; see [`crate::device::fp8`]).
/// Kernels move the cache in 16-byte vectors of [`KvElem::PER_V4`] elements: 16 for
/// fp8, so a vector carries twice the tokens of f16.
pub trait KvElem: Copy + 'static {
    /// Elements per 16-byte vector.
    const PER_V4: u32;
    /// A short name (`"f16"`, `"e4m3"`, ...), used in entry-point names.
    const NAME: &'static str;
    /// Whether stored values carry a per-KV-head scale (`x = decode(b) * scale`).
    const SCALED: bool;
    /// Element `e` (`< PER_V4`) of a 16-byte vector, decoded to `f32` (exact, unscaled).
    fn unpack(v: &[u32; 4], e: u32) -> f32;
    /// Packs the first `PER_V4` values (already divided by the scale) into a vector.
    fn pack(vals: &[f32; 16]) -> [u32; 4];
}

impl<T: Elem> KvElem for T {
    const PER_V4: u32 = T::PER_V4;
    const NAME: &'static str = T::NAME;
    const SCALED: bool = false;
    #[inline(always)]
    fn unpack(v: &[u32; 4], e: u32) -> f32 {
        T::unpack(v, e)
    }
    #[inline(always)]
    fn pack(vals: &[f32; 16]) -> [u32; 4] {
        let mut first = [0f32; 8];
        first.copy_from_slice(&vals[..8]);
        T::pack(&first)
    }
}

#[inline(always)]
fn byte_of(v: &[u32; 4], e: u32) -> u8 {
    (v[(e / 4) as usize] >> (8 * (e % 4))) as u8
}

#[inline(always)]
fn pack_bytes(f: impl Fn(f32, f32) -> u16, vals: &[f32; 16]) -> [u32; 4] {
    let mut out = [0u32; 4];
    for (w, o) in out.iter_mut().enumerate() {
        let lo = f(vals[4 * w], vals[4 * w + 1]) as u32;
        let hi = f(vals[4 * w + 2], vals[4 * w + 3]) as u32;
        *o = lo | (hi << 16);
    }
    out
}

impl KvElem for E4m3 {
    const PER_V4: u32 = 16;
    const NAME: &'static str = "e4m3";
    const SCALED: bool = true;
    #[inline(always)]
    fn unpack(v: &[u32; 4], e: u32) -> f32 {
        // Through the pair decode (one packed multiply for two bytes without the
        // hardware conversion, on sm_80), not `e4m3_to_f32`'s f32 multiply a byte:
        // elements `e` and `e ^ 1` decode the same pair, which the compiler shares.
        // Exact either way, NaN included (`F16_NAN` widens to `e4m3_to_f32`'s NaN).
        let pair = (v[(e / 4) as usize] >> (8 * ((e % 4) & !1))) as u16;
        f16_to_f32((e4m3x2_to_f16x2(pair) >> (16 * (e % 2))) as u16)
    }
    #[inline(always)]
    fn pack(vals: &[f32; 16]) -> [u32; 4] {
        pack_bytes(f32x2_to_e4m3x2, vals)
    }
}

impl KvElem for E5m2 {
    const PER_V4: u32 = 16;
    const NAME: &'static str = "e5m2";
    const SCALED: bool = true;
    #[inline(always)]
    fn unpack(v: &[u32; 4], e: u32) -> f32 {
        e5m2_to_f32(byte_of(v, e))
    }
    #[inline(always)]
    fn pack(vals: &[f32; 16]) -> [u32; 4] {
        pack_bytes(f32x2_to_e5m2x2, vals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::fp8::e4m3_to_f32;

    #[test]
    fn e4m3_unpack_through_the_pair_decode_is_the_byte_decode() {
        // Every byte at every position of a 16-byte chunk, its neighbours varied.
        for b in 0..=255u32 {
            for e in 0..16u32 {
                let fill = b.wrapping_mul(0x9e37_79b9) ^ e.wrapping_mul(0x85eb_ca6b);
                let mut v = [fill, !fill, fill.rotate_left(7), fill ^ 0x5a5a_5a5a];
                let (w, sh) = ((e / 4) as usize, 8 * (e % 4));
                v[w] = (v[w] & !(0xff << sh)) | (b << sh);
                assert_eq!(
                    E4m3::unpack(&v, e).to_bits(),
                    e4m3_to_f32(b as u8).to_bits(),
                    "byte {b:#04x} at {e}"
                );
            }
        }
    }
}
