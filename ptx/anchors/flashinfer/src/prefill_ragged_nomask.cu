// FlashInfer anchor: FA2-style batch prefill over a ragged (contiguous) KV, f16 q / f16 KV / f16 out,
// head_dim 128 (QK and VO), MaskMode::kNone (non-causal), PosEncodingMode::kNone, fp32 QK accumulation,
// DefaultAttention<false, false, false, false>, CTA_TILE_Q 128.
//
// This is what BatchPrefillWithRaggedKVCacheWrapper(backend="fa2") launches for long prompts with causal=False.
// FlashInfer's JIT (flashinfer/data/csrc/batch_prefill_ragged_kernel_inst.jinja, part of the
// primary "full" FA2 module, flashinfer/jit/attention/modules.py:1184-1214 and 2147-2153)
// instantiates BatchPrefillWithRaggedKVCacheDispatched<CTA_TILE_Q, 128, 128, kNone, false,
// MASK_MODE, false, DefaultAttention<use_custom_mask, false, false, false>, RaggedParams> for
// CTA_TILE_Q in {16, 64, 128}; this file instantiates only the kernel the CTA_TILE_Q=128 dispatcher
// launches on sm_90 (H100) and sm_80 (A100).
//
// Template arguments, from flashinfer-python==0.7.4, flashinfer/data/include/flashinfer/
// (the ragged dispatcher mirrors the paged one; line numbers are the ragged dispatcher's):
//   CTA_TILE_Q   = 128: utils.cuh:432-433 (FA2DetermineCtaTileQ: packed qo len > 64, head_dim < 256)
//   NUM_MMA_Q    = get_num_mma_q(128) = 2    (prefill.cuh:4985, 131-139)
//   NUM_WARPS_Q  = get_num_warps_q(128) = 4  (prefill.cuh:4986, 116-125)
//   NUM_WARPS_KV = 4 / get_num_warps_q(128) = 1 (prefill.cuh:4987, 127-129)
//   NUM_MMA_D_QK = NUM_MMA_D_VO = 8 (prefill.cuh:4997-4998); DTypeQKAccum = float (prefill.cuh:4999-5001)
//   NUM_MMA_KV   = 4: kKVSmemPerMmaKV = 8192 (prefill.cuh:5028), kFixedSmem = 32768 (prefill.cuh:5044),
//                  num_ctas_per_sm = 2 (prefill.cuh:5069-5070), max_smem_per_threadblock = 116736 (H100) /
//                  83968 (A100) (prefill.cuh:5077-5078), max_num_mma_kv_smem = 10 (H100) / 6 (A100)
//                  (prefill.cuh:5085), max_num_mma_kv_reg = 8 / 2 = 4 (prefill.cuh:5080-5084),
//                  DISPATCH_NUM_MMA_KV(4) -> 4 (prefill.cuh:5106-5107, utils.cuh:94-111)
//   KernelTraits ENABLE_FP4_REPACK = kPrefillLauncherRepacksFp4 = true (prefill.cuh:178, 5112)
//   CTA_TILE_KV  = 4 * 1 * 16 = 64 KV tokens per main-loop iteration (prefill.cuh:389)
//   threads      = 128, block dim3(32, 4, 1) (prefill.cuh:4996)
//   dynamic smem = sizeof(KTraits::SharedStorage) = 65536 bytes (USE_SOFTMAX_VO_SPLIT is false;
//                  prefill.cuh:5124-5137)
#include <flashinfer/attention/prefill.cuh>

#include "batch_prefill_config.inc"

namespace flashinfer {
namespace anchor {
using KTraits = KernelTraits<MaskMode::kNone, /*CTA_TILE_Q=*/128, /*NUM_MMA_Q=*/2, /*NUM_MMA_KV=*/4,
                             /*NUM_MMA_D_QK=*/8, /*NUM_MMA_D_VO=*/8, /*NUM_WARPS_Q=*/4,
                             /*NUM_WARPS_KV=*/1, PosEncodingMode::kNone, DTypeQ, DTypeKV, DTypeO,
                             /*DTypeQKAccum=*/float, IdType, DefaultAttention<false, false, false, false>,
                             kPrefillLauncherRepacksFp4, /*USE_TOKEN_HEAD_SF=*/false>;
static_assert(!KTraits::IsInvalid() && !KTraits::USE_FP8_MMA && !KTraits::USE_SOFTMAX_VO_SPLIT);
static_assert(KTraits::NUM_THREADS == 128 && KTraits::CTA_TILE_KV == 64);
static_assert(sizeof(KTraits::SharedStorage) == 65536);
}  // namespace anchor

template __global__ void BatchPrefillWithRaggedKVCacheKernel<anchor::KTraits, RaggedParams>(
    const __grid_constant__ RaggedParams params);

}  // namespace flashinfer
