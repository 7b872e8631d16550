//! PTX entry points: one-line wrappers that run a kernel body with the GPU context.
//!
//! Each takes its kernel's `#[repr(C)]` parameter struct by value (one `.param` of the
//! struct's size), so the host launch passes exactly one argument. The names are the
//! kernels' `Kernel::NAME`s (a test in the root crate checks they match the PTX).

use crate::device::{Gpu, Kernel};
use crate::elem::{Bf16, E4m3, E5m2, F16};
use crate::kernels::{
    CopyBlocks, CopyBlocksParams, DecodeParams, DecodeReduce, KvAppend, KvAppendParams,
    MergeParams, MergeStates, PagedDecode, PagedPrefill, PagedPrefillSimt, PrefillParams,
    ReduceParams,
};

/// `copy_blocks(CopyBlocksParams)`, see [`CopyBlocks`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn copy_blocks(p: CopyBlocksParams) {
    CopyBlocks::run(&Gpu, &p)
}

macro_rules! typed_entries {
    ($t:ty, $append:ident, $reduce:ident, $merge:ident) => {
        /// `kv_append` for this element type, see [`KvAppend`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $append(p: KvAppendParams<$t>) {
            KvAppend::<$t>::run(&Gpu, &p)
        }
        /// The split-K reduce for this element type, see [`DecodeReduce`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $reduce(p: ReduceParams<$t>) {
            DecodeReduce::<$t>::run(&Gpu, &p)
        }
        /// The merge of attention states for this element type, see [`MergeStates`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $merge(p: MergeParams<$t>) {
            MergeStates::<$t>::run(&Gpu, &p)
        }
    };
}

typed_entries!(
    F16,
    kv_append_f16,
    paged_decode_reduce_f16,
    merge_states_f16
);
typed_entries!(
    Bf16,
    kv_append_bf16,
    paged_decode_reduce_bf16,
    merge_states_bf16
);
typed_entries!(
    f32,
    kv_append_f32,
    paged_decode_reduce_f32,
    merge_states_f32
);

/// Paged prefill attention, f16, on tensor cores: see [`PagedPrefill`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn paged_prefill_attention_f16(p: PrefillParams<F16>) {
    PagedPrefill::<F16>::run(&Gpu, &p)
}

/// Paged prefill attention, bf16, on tensor cores: see [`PagedPrefill`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn paged_prefill_attention_bf16(p: PrefillParams<Bf16>) {
    PagedPrefill::<Bf16>::run(&Gpu, &p)
}

/// Paged prefill attention, f32, on CUDA cores: see [`PagedPrefillSimt`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn paged_prefill_attention_f32(p: PrefillParams<f32>) {
    PagedPrefillSimt::<f32>::run(&Gpu, &p)
}

macro_rules! fp8_entries {
    ($t:ty, $k:ty, $append:ident, $prefill:ident) => {
        /// `kv_append` into an fp8 cache (quantising with the scales), see [`KvAppend`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $append(p: KvAppendParams<$t, $k>) {
            KvAppend::<$t, $k>::run(&Gpu, &p)
        }
        /// Paged prefill attention over an fp8 cache, on tensor cores: see [`PagedPrefill`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $prefill(p: PrefillParams<$t, $k>) {
            PagedPrefill::<$t, $k>::run(&Gpu, &p)
        }
    };
}

fp8_entries!(
    F16,
    E4m3,
    kv_append_f16_e4m3,
    paged_prefill_attention_f16_e4m3
);
fp8_entries!(
    F16,
    E5m2,
    kv_append_f16_e5m2,
    paged_prefill_attention_f16_e5m2
);
fp8_entries!(
    Bf16,
    E4m3,
    kv_append_bf16_e4m3,
    paged_prefill_attention_bf16_e4m3
);
fp8_entries!(
    Bf16,
    E5m2,
    kv_append_bf16_e5m2,
    paged_prefill_attention_bf16_e5m2
);

