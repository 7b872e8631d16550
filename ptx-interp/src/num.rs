//! Numerics, written from the PTX ISA and IEEE 754 (not from the emulator): the
//! 16-bit and 8-bit float conversions, the approximate instructions' error model, and
//! the m8n8 / m16n8k16 fragment layouts.
//!
//! Every conversion to a narrower format goes through one routine, [`round_to`]: the
//! value is scaled by a power of two (exact in `f64`) and rounded once to an integer
//! with ties to even, so there is no double rounding.

/// A binary floating-point format: exponent and mantissa bits, and what happens above
/// its largest finite value.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Format {
    exp_bits: u32,
    man_bits: u32,
    /// The largest finite value's bits (sign clear).
    max_bits: u32,
    /// Bits of +infinity, if the format has one.
    inf_bits: Option<u32>,
    /// Bits of the NaN a conversion produces.
    nan_bits: u32,
}

/// IEEE binary16.
pub(crate) const F16: Format = Format {
    exp_bits: 5,
    man_bits: 10,
    max_bits: 0x7BFF,
    inf_bits: Some(0x7C00),
    nan_bits: 0x7FFF,
};
/// bfloat16.
pub(crate) const BF16: Format = Format {
    exp_bits: 8,
    man_bits: 7,
    max_bits: 0x7F7F,
    inf_bits: Some(0x7F80),
    nan_bits: 0x7FFF,
};
/// FP8 E4M3 (OCP "FN": no infinity, one NaN mantissa, max 448).
pub(crate) const E4M3: Format = Format {
    exp_bits: 4,
    man_bits: 3,
    max_bits: 0x7E,
    inf_bits: None,
    nan_bits: 0x7F,
};
/// FP8 E5M2 (IEEE-like: infinities, max 57344).
pub(crate) const E5M2: Format = Format {
    exp_bits: 5,
    man_bits: 2,
    max_bits: 0x7B,
    inf_bits: Some(0x7C),
    nan_bits: 0x7F,
};

impl Format {
    fn bias(self) -> i32 {
        (1 << (self.exp_bits - 1)) - 1
    }
    fn sign_bit(self) -> u32 {
        1 << (self.exp_bits + self.man_bits)
    }

    /// The value of `bits` (NaN for the format's NaN patterns).
    pub(crate) fn decode(self, bits: u32) -> f64 {
        let sign = if bits & self.sign_bit() != 0 {
            -1.0
        } else {
            1.0
        };
        let mag = bits & (self.sign_bit() - 1);
        let e = (mag >> self.man_bits) as i32;
        let m = (mag & ((1 << self.man_bits) - 1)) as f64;
        let emax = (1 << self.exp_bits) - 1;
        let scale = pow2;
        if self.inf_bits.is_none() {
            // E4M3: the all-ones exponent is finite except its all-ones mantissa.
            if mag == self.nan_bits {
                return f64::NAN;
            }
        } else if e == emax {
            return if m == 0.0 {
                sign * f64::INFINITY
            } else {
                f64::NAN
            };
        }
        if e == 0 {
            sign * m * scale(1 - self.bias() - self.man_bits as i32)
        } else {
            sign * (1.0 + m / scale(self.man_bits as i32)) * scale(e - self.bias())
        }
    }

    /// `x` rounded to nearest even; above the largest finite value: infinity, or with
    /// `satfinite` (or a format without infinity) the largest finite value. NaN: the
    /// format's NaN.
    pub(crate) fn round_to(self, x: f64, satfinite: bool) -> u32 {
        if x.is_nan() {
            return self.nan_bits;
        }
        let sign = if x.is_sign_negative() {
            self.sign_bit()
        } else {
            0
        };
        let a = x.abs();
        let over = || {
            sign | match self.inf_bits {
                Some(inf) if !satfinite => inf,
                _ => self.max_bits,
            }
        };
        if a.is_infinite() {
            return over();
        }
        if a == 0.0 {
            return sign;
        }
        let (man, bias) = (self.man_bits as i32, self.bias());
        // The exponent of `a` (a normal f64 here: inputs come from f32).
        let e = ((a.to_bits() >> 52) & 0x7FF) as i32 - 1023;
        let min_e = 1 - bias;
        let bits = if e < min_e {
            // Subnormal in the target: units of 2^(min_e - man).

            (a * pow2(man - min_e)).round_ties_even() as u32 // q == 2^man is the smallest normal, which these bits also encode
        } else {
            let mut q = (a * pow2(man - e)).round_ties_even() as u32;
            let mut e = e;
            if q == 1 << (man + 1) {
                q >>= 1;
                e += 1;
            }
            let field = (e + bias) as u32;
            if field >= 1 << self.exp_bits {
                return over();
            }
            (field << man) | (q - (1 << man))
        };
        if bits > self.max_bits {
            return over();
        }
        sign | bits
    }
}

