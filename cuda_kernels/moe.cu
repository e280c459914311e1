// Mixture-of-experts kernels: top-k routing, the grouped expert matvec (decode) and gemm (prefill), gpt-oss's
// clamped SwiGLU and the weighted combine of each token's k expert outputs. The numpy reference is
// engine/backends/reference/moe.py.
//
//   logits [T, E] --moe_route_f32--> ids [T, k], weights [T, k]
//   moe_plan (or cuda_kernels/moe.plan_groups on the host): the T*k (token, slot) pairs sorted by expert, cut into
//   groups of at most group_rows pairs of one expert (8 for moe_matvec, GEMM_BN = 64 for moe_gemm):
//   pair p -> x row pair_rows[p];  group g = pairs start[g] .. + len[g] - 1
//   x [T, in] --moe_matvec_<q> / moe_gemm_<q>--> y [n_pairs, out]  (row p = W_e . x[pair_rows[p]] + bias[e])
//   where W_e, expert e's [out, in] matrix, is at expert_ptr[e] when the expert cache gives a slot table
//   (engine/backends/cuda/expert_cache/cache.py), else at W + e * out * row_bytes (all experts stacked as in the GGUF)
//   y_down [n_pairs, d] --moe_combine_f32--> out[t] = sum_j weights[t, j] * y_down[pair_of[t * k + j]]
//
// Launch: cuda_kernels/moe.py (geometry). ABI: docs/CUDA_KERNELS.md.

#include "gguf_blocks.cuh"
#include "gemm_tiles.cuh"  // the tile of gemm_<q>, reused by moe_gemm_<q> (after gguf_blocks.cuh)

constexpr int MOE_ROUTE_WARPS = 4;       // rows (tokens) per CTA, one warp each
constexpr int MOE_MAX_PER_LANE = 8;      // E <= 256 experts: each lane holds experts lane, lane + 32, ...
constexpr int MOE_MAX_K = 16;
constexpr int MOE_WARPS_PER_CTA = 4;     // moe_matvec: as matvec_<q>, 4 warps of 4 rows
constexpr int MOE_ROWS_PER_WARP = 4;
constexpr int MOE_GROUP_ROWS = 8;        // moe_matvec: pairs per group, accumulators per row and lane
static_assert(MOE_ROWS_PER_WARP * MOE_GROUP_ROWS == 32, "one lane per (row, pair) writes the results");
#define MOE_NEG_INF (__int_as_float(0xff800000))  // -inf; math.h's INFINITY needs a header

// Per token row: the k largest logits (ties to the lower expert id, as numpy's stable sort), then
// gating 0: softmax over all E, kept for the k (normalize != 0: divided by their sum, qwen3moe);
// gating 1: softmax over the k selected logits only (gpt-oss). Requires E <= 256 and k <= 16, k <= E.
extern "C" __global__ void moe_route_f32(int* ids, float* weights, const float* logits, int T, int E, int k,
                                         int gating, int normalize) {
    const int lane = threadIdx.x & 31;
    const int t = blockIdx.x * MOE_ROUTE_WARPS + (threadIdx.x >> 5);
    if (t >= T) return;  // whole warps leave together
    const float* row = logits + (long long)t * E;
    float v[MOE_MAX_PER_LANE];
    unsigned taken = 0;
#pragma unroll
    for (int i = 0; i < MOE_MAX_PER_LANE; ++i) {
        const int e = lane + 32 * i;
        v[i] = e < E ? row[e] : MOE_NEG_INF;
    }
    float top[MOE_MAX_K];
    int top_id[MOE_MAX_K];
    for (int j = 0; j < k; ++j) {
        float best = MOE_NEG_INF;
        int best_id = 0x7FFFFFFF;
#pragma unroll
        for (int i = 0; i < MOE_MAX_PER_LANE; ++i) {
            const int e = lane + 32 * i;
            if (e < E && !(taken >> i & 1u) && (v[i] > best || (v[i] == best && e < best_id))) {
                best = v[i];
                best_id = e;
            }
        }
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other = __shfl_xor_sync(0xFFFFFFFFu, best, offset);
            const int other_id = __shfl_xor_sync(0xFFFFFFFFu, best_id, offset);
            if (other > best || (other == best && other_id < best_id)) {
                best = other;
                best_id = other_id;
            }
        }
        if ((best_id & 31) == lane) taken |= 1u << (best_id >> 5);  // the owner marks it
        top[j] = best;
        top_id[j] = best_id;
    }
    float denom = 0.0f;
    const float m = top[0];  // the largest logit of the row
    if (gating == 0) {
#pragma unroll
        for (int i = 0; i < MOE_MAX_PER_LANE; ++i)
            if (lane + 32 * i < E) denom += expf(v[i] - m);
        for (int offset = 16; offset > 0; offset >>= 1) denom += __shfl_xor_sync(0xFFFFFFFFu, denom, offset);
    }
    float kept = 0.0f;
    for (int j = 0; j < k; ++j) kept += expf(top[j] - m);
    if (gating != 0 || normalize) denom = kept;  // softmax over the k, or the renormalised top-k (same value)
    if (lane < k) {  // k <= 16 < 32: one lane per slot
        ids[(long long)t * k + lane] = top_id[lane];
        weights[(long long)t * k + lane] = expf(top[lane] - m) / denom;
    }
}

