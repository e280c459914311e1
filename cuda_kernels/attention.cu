// Paged causal attention over the KV pool, for prefill chunks and decode alike (no phases: every query row
// t knows its sequence token_seq[t] and position token_pos[t]). One block of 4 warps per (query row, head):
// the warps take the keys in turn (warp w: keys first + w, first + w + 4, ...), each lane holds hd / 32
// dimensions of q and of its running output, and each warp keeps an online softmax (max m, sum l, acc).
// The 4 warps are merged at the end through shared memory with the log-sum-exp rule.
//
//   keys of query row t:  first = window ? max(0, p - window + 1) : 0  ..  p = token_pos[t]   (never empty)
//   key j lives at slot   block_tables[s * max_blocks + j / block_size] * block_size + j % block_size
//
// The pool rows are f32, f16 or int8 + scale (--kv-type, engine/kv_quant.py): one template, a kernel pair per type.
// The split variant (flash-decoding) adds a grid dimension over chunks of chunk_keys keys, so a few long
// decode rows still fill the GPU; attention_combine_f32 merges the partials. A chunk past the last key
// writes max = -inf, sum = 0, and every merge gives such a part weight 0 instead of exp(-inf - -inf) = NaN.
// hd <= 256. Launch geometry: cuda_kernels/attention.py.

#define ATTN_WARPS 4
#define ATTN_MAX_HD 256
#define ATTN_PER_LANE (ATTN_MAX_HD / 32)
#define NEG_INF (__int_as_float(0xff800000))  // -inf; math.h's INFINITY needs a header

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset >>= 1)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// Weight of a part with running max m in a merge whose overall max is m_all (0 for an empty part).
__device__ __forceinline__ float part_weight(float m, float m_all) {
    return m == NEG_INF ? 0.0f : expf(m - m_all);
}

// One layer's K or V rows in the pool, by --kv-type (engine/kv_quant.py): value(row, d) and the row's scale
// (1 for the float types, so their products are exactly the f32 kernel's).
// row = segment * seg_rows + kv_head * num_slots + slot % num_slots, segment = slot / num_slots (num_slots: one
// segment's slots, every slot of a fixed pool; seg_rows: the rows from one segment to the next, kv_blocks.cu).
struct RowsF32 {
    const float* base;
    int hd;
    __device__ __forceinline__ float value(long long row, int d) const { return base[row * hd + d]; }
    __device__ __forceinline__ float scale(long long) const { return 1.0f; }
};

struct RowsF16 {
    const unsigned short* base;
    int hd;
    __device__ __forceinline__ float value(long long row, int d) const {
        float out;
        asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(base[row * hd + d]));
        return out;
    }
    __device__ __forceinline__ float scale(long long) const { return 1.0f; }
};

struct RowsInt8 {  // hd int8 values, then their float32 scale: row_bytes = hd + 4
    const signed char* base;
    int hd;
    __device__ __forceinline__ float value(long long row, int d) const { return (float)base[row * (hd + 4) + d]; }
    __device__ __forceinline__ float scale(long long row) const {
        return *reinterpret_cast<const float*>(base + row * (hd + 4) + hd);
    }
};

struct BlockResult {
    float m;  // max score over the keys (-inf when there were none)
    float l;  // sum of exp(score - m)
};

// Softmax-weighted sum over keys [key_begin, key_end) of query row t, head h, merged over the block's warps.
// Leaves the unnormalised output (relative to the returned m) in acc_out[0 .. hd) (shared memory).
// int8 folds the scales in as the numpy reference does: score = (q . k_q) * s_k, and p * s_v weighs v_q.
template <typename Rows>
__device__ BlockResult attend_keys(const float* q, Rows pool_k, Rows pool_v, const int* token_seq,
                                   const int* block_tables, int max_blocks, int t, int h, int H, int KVH, int hd,
                                   int block_size, int num_slots, int seg_rows, float scale, int key_begin, int key_end,
                                   float* acc_out) {
    __shared__ float warp_acc[ATTN_WARPS][ATTN_MAX_HD];
    __shared__ float warp_m[ATTN_WARPS], warp_l[ATTN_WARPS];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int kv_head = h / (H / KVH);  // GQA: a group of H / KVH query heads shares one KV head
    const int* table = block_tables + (long long)token_seq[t] * max_blocks;
    const long long head_rows = (long long)kv_head * num_slots;  // in segment 0; a later one is seg_rows on

    float q_reg[ATTN_PER_LANE], acc[ATTN_PER_LANE];
    const float* q_row = q + ((long long)t * H + h) * hd;
#pragma unroll
    for (int i = 0; i < ATTN_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        q_reg[i] = d < hd ? q_row[d] * scale : 0.0f;  // scale q first, as the numpy reference does
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = key_begin + warp; j < key_end; j += ATTN_WARPS) {
        const long long slot = (long long)table[j / block_size] * block_size + j % block_size;
        const long long segment = slot / num_slots;
        const long long row = segment * seg_rows + head_rows + (slot - segment * num_slots);
        float partial = 0.0f;
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < hd) partial += q_reg[i] * pool_k.value(row, d);
        }
        const float score = warp_sum(partial) * pool_k.scale(row);
        const float m_new = fmaxf(m, score);
        const float correction = expf(m - m_new);  // m = -inf on the first key: correction 0
        const float p = expf(score - m_new);
        l = l * correction + p;
        const float pv = p * pool_v.scale(row);
