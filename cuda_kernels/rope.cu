// Rotary position embedding, in place on x [T, H, hd] (contiguous). Only the first rope_dims of each head
// rotate (partial rotary); the rest is left as is. cos/sin tables are [max_pos, rope_dims / 2], looked up
// at positions[t] (int32). One thread per rotated pair, so each element is read and written once.
// Launch: block 256, grid ceil(T * H * rope_dims / 2 / 256) (cuda_kernels/rope.py).

// Rotates the pair (x[first], x[second]) of token t, head h, by the angle of pair index `pair`.
__device__ __forceinline__ void rotate_pair(float* x, const float* cos_table, const float* sin_table,
                                            long long row_base, int pos, int half, int pair, int first, int second) {
    const float c = cos_table[(long long)pos * half + pair];
    const float s = sin_table[(long long)pos * half + pair];
    const float x1 = x[row_base + first];
    const float x2 = x[row_base + second];
    x[row_base + first] = x1 * c - x2 * s;
    x[row_base + second] = x2 * c + x1 * s;
}

// NeoX / half-split layout (Llama in HF form, Qwen, Gemma): pairs (i, i + rope_dims / 2)
extern "C" __global__ void rope_neox_f32(float* x, const int* positions, const float* cos, const float* sin,
                                         int T, int H, int hd, int rope_dims) {
    const int half = rope_dims / 2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * H * half) return;
    const long long row = i / half;  // t * H + h
    const int pair = (int)(i - row * half);
    const int t = (int)(row / H);
    rotate_pair(x, cos, sin, row * hd, positions[t], half, pair, pair, pair + half);
}

// llama.cpp's "normal" layout (GGUF llama weights): adjacent pairs (2i, 2i + 1)
extern "C" __global__ void rope_norm_f32(float* x, const int* positions, const float* cos, const float* sin,
                                         int T, int H, int hd, int rope_dims) {
    const int half = rope_dims / 2;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)T * H * half) return;
    const long long row = i / half;
    const int pair = (int)(i - row * half);
    const int t = (int)(row / H);
    rotate_pair(x, cos, sin, row * hd, positions[t], half, pair, 2 * pair, 2 * pair + 1);
}