// Expert e's [out, in] matrix: through the expert cache's slot table when there is one, else stacked in W.
__device__ __forceinline__ const unsigned char* expert_weight(const unsigned char* W,
                                                             const unsigned long long* expert_ptr, int expert,
                                                             int out, size_t row_bytes) {
    return expert_ptr ? (const unsigned char*)expert_ptr[expert] : W + (size_t)expert * out * row_bytes;
}

// y[p, r] = dot(dequant(W[e][r]), x[pair_rows[p]]) + bias[e * out + r] for the pairs p of group g (expert
// e = group_expert[g]). W holds the E experts' [out, in] matrices back to back in their GGUF blocks (the
// stacked GGUF tensor as stored), or expert_ptr[e] points at expert e's matrix (a device slot). A null
// pair_rows reads x row p for pair p (the down projection, whose
// input rows are already in pair order). Grid (ceil(out / 16), n_groups); the structure of matvec_<q>, with the
// token rows of x gathered through pair_rows, so an expert's weight is read once for all its pairs.
template <class Block>
__device__ __forceinline__ void moe_matvec(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
                                           const float* x, const float* bias,
                                           const int* group_expert, const int* group_start, const int* group_len,
                                           const int* pair_rows, int out, int in, int ld_y) {
    constexpr int CHUNKS_PER_BLOCK = Block::QK / 8;
    const int g = blockIdx.y, lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * MOE_WARPS_PER_CTA + (threadIdx.x >> 5)) * MOE_ROWS_PER_WARP;
    if (row0 >= out) return;
    const int n_rows = min(MOE_ROWS_PER_WARP, out - row0);
    const int T = group_len[g];
    if (T == 0) return;  // a spare group of moe_plan's fixed-size grid (graph-capturable launches)
    const int expert = group_expert[g], start = group_start[g];
    const size_t row_bytes = (size_t)(in / Block::QK) * Block::BYTES;
    const unsigned char* w_rows = expert_weight(W, expert_ptr, expert, out, row_bytes) + row0 * row_bytes;
    const int n_chunks = in / 8;

    const float* xs[MOE_GROUP_ROWS];
#pragma unroll
    for (int t = 0; t < MOE_GROUP_ROWS; ++t) {  // pair_rows null: x rows are the sorted pairs themselves
        const int p = start + (t < T ? t : 0);
        xs[t] = x + (size_t)(pair_rows ? pair_rows[p] : p) * in;
    }
    float acc[MOE_ROWS_PER_WARP][MOE_GROUP_ROWS];
