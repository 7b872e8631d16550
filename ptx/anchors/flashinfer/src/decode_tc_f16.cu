// FlashInfer anchor: tensor-core decode, i.e. what BatchDecodeWithPagedKVCacheWrapper(
// use_tensor_cores=True) launches for f16 q / f16 KV / f16 out, head_dim 128, GQA group 4
// (32 query heads : 8 KV heads), page size 16, PosEncodingMode::kNone, no soft-cap/window.
//
// With use_tensor_cores=True and 16-bit q/KV the wrapper takes backend "fa2"
// (flashinfer/decode.py:2795-2811) and runs the FA2 batch prefill module's paged kernel
// (get_batch_prefill_module, flashinfer/decode.py:2837-2851) with MaskMode.NON_CAUSAL for
// one query token per request (flashinfer/decode.py:3726-3730), i.e. MaskMode::kNone. The
// primary FA2 module is built with paged_kv_stride_mode="equal" (SAME_KV_STRIDES=true;
// flashinfer/jit/attention/modules.py:1184-1214, data/csrc/batch_prefill_paged.cuh:160-170).
// FlashInfer's JIT instantiates BatchPrefillWithPagedKVCacheDispatched for CTA_TILE_Q in
// {16, 64, 128}; this file instantiates only the kernel the CTA_TILE_Q=16 dispatcher launches on
// sm_90 (H100) and sm_80 (A100), so the cubin holds one __global__ function.
//
// Template arguments, from flashinfer-python==0.7.4, flashinfer/data/include/flashinfer/:
//   CTA_TILE_Q   = 16: packed qo len = 1 query token * group 4 = 4 (attention/scheduler.cuh
//                  PrefillSplitQOKVIndptr step 1); FA2DetermineCtaTileQ (utils.cuh:411-489) takes
//                  the "avg_packed_qo_len <= 16" branch and returns 16 (utils.cuh:482) because
//                  16*128*2 + (128+128)*16*4*2 = 36864 bytes fits the 227 KiB (H100) /
//                  163 KiB (A100) opt-in limit (utils.cuh:477-481)
//   NUM_MMA_Q    = get_num_mma_q(16) = 1     (prefill.cuh:5223, 131-139)
//   NUM_WARPS_Q  = get_num_warps_q(16) = 1   (prefill.cuh:5224, 116-125)
//   NUM_WARPS_KV = 4 / get_num_warps_q(16) = 4 (prefill.cuh:5225, 127-129)
//   NUM_MMA_D_QK = NUM_MMA_D_VO = 8 (prefill.cuh:5236-5237); DTypeQKAccum = float (5238-5240)
//   NUM_MMA_KV   = 2: kKVSmemPerMmaKV = (128 + 128) * 16 * 4 * 2 = 32768 (prefill.cuh:5267),
//                  kFixedSmem = 16 * 128 * 2 = 4096 (prefill.cuh:5283), num_ctas_per_sm = 2
//                  (prefill.cuh:5308-5309), max_smem_per_threadblock = 116736 (H100) / 83968 (A100)
//                  (prefill.cuh:5310-5311), max_num_mma_kv_smem = (116736 - 4096) / 32768 = 3 (H100),
//                  2 (A100) (prefill.cuh:5318), max_num_mma_kv_reg = 8 / 1 = 8 (prefill.cuh:5313-5317),
//                  DISPATCH_NUM_MMA_KV(3 or 2) -> 2 (prefill.cuh:5339-5340, utils.cuh:94-111)
//   KernelTraits ENABLE_FP4_REPACK = kPrefillLauncherRepacksFp4 = true (prefill.cuh:178, 5345),
//                USE_TOKEN_HEAD_SF = false, FORCE_DISABLE_REPACK = false (default)
//   CTA_TILE_KV  = NUM_MMA_KV * NUM_WARPS_KV * 16 = 128 KV tokens per main-loop iteration (prefill.cuh:389)
//   threads      = 32 * 1 * 4 = 128, block dim3(32, 1, 4) (prefill.cuh:5234)
//   dynamic smem = sizeof(KTraits::SharedStoragePaged) = 69632 bytes (prefill.cuh:5364-5366)
#include <flashinfer/attention/prefill.cuh>

#include "batch_prefill_config.inc"

namespace flashinfer {
namespace anchor {
using KTraits = KernelTraits<MaskMode::kNone, /*CTA_TILE_Q=*/16, /*NUM_MMA_Q=*/1, /*NUM_MMA_KV=*/2,
                             /*NUM_MMA_D_QK=*/8, /*NUM_MMA_D_VO=*/8, /*NUM_WARPS_Q=*/1,
                             /*NUM_WARPS_KV=*/4, PosEncodingMode::kNone, DTypeQ, DTypeKV, DTypeO,
                             /*DTypeQKAccum=*/float, IdType, DefaultAttention<false, false, false, false>,
                             kPrefillLauncherRepacksFp4, /*USE_TOKEN_HEAD_SF=*/false>;
static_assert(get_num_mma_q(16) == 1 && get_num_warps_q(16) == 1 && get_num_warps_kv(16) == 4);
static_assert(!KTraits::IsInvalid());
static_assert(KTraits::NUM_THREADS == 128 && KTraits::CTA_TILE_KV == 128);
static_assert(sizeof(KTraits::SharedStoragePaged) == 69632);
}  // namespace anchor

template __global__ void BatchPrefillWithPagedKVCacheKernel</*SAME_KV_STRIDES=*/true, anchor::KTraits,
                                                            PagedParams>(
    const __grid_constant__ PagedParams params);

}  // namespace flashinfer
