// The DeepSeek V4 forward pass and its state, read top to bottom: embed into hc streams; per
// layer hc_pre -> RMSNorm -> attention (raw window + compressed rows) -> hc_post, then hc_pre ->
// RMSNorm -> MoE -> hc_post; the hc head collapse, the final norm and the head.
//
// Every token's arithmetic is the same whatever the chunk it arrives in (matmuls keep the kernel
// table's batch contract; compressor windows, indexer choices and attention are computed per
// token in position order), so a prefill, a chunked prefill, a decode and a replay after a
// rewind all give the same bits.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <xmmintrin.h>  // SSE (every x86-64): the attention gather's 4 x 4 transposes

#include "deepseek_v4.h"

namespace zen5 {

namespace {
constexpr char kMagic[8] = {'Z', 'E', 'N', '5', 'D', 'S', 'V', '4'};
constexpr uint32_t kVersion = 1;
#ifndef ZEN5_VERSION
#define ZEN5_VERSION "dev"
#endif
const uint64_t kBuildId = hash_bytes(ZEN5_VERSION "/dsv4-1", sizeof(ZEN5_VERSION "/dsv4-1") - 1, 1);
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// torch.nn.functional.softplus (beta 1, threshold 20)
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
// y[d] = sum over j < h, in order from 0, of w[j] x[j * n + d]: a pass per j over contiguous
// rows, so it vectorizes (a loop over j innermost did not)
void weighted_sum(const float* w, const float* x, int h, int n, float* y) {
    for (int d = 0; d < n; ++d) y[d] = 0.0f;
    for (int j = 0; j < h; ++j) {
        const float wj = w[j], *xj = x + size_t(j) * n;
        for (int d = 0; d < n; ++d) y[d] += wj * xj[d];
    }
}

// g = min(g, lim), u = clamp(u, -lim, lim): separate loops over unaliased rows, so each is one
// vector min (and max) per 4 floats (one loop over both stayed scalar)
void clamp_rows(float* __restrict g, float* __restrict u, int n, float lim) {
    for (int i = 0; i < n; ++i) g[i] = std::min(g[i], lim);
    for (int i = 0; i < n; ++i) u[i] = std::min(std::max(u[i], -lim), lim);
}

void unweighted_rms(float* x, int n, float eps) {
    float ss = 0.0f;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / float(n) + eps);
    for (int i = 0; i < n; ++i) x[i] *= r;
}

struct Header {
    char magic[8];
    uint32_t version, header_bytes;
    uint64_t build_id, fingerprint;
    uint32_t n_past, qat, logits_valid, n_layers, vocab, raw_from, base;
    uint32_t pad;
};
}  // namespace

V4Context::V4Context(std::shared_ptr<const V4Model> model, int n_ctx, const Kernels* kernels, bool qat)
    : model_(std::move(model)), k_(kernels ? *kernels : active_kernels()), n_ctx_(n_ctx), qat_(qat) {
    if (n_ctx_ <= 0) throw ZenError("n_ctx must be positive");
    const V4Config& c = model_->cfg;
    st_.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
        LayerState& s = st_[l];
        const int r = c.ratios[l];
        s.raw.assign(size_t(n_ctx_) * c.head_dim, 0.0f);
        if (r) s.comp.assign(size_t(n_ctx_ / r + 1) * c.head_dim, 0.0f);
        if (r == 4) s.idx.assign(size_t((n_ctx_ / 4 + kKeyTile) / kKeyTile * kKeyTile) * c.index_dim, 0.0f);
    }
    tokens_.assign(n_ctx_, 0);
    logits_.assign(c.vocab, 0.0f);
    stage_s_.assign(2 * size_t(c.n_layers) + 1, 0.0);
    reset_state();
    const size_t T = kChunk, D = c.hidden, hc = c.hc_mult, qd = size_t(c.n_heads) * c.head_dim;
    const size_t ff = std::max<size_t>(c.moe_inter, 1);
    X_.resize(T * hc * D);
    xn_.resize(T * D);
    col_.resize(T * D);
    out_.resize(T * D);
    post_.resize(T * hc);
    comb_.resize(T * hc * hc);
    qa_.resize(T * c.q_rank);
    q_.resize(T * qd);
    kv_.resize(T * c.head_dim);
    att_.resize(T * qd);
    oa_.resize(T * c.o_groups * c.o_rank);
    iq_.resize(T * c.index_heads * std::max(c.index_dim, 1));
    iw_.resize(T * std::max(c.index_heads, 1));
    tmp_.resize(T * std::max({hc * D, size_t(2 + hc) * hc, size_t(c.n_experts), D}));
    tmp2_.resize(T * std::max(hc * D, D));
    ckv_.resize(T * 2 * (c.head_dim + c.index_dim));  // the compressor's, then the indexer's
    cg_.resize(T * 2 * (c.head_dim + c.index_dim));
    ffn_g_.resize(T * ff);
    ffn_u_.resize(T * ff);
    rlog_.resize(T * c.n_experts);
}

size_t V4Context::bytes_per_token() const {
    const V4Config& c = model_->cfg;
    double b = 4;  // the token id (a rewind may replay it)
    for (int r : c.ratios) {
        b += c.head_dim * 4.0;
        if (r) b += c.head_dim * 4.0 / r;
        if (r == 4) b += c.index_dim * 4.0 / 4 + 4.0 * 2 * (2 * c.head_dim + 2 * c.index_dim) * 4 / kBlock;
    }
    return size_t(b + 0.5);
}

// ---- state bookkeeping ----------------------------------------------------------------------
// The compressor inputs of the current 128-position block are kept (plus, for ratio 4, the 4
// positions before it), so a rewind inside the block forgets positions. A rewind further back
// rebuilds the state at the start of the target's block from what is kept for every position
// (raw rows, compressed and indexer rows, the ratio-4 inputs at each block edge) and evaluates
// the tokens from there again (at most kBlock - 1 of them).

void V4Context::reset_state() {
    n_past_ = 0;
    logits_valid_ = false;
    trunc_floor_ = history_floor_ = 0;
    for (LayerState& s : st_) {
        s.ckv.clear(), s.cgate.clear(), s.ikv.clear(), s.igate.clear();
        s.base = 0;
        s.edge.assign(1, {});  // block 0 starts with no previous window
    }
}

void V4Context::truncate(int n) {
    const V4Config& c = model_->cfg;
    for (int l = 0; l < c.n_layers; ++l) {
        LayerState& s = st_[l];
        if (!c.ratios[l]) continue;
        const size_t keep = size_t(n - s.base);
        s.ckv.resize(keep * model_->layers[l].comp.width);
        s.cgate.resize(keep * model_->layers[l].comp.width);
        if (c.ratios[l] == 4) {
            s.ikv.resize(keep * model_->layers[l].icomp.width);
            s.igate.resize(keep * model_->layers[l].icomp.width);
        }
        s.edge.resize(std::min(s.edge.size(), size_t(n / kBlock) + 1));
    }
    n_past_ = n;
}