#pragma unroll
    for (int i = 0; i < MOE_ROWS_PER_WARP * MOE_GROUP_ROWS; ++i) (&acc[0][0])[i] = 0.0f;

    for (int chunk = lane; chunk < n_chunks; chunk += 32) {
        const int block_offset = (chunk / CHUNKS_PER_BLOCK) * Block::BYTES, sub = chunk % CHUNKS_PER_BLOCK;
        float w[MOE_ROWS_PER_WARP][8];
#pragma unroll
        for (int r = 0; r < MOE_ROWS_PER_WARP; ++r) {
            if (r < n_rows) {
                Block::decode8(w_rows + r * row_bytes + block_offset, sub, w[r]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) w[r][i] = 0.0f;
            }
        }
#pragma unroll
        for (int t = 0; t < MOE_GROUP_ROWS; ++t) {
            if (t < T) {
                const float4* xp = (const float4*)(xs[t] + 8 * chunk);
                const float4 a = xp[0], b = xp[1];
#pragma unroll
                for (int r = 0; r < MOE_ROWS_PER_WARP; ++r)
                    acc[r][t] += w[r][0] * a.x + w[r][1] * a.y + w[r][2] * a.z + w[r][3] * a.w
                               + w[r][4] * b.x + w[r][5] * b.y + w[r][6] * b.z + w[r][7] * b.w;
            }
        }
    }
    float mine = 0.0f;
#pragma unroll
    for (int r = 0; r < MOE_ROWS_PER_WARP; ++r) {
#pragma unroll
        for (int t = 0; t < MOE_GROUP_ROWS; ++t) {
            if (t < T) {  // T is the same for the whole CTA, so the shuffles stay full-warp
                float sum = acc[r][t];
#pragma unroll
                for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, offset);
                if (lane == r * MOE_GROUP_ROWS + t) mine = sum;
            }
        }
    }
    const int r = lane / MOE_GROUP_ROWS, t = lane % MOE_GROUP_ROWS;
    if (r < n_rows && t < T)
        y[(size_t)(start + t) * ld_y + row0 + r] = mine + (bias ? bias[(size_t)expert * out + row0 + r] : 0.0f);
}

// The grouped gemm (prefill): for group g (expert e = group_expert[g], pairs start .. start + len - 1 with
// len <= GEMM_BN), y[start + n, r] = W_e[r] . x[pair_rows[start + n]] + bias[e * out + r], on gemm_<q>'s
// tensor-core tile (gemm_tiles.cuh): one CTA per (GEMM_BM output rows, group), so each expert's weight tile is
// read once per group of up to 64 of its pairs instead of once per 8 as in moe_matvec. Grid
// (ceil(out / GEMM_BM), n_groups); a group of length 0 (moe_plan's spare groups) leaves at once.
template <class Block>
__device__ __forceinline__ void moe_gemm(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
                                         const float* x, const float* bias, const int* group_expert,
                                         const int* group_start, const int* group_len, const int* pair_rows,
                                         int out, int in, int ld_y) {
    __shared__ __align__(16) unsigned short w_tile[GEMM_BM][GEMM_STRIDE];
    __shared__ __align__(16) unsigned short x_tile[GEMM_BN][GEMM_STRIDE];
    const int g = blockIdx.y;
    const int n_rows = min(group_len[g], GEMM_BN);
    if (n_rows <= 0) return;  // the whole CTA leaves before any barrier
    const int expert = group_expert[g], start = group_start[g], row0 = blockIdx.x * GEMM_BM;
    const size_t row_bytes = (size_t)(in / Block::QK) * Block::BYTES;
    const unsigned char* W_e = expert_weight(W, expert_ptr, expert, out, row_bytes);
    float acc[2][4][4];
    gemm_tile_mma<Block>(acc, w_tile, x_tile, W_e, x, pair_rows, start, start + n_rows, row0, out, in);
    const float* b_e = bias ? bias + (size_t)expert * out : nullptr;
    gemm_tile_store(acc, row0, start, start + n_rows, out, [&](int r) { return b_e ? b_e[r] : 0.0f; },
                    [&](int r, int n, float value) { y[(size_t)(start + n) * ld_y + r] = value; });
}

