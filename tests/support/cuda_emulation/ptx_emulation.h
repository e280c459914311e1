// CPU stand-ins for the inline PTX our kernels use (gemm_quant.cu, matvec_quant.cu) and the CUDA vector types
// around it. tests/support/kernel_emulator.py rewrites each `asm(...)` statement into a call of the function named
// after its instruction (dots -> underscores, prefixed `ptx_`), outputs passed by reference, in operand
// order; an instruction without a function here fails the build, so nothing is silently skipped.
// Included after cuda_emulation.h (uses its per-warp barrier).
#pragma once
#include <cstring>

struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
#define __align__(n) __attribute__((aligned(n)))

namespace emu {
// IEEE binary16 through the compiler's _Float16: the conversion rounds to nearest even, as cvt.rn does.
inline float half_bits_to_float(unsigned short bits) { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
inline unsigned short float_to_half_bits(float f) {
    _Float16 h = (_Float16)f;
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

// One warp's operands of an mma in flight: every lane posts its fragments, then reads everyone's.
struct MmaMailbox {
    unsigned a[32][4], b[32][2];
};
}  // namespace emu

// cvt.f32.f16 d, a: fp16 bits -> float (exact).
inline void ptx_cvt_f32_f16(float& d, unsigned short a) { d = emu::half_bits_to_float(a); }

// cvt.rn.f16x2.f32 d, a, b: the FIRST source goes to the UPPER half (PTX ISA), both rounded to nearest even.
inline void ptx_cvt_rn_f16x2_f32(unsigned& d, float a, float b) {
    d = ((unsigned)emu::float_to_half_bits(a) << 16) | emu::float_to_half_bits(b);
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0..d3}, {a0..a3}, {b0,b1}, {c0..c3} with c tied to d.
// Warp-collective: fragments are laid out as in the PTX ISA tables for m16n8k16 .f16 (g = lane / 4,
// t = lane % 4; the lower-indexed element in the low half of each register):
//   A (16x16, row): reg i holds row g + 8 * (i & 1), columns 2t, 2t + 1 (+ 8 for i >= 2)
//   B (16x8, col):  reg i holds rows 2t, 2t + 1 (+ 8 for i = 1), column g
//   C/D (16x8):     d0, d1 at row g, columns 2t, 2t + 1; d2, d3 at row g + 8
// Products of fp16 values are exact in fp32; the sums are fp32 in k order (hardware order may differ).
inline void ptx_mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32(
    float& d0, float& d1, float& d2, float& d3, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
    unsigned b0, unsigned b1) {
    static_assert(sizeof(emu::MmaMailbox) <= sizeof(emu::Warp::scratch[0]), "mailbox fits the warp's scratch");
    auto* box = reinterpret_cast<emu::MmaMailbox*>(emu::warp().scratch[emu::collective++ & 1]);
    const unsigned lane = emu::lane();
    const unsigned a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
    std::memcpy(box->a[lane], a, sizeof a);
    std::memcpy(box->b[lane], b, sizeof b);
    emu::wait(emu::warp().barrier);
    // This lane's outputs need rows g and g + 8 of A (held by lanes 4g .. 4g + 3) and columns 2t, 2t + 1 of B
    // (held by lanes 4c .. 4c + 3 for column c): decode just those.
    const int g = lane >> 2, t = lane & 3;
    float a_rows[2][16], b_cols[2][16];
    for (int tp = 0; tp < 4; ++tp) {
        for (int i = 0; i < 4; ++i) {
            const unsigned reg = box->a[4 * g + tp][i];
            const int col = 2 * tp + 8 * (i >> 1);
            a_rows[i & 1][col] = emu::half_bits_to_float(reg & 0xFFFF);
            a_rows[i & 1][col + 1] = emu::half_bits_to_float(reg >> 16);
        }
        for (int j = 0; j < 2; ++j)
            for (int i = 0; i < 2; ++i) {
                const unsigned reg = box->b[4 * (2 * t + j) + tp][i];
                const int k = 2 * tp + 8 * i;
                b_cols[j][k] = emu::half_bits_to_float(reg & 0xFFFF);
                b_cols[j][k + 1] = emu::half_bits_to_float(reg >> 16);
            }
    }
    float* d[4] = {&d0, &d1, &d2, &d3};  // d0, d1: row g; d2, d3: row g + 8; columns 2t, 2t + 1
    for (int i = 0; i < 4; ++i) {
        float sum = *d[i];
        for (int k = 0; k < 16; ++k) sum += a_rows[i >> 1][k] * b_cols[i & 1][k];
        *d[i] = sum;
    }
}
