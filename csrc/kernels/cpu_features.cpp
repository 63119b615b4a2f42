// Runtime ISA choice. A tier needs the CPU (CPUID leaves 1 and 7), the OS (XCR0 must enable the
// YMM state for AVX2, and the opmask and upper ZMM state for AVX-512: a kernel or hypervisor can
// hide them) and the build (its translation unit). We check all three, once, and name what is
// missing, so ZEN5_FORCE_ISA=avx512 on a Zen 3 says "CPU lacks AVX512F, ..." rather than SIGILL.
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels.h"

#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif

namespace zen5 {

#ifdef ZEN5_NO_AVX512
const Kernels* kernels_avx512() { return nullptr; }  // this build has only the reference
#endif
#ifdef ZEN5_NO_AVX2
const Kernels* kernels_avx2() { return nullptr; }
#endif
#ifdef ZEN5_NO_AVX2VNNI
const Kernels* kernels_avx2vnni() { return nullptr; }
#endif
const Kernels* kernels_amx() {
#ifdef ZEN5_NO_AMX
    return nullptr;
#else
    static const Kernels k = [] {
        Kernels t = *kernels_avx512();
        t.name = "amx";
        t.matmul_int8 = matmul_int8_amx;
        return t;
    }();
    return &k;
#endif
}

namespace {

struct Features {
    bool osxsave = false, ymm_os = false, zmm_os = false, tile_os = false;
    bool avx = false, fma = false, f16c = false, avx2 = false, avxvnni = false;
    bool f = false, dq = false, bw = false, vl = false, vnni512 = false;
    bool amx_tile = false, amx_int8 = false;
};

Features read_features() {
    Features x;
#if defined(__x86_64__) || defined(_M_X64)
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return x;
    x.osxsave = c & (1u << 27);
    x.avx = c & (1u << 28);
    x.fma = c & (1u << 12);
    x.f16c = c & (1u << 29);
    if (x.osxsave) {
        unsigned lo, hi;
        __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        x.ymm_os = (lo & 0x6u) == 0x6u;    // XCR0 bits 1 SSE, 2 AVX
        x.zmm_os = (lo & 0xE6u) == 0xE6u;  // + 5 opmask, 6 ZMM_Hi256, 7 Hi16_ZMM
        x.tile_os = (lo & 0x60000u) == 0x60000u;  // 17 XTILECFG, 18 XTILEDATA
    }
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        x.avx2 = b & (1u << 5);
        x.f = b & (1u << 16);
        x.dq = b & (1u << 17);
        x.bw = b & (1u << 30);
        x.vl = b & (1u << 31);
        x.vnni512 = c & (1u << 11);
        x.amx_tile = d & (1u << 24);
        x.amx_int8 = d & (1u << 25);
    }
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) x.avxvnni = a & (1u << 4);
#endif
    return x;
}

// "" when every named feature is present, else "CPU lacks A, B" / "OS does not save ..." /
// "not built" (the first that applies).
std::string missing(const Kernels* built, std::initializer_list<std::pair<const char*, bool>> cpu, bool os_ok,
                    const char* os_state) {
    std::string lacks;
    for (const auto& [name, ok] : cpu)
        if (!ok) lacks += (lacks.empty() ? "" : ", ") + std::string(name);
    if (!lacks.empty()) return "CPU lacks " + lacks;
    if (!os_ok) return std::string("OS does not save the ") + os_state + " state (XCR0)";
    if (!built) return "not built (compiler or target without these instructions)";
    return "";
}

// Linux enables the AMX tile data state (8 KB per thread) only for a process that asks for it
// (arch_prctl ARCH_REQ_XCOMP_PERM, Linux 5.16 and later); until then a tile instruction faults.
// Permission is per process and covers the threads it starts later too.
bool request_tile_permission() {
#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
    return false;
#endif
}

