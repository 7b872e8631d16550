//! Compile-time proof that `include/pagedkv.h` matches the Rust definitions (feature
//! `header-check`; build.rs runs bindgen on the header).
//!
//! * `c` holds the header's structs and enums as bindgen sees them: each one's size,
//!   alignment and field offsets, and each status value, must equal the Rust side's.
//! * `f` holds the header's functions, typed with the Rust types of the same names:
//!   [`same`] unifies each with the Rust function, so any difference in a parameter or
//!   return type is a type error.
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    missing_docs,
    clippy::all
)]

mod c {
    include!(concat!(env!("OUT_DIR"), "/c_types.rs"));
}

// The opaque handle is a Rust struct behind a pointer: C never sees its fields.
#[allow(improper_ctypes)]
mod f {
    include!(concat!(env!("OUT_DIR"), "/c_fns.rs"));
}

macro_rules! same_layout {
    ($t:ident { $($field:ident),* $(,)? }) => {
        const _: () = {
            assert!(size_of::<c::$t>() == size_of::<crate::$t>(), concat!("size of ", stringify!($t)));
            assert!(align_of::<c::$t>() == align_of::<crate::$t>(), concat!("align of ", stringify!($t)));
            $(assert!(
                core::mem::offset_of!(c::$t, $field) == core::mem::offset_of!(crate::$t, $field),
                concat!("offset of ", stringify!($t), ".", stringify!($field))
            );)*
        };
    };
}

same_layout!(pagedkv_scheduler_config {
    num_blocks,
    block_size,
    num_host_blocks,
    max_model_len,
    max_num_seqs,
    max_tokens_per_step,
    watermark,
    preempt_by_swap,
    priority_policy,
    enable_prefix_caching,
    sliding_window,
});
same_layout!(pagedkv_request {
    id,
    prompt,
    prompt_len,
    max_tokens,
    stop_token,
    priority,
    has_cache_salt,
    cache_salt,
});
same_layout!(pagedkv_scheduled_seq {
    seq,
    request,
    is_prefill,
    start_pos,
    num_new_tokens,
    context_len,
    token_offset,
    num_draft_tokens,
});
same_layout!(pagedkv_accepted {
    seq,
    num_tokens,
    reserved,
});
same_layout!(pagedkv_group_tables {
    block_tables,
    slot_mapping,
    sliding_window,
    reserved,
});
same_layout!(pagedkv_batch {
    num_seqs,
    seqs,
    max_blocks_per_seq,
    block_size,
    block_tables,
    context_lens,
    num_slots,
    slot_mapping,
    num_copies,
    copies,
    num_swap_out,
    swap_out,
    num_swap_in,
    swap_in,
});
same_layout!(pagedkv_sampled {
    seq,
    token,
    reserved
});
same_layout!(pagedkv_metrics {
    steps,
    blocks_used,
    blocks_free,
    blocks_cached_free,
    reserved,
    kv_utilization,
    running,
    waiting,
    swapped,
    preempted_recompute,
    preempted_swap,
    prefix_queried_tokens,
    prefix_hit_tokens,
});
same_layout!(pagedkv_decode_shape {
    num_seqs,
    num_q_heads,
    num_kv_heads,
    head_dim,
    block_size,
    num_blocks,
    max_blocks_per_seq,
    reserved,
});

same_layout!(pagedkv_kv_scales { k, v, len });
same_layout!(pagedkv_merge_shape {
    num_rows,
    num_states,
    num_heads,
    head_dim,
});

macro_rules! same_values {
    ($($v:ident),* $(,)?) => {
        const _: () = {
            assert!(size_of::<c::pagedkv_status>() == size_of::<crate::pagedkv_status>());
            $(assert!(
                c::pagedkv_status::$v as i64 == crate::pagedkv_status::$v as i64,
                concat!("value of ", stringify!($v))
            );)*
        };
    };
}
const _: () = {
    assert!(c::pagedkv_dtype::PAGEDKV_F16 as i64 == crate::pagedkv_dtype::PAGEDKV_F16 as i64);
    assert!(c::pagedkv_dtype::PAGEDKV_BF16 as i64 == crate::pagedkv_dtype::PAGEDKV_BF16 as i64);
    assert!(c::pagedkv_dtype::PAGEDKV_F32 as i64 == crate::pagedkv_dtype::PAGEDKV_F32 as i64);
    assert!(c::pagedkv_dtype::PAGEDKV_E4M3 as i64 == crate::pagedkv_dtype::PAGEDKV_E4M3 as i64);
    assert!(c::pagedkv_dtype::PAGEDKV_E5M2 as i64 == crate::pagedkv_dtype::PAGEDKV_E5M2 as i64);
};

