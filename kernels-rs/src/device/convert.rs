//! f16 / bf16 ⇄ f32 conversion, bit-exact with the GPU's `cvt` instructions.
//!
//! On nvptx these are one `cvt` instruction each (`cvt.f32.f16`, `cvt.rn.f16.f32`,
//! `cvt.rn.bf16.f32`; bf16 → f32 is a shift on any target). On the host they are the
//! software equivalents: round to nearest even, overflow to infinity, subnormals kept,
//! NaN stays NaN. The 16-bit values travel as their bit patterns (`u16`).

/// f16 bits → f32 (exact).
#[inline(always)]
pub fn f16_to_f32(h: u16) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        super::nvptx::cvt_f32_f16(h)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        soft_f16_to_f32(h)
    }
}

/// f32 → f16 bits, rounded to nearest even.
#[inline(always)]
pub fn f32_to_f16(f: f32) -> u16 {
    #[cfg(target_arch = "nvptx64")]
    {
        super::nvptx::cvt_rn_f16_f32(f)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        soft_f32_to_f16(f)
    }
}

/// bf16 bits → f32 (exact: bf16 is the top half of an f32).
#[inline(always)]
pub fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 → bf16 bits, rounded to nearest even.
#[inline(always)]
pub fn f32_to_bf16(f: f32) -> u16 {
    #[cfg(target_arch = "nvptx64")]
    {
        super::nvptx::cvt_rn_bf16_f32(f)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        soft_f32_to_bf16(f)
    }
}

#[cfg_attr(target_arch = "nvptx64", allow(dead_code))]
fn soft_f16_to_f32(h: u16) -> f32 {
    let sign = ((h as u32) & 0x8000) << 16;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = match (exp, mant) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: m * 2^-24, exact in f32.
            let v = m as f32 * (1.0 / 16_777_216.0);
            sign | v.to_bits()
        }
        (31, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 112) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

#[cfg_attr(target_arch = "nvptx64", allow(dead_code))]
fn soft_f32_to_f16(f: f32) -> u16 {
    let x = f.to_bits();
    let sign = ((x >> 16) & 0x8000) as u16;
    let exp = ((x >> 23) & 0xff) as i32;
    let mant = x & 0x7f_ffff;
    if exp == 255 {
        // Inf stays inf; NaN stays a (quiet) NaN.
        let nan = if mant != 0 {
            0x200 | (mant >> 13) as u16
        } else {
            0
        };
        return sign | 0x7c00 | nan;
    }
    let e = exp - 127 + 15;
    if e >= 31 {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = mant | 0x80_0000;
        let shift = (14 - e) as u32;
        let kept = m >> shift;
        let rem = m & ((1 << shift) - 1);
        let halfway = 1 << (shift - 1);
        let rounded = if rem > halfway || (rem == halfway && kept & 1 == 1) {
            kept + 1
        } else {
            kept
        };
        return sign | rounded as u16;
    }
    let kept = ((e as u32) << 10) | (mant >> 13);
    let rem = mant & 0x1fff;
    let rounded = if rem > 0x1000 || (rem == 0x1000 && kept & 1 == 1) {
        kept + 1
    } else {
        kept
    };
    sign | rounded as u16
}

#[cfg_attr(target_arch = "nvptx64", allow(dead_code))]
fn soft_f32_to_bf16(f: f32) -> u16 {
    let x = f.to_bits();
    if f.is_nan() {
        return ((x >> 16) | 0x40) as u16;
    }
    let r = x.wrapping_add(0x7fff + ((x >> 16) & 1));
    (r >> 16) as u16
}
