// GGUF block decoders: one struct per weight type, dequantising 8 elements at a time in registers.
// Included by matvec_quant.cu and gemm_quant.cu. cuda_kernels/registry.read_source expands the include before
// NVRTC (which gets no include path) or the CPU emulator sees the text. Layouts follow ggml-common.h /
// gguf/quants.py.
//
// Every type exposes the same interface, so the kernels are written once:
//   QK     elements per block (the float types use a virtual block of 8 elements)
//   BYTES  bytes per block; row r of an [out, in] weight starts at W + r * (in / QK) * BYTES
//   decode8(block, chunk, w)  writes elements [8 * chunk, 8 * chunk + 8) of the block to w[0..7]
// Eight elements is the unit because it is the widest run every layout stores contiguously
// (a Q4 nibble run of 8, a 16-byte f16 vector, one quarter of a Q8_0 block).

__device__ __forceinline__ float f16_bits_to_f32(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}

__device__ __forceinline__ float bf16_bits_to_f32(unsigned short bits) {
    return __uint_as_float((unsigned)bits << 16);
}

__device__ __forceinline__ unsigned short load_u16(const unsigned char* p) {
    return *(const unsigned short*)p;
}

// 8 bytes at a 2-byte-aligned address (Q4_0, Q5_0, Q8_0 and Q6_K blocks are only 2-byte aligned in a row).
__device__ __forceinline__ uint2 load8_align2(const unsigned char* p) {
    const unsigned short* h = (const unsigned short*)p;
    return make_uint2(h[0] | ((unsigned)h[1] << 16), h[2] | ((unsigned)h[3] << 16));
}

// Byte i (0..7, little-endian) of an 8-byte load.
__device__ __forceinline__ unsigned byte_of(uint2 v, int i) {
    return ((i < 4 ? v.x : v.y) >> (8 * (i & 3))) & 0xFFu;
}

struct BlockF32 {
    static constexpr int QK = 8, BYTES = 32;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int, float* w) {
        float4 lo = ((const float4*)b)[0], hi = ((const float4*)b)[1];
        w[0] = lo.x; w[1] = lo.y; w[2] = lo.z; w[3] = lo.w;
        w[4] = hi.x; w[5] = hi.y; w[6] = hi.z; w[7] = hi.w;
    }
};

struct BlockF16 {
    static constexpr int QK = 8, BYTES = 16;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int, float* w) {
        uint4 v = *(const uint4*)b;
        unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = f16_bits_to_f32(words[i] & 0xFFFFu);
            w[2 * i + 1] = f16_bits_to_f32(words[i] >> 16);
        }
    }
};

struct BlockBF16 {
    static constexpr int QK = 8, BYTES = 16;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int, float* w) {
        uint4 v = *(const uint4*)b;
        unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[2 * i] = __uint_as_float(words[i] << 16);
            w[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
        }
    }
};

// Q4_0: {f16 d; u8 qs[16]}; element j < 16 is the low nibble of qs[j], element j + 16 the high nibble.
// w = d * (q - 8).
struct BlockQ4_0 {
    static constexpr int QK = 32, BYTES = 18;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        float d = f16_bits_to_f32(load_u16(b));
        uint2 qs = load8_align2(b + 2 + 8 * (chunk & 1));
        int shift = 4 * (chunk >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = d * (float)((int)((byte_of(qs, i) >> shift) & 0xFu) - 8);
    }
};

// Q4_1: {f16 d; f16 m; u8 qs[16]}, nibbles as Q4_0; w = d * q + m. 20-byte blocks are 4-byte aligned.
struct BlockQ4_1 {
    static constexpr int QK = 32, BYTES = 20;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        unsigned dm = *(const unsigned*)b;
        float d = f16_bits_to_f32(dm & 0xFFFFu), m = f16_bits_to_f32(dm >> 16);
        const unsigned* qp = (const unsigned*)(b + 4 + 8 * (chunk & 1));
        uint2 qs = make_uint2(qp[0], qp[1]);
        int shift = 4 * (chunk >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = d * (float)((byte_of(qs, i) >> shift) & 0xFu) + m;
    }
};

// Q5_0: {f16 d; u8 qh[4]; u8 qs[16]}; the low 4 bits as Q4_0, bit 4 of element j is bit j of the
// little-endian u32 qh. w = d * (q - 16).
struct BlockQ5_0 {
    static constexpr int QK = 32, BYTES = 22;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        float d = f16_bits_to_f32(load_u16(b));
        unsigned qh = load_u16(b + 2) | ((unsigned)load_u16(b + 4) << 16);
        uint2 qs = load8_align2(b + 6 + 8 * (chunk & 1));
        int shift = 4 * (chunk >> 1);
        unsigned high = qh >> (8 * chunk);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            unsigned q = ((byte_of(qs, i) >> shift) & 0xFu) | (((high >> i) & 1u) << 4);
            w[i] = d * (float)((int)q - 16);
        }
    }
};