same_values!(
    PAGEDKV_OK,
    PAGEDKV_ERR_NULL,
    PAGEDKV_ERR_INVALID_ARGUMENT,
    PAGEDKV_ERR_OUT_OF_BLOCKS,
    PAGEDKV_ERR_UNKNOWN_ID,
    PAGEDKV_ERR_INVALID_STATE,
    PAGEDKV_ERR_CUDA,
    PAGEDKV_ERR_PANIC,
);

/// Unifies two function pointers: the header's and the Rust one must have one type.
pub fn same<F>(_: F, _: F) {}

/// Never called: it exists so that it type-checks.
pub fn signatures() {
    use crate as r;
    same::<unsafe extern "C" fn() -> _>(
        f::pagedkv_last_error_message,
        r::pagedkv_last_error_message,
    );
    same::<unsafe extern "C" fn() -> _>(f::pagedkv_version, r::pagedkv_version);
    same::<unsafe extern "C" fn(_) -> _>(
        f::pagedkv_scheduler_config_default,
        r::pagedkv_scheduler_config_default,
    );
    same::<unsafe extern "C" fn(_, _) -> _>(
        f::pagedkv_scheduler_create,
        r::pagedkv_scheduler_create,
    );
    same::<unsafe extern "C" fn(_) -> _>(
        f::pagedkv_scheduler_destroy,
        r::pagedkv_scheduler_destroy,
    );
    same::<unsafe extern "C" fn(_, _, _) -> _>(f::pagedkv_add_request, r::pagedkv_add_request);
    same::<unsafe extern "C" fn(_, _) -> _>(f::pagedkv_abort, r::pagedkv_abort);
    same::<unsafe extern "C" fn(_) -> _>(
        f::pagedkv_reset_prefix_cache,
        r::pagedkv_reset_prefix_cache,
    );
    same::<unsafe extern "C" fn(_, _) -> _>(f::pagedkv_step, r::pagedkv_step);
    same::<unsafe extern "C" fn(_, _, _) -> _>(f::pagedkv_batch_group, r::pagedkv_batch_group);
    same::<unsafe extern "C" fn(_, _, _, _) -> _>(
        f::pagedkv_scheduler_create_groups,
        r::pagedkv_scheduler_create_groups,
    );
    same::<unsafe extern "C" fn(_, _, _, _) -> _>(f::pagedkv_on_step_done, r::pagedkv_on_step_done);
    same::<unsafe extern "C" fn(_, _) -> _>(f::pagedkv_is_idle, r::pagedkv_is_idle);
    same::<unsafe extern "C" fn(_, _) -> _>(f::pagedkv_get_metrics, r::pagedkv_get_metrics);
    same::<unsafe extern "C" fn(_, _, _, _, _) -> _>(f::pagedkv_seq_tokens, r::pagedkv_seq_tokens);
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_reference_decode_attention,
        r::pagedkv_reference_decode_attention,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_reference_kv_append,
        r::pagedkv_reference_kv_append,
    );
    same::<unsafe extern "C" fn(_, _) -> _>(
        f::pagedkv_cuda_backend_create,
        r::pagedkv_cuda_backend_create,
    );
    same::<unsafe extern "C" fn(_) -> _>(
        f::pagedkv_cuda_backend_destroy,
        r::pagedkv_cuda_backend_destroy,
    );
    same::<unsafe extern "C" fn(_) -> _>(f::pagedkv_cuda_synchronize, r::pagedkv_cuda_synchronize);
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_cuda_kv_append,
        r::pagedkv_cuda_kv_append,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_cuda_decode_attention,
        r::pagedkv_cuda_decode_attention,
    );
    same::<unsafe extern "C" fn(_, _, _) -> _>(
        f::pagedkv_cuda_backend_create_on_stream,
        r::pagedkv_cuda_backend_create_on_stream,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_cuda_decode_attention_strided,
        r::pagedkv_cuda_decode_attention_strided,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_cuda_kv_append_fp8,
        r::pagedkv_cuda_kv_append_fp8,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_cuda_decode_attention_fp8,
        r::pagedkv_cuda_decode_attention_fp8,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_kv_scales_calibrate,
        r::pagedkv_kv_scales_calibrate,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_merge_states,
        r::pagedkv_merge_states,
    );
    same::<unsafe extern "C" fn(_, _, _, _, _, _, _, _, _) -> _>(
        f::pagedkv_cuda_merge_states,
        r::pagedkv_cuda_merge_states,
    );
}

#[test]
fn the_header_matches_the_rust_definitions() {
    // Everything above is checked when this module compiles; this test only makes the
    // check visible in the test list.
    let _ = signatures as fn();
}
