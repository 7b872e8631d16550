//! `kv_append`: write the new tokens' K and V into their slots of one layer's cache.
//!
//! ```
//! use pagedkv_host::{DType, HostTensor, emulator::Emulator};
//! use pagedkv_host::ops::kv_append::{KvAppendInputs, kv_append_emulated};
//! use pagedkv_host::ops::scales::KvScales;
//! use pagedkv_kernels::PagedLayout;
//!
//! let layout = PagedLayout { num_blocks: 4, num_kv_heads: 2, block_size: 8, head_dim: 64 };
//! let pool = [4 * 2 * 8 * 64];
//! let (mut kc, mut vc) = (HostTensor::full(DType::F16, &pool, f64::NAN), HostTensor::full(DType::F16, &pool, f64::NAN));
//! let k = HostTensor::full(DType::F16, &[3, 2, 64], 1.5);
//! let v = HostTensor::full(DType::F16, &[3, 2, 64], -2.0);
//! // Token 1 is padding (slot -1).
//! kv_append_emulated(&Emulator::new(), KvAppendInputs { layout: &layout, key: &k, value: &v,
//!     slot_mapping: &[9, -1, 30], key_cache: &mut kc, value_cache: &mut vc,
//!     scales: None }).unwrap();
//! assert_eq!(kc.get(layout.slot_offset(9, 1) as usize), 1.5);
//! assert!(kc.get(layout.slot_offset(10, 0) as usize).is_nan());
//!
//! // An fp8 cache stores x / scale: 1.5 / 0.25 = 6 and -2 / 0.5 = -4 are exact in e4m3.
//! let (mut kc, mut vc) = (HostTensor::full(DType::E4m3, &pool, f64::NAN), HostTensor::full(DType::E4m3, &pool, f64::NAN));
//! let scales = KvScales::per_tensor(2, 0.25, 0.5);
//! kv_append_emulated(&Emulator::new(), KvAppendInputs { layout: &layout, key: &k, value: &v,
//!     slot_mapping: &[9, -1, 30], key_cache: &mut kc, value_cache: &mut vc,
//!     scales: Some(&scales) }).unwrap();
//! assert_eq!(kc.get(layout.slot_offset(30, 0) as usize), 6.0);
//! assert_eq!(vc.get(layout.slot_offset(30, 0) as usize), -4.0);
//! ```

use std::collections::HashSet;

use pagedkv_kernels::kernels::kv_append::THREADS;
use pagedkv_kernels::{Dim3, PagedLayout};

use super::scales::{KvScales, check_cache_types};
use super::{check_layout, check_tensor};
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};
use crate::reference;
use crate::tensor::{HostTensor, TensorDesc};

/// Most tokens one launch appends (`gridDim.x`).
pub const MAX_TOKENS: usize = i32::MAX as usize;

/// The tensors of one `kv_append` call, by name (for every backend: `T` is its tensor),
/// so K and V, or the two caches, cannot be swapped by position.
#[derive(Debug)]
pub struct KvAppendInputs<'a, T> {
    /// The caches' layout.
    pub layout: &'a PagedLayout,
    /// `[num_tokens, num_kv_heads, head_dim]`: the new tokens' keys.
    pub key: &'a T,
    /// `[num_tokens, num_kv_heads, head_dim]`: the new tokens' values.
    pub value: &'a T,
    /// `[num_tokens]`: each token's slot (`block * block_size + offset`; negative: skip).
    pub slot_mapping: &'a [i64],
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: written at the slots.
    pub key_cache: &'a mut T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: written at the slots.
    pub value_cache: &'a mut T,
    /// The per-KV-head scales of an fp8 cache (required for one, refused otherwise):
    /// K is stored as `encode(x / scales.k[h])`, V likewise.
    pub scales: Option<&'a KvScales>,
}

/// Checks every argument of a `kv_append` launch.
///
/// `key`, `value`: `[num_tokens, num_kv_heads, head_dim]`; `slot_mapping`: `[num_tokens]`
/// (negative: skip); caches: `[num_blocks, num_kv_heads, block_size, head_dim]`, of
/// the keys' dtype, or fp8 with `scales` (see [`check_cache_types`]). Every non-negative
/// slot must be inside the pool and appear once.
pub fn validate<T: TensorDesc>(io: &KvAppendInputs<'_, T>) -> Result<()> {
    let KvAppendInputs {
        layout,
        key,
        value,
        slot_mapping,
        ref key_cache,
        ref value_cache,
        scales,
    } = *io;
    let (key_cache, value_cache): (&T, &T) = (key_cache, value_cache);
    check_layout(layout)?;
    let n = slot_mapping.len();
    if n > MAX_TOKENS {
        return Err(Error::invalid(
            "slot_mapping",
            format!("{n} tokens (at most {MAX_TOKENS})"),
        ));
    }
    let dtype = key_cache.dtype();
    let pool = super::checked_pool_elems(layout)?;
    check_tensor("key_cache", key_cache, dtype, pool)?;
    check_tensor("value_cache", value_cache, dtype, pool)?;
    let row = layout.num_kv_heads as u64 * layout.head_dim as u64;
    check_cache_types(key.dtype(), dtype, scales, layout.num_kv_heads)?;
    check_tensor("key", key, key.dtype(), n as u64 * row)?;
    check_tensor("value", value, key.dtype(), n as u64 * row)?;
    validate_slots(layout, slot_mapping)
}

/// Checks a slot mapping against a pool: every non-negative slot inside it, none twice.
pub fn validate_slots(layout: &PagedLayout, slot_mapping: &[i64]) -> Result<()> {
    let mut seen = HashSet::with_capacity(slot_mapping.len());
    for (i, &slot) in slot_mapping.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        if slot as u64 >= layout.num_slots() {
            return Err(Error::invalid(
                "slot_mapping",
                format!(
                    "token {i}: slot {slot} is outside the pool of {} slots",
                    layout.num_slots()
                ),
            ));
        }
        if !seen.insert(slot) {
            return Err(Error::invalid(
                "slot_mapping",
                format!("token {i}: slot {slot} is written twice"),
            ));
        }
    }
    Ok(())
}

/// The launch configuration: one thread block per token.
pub fn launch_config(num_tokens: usize) -> LaunchConfig {
    LaunchConfig {
        grid: Dim3::new(num_tokens as u32, 1, 1),
        block: Dim3::new(THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// The reference path: validation, then [`reference::kv_append`].
pub fn kv_append_reference(io: KvAppendInputs<'_, HostTensor>) -> Result<()> {
    validate(&io)?;
    let KvAppendInputs {
        layout,
        key,
        value,
        slot_mapping,
        key_cache,
        value_cache,
        scales,
    } = io;
    reference::kv_append(
        layout,
        (key, value),
        slot_mapping,
        (key_cache, value_cache),
        scales,
    );
    Ok(())
}

/// Runs the real `kv_append` kernel body in the emulator: a one-shot use of the step
/// path ([`StepRunner::kv_append`](crate::step::StepRunner::kv_append) on an
/// [`EmuDevice`](crate::step::EmuDevice)), so this is the launch engines run.
pub fn kv_append_emulated(emu: &Emulator, io: KvAppendInputs<'_, HostTensor>) -> Result<()> {
    crate::step::once::kv_append(crate::step::EmuDevice::new(emu.clone()), io)
}
