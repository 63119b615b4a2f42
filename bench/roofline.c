/* Hardware roofs for the benchmark (issue 7): read / triad bandwidth and int8 VNNI / fp32 FMA
 * peaks, at a given thread count. Compiled on the fly by bench/roofline.py with
 *   gcc -O3 -mavx512f -mavx512bw -mavx512vnni -fopenmp
 * and never shipped: it measures the machine, not zen5.
 *
 * Why each kernel looks the way it does:
 *  - read: 8 independent zmm accumulators so the loop is bound by loads, not by the add latency;
 *    each thread streams its own contiguous half of the buffer (as zen5's GEMV threads do).
 *  - triad: a[i] = b[i] + s * c[i] on floats, counted as STREAM counts it (3 x 4 bytes per
 *    element, no write-allocate traffic), so it is comparable with published STREAM figures.
 *  - peaks: 16 independent accumulator chains (more than latency x throughput = 4 x 2 = 8), so
 *    the loop is bound by the two FMA / VNNI ports. One vpdpbusd = 16 lanes x 4 int8 MACs =
 *    128 ops; one vfmadd231ps zmm = 16 x 2 = 32 flops.
 *  - every loop over accumulators is fully unrolled (`#pragma GCC unroll`): an accumulator array
 *    indexed in a rolled loop lives on the stack, and the store-to-load chain through memory
 *    then measures forwarding latency, not the ports (it cost 3-4x here).
 * Each figure is the best of short timed passes repeated for at least 1 s (best, not median:
 * a roof is what the hardware can do; interference from other work only lowers a pass).
 * Usage: roofline THREADS LLC_BYTES DRAM_BYTES   -> one JSON object on stdout.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static volatile float sink_f;
static volatile int sink_i;

/* GB/s reading n floats (n divisible by 16 * 8 * threads). */
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
            __m512 acc[8];
            for (int k = 0; k < 8; k++) acc[k] = _mm512_setzero_ps();
            for (size_t i = lo; i < hi; i += 128)
#pragma GCC unroll 8
                for (int k = 0; k < 8; k++) acc[k] = _mm512_add_ps(acc[k], _mm512_load_ps(buf + i + 16 * k));
            for (int k = 1; k < 8; k++) acc[0] = _mm512_add_ps(acc[0], acc[k]);
            sink_f = _mm512_reduce_add_ps(acc[0]);
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
            __m512 s = _mm512_set1_ps(3.0f);
            for (size_t i = lo; i < hi; i += 16)
                _mm512_store_ps(a + i, _mm512_fmadd_ps(s, _mm512_load_ps(c + i), _mm512_load_ps(b + i)));
        }
        double dt = now() - t0;
        t_total += dt;
        if (dt < best) best = dt;
        passes++;
    }
    return 3.0 * n * sizeof(float) / best * 1e-9;
}

#define ITERS 4000000L  /* per pass: ~20 ms; passes repeat for >= 1 s, best kept */

static double vnni_peak(int threads) {
    double best = 1e30, t_total = 0;
    for (int pass = 0; pass < 5 || (t_total < 1.0 && pass < 100); pass++) {
        double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            __m512i acc[16];
            __m512i a = _mm512_set1_epi8(1 + omp_get_thread_num()), b = _mm512_set1_epi8(3);
            for (int k = 0; k < 16; k++) acc[k] = _mm512_set1_epi32(k);
            for (long i = 0; i < ITERS / 16; i++) {
#pragma GCC unroll 16
                for (int k = 0; k < 16; k++) acc[k] = _mm512_dpbusd_epi32(acc[k], a, b);
                __asm__ __volatile__("" : "+v"(a), "+v"(b));  /* keep the operands live */
            }
            for (int k = 1; k < 16; k++) acc[0] = _mm512_add_epi32(acc[0], acc[k]);
            sink_i = _mm512_reduce_add_epi32(acc[0]);
        }
        double dt = now() - t0;
        t_total += dt;
        if (dt < best) best = dt;
    }
    return (double)threads * (ITERS / 16) * 16 * 128 / best * 1e-9;
}

static double fma_peak(int threads) {
    double best = 1e30, t_total = 0;
    for (int pass = 0; pass < 5 || (t_total < 1.0 && pass < 100); pass++) {
        double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            __m512 acc[16];
            __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-7f);
            for (int k = 0; k < 16; k++) acc[k] = _mm512_set1_ps((float)k);
            for (long i = 0; i < ITERS / 16; i++) {
#pragma GCC unroll 16
                for (int k = 0; k < 16; k++) acc[k] = _mm512_fmadd_ps(acc[k], a, b);
                __asm__ __volatile__("" : "+v"(a), "+v"(b));
            }
            for (int k = 1; k < 16; k++) acc[0] = _mm512_add_ps(acc[0], acc[k]);
            sink_f = _mm512_reduce_add_ps(acc[0]);
        }
        double dt = now() - t0;
        t_total += dt;
        if (dt < best) best = dt;
    }
    return (double)threads * (ITERS / 16) * 16 * 32 / best * 1e-9;
}

static float* alloc_floats(size_t n) {
    float* p = aligned_alloc(64, n * sizeof(float));
    if (!p) { fprintf(stderr, "roofline: out of memory\n"); exit(1); }
    for (size_t i = 0; i < n; i++) p[i] = (float)(i & 1023) * 1e-3f;  /* fault every page in */
    return p;
}

int main(int argc, char** argv) {
    if (argc != 4) { fprintf(stderr, "usage: roofline THREADS LLC_BYTES DRAM_BYTES\n"); return 2; }
    int threads = atoi(argv[1]);
    size_t sizes[2] = {(size_t)atoll(argv[2]), (size_t)atoll(argv[3])};
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
    double vnni = vnni_peak(threads), fma = fma_peak(threads);
    printf("{\"threads\": %d, \"llc_bytes\": %zu, \"dram_bytes\": %zu, \"read_llc_gbps\": %.2f, "
           "\"read_dram_gbps\": %.2f, \"triad_llc_gbps\": %.2f, \"triad_dram_gbps\": %.2f, "
           "\"vnni_int8_gops\": %.1f, \"fma_fp32_gflops\": %.1f}\n",
           threads, sizes[0], sizes[1], rd[0], rd[1], tr[0], tr[1], vnni, fma);
    return 0;
}
