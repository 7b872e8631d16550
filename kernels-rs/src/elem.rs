//! [`Elem`]: the element types of the cache, the queries and the outputs.
//!
//! Kernels move 16-byte vectors (`[u32; 4]`): 8 elements of a 16-bit type or 4 `f32`.
//! `Elem` unpacks and packs those vectors; arithmetic is always in `f32`.

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