/// The decode entry points of one type pair: the runtime geometry (`HEAD_DIM = 0`) and
/// each compile-time head_dim, see [`PagedDecode`] (split-K when `num_partitions > 1`).
macro_rules! decode_entries {
    ($t:ty, $k:ty, $($d:literal => $name:ident,)*) => {$(
        /// Paged decode attention, see [`PagedDecode`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(p: DecodeParams<$t, $k>) {
            PagedDecode::<$t, $k, $d>::run(&Gpu, &p)
        }
    )*};
}
decode_entries!(
    F16,
    F16,
    0 => paged_decode_attention_f16,
    64 => paged_decode_attention_f16_d64,
    128 => paged_decode_attention_f16_d128,
    256 => paged_decode_attention_f16_d256,
);
decode_entries!(
    Bf16,
    Bf16,
    0 => paged_decode_attention_bf16,
    64 => paged_decode_attention_bf16_d64,
    128 => paged_decode_attention_bf16_d128,
    256 => paged_decode_attention_bf16_d256,
);
decode_entries!(
    f32,
    f32,
    0 => paged_decode_attention_f32,
    64 => paged_decode_attention_f32_d64,
    128 => paged_decode_attention_f32_d128,
    256 => paged_decode_attention_f32_d256,
);
decode_entries!(
    F16,
    E4m3,
    0 => paged_decode_attention_f16_e4m3,
    64 => paged_decode_attention_f16_e4m3_d64,
    128 => paged_decode_attention_f16_e4m3_d128,
    256 => paged_decode_attention_f16_e4m3_d256,
);
decode_entries!(
    F16,
    E5m2,
    0 => paged_decode_attention_f16_e5m2,
    64 => paged_decode_attention_f16_e5m2_d64,
    128 => paged_decode_attention_f16_e5m2_d128,
    256 => paged_decode_attention_f16_e5m2_d256,
);
decode_entries!(
    Bf16,
    E4m3,
    0 => paged_decode_attention_bf16_e4m3,
    64 => paged_decode_attention_bf16_e4m3_d64,
    128 => paged_decode_attention_bf16_e4m3_d128,
    256 => paged_decode_attention_bf16_e4m3_d256,
);
decode_entries!(
    Bf16,
    E5m2,
    0 => paged_decode_attention_bf16_e5m2,
    64 => paged_decode_attention_bf16_e5m2_d64,
    128 => paged_decode_attention_bf16_e5m2_d128,
    256 => paged_decode_attention_bf16_e5m2_d256,
);

/// The multi-warp tensor-core prefill entry points of one type pair, one per
/// compile-time head_dim, see [`PagedPrefill`].
macro_rules! prefill_tiled_entries {
    ($t:ty, $k:ty, $($d:literal => $name:ident,)*) => {$(
        /// Paged prefill attention, multi-warp, on tensor cores: see [`PagedPrefill`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(p: PrefillParams<$t, $k>) {
            PagedPrefill::<$t, $k, $d>::run(&Gpu, &p)
        }
    )*};
}
prefill_tiled_entries!(
    F16,
    F16,
    64 => paged_prefill_attention_f16_d64,
    128 => paged_prefill_attention_f16_d128,
);
prefill_tiled_entries!(
    Bf16,
    Bf16,
    64 => paged_prefill_attention_bf16_d64,
    128 => paged_prefill_attention_bf16_d128,
);
prefill_tiled_entries!(
    F16,
    E4m3,
    64 => paged_prefill_attention_f16_e4m3_d64,
    128 => paged_prefill_attention_f16_e4m3_d128,
);
prefill_tiled_entries!(
    F16,
    E5m2,
    64 => paged_prefill_attention_f16_e5m2_d64,
    128 => paged_prefill_attention_f16_e5m2_d128,
);
prefill_tiled_entries!(
    Bf16,
    E4m3,
    64 => paged_prefill_attention_bf16_e4m3_d64,
    128 => paged_prefill_attention_bf16_e4m3_d128,
);
prefill_tiled_entries!(
    Bf16,
    E5m2,
    64 => paged_prefill_attention_bf16_e5m2_d64,
    128 => paged_prefill_attention_bf16_e5m2_d128,
);

/// The one-warp tensor-core prefill with a tree mask (speculative decoding's verify
/// rows as a tree of drafts), one per type pair: see [`PagedPrefill`]'s `TREE`.
macro_rules! prefill_tree_entries {
    ($($t:ty, $k:ty => $name:ident,)*) => {$(
        /// Paged prefill attention with a tree mask, one warp, on tensor cores: see
        /// [`PagedPrefill`].
        #[unsafe(no_mangle)]
        pub unsafe extern "ptx-kernel" fn $name(p: PrefillParams<$t, $k>) {
            PagedPrefill::<$t, $k, 0, true>::run(&Gpu, &p)
        }
    )*};
}
prefill_tree_entries!(
    F16, F16 => paged_prefill_attention_f16_tree,
    Bf16, Bf16 => paged_prefill_attention_bf16_tree,
    F16, E4m3 => paged_prefill_attention_f16_e4m3_tree,
    F16, E5m2 => paged_prefill_attention_f16_e5m2_tree,
    Bf16, E4m3 => paged_prefill_attention_bf16_e4m3_tree,
    Bf16, E5m2 => paged_prefill_attention_bf16_e5m2_tree,
);