// Q8_0: {f16 d; i8 qs[32]}; w = d * q.
struct BlockQ8_0 {
    static constexpr int QK = 32, BYTES = 34;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        float d = f16_bits_to_f32(load_u16(b));
        uint2 qs = load8_align2(b + 2 + 8 * chunk);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = d * (float)(signed char)byte_of(qs, i);
    }
};

// Q4_K: {f16 d; f16 dmin; u8 scales[12]; u8 qs[128]}: 8 sub-blocks of 32 elements, each with its own 6-bit
// scale and 6-bit min (a per-32 scale is what lets 4 bits track the weight's local range), packed as in
// get_scale_min_k4. Sub-block s is the low (s even) or high (s odd) nibbles of qs[32 * (s / 2) ..][0..32).
// w = d * scale[s] * q - dmin * min[s]. 144-byte blocks are 16-byte aligned, so qs loads are 8-byte loads.
struct BlockQ4_K {
    static constexpr int QK = 256, BYTES = 144;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        unsigned d_dmin = *(const unsigned*)b;
        const unsigned char* scales = b + 4;
        int sub = chunk >> 2;
        unsigned scale6, min6;
        if (sub < 4) {
            scale6 = scales[sub] & 63u;
            min6 = scales[sub + 4] & 63u;
        } else {  // low 4 bits in scales[sub + 4], top 2 bits in the spare bits 6..7 of scales[sub - 4] / [sub]
            scale6 = (scales[sub + 4] & 0xFu) | ((scales[sub - 4] >> 6) << 4);
            min6 = (scales[sub + 4] >> 4) | ((scales[sub] >> 6) << 4);
        }
        float scale = f16_bits_to_f32(d_dmin & 0xFFFFu) * (float)scale6;
        float offset = f16_bits_to_f32(d_dmin >> 16) * (float)min6;
        uint2 qs = *(const uint2*)(b + 16 + 32 * (sub >> 1) + 8 * (chunk & 3));
        int shift = 4 * (sub & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = scale * (float)((byte_of(qs, i) >> shift) & 0xFu) - offset;
    }
};

// Q6_K: {u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d}: two halves of 128 elements. In half h, element r
// takes its low 4 bits from ql[64h + r % 64] (low nibble for r < 64, high nibble otherwise) and its top
// 2 bits from qh[32h + r % 32] at bit 2 * (r / 32). w = d * scales[e / 16] * (q - 32), one int8 scale per 16.
struct BlockQ6_K {
    static constexpr int QK = 256, BYTES = 210;
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        int half = chunk >> 4;
        uint2 ql = load8_align2(b + 64 * half + 8 * (chunk & 7));
        uint2 qh = load8_align2(b + 128 + 32 * half + 8 * (chunk & 3));
        int low_shift = 4 * ((chunk >> 3) & 1);
        int high_shift = 2 * ((chunk >> 2) & 3);
        float scale = f16_bits_to_f32(load_u16(b + 208)) * (float)(signed char)b[192 + (chunk >> 1)];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            unsigned q = ((byte_of(ql, i) >> low_shift) & 0xFu) | (((byte_of(qh, i) >> high_shift) & 3u) << 4);
            w[i] = scale * (float)((int)q - 32);
        }
    }
};

// MXFP4 (gpt-oss's experts): {u8 e; u8 qs[16]}: 32 elements, e2m1 values (doubled, as gguf's kvalues
// 0 1 2 3 4 6 8 12 and their negatives) scaled by the halved e8m0 exponent 2^(e - 128) (gguf's
// e8m0_to_fp32_half). Element i < 16 is the low nibble of qs[i], element 16 + i its high nibble.
// 17-byte blocks have no alignment at all: byte loads only.
struct BlockMXFP4 {
    static constexpr int QK = 32, BYTES = 17;
    static __device__ __forceinline__ float e2m1_doubled(unsigned nibble) {
        const unsigned m = nibble & 7u;
        const float magnitude = m < 4u ? (float)m : (float)((2u + (m & 1u)) << ((m >> 1) - 1u));
        return nibble & 8u ? -magnitude : magnitude;
    }
    static __device__ __forceinline__ void decode8(const unsigned char* b, int chunk, float* w) {
        const unsigned e = b[0];
        const float d = __uint_as_float(e < 2u ? 0x00200000u << e : (e - 1u) << 23);
        const unsigned char* qs = b + 1 + 8 * (chunk & 1);
        const int shift = 4 * (chunk >> 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) w[i] = d * e2m1_doubled((qs[i] >> shift) & 0xFu);
    }
};
