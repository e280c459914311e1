// Gated MLP activations: gate_up is [T, 2F] = [gate | up] per row (the fused gate/up projection),
// out [T, F] = act(gate) * up. Precise expf / tanhf (no fast math) to stay within ~1e-6 of numpy.
// Launch: block 256, grid ceil(T * F / 256) (cuda_kernels/activations.py).

__device__ __forceinline__ long long flat_index() {
    return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}

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