void V4Context::trim_inputs() {
    const V4Config& c = model_->cfg;
    const int A = n_past_ / kBlock * kBlock;
    trunc_floor_ = std::max(trunc_floor_, A);
    for (int l = 0; l < c.n_layers; ++l) {
        LayerState& s = st_[l];
        const int base = std::max(0, A - lead(l));
        if (!c.ratios[l] || base <= s.base) continue;
        const size_t drop = size_t(base - s.base), cw = model_->layers[l].comp.width, iw = model_->layers[l].icomp.width;
        s.ckv.erase(s.ckv.begin(), s.ckv.begin() + drop * cw);
        s.cgate.erase(s.cgate.begin(), s.cgate.begin() + drop * cw);
        if (c.ratios[l] == 4) {
            s.ikv.erase(s.ikv.begin(), s.ikv.begin() + drop * iw);
            s.igate.erase(s.igate.begin(), s.igate.begin() + drop * iw);
        }
        s.base = base;
    }
}

void V4Context::eval(const int32_t* tokens, int n, float* all_logits) {
    const V4Config& c = model_->cfg;
    if (n <= 0) return;
    if (int64_t(n_past_) + n > n_ctx_)
        throw ContextOverflow("context overflow: " + std::to_string(n_past_) + " cached + " + std::to_string(n) +
                              " new tokens exceed the context of " + std::to_string(n_ctx_) + " tokens");
    for (int i = 0; i < n; ++i)
        if (tokens[i] < 0 || tokens[i] >= c.vocab)
            throw ZenError("token id " + std::to_string(tokens[i]) + " is outside the vocabulary (" +
                           std::to_string(c.vocab) + ")");
    experts_.assign(size_t(n) * c.n_layers * c.top_k, -1);
    selected_.assign(size_t(n) * c.n_layers * std::max(c.index_topk, 1), -1);
    for (int i = 0; i < n; i += kChunk) {
        const int m = std::min(kChunk, n - i);
        rec_off_ = i;
        forward_chunk(tokens + i, m, all_logits ? all_logits + size_t(i) * c.vocab : nullptr);
    }
    logits_valid_ = true;
}

void V4Context::rewind(int n, const float* last_logits) {
    if (n < 0 || n > n_past_)
        throw ZenError("rewind(" + std::to_string(n) + ") outside [0, " + std::to_string(n_past_) + "]");
    if (last_logits && n == 0) throw ZenError("rewind(0) has no last position to give logits to");
    if (n != n_past_) {
        logits_valid_ = false;
        if (n >= trunc_floor_) {
            truncate(n);
        } else {
            // Rebuild the state at the start of n's block, then replay the tokens up to n.
            const V4Config& c = model_->cfg;
            int from = n / kBlock * kBlock;
            if (from < history_floor_) from = 0;
            const std::vector<int32_t> replay(tokens_.begin() + from, tokens_.begin() + n);
            if (from == 0) {
                reset_state();
            } else {
                for (int l = 0; l < c.n_layers; ++l) {
                    LayerState& s = st_[l];
                    if (!c.ratios[l]) continue;
                    s.ckv.clear(), s.cgate.clear(), s.ikv.clear(), s.igate.clear();
                    s.base = from - lead(l);
                    if (c.ratios[l] == 4) {
                        const std::vector<float>& e = s.edge[from / kBlock];
                        const size_t cw = model_->layers[l].comp.width, iw = model_->layers[l].icomp.width;
                        s.ckv.assign(e.begin(), e.begin() + 4 * cw);
                        s.cgate.assign(e.begin() + 4 * cw, e.begin() + 8 * cw);
                        s.ikv.assign(e.begin() + 8 * cw, e.begin() + 8 * cw + 4 * iw);
                        s.igate.assign(e.begin() + 8 * cw + 4 * iw, e.begin() + 8 * cw + 8 * iw);
                    }
                    s.edge.resize(size_t(from / kBlock) + 1);
                }
                n_past_ = trunc_floor_ = from;
            }
            if (!replay.empty()) eval(replay.data(), int(replay.size()));
            rebuilt_ += int(replay.size());
        }
    }
    if (last_logits) {
        std::memcpy(logits_.data(), last_logits, sizeof(float) * model_->cfg.vocab);
        logits_valid_ = true;
    }
}

// ---- the forward pass -----------------------------------------------------------------------

void V4Context::matmuls(const std::vector<MatJob>& jobs) {
    // FP8 (re-quantized to Q8_0 at load) and MXFP4 weights take the int8 path: the activations to
    // int8 per 32 (QuantAct, as the llama decoder's; once per distinct input), then the tier's
    // int8 matmul over 16-row groups; float weights read panels of kPanelRows-row bands
    const size_t J = jobs.size();
    std::vector<size_t> act(J, SIZE_MAX);  // job -> the block offset of its quantized input
    std::vector<bool> first(J, false);     // the job that quantizes it (later ones share it)
    size_t blocks = 0;
    for (size_t j = 0; j < J; ++j) {
        const MatJob& m = jobs[j];
        if (!m.w->packed) continue;
        for (size_t i = 0; i < j && act[j] == SIZE_MAX; ++i)
            if (act[i] != SIZE_MAX && jobs[i].x == m.x && jobs[i].n == m.n && jobs[i].ldx == m.ldx &&
                jobs[i].w->cols == m.w->cols)
                act[j] = act[i];
        if (act[j] == SIZE_MAX) act[j] = blocks, first[j] = true, blocks += size_t(m.n) * (m.w->cols / QK);
    }
    if (act_q_.size() < blocks * QK) act_q_.resize(blocks * QK);
    if (act_d_.size() < blocks) act_d_.resize(blocks), act_ds_.resize(blocks), act_c_.resize(blocks);
    std::vector<QuantAct> qa(J);
    for (size_t j = 0; j < J; ++j) {
        const MatJob& m = jobs[j];
        if (act[j] == SIZE_MAX) continue;
        const size_t o = act[j];
        qa[j] = QuantAct{act_q_.data() + o * QK, act_d_.data() + o, act_c_.data() + o, act_ds_.data() + o, m.w->cols, m.n};
        if (!first[j]) continue;
        items(m.n, [&](int t) {  // token t's block b at b * n + t
            k_.quantize_act(m.x + t * m.ldx, 1, m.w->cols, m.n, act_q_.data() + (o + t) * QK, act_d_.data() + o + t,
                            act_c_.data() + o + t, act_ds_.data() + o + t);
        });
    }
    // the jobs' rows shared out among the threads as the llama decoder's (Context::matmuls,
    // ThreadPool::run_rows): whole 16-row group pairs, or 64-row bands for float weights
    std::vector<ThreadPool::Rows> rows(J);
    int64_t work = 0;
    for (size_t j = 0; j < J; ++j) {
        const MatJob& m = jobs[j];
        rows[j] = {m.r0, m.r1 < 0 ? m.w->rows : m.r1, m.w->packed ? 32 : kPanelRows};
        work += int64_t(m.n) * (rows[j].hi - rows[j].lo) * m.w->cols;
    }
    auto run = [&](int j, int64_t lo, int64_t hi) {
        const MatJob& m = jobs[j];
        if (m.w->packed) return k_.matmul_int8(*m.w->packed, lo, hi, qa[j], m.n, m.y, m.ldy);
        WeightView v = *m.w;
        if (lo % kPanelRows) v.panels = nullptr;  // panel kernels start at a band
        k_.matmul(v, lo, hi, m.x, m.n, m.ldx, m.y, m.ldy);
    };
    if (work < (1 << 16)) {
        for (size_t j = 0; j < J; ++j) run(int(j), rows[j].lo, rows[j].hi);
        return;
    }
    const int64_t bands = (rows[0].hi - rows[0].lo + kPanelRows - 1) / kPanelRows;
    if (J == 1 && !jobs[0].w->packed && bands < model_->pool.size() && jobs[0].n >= ThreadPool::kMinItems) {
        // fewer bands of float rows than threads (the hyper-connections' 24-row mixes are one):
        // run_rows would leave threads without a unit (one thread did a mix whole), so a
        // prefill's tokens split instead (a token's sums do not depend on its batch)
        const MatJob& m = jobs[0];
        WeightView v = *m.w;
        if (rows[0].lo % kPanelRows) v.panels = nullptr;  // as in run
        model_->pool.run_items(m.n, [&](int64_t t0, int64_t t1) {
            k_.matmul(v, rows[0].lo, rows[0].hi, m.x + t0 * m.ldx, int(t1 - t0), m.ldx, m.y + t0 * m.ldy, m.ldy);
        });
        return;
    }
    model_->pool.run_rows(rows.data(), int(J), run);
}

