// Token sampling on device logits [rows, vocab], one block per row, the semantics of engine/sampling.py:
// temperature 0 is argmax (lowest id on ties); otherwise softmax(logits / T) filtered by top-k, then top-p
// (on the top-k renormalised distribution), then min-p, and one draw. Every filter keeps a prefix of the
// tokens sorted by descending logit, so instead of sorting the vocabulary each filter becomes a threshold
// on an order-preserving 32-bit key of the scaled logit, found by a 4-pass MSB radix select (256 bins):
//   top-k: the k-th largest key (counts);  top-p: the key where the descending cumulative mass first
//   reaches top_p * mass(top-k set) (fixed-point masses: integer atomics keep the result deterministic);
//   min-p: exp(s - max) >= min_p.
// Ties at a top-k / top-p threshold are all kept. The draw is an inverse CDF over the kept tokens in id
// order (each thread sums a contiguous chunk, then a block scan), with one uniform from Philox4x32-10 keyed
// by seeds[row] at counter counters[row]: the same (seed, counter) always picks the same token.
// Grammar-constrained rows (optional): allowed_mask holds bitmask rows in llguidance's layout, int32 words,
// bit (id % 32) of word (id / 32) set = id allowed, mask_words words a row (>= ceil(vocab / 32); bits past
// vocab are ignored). Row r uses mask row mask_rows[r], or mask row r when mask_rows is null; a negative
// mask_rows[r], or a null allowed_mask, leaves row r unconstrained. The indirection lets a batch hold masks
// only for its constrained rows, and lets rows share one. A disallowed token reads as a -inf logit before
// anything else, so greedy, every filter and the draw see exactly the host contract run on logits with
// the disallowed ones set to -inf (a row with no allowed finite logit gives 0, as all -inf logits do).
// Launch: grid (rows), block 1024 (cuda_kernels/sampling.py).

#define SAMPLE_THREADS 1024
#define RADIX_BINS 256
#define MASS_ONE 1099511627776.0f  // 2^40: fixed-point scale of a token's weight exp(s - max) <= 1
#define FULL_MASK 0xffffffffu

struct SampleShared {
    unsigned long long hist[RADIX_BINS];
    float inclusive[SAMPLE_THREADS];
    float warp_value[32];
    int warp_id[32];
    unsigned long long warp_u64[32];
    unsigned int prefix;
    unsigned long long remaining;
};

// Larger float -> larger unsigned key (sign flipped for positives, all bits for negatives).
__device__ __forceinline__ unsigned int order_key(float value) {
    const unsigned int bits = __float_as_uint(value);
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3"); first output word only.
__device__ unsigned int philox_first_word(unsigned long long seed, unsigned int counter) {
    unsigned int c0 = counter, c1 = 0, c2 = 0, c3 = 0;
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
    for (int round = 0; round < 10; ++round) {
        const unsigned int hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const unsigned int hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// One row's logits as the sampler sees them: a token the row's mask disallows reads as -inf. Every read of
// a logit goes through here, so no filter can see a disallowed token's real value; mask is null for an
// unconstrained row (a block-uniform branch, and the plain load of before).
struct Logits {
    const float* x;
    const unsigned int* mask;
    __device__ float operator[](int i) const {
        if (mask && !((mask[i >> 5] >> (i & 31)) & 1u)) return __int_as_float(0xff800000);  // -inf
        return x[i];
    }
};

// Highest logit and its lowest id, for the whole block.
__device__ void block_argmax(const Logits& x, int vocab, SampleShared& sh, float& best_value, int& best_id) {
    float value = __int_as_float(0xff800000);  // -inf
    int id = vocab;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = x[i];
        if (v > value) { value = v; id = i; }  // ids rise within a thread: strict > keeps the lowest
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_value = __shfl_xor_sync(FULL_MASK, value, offset);
        const int other_id = __shfl_xor_sync(FULL_MASK, id, offset);
        if (other_value > value || (other_value == value && other_id < id)) { value = other_value; id = other_id; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sh.warp_value[warp] = value; sh.warp_id[warp] = id; }
    __syncthreads();
    best_value = sh.warp_value[0];
    best_id = sh.warp_id[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
        if (sh.warp_value[w] > best_value || (sh.warp_value[w] == best_value && sh.warp_id[w] < best_id)) {
            best_value = sh.warp_value[w];
            best_id = sh.warp_id[w];
        }
    __syncthreads();
}

struct Scaled {
    Logits x;
    float temperature;
    float max_scaled;
    __device__ float scaled(int i) const { return x[i] / temperature; }
    __device__ float weight(float s) const { return expf(s - max_scaled); }  // <= 1
    __device__ unsigned long long mass(float s) const { return (unsigned long long)(weight(s) * MASS_ONE); }
};

// The largest key K such that the total of measure(i) over tokens with key >= K (and key >= floor_key)
// reaches `target`. measure = 1 (count, for top-k) or fixed-point mass (top-p).
template <bool BY_MASS>
__device__ unsigned int radix_select(const Scaled& row, int vocab, unsigned int floor_key, unsigned long long target,
                                     SampleShared& sh) {
    unsigned int prefix = 0, mask = 0;
    if (threadIdx.x == 0) sh.remaining = target;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < RADIX_BINS; b += blockDim.x) sh.hist[b] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float s = row.scaled(i);
            const unsigned int key = order_key(s);
            if (key < floor_key || (key & mask) != prefix) continue;
            atomicAdd(&sh.hist[(key >> shift) & 0xFF], BY_MASS ? row.mass(s) : 1ull);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long above = 0;
            int chosen = -1, lowest_nonempty = 0;
            for (int b = RADIX_BINS - 1; b >= 0 && chosen < 0; --b) {
                if (sh.hist[b] == 0) continue;
                lowest_nonempty = b;
                if (above + sh.hist[b] >= sh.remaining) chosen = b;
                else above += sh.hist[b];
            }
            // Rounding left the target above everything: keep the whole lowest bin (and below it next pass).
            if (chosen < 0) { chosen = lowest_nonempty; above = 0; sh.remaining = sh.hist[chosen]; }
            sh.remaining -= above;
            sh.prefix = prefix | ((unsigned int)chosen << shift);
        }
        __syncthreads();
        prefix = sh.prefix;
        mask |= 0xFFu << shift;
    }
    return prefix;
}

__device__ unsigned long long block_sum_u64(unsigned long long value, SampleShared& sh) {
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(FULL_MASK, value, offset);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sh.warp_u64[warp] = value;
    __syncthreads();
    unsigned long long total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) total += sh.warp_u64[w];
    __syncthreads();
    return total;
}

