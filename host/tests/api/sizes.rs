//! Sizes computed from user input never wrap: a layout or a shape too large to address
//! is an error naming the argument, before anything is allocated or read.

use pagedkv_host::ops::{check_layout, checked_pool_elems, kv_append};
use pagedkv_host::{DType, Error, HostTensor};
use pagedkv_kernels::PagedLayout;

/// 2^31 blocks x 2^20 heads x 32 tokens x 256 elements = 2^64 elements: `pool_elems`
/// wraps to 0, which once validated against 0-element caches.
const WRAPPING: PagedLayout = PagedLayout {
    num_blocks: 1 << 31,
    num_kv_heads: 1 << 20,
    block_size: 32,
    head_dim: 256,
};

fn names(e: Error, arg: &str) {
    match e {
        Error::InvalidArgument { arg: a, .. } => assert_eq!(a, arg, "{e}"),
        other => panic!("expected InvalidArgument({arg}), got {other}"),
    }
}

#[test]
fn a_layout_whose_pool_wraps_is_refused() {
    let exact = [32u128, 256, 1 << 20, 1 << 31].iter().product::<u128>();
    assert_eq!(exact, 1 << 64, "the premise: the u64 product wraps to 0");
    names(check_layout(&WRAPPING).unwrap_err(), "num_blocks");
    names(checked_pool_elems(&WRAPPING).unwrap_err(), "num_blocks");
    // Fits u64 but not an allocation (2^61 elements x 4 bytes > isize::MAX).
    let huge = PagedLayout {
        num_blocks: 1 << 31,
        num_kv_heads: 1 << 17,
        ..WRAPPING
    };
    names(check_layout(&huge).unwrap_err(), "num_blocks");
    let ok = PagedLayout {
        num_blocks: 1000,
        num_kv_heads: 8,
        block_size: 16,
        head_dim: 128,
    };
    assert_eq!(checked_pool_elems(&ok).unwrap(), 1000 * 8 * 16 * 128);
}

#[test]
fn kv_append_with_a_wrapping_layout_is_an_error_not_a_panic() {
    let empty = HostTensor::full(DType::F16, &[0], 0.0);
    let (mut kc, mut vc) = (empty.clone(), empty.clone());
    let e = kv_append::validate(&kv_append::KvAppendInputs {
        layout: &WRAPPING,
        key: &empty,
        value: &empty,
        slot_mapping: &[],
        key_cache: &mut kc,
        value_cache: &mut vc,
        scales: None,
    })
    .unwrap_err();
    names(e, "num_blocks");
}

#[test]
fn tensor_shapes_whose_size_overflows_are_errors() {
    let big = [usize::MAX / 2, 3];
    names(
        HostTensor::try_full(DType::F32, &big, 0.0).unwrap_err(),
        "shape",
    );
    names(
        HostTensor::from_f64(DType::F16, &big, &[]).unwrap_err(),
        "shape",
    );
    names(
        HostTensor::from_bytes(DType::F16, &big, &[]).unwrap_err(),
        "shape",
    );
    // Elements fit usize, bytes do not.
    names(
        HostTensor::try_full(DType::F32, &[usize::MAX / 4 + 1], 0.0).unwrap_err(),
        "shape",
    );
    let t = HostTensor::try_full(DType::Bf16, &[3, 5], 1.0).unwrap();
    assert_eq!(t.len(), 15);
}
