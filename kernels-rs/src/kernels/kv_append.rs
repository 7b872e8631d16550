//! `kv_append`: write the new tokens' K and V into their slots of the paged cache.
//!
//! Grid: `(num_tokens, 1, 1)`; block: [`THREADS`] threads. Thread block `t` copies token
//! `t`'s K and V rows (`num_kv_heads * head_dim` elements each) to slot
//! `slot_mapping[t]`, 16 bytes per thread per step, the K and V loads in flight
//! together. A negative slot is padding: the token is skipped.
//!
//! Bytes moved: `2 * written_tokens * num_kv_heads * head_dim * size_of::<T>()` read and
//! the same written, plus `8 * num_tokens` of slot mapping.

use core::marker::PhantomData;

use crate::device::{Ctx, GlobalSlice, GlobalSliceMut, Kernel};
use crate::elem::{Bf16, Elem, F16};
use crate::layout::PagedLayout;

/// Threads per block.
pub const THREADS: u32 = 128;

/// Parameters of [`KvAppend`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvAppendParams<T> {
    /// `[num_tokens, num_kv_heads, head_dim]`: the new tokens' keys.
    pub key: GlobalSlice<T>,
    /// `[num_tokens, num_kv_heads, head_dim]`: the new tokens' values.
    pub value: GlobalSlice<T>,
    /// `[num_tokens]`: each token's slot (`block * block_size + offset`); negative:
    /// skip. The host guarantees every non-negative slot is `< num_slots` and appears once.
    pub slot_mapping: GlobalSlice<i64>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's key cache.
    pub key_cache: GlobalSliceMut<T>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's value cache.
    pub value_cache: GlobalSliceMut<T>,
    /// The cache's shape.
    pub layout: PagedLayout,
}

/// The `kv_append` kernel for element type `T`.
#[derive(Clone, Copy, Debug)]
pub struct KvAppend<T>(PhantomData<T>);

#[inline(always)]
fn run<T: Elem, C: Ctx>(ctx: &C, p: &KvAppendParams<T>) {
    let token = ctx.block_idx().x as u64;
    let slot = ctx.ld(&p.slot_mapping, token);
    if slot < 0 {
        return;
    }
    let l = &p.layout;
    let chunks = l.head_dim / T::PER_V4;
    let per_token = l.num_kv_heads * chunks;
    let (key_cache, value_cache) = (&p.key_cache, &p.value_cache);
    let mut i = ctx.thread_idx().x;
    while i < per_token {
        let (head, c) = (i / chunks, i % chunks);
        let src = (token * l.num_kv_heads as u64 + head as u64) * l.token_stride()
            + (c * T::PER_V4) as u64;
        let dst = l.slot_offset(slot as u64, head) + (c * T::PER_V4) as u64;
        let k = ctx.ld_nc_v4(&p.key, src);
        let v = ctx.ld_nc_v4(&p.value, src);
        ctx.st_v4(key_cache, dst, k);
        ctx.st_v4(value_cache, dst, v);
        i += ctx.block_dim().x;
    }
}

macro_rules! kv_append_kernel {
    ($t:ty, $name:literal) => {
        impl Kernel for KvAppend<$t> {
            type Params = KvAppendParams<$t>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                run::<$t, C>(ctx, p)
            }
        }
    };
}
kv_append_kernel!(F16, "kv_append_f16");
kv_append_kernel!(Bf16, "kv_append_bf16");
kv_append_kernel!(f32, "kv_append_f32");
