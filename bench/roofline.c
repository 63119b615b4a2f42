/* Hardware roofs for the benchmark (issue 7): read / triad bandwidth and int8 / fp32 FMA peaks,
 * at a given thread count, for one zen5 ISA tier. Compiled on the fly by bench/roofline.py, once
 * per tier, with only that tier's flags (never -march=native):
 *   avx512    -DROOF_AVX512 -mavx512f -mavx512bw -mavx512vnni: zmm loads, vpdpbusd zmm, vfmadd zmm
 *   amx       the avx512 flags and -DROOF_AMX -mamx-tile -mamx-int8: the avx512 roofs, and TDPBSSD on
 *             tiles (the amx tier's int8 products run on the tile unit: its int8 roof is this one)
 *   avx2vnni  -DROOF_AVX2VNNI -mavx2 -mfma -mavxvnni: ymm loads, vpdpbusd ymm (VEX), vfmadd ymm
 *   avx2      -DROOF_AVX2 -mavx2 -mfma: ymm loads, vfmadd ymm, and two int8 sequences:
 *             vpmaddubsw+vpaddw (int16 sums: zen5's Q4 inner loop; the int8 roof of this tier)
 *             and vpmaddubsw+vpmaddwd+vpaddd (the full int8 -> int32 dot product), both reported
 * and never shipped: it measures the machine, not zen5. One vpmaddubsw ymm = 32 u8 x s8 products
 * = 64 ops, counted like vpdpbusd (zmm: 64 products = 128 ops; ymm: 64 ops); the adds that follow
 * it are part of the sequence, not extra ops.
 *
 * Why each kernel looks the way it does:
 *  - read: 8 independent zmm accumulators so the loop is bound by loads, not by the add latency;
 *    each thread streams its own contiguous half of the buffer (as zen5's GEMV threads do).
 *  - triad: a[i] = b[i] + s * c[i] on floats, counted as STREAM counts it (3 x 4 bytes per
 *    element, no write-allocate traffic), so it is comparable with published STREAM figures.
 *  - peaks: 16 independent accumulator chains with zmm (10 with ymm: 16 registers only, and an
 *    accumulator that does not fit in one is spilled; 10 is still more than latency x throughput =
 *    4 x 2 = 8), so the loop is bound by the two FMA / VNNI ports; 8 for the vpmaddubsw chains,
 *    where only the 1-cycle add is on the chain. One vpdpbusd zmm = 16 lanes x 4 int8 MACs = 128 ops; one vfmadd231ps zmm = 16 x 2 = 32
 *    flops (ymm: half). In the vpmaddubsw chains only the add is on the chain; an empty asm on the
 *    shared operand before each step keeps the compiler from merging the identical products.
 *  - every loop over accumulators is fully unrolled (`#pragma GCC unroll`): an accumulator array
 *    indexed in a rolled loop lives on the stack, and the store-to-load chain through memory
 *    then measures forwarding latency, not the ports (it cost 3-4x here).
 * Each figure is the best of short timed passes repeated for at least 1 s (best, not median:
 * a roof is what the hardware can do; interference from other work only lowers a pass).
 * Usage: roofline THREADS LLC_BYTES DRAM_BYTES   -> one JSON object on stdout.
 *        roofline THREADS 0 DRAM_BYTES           -> {"read_dram_gbps": ...} only (a quick probe
 *        between timed repetitions: on a shared host the DRAM bandwidth a guest gets moves
 *        from minute to minute).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#if defined(ROOF_AVX512)
#if defined(ROOF_AMX)
#define TIER "amx"
#else
#define TIER "avx512"
#endif
typedef __m512 vf;
#define VF_W 16
#define vf_zero _mm512_setzero_ps
#define vf_set1 _mm512_set1_ps
#define vf_add _mm512_add_ps
#define vf_load _mm512_load_ps
#define vf_store _mm512_store_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_sum _mm512_reduce_add_ps
#define CHAINS 16     /* accumulator chains of every peak */
#define I8_CHAINS 16
#elif defined(ROOF_AVX2VNNI) || defined(ROOF_AVX2)
#if defined(ROOF_AVX2VNNI)
#define TIER "avx2vnni"
#else
#define TIER "avx2"
#endif
typedef __m256 vf;
#define VF_W 8
#define vf_zero _mm256_setzero_ps
#define vf_set1 _mm256_set1_ps
#define vf_add _mm256_add_ps
#define vf_load _mm256_load_ps
#define vf_store _mm256_store_ps
#define vf_fmadd _mm256_fmadd_ps
static float vf_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static int vi_sum(__m256i v) {
    int x[8];
    _mm256_storeu_si256((__m256i*)x, v);
    return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7];
}
#define CHAINS 10     /* fp32 FMA / vpdpbusd chains: 4-5 cycles x 2 ports, + a, b: 12 of 16 ymm */
#define I8_CHAINS 8   /* vpmaddubsw chains: only the 1-cycle add is on the chain; + a, b, product, ones */
#else
#error "define ROOF_AVX512, ROOF_AVX2VNNI or ROOF_AVX2"
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static volatile float sink_f;
static volatile int sink_i;

