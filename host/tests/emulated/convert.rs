//! The device layer's host-side f16/bf16 conversions are bit-exact with IEEE rounding
//! (checked against the `half` crate), so emulated kernels round like the GPU's `cvt`.

use half::{bf16, f16};
use pagedkv_kernels::device::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use proptest::prelude::*;

#[test]
fn every_f16_widens_exactly() {
    for h in 0..=u16::MAX {
        let want = f16::from_bits(h).to_f32();
        let got = f16_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
        }
    }
}

#[test]
fn every_bf16_widens_exactly() {
    for b in 0..=u16::MAX {
        let want = bf16::from_bits(b).to_f32();
        let got = bf16_to_f32(b);
        if want.is_nan() {
            assert!(got.is_nan(), "{b:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{b:#06x}");
        }
    }
}

fn check_narrowing(x: f32) {
    let h = f32_to_f16(x);
    let b = f32_to_bf16(x);
    if x.is_nan() {
        assert!(
            f16::from_bits(h).is_nan() && bf16::from_bits(b).is_nan(),
            "{x}"
        );
    } else {
        assert_eq!(
            h,
            f16::from_f32(x).to_bits(),
            "f16 of {x:e} ({:#010x})",
            x.to_bits()
        );
        assert_eq!(
            b,
            bf16::from_f32(x).to_bits(),
            "bf16 of {x:e} ({:#010x})",
            x.to_bits()
        );
    }
}

#[test]
fn narrowing_edge_cases_round_to_nearest_even() {
    let edges = [
        0.0f32,
        -0.0,
        1.0,
        65504.0,
        65519.99,
        65520.0,
        1e-8,
        2.98e-8,
        5.96e-8,
        6.1e-5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::MAX,
        f32::MIN_POSITIVE,
        1.0 + f32::EPSILON,
        f32::from_bits(0x3f80_1000), // exactly halfway between two f16 values
        f32::from_bits(0x3f80_3000),
        f32::from_bits(0x3f80_8000), // halfway between two bf16 values, even below
        f32::from_bits(0x3f81_8000), // halfway, odd below: rounds up
        f32::from_bits(0x3380_0000), // 2^-24: smallest f16 subnormal
        f32::from_bits(0x3300_0000), // 2^-25: ties to zero
        f32::from_bits(0x3300_0001),
    ];
    for x in edges {
        check_narrowing(x);
        check_narrowing(-x);
    }
}

proptest! {
    #[test]
    fn narrowing_matches_ieee_on_random_bits(bits in any::<u32>()) {
        check_narrowing(f32::from_bits(bits));
    }
}
