// lfm2's short convolution (engine/short_conv.py): a depthwise causal conv of length L over u = B * x, per
// sequence, reading and updating the sequence's rolling state of the last L-1 inputs. One thread per
// (sequence, channel) walks that sequence's rows in order (the recurrence runs along its rows), keeping the
// window in registers; consecutive threads are consecutive channels, so the row reads are coalesced.
// Launch: block 256, grid ceil(n_seqs * d / 256) (cuda_kernels/short_conv.py).

#define SHORT_CONV_MAX_L 8

// u, out [T, d]; w [d, L] (GGUF blk.N.shortconv.conv.weight); states [slots, L-1, d], in place;
// per sequence s: rows seq_start[s] .. + seq_len[s], first position start_pos[s] (0: the state is zeros,
// whatever its slot holds), state row state_slot[s]. Sums in numpy's order: k = 0 (oldest) first.
extern "C" __global__ void short_conv_f32(float* out, float* states, const float* u, const float* w,
                                          const int* seq_start, const int* seq_len, const int* start_pos,
                                          const int* state_slot, int n_seqs, int d, int L) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_seqs * d || L < 2 || L > SHORT_CONV_MAX_L) return;
    const int s = (int)(i / d);
    const int c = (int)(i - (long long)s * d);
    const int R = L - 1;
    const float* wc = w + (long long)c * L;
    float* state = states + (long long)state_slot[s] * R * d + c;  // row j at state[j * d]
    float prev[SHORT_CONV_MAX_L];  // prev[j]: the input j - R positions back (oldest first)
    for (int j = 0; j < R; ++j) prev[j] = start_pos[s] > 0 ? state[(long long)j * d] : 0.0f;
    for (int t = 0; t < seq_len[s]; ++t) {
        const long long at = (long long)(seq_start[s] + t) * d + c;
        const float x = u[at];
        float acc = prev[0] * wc[0];
        for (int k = 1; k < R; ++k) acc = acc + prev[k] * wc[k];
        acc = acc + x * wc[R];
        out[at] = acc;
        for (int k = 0; k + 1 < R; ++k) prev[k] = prev[k + 1];
        prev[R - 1] = x;
    }
    for (int j = 0; j < R; ++j) state[(long long)j * d] = prev[j];
}