// (cos, sin) of pos * f[i] for the rope_dim / 2 pairs, at cs[2i], cs[2i + 1]
static void rope_angles(const float* f, int rd, int pos, float* cs) {
    for (int i = 0; i < rd / 2; ++i) {
        const float angle = float(pos) * f[i];
        cs[2 * i] = std::cos(angle), cs[2 * i + 1] = std::sin(angle);
    }
}

void V4Context::rope(float* v, int dim, const float* f, int pos, bool inverse) const {
    thread_local std::vector<float> cs;
    cs.resize(size_t(model_->cfg.rope_dim));
    rope_angles(f, model_->cfg.rope_dim, pos, cs.data());
    rope_at(v, dim, cs.data(), inverse);
}

void V4Context::rope_at(float* v, int dim, const float* cs, bool inverse) const {
    // interleaved pairs (2i, 2i+1) on the last rope_dim values of a dim-wide head
    const int rd = model_->cfg.rope_dim;
    float* p = v + dim - rd;
    for (int i = 0; i < rd / 2; ++i) {
        const float c = cs[2 * i], sn = inverse ? -cs[2 * i + 1] : cs[2 * i + 1];
        const float x0 = p[2 * i], x1 = p[2 * i + 1];
        p[2 * i] = x0 * c - x1 * sn;
        p[2 * i + 1] = x1 * c + x0 * sn;
    }
}

void V4Context::hc_pre(const V4Hc& hc, int n, float* post, float* comb, float* collapsed) {
    const V4Config& c = model_->cfg;
    const int H = c.hc_mult, D = c.hidden, HD = H * D, M = (2 + H) * H;
    float* normed = tmp2_.data();
    items(n, [&](int t) {
        std::memcpy(normed + size_t(t) * HD, X_.data() + size_t(t) * HD, sizeof(float) * HD);
        unweighted_rms(normed + size_t(t) * HD, HD, c.rms_eps);
    });
    float* mix = tmp_.data();
    matmul(hc.fn, normed, n, HD, mix, M);
    items(n, [&](int t) {
        const float* m = mix + size_t(t) * M;
        float pre[16], cm[16 * 16];
        for (int j = 0; j < H; ++j) {
            pre[j] = sigmoid(m[j] * hc.scale[0] + hc.base[j]) + c.hc_eps;
            post[t * H + j] = 2.0f * sigmoid(m[H + j] * hc.scale[1] + hc.base[H + j]);
        }
        for (int i = 0; i < H; ++i) {  // row softmax, + eps
            float mx = kNegInf, sum = 0.0f;
            for (int j = 0; j < H; ++j) {
                cm[i * H + j] = m[2 * H + i * H + j] * hc.scale[2] + hc.base[2 * H + i * H + j];
                mx = std::max(mx, cm[i * H + j]);
            }
            for (int j = 0; j < H; ++j) sum += (cm[i * H + j] = std::exp(cm[i * H + j] - mx));
            for (int j = 0; j < H; ++j) cm[i * H + j] = cm[i * H + j] / sum + c.hc_eps;
        }
        auto cols = [&] {
            for (int j = 0; j < H; ++j) {
                float s = 0.0f;
                for (int i = 0; i < H; ++i) s += cm[i * H + j];
                for (int i = 0; i < H; ++i) cm[i * H + j] /= s + c.hc_eps;
            }
        };
        cols();
        for (int it = 1; it < c.hc_iters; ++it) {
            for (int i = 0; i < H; ++i) {
                float s = 0.0f;
                for (int j = 0; j < H; ++j) s += cm[i * H + j];
                for (int j = 0; j < H; ++j) cm[i * H + j] /= s + c.hc_eps;
            }
            cols();
        }
        std::memcpy(comb + size_t(t) * H * H, cm, sizeof(float) * H * H);
        const float* x = X_.data() + size_t(t) * HD;
        weighted_sum(pre, x, H, D, collapsed + size_t(t) * D);
    });
}

void V4Context::hc_post(const float* out, const float* post, const float* comb, int n) {
    // new stream k = post[k] * out + sum over j of comb[j][k] * old stream j (comb transposed)
    const V4Config& c = model_->cfg;
    const int H = c.hc_mult, D = c.hidden;
    items(n, [&](int t) {
        float* old = tmp2_.data() + size_t(t) * H * D;  // scratch (hc_pre's normed rows are spent)
        float* x = X_.data() + size_t(t) * H * D;
        std::memcpy(old, x, sizeof(float) * H * D);
        const float *cm = comb + size_t(t) * H * H, *o = out + size_t(t) * D;
        for (int k = 0; k < H; ++k) {
            float w[16], *xk = x + size_t(k) * D;
            for (int j = 0; j < H; ++j) w[j] = cm[j * H + k];
            weighted_sum(w, old, H, D, xk);
            const float p = post[t * H + k];
            for (int d = 0; d < D; ++d) xk[d] = p * o[d] + xk[d];
        }
    });
}

