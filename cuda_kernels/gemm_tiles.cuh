// The tensor-core tile of the quantised prefill products, shared by gemm_<q> (gemm_quant.cu) and the grouped
// expert gemm moe_gemm_<q> (moe.cu). Include gguf_blocks.cuh first (it has no include guard, so this header
// does not include it). cuda_kernels/registry.read_source expands both includes before NVRTC or the emulator.
//
// Computed as y^T = W . x^T so that the weight is the row-major A operand and x the "col" B operand of
// mma.sync.m16n8k16.row.col.f32.f16.f16.f32, both stored exactly as they sit in memory (rows of k).
// A CTA owns a GEMM_BM x GEMM_BN tile of (output features x token rows); 4 warps in a 2 x 2 grid each own
// 32 x 32 of it (2 m16 x 4 n8 fragments, 32 fp32 accumulators a lane). Per GEMM_BK = 64 step of k every
// thread dequantises four 8-element weight chunks straight from the GGUF blocks into the fp16 shared tile,
// converts eight float4 of x to fp16, and each warp runs 4 x 8 MMAs. Rows past `out` and tokens past the
// tile's rows are zero-filled in the tiles and masked in the epilogue. The token rows are x rows
// `first + n` (gemm_<q>) or `rows[first + n]` (an expert's gathered pairs, moe_gemm_<q>) and the results go to
// a caller's `store(r, n, value)`, so both kernels share the loads, the MMAs and the fragment layout and differ
// only in where rows come from and go to. Needs sm_80+ (mma, f16x2 cvt).

constexpr int GEMM_BM = 64;                // output features per CTA
constexpr int GEMM_BN = 64;                // token rows per CTA
constexpr int GEMM_BK = 64;                // k per shared-memory stage
constexpr int GEMM_THREADS = 128;          // 4 warps, 2 x 2 over the tile
constexpr int GEMM_STRIDE = GEMM_BK + 8;   // fp16 per tile row; the 8-half pad makes the fragment loads of the
                                           // 8 lane groups hit 8 distinct 4-bank sets (no bank conflicts)

__device__ __forceinline__ unsigned pack_f16x2(float low, float high) {
    unsigned packed;  // cvt.rn.f16x2.f32 puts its first source in the upper half
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(high), "f"(low));
    return packed;
}

