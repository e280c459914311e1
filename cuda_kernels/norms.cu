// RMS norm, plain and fused with the residual add. One block per row; float32 throughout, the sum of
// squares accumulated in float by each thread, then across the block (warp shuffles, then one warp over
// the per-warp sums), as numpy's float32 einsum does it (a pairwise sum, so results agree to ~1e-6).
// Launch: grid (rows), block a multiple of 32 up to 1024 (cuda_kernels/norms.py).

__device__ __forceinline__ float warp_sum(float value) {
    for (int offset = 16; offset > 0; offset >>= 1)
        value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// Sum of `value` over the block, returned to every thread. blockDim.x must be a multiple of 32.
__device__ float block_sum(float value) {
    __shared__ float warp_sums[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    value = warp_sum(value);
    if (lane == 0) warp_sums[warp] = value;
    __syncthreads();
    const int n_warps = blockDim.x >> 5;
    float total = lane < n_warps ? warp_sums[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();  // warp_sums may be reused by a following call
    return total;
}

// The scale 1 / sqrt(mean(x^2) + eps), with IEEE sqrt and division (no fast math) as numpy computes it.
__device__ __forceinline__ float inverse_rms(float sum_sq, int n, float eps) {
    return 1.0f / sqrtf(sum_sq / (float)n + eps);
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w   (rows = T, or T * H for per-head QK norm)
extern "C" __global__ void rms_norm_f32(float* out, const float* x, const float* w, int rows, int n, float eps) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* x_row = x + (long long)row * n;
    float* out_row = out + (long long)row * n;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x_row[i];
        sum_sq += v * v;
    }
    const float scale = inverse_rms(block_sum(sum_sq), n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out_row[i] = x_row[i] * scale * w[i];
}

// sum_out = x + delta; norm_out = rms_norm(sum_out) * w. sum_out may be x itself (in-place residual):
// each element is read and written by the same thread, so no pointer is declared __restrict__.
extern "C" __global__ void add_rms_norm_f32(float* sum_out, float* norm_out, const float* x, const float* delta,
                                            const float* w, int rows, int n, float eps) {
    const int row = blockIdx.x;
    if (row >= rows) return;
    const long long base = (long long)row * n;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = x[base + i] + delta[base + i];
        sum_out[base + i] = v;
        sum_sq += v * v;
    }
    const float scale = inverse_rms(block_sum(sum_sq), n, eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        norm_out[base + i] = sum_out[base + i] * scale * w[i];
}
