//! `kv_append`: write the new tokens' K and V into their slots of the paged cache.
//!
//! Grid: `(num_tokens, 1, 1)`; block: [`THREADS`] threads. Thread block `t` copies token
//! `t`'s K and V rows (`num_kv_heads * head_dim` elements each) to slot
//! `slot_mapping[t]`, 16 bytes per thread per step, the K and V loads in flight
//! together. A negative slot is padding: the token is skipped.
//!
//! With an fp8 cache (`K` = [`E4m3`] or [`E5m2`]) each thread reads 16 elements of K
//! and of V (two 16-byte vectors of f16 / bf16 each, all four loads in flight), divides
//! them by their KV head's scale and stores one 16-byte vector of 16 fp8 values per
//! cache (round to nearest even, saturating: a finite input never becomes NaN).
//!
//! Bytes moved: `2 * written_tokens * num_kv_heads * head_dim * size_of::<T>()` read and
//! `2 * written_tokens * num_kv_heads * head_dim * size_of::<K>()` written, plus `8 *
//! num_tokens` of slot mapping (and `8 * num_kv_heads` of scales for fp8).

use core::marker::PhantomData;

use crate::device::{Ctx, GlobalRange, GlobalSlice, GlobalSliceMut, Kernel, KernelParams};
use crate::elem::{Bf16, E4m3, E5m2, Elem, F16, KvElem};
use crate::kernels::each16;
use crate::layout::PagedLayout;

/// Threads per block.
pub const THREADS: u32 = 128;

/// Parameters of [`KvAppend`]: new tokens of element type `T` into a cache of `K`
/// (`T` itself, or fp8 with scales).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvAppendParams<T, K = T> {
    /// `[num_tokens, num_kv_heads, head_dim]`: the new tokens' keys.
    pub key: GlobalSlice<T>,
    /// `[num_tokens, num_kv_heads, head_dim]`: the new tokens' values.
    pub value: GlobalSlice<T>,
    /// `[num_tokens]`: each token's slot (`block * block_size + offset`); negative:
    /// skip. The host guarantees every non-negative slot is `< num_slots` and appears once.
    pub slot_mapping: GlobalSlice<i64>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's key cache.
    pub key_cache: GlobalSliceMut<K>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: this layer's value cache.
    pub value_cache: GlobalSliceMut<K>,
    /// `[num_kv_heads]`: K scale of each KV head (`K::SCALED` only; else empty).
    pub k_scales: GlobalSlice<f32>,
    /// `[num_kv_heads]`: V scale of each KV head (`K::SCALED` only; else empty).
    pub v_scales: GlobalSlice<f32>,
    /// The cache's shape.
    pub layout: PagedLayout,
}

// SAFETY: 7 views and the 16-byte layout: 128 bytes, no padding (asserted below).
const _: () = assert!(core::mem::size_of::<KvAppendParams<f32>>() == 7 * 16 + 16);
unsafe impl<T: 'static, K: 'static> KernelParams for KvAppendParams<T, K>
where
    Self: Copy,
{
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(self.key.range("key"));
        f(self.value.range("value"));
        f(self.slot_mapping.range("slot_mapping"));
        f(self.key_cache.range("key_cache"));
        f(self.value_cache.range("value_cache"));
        f(self.k_scales.range("k_scales"));
        f(self.v_scales.range("v_scales"));
    }
}

/// The `kv_append` kernel for new tokens of type `T` into a cache of `K`.
#[derive(Clone, Copy, Debug)]
pub struct KvAppend<T, K = T>(PhantomData<(T, K)>);

/// One cache vector's worth (`K::PER_V4` elements) of a new token's row, starting at
/// element `src`, divided by `scale` and packed as `K`. All the loads are issued
/// before any value is used.
#[inline(always)]
fn quantised<T: Elem, K: KvElem, C: Ctx>(
    ctx: &C,
    s: &GlobalSlice<T>,
    src: u64,
    scale: f32,
) -> [u32; 4] {
    // `T` is 16-bit here (fp8 caches take f16 / bf16): two vectors.
    let lo = ctx.ld_nc_v4(s, src);
    let hi = ctx.ld_nc_v4(s, src + T::PER_V4 as u64);
    let mut vals = [0f32; 16];
    each16(|i| {
        let x = if i < T::PER_V4 {
            T::unpack(&lo, i)
        } else {
            T::unpack(&hi, i - T::PER_V4)
        };
        vals[i as usize] = x / scale;
    });
    K::pack(&vals)
}

#[inline(always)]
fn run<T: Elem, K: KvElem, C: Ctx>(ctx: &C, p: &KvAppendParams<T, K>) {
    let token = ctx.block_idx().x as u64;
    let slot = ctx.ld(&p.slot_mapping, token);
    if slot < 0 {
        return;
    }
    let l = &p.layout;
    let chunks = l.head_dim / K::PER_V4;
    let per_token = l.num_kv_heads * chunks;
    let (key_cache, value_cache) = (&p.key_cache, &p.value_cache);
    let mut i = ctx.thread_idx().x;
    while i < per_token {
        let (head, c) = (i / chunks, i % chunks);
        let src = (token * l.num_kv_heads as u64 + head as u64) * l.token_stride()
            + (c * K::PER_V4) as u64;
        let dst = l.slot_offset(slot as u64, head) + (c * K::PER_V4) as u64;
        let (k, v) = if K::SCALED {
            let ks = ctx.ld(&p.k_scales, head as u64);
            let vs = ctx.ld(&p.v_scales, head as u64);
            (
                quantised::<T, K, C>(ctx, &p.key, src, ks),
                quantised::<T, K, C>(ctx, &p.value, src, vs),
            )
        } else {
            // `K` is `T`: a plain copy.
            (ctx.ld_nc_v4(&p.key, src), ctx.ld_nc_v4(&p.value, src))
        };
        ctx.st_v4(key_cache, dst, k);
        ctx.st_v4(value_cache, dst, v);
        i += ctx.block_dim().x;
    }
}

macro_rules! kv_append_kernel {
    ($t:ty, $k:ty, $name:literal) => {
        impl Kernel for KvAppend<$t, $k> {
            type Params = KvAppendParams<$t, $k>;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
                run::<$t, $k, C>(ctx, p)
            }
        }
    };
}
kv_append_kernel!(F16, F16, "kv_append_f16");
kv_append_kernel!(Bf16, Bf16, "kv_append_bf16");
kv_append_kernel!(f32, f32, "kv_append_f32");
kv_append_kernel!(F16, E4m3, "kv_append_f16_e4m3");
kv_append_kernel!(F16, E5m2, "kv_append_f16_e5m2");
kv_append_kernel!(Bf16, E4m3, "kv_append_bf16_e4m3");
kv_append_kernel!(Bf16, E5m2, "kv_append_bf16_e5m2");
