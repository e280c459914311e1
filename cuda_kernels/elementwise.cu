// Elementwise and row-shaped kernels: embedding lookup, residual add, column split, row gather and the
// gated MLP activations. One thread per output element over a flat index (long long: T * d can pass 2^31
// for big prefill chunks); consecutive threads write consecutive columns, so accesses are coalesced.
// Precise expf / tanhf (no fast math) to stay within ~1e-6 of numpy.
// Launch: block 256, grid ceil(elements / 256) (cuda_kernels/elementwise.py).

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

// out = a * b, elementwise over n floats (lfm2's B * x and C * y gates; out may alias a or b)
extern "C" __global__ void mul_f32(float* out, const float* a, const float* b, int n) {
    const long long i = flat_index();
    if (i < n) out[i] = a[i] * b[i];
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

// Gated activations: gate_up is [T, 2F] = [gate | up] per row (the fused projection), out [T, F].

// out = silu(g) * u = g / (1 + exp(-g)) * u
extern "C" __global__ void gated_silu_f32(float* out, const float* gate_up, int T, int F) {
    const long long i = flat_index();
    if (i >= (long long)T * F) return;
    const long long t = i / F;
    const long long col = i - t * F;
    const float g = gate_up[t * 2 * F + col];
    const float u = gate_up[t * 2 * F + F + col];
    out[i] = g / (1.0f + expf(-g)) * u;
}

// out = gelu_tanh(g) * u = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u
extern "C" __global__ void gated_gelu_tanh_f32(float* out, const float* gate_up, int T, int F) {
    const long long i = flat_index();
    if (i >= (long long)T * F) return;
    const long long t = i / F;
    const long long col = i - t * F;
    const float g = gate_up[t * 2 * F + col];
    const float u = gate_up[t * 2 * F + F + col];
    const float inner = 0.7978845608f * (g + 0.044715f * g * g * g);
    out[i] = 0.5f * g * (1.0f + tanhf(inner)) * u;
}
