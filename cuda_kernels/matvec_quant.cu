// Quantised matrix-vector products for decode (T = 1..8 token rows): y[t, r] = dot(dequant(W[r]), x[t]) + bias[r].
//
// One warp per MATVEC_ROWS_PER_WARP consecutive output rows, MATVEC_WARPS_PER_CTA warps per CTA. Lane l walks
// the rows' 8-element chunks l, l + 32, l + 64, ...: consecutive lanes read consecutive bytes of a row, so each
// warp-wide load is one contiguous span of the weight stream (the quantity that bounds decode). A chunk is
// dequantised in registers and dotted with all T rows of x at once, so the weight is read once per launch
// whatever T is. x is read through L1/L2 (every warp reads the same x); the 4 rows a warp owns share each x
// load, because at 4-5 bits a weight an unshared fp32 x chunk would be ~7x the bytes of its weight chunk and
// L1, not HBM, would set the pace. Warp-shuffle reductions finish the rows. No full-precision weight exists.
//
// Launch: see cuda_kernels/matvec_quant.py (geometry). ABI: docs/CUDA_KERNELS.md.

#include "gguf_blocks.cuh"  // the block decoders (expanded by cuda_kernels/registry.read_source)

constexpr int MATVEC_WARPS_PER_CTA = 4;
constexpr int MATVEC_ROWS_PER_WARP = 4;  // rows sharing each x load (see the header comment)
constexpr int MATVEC_MAX_T = 8;          // accumulators per row and lane; larger T goes to gemm_<q>
static_assert(MATVEC_ROWS_PER_WARP * MATVEC_MAX_T == 32, "one lane per (row, token) writes the results");

// Requires in % Block::QK == 0, in % 8 == 0 and 1 <= T <= MATVEC_MAX_T.
template <class Block>
__device__ __forceinline__ void matvec(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    constexpr int CHUNKS_PER_BLOCK = Block::QK / 8;
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * MATVEC_WARPS_PER_CTA + (threadIdx.x >> 5)) * MATVEC_ROWS_PER_WARP;
    if (row0 >= out) return;  // the whole warp leaves together, so the shuffles below stay full-warp
    const int n_rows = min(MATVEC_ROWS_PER_WARP, out - row0);
    const size_t row_bytes = (size_t)(in / Block::QK) * Block::BYTES;
    const unsigned char* w_rows = W + row0 * row_bytes;
    const int n_chunks = in / 8;

    float acc[MATVEC_ROWS_PER_WARP][MATVEC_MAX_T];
#pragma unroll
    for (int i = 0; i < MATVEC_ROWS_PER_WARP * MATVEC_MAX_T; ++i) (&acc[0][0])[i] = 0.0f;

    for (int chunk = lane; chunk < n_chunks; chunk += 32) {
        // Decode this chunk of all the warp's rows first: their loads are independent and all in flight at once.
        const int block_offset = (chunk / CHUNKS_PER_BLOCK) * Block::BYTES, sub = chunk % CHUNKS_PER_BLOCK;
        float w[MATVEC_ROWS_PER_WARP][8];
#pragma unroll
        for (int r = 0; r < MATVEC_ROWS_PER_WARP; ++r) {
            if (r < n_rows) {
                Block::decode8(w_rows + r * row_bytes + block_offset, sub, w[r]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) w[r][i] = 0.0f;
            }
        }
#pragma unroll
        for (int t = 0; t < MATVEC_MAX_T; ++t) {
            if (t < T) {
                const float4* xp = (const float4*)(x + (size_t)t * in + 8 * chunk);
                const float4 a = xp[0], b = xp[1];
#pragma unroll
                for (int r = 0; r < MATVEC_ROWS_PER_WARP; ++r)
                    acc[r][t] += w[r][0] * a.x + w[r][1] * a.y + w[r][2] * a.z + w[r][3] * a.w
                               + w[r][4] * b.x + w[r][5] * b.y + w[r][6] * b.z + w[r][7] * b.w;
            }
        }
    }

    // Butterfly reductions leave every sum in every lane; lane r * MATVEC_MAX_T + t keeps (row r, token t),
    // so all of the warp's outputs are stored by one instruction.
    float mine = 0.0f;
#pragma unroll
    for (int r = 0; r < MATVEC_ROWS_PER_WARP; ++r) {
#pragma unroll
        for (int t = 0; t < MATVEC_MAX_T; ++t) {
            if (t < T) {  // warp-uniform, so the shuffles stay full-warp
                float sum = acc[r][t];
#pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
                if (lane == r * MATVEC_MAX_T + t) mine = sum;  // constant indices keep acc[][] in registers
            }
        }
    }
    const int r = lane / MATVEC_MAX_T, t = lane % MATVEC_MAX_T;
    if (r < n_rows && t < T) y[(size_t)t * ld_y + row0 + r] = mine + (bias ? bias[row0 + r] : 0.0f);
}

extern "C" __global__ void matvec_f32(float* y, const unsigned char* W, const float* x, const float* bias,
                                      int T, int out, int in, int ld_y) {
    matvec<BlockF32>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_f16(float* y, const unsigned char* W, const float* x, const float* bias,
                                      int T, int out, int in, int ld_y) {
    matvec<BlockF16>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_bf16(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockBF16>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_q4_0(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockQ4_0>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_q4_1(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockQ4_1>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_q5_0(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockQ5_0>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_q8_0(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockQ8_0>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_q4_k(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockQ4_K>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_q6_k(float* y, const unsigned char* W, const float* x, const float* bias,
                                       int T, int out, int in, int ld_y) {
    matvec<BlockQ6_K>(y, W, x, bias, T, out, in, ld_y);
}
extern "C" __global__ void matvec_mxfp4(float* y, const unsigned char* W, const float* x, const float* bias,
                                        int T, int out, int in, int ld_y) {
    matvec<BlockMXFP4>(y, W, x, bias, T, out, in, ld_y);
}