#pragma unroll
        for (int i = 0; i < ATTN_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < hd) acc[i] = acc[i] * correction + pv * pool_v.value(row, d);
        }
        m = m_new;
    }
    if (lane == 0) {
        warp_m[warp] = m;
        warp_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATTN_PER_LANE; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) warp_acc[warp][d] = acc[i];
    }
    __syncthreads();
    BlockResult result{NEG_INF, 0.0f};
    for (int w = 0; w < ATTN_WARPS; ++w) result.m = fmaxf(result.m, warp_m[w]);
    for (int w = 0; w < ATTN_WARPS; ++w) result.l += part_weight(warp_m[w], result.m) * warp_l[w];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float total = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) total += part_weight(warp_m[w], result.m) * warp_acc[w][d];
        acc_out[d] = total;
    }
    __syncthreads();
    return result;
}

__device__ __forceinline__ int first_key(int pos, int window) {
    return window > 0 ? max(0, pos - window + 1) : 0;
}

// out [T, H * hd]; q [T, H, hd]; pool_k / pool_v one layer's [KVH, num_slots, row] (f32, f16 or int8 rows).
// Grid (T * H), block 128.
template <typename Rows>
__device__ void paged_attention(float* out, const float* q, Rows pool_k, Rows pool_v, const int* token_seq,
                                const int* token_pos, const int* block_tables, int max_blocks, int T, int H, int KVH,
                                int hd, int block_size, int num_slots, int seg_rows, float scale, int window) {
    __shared__ float acc[ATTN_MAX_HD];
    const int t = blockIdx.x / H;
    const int h = blockIdx.x - t * H;
    if (t >= T) return;
    const int pos = token_pos[t];
    const BlockResult r = attend_keys(q, pool_k, pool_v, token_seq, block_tables, max_blocks, t, h, H, KVH, hd,
                                      block_size, num_slots, seg_rows, scale, first_key(pos, window), pos + 1, acc);
    float* out_row = out + ((long long)t * H + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) out_row[d] = acc[d] / r.l;
}

// Flash-decoding pass 1. Grid (T * H, n_chunks): chunk c covers keys first + c * chunk_keys, ... (at most
// chunk_keys, possibly none). part_out [T * H, n_chunks, hd] unnormalised, part_max / part_sum [T * H, n_chunks].
template <typename Rows>
__device__ void paged_attention_split(const float* q, Rows pool_k, Rows pool_v, const int* token_seq,
                                      const int* token_pos, const int* block_tables, int max_blocks, int T, int H,
                                      int KVH, int hd, int block_size, int num_slots, int seg_rows, float scale,
                                      int window,
                                      float* part_out, float* part_max, float* part_sum, int chunk_keys) {
    __shared__ float acc[ATTN_MAX_HD];
    const int t = blockIdx.x / H;
    const int h = blockIdx.x - t * H;
    if (t >= T) return;
    const int pos = token_pos[t];
    const long long chunk_begin = (long long)first_key(pos, window) + (long long)blockIdx.y * chunk_keys;
    const int key_begin = (int)min(chunk_begin, (long long)pos + 1);
    const int key_end = (int)min(chunk_begin + chunk_keys, (long long)pos + 1);
    const BlockResult r = attend_keys(q, pool_k, pool_v, token_seq, block_tables, max_blocks, t, h, H, KVH, hd,
                                      block_size, num_slots, seg_rows, scale, key_begin, key_end, acc);
    const long long part = (long long)blockIdx.x * gridDim.y + blockIdx.y;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) part_out[part * hd + d] = acc[d];
    if (threadIdx.x == 0) {
        part_max[part] = r.m;
        part_sum[part] = r.l;
    }
}