void V4Context::compress(int l, const V4Compressor& cp, bool indexer, int n, const float* kv, float* gate) {
    // Given the kv and gate projections of the chunk's inputs: add ape to the gates, append both to
    // the pending inputs; each window that closes emits one row: a per-channel softmax over its
    // slots (ratio 4: the previous window's first half and this window's second half), RMSNorm,
    // RoPE at the window's first position, QAT rounding.
    const V4Config& c = model_->cfg;
    LayerState& s = st_[l];
    const int r = indexer ? 4 : c.ratios[l], W = cp.width, hd = cp.head;
    std::vector<float>& kvs = indexer ? s.ikv : s.ckv;
    std::vector<float>& gs = indexer ? s.igate : s.cgate;
    const int base = s.base;
    std::vector<int> closing;  // positions whose window closes in this chunk
    for (int t = 0; t < n; ++t) {
        const int p = n_past_ + t;
        float* g = gate + size_t(t) * W;
        for (int i = 0; i < W; ++i) g[i] += cp.ape[(p % r) * W + i];
        kvs.insert(kvs.end(), kv + size_t(t) * W, kv + size_t(t + 1) * W);
        gs.insert(gs.end(), g, g + W);
        if ((p + 1) % r) continue;
        closing.push_back(p);
        if (r == 4 && (p + 1) % kBlock == 0) {
            // the inputs of the 4 positions before a block boundary: the overlap a rewind that
            // rebuilds the next block starts from
            std::vector<float>& e = s.edge.size() > size_t((p + 1) / kBlock) ? s.edge[(p + 1) / kBlock]
                                                                              : s.edge.emplace_back();
            if (!indexer) e.clear();
            const size_t first = size_t(p - 3 - base) * W;
            e.insert(e.end(), kvs.begin() + first, kvs.begin() + first + 4 * W);
            e.insert(e.end(), gs.begin() + first, gs.begin() + first + 4 * W);
        }
    }
    // the closed windows' rows, over the threads (each reads only the inputs appended above)
    items(int(closing.size()), [&](int i) {
        const int p = closing[size_t(i)], w = (p + 1) / r - 1, start = w * r;
        thread_local std::vector<float> row, wts, out;
        row.resize(size_t(hd)), wts.resize(size_t(2 * r)), out.resize(size_t(hd));
        // slots: (position, channel offset); ratio 4 puts the previous window's first half first
        int sp[16], so[16], ns = 0;
        if (r == 4) {
            if (w > 0)
                for (int j = 0; j < 4; ++j) sp[ns] = start - 4 + j, so[ns++] = 0;
            for (int j = 0; j < 4; ++j) sp[ns] = start + j, so[ns++] = hd;
        }
        for (int ch = 0; ch < hd; ++ch) {
            float mx = kNegInf, sum = 0.0f, acc = 0.0f;
            const int cnt = r == 4 ? ns : r;
            for (int j = 0; j < cnt; ++j) {
                const int pj = r == 4 ? sp[j] : start + j, off = r == 4 ? so[j] : 0;
                wts[j] = gs[size_t(pj - base) * W + off + ch];
                mx = std::max(mx, wts[j]);
            }
            for (int j = 0; j < cnt; ++j) sum += (wts[j] = std::exp(wts[j] - mx));
            for (int j = 0; j < cnt; ++j) {
                const int pj = r == 4 ? sp[j] : start + j, off = r == 4 ? so[j] : 0;
                acc += kvs[size_t(pj - base) * W + off + ch] * (wts[j] / sum);
            }
            row[ch] = acc;
        }
        float* dst = indexer ? out.data() : s.comp.data() + size_t(w) * hd;
        k_.rmsnorm(row.data(), cp.norm, hd, c.rms_eps, dst);
        rope(dst, hd, model_->freq_compress.data(), start, false);
        if (qat_) {
            if (indexer) {
                v4_hadamard(dst, hd);
                v4_fp4_sim(dst, hd, 32);
            } else {
                v4_fp8_sim(dst, hd - c.rope_dim, 64);
            }
        }
        if (indexer)
            for (int ch = 0; ch < hd; ++ch) s.idx[key_tile_index(w, ch, hd)] = dst[ch];
    });
}

