// Quantised matrix products for prefill (large T) on tensor cores: y[t, r] = dot(dequant(W[r]), x[t]) + bias[r].
//
// The tile (loads from the GGUF blocks, fp16 shared tiles, mma.sync, fragment layout) is gemm_tiles.cuh's,
// shared with the grouped expert gemm of moe.cu; here grid y walks consecutive token rows of x.
// Any T and out work; `in` must be a multiple of the block size (and of 8). fp16 inputs: weights and
// activations must stay within +-65504 (GGUF scales are fp16 anyway).
//
// Launch: see cuda_kernels/gemm_quant.py (geometry). ABI: docs/CUDA_KERNELS.md. Needs sm_80+ (mma, f16x2 cvt).

#include "gguf_blocks.cuh"  // the block decoders (expanded by cuda_kernels/registry.read_source)
#include "gemm_tiles.cuh"   // the tensor-core tile (after gguf_blocks.cuh: it has no include guard)

template <class Block>
__device__ __forceinline__ void gemm(float* y, const unsigned char* W, const float* x, const float* bias,
                                     int T, int out, int in, int ld_y) {
    __shared__ __align__(16) unsigned short w_tile[GEMM_BM][GEMM_STRIDE];
    __shared__ __align__(16) unsigned short x_tile[GEMM_BN][GEMM_STRIDE];
    const int row0 = blockIdx.x * GEMM_BM, tok0 = blockIdx.y * GEMM_BN;
    float acc[2][4][4];
    gemm_tile_mma<Block>(acc, w_tile, x_tile, W, x, nullptr, tok0, T, row0, out, in);
    gemm_tile_store(acc, row0, tok0, T, out, [=](int r) { return bias ? bias[r] : 0.0f; },
                    [=](int r, int n, float value) { y[(size_t)(tok0 + n) * ld_y + r] = value; });
}

extern "C" __global__ void gemm_f32(float* y, const unsigned char* W, const float* x, const float* bias,
                                         int T, int out, int in, int ld_y) {
    gemm<BlockF32>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_f16(float* y, const unsigned char* W, const float* x, const float* bias,
                                         int T, int out, int in, int ld_y) {
    gemm<BlockF16>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_bf16(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockBF16>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_q4_0(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockQ4_0>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_q4_1(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockQ4_1>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_q5_0(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockQ5_0>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_q8_0(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockQ8_0>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_q4_k(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockQ4_K>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_q6_k(float* y, const unsigned char* W, const float* x, const float* bias,
                                          int T, int out, int in, int ld_y) {
    gemm<BlockQ6_K>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void gemm_mxfp4(float* y, const unsigned char* W, const float* x, const float* bias,
                                      int T, int out, int in, int ld_y) {
    gemm<BlockMXFP4>(y, W, x, bias, T, out, in, ld_y);
}