struct Tiers {
    std::string why[kTierCount];
    const Kernels* table[kTierCount];
    Tiers() {
        const Features x = read_features();
        table[0] = &kernels_ref();
        why[1] = missing(kernels_avx2(), {{"AVX", x.avx}, {"AVX2", x.avx2}, {"FMA", x.fma}, {"F16C", x.f16c}},
                         x.ymm_os, "YMM");
        table[1] = why[1].empty() ? kernels_avx2() : nullptr;
        why[2] = missing(kernels_avx2vnni(),
                         {{"AVX", x.avx}, {"AVX2", x.avx2}, {"FMA", x.fma}, {"F16C", x.f16c}, {"AVX-VNNI", x.avxvnni}},
                         x.ymm_os, "YMM");
        table[2] = why[2].empty() ? kernels_avx2vnni() : nullptr;
        why[3] = missing(kernels_avx512(),
                         {{"AVX512F", x.f}, {"AVX512DQ", x.dq}, {"AVX512BW", x.bw}, {"AVX512VL", x.vl},
                          {"AVX512_VNNI", x.vnni512}, {"FMA", x.fma}, {"F16C", x.f16c}},
                         x.zmm_os, "ZMM");
        table[3] = why[3].empty() ? kernels_avx512() : nullptr;
        why[4] = missing(kernels_amx(),
                         {{"AVX512F", x.f}, {"AVX512DQ", x.dq}, {"AVX512BW", x.bw}, {"AVX512VL", x.vl},
                          {"AVX512_VNNI", x.vnni512}, {"FMA", x.fma}, {"F16C", x.f16c}, {"AMX-TILE", x.amx_tile},
                          {"AMX-INT8", x.amx_int8}},
                         x.zmm_os && x.tile_os, "ZMM and AMX tile");
        if (why[4].empty() && !request_tile_permission())
            why[4] = "OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16 or later)";
        table[4] = why[4].empty() ? kernels_amx() : nullptr;
    }
};

const Tiers& tiers() {
    static const Tiers t;
    return t;
}

constexpr const char* kTierNames[kTierCount] = {"ref", "avx2", "avx2vnni", "avx512", "amx"};

}  // namespace

IsaTier isa_tier(int i) {
    const Tiers& t = tiers();
    return {kTierNames[i], t.table[i], t.why[i].c_str()};
}

bool cpu_supports_avx512() { return isa_tier(3).kernels != nullptr; }

int64_t int8_span_blocks(int64_t blocks, int n) noexcept {
    static const int64_t l2 = [] {
        const long v = sysconf(_SC_LEVEL2_CACHE_SIZE);  // glibc: from CPUID; 0 where unknown
        return v > 0 ? int64_t(v) : int64_t(1) << 20;
    }();
    const int64_t total = blocks * n * (QK + 12);
    if (n <= 1 || total <= l2 / 2) return blocks;
    const int64_t spans = (total + l2 / 4 - 1) / (l2 / 4);
    return (blocks + spans - 1) / spans;
}

bool cpu_is_amd() noexcept {
    static const bool amd = [] {
#if defined(__x86_64__) || defined(_M_X64)
        unsigned a, b, c, d;
        if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
        char v[13];  // the vendor string: EBX, EDX, ECX
        std::memcpy(v, &b, 4), std::memcpy(v + 4, &d, 4), std::memcpy(v + 8, &c, 4), v[12] = 0;
        return std::strcmp(v, "AuthenticAMD") == 0;
#else
        return false;
#endif
    }();
    return amd;
}

const Kernels& kernels_by_name(const char* name) {
    for (int i = 0; i < kTierCount; ++i)
        if (std::strcmp(name, kTierNames[i]) == 0) {
            const IsaTier t = isa_tier(i);
            if (!t.kernels) throw std::runtime_error(std::string(name) + " kernels unavailable: " + t.missing);
            return *t.kernels;
        }
    throw std::runtime_error(std::string("unknown ISA '") + name + "' (expected ref, avx2, avx2vnni, avx512 or amx)");
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
        for (int i = kTierCount - 1; i >= 0 && !g_active; --i) g_active = isa_tier(i).kernels;
    }
    return *g_active;
}

const Kernels& active_kernels() { return select_kernels(); }

}  // namespace zen5