void V4Context::attention(int l, int n, const float* x, float* out) {
    const V4Config& c = model_->cfg;
    const V4Layer& L = model_->layers[l];
    LayerState& s = st_[l];
    const int H = c.n_heads, hd = c.head_dim, qd = H * hd, r = L.ratio, rd = c.rope_dim;
    const int IH = c.index_heads, id = c.index_dim;
    // every projection of the layer's input at once: Q's low rank, KV, the compressors' kv and
    // gate, the indexer's head weights (the indexer's compressor after the main one's, in ckv_/cg_)
    const int cw = r ? L.comp.width : 0;
    float* ikv = ckv_.data() + size_t(n) * cw;
    float* ig = cg_.data() + size_t(n) * cw;
    std::vector<MatJob> in{{&L.wq_a, x, n, c.hidden, qa_.data(), c.q_rank}, {&L.wkv, x, n, c.hidden, kv_.data(), hd}};
    if (r) {
        in.push_back({&L.comp.wkv, x, n, c.hidden, ckv_.data(), cw});
        in.push_back({&L.comp.wgate, x, n, c.hidden, cg_.data(), cw});
    }
    if (r == 4) {
        in.push_back({&L.icomp.wkv, x, n, c.hidden, ikv, L.icomp.width});
        in.push_back({&L.icomp.wgate, x, n, c.hidden, ig, L.icomp.width});
        in.push_back({&L.iweights, x, n, c.hidden, iw_.data(), IH});
    }
    matmuls(in);
    // Q: weighted norm of the low rank, up (and the indexer's queries), per-head unweighted norm,
    // RoPE on each head's tail
    items(n, [&](int t) { k_.rmsnorm(qa_.data() + size_t(t) * c.q_rank, L.q_norm, c.q_rank, c.rms_eps, qa_.data() + size_t(t) * c.q_rank); });
    std::vector<MatJob> up{{&L.wq_b, qa_.data(), n, c.q_rank, q_.data(), qd}};
    if (r == 4) up.push_back({&L.iwq_b, qa_.data(), n, c.q_rank, iq_.data(), IH * id});
    matmuls(up);
    items(n * H, [&](int i) {  // per (token, head), as the indexer's queries below
        float* qh = q_.data() + size_t(i) * hd;
        unweighted_rms(qh, hd, c.rms_eps);
        rope_at(qh, hd, rot(r != 0, i / H), false);
    });
    items(n, [&](int t) {
        // KV: one shared head, weighted norm, RoPE, FP8 simulation of the non-rope part
        float* row = s.raw.data() + size_t(n_past_ + t) * hd;
        k_.rmsnorm(kv_.data() + size_t(t) * hd, L.kv_norm, hd, c.rms_eps, row);
        rope_at(row, hd, rot(r != 0, t), false);
        if (qat_) v4_fp8_sim(row, hd - rd, 64);
    });
    if (r) compress(l, L.comp, false, n, ckv_.data(), cg_.data());
    if (r == 4) {
        compress(l, L.icomp, true, n, ikv, ig);
        // per (token, head), so a decoded token's 64 heads use every thread (a task per token left
        // them all to one thread: with the compressors, 0.25 -> 0.15 ms per decoded token at 2)
        items(n * IH, [&](int i) {
            float* qh = iq_.data() + size_t(i) * id;
            rope_at(qh, id, rot(true, i / IH), false);
            if (qat_) {
                v4_hadamard(qh, id);
                v4_fp4_sim(qh, id, 32);
            }
        });
    }
    // Which compressed rows each token sees: ratio 128 all complete windows, ratio 4 the
    // indexer's top-k of them (sum over heads of w_h relu(q_h . k_s) / sqrt(id)), ascending.
    const int topk = std::max(c.index_topk, 1);
    std::vector<int32_t> sel(size_t(n) * topk);
    std::vector<int> nsel(n, 0);
    if (r == 4) {
        const float hscale = 1.0f / std::sqrt(float(IH)), dscale = 1.0f / std::sqrt(float(id));
        // scores in tasks of (token, 256 rows), so a decoded token's thousands of rows use every
        // thread; then each token's top-k
        constexpr int kRows = 256;
        std::vector<std::vector<std::pair<float, int>>> scores(n);
        std::vector<std::pair<int, int>> parts;  // (token, first row)
        for (int t = 0; t < n; ++t) {
            scores[t].resize((n_past_ + t + 1) / 4);
            for (int si = 0; si < int(scores[t].size()); si += kRows) parts.push_back({t, si});
        }
        model_->pool.run(int(parts.size()), [&](int task, int) {
            // every head's dot products with the chunk's rows (key tiles from row s0, a multiple of
            // kKeyTile) by the tier's score kernel; then per row the heads' weighted sum, in head
            // order (rows in the inner loop, so it vectorizes)
            const int t = parts[task].first, s0 = parts[task].second;
            const int cnt = std::min(int(scores[t].size()) - s0, kRows);
            thread_local std::vector<float> dots, total;
            dots.resize(size_t(IH) * cnt);
            k_.attn_scores(iq_.data() + size_t(t) * IH * id, IH, s.idx.data() + size_t(s0) * id, int64_t(kKeyTile) * id,
                           cnt, id, 1.0f, dots.data(), cnt);
            total.assign(cnt, 0.0f);
            for (int h = 0; h < IH; ++h) {
                const float wh = iw_[size_t(t) * IH + h] * hscale, *d = dots.data() + size_t(h) * cnt;
                for (int i = 0; i < cnt; ++i) total[i] += std::max(d[i], 0.0f) * dscale * wh;
            }
            for (int i = 0; i < cnt; ++i) scores[t][s0 + i] = {total[i], s0 + i};
        });
        model_->pool.run(n, [&](int t, int) {
            // the k best (a strict order: ties go to the lower row, so the set is unique), found in
            // linear time, then put in row order (partial_sort's heap: the scores and this took
            // 0.48 ms of a decoded token at depth 8192, 2048 rows, 2 threads; now 0.38)
            std::vector<std::pair<float, int>>& sc = scores[t];
            const int vis = int(sc.size());
            const int k = std::min(c.index_topk, vis);
            if (k > 0 && k < vis)
                std::nth_element(sc.begin(), sc.begin() + (k - 1), sc.end(), [](const auto& a, const auto& b) {
                    return a.first > b.first || (a.first == b.first && a.second < b.second);
                });
            int32_t* out_sel = sel.data() + size_t(t) * topk;
            for (int i = 0; i < k; ++i) out_sel[i] = sc[i].second;
            std::sort(out_sel, out_sel + k);
            nsel[t] = k;
        });
    }
    for (int t = 0; t < n; ++t) {
        int32_t* rec = selected_.data() + (size_t(rec_off_ + t) * c.n_layers + l) * topk;
        std::fill(rec, rec + topk, -1);
        for (int i = 0; i < nsel[t]; ++i) rec[i] = sel[size_t(t) * topk + i];
    }
    // Attention per (token, head): raw window rows then compressed rows, a sink in the
    // denominator, values = keys; inverse RoPE on the output's tail. Every head reads the same
    // rows (one K=V head), so a token's rows are gathered once, as rows and as key tiles, and
    // the tier's attention kernels run a group of its heads: scores with the rows in the lanes,
    // then the values with the channels in the lanes, each row feeding every head of the group
    // from L1. A head's result does not depend on the group (the kernels' contract), so any
    // grouping gives the same bits. A larger batch runs whole tokens, each gathered by its task.
    // A small one (decode) splits each token's heads into as many groups as give every thread a
    // task, and no more, since every group reads all its token's rows again: at depth 2048 (640
    // rows of 2 KB) the ratio-4 layer decoded in 6% less time with 2 groups of 32 heads than
    // with 8 of 8 (1 and 2 threads, Xeon). Its tokens are gathered first, in pieces of whole key
    // tiles across the threads (a decoded token's 1.3 MB of rows and tiles had been one task).
    const int threads = model_->pool.size();
    int groups = 1;
    if (n < 2 * threads) {  // the fewest groups (of at least 8 heads) that divide among the threads
        const int most = (H + 7) / 8;
        groups = std::min((threads + n - 1) / n, most);
        while (groups < most && n * groups % threads) ++groups;
    }
    const int per = (H + groups - 1) / groups;
    groups = (H + per - 1) / per;
    // scores in base-2 units, as the tier's softmax_partial takes them (kernels.h): log2(e) folded
    // into the scale, and into the sink, which joins each head's row as one more position
    const float scale = kLog2e / std::sqrt(float(hd));
    auto size_rows = [&](int t, Rows& g) {  // token t's row count; room for its whole key tiles
        const int p = n_past_ + t, nraw = p - std::max(0, p - c.window + 1) + 1;
        g.nk = nraw + (r == 4 ? nsel[t] : r ? (p + 1) / r : 0);
        g.rows.resize(size_t((g.nk + kKeyTile - 1) / kKeyTile * kKeyTile) * hd);
        g.tiles.resize(g.rows.size());
    };
    // Rows [r0, r1) into g.rows and g.tiles (the last tile zero-padded when r1 is nk), r0 on a key
    // tile, r1 too unless nk: 4 rows at a time, read once from the cache and written both ways,
    // the tiles through 4 x 4 transposes (one row at a time into the tiles' 64-byte lines took a
    // fifth longer at depth 2048, 640 rows of 2 KB: 0.59 vs 0.48 ms per token, Zen 3).
    const std::vector<float> zeros(size_t(hd), 0.0f);
    auto gather = [&](int t, Rows& g, int r0, int r1) {
        const int p = n_past_ + t, lo = std::max(0, p - c.window + 1), nraw = p - lo + 1;
        const int end = r1 == g.nk ? int(g.rows.size() / hd) : r1;
        for (int i = r0; i < end; i += 4) {  // 4 rows never straddle a tile (kKeyTile = 16)
            const float* src[4];
            for (int k = 0; k < 4; ++k) {
                const int j = i + k;
                if (j >= r1) src[k] = zeros.data();
                else if (j < nraw) src[k] = s.raw.data() + size_t(lo + j) * hd;
                else src[k] = s.comp.data() + size_t(r == 4 ? sel[size_t(t) * topk + j - nraw] : j - nraw) * hd;
            }
            float* row = g.rows.data() + size_t(i) * hd;
            float* tile = g.tiles.data() + key_tile_index(i, 0, hd);
            int d = 0;
            for (; d + 4 <= hd; d += 4) {
                __m128 v[4];
                for (int k = 0; k < 4; ++k) _mm_storeu_ps(row + size_t(k) * hd + d, v[k] = _mm_loadu_ps(src[k] + d));
                _MM_TRANSPOSE4_PS(v[0], v[1], v[2], v[3]);
                for (int k = 0; k < 4; ++k) _mm_storeu_ps(tile + size_t(d + k) * kKeyTile, v[k]);
            }
            for (; d < hd; ++d)  // a head size that is not a multiple of 4
                for (int k = 0; k < 4; ++k) tile[size_t(d) * kKeyTile + k] = row[size_t(k) * hd + d] = src[k][d];
        }
    };
    if (groups > 1) {
        if (gathered_.size() < size_t(n)) gathered_.resize(n);
        for (int t = 0; t < n; ++t) size_rows(t, gathered_[t]);
        const int pieces = std::max(1, threads / n);
        model_->pool.run(n * pieces, [&](int task, int) {
            Rows& g = gathered_[task / pieces];
            const int k = task % pieces, tiles = (g.nk + kKeyTile - 1) / kKeyTile;
            const int r0 = tiles * k / pieces * kKeyTile, r1 = std::min(g.nk, tiles * (k + 1) / pieces * kKeyTile);
            if (r0 < r1) gather(task / pieces, g, r0, r1);
        });
    }
    model_->pool.run(n * groups, [&](int task, int) {
        const int t = task / groups, h0 = task % groups * per, nh = std::min(H, h0 + per) - h0;
        thread_local Rows own;
        Rows& g = groups > 1 ? gathered_[t] : own;
        if (groups == 1) {
            size_rows(t, g);
            gather(t, g, 0, g.nk);
        }
        const int nk = g.nk;
        // a head's scores, then its sink: the softmax's denominator has the sink's term, the values
        // use the first nk (the tier's exp2 over vectors: the scalar std::exp it replaced took a
        // tenth of the ratio-4 layer's attention at depth 2048, 0.23-0.27 of 2.2-2.7 ms per token)
        const int ld = nk + 1;
        thread_local std::vector<float> sc;
        sc.resize(size_t(nh) * ld);
        k_.attn_scores(q_.data() + size_t(t) * qd + size_t(h0) * hd, nh, g.tiles.data(), int64_t(kKeyTile) * hd, nk,
                       hd, scale, sc.data(), ld);
        for (int j = 0; j < nh; ++j) {
            float* v = sc.data() + size_t(j) * ld;
            v[nk] = L.sink[h0 + j] * kLog2e;
            float mx;
            const float sum = k_.softmax_partial(v, nk + 1, &mx);
            for (int i = 0; i < nk; ++i) v[i] /= sum;
        }
        float* o0 = att_.data() + size_t(t) * qd + size_t(h0) * hd;
        std::fill(o0, o0 + size_t(nh) * hd, 0.0f);
        k_.attn_values(sc.data(), ld, nh, g.rows.data(), hd, nk, hd, o0, hd);
        for (int j = 0; j < nh; ++j) rope_at(o0 + size_t(j) * hd, hd, rot(r != 0, t), true);
    });
    // grouped low-rank output: group g's heads through its rows of wo_a, then wo_b
    const int G = c.o_groups, gin = qd / G, orow = G * c.o_rank;
    std::vector<MatJob> og;
    for (int g = 0; g < G; ++g)
        og.push_back({&L.wo_a, att_.data() + size_t(g) * gin, n, qd, oa_.data(), orow, int64_t(g) * c.o_rank,
                      int64_t(g + 1) * c.o_rank});
    matmuls(og);
    matmul(L.wo_b, oa_.data(), n, orow, out, c.hidden);
}