/// `cvt.f32.f16`: exact.
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    F16.decode(h as u32) as f32
}

/// `cvt.rn.f16.f32`.
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    F16.round_to(x as f64, false) as u16
}

/// `mul.rn.f16x2 d, a, b` (PTX ISA, mul (half precision)): per 16-bit half, the
/// product of the f16 values rounded to nearest even, subnormals kept (no `.ftz`).
/// The f64 product of two f16s is exact, so this rounds once.
pub(crate) fn mul_f16x2(a: u32, b: u32) -> u32 {
    let half =
        |x: u32, y: u32| F16.round_to(F16.decode(x & 0xFFFF) * F16.decode(y & 0xFFFF), false);
    half(a, b) | half(a >> 16, b >> 16) << 16
}

/// `cvt.rn.bf16.f32`.
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    BF16.round_to(x as f64, false) as u16
}

/// bf16 to f32: exact (only the tests use it; kernels shift).
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    BF16.decode(h as u32) as f32
}

/// `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 d, a, b`: `a` in the upper byte.
pub(crate) fn f32x2_to_fp8x2(fmt: Format, a: f32, b: f32) -> u16 {
    let hi = fmt.round_to(a as f64, true) as u16;
    let lo = fmt.round_to(b as f64, true) as u16;
    hi << 8 | lo
}

/// `cvt.rn.f16x2.{e4m3x2,e5m2x2} d, a`: each byte of `a` to an f16 (exact: every FP8
/// value is an f16), the upper byte to the upper half.
pub(crate) fn fp8x2_to_f16x2(fmt: Format, a: u16) -> u32 {
    let one = |b: u16| F16.round_to(fmt.decode(b as u32), false);
    one(a & 0xFF) | one(a >> 8) << 16
}

/// Flushes an `f32` subnormal to a zero of the same sign (`.ftz`).
pub(crate) fn ftz(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

/// The ISA's documented maximum relative error of `ex2.approx.f32` (2^-22, full
/// range; PTX ISA, "ex2").
pub const EX2_MAX_REL_ERR: f64 = 1.0 / (1u64 << 22) as f64;
/// The documented maximum relative error of `tanh.approx.f32` (2^-10.987; PTX ISA,
/// "tanh").
pub const TANH_MAX_REL_ERR: f64 = 4.9e-4;

/// The largest absolute error of `lg2.approx.f32` the approximate mode allows: 2^-22
/// (PTX ISA, "lg2": 2^-22.6 over the mantissa, as we read it; the model takes the
/// larger).
pub const LG2_MAX_ABS_ERR: f64 = 1.0 / (1u64 << 22) as f64;

/// The approximate mode's relative perturbation of `ex2`: the ISA's bound less the
/// final rounding to f32 (2^-24), so a perturbed result is within the bound of the
/// exact value.
pub(crate) const EX2_PERTURBATION: f64 = EX2_MAX_REL_ERR - 1.0 / (1u64 << 24) as f64;
/// As [`EX2_PERTURBATION`], for `tanh`.
pub(crate) const TANH_PERTURBATION: f64 = TANH_MAX_REL_ERR - 1.0 / (1u64 << 24) as f64;

/// A deterministic value in [-1, 1) from the input's bits, the instruction and the
/// launch seed: the approximate mode's perturbation is a function of what the
/// instruction computes, not of the order threads run in.
pub(crate) fn unit_noise(seed: u64, line: u32, x: f32) -> f64 {
    let mut z = seed ^ (line as u64) << 32 ^ x.to_bits() as u64;
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 33)).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    z = (z ^ (z >> 33)).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    z ^= z >> 33;
    (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
}

