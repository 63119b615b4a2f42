// AVX2 attention kernels (kernels_avx2.h). Placeholder: the reference's until the AVX2 versions land.
#include "kernels_avx2.h"

namespace zen5 {
namespace ZEN5_TIER {

void attn_scores(const float* q, int nq, const float* k, int64_t tstride, int n, int hd, float scale, float* out,
                 int64_t ldo) {
    kernels_ref().attn_scores(q, nq, k, tstride, n, hd, scale, out, ldo);
}
void attn_scores_h(const float* q, int nq, const uint16_t* k, int64_t tstride, int n, int hd, float scale,
                   float* out, int64_t ldo) {
    kernels_ref().attn_scores_h(q, nq, k, tstride, n, hd, scale, out, ldo);
}
void attn_values(const float* p, int64_t ldp, int nq, const float* v, int64_t stride, int n, int hd, float* out,
                 int64_t ldo) {
    kernels_ref().attn_values(p, ldp, nq, v, stride, n, hd, out, ldo);
}
void attn_values_h(const float* p, int64_t ldp, int nq, const uint16_t* v, int64_t stride, int n, int hd,
                   float* out, int64_t ldo) {
    kernels_ref().attn_values_h(p, ldp, nq, v, stride, n, hd, out, ldo);
}
float softmax_partial(float* x, int n, float* max) { return kernels_ref().softmax_partial(x, n, max); }
void attn_scores_q8(const float* q, int nq, const uint8_t* k, const float* ks, int64_t tstride, int n, int hd,
                    float scale, float* out, int64_t ldo) {
    kernels_ref().attn_scores_q8(q, nq, k, ks, tstride, n, hd, scale, out, ldo);
}
void attn_values_q8(const float* p, int64_t ldp, int nq, const int8_t* v, const float* vs, int64_t qstride, int n,
                    int hd, float* out, int64_t ldo) {
    kernels_ref().attn_values_q8(p, ldp, nq, v, vs, qstride, n, hd, out, ldo);
}

}  // namespace ZEN5_TIER
}  // namespace zen5