void V4Context::moe(int l, int n, const int32_t* tokens, const float* x, float* out) {
    const V4Config& c = model_->cfg;
    const V4Layer& L = model_->layers[l];
    const int D = c.hidden, E = c.n_experts, K = c.top_k, F = c.moe_inter;
    matmul(L.gate, x, n, D, rlog_.data(), E);
    std::vector<int> ids(size_t(n) * K);
    std::vector<float> wts(size_t(n) * K);
    items(n, [&](int t) {
        float* sc = rlog_.data() + size_t(t) * E;
        for (int e = 0; e < E; ++e) sc[e] = std::sqrt(softplus(sc[e]));
        int* id = ids.data() + size_t(t) * K;
        if (L.hash) {
            std::copy(L.tid2eid + size_t(tokens[t]) * K, L.tid2eid + size_t(tokens[t] + 1) * K, id);
        } else {
            std::vector<std::pair<float, int>> biased(E);
            for (int e = 0; e < E; ++e) biased[e] = {sc[e] + L.gate_bias[e], e};
            std::partial_sort(biased.begin(), biased.begin() + K, biased.end(), [](const auto& a, const auto& b) {
                return a.first > b.first || (a.first == b.first && a.second < b.second);
            });
            for (int k = 0; k < K; ++k) id[k] = biased[k].second;
        }
        float sum = 0.0f;
        for (int k = 0; k < K; ++k) sum += (wts[size_t(t) * K + k] = sc[id[k]]);
        for (int k = 0; k < K; ++k) wts[size_t(t) * K + k] = wts[size_t(t) * K + k] / (sum + 1e-20f) * c.route_scale;
        int32_t* rec = experts_.data() + (size_t(rec_off_ + t) * c.n_layers + l) * K;
        std::copy(id, id + K, rec);
        std::sort(rec, rec + K);
    });
    auto swiglu = [&](int m) {  // ffn_g_ = silu(min(g, limit)) * clamp(u, -limit, limit)
        const float lim = c.swiglu_limit;
        items(m, [&](int t) {
            float* g = ffn_g_.data() + size_t(t) * F;
            float* u = ffn_u_.data() + size_t(t) * F;
            if (lim > 0) clamp_rows(g, u, F, lim);
            k_.swiglu(g, u, F, g);
        });
    };
    std::fill(out, out + size_t(n) * D, 0.0f);
    std::vector<int> used(ids);
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    model_->prepare_experts(l, used);  // packs those routed to for the first time
    // Each routed expert's tokens with their weights, in id order, then the shared expert (every
    // token, weight 1: axpy by 1 adds exactly), so a token sums its experts in the same order
    // whatever its batch.
    struct Use { const WeightView *w1, *w3, *w2; std::vector<std::pair<int, float>> who; };
    std::vector<Use> uses;
    for (int e : used) {
        const V4Expert& X = model_->expert(l, e);
        uses.push_back({&X.w1, &X.w3, &X.w2, {}});
    }
    for (int t = 0; t < n; ++t)  // each expert's tokens in order, one pass (used is sorted)
        for (int k = 0; k < K; ++k) {
            const size_t u = size_t(std::lower_bound(used.begin(), used.end(), ids[size_t(t) * K + k]) - used.begin());
            uses[u].who.push_back({t, wts[size_t(t) * K + k]});
        }
    uses.push_back({&L.sw1, &L.sw3, &L.sw2, {}});
    for (int t = 0; t < n; ++t) uses.back().who.push_back({t, 1.0f});
    // Experts in batches of at most kChunk token rows (the scratch's), each batch's up projections
    // in one parallel run and its down projections in another: a decoded token's 7 experts cost
    // two waits for the threads, not 21.
    float* xs = tmp2_.data();
    float* ys = tmp_.data();
    for (size_t b0 = 0; b0 < uses.size();) {
        size_t b1 = b0, rows = 0;
        while (b1 < uses.size() && (b1 == b0 || rows + uses[b1].who.size() <= size_t(kChunk))) rows += uses[b1++].who.size();
        std::vector<MatJob> upj, downj;
        std::vector<std::pair<size_t, int>> copies;  // (row of xs, token)
        size_t r = 0;
        for (size_t i = b0; i < b1; ++i) {
            const Use& u = uses[i];
            const int m = int(u.who.size());
            const float* xi = x;  // every token in order (a decoded token's experts, the shared one): x itself
            bool all = m == n;
            for (int j = 0; all && j < m; ++j) all = u.who[j].first == j;
            if (!all) {
                for (int j = 0; j < m; ++j) copies.push_back({r + j, u.who[j].first});
                xi = xs + r * D;
            }
            upj.push_back({u.w1, xi, m, D, ffn_g_.data() + r * F, F});
            upj.push_back({u.w3, xi, m, D, ffn_u_.data() + r * F, F});
            downj.push_back({u.w2, ffn_g_.data() + r * F, m, F, ys + r * D, D});
            r += m;
        }
        items(int(copies.size()), [&](int i) {
            std::memcpy(xs + copies[i].first * D, x + size_t(copies[i].second) * D, sizeof(float) * D);
        });
        matmuls(upj);
        swiglu(int(rows));
        matmuls(downj);
        // each token's rows of the batch (ascending, so in use order), then its sums over the threads
        std::vector<int> start(size_t(n) + 1, 0);
        for (size_t i = b0; i < b1; ++i)
            for (const auto& tw : uses[i].who) ++start[size_t(tw.first) + 1];
        for (int t = 0; t < n; ++t) start[size_t(t) + 1] += start[size_t(t)];
        std::vector<std::pair<size_t, float>> mine(rows);  // (row of ys, weight) by token
        std::vector<int> fill(start.begin(), start.end() - 1);
        r = 0;
        for (size_t i = b0; i < b1; ++i)
            for (const auto& [t, w] : uses[i].who) mine[size_t(fill[size_t(t)]++)] = {r++, w};
        items(n, [&](int t) {
            for (int i = start[size_t(t)]; i < start[size_t(t) + 1]; ++i)
                k_.axpy(mine[size_t(i)].second, ys + mine[size_t(i)].first * D, out + size_t(t) * D, D);
        });
        b0 = b1;
    }
}

