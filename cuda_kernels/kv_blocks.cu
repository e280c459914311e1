// KV pool writes and whole-block moves. Pool layout (docs/CUDA_KERNELS.md): float32
// [layers, 2 (K, V), KVH, num_slots, hd], slot = block_id * block_size + offset. Seen from a block move
// the pool is `planes` = layers * 2 * KVH planes of [num_slots, hd], and block b of a plane is the
// contiguous run of block_elems = block_size * hd floats starting at b * block_elems:
//
//   plane p:  | block 0 | block 1 | ... | block num_blocks-1 |     (num_slots * hd floats)
//
// An elastic pool (engine/backends/cuda/kv_elastic.py) is segment-major: segments of num_slots slots, each
// [layers, 2, KVH, num_slots, hd] (a fixed pool is one segment), seg_rows = layers * 2 * KVH * num_slots rows
// apart, so a run of segments is one contiguous range of memory that physical chunks map and unmap:
//
//   pool:  | segment 0: plane 0 [num_slots rows] | plane 1 | ... | segment 1: plane 0 | plane 1 | ... |
//
// Block moves see the pool as 32-bit words, whatever the --kv-type: for f16 / int8 rows the backend passes
// `hd` = row words (row bytes / 4) and block_elems = block_size * row words, so one kernel moves every type.
// Block moves copy float4 when block_elems % 4 == 0 (every real head size), else single floats, with a
// grid-stride loop so one launch covers any number of blocks (cuda_kernels/kv_blocks.py).

// Row of (KV head h, slot) counted from a layer's pool_layer_{k,v}: a later segment's slots are seg_rows on.
__device__ __forceinline__ long long kv_row(int h, long long slot, int num_slots, int seg_rows) {
    const long long segment = slot / num_slots;
    return segment * seg_rows + (long long)h * num_slots + (slot - segment * num_slots);
}

// pool_layer_{k,v} are one layer's [KVH, num_slots, hd] of segment 0; k, v are [T, KVH, hd]; slots are int64.
// A negative slot (a padding row) is skipped.
extern "C" __global__ void store_kv_f32(float* pool_layer_k, float* pool_layer_v, const float* k, const float* v,
                                        const long long* slots, int T, int KVH, int hd, int num_slots, int seg_rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * KVH * hd) return;
    const long long row = i / hd;  // t * KVH + h
    const int d = (int)(i - row * hd);
    const int t = (int)(row / KVH);
    const int h = (int)(row - (long long)t * KVH);
    const long long slot = slots[t];
    if (slot < 0) return;
    const long long dst = kv_row(h, slot, num_slots, seg_rows) * hd + d;
    pool_layer_k[dst] = k[i];
    pool_layer_v[dst] = v[i];
}

// --kv-type f16 / int8 rows (engine/kv_quant.py is the reference): a pool row is one token's K (or V) of one
// head. f16: hd halves (hd even; pairs are converted with one cvt.rn.f16x2). int8: hd int8 values, then the
// row's float32 scale (row_bytes = hd + 4, hd % 4 == 0 so the scale is aligned); scale = max|x| / 127,
// q = rint(x * (127 / max|x|)) clipped to +-127, all float32 steps as in numpy, so the bytes are identical.

// One thread per pair of elements: pool_layer_{k,v} [KVH, num_slots, hd] halves.
extern "C" __global__ void store_kv_f16(unsigned short* pool_layer_k, unsigned short* pool_layer_v, const float* k,
                                        const float* v, const long long* slots, int T, int KVH, int hd,
                                        int num_slots, int seg_rows) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // pair index
    const int pairs = hd / 2;
    if (i >= (long long)T * KVH * pairs) return;
    const long long row = i / pairs;  // t * KVH + h
    const int d = 2 * (int)(i - row * pairs);
    const int t = (int)(row / KVH);
    const int h = (int)(row - (long long)t * KVH);
    const long long slot = slots[t];
    if (slot < 0) return;
    const long long src = row * hd + d;
    const long long dst = kv_row(h, slot, num_slots, seg_rows) * hd + d;
    unsigned packed_k, packed_v;  // the first source lands in the upper half: element d + 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed_k) : "f"(k[src + 1]), "f"(k[src]));
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed_v) : "f"(v[src + 1]), "f"(v[src]));
    *reinterpret_cast<unsigned*>(pool_layer_k + dst) = packed_k;
    *reinterpret_cast<unsigned*>(pool_layer_v + dst) = packed_v;
}

__device__ __forceinline__ float warp_max(float value) {
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}

// One row of hd values -> hd int8 + its scale, by one warp (lane l: elements l, l + 32, ...).
__device__ __forceinline__ void quantize_row(signed char* dst, const float* x, int hd, int lane) {
    float amax = 0.0f;
    for (int d = lane; d < hd; d += 32) amax = fmaxf(amax, fabsf(x[d]));
    amax = warp_max(amax);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int d = lane; d < hd; d += 32) dst[d] = (signed char)fminf(127.0f, fmaxf(-127.0f, rintf(x[d] * inv)));
    if (lane == 0) *reinterpret_cast<float*>(dst + hd) = amax / 127.0f;
}

