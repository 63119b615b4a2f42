// For the SIMD tiers' translation units only: what they need from a standard library, with
// internal linkage. An inline or template function compiled in a tier file (std::vector's members,
// std::min) becomes a weak symbol, and the linker may keep that copy, built with AVX-512 flags, for
// the baseline code too; tests/test_isa_tiers.py checks that tier objects define no weak symbols.
#pragma once
#include <cstddef>
#include <cstdlib>

namespace zen5 {
namespace {

inline int imin(int a, int b) { return a < b ? a : b; }

// Per-thread scratch memory that grows to the largest request and is freed at thread exit
// (thread_local, like the std::vector it replaces); 64-byte aligned.
struct Scratch {
    void* p = nullptr;
    size_t bytes = 0;
    ~Scratch() { std::free(p); }
    template <typename T>
    T* get(size_t count) {
        const size_t need = (count * sizeof(T) + 63) / 64 * 64;
        if (need > bytes) {
            std::free(p);
            p = std::aligned_alloc(64, need);
            if (!p) std::abort();  // out of memory in a kernel: nothing sensible to return
            bytes = need;
        }
        return static_cast<T*>(p);
    }
};

}  // namespace
}  // namespace zen5