void V4Context::forward_chunk(const int32_t* tokens, int n, float* all_logits) {
    const V4Model& m = *model_;
    const V4Config& c = m.cfg;
    const int D = c.hidden, H = c.hc_mult, HD = H * D;
    auto mark = std::chrono::steady_clock::now();
    auto lap = [&](double& acc) {  // two clock reads per layer: nothing next to a layer's matmuls
        const auto now = std::chrono::steady_clock::now();
        acc += std::chrono::duration<double>(now - mark).count();
        mark = now;
    };
    double& rest = stage_s_.back();
    for (int t = 0; t < n; ++t) {
        tokens_[n_past_ + t] = tokens[t];
        float* x = X_.data() + size_t(t) * HD;
        k_.dequant_row(m.embed.type, m.embed.row(tokens[t]), D, x);
        for (int j = 1; j < H; ++j) std::memcpy(x + size_t(j) * D, x, sizeof(float) * D);
    }
    // the tokens' rotations, shared by every head and layer: per head, a ratio-4 layer computed
    // 193 x 32 (cos, sin) pairs per token (64 query heads, 64 outputs, 64 indexer heads, the KV
    // row), 0.046 ms of one Zen 3 core per layer and token; now 2 x 32 per token
    rot_n_ = n;
    rot_.resize(2 * size_t(n) * c.rope_dim);
    items(n, [&](int t) {
        rope_angles(m.freq_main.data(), c.rope_dim, n_past_ + t, rot_.data() + size_t(t) * c.rope_dim);
        rope_angles(m.freq_compress.data(), c.rope_dim, n_past_ + t, rot_.data() + size_t(n + t) * c.rope_dim);
    });
    lap(rest);
    for (int l = 0; l < c.n_layers; ++l) {
        const V4Layer& L = m.layers[l];
        hc_pre(L.hc_attn, n, post_.data(), comb_.data(), col_.data());
        items(n, [&](int t) { k_.rmsnorm(col_.data() + size_t(t) * D, L.attn_norm, D, c.rms_eps, xn_.data() + size_t(t) * D); });
        attention(l, n, xn_.data(), out_.data());
        hc_post(out_.data(), post_.data(), comb_.data(), n);
        lap(stage_s_[2 * l]);
        hc_pre(L.hc_ffn, n, post_.data(), comb_.data(), col_.data());
        items(n, [&](int t) { k_.rmsnorm(col_.data() + size_t(t) * D, L.ffn_norm, D, c.rms_eps, xn_.data() + size_t(t) * D); });
        moe(l, n, tokens, xn_.data(), out_.data());
        hc_post(out_.data(), post_.data(), comb_.data(), n);
        lap(stage_s_[2 * l + 1]);
    }
    n_past_ += n;
    trim_inputs();  // the inputs before the (possibly new) block's lead are no longer needed
    // head: the hc collapse (no Sinkhorn), the final norm, the logits
    const int first = all_logits ? 0 : n - 1;
    for (int t = first; t < n; ++t) {
        float* normed = tmp2_.data();
        std::memcpy(normed, X_.data() + size_t(t) * HD, sizeof(float) * HD);
        unweighted_rms(normed, HD, c.rms_eps);
        float mix[16];
        k_.matmul(m.hc_head.fn, 0, H, normed, 1, HD, mix, H);
        float* col = col_.data() + size_t(t) * D;
        std::fill(col, col + D, 0.0f);
        for (int j = 0; j < H; ++j) {
            const float w = sigmoid(mix[j] * m.hc_head.scale[0] + m.hc_head.base[j]) + c.hc_eps;
            for (int d = 0; d < D; ++d) col[d] += w * X_[size_t(t) * HD + size_t(j) * D + d];
        }
        k_.rmsnorm(col, m.norm, D, c.rms_eps, xn_.data() + size_t(t) * D);
    }
    if (all_logits) {
        matmul(m.head, xn_.data(), n, D, all_logits, c.vocab);
        std::memcpy(logits_.data(), all_logits + size_t(n - 1) * c.vocab, sizeof(float) * c.vocab);
    } else {
        matmul(m.head, xn_.data() + size_t(n - 1) * D, 1, D, logits_.data(), c.vocab);
    }
    lap(rest);
}

// ---- snapshots ------------------------------------------------------------------------------
// Compact: the tokens, the last logits, and per layer every compressed and indexer row, the raw
// rows from the block start A minus the window (what the window and a rebuild of the block read),
// the pending compressor inputs only (ratio 4: from the previous window; ratio 128: from the
// window start), and for ratio 4 the inputs at A's edge. After a restore, a rewind to n >= A
// rebuilds the block from that edge; further back it replays from the first token.

