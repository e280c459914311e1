// A CPU stand-in for the CUDA runtime pieces our kernels use, so a .cu file compiles with g++ and its
// blocks run on the host: each CUDA thread is a fiber (ucontext) of one OS thread, run round-robin;
// __syncthreads is a barrier over the block's fibers, warp shuffles a barrier over 32 lanes around a shared
// mailbox. A fiber runs until it waits at a barrier, so switching costs a swapcontext instead of an OS
// thread wake-up (thousands of barrier phases a block in the matvec reductions). Blocks run one after
// another, so `__shared__` can be a function-static. Exact in control flow, not in timing or races.
#pragma once
#include <ucontext.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <memory>
#include <vector>

struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct float4 { float x, y, z, w; };

namespace emu {
// A barrier among fibers: the last to arrive opens it; the others yield until its generation moves on.
// An exited fiber drops out (as an exited CUDA thread no longer holds up __syncthreads).
struct Barrier {
    unsigned expected = 0, arrived = 0, generation = 0;
};
void yield();
inline thread_local unsigned long long progress = 0;  // arrivals and exits: a round without any is a deadlock
inline void wait(Barrier& b) {
    ++progress;
    const unsigned generation = b.generation;
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    while (b.generation == generation) yield();
}
inline void drop(Barrier& b) {
    ++progress;
    --b.expected;
    if (b.arrived > 0 && b.arrived == b.expected) {
        b.arrived = 0;
        ++b.generation;
    }
}

// Warp-collective operations post into one of two mailboxes, alternating: a lane can only post into a
// mailbox again after the next collective's barrier, which every lane reaches only after reading this one,
// so one barrier per collective suffices.
struct Warp {
    Barrier barrier;
    unsigned long long mailbox[2][32];
    alignas(16) unsigned char scratch[2][32 * 32];  // warp-collective PTX (ptx_emulation.h: mma operands)
};
struct Block {
    Barrier barrier;
    std::vector<Warp> warps;
    std::vector<unsigned char> dynamic_shared;
};
struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;  // never touched beyond what the kernel uses: pages commit lazily
    dim3 idx;
    unsigned collective = 0;
    bool done = false;
};
constexpr size_t STACK_BYTES = 256 * 1024;

// The running fiber's view (restored by the scheduler at every switch).
inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
inline thread_local Block* block = nullptr;
inline thread_local unsigned collective = 0;  // warp collectives this fiber has done (mailbox parity)
inline thread_local Fiber* current = nullptr;
inline thread_local ucontext_t scheduler;
inline thread_local const std::function<void()>* body = nullptr;
inline unsigned char* dynamic_shared_base = nullptr;
inline unsigned long long block_serial = 0;  // counts blocks run, for garbage_once

// Static __shared__ arrays are function-statics here; kernel_emulator.py follows each declaration with a call
// that fills the array with 0xFF bytes (NaN as float, -1 as an int) once per block, as a GPU block starts
// with undefined shared memory rather than the previous block's values.
inline void garbage_once(void* address, size_t nbytes) {
    static thread_local std::vector<std::pair<void*, unsigned long long>> filled;
    for (auto& [a, serial] : filled)
        if (a == address) {
            if (serial != block_serial) std::memset(address, 0xFF, nbytes), serial = block_serial;
            return;
        }
    std::memset(address, 0xFF, nbytes);
    filled.emplace_back(address, block_serial);
}

inline unsigned flat_thread() { return thread_idx.x + block_dim.x * (thread_idx.y + block_dim.y * thread_idx.z); }
inline unsigned lane() { return flat_thread() & 31; }
inline Warp& warp() { return block->warps[flat_thread() >> 5]; }

inline void yield() {
    current->collective = collective;
    swapcontext(&current->context, &scheduler);
}

template <typename T>
T exchange(T value, unsigned source_lane, bool keep_own) {
    static_assert(sizeof(T) <= 8);
    Warp& w = warp();
    unsigned long long* mailbox = w.mailbox[collective++ & 1];
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    mailbox[lane()] = bits;
    wait(w.barrier);
    T result = value;
    if (!keep_own) std::memcpy(&result, &mailbox[source_lane & 31], sizeof(T));
    return result;
}

inline void fiber_main() {
    (*body)();
    drop(block->barrier);
    drop(warp().barrier);
    current->done = true;
    current->collective = collective;
    swapcontext(&current->context, &scheduler);  // never resumed
}

inline void launch(dim3 grid, dim3 threads, size_t shared_bytes, const std::function<void()>& kernel) {
    const unsigned n = threads.x * threads.y * threads.z;
    std::vector<Fiber> fibers(n);
    for (auto& f : fibers) f.stack.reset(new char[STACK_BYTES]);
    body = &kernel;
    block_dim = threads;
    grid_dim = grid;
    // Blocks in a shuffled order, and every other block's fibers scheduled last-to-first: a GPU promises
    // no order between blocks, nor between threads up to a barrier, so a kernel (or a backend aliasing its
    // inputs and outputs) that depends on one fails here instead of on some GPU some day.
    const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    std::vector<unsigned long long> order(blocks);
    for (unsigned long long i = 0; i < blocks; ++i) order[i] = i;
    unsigned long long state = 0x9E3779B97F4A7C15ull ^ blocks;
    for (unsigned long long i = blocks; i > 1; --i) {  // Fisher-Yates with a fixed-seed xorshift
        state ^= state << 13, state ^= state >> 7, state ^= state << 17;
        std::swap(order[i - 1], order[state % i]);
    }
    for (unsigned long long position = 0; position < blocks; ++position) {
        const unsigned long long flat = order[position];
        const unsigned bx = flat % grid.x, by = (flat / grid.x) % grid.y, bz = flat / ((unsigned long long)grid.x * grid.y);
        const bool reverse = position & 1;
        ++block_serial;
        Block b;
        b.barrier.expected = n;
        b.warps.resize((n + 31) / 32);
        for (unsigned w = 0; w < b.warps.size(); ++w) b.warps[w].barrier.expected = std::min(32u, n - 32 * w);
        b.dynamic_shared.assign(shared_bytes + 16, 0xA5);  // garbage, as on a GPU
        dynamic_shared_base = b.dynamic_shared.data();
        block = &b;
        block_idx = dim3{bx, by, bz};
        for (unsigned t = 0; t < n; ++t) {
            Fiber& f = fibers[t];
            f.idx = dim3{t % threads.x, (t / threads.x) % threads.y, t / (threads.x * threads.y)};
            f.collective = 0;
            f.done = false;
            getcontext(&f.context);
            f.context.uc_stack.ss_sp = f.stack.get();
            f.context.uc_stack.ss_size = STACK_BYTES;
            f.context.uc_link = nullptr;
            makecontext(&f.context, fiber_main, 0);
        }
        for (bool running = true; running;) {  // round-robin until every fiber has returned
            running = false;
            const unsigned long long before = progress;
            for (unsigned i = 0; i < n; ++i) {
                Fiber& f = fibers[reverse ? n - 1 - i : i];
                if (f.done) continue;
                running = true;
                current = &f;
                thread_idx = f.idx;
                collective = f.collective;
                swapcontext(&scheduler, &f.context);
            }
            if (running && progress == before) {  // every live fiber waits on a barrier nobody can open
                std::fprintf(stderr, "emulated kernel deadlock in block (%u, %u, %u)\n", bx, by, bz);
                std::abort();
            }
        }
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

inline void __syncthreads() { emu::wait(emu::block->barrier); }
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