// Inclusive prefix sums of one float per thread, left in sh.inclusive[thread] (deterministic order).
__device__ void block_inclusive_scan(float value, SampleShared& sh) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float below = __shfl_up_sync(FULL_MASK, value, offset);
        if (lane >= offset) value += below;
    }
    if (lane == 31) sh.warp_value[warp] = value;
    __syncthreads();
    float warps_below = 0.0f;
    for (int w = 0; w < warp; ++w) warps_below += sh.warp_value[w];
    sh.inclusive[threadIdx.x] = value + warps_below;
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
sample_f32(int* out_ids, const float* logits, int rows, int vocab, const float* temperature, const int* top_k,
           const float* top_p, const float* min_p, const unsigned long long* seeds, const int* counters,
           const int* allowed_mask, int mask_words, const int* mask_rows) {
    __shared__ SampleShared sh;
    const int r = blockIdx.x;
    if (r >= rows) return;
    // Words are read as unsigned so the shift in Logits is a plain bit test whatever bit 31 holds.
    const unsigned int* masks = reinterpret_cast<const unsigned int*>(allowed_mask);
    const int mask_row = masks == nullptr ? -1 : mask_rows == nullptr ? r : mask_rows[r];
    const Logits x{logits + (long long)r * vocab, mask_row < 0 ? nullptr : masks + (long long)mask_row * mask_words};
    float best_value;
    int best_id;
    block_argmax(x, vocab, sh, best_value, best_id);
    // The greedy answer, and the fallback of the draw below. Only NaN or all -inf logits (a mask allowing
    // none but -inf ones included) leave best_id at vocab; a valid id (0) still beats one past the vocabulary.
    if (threadIdx.x == 0) out_ids[r] = best_id < vocab ? best_id : 0;
    const float temp = temperature[r];
    if (!(temp > 0.0f) || best_id >= vocab || !(best_value > __int_as_float(0xff800000))) return;
    __syncthreads();  // the draw may overwrite out_ids[r]: order it after the write above
    const Scaled row{x, temp, best_value / temp};  // division is monotonic: the max scaled logit

    unsigned int keep_key = 0;
    const int k = top_k[r];
    if (k > 0 && k < vocab) keep_key = radix_select<false>(row, vocab, 0, (unsigned long long)k, sh);
    if (top_p[r] < 1.0f) {
        unsigned long long local = 0;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float s = row.scaled(i);
            if (order_key(s) >= keep_key) local += row.mass(s);
        }
        const unsigned long long top_k_mass = block_sum_u64(local, sh);
        unsigned long long target = (unsigned long long)((double)top_p[r] * (double)top_k_mass);
        keep_key = radix_select<true>(row, vocab, keep_key, target > 0 ? target : 1ull, sh);
    }
    const float min_weight = min_p[r];

    // Inverse CDF in id order over the kept tokens: thread j owns ids [j * chunk, (j + 1) * chunk).
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = min(vocab, (int)threadIdx.x * chunk), end = min(vocab, begin + chunk);
    float local_mass = 0.0f;
    for (int i = begin; i < end; ++i) {
        const float s = row.scaled(i), w = row.weight(s);
        if (order_key(s) >= keep_key && w >= min_weight) local_mass += w;
    }
    block_inclusive_scan(local_mass, sh);
    const float total = sh.inclusive[blockDim.x - 1];  // >= 1: the top token (weight 1) is always kept
    const float uniform = (philox_first_word(seeds[r], (unsigned int)counters[r]) >> 8) * (1.0f / 16777216.0f);
    float u = uniform * total;
    if (u >= total) u = __int_as_float(__float_as_int(total) - 1);  // the largest float below total
    const float below = threadIdx.x == 0 ? 0.0f : sh.inclusive[threadIdx.x - 1];
    if (!(below <= u && u < sh.inclusive[threadIdx.x])) return;
    const float residual = u - below;
    float running = 0.0f;
    int last_kept = -1;
    for (int i = begin; i < end; ++i) {
        const float s = row.scaled(i), w = row.weight(s);
        if (!(order_key(s) >= keep_key && w >= min_weight) || w == 0.0f) continue;
        last_kept = i;
        running += w;
        if (running > residual) break;
    }
    if (last_kept >= 0) out_ids[r] = last_kept;
}
