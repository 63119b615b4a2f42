// Runtime ISA choice. AVX-512 needs both the CPU (CPUID leaf 7) and the OS (XCR0 must enable
// the opmask and upper ZMM state; a kernel or hypervisor can hide it). We check both, once.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace zen5 {

#ifdef ZEN5_NO_AVX512
const Kernels* kernels_avx512() { return nullptr; }  // this build has only the reference
#endif

bool cpu_supports_avx512() {
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(ZEN5_NO_AVX512)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
    const bool osxsave = c & (1u << 27), fma = c & (1u << 12), f16c = c & (1u << 29);
    if (!osxsave || !fma || !f16c) return false;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    // XCR0 bits: 1 SSE, 2 AVX, 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM
    if ((lo & 0xE6u) != 0xE6u) return false;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool f = b & (1u << 16), dq = b & (1u << 17), bw = b & (1u << 30), vl = b & (1u << 31);
    const bool vnni = c & (1u << 11);  // int8 dot products (Zen 4/5, Ice Lake and later)
    return f && dq && bw && vl && vnni && kernels_avx512() != nullptr;
#else
    return false;
#endif
}

const Kernels& kernels_by_name(const char* name) {
    if (std::strcmp(name, "ref") == 0) return kernels_ref();
    if (std::strcmp(name, "avx512") == 0) {
        if (!cpu_supports_avx512())
            throw std::runtime_error("AVX-512 kernels requested but this CPU/OS/build lacks AVX-512");
        return *kernels_avx512();
    }
    throw std::runtime_error(std::string("unknown ISA '") + name + "' (expected ref or avx512)");
}

static const Kernels* g_active = nullptr;

const Kernels& select_kernels() {
    if (g_active) return *g_active;
    const char* force = std::getenv("ZEN5_FORCE_ISA");
    if (force && *force) {
        try {
            g_active = &kernels_by_name(force);
        } catch (const std::exception& e) {
            throw std::runtime_error(std::string("ZEN5_FORCE_ISA=") + force + ": " + e.what());
        }
    } else {
        g_active = cpu_supports_avx512() ? kernels_avx512() : &kernels_ref();
    }
    return *g_active;
}

const Kernels& active_kernels() { return select_kernels(); }

}  // namespace zen5