// One pair of kernels per --kv-type: f32 rows, f16 rows, int8 rows with their scales. The split kernels'
// `out` is unused: it keeps the argument list of paged_attention_* as a prefix (docs/CUDA_KERNELS.md).
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention_f32(float* out, const float* q, const float* pool_k, const float* pool_v, const int* token_seq,
                    const int* token_pos, const int* block_tables, int max_blocks, int T, int H, int KVH, int hd,
                    int block_size, int num_slots, int seg_rows, float scale, int window) {
    paged_attention(out, q, RowsF32{pool_k, hd}, RowsF32{pool_v, hd}, token_seq, token_pos, block_tables, max_blocks, T,
                    H, KVH, hd, block_size, num_slots, seg_rows, scale, window);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention_split_f32(float* out, const float* q, const float* pool_k, const float* pool_v,
                          const int* token_seq, const int* token_pos, const int* block_tables, int max_blocks, int T,
                          int H, int KVH, int hd, int block_size, int num_slots, int seg_rows, float scale, int window,
                          float* part_out, float* part_max, float* part_sum, int chunk_keys) {
    paged_attention_split(q, RowsF32{pool_k, hd}, RowsF32{pool_v, hd}, token_seq, token_pos, block_tables, max_blocks,
                          T, H, KVH, hd, block_size, num_slots, seg_rows, scale, window, part_out, part_max, part_sum,
                          chunk_keys);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention_f16(float* out, const float* q, const unsigned short* pool_k, const unsigned short* pool_v, const int* token_seq,
                    const int* token_pos, const int* block_tables, int max_blocks, int T, int H, int KVH, int hd,
                    int block_size, int num_slots, int seg_rows, float scale, int window) {
    paged_attention(out, q, RowsF16{pool_k, hd}, RowsF16{pool_v, hd}, token_seq, token_pos, block_tables, max_blocks, T,
                    H, KVH, hd, block_size, num_slots, seg_rows, scale, window);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention_split_f16(float* out, const float* q, const unsigned short* pool_k, const unsigned short* pool_v,
                          const int* token_seq, const int* token_pos, const int* block_tables, int max_blocks, int T,
                          int H, int KVH, int hd, int block_size, int num_slots, int seg_rows, float scale, int window,
                          float* part_out, float* part_max, float* part_sum, int chunk_keys) {
    paged_attention_split(q, RowsF16{pool_k, hd}, RowsF16{pool_v, hd}, token_seq, token_pos, block_tables, max_blocks,
                          T, H, KVH, hd, block_size, num_slots, seg_rows, scale, window, part_out, part_max, part_sum,
                          chunk_keys);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention_int8(float* out, const float* q, const signed char* pool_k, const signed char* pool_v, const int* token_seq,
                    const int* token_pos, const int* block_tables, int max_blocks, int T, int H, int KVH, int hd,
                    int block_size, int num_slots, int seg_rows, float scale, int window) {
    paged_attention(out, q, RowsInt8{pool_k, hd}, RowsInt8{pool_v, hd}, token_seq, token_pos, block_tables, max_blocks, T,
                    H, KVH, hd, block_size, num_slots, seg_rows, scale, window);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
paged_attention_split_int8(float* out, const float* q, const signed char* pool_k, const signed char* pool_v,
                          const int* token_seq, const int* token_pos, const int* block_tables, int max_blocks, int T,
                          int H, int KVH, int hd, int block_size, int num_slots, int seg_rows, float scale, int window,
                          float* part_out, float* part_max, float* part_sum, int chunk_keys) {
    paged_attention_split(q, RowsInt8{pool_k, hd}, RowsInt8{pool_v, hd}, token_seq, token_pos, block_tables, max_blocks,
                          T, H, KVH, hd, block_size, num_slots, seg_rows, scale, window, part_out, part_max, part_sum,
                          chunk_keys);
}


// Flash-decoding pass 2: out[t, h] = sum_c w_c part_out[c] / sum_c w_c part_sum[c], w_c = exp(max_c - max).
// Grid (T * H), block >= 32 threads, dynamic shared memory n_chunks floats. `sink` (gpt-oss: a learned logit
// of head h with no value) joins the denominator only; -inf for none.
__device__ __forceinline__ void combine_parts(float* out, const float* part_out, const float* part_max,
                                              const float* part_sum, float sink, long long row, int hd, int n_chunks) {
    extern __shared__ float weights[];  // [n_chunks]
    const float* maxes = part_max + row * n_chunks;
    float m_all = sink;
    for (int c = 0; c < n_chunks; ++c) m_all = fmaxf(m_all, maxes[c]);
    for (int c = threadIdx.x; c < n_chunks; c += blockDim.x) weights[c] = part_weight(maxes[c], m_all);
    __syncthreads();
    float denominator = part_weight(sink, m_all);
    for (int c = 0; c < n_chunks; ++c) denominator += weights[c] * part_sum[row * n_chunks + c];
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float numerator = 0.0f;
        for (int c = 0; c < n_chunks; ++c) numerator += weights[c] * part_out[(row * n_chunks + c) * hd + d];
        out[row * hd + d] = numerator / denominator;
    }
}

extern "C" __global__ void attention_combine_f32(float* out, const float* part_out, const float* part_max,
                                                 const float* part_sum, int T, int H, int hd, int n_chunks) {
    const long long row = blockIdx.x;  // t * H + h
    if (row >= (long long)T * H) return;
    combine_parts(out, part_out, part_max, part_sum, NEG_INF, row, hd, n_chunks);
}

// attention_combine_f32 with one sink logit per head, sinks [H] (gpt-oss; the split pass runs as usual).
extern "C" __global__ void attention_combine_sinks_f32(float* out, const float* part_out, const float* part_max,
                                                       const float* part_sum, const float* sinks, int T, int H,
                                                       int hd, int n_chunks) {
    const long long row = blockIdx.x;  // t * H + h
    if (row >= (long long)T * H) return;
    combine_parts(out, part_out, part_max, part_sum, sinks[row % H], row, hd, n_chunks);
}
