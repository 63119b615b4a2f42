// DeepSeek V4 weights: bind the official tensor names (spec section 4.3) to V4Layer fields with
// exact shapes, convert the small vectors to F32, give the matrices panel copies for the float
// matmuls, and the QAT rounding routines (spec 1.4/1.5, current official revision).
#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "deepseek_v4.h"

namespace zen5 {

namespace {

constexpr int kTypeI32 = 26;  // GGML's I32 id

std::string shape_str(const std::vector<int64_t>& s) {
    std::string r = "(";
    for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + (s.size() == 1 ? ",)" : ")");
}

struct Binder {
    std::map<std::string, const TensorIn*> by;
    std::vector<std::unique_ptr<std::vector<float>>>& floats;
    std::vector<std::unique_ptr<std::vector<int32_t>>>& ints;

    const TensorIn& get(const std::string& name, const std::vector<int64_t>& shape) const {
        auto it = by.find(name);
        if (it == by.end()) throw BadModel("missing tensor " + name);
        if (it->second->shape != shape)
            throw BadModel("tensor " + name + " has shape " + shape_str(it->second->shape) + ", expected " +
                           shape_str(shape));
        return *it->second;
    }
    // A float matrix used in place, or one of the official formats (kernels.h: FP8 with 128 x 128
    // block scales, MXFP4 with a scale per 32) with its `.scale` tensor.
    WeightView matrix(const std::string& name, int64_t rows, int64_t cols) const {
        auto it = by.find(name);
        const int type = it == by.end() ? GGML_F32 : it->second->type;
        const bool fp4 = type == kTypeMXFP4, quant = fp4 || type == kTypeFP8;
        if (fp4 && cols % QK) throw BadModel("tensor " + name + ": MXFP4 needs a multiple of 32 columns");
        const TensorIn& t = get(name, {rows, fp4 ? cols / 2 : cols});
        if (t.type != GGML_F32 && t.type != GGML_F16 && t.type != GGML_BF16 && !quant)
            throw BadModel("tensor " + name + " must be F32, F16, BF16, F8_E4M3 or packed e2m1, got " +
                           type_name(t.type));
        const size_t rb = row_bytes(t.type, cols);
        if (t.nbytes != rb * size_t(rows)) throw BadModel("tensor " + name + " has the wrong byte size");
        WeightView w{t.data, t.type, rows, cols, rb};
        if (quant) {
            const std::string sname = name.substr(0, name.size() - 7) + ".scale";  // "x.weight" -> "x.scale"
            const std::vector<int64_t> sshape = fp4 ? std::vector<int64_t>{rows, cols / QK}
                                                    : std::vector<int64_t>{(rows + 127) / 128, (cols + 127) / 128};
            const TensorIn& s = get(sname, sshape);
            if (s.type != kTypeE8M0 || s.nbytes != size_t(sshape[0] * sshape[1]))
                throw BadModel("tensor " + sname + " must be F8_E8M0 (one byte per scale)");
            w.scales = s.data;
        }
        return w;
    }
    // Any float tensor as an owned F32 copy (norm weights, biases, hyper-connection parameters).
    const float* vec(const std::string& name, const std::vector<int64_t>& shape) const {
        const TensorIn& t = get(name, shape);
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        if (t.type != GGML_F32 && t.type != GGML_F16 && t.type != GGML_BF16)
            throw BadModel("tensor " + name + " must be a float tensor, got " + type_name(t.type));
        if (t.nbytes != row_bytes(t.type, n)) throw BadModel("tensor " + name + " has the wrong byte size");
        auto v = std::make_unique<std::vector<float>>(size_t(n));
        for (int64_t i = 0; i < n; ++i) {
            if (t.type == GGML_F32) std::memcpy(&(*v)[i], t.data + 4 * i, 4);
            else {
                uint16_t h;
                std::memcpy(&h, t.data + 2 * i, 2);
                (*v)[i] = t.type == GGML_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
            }
        }
        floats.push_back(std::move(v));
        return floats.back()->data();
    }
    WeightView owned_matrix(const std::string& name, int64_t rows, int64_t cols) const {
        const float* p = vec(name, {rows, cols});
        return WeightView{reinterpret_cast<const uint8_t*>(p), GGML_F32, rows, cols, size_t(cols) * 4};
    }
    const int32_t* ids(const std::string& name, int64_t rows, int64_t cols, int limit) const {
        const TensorIn& t = get(name, {rows, cols});
        if (t.type != kTypeI32 || t.nbytes != size_t(rows * cols) * 4)
            throw BadModel("tensor " + name + " must be I32");
        auto v = std::make_unique<std::vector<int32_t>>(size_t(rows * cols));
        std::memcpy(v->data(), t.data, t.nbytes);
        for (int32_t e : *v)
            if (e < 0 || e >= limit) throw BadModel("tensor " + name + " holds expert id " + std::to_string(e));
        ints.push_back(std::move(v));
        return ints.back()->data();
    }
};

void check_config(const V4Config& c) {
    const bool ok = c.vocab > 0 && c.hidden > 0 && c.n_layers > 0 && c.n_heads > 0 && c.head_dim > 0 &&
                    c.rope_dim > 0 && c.rope_dim % 2 == 0 && c.rope_dim <= c.head_dim && c.q_rank > 0 &&
                    c.o_groups > 0 && c.n_heads % c.o_groups == 0 && c.o_rank > 0 && c.window > 0 &&
                    int(c.ratios.size()) == c.n_layers && c.n_experts > 0 && c.top_k > 0 &&
                    c.top_k <= c.n_experts && c.moe_inter > 0 && c.hc_mult > 0 && c.hc_mult <= 16 && c.hc_iters > 0;
    if (!ok) throw BadModel("inconsistent DeepSeek V4 dimensions");
    for (int r : c.ratios)
        if (r != 0 && r != 4 && r != 128) throw BadModel("compress ratio " + std::to_string(r) + " is not 0, 4 or 128");
    bool any4 = false;
    for (int r : c.ratios) any4 |= r == 4;
    if (any4 && (c.index_heads <= 0 || c.index_dim < c.rope_dim || c.index_topk <= 0 ||
                 (c.index_dim & (c.index_dim - 1)) || c.index_dim % 32))
        throw BadModel("the indexer needs heads > 0, top-k > 0 and a power-of-two width >= 32 and >= rope_dim");
    if ((c.head_dim - c.rope_dim) % 64) throw BadModel("head_dim - rope_dim must be a multiple of 64 (FP8 blocks)");
}

}  // namespace

V4Model::V4Model(V4Config c, const std::vector<TensorIn>& tensors, std::vector<float> fm, std::vector<float> fc,
                 int threads, const CacheSpec& cache, int load_threads)
    : cfg(std::move(c)), freq_main(std::move(fm)), freq_compress(std::move(fc)), pool(threads),
      cache_(cache) {
    check_config(cfg);
    if (int(freq_main.size()) != cfg.rope_dim / 2 || int(freq_compress.size()) != cfg.rope_dim / 2)
        throw BadModel("rope tables must have rope_dim / 2 entries");
    Binder b{{}, floats_, ints_};
    for (const auto& t : tensors) b.by[t.name] = &t;
    const int64_t D = cfg.hidden, V = cfg.vocab, hc = cfg.hc_mult, M = (2 + hc) * hc, hd = cfg.head_dim;
    const int64_t qd = int64_t(cfg.n_heads) * hd, orow = int64_t(cfg.o_groups) * cfg.o_rank;
    embed = b.matrix("embed.weight", V, D);
    head = b.matrix("head.weight", V, D);
    norm = b.vec("norm.weight", {D});
    hc_head = V4Hc{b.owned_matrix("hc_head_fn", hc, hc * D), b.vec("hc_head_base", {hc}), b.vec("hc_head_scale", {1})};
    for (int i = 0; i < cfg.n_layers; ++i) {
        const std::string p = "layers." + std::to_string(i) + ".";
        V4Layer L;
        L.ratio = cfg.ratios[i];
        L.hash = i < cfg.n_hash_layers;
        L.hc_attn = V4Hc{b.owned_matrix(p + "hc_attn_fn", M, hc * D), b.vec(p + "hc_attn_base", {M}),
                         b.vec(p + "hc_attn_scale", {3})};
        L.hc_ffn = V4Hc{b.owned_matrix(p + "hc_ffn_fn", M, hc * D), b.vec(p + "hc_ffn_base", {M}),
                        b.vec(p + "hc_ffn_scale", {3})};
        L.attn_norm = b.vec(p + "attn_norm.weight", {D});
        L.ffn_norm = b.vec(p + "ffn_norm.weight", {D});
        const std::string a = p + "attn.";
        L.wq_a = b.matrix(a + "wq_a.weight", cfg.q_rank, D);
        L.q_norm = b.vec(a + "q_norm.weight", {cfg.q_rank});
        L.wq_b = b.matrix(a + "wq_b.weight", qd, cfg.q_rank);
        L.wkv = b.matrix(a + "wkv.weight", hd, D);
        L.kv_norm = b.vec(a + "kv_norm.weight", {hd});
        L.wo_a = b.matrix(a + "wo_a.weight", orow, qd / cfg.o_groups);
        L.wo_b = b.matrix(a + "wo_b.weight", D, orow);
        L.sink = b.vec(a + "attn_sink", {cfg.n_heads});
        if (L.ratio) {
            const int w = L.ratio == 4 ? 2 * int(hd) : int(hd);
            L.comp = V4Compressor{b.matrix(a + "compressor.wkv.weight", w, D), b.matrix(a + "compressor.wgate.weight", w, D),
                                  b.vec(a + "compressor.ape", {L.ratio, w}), b.vec(a + "compressor.norm.weight", {hd}),
                                  w, int(hd)};
        }
        if (L.ratio == 4) {
            const int id = cfg.index_dim, w = 2 * id;
            const std::string x = a + "indexer.";
            L.icomp = V4Compressor{b.matrix(x + "compressor.wkv.weight", w, D), b.matrix(x + "compressor.wgate.weight", w, D),
                                   b.vec(x + "compressor.ape", {4, w}), b.vec(x + "compressor.norm.weight", {id}), w, id};
            L.iwq_b = b.matrix(x + "wq_b.weight", int64_t(cfg.index_heads) * id, cfg.q_rank);
            L.iweights = b.matrix(x + "weights_proj.weight", cfg.index_heads, D);
        }
        const std::string f = p + "ffn.";
        L.gate = b.matrix(f + "gate.weight", cfg.n_experts, D);
        if (L.hash) L.tid2eid = b.ids(f + "gate.tid2eid", V, cfg.top_k, cfg.n_experts);
        else L.gate_bias = b.vec(f + "gate.bias", {cfg.n_experts});
        for (int e = 0; e < cfg.n_experts; ++e) {
            const std::string x = f + "experts." + std::to_string(e) + ".";
            L.w1.push_back(b.matrix(x + "w1.weight", cfg.moe_inter, D));
            L.w2.push_back(b.matrix(x + "w2.weight", D, cfg.moe_inter));
            L.w3.push_back(b.matrix(x + "w3.weight", cfg.moe_inter, D));
        }
        L.sw1 = b.matrix(f + "shared_experts.w1.weight", cfg.moe_inter, D);
        L.sw2 = b.matrix(f + "shared_experts.w2.weight", D, cfg.moe_inter);
        L.sw3 = b.matrix(f + "shared_experts.w3.weight", cfg.moe_inter, D);
        layers.push_back(std::move(L));
    }
    // Every matrix but the embedding (read a row at a time) gets a panel copy for the float matmuls.
    std::vector<WeightView*> mats{&head, &hc_head.fn};
    for (V4Layer& L : layers) {
        for (WeightView* w : {&L.hc_attn.fn, &L.hc_ffn.fn, &L.wq_a, &L.wq_b, &L.wkv, &L.wo_a, &L.wo_b, &L.gate,
                              &L.sw1, &L.sw2, &L.sw3})
            mats.push_back(w);
        if (L.ratio) mats.insert(mats.end(), {&L.comp.wkv, &L.comp.wgate});
        if (L.ratio == 4) mats.insert(mats.end(), {&L.icomp.wkv, &L.icomp.wgate, &L.iwq_b, &L.iweights});
    }
    // The routed experts are packed on first use (prepare_experts); here they enter the
    // fingerprint by samples only (pack_and_hash), so a load reads none of their bytes.
    std::set<const uint8_t*> lazy;
    for (const V4Layer& L : layers)
        for (auto* v : {&L.w1, &L.w2, &L.w3})
            for (const WeightView& w : *v) {
                lazy.insert(w.data);
                if (w.scales) lazy.insert(w.scales);
            }
    slots_.resize(layers.size());
    for (auto& s : slots_) s.reset(new ExpertSlot[cfg.n_experts]);
    // (packed below, with the fingerprint: pack_and_hash, one pass over the file that releases
    // its pages as they are copied; the embedding's rows fault back in as tokens are looked up)
    uint64_t h = hash_bytes("deepseek_v4", 11, 0x7A656E35);
    const int dims[] = {cfg.vocab, cfg.hidden, cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.q_rank,
                        cfg.o_groups, cfg.o_rank, cfg.window, cfg.index_heads, cfg.index_dim, cfg.index_topk,
                        cfg.n_experts, cfg.top_k, cfg.moe_inter, cfg.n_hash_layers, cfg.hc_mult, cfg.hc_iters};
    h = hash_bytes(dims, sizeof dims, h);
    h = hash_bytes(cfg.ratios.data(), cfg.ratios.size() * 4, h);
    const float fl[] = {cfg.route_scale, cfg.swiglu_limit, cfg.hc_eps, cfg.rms_eps};
    h = hash_bytes(fl, sizeof fl, h);
    h = hash_bytes(freq_main.data(), freq_main.size() * 4, h);
    h = hash_bytes(freq_compress.data(), freq_compress.size() * 4, h);
    for (const WeightView* w : mats) arena_bytes_ += owned_bytes(*w);
    // an int8 matmul reads 16-row groups: the grouped output projection starts a group per o_rank
    for (const V4Layer& L : layers)
        if (L.wo_a.type == kTypeFP8 && cfg.o_rank % 16) throw BadModel("FP8 wo_a needs o_lora_rank % 16 == 0");
    h = pack_and_hash(b.by, mats, h, arena_, packed_, panels_, pool, load_threads, cache_, &lazy);
    for (const auto& [name, t] : b.by) n_params += t->elements();
    fingerprint = h;
}

std::vector<V4Model::LayerBytes> V4Model::layer_bytes() const {
    std::vector<LayerBytes> out;
    for (const V4Layer& L : layers) {
        LayerBytes b;
        for (const WeightView* w : {&L.hc_attn.fn, &L.wq_a, &L.wq_b, &L.wkv, &L.wo_a, &L.wo_b}) b.attn += owned_bytes(*w);
        if (L.ratio) b.attn += owned_bytes(L.comp.wkv) + owned_bytes(L.comp.wgate);
        if (L.ratio == 4)
            for (const WeightView* w : {&L.icomp.wkv, &L.icomp.wgate, &L.iwq_b, &L.iweights}) b.attn += owned_bytes(*w);
        for (const WeightView* w : {&L.hc_ffn.fn, &L.gate, &L.sw1, &L.sw2, &L.sw3}) b.ffn += owned_bytes(*w);
        b.expert = owned_bytes(L.w1[0]) + owned_bytes(L.w2[0]) + owned_bytes(L.w3[0]);
        out.push_back(b);
    }
    return out;
}

void V4Model::prepare_experts(int l, const std::vector<int>& ids) const {
    ExpertSlot* slots = slots_[l].get();
    bool all = true;
    for (int e : ids) all = all && slots[e].ready.load(std::memory_order_acquire);
    if (all) return;  // the common case once warm: no lock
    std::lock_guard<std::mutex> lock(expert_mu_);
    struct Job { const WeightView* src; const WeightView* dst; uint8_t* at; };
    std::vector<Job> jobs;
    std::vector<int> fresh;
    for (int e : ids) {
        ExpertSlot& s = slots[e];
        if (s.ready.load(std::memory_order_acquire) || std::find(fresh.begin(), fresh.end(), e) != fresh.end()) continue;
        const V4Layer& L = layers[l];
        const WeightView* src[3] = {&L.w1[e], &L.w2[e], &L.w3[e]};
        WeightView* dst[3] = {&s.view.w1, &s.view.w2, &s.view.w3};
        size_t total = 0;
        for (const WeightView* w : src) total += owned_bytes(*w);
        s.mem = alloc_zeroed(total);
        uint8_t* at = s.mem.get();
        for (int i = 0; i < 3; ++i) {  // the layout now, the rows over the pool
            *dst[i] = *src[i];
            own_layout(*dst[i], at, s.packed, s.panels);
            jobs.push_back({src[i], dst[i], at});
            at += owned_bytes(*src[i]);
        }
        expert_bytes_ += total;
        fresh.push_back(e);
    }
    // tasks of 64 rows (a panel band, four 16-row groups)
    std::vector<std::pair<int, int64_t>> tasks;
    for (size_t j = 0; j < jobs.size(); ++j)
        for (int64_t r = 0; r < jobs[j].src->rows; r += kPanelRows) tasks.push_back({int(j), r});
    // The file is read exactly: each matrix's codes and scales asked for ahead, the mapping's
    // read-around off while the tasks fault them in (a fault reads read_ahead_kb around it, into
    // the neighbouring experts: on the Zen 3 VM, 8 MiB; 3 experts of V4 Flash's first 3 layers
    // put 120 MB of the experts' file into the page cache, now 90 MB, 40 MB of it theirs)
    const FileMaps maps;
    std::vector<std::pair<const uint8_t*, size_t>> reads;
    for (const Job& j : jobs) {
        const WeightView& w = *j.src;
        reads.push_back({w.data, size_t(w.rows) * w.row_bytes});
        if (w.scales && w.type == kTypeMXFP4) reads.push_back({w.scales, size_t(w.rows) * size_t(w.cols / 32)});
    }
    for (const auto& [p, n] : reads) maps.read_sparsely(p, n, true), maps.will_need(p, n);
    pool.run(int(tasks.size()), [&](int t, int) {
        const Job& j = jobs[tasks[t].first];
        const int64_t r0 = tasks[t].second;
        pack_rows(*j.dst, j.at, r0, std::min(j.src->rows, r0 + kPanelRows));
    });
    for (const auto& [p, n] : reads) maps.read_sparsely(p, n, false), maps.release(p, n);
    for (int e : fresh) slots[e].ready.store(true, std::memory_order_release);
}

void V4Model::prepare_all_experts() const {
    std::vector<int> all(cfg.n_experts);
    for (int e = 0; e < cfg.n_experts; ++e) all[e] = e;
    for (int l = 0; l < cfg.n_layers; ++l) prepare_experts(l, all);
}

size_t V4Model::expert_bytes_total() const {
    size_t n = 0;
    for (const LayerBytes& b : layer_bytes()) n += b.expert * size_t(cfg.n_experts);
    return n;
}

size_t V4Model::head_bytes() const { return owned_bytes(head) + owned_bytes(hc_head.fn); }

// ---- QAT simulations -------------------------------------------------------------------------

namespace {
// 2^ceil(log2(r)) for r > 0, exactly (frexp: r = m 2^e with m in [0.5, 1)).
float pow2_ceil(float r) {
    int e;
    const float m = std::frexp(r, &e);
    return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}
// The official kernel's block scale: 2^ceil(log2(max(amax, floor) * f32(1 / qmax))), a product,
// not a division (they can differ when amax / qmax is within an ulp of a power of two).
float block_scale(const float* x, int n, float qmax, float floor) {
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    return pow2_ceil(std::max(amax, floor) * (1.0f / qmax));
}
// a rounded half to even to a multiple of step, a power of two, with 0 <= a / step < 2^22: the
// product by 1 / step is exact, and adding and subtracting 2^23 rounds it as nearbyint does in the
// default rounding mode, without nearbyint's library call (the indexer's queries take 8192 of
// these per token and ratio-4 layer: v4_fp4_sim 16 -> 12 ns a value, Zen 3).
float round_to_step(float a, float step) {
    constexpr float kRound = 0x1p23f;
    return ((a * (1.0f / step) + kRound) - kRound) * step;
}
}  // namespace

void v4_fp8_sim(float* x, int n, int block) {
    // e4m3fn: 3 mantissa bits, normal from 2^-6 (spacing 2^(e-3)), subnormal spacing 2^-9, max 448;
    // |x / scale| <= 448 by construction, so a / step < 16. The scale is a power of two: dividing
    // by it is multiplying by its reciprocal (2^-120 <= 1 / s <= 2^22), exactly.
    for (int b = 0; b < n; b += block) {
        const float s = block_scale(x + b, block, 448.0f, 1e-4f), inv = 1.0f / s;
        for (int i = b; i < b + block; ++i) {
            const float a = std::fabs(x[i]) * inv;
            int e;
            std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1): the binade of a is 2^(e - 1)
            const float step = std::ldexp(1.0f, std::max(e - 1, -6) - 3);
            const float q = std::min(round_to_step(a, step), 448.0f);
            x[i] = (x[i] < 0 ? -q : q) * s;
        }
    }
}