__device__ __forceinline__ void mma_f16_f32(float* c, const unsigned* a, const unsigned* b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Weight tile [GEMM_BM][GEMM_BK] for k in [k0, k0 + GEMM_BK) of the [out, in] matrix at W: 8 chunks of 8 per
// row, 4 chunks a thread. Fixed trip counts let the compiler issue all of a thread's loads before the first
// decode needs one.
template <class Block>
__device__ __forceinline__ void load_weight_tile(unsigned short (*tile)[GEMM_STRIDE], const unsigned char* W,
                                                 int row0, int k0, int out, int in) {
    constexpr int CHUNKS_PER_ROW = GEMM_BK / 8;
    static_assert(GEMM_BM * CHUNKS_PER_ROW % GEMM_THREADS == 0, "whole chunks per thread");
    const size_t row_bytes = (size_t)(in / Block::QK) * Block::BYTES;
#pragma unroll
    for (int j = 0; j < GEMM_BM * CHUNKS_PER_ROW / GEMM_THREADS; ++j) {
        const int i = threadIdx.x + j * GEMM_THREADS;
        const int r = i / CHUNKS_PER_ROW, k = k0 + 8 * (i % CHUNKS_PER_ROW);
        float w[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (row0 + r < out && k < in)
            Block::decode8(W + (row0 + r) * row_bytes + (k / Block::QK) * Block::BYTES, (k % Block::QK) / 8, w);
        *(uint4*)&tile[r][k - k0] = make_uint4(pack_f16x2(w[0], w[1]), pack_f16x2(w[2], w[3]),
                                               pack_f16x2(w[4], w[5]), pack_f16x2(w[6], w[7]));
    }
}

// Activation tile [GEMM_BN][GEMM_BK]: 16 float4 per token row, 8 a thread; consecutive threads read
// consecutive 16 bytes of a row. Tile row n with first + n < row_end is x row rows[first + n] (rows null:
// first + n); the rest are zeros. Spelled `first + n < row_end` on purpose: `n < row_end - first` (or a row
// callback) costs gemm_q4_k 32 more registers on sm_80/sm_90 (ptxas 12.9).
__device__ __forceinline__ void load_activation_tile(unsigned short (*tile)[GEMM_STRIDE], const float* x,
                                                     const int* rows, int first, int row_end, int k0, int in) {
    constexpr int VEC_PER_ROW = GEMM_BK / 4;
    static_assert(GEMM_BN * VEC_PER_ROW % GEMM_THREADS == 0, "whole float4s per thread");
#pragma unroll
    for (int j = 0; j < GEMM_BN * VEC_PER_ROW / GEMM_THREADS; ++j) {
        const int i = threadIdx.x + j * GEMM_THREADS;
        const int n = i / VEC_PER_ROW, k = k0 + 4 * (i % VEC_PER_ROW);
        float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (first + n < row_end && k < in) {
            const int row = rows ? rows[first + n] : first + n;
            v = *(const float4*)(x + (size_t)row * in + k);
        }
        *(uint2*)&tile[n][k - k0] = make_uint2(pack_f16x2(v.x, v.y), pack_f16x2(v.z, v.w));
    }
}

// acc (this lane's 2 x 4 fragments of 4) = W[row0 .. row0 + GEMM_BM) . (the tile's x rows)^T over all of
// in, x rows first .. min(row_end, first + GEMM_BN) as in load_activation_tile. Every thread of the CTA must
// call it (it synchronises); w_tile and x_tile are the caller's shared tiles.
template <class Block>
__device__ __forceinline__ void gemm_tile_mma(float (&acc)[2][4][4], unsigned short (*w_tile)[GEMM_STRIDE],
                                              unsigned short (*x_tile)[GEMM_STRIDE], const unsigned char* W,
                                              const float* x, const int* rows, int first, int row_end, int row0,
                                              int out, int in) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane >> 2, quad = lane & 3;  // PTX "groupID" and "threadID_in_group"
    const int warp_m = 32 * (warp & 1), warp_n = 32 * (warp >> 1);
#pragma unroll
    for (int i = 0; i < 2 * 4 * 4; ++i) (&acc[0][0][0])[i] = 0.0f;

    for (int k0 = 0; k0 < in; k0 += GEMM_BK) {
        load_weight_tile<Block>(w_tile, W, row0, k0, out, in);
        load_activation_tile(x_tile, x, rows, first, row_end, k0, in);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            // Fragments as in the PTX ISA (m16n8k16, .f16): A reg j holds row group (+8 for j odd) and
            // k 2*quad (+8 for j >= 2); B reg j holds k 2*quad (+8 for j = 1) of column group.
            unsigned a[2][4], b[4][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = warp_m + 16 * mi + group;
                a[mi][0] = *(const unsigned*)&w_tile[r][kk + 2 * quad];
                a[mi][1] = *(const unsigned*)&w_tile[r + 8][kk + 2 * quad];
                a[mi][2] = *(const unsigned*)&w_tile[r][kk + 2 * quad + 8];
                a[mi][3] = *(const unsigned*)&w_tile[r + 8][kk + 2 * quad + 8];
            }
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int n = warp_n + 8 * ni + group;
                b[ni][0] = *(const unsigned*)&x_tile[n][kk + 2 * quad];
                b[ni][1] = *(const unsigned*)&x_tile[n][kk + 2 * quad + 8];
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int ni = 0; ni < 4; ++ni) mma_f16_f32(acc[mi][ni], a[mi], b[ni]);
        }
        __syncthreads();  // the next stage overwrites the tiles
    }
}

// store(r, n, acc + row_bias(r)) for each of this lane's results with feature row r < out and tile row n,
// first + n < row_end (the rows load_activation_tile read); row_bias is read once per row, before that row's
// stores (a store through y may alias it).
// Accumulator c[j] of fragment (mi, ni): feature row warp_m + 16 mi + group (+8 for j >= 2),
// token warp_n + 8 ni + 2 quad (+1 for j odd).
template <class RowBias, class Store>
__device__ __forceinline__ void gemm_tile_store(const float (&acc)[2][4][4], int row0, int first, int row_end,
                                                int out, RowBias row_bias, Store store) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane >> 2, quad = lane & 3;
    const int warp_m = 32 * (warp & 1), warp_n = 32 * (warp >> 1);
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = row0 + warp_m + 16 * mi + group + 8 * half;
            if (r >= out) continue;
            const float b_r = row_bias(r);
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
#pragma unroll
                for (int odd = 0; odd < 2; ++odd) {
                    const int n = warp_n + 8 * ni + 2 * quad + odd;
                    if (first + n < row_end) store(r, n, acc[mi][ni][2 * half + odd] + b_r);
                }
            }
        }
    }
}
