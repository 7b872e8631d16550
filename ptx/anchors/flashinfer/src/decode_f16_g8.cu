// FlashInfer anchor: CUDA-core paged decode, f16 q / f16 KV / f16 out, head_dim 128,
// GQA group 8 (32 query heads : 4 KV heads, the shape of FlashInfer's 2024-02-02 blog Fig. 9),
// page size 16 (runtime), PosEncodingMode::kNone,
// DefaultAttention<false, false, false, false> (no custom mask, sliding window, soft-cap, ALiBi).
//
// This is what BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False) launches. FlashInfer's
// JIT (flashinfer/data/csrc/batch_decode_kernel_inst.jinja) instantiates the host dispatcher
// BatchDecodeWithPagedKVCacheDispatched<128, kNone, DefaultAttention<...>, Params>, which picks one
// kernel per GQA group size at run time; this file instantiates only the kernel that dispatcher
// launches for group size 8 on sm_80/sm_90, so the cubin holds exactly one __global__ function.
// The group size is not a module parameter: the config is the same batch_decode_config.f16.inc
// as decode_f16's (one JIT module serves every group size).
//
// Template arguments, from flashinfer-python==0.7.4,
// flashinfer/data/include/flashinfer/attention/decode.cuh (BatchDecodeWithPagedKVCacheDispatched):
//   vec_size          = max(16 / sizeof(DTypeKV), HEAD_DIM / 32) = max(8, 4)     = 8   (decode.cuh:772)
//   bdx               = HEAD_DIM / vec_size = 128 / 8                            = 16  (decode.cuh:774)
//   bdy               = GROUP_SIZE (DISPATCH_GQA_GROUP_SIZE, utils.cuh:158-160) = 8   (decode.cuh:776-777)
//   num_threads       = max(128, bdx * bdy) = max(128, 128)                      = 128 (decode.cuh:778)
//   bdz               = num_threads / (bdx * bdy) = 128 / 128                    = 1   (decode.cuh:779)
//   tile_size_per_bdx = GROUP_SIZE == 1 ? ... : 1                                = 1   (decode.cuh:780)
//   num_stages_smem   = 2 for compute capability >= 8 (DISPATCH_COMPUTE_CAP_DECODE_NUM_STAGES_SMEM,
//                       utils.cuh:333-340, used at decode.cuh:781)                  = 2
//   dynamic smem      = max(2*2*1*8*1*128*2, 1*8*128*4) + max(1*128*8, 2*8*1*4)  = 9216 bytes (decode.cuh:783-787)
//   block             = dim3(bdx, bdy, bdz) = (16, 8, 1); grid = (padded_batch_size, num_kv_heads) (decode.cuh:793-794)
#include <flashinfer/attention/decode.cuh>

#include "batch_decode_config.f16.inc"

namespace flashinfer {
namespace anchor {
constexpr uint32_t kGroupSize = 8;
constexpr uint32_t kVecSize = std::max(16UL / sizeof(DTypeKV), HEAD_DIM_QK / 32UL);  // decode.cuh:772
constexpr uint32_t kBdx = HEAD_DIM_QK / kVecSize;                                    // decode.cuh:774
constexpr uint32_t kBdy = kGroupSize;                                                // decode.cuh:777
constexpr uint32_t kNumThreads = std::max(128U, kBdx * kBdy);                        // decode.cuh:778
constexpr uint32_t kBdz = kNumThreads / (kBdx * kBdy);                               // decode.cuh:779
constexpr uint32_t kTileSizePerBdx = kGroupSize == 1 ? (sizeof(DTypeKV) == 1 ? 2U : 4U) : 1U;  // decode.cuh:780
constexpr uint32_t kNumStagesSmem = 2;  // utils.cuh:334-335 (compute capability >= 8)
constexpr uint32_t kSmemSize =
    std::max(2 * kNumStagesSmem * kTileSizePerBdx * kBdy * kBdz * HEAD_DIM_QK * sizeof(DTypeKV),
             kBdz * kBdy * HEAD_DIM_QK * sizeof(float)) +
    std::max(kTileSizePerBdx * kNumThreads * sizeof(DTypeKV*), 2 * kBdy * kBdz * sizeof(float));  // decode.cuh:783-787
static_assert(kVecSize == 8 && kBdx == 16 && kBdy == 8 && kBdz == 1 && kTileSizePerBdx == 1);
static_assert(kNumThreads == 128 && kSmemSize == 9216);
}  // namespace anchor

template __global__ void BatchDecodeWithPagedKVCacheKernel<
    PosEncodingMode::kNone, /*num_stages_smem=*/2, /*tile_size_per_bdx=*/1, /*vec_size=*/8,
    /*bdx=*/16, /*bdy=*/8, /*bdz=*/1, DefaultAttention<false, false, false, false>, Params>(
    const __grid_constant__ Params params);

}  // namespace flashinfer
