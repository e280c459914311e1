// A CPU stand-in for the CUDA runtime pieces our kernels use, so a .cu file compiles with g++ and its
// blocks run on the host: each CUDA thread is an OS thread, __syncthreads a barrier over the block,
// warp shuffles a barrier over 32 lanes around a shared mailbox. Blocks run one after another, so
// `__shared__` can be a function-static. Slow (thousands of OS threads), exact in control flow.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct float4 { float x, y, z, w; };

namespace emu {
struct Warp {
    std::barrier<> barrier{32};
    unsigned long long mailbox[32];
    alignas(16) unsigned char scratch[32 * 32];  // warp-collective PTX (ptx_emulation.h: mma operands)
};
struct Block {
    std::unique_ptr<std::barrier<>> barrier;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> dynamic_shared;
};
inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block = nullptr;
inline unsigned char* dynamic_shared_base = nullptr;

inline unsigned lane() { return thread_idx.x & 31; }
inline Warp& warp() { return *block->warps[thread_idx.x >> 5]; }

template <typename T>
T exchange(T value, unsigned source_lane, bool keep_own) {
    static_assert(sizeof(T) <= 8);
    Warp& w = warp();
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    w.mailbox[lane()] = bits;
    w.barrier.arrive_and_wait();
    T result = value;
    if (!keep_own) std::memcpy(&result, &w.mailbox[source_lane & 31], sizeof(T));
    w.barrier.arrive_and_wait();  // nobody overwrites the mailbox before every lane has read it
    return result;
}

inline void launch(dim3 grid, dim3 threads, size_t shared_bytes, const std::function<void()>& kernel) {
    const unsigned n = threads.x * threads.y * threads.z;
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block b;
                b.barrier = std::make_unique<std::barrier<>>(n);
                for (unsigned w = 0; w < (n + 31) / 32; ++w) b.warps.push_back(std::make_unique<Warp>());
                b.dynamic_shared.assign(shared_bytes + 16, 0xA5);  // garbage, as on a GPU
                dynamic_shared_base = b.dynamic_shared.data();
                std::vector<std::thread> pool;
                for (unsigned t = 0; t < n; ++t)
                    pool.emplace_back([&, t] {
                        thread_idx = dim3{t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y)};
                        block_idx = dim3{bx, by, bz};
                        block_dim = threads;
                        grid_dim = grid;
                        block = &b;
                        kernel();
                        b.barrier->arrive_and_drop();  // an exited thread no longer holds up __syncthreads
                        b.warps[t >> 5]->barrier.arrive_and_drop();
                    });
                for (auto& th : pool) th.join();
            }
}
}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__

inline void __syncthreads() { emu::block->barrier->arrive_and_wait(); }
template <typename T> T __shfl_xor_sync(unsigned, T v, int offset) { return emu::exchange(v, emu::lane() ^ offset, false); }
template <typename T> T __shfl_up_sync(unsigned, T v, unsigned delta) {
    return emu::exchange(v, emu::lane() - delta, emu::lane() < delta);
}
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __int_as_float(unsigned int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return (unsigned int)(((unsigned long long)a * b) >> 32); }
template <typename T> T atomicAdd(T* address, T value) { return __atomic_fetch_add(address, value, __ATOMIC_RELAXED); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