/* GB/s reading n floats (n divisible by VF_W * 8 * threads). */
static double read_bw(const float* buf, size_t n, int threads) {
    double best = 1e30;
    size_t bytes = n * sizeof(float);
    int passes = 0;
    double t_total = 0;
    while (passes < 5 || (t_total < 1.0 && passes < 200)) {
        double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t per = n / nt, lo = per * t, hi = lo + per;
            vf acc[8];
            for (int k = 0; k < 8; k++) acc[k] = vf_zero();
            for (size_t i = lo; i < hi; i += 8 * VF_W)
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) acc[k] = vf_add(acc[k], vf_load(buf + i + VF_W * k));
            for (int k = 1; k < 8; k++) acc[0] = vf_add(acc[0], acc[k]);
            sink_f = vf_sum(acc[0]);
        }
        double dt = now() - t0;
        t_total += dt;
        if (dt < best) best = dt;
        passes++;
    }
    return bytes / best * 1e-9;
}

static double triad_bw(float* a, const float* b, const float* c, size_t n, int threads) {
    double best = 1e30;
    int passes = 0;
    double t_total = 0;
    while (passes < 5 || (t_total < 1.0 && passes < 200)) {
        double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            size_t per = n / nt, lo = per * t, hi = lo + per;
            vf s = vf_set1(3.0f);
            for (size_t i = lo; i < hi; i += VF_W)
                vf_store(a + i, vf_fmadd(s, vf_load(c + i), vf_load(b + i)));
        }
        double dt = now() - t0;
        t_total += dt;
        if (dt < best) best = dt;
        passes++;
    }
    return 3.0 * n * sizeof(float) / best * 1e-9;
}

#define ITERS 4000000L  /* per pass: ~20 ms; passes repeat for >= 1 s, best kept */

/* The best of passes repeated for >= 1 s (at least 5) of `pass`, as Gop/s: each pass runs
 * ITERS / chains x chains chain steps of `ops` ops on every thread. */
static double peak(void (*pass)(int), int threads, int chains, double ops) {
    double best = 1e30, t_total = 0;
    for (int p = 0; p < 5 || (t_total < 1.0 && p < 100); p++) {
        double t0 = now();
        pass(threads);
        double dt = now() - t0;
        t_total += dt;
        if (dt < best) best = dt;
    }
    return (double)threads * (ITERS / chains) * chains * ops / best * 1e-9;
}

#define KEEP(x) __asm__ __volatile__("" : "+x"(x))  /* the value may have changed: recompute */