// One warp per (t, h) row, 4 rows a 128-thread block: pool_layer_{k,v} [KVH, num_slots, hd + 4] bytes.
extern "C" __global__ void store_kv_int8(signed char* pool_layer_k, signed char* pool_layer_v, const float* k,
                                         const float* v, const long long* slots, int T, int KVH, int hd,
                                         int num_slots, int seg_rows) {
    const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // t * KVH + h
    if (row >= (long long)T * KVH) return;
    const int t = (int)(row / KVH);
    const int h = (int)(row - (long long)t * KVH);
    const long long slot = slots[t];
    if (slot < 0) return;
    const long long dst = kv_row(h, slot, num_slots, seg_rows) * (hd + 4);
    quantize_row(pool_layer_k + dst, k + row * hd, hd, threadIdx.x & 31);
    quantize_row(pool_layer_v + dst, v + row * hd, hd, threadIdx.x & 31);
}

// Where element `e` of block `block` in plane `plane` (of `planes`) lives in the pool, in units of `vec` floats.
// num_slots is one segment's (all of them in a fixed pool): a block of segment s is s * planes planes on.
__device__ __forceinline__ long long pool_index(int plane, int planes, int block, long long e, int num_slots, int hd,
                                                int block_elems, int vec) {
    const int seg_blocks = (int)((long long)num_slots * hd / block_elems);
    const int segment = block / seg_blocks;
    const long long plane_words = (long long)num_slots * hd;
    return (((long long)segment * planes + plane) * plane_words
            + (long long)(block - segment * seg_blocks) * block_elems) / vec + e;
}

// Visits every (item, plane, element) of `n` blocks in every plane: fn(item, plane, element, flat index),
// in units of `vec` floats; the flat index is the position in a [n, planes, block_elems] staging buffer.
template <typename Fn>
__device__ __forceinline__ void for_each_block_element(int n, int planes, int block_elems, int vec, Fn fn) {
    const long long per_block = block_elems / vec;
    const long long total = (long long)n * planes * per_block;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const long long rest = i / per_block;
        const long long e = i - rest * per_block;
        const int plane = (int)(rest % planes);
        const int item = (int)(rest / planes);
        fn(item, plane, e, i);
    }
}

template <typename T>
__device__ void copy_blocks(T* pool, const int* src_blocks, const int* dst_blocks, int n_pairs, int planes,
                            int num_slots, int block_elems, int hd) {
    const int vec = sizeof(T) / sizeof(float);
    for_each_block_element(n_pairs, planes, block_elems, vec, [&](int pair, int plane, long long e, long long) {
        pool[pool_index(plane, planes, dst_blocks[pair], e, num_slots, hd, block_elems, vec)] =
            pool[pool_index(plane, planes, src_blocks[pair], e, num_slots, hd, block_elems, vec)];
    });
}

// Copy-on-write: block src_blocks[i] -> dst_blocks[i] in every plane (every layer, K and V, every head).
// Source and destination blocks must differ (they are distinct blocks of the pool).
extern "C" __global__ void copy_kv_blocks_f32(float* pool, const int* src_blocks, const int* dst_blocks, int n_pairs,
                                              int planes, int num_slots, int block_elems, int hd) {
    if (block_elems % 4 == 0)
        copy_blocks(reinterpret_cast<float4*>(pool), src_blocks, dst_blocks, n_pairs, planes, num_slots, block_elems, hd);
    else
        copy_blocks(pool, src_blocks, dst_blocks, n_pairs, planes, num_slots, block_elems, hd);
}

// is_gather: staging[i, plane, :] = pool block blocks[i] of plane; else the reverse.
template <typename T>
__device__ void move_blocks(T* staging, T* pool, const int* blocks, int n, int planes, int num_slots,
                            int block_elems, int hd, bool is_gather) {
    const int vec = sizeof(T) / sizeof(float);
    for_each_block_element(n, planes, block_elems, vec, [&](int item, int plane, long long e, long long flat) {
        const long long at = pool_index(plane, planes, blocks[item], e, num_slots, hd, block_elems, vec);
        if (is_gather)
            staging[flat] = pool[at];
        else
            pool[at] = staging[flat];
    });
}

// Park: pack blocks into staging [n, planes, block_elems] for one device -> pinned-host copy.
extern "C" __global__ void gather_kv_blocks_f32(float* staging, float* pool, const int* blocks, int n, int planes,
                                                int num_slots, int block_elems, int hd) {
    if (block_elems % 4 == 0)
        move_blocks(reinterpret_cast<float4*>(staging), reinterpret_cast<float4*>(pool), blocks, n, planes,
                    num_slots, block_elems, hd, true);
    else
        move_blocks(staging, pool, blocks, n, planes, num_slots, block_elems, hd, true);
}

// Restore: unpack staging [n, planes, block_elems] (just copied from pinned host memory) into the pool.
extern "C" __global__ void scatter_kv_blocks_f32(float* staging, float* pool, const int* blocks, int n, int planes,
                                                 int num_slots, int block_elems, int hd) {
    if (block_elems % 4 == 0)
        move_blocks(reinterpret_cast<float4*>(staging), reinterpret_cast<float4*>(pool), blocks, n, planes,
                    num_slots, block_elems, hd, false);
    else
        move_blocks(staging, pool, blocks, n, planes, num_slots, block_elems, hd, false);
}
