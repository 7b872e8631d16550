//! Argument generators: the values the calls are built from. Each one mostly picks
//! among values that matter (valid sizes, zero, powers of two, the edges of the type),
//! sometimes an arbitrary one, so that most inputs get past the first check and some
//! hit every later one.

use std::ptr::null_mut;

use libfuzzer_sys::arbitrary::{Result, Unstructured};

/// A value from `interesting` or an arbitrary one.
pub(crate) fn pick_u32(u: &mut Unstructured, interesting: &[u32]) -> Result<u32> {
    if u.ratio(1, 4)? {
        u.arbitrary()
    } else {
        Ok(*u.choose(interesting)?)
    }
}

pub(crate) fn pick_u64(u: &mut Unstructured, small: u64) -> Result<u64> {
    Ok(match u.int_in_range(0..=5)? {
        0 => u.arbitrary()?,
        1 => u64::MAX,
        2 => 1 << 32,
        _ => u.int_in_range(0..=small)?,
    })
}

pub(crate) const LAYOUT_U32: &[u32] = &[
    0,
    1,
    2,
    3,
    8,
    16,
    32,
    64,
    128,
    256,
    1 << 20,
    1 << 31,
    u32::MAX,
];

/// An element count for a buffer the library checks against a shape: the one the
/// shape implies when it is small enough, else a small arbitrary one (the buffer is
/// really that long).
pub(crate) fn length(u: &mut Unstructured, implied: Option<u64>, max: u64) -> Result<u64> {
    match implied {
        Some(n) if n <= max && u.ratio(7, 8)? => Ok(n),
        _ => u.int_in_range(0..=max.min(64)),
    }
}

pub(crate) fn product(f: &[u32]) -> Option<u64> {
    f.iter().try_fold(1u64, |a, &x| a.checked_mul(x as u64))
}

/// A buffer pointer: usually the buffer, sometimes null.
pub(crate) fn ptr<T>(u: &mut Unstructured, v: &mut [T]) -> Result<*mut T> {
    Ok(if u.ratio(1, 24)? {
        null_mut()
    } else {
        v.as_mut_ptr()
    })
}

pub(crate) fn floats(u: &mut Unstructured, n: u64) -> Result<Vec<f32>> {
    let seed: u8 = u.arbitrary()?;
    Ok((0..n)
        .map(|i| ((i as u32 ^ seed as u32) % 13) as f32 - 6.0)
        .collect())
}