#if defined(ROOF_AVX512)
static void vnni_pass(int threads) {
#pragma omp parallel num_threads(threads)
    {
        __m512i acc[CHAINS];
        __m512i a = _mm512_set1_epi8(1 + omp_get_thread_num()), b = _mm512_set1_epi8(3);
        for (int k = 0; k < CHAINS; k++) acc[k] = _mm512_set1_epi32(k);
        for (long i = 0; i < ITERS / CHAINS; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < CHAINS; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
            KEEP(a); KEEP(b);  /* keep the operands live */
        }
        for (int k = 1; k < CHAINS; k++) acc[0] = _mm512_add_epi32(acc[0], acc[k]);
        sink_i = _mm512_reduce_add_epi32(acc[0]);
    }
}
#define INT8_OPS 128
#if defined(ROOF_AMX)
#include <sys/syscall.h>
#include <unistd.h>
/* Linux keeps a process out of the tile data state until it asks (arch_prctl ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA); without it the first tile instruction faults. */
static int amx_permitted(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

/* Palette 1, all eight tiles 16 rows x 64 bytes: tmm0..3 int32 accumulators, tmm4/5 A, tmm6/7 B. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Four independent TDPBSSD chains of full tiles, 16 x 16 x 64 int8 MACs = 32,768 ops each: a
 * TDP takes 16 cycles on the tile unit, so four accumulators in flight keep it busy. A pass
 * runs ITERS / 16 TDPs (4M cycles, twice a vpdpbusd pass), so a step is counted as
 * AMX_STEP_OPS = 32,768 / 16 ops. */
#define AMX_STEP_OPS (2.0 * 16 * 16 * 64 / 16)
static void amx_pass(int threads) {
#pragma omp parallel num_threads(threads)
    {
        static __thread struct tile_config cfg __attribute__((aligned(64)));
        static __thread int8_t ab[2][1024] __attribute__((aligned(64)));
        static __thread int32_t c[256] __attribute__((aligned(64)));
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int i = 0; i < 8; i++) cfg.colsb[i] = 64, cfg.rows[i] = 16;
        memset(ab, 1 + omp_get_thread_num(), sizeof ab);
        _tile_loadconfig(&cfg);
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        _tile_loadd(4, ab[0], 64); _tile_loadd(5, ab[1], 64);
        _tile_loadd(6, ab[1], 64); _tile_loadd(7, ab[0], 64);
        for (long i = 0; i < ITERS / 64; i++) {
            _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7);
            _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7);
        }
        _tile_stored(0, c, 64);
        sink_i = c[0];
        _tile_release();
    }
}
#endif
#elif defined(ROOF_AVX2VNNI)
static void vnni_pass(int threads) {
#pragma omp parallel num_threads(threads)
    {
        __m256i acc[CHAINS];
        __m256i a = _mm256_set1_epi8(1 + omp_get_thread_num()), b = _mm256_set1_epi8(3);
        for (int k = 0; k < CHAINS; k++) acc[k] = _mm256_set1_epi32(k);
        for (long i = 0; i < ITERS / CHAINS; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < CHAINS; k++) acc[k] = _mm256_dpbusd_avx_epi32(acc[k], a, b);
            KEEP(a); KEEP(b);
        }
        for (int k = 1; k < CHAINS; k++) acc[0] = _mm256_add_epi32(acc[0], acc[k]);
        sink_i = vi_sum(acc[0]);
    }
}
#define INT8_OPS 64
#else
/* vpmaddubsw + vpaddw: int16 sums (zen5's Q4 inner loop), the tier's int8 roof */
static void maddubs_i16_pass(int threads) {
#pragma omp parallel num_threads(threads)
    {
        __m256i acc[I8_CHAINS];
        __m256i a = _mm256_set1_epi8(1 + omp_get_thread_num()), b = _mm256_set1_epi8(3);
        for (int k = 0; k < I8_CHAINS; k++) acc[k] = _mm256_set1_epi16(k);
        for (long i = 0; i < ITERS / I8_CHAINS; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < I8_CHAINS; k++) {
                KEEP(a);  /* one product per chain, not one shared by all */
                acc[k] = _mm256_add_epi16(acc[k], _mm256_maddubs_epi16(a, b));
            }
            KEEP(b);
        }
        for (int k = 1; k < I8_CHAINS; k++) acc[0] = _mm256_add_epi16(acc[0], acc[k]);
        sink_i = vi_sum(acc[0]);
    }
}
/* vpmaddubsw + vpmaddwd(ones) + vpaddd: the full int8 -> int32 dot product */
static void maddubs_i32_pass(int threads) {
#pragma omp parallel num_threads(threads)
    {
        __m256i acc[I8_CHAINS];
        __m256i a = _mm256_set1_epi8(1 + omp_get_thread_num()), b = _mm256_set1_epi8(3);
        __m256i ones = _mm256_set1_epi16(1);
        for (int k = 0; k < I8_CHAINS; k++) acc[k] = _mm256_set1_epi32(k);
        for (long i = 0; i < ITERS / I8_CHAINS; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < I8_CHAINS; k++) {
                KEEP(a);
                acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
            }
            KEEP(b);
        }
        for (int k = 1; k < I8_CHAINS; k++) acc[0] = _mm256_add_epi32(acc[0], acc[k]);
        sink_i = vi_sum(acc[0]);
    }
}
#define INT8_OPS 64
#endif

static void fma_pass(int threads) {
#pragma omp parallel num_threads(threads)
    {
        vf acc[CHAINS];
        vf a = vf_set1(0.999f), b = vf_set1(1e-7f);
        for (int k = 0; k < CHAINS; k++) acc[k] = vf_set1((float)k);
        for (long i = 0; i < ITERS / CHAINS; i++) {
#pragma GCC unroll 16
            for (int k = 0; k < CHAINS; k++) acc[k] = vf_fmadd(acc[k], a, b);
            KEEP(a); KEEP(b);
        }
        for (int k = 1; k < CHAINS; k++) acc[0] = vf_add(acc[0], acc[k]);
        sink_f = vf_sum(acc[0]);
    }
}

