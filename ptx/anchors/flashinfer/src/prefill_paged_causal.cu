// FlashInfer anchor: FA2-style batch prefill over a paged KV cache, f16 q / f16 KV / f16 out,
// head_dim 128 (QK and VO), MaskMode::kCausal, PosEncodingMode::kNone, fp32 QK accumulation,
// DefaultAttention<false, false, false, false>, CTA_TILE_Q 128.
//
// This is what BatchPrefillWithPagedKVCacheWrapper(backend="fa2") launches for long prompts
// (e.g. 8 x 2048 causal). FlashInfer's JIT (flashinfer/data/csrc/batch_prefill_paged_kernel_inst.jinja,
// rendered by _gen_batch_prefill_primary_module with paged_kv_stride_mode="equal",
// flashinfer/jit/attention/modules.py:1184-1214) instantiates the host dispatcher
// BatchPrefillWithPagedKVCacheDispatched</*SAME_KV_STRIDES=*/true, CTA_TILE_Q, 128, 128, kNone,
// false, MASK_MODE, false, DefaultAttention<use_custom_mask, false, false, false>, PagedParams>
// for CTA_TILE_Q in {16, 64, 128} and each mask mode; this file instantiates only the kernel the
// CTA_TILE_Q=128 dispatcher launches on sm_90 (H100) and sm_80 (A100), so the cubin holds one
// __global__ function.
//
// Template arguments, from flashinfer-python==0.7.4, flashinfer/data/include/flashinfer/:
//   CTA_TILE_Q   = 128: utils.cuh:432-433 (FA2DetermineCtaTileQ: avg packed qo len
//                  2048*4 > 64 and head_dim 128 < 256), called from attention/scheduler.cuh
//                  PrefillSplitQOKVIndptr (step 2), dispatched by DISPATCH_CTA_TILE_Q (utils.cuh:113-141)
//   NUM_MMA_Q    = get_num_mma_q(128) = 2    (prefill.cuh:5223, 131-139)
//   NUM_WARPS_Q  = get_num_warps_q(128) = 4  (prefill.cuh:5224, 116-125)
//   NUM_WARPS_KV = get_num_warps_kv(128) = 4 / get_num_warps_q(128) = 1 (prefill.cuh:5225, 127-129;
//                  note get_num_warps_kv is passed CTA_TILE_Q)
//   NUM_MMA_D_QK = NUM_MMA_D_VO = 128 / 16 = 8 (prefill.cuh:5236-5237)
//   DTypeQKAccum = float (USE_FP16_QK_REDUCTION = false; prefill.cuh:5238-5240)
//   NUM_MMA_KV   = 4: DISPATCH_NUM_MMA_KV(min(max_num_mma_kv_smem, max_num_mma_kv_reg))
//                  (prefill.cuh:5339-5340, utils.cuh:94-111) with
//                  kKVSmemPerMmaKV = (128 + 128) * 16 * 1 * 2 = 8192 (prefill.cuh:5267; no KV sharing,
//                  no repack, no VO split at head_dim 128), kFixedSmem = 128 * 128 * 2 = 32768
//                  (prefill.cuh:5283), num_ctas_per_sm = 2 (prefill.cuh:5308-5309),
//                  max_smem_per_threadblock = min(smem_per_sm / 2, optin) = 116736 on H100
//                  (233472 B/SM), 83968 on A100 (167936 B/SM) (prefill.cuh:5310-5311),
//                  max_num_mma_kv_smem = (116736 - 32768) / 8192 = 10 (H100), 6 (A100) (prefill.cuh:5318),
//                  max_num_mma_kv_reg = 8 / NUM_MMA_Q = 4 (prefill.cuh:5313-5317) -> 4 on both
//   KernelTraits ENABLE_FP4_REPACK = kPrefillLauncherRepacksFp4 = true (prefill.cuh:178, 5345),
//                USE_TOKEN_HEAD_SF = false, FORCE_DISABLE_REPACK = false (default)
//   CTA_TILE_KV  = NUM_MMA_KV * NUM_WARPS_KV * 16 = 64 KV tokens per main-loop iteration (prefill.cuh:389)
//   threads      = 32 * NUM_WARPS_Q * NUM_WARPS_KV = 128, block dim3(32, 4, 1) (prefill.cuh:5234)
//   dynamic smem = sizeof(KTraits::SharedStoragePaged) = 65536 bytes (prefill.cuh:5364-5366)
#include <flashinfer/attention/prefill.cuh>

#include "batch_prefill_config.inc"

namespace flashinfer {
namespace anchor {
using KTraits = KernelTraits<MaskMode::kCausal, /*CTA_TILE_Q=*/128, /*NUM_MMA_Q=*/2, /*NUM_MMA_KV=*/4,
                             /*NUM_MMA_D_QK=*/8, /*NUM_MMA_D_VO=*/8, /*NUM_WARPS_Q=*/4,
                             /*NUM_WARPS_KV=*/1, PosEncodingMode::kNone, DTypeQ, DTypeKV, DTypeO,
                             /*DTypeQKAccum=*/float, IdType, DefaultAttention<false, false, false, false>,
                             kPrefillLauncherRepacksFp4, /*USE_TOKEN_HEAD_SF=*/false>;
static_assert(get_num_mma_q(128) == 2 && get_num_warps_q(128) == 4 && get_num_warps_kv(128) == 1);
static_assert(!KTraits::IsInvalid());
static_assert(KTraits::NUM_THREADS == 128 && KTraits::CTA_TILE_KV == 64);
static_assert(sizeof(KTraits::SharedStoragePaged) == 65536);
}  // namespace anchor

template __global__ void BatchPrefillWithPagedKVCacheKernel</*SAME_KV_STRIDES=*/true, anchor::KTraits,
                                                            PagedParams>(
    const __grid_constant__ PagedParams params);

}  // namespace flashinfer