void v4_fp4_sim(float* x, int n, int block) {
    // e2m1: {0, .5, 1, 1.5} spacing .5, {2, 3} spacing 1, {4, 6} spacing 2; |x / scale| <= 6,
    // so a / step < 4. The scale is a power of two (2^-126 <= s <= 2^126), as in v4_fp8_sim.
    for (int b = 0; b < n; b += block) {
        const float s = block_scale(x + b, block, 6.0f, 6.0f * 0x1p-126f);  // the smallest normal scale
        const float inv = 1.0f / s;
        for (int i = b; i < b + block; ++i) {
            const float a = std::fabs(x[i]) * inv;
            const float step = a < 2.0f ? 0.5f : a < 4.0f ? 1.0f : 2.0f;
            const float q = std::min(round_to_step(a, step), 6.0f);
            x[i] = (x[i] < 0 ? -q : q) * s;
        }
    }
}

void v4_hadamard(float* x, int n) {
    for (int h = 1; h < n; h *= 2)
        for (int i = 0; i < n; i += 2 * h)
            for (int j = i; j < i + h; ++j) {
                const float a = x[j], c = x[j + h];
                x[j] = a + c;
                x[j + h] = a - c;
            }
    const float s = 1.0f / std::sqrt(float(n));
    for (int i = 0; i < n; ++i) x[i] *= s;
}

}  // namespace zen5