/* On 2 MiB pages where the kernel allows (THP "madvise" mode needs the hint), as zen5 holds its
 * weights (model.cpp alloc_zeroed): on 4 KiB pages the 1 GiB read paid TLB misses zen5's GEMV
 * does not, and its roof sat below what the GEMV reached. */
static float* alloc_floats(size_t n) {
    size_t huge = (size_t)2 << 20, bytes = (n * sizeof(float) + huge - 1) / huge * huge;
    float* p = aligned_alloc(huge, bytes);
    if (!p) { fprintf(stderr, "roofline: out of memory\n"); exit(1); }
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    for (size_t i = 0; i < n; i++) p[i] = (float)(i & 1023) * 1e-3f;  /* fault every page in */
    return p;
}

int main(int argc, char** argv) {
    if (argc != 4) { fprintf(stderr, "usage: roofline THREADS LLC_BYTES DRAM_BYTES\n"); return 2; }
    int threads = atoi(argv[1]);
    size_t sizes[2] = {(size_t)atoll(argv[2]), (size_t)atoll(argv[3])};
    if (sizes[0] == 0) {
        size_t quantum = 128 * 2 * 16, n = sizes[1] / sizeof(float) / quantum * quantum;
        float* buf = alloc_floats(n);
        printf("{\"threads\": %d, \"dram_bytes\": %zu, \"read_dram_gbps\": %.2f}\n", threads, sizes[1],
               read_bw(buf, n, threads));
        free(buf);
        return 0;
    }
    double rd[2], tr[2];
    size_t quantum = 128 * 2 * 16;  /* elements: divisible for every loop and both thread counts */
    for (int s = 0; s < 2; s++) {
        size_t n = sizes[s] / sizeof(float) / quantum * quantum;
        float* buf = alloc_floats(n);
        rd[s] = read_bw(buf, n, threads);
        free(buf);
        size_t m = sizes[s] / 3 / sizeof(float) / quantum * quantum;
        float *a = alloc_floats(m), *b = alloc_floats(m), *c = alloc_floats(m);
        tr[s] = triad_bw(a, b, c, m, threads);
        free(a); free(b); free(c);
    }
    printf("{\"tier\": \"%s\", \"threads\": %d, \"llc_bytes\": %zu, \"dram_bytes\": %zu, "
           "\"read_llc_gbps\": %.2f, \"read_dram_gbps\": %.2f, \"triad_llc_gbps\": %.2f, "
           "\"triad_dram_gbps\": %.2f, ", TIER, threads, sizes[0], sizes[1], rd[0], rd[1], tr[0], tr[1]);
#if defined(ROOF_AVX512) || defined(ROOF_AVX2VNNI)
    double int8 = peak(vnni_pass, threads, CHAINS, INT8_OPS);
    printf("\"vnni_int8_gops\": %.1f, ", int8);
    const char* int8_insn = VF_W == 16 ? "vpdpbusd zmm" : "vpdpbusd ymm (VEX)";
#if defined(ROOF_AMX)
    if (!amx_permitted()) { fprintf(stderr, "roofline: the OS refused the AMX tile state (arch_prctl)\n"); return 1; }
    int8 = peak(amx_pass, threads, 1, AMX_STEP_OPS);
    printf("\"amx_int8_gops\": %.1f, ", int8);
    int8_insn = "tdpbssd (AMX tiles)";
#endif
#else
    double int8 = peak(maddubs_i16_pass, threads, I8_CHAINS, INT8_OPS), i32 = peak(maddubs_i32_pass, threads, I8_CHAINS, INT8_OPS);
    printf("\"maddubs_i16_gops\": %.1f, \"maddubs_i32_gops\": %.1f, ", int8, i32);
    const char* int8_insn = "vpmaddubsw+vpaddw ymm";
#endif
    double fma = peak(fma_pass, threads, CHAINS, 2 * VF_W);
    printf("\"fma_fp32_gflops\": %.1f, \"int8_gops\": %.1f, \"int8_insn\": \"%s\", "
           "\"fma_insn\": \"vfmadd231ps %s\"}\n", fma, int8, int8_insn, VF_W == 16 ? "zmm" : "ymm");
    return 0;
}