namespace {
int pending_from(int n, int r) { return r == 4 ? std::max(0, n / 4 * 4 - 4) : n / r * r; }
}  // namespace

std::string V4Context::snapshot() const {
    const V4Config& c = model_->cfg;
    const int n = n_past_, A = n / kBlock * kBlock, raw_from = std::max(0, A - c.window);
    Header h{};
    std::memcpy(h.magic, kMagic, 8);
    h.version = kVersion, h.header_bytes = sizeof(Header), h.build_id = kBuildId;
    h.fingerprint = model_->fingerprint;
    h.n_past = n, h.qat = qat_, h.logits_valid = logits_valid_, h.n_layers = c.n_layers, h.vocab = c.vocab;
    h.raw_from = raw_from, h.base = A;
    std::string out(reinterpret_cast<const char*>(&h), sizeof h);
    auto put = [&](const void* p, size_t bytes) { out.append(static_cast<const char*>(p), bytes); };
    put(tokens_.data(), size_t(n) * 4);
    if (logits_valid_) put(logits_.data(), size_t(c.vocab) * 4);
    for (int l = 0; l < c.n_layers; ++l) {
        const LayerState& s = st_[l];
        const int r = c.ratios[l];
        put(s.raw.data() + size_t(raw_from) * c.head_dim, size_t(n - raw_from) * c.head_dim * 4);
        if (!r) continue;
        const size_t cw = model_->layers[l].comp.width, iw = model_->layers[l].icomp.width;
        const size_t skip = size_t(pending_from(n, r) - s.base);
        put(s.comp.data(), size_t(n / r) * c.head_dim * 4);
        put(s.ckv.data() + skip * cw, s.ckv.size() * 4 - skip * cw * 4);
        put(s.cgate.data() + skip * cw, s.cgate.size() * 4 - skip * cw * 4);
        if (r == 4) {
            std::vector<float> rows(size_t(n / 4) * c.index_dim);  // the blob holds rows (to_rows only reads the tiles)
            copy_key_tiles(const_cast<float*>(s.idx.data()), rows.data(), n / 4, c.index_dim, true);
            put(rows.data(), rows.size() * 4);
            put(s.ikv.data() + skip * iw, s.ikv.size() * 4 - skip * iw * 4);
            put(s.igate.data() + skip * iw, s.igate.size() * 4 - skip * iw * 4);
            if (A > 0) put(s.edge[A / kBlock].data(), s.edge[A / kBlock].size() * 4);
        }
    }
    return out;
}

void V4Context::restore(const std::string& blob) {
    const V4Config& c = model_->cfg;
    Header h;
    if (blob.size() < sizeof h) throw BadSnapshot("snapshot too short");
    std::memcpy(&h, blob.data(), sizeof h);
    if (std::memcmp(h.magic, kMagic, 8))
        throw BadSnapshot(std::memcmp(h.magic, "ZEN5KV", 6) ? "not a zen5 DeepSeek V4 snapshot"
                                                             : "a KV-cache snapshot of another architecture, not DeepSeek V4 state");
    if (h.version != kVersion || h.header_bytes != sizeof h || h.build_id != kBuildId)
        throw BadSnapshot("snapshot from another zen5 build or format version");
    if (h.fingerprint != model_->fingerprint) throw ModelMismatch("snapshot was taken with a different model");
    if (h.qat != uint32_t(qat_))
        throw ModelMismatch("snapshot was taken with the QAT simulations " + std::string(h.qat ? "on" : "off"));
    if (int64_t(h.n_past) > n_ctx_)
        throw ContextOverflow("snapshot of " + std::to_string(h.n_past) + " tokens exceeds the context of " +
                              std::to_string(n_ctx_) + " tokens");
    const int n = int(h.n_past), A = n / kBlock * kBlock, raw_from = std::max(0, A - c.window);
    if (int(h.raw_from) != raw_from || int(h.base) != A || int(h.n_layers) != c.n_layers || int(h.vocab) != c.vocab)
        throw BadSnapshot("snapshot header is inconsistent");
    size_t need = sizeof h + size_t(n) * 4 + (h.logits_valid ? size_t(c.vocab) * 4 : 0);
    for (int l = 0; l < c.n_layers; ++l) {
        const int r = c.ratios[l];
        need += size_t(n - raw_from) * c.head_dim * 4;
        if (!r) continue;
        const size_t pend = size_t(n - pending_from(n, r)), cw = model_->layers[l].comp.width;
        const size_t iw = model_->layers[l].icomp.width;
        need += size_t(n / r) * c.head_dim * 4 + 2 * pend * cw * 4;
        if (r == 4) need += size_t(n / 4) * c.index_dim * 4 + 2 * pend * iw * 4 + (A > 0 ? 8 * (cw + iw) * 4 : 0);
    }
    if (blob.size() != need)
        throw BadSnapshot("snapshot holds " + std::to_string(blob.size()) + " bytes, expected " + std::to_string(need));
    const char* p = blob.data() + sizeof h;
    for (int i = 0; i < n; ++i) {
        int32_t t;
        std::memcpy(&t, p + 4 * size_t(i), 4);
        if (t < 0 || t >= c.vocab) throw BadSnapshot("snapshot token ids outside the vocabulary");
    }
    // valid: now replace the state
    auto get = [&](void* dst, size_t bytes) { std::memcpy(dst, p, bytes), p += bytes; };
    auto get_vec = [&](std::vector<float>& v, size_t floats) { v.resize(floats), get(v.data(), floats * 4); };
    reset_state();
    get(tokens_.data(), size_t(n) * 4);
    logits_valid_ = h.logits_valid;
    if (logits_valid_) get(logits_.data(), size_t(c.vocab) * 4);
    for (int l = 0; l < c.n_layers; ++l) {
        LayerState& s = st_[l];
        const int r = c.ratios[l];
        std::fill(s.raw.begin(), s.raw.end(), 0.0f);
        get(s.raw.data() + size_t(raw_from) * c.head_dim, size_t(n - raw_from) * c.head_dim * 4);
        if (!r) continue;
        const size_t cw = model_->layers[l].comp.width, iw = model_->layers[l].icomp.width;
        s.base = pending_from(n, r);
        const size_t pend = size_t(n - s.base);
        get(s.comp.data(), size_t(n / r) * c.head_dim * 4);
        get_vec(s.ckv, pend * cw), get_vec(s.cgate, pend * cw);
        s.edge.assign(size_t(A / kBlock) + 1, {});
        if (r == 4) {
            std::vector<float> rows(size_t(n / 4) * c.index_dim);
            get(rows.data(), rows.size() * 4);
            copy_key_tiles(s.idx.data(), rows.data(), n / 4, c.index_dim, false);
            get_vec(s.ikv, pend * iw), get_vec(s.igate, pend * iw);
            if (A > 0) get_vec(s.edge[A / kBlock], 8 * (cw + iw));
        }
    }
    n_past_ = trunc_floor_ = n;
    history_floor_ = A;
}

}  // namespace zen5