/// The elements of an m16n8k16 `mma` fragment: for lane `lane` and fragment register
/// `j`, the (row, column) of its low and high 16-bit halves (A: 16×16 row-major,
/// B: 16×8 "col", i.e. element (k, n)); for the f32 C/D fragment, the (row, column)
/// of element `j`. PTX ISA, "Matrix Fragments for mma.m16n8k16".
pub(crate) fn frag_a(lane: usize, j: usize, half: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (j % 2), 2 * t + 8 * (j / 2) + half)
}

/// See [`frag_a`]: B's (k, n).
pub(crate) fn frag_b(lane: usize, j: usize, half: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (2 * t + 8 * j + half, g)
}

/// See [`frag_a`]: C and D's (row, column).
pub(crate) fn frag_c(lane: usize, j: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + 8 * (j / 2), 2 * t + (j % 2))
}

/// `2^k` exactly, for `k` in f64's normal range (every exponent the formats here
/// need: they come from f16, bf16, fp8 and f32 values). Built from the bits: `powi`
/// is a libm call, and the interpreter converts an element this way per lane.
#[inline]
fn pow2(k: i32) -> f64 {
    debug_assert!((-1022..=1023).contains(&k));
    f64::from_bits(((k + 1023) as u64) << 52)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pow2_is_powi_over_the_normal_range() {
        for k in -1022..=1023 {
            assert_eq!(pow2(k), 2f64.powi(k), "2^{k}");
        }
    }

    #[test]
    fn f16_round_trip_and_rounding() {
        assert_eq!(f32_to_f16(1.0), 0x3C00);
        assert_eq!(f32_to_f16(-2.0), 0xC000);
        assert_eq!(f32_to_f16(65504.0), 0x7BFF);
        // Half way between 65504 and 65536 rounds to even: infinity.
        assert_eq!(f32_to_f16(65520.0), 0x7C00);
        assert_eq!(f32_to_f16(65519.0), 0x7BFF);
        // 1 + 2^-11 is a tie: to even (1.0); 1 + 3 * 2^-11 rounds up to 1 + 2^-9.
        assert_eq!(f32_to_f16(1.0 + 2f32.powi(-11)), 0x3C00);
        assert_eq!(f32_to_f16(1.0 + 3.0 * 2f32.powi(-11)), 0x3C02);
        // Smallest subnormal, and half of it (a tie to even: zero).
        assert_eq!(f32_to_f16(2f32.powi(-24)), 0x0001);
        assert_eq!(f32_to_f16(2f32.powi(-25)), 0x0000);
        assert_eq!(f32_to_f16(3.0 * 2f32.powi(-25)), 0x0002);
        assert_eq!(f32_to_f16(f32::NAN), 0x7FFF);
        assert_eq!(f32_to_f16(f32::NEG_INFINITY), 0xFC00);
        assert_eq!(f32_to_f16(-0.0), 0x8000);
        for h in [0x0001u16, 0x03FF, 0x0400, 0x3555, 0x7BFF, 0x8001, 0xFBFF] {
            assert_eq!(f32_to_f16(f16_to_f32(h)), h, "{h:#x}");
        }
        assert_eq!(f16_to_f32(0x7C00), f32::INFINITY);
        assert!(f16_to_f32(0x7E00).is_nan());
    }

    #[test]
    fn bf16_rounding() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // 1 + 2^-8 is a tie: to even.
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80);
        assert_eq!(f32_to_bf16(1.0 + 3.0 * 2f32.powi(-8)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80);
        // f32 subnormals: bf16 keeps the top bits; half its smallest is a tie to even.
        assert_eq!(f32_to_bf16(f32::from_bits(0x0001_0000)), 0x0001);
        assert_eq!(f32_to_bf16(f32::from_bits(0x0000_8000)), 0x0000);
        assert_eq!(f32_to_bf16(f32::from_bits(0x0001_8000)), 0x0002);
        assert_eq!(f32_to_bf16(f32::NAN), 0x7FFF);
        assert_eq!(bf16_to_f32(0xC0A0), -5.0);
    }

    #[test]
    fn e4m3_satfinite() {
        let e = |x: f32| E4M3.round_to(x as f64, true);
        assert_eq!(e(1.0), 0x38);
        assert_eq!(e(448.0), 0x7E);
        assert_eq!(e(464.0), 0x7E); // would round to 480, past the max: saturates
        assert_eq!(e(1e9), 0x7E);
        assert_eq!(e(f32::INFINITY), 0x7E);
        assert_eq!(e(-f32::INFINITY), 0xFE);
        assert_eq!(e(f32::NAN), 0x7F);
        assert_eq!(e(2f32.powi(-9)), 0x01); // smallest subnormal
        assert_eq!(e(2f32.powi(-10)), 0x00); // tie to even
        assert_eq!(e(0.875 * 2f32.powi(-6)), 0x07); // largest subnormal
        assert_eq!(e(-1.125), 0xB9);
        assert_eq!(E4M3.decode(0x7E), 448.0);
        assert!(E4M3.decode(0xFF).is_nan());
        assert_eq!(E4M3.decode(0x01), 2f64.powi(-9));
    }

    #[test]
    fn e5m2_satfinite_and_pairs() {
        let e = |x: f32| E5M2.round_to(x as f64, true);
        assert_eq!(e(57344.0), 0x7B);
        assert_eq!(e(f32::INFINITY), 0x7B);
        assert_eq!(e(1.0), 0x3C);
        assert_eq!(e(2f32.powi(-16)), 0x01);
        assert_eq!(E5M2.decode(0x7C), f64::INFINITY);
        // a to the upper byte, b to the lower.
        assert_eq!(f32x2_to_fp8x2(E4M3, 1.0, -2.0), 0x38C0);
        assert_eq!(fp8x2_to_f16x2(E4M3, 0x38C0), 0x3C00 << 16 | 0xC000);
        assert_eq!(fp8x2_to_f16x2(E5M2, 0x3CC0), 0x3C00 << 16 | 0xC000);
        assert_eq!(fp8x2_to_f16x2(E4M3, 0x7F01) >> 16, 0x7FFF);
        assert_eq!(fp8x2_to_f16x2(E4M3, 0x7F01) & 0xFFFF, 0x1800); // 2^-9, normal in f16
    }

    #[test]
    fn fragments_cover_each_matrix_once() {
        let mut a = [[0u8; 16]; 16];
        let mut b = [[0u8; 8]; 16];
        let mut c = [[0u8; 8]; 16];
        for lane in 0..32 {
            for j in 0..4 {
                for h in 0..2 {
                    let (r, k) = frag_a(lane, j, h);
                    a[r][k] += 1;
                }
                let (r, n) = frag_c(lane, j);
                c[r][n] += 1;
            }
            for j in 0..2 {
                for h in 0..2 {
                    let (k, n) = frag_b(lane, j, h);
                    b[k][n] += 1;
                }
            }
        }
        assert!(a.iter().flatten().all(|&x| x == 1));
        assert!(b.iter().flatten().all(|&x| x == 1));
        assert!(c.iter().flatten().all(|&x| x == 1));
        // Spot values from the ISA's figures: lane 5 (group 1, thread 1).
        assert_eq!(frag_a(5, 3, 1), (9, 11));
        assert_eq!(frag_b(5, 1, 0), (10, 1));
        assert_eq!(frag_c(5, 2), (9, 2));
    }

    #[test]
    fn ftz_and_noise() {
        assert_eq!(ftz(f32::from_bits(1)).to_bits(), 0);
        assert_eq!(ftz(-f32::from_bits(1)).to_bits(), 0x8000_0000);
        assert_eq!(ftz(1.5), 1.5);
        let n: Vec<f64> = (0..1000).map(|i| unit_noise(7, 3, i as f32)).collect();
        assert!(n.iter().all(|x| (-1.0..1.0).contains(x)));
        assert!(n.iter().any(|&x| x > 0.9) && n.iter().any(|&x| x < -0.9));
    }
}