// One extern "C" wrapper per type and family, spelled out: cuda_kernels/registry discovers kernels by their
// declarations.
extern "C" __global__ void moe_matvec_f32(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockF32>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_f16(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockF16>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_bf16(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockBF16>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_q4_0(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockQ4_0>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_q4_1(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockQ4_1>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_q5_0(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockQ5_0>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_q8_0(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockQ8_0>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_q4_k(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockQ4_K>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_q6_k(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockQ6_K>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_matvec_mxfp4(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_matvec<BlockMXFP4>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_f32(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockF32>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_f16(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockF16>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_bf16(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockBF16>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_q4_0(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockQ4_0>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_q4_1(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockQ4_1>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_q5_0(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockQ5_0>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_q8_0(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockQ8_0>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_q4_k(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockQ4_K>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_q6_k(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockQ6_K>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}
extern "C" __global__ void moe_gemm_mxfp4(float* y, const unsigned char* W, const unsigned long long* expert_ptr,
        const float* x, const float* bias, const int* group_expert, const int* group_start, const int* group_len,
        const int* pair_rows, int n_groups, int out, int in, int ld_y) {
    moe_gemm<BlockMXFP4>(y, W, expert_ptr, x, bias, group_expert, group_start, group_len, pair_rows, out, in, ld_y);
}

// The host plan (cuda_kernels/moe.plan_groups) on the device, so a decode step needs no copy back of the ids:
// one CTA, thread e owns expert e. It counts its pairs, thread 0 scans the counts (E <= 256: serial is cheap),
// then thread e walks the pairs in order, placing its own at offset[e] + rank (stable: the same order as the
// host's stable argsort) and writing its groups of at most group_rows (MOE_GROUP_ROWS for moe_matvec, GEMM_BN
// for moe_gemm). Groups past the used ones, up to max_groups (what the grouped kernel's grid was sized for),
// get length 0.
extern "C" __global__ void moe_plan(int* pair_rows, int* pair_of, int* group_expert, int* group_start,
                                    int* group_len, const int* ids, int n_pairs, int k, int E, int max_groups,
                                    int group_rows) {
    __shared__ int count[256], offset[256], group_base[257];
    const int e = threadIdx.x;
    if (e < E) {
        int c = 0;
        for (int p = 0; p < n_pairs; ++p) c += ids[p] == e;
        count[e] = c;
    }
    __syncthreads();
    if (e == 0) {
        int pos = 0, groups = 0;
        for (int x = 0; x < E; ++x) {
            offset[x] = pos;
            group_base[x] = groups;
            pos += count[x];
            groups += (count[x] + group_rows - 1) / group_rows;
        }
        group_base[E] = groups;
    }
    __syncthreads();
    if (e < E) {
        int rank = 0;
        for (int p = 0; p < n_pairs; ++p) {
            if (ids[p] != e) continue;
            pair_rows[offset[e] + rank] = p / k;
            pair_of[p] = offset[e] + rank;
            ++rank;
        }
        for (int j = 0; j * group_rows < count[e]; ++j) {
            const int g = group_base[e] + j;
            group_expert[g] = e;
            group_start[g] = offset[e] + j * group_rows;
            group_len[g] = min(group_rows, count[e] - j * group_rows);
        }
    }
    for (int g = group_base[E] + e; g < max_groups; g += blockDim.x) {
        group_expert[g] = 0;
        group_start[g] = 0;
        group_len[g] = 0;
    }
}

// gpt-oss: out = (clamp(u, -7, 7) + 1) * g' * sigmoid(1.702 g'), g' = min(g, 7); gate_up = [g | u] per row.
extern "C" __global__ void gated_swiglu_oai_f32(float* out, const float* gate_up, int T, int F) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * F) return;
    const long long t = i / F, c = i - t * F;
    const float g = fminf(gate_up[t * 2 * F + c], 7.0f);
    const float u = fminf(fmaxf(gate_up[t * 2 * F + F + c], -7.0f), 7.0f);
    out[i] = g / (1.0f + expf(-1.702f * g)) * (u + 1.0f);
}

// out[t, c] = sum_j weights[t * k + j] * y[pair_of[t * k + j], c]: each token's k expert outputs, weighted,
// summed in slot order (one thread per output element, so no atomics and a fixed order).
extern "C" __global__ void moe_combine_f32(float* out, const float* y, const int* pair_of, const float* weights,
                                           int T, int k, int d) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * d) return;
    const long long t = i / d, c = i - t * d;
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) sum += weights[t * k + j] * y[(long long)pair_of[t * k + j] * d + c];
    out[i] = sum;
}
