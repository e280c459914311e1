// Row-shaped data movement and elementwise adds: embedding lookup, residual add, column split, row gather.
// One thread per output element over a flat index (long long: T * d can pass 2^31 for big prefill chunks);
// consecutive threads write consecutive columns, so reads and writes are coalesced.
// Launch: block 256, grid ceil(elements / 256) (cuda_kernels/rows.py).

__device__ __forceinline__ long long flat_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

// out[t, :] = table[ids[t], :] * scale   (Gemma scales embeddings by sqrt(d); others pass 1)
extern "C" __global__ void embedding_f32(float* out, const float* table, const int* ids, int T, int d, float scale) {
    const long long i = flat_index();
    if (i >= (long long)T * d) return;
    const long long t = i / d;
    const long long col = i - t * d;
    const float v = table[(long long)ids[t] * d + col];
    out[i] = scale == 1.0f ? v : v * scale;
}

// out = a + b, elementwise over n floats (out may alias a or b)
extern "C" __global__ void add_f32(float* out, const float* a, const float* b, int n) {
    const long long i = flat_index();
    if (i < n) out[i] = a[i] + b[i];
}

// out[t, :] = x[t, col_start : col_start + out_cols]: one part (Q, K or V) of a fused projection, made contiguous
extern "C" __global__ void split_columns_f32(float* out, const float* x, int T, int in_cols, int col_start, int out_cols) {
    const long long i = flat_index();
    if (i >= (long long)T * out_cols) return;
    const long long t = i / out_cols;
    const long long col = i - t * out_cols;
    out[i] = x[t * in_cols + col_start + col];
}

// out[i, :] = x[rows[i], :]: the rows whose logits are needed (the last token of each sequence)
extern "C" __global__ void gather_rows_f32(float* out, const float* x, const long long* rows, int n_rows, int d) {
    const long long i = flat_index();
    if (i >= (long long)n_rows * d) return;
    const long long r = i / d;
    const long long col = i - r * d;
    out[i] = x[rows[r] * d + col];
}
