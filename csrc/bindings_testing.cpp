// zen5._native.testing: each kernel of any tier's table called on its own, with the cache's
// layouts built here from plain rows. Only the tests use these (tests/test_kernels.py compares
// every tier against the reference; test_reference_agreement.py runs the q8_0 attention); the
// production API is bindings.cpp.
#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <tuple>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "bindings.h"
#include "deepseek_v4.h"
#include "model.h"
#include "threadpool.h"

namespace zen5 {

namespace {

// (n, kv_dim) key rows in the cache's transposed tiles of kKeyTile positions; the last tile's
// unused positions hold NaN, which no score may read.
template <typename T>
std::vector<T> key_tiles(const T* k, int n, int kv_dim) {
    const int tiles = (n + kKeyTile - 1) / kKeyTile;
    std::vector<T> out(size_t(tiles) * kv_dim * kKeyTile, sizeof(T) == 2 ? T(0x7E00) : T(NAN));
    copy_key_tiles(out.data(), const_cast<T*>(k), n, kv_dim, false);
    return out;
}

using U8Array = py::array_t<uint8_t, py::array::c_style>;
using U16Array = py::array_t<uint16_t, py::array::c_style>;
using I8Array = py::array_t<int8_t, py::array::c_style>;

// The float caches' attention kernels (fp32, fp16) over k or v, (n, stride >= hd) rows: keys
// tiled here like the cache (kernels.h) with kv_dim = stride, values used as they are.
// q: (hd,) or (nq, hd) -> scores (n,) or (nq, n); p: (n,) or (nq, n) -> output (hd,) or (nq, hd),
// summed from zero.
template <typename Scores, typename Array>
py::array_t<float> attn_scores(Scores kernel, const F32Array& q, const Array& k, int hd, float scale) {
    if (k.ndim() != 2 || k.shape(1) < hd || q.size() % hd || q.size() == 0) throw ZenError("k must be (n, stride >= hd), q (nq, hd)");
    const int n = int(k.shape(0)), nq = int(q.size() / hd);
    py::array_t<float> out(q.ndim() == 1 ? std::vector<py::ssize_t>{n} : std::vector<py::ssize_t>{nq, n});
    const auto tiles = key_tiles(k.data(), n, int(k.shape(1)));
    kernel(q.data(), nq, tiles.data(), k.shape(1) * kKeyTile, n, hd, scale, out.mutable_data(), n);
    return out;
}
template <typename Values, typename Array>
py::array_t<float> attn_values(Values kernel, const F32Array& p, const Array& v, int hd) {
    const int n = int(v.shape(0)), nq = n ? int(p.size() / n) : 0;
    if (v.ndim() != 2 || v.shape(1) < hd || n == 0 || p.size() != py::ssize_t(nq) * n) throw ZenError("v must be (n, stride >= hd), p (nq, n)");
    py::array_t<float> out(p.ndim() == 1 ? std::vector<py::ssize_t>{hd} : std::vector<py::ssize_t>{nq, hd});
    std::fill(out.mutable_data(), out.mutable_data() + out.size(), 0.0f);
    kernel(p.data(), n, nq, v.data(), v.shape(1), n, hd, out.mutable_data(), hd);
    return out;
}

}  // namespace

void register_testing(py::module_& parent) {
    py::module_ m = parent.def_submodule("testing", "kernel-level hooks for the tests: any tier's kernels, one call each");

    // DeepSeek V4's QAT simulations (deepseek_v4.h) on a copy of x: "fp8" / "fp4" per block, "hadamard"
    m.def("v4_qat", [](const std::string& kind, F32Array x, int block) {
        py::array_t<float> out(x.size());
        std::memcpy(out.mutable_data(), x.data(), x.size() * 4);
        const int n = int(x.size());
        if (kind == "hadamard") {
            if (n <= 0 || (n & (n - 1))) throw ZenError("hadamard needs a power-of-two length");
            v4_hadamard(out.mutable_data(), n);
        } else {
            if (block <= 0 || n % block) throw ZenError("the length must be a multiple of the block");
            if (kind == "fp8") v4_fp8_sim(out.mutable_data(), n, block);
            else if (kind == "fp4") v4_fp4_sim(out.mutable_data(), n, block);
            else throw ZenError("kind must be fp8, fp4 or hadamard");
        }
        return out;
    }, py::arg("kind"), py::arg("x"), py::arg("block") = 0);
    // ThreadPool::run_shares on a pool of `threads`: the (u0, u1, ran_on_caller) ranges it ran,
    // the calling thread spending caller_us microseconds per unit and the workers none (a slow
    // thread whose share the others should take over)
    m.def("pool_shares", [](int threads, int64_t n_units, int64_t min_chunk, int caller_us) {
        ThreadPool pool(threads);
        const auto caller = std::this_thread::get_id();
        std::mutex mu;
        std::vector<std::tuple<int64_t, int64_t, bool>> ranges;
        {
            py::gil_scoped_release nogil;
            pool.run_shares(n_units, min_chunk, [&](int64_t u0, int64_t u1) {
                const bool on_caller = std::this_thread::get_id() == caller;
                if (on_caller) std::this_thread::sleep_for(std::chrono::microseconds(caller_us * (u1 - u0)));
                std::lock_guard<std::mutex> lock(mu);
                ranges.emplace_back(u0, u1, on_caller);
            });
        }
        py::list out;
        for (const auto& [u0, u1, on_caller] : ranges) out.append(py::make_tuple(u0, u1, on_caller));
        return out;
    }, py::arg("threads"), py::arg("n_units"), py::arg("min_chunk"), py::arg("caller_us") = 0);
    // (hash_bytes of data, the same fed to StreamHash in pieces of `piece` bytes): must be equal
    m.def("hash_pieces", [](const py::bytes& b, uint64_t seed, size_t piece) {
        const std::string s = b;
        const auto* p = reinterpret_cast<const uint8_t*>(s.data());
        StreamHash h(seed, s.size());
        for (size_t o = 0; o < s.size(); o += std::max<size_t>(piece, 1)) h.update(p + o, std::min(piece, s.size() - o));
        return py::make_tuple(hash_bytes(p, s.size(), seed), h.finish());
    }, py::arg("data"), py::arg("seed"), py::arg("piece"));
    m.def("kernel_matmul", [](const std::string& isa, int type, U8Array w, int64_t rows, int64_t cols, F32Array x) {
        const Kernels& k = kernels_for(isa);
        const size_t rb = row_bytes(type, cols);
        if (rb == 0 || size_t(w.size()) != rb * size_t(rows)) throw ZenError("weight bytes do not match type/shape");
        if (x.ndim() != 2 || x.shape(1) != cols) throw ZenError("x must be (n, cols)");
        const int n = int(x.shape(0));
        py::array_t<float> y({py::ssize_t(n), py::ssize_t(rows)});
        WeightView wv{w.data(), type, rows, cols, rb};
        FloatPanels panels;  // float types: the layout the AVX-512 kernel reads, as the Model packs it
        AlignedBytes storage;
        if (const size_t bytes = float_panel_bytes(type, rows, cols)) {
            storage = alloc_zeroed(bytes);
            pack_float_panels(wv, panels, storage.get());
            wv.panels = &panels;
        }
        k.matmul(wv, 0, rows, x.data(), n, cols, y.mutable_data(), rows);
        return y;
    }, py::arg("isa"), py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("x"));
    // scales: the E8M0 tensor of kTypeFP8 / kTypeMXFP4 weights (kernels.h), empty otherwise
    m.def("kernel_matmul_int8", [](const std::string& isa, int type, U8Array w, int64_t rows, int64_t cols, F32Array x,
                                   U8Array scales) {
        const Kernels& k = kernels_for(isa);
        const size_t rb = row_bytes(type, cols);
        if (rb == 0 || size_t(w.size()) != rb * size_t(rows)) throw ZenError("weight bytes do not match type/shape");
        if (x.ndim() != 2 || x.shape(1) != cols) throw ZenError("x must be (n, cols)");
        const size_t ns = type == kTypeMXFP4 ? size_t(rows * cols / QK)
                          : type == kTypeFP8 ? size_t((rows + 127) / 128 * ((cols + 127) / 128)) : 0;
        if (size_t(scales.size()) != ns) throw ZenError("scales do not match type/shape");
        PackedWeights pw;
        AlignedBytes storage;
        WeightView wv{w.data(), type, rows, cols, rb};
        wv.scales = ns ? scales.data() : nullptr;
        if (!pack_weights(wv, pw, storage)) throw ZenError("type is not packable");
        const int n = int(x.shape(0));
        std::vector<int8_t> q(size_t(n) * cols);
        std::vector<float> d(size_t(n) * cols / QK);
        std::vector<int32_t> c(size_t(n) * cols / QK);
        std::vector<float> ds(size_t(n) * cols / QK);
        k.quantize_act(x.data(), n, cols, n, q.data(), d.data(), c.data(), ds.data());
        py::array_t<float> y({py::ssize_t(n), py::ssize_t(rows)});
        k.matmul_int8(pw, 0, rows, QuantAct{q.data(), d.data(), c.data(), ds.data(), cols, n}, n, y.mutable_data(), rows);
        return y;
    }, py::arg("isa"), py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("x"),
       py::arg("scales") = U8Array());
    // the packed layout's bytes (payloads, then scales) of Q4_0 / Q4_1 / Q8_0 / MXFP4 / FP8 rows
    // (MXFP4, FP8: with their E8M0 scales), packed `piece` rows per call as a load's tasks do (a
    // piece of 1 takes the row-by-row path, 16 the whole groups')
    m.def("pack_layout", [](int type, U8Array w, int64_t rows, int64_t cols, int64_t piece, U8Array scales) {
        const size_t rb = row_bytes(type, cols);
        if (rb == 0 || size_t(w.size()) != rb * size_t(rows)) throw ZenError("weight bytes do not match type/shape");
        if (!packed_payload_bytes(type)) throw ZenError("not a type of the int8 layout");
        if (piece <= 0) throw ZenError("piece must be positive");
        const size_t ns = type == kTypeMXFP4 ? size_t(rows * cols / QK)
                          : type == kTypeFP8 ? size_t((rows + 127) / 128 * ((cols + 127) / 128)) : 0;
        if (size_t(scales.size()) != ns) throw ZenError("scales do not match type/shape");
        WeightView wv{w.data(), type, rows, cols, rb};
        wv.scales = ns ? scales.data() : nullptr;
        const size_t n = packed_bytes(wv);
        AlignedBytes storage = alloc_zeroed(n);
        PackedWeights pw;
        for (int64_t r = 0; r < rows; r += piece) pack_into(wv, pw, storage.get(), r, std::min(rows, r + piece));
        return py::bytes(reinterpret_cast<const char*>(storage.get()), n);
    }, py::arg("type"), py::arg("w"), py::arg("rows"), py::arg("cols"), py::arg("piece"), py::arg("scales") = U8Array());
    m.def("kernel_dequant_row", [](const std::string& isa, int type, U8Array src, int64_t n) {
        const size_t rb = row_bytes(type, n);
        if (rb == 0 || size_t(src.size()) < rb) throw ZenError("source bytes do not match type/length");
        py::array_t<float> out(n);
        kernels_for(isa).dequant_row(type, src.data(), n, out.mutable_data());
        return out;
    }, py::arg("isa"), py::arg("type"), py::arg("src"), py::arg("n"));
    m.def("kernel_dot", [](const std::string& isa, F32Array a, F32Array b) {
        if (a.size() != b.size()) throw ZenError("length mismatch");
        return kernels_for(isa).dot(a.data(), b.data(), a.size());
    }, py::arg("isa"), py::arg("a"), py::arg("b"));
    m.def("kernel_axpy", [](const std::string& isa, float alpha, F32Array x, F32Array y) {
        if (x.size() != y.size()) throw ZenError("length mismatch");
        py::array_t<float> out(y.size());
        std::memcpy(out.mutable_data(), y.data(), y.size() * 4);
        kernels_for(isa).axpy(alpha, x.data(), out.mutable_data(), x.size());
        return out;
    }, py::arg("isa"), py::arg("alpha"), py::arg("x"), py::arg("y"));
    m.def("kernel_add", [](const std::string& isa, F32Array y, F32Array x) {
        if (x.size() != y.size()) throw ZenError("length mismatch");
        py::array_t<float> out(y.size());
        std::memcpy(out.mutable_data(), y.data(), y.size() * 4);
        kernels_for(isa).add(out.mutable_data(), x.data(), x.size());
        return out;
    }, py::arg("isa"), py::arg("y"), py::arg("x"));
    m.def("kernel_rmsnorm", [](const std::string& isa, F32Array x, F32Array w, float eps) {
        if (x.size() != w.size()) throw ZenError("length mismatch");
        py::array_t<float> out(x.size());
        kernels_for(isa).rmsnorm(x.data(), w.data(), x.size(), eps, out.mutable_data());
        return out;
    }, py::arg("isa"), py::arg("x"), py::arg("w"), py::arg("eps"));
    m.def("kernel_attn_scores", [](const std::string& isa, F32Array q, F32Array k, int hd, float scale) {
        return attn_scores(kernels_for(isa).attn_scores, q, k, hd, scale);
    }, py::arg("isa"), py::arg("q"), py::arg("k"), py::arg("hd"), py::arg("scale"));
    m.def("kernel_attn_values", [](const std::string& isa, F32Array p, F32Array v, int hd) {
        return attn_values(kernels_for(isa).attn_values, p, v, hd);
    }, py::arg("isa"), py::arg("p"), py::arg("v"), py::arg("hd"));
    m.def("kernel_to_f16", [](const std::string& isa, F32Array x) {
        py::array_t<uint16_t> out(x.size());
        kernels_for(isa).to_f16(x.data(), x.size(), out.mutable_data());
        return out;
    }, py::arg("isa"), py::arg("x"));
    m.def("kernel_attn_scores_h", [](const std::string& isa, F32Array q, U16Array k, int hd, float scale) {
        return attn_scores(kernels_for(isa).attn_scores_h, q, k, hd, scale);
    }, py::arg("isa"), py::arg("q"), py::arg("k"), py::arg("hd"), py::arg("scale"));
    m.def("kernel_attn_values_h", [](const std::string& isa, F32Array p, U16Array v, int hd) {
        return attn_values(kernels_for(isa).attn_values_h, p, v, hd);
    }, py::arg("isa"), py::arg("p"), py::arg("v"), py::arg("hd"));
    // The q8_0 cache's kernels: k / v (n, stride >= hd) int8 rows with one scale per position,
    // ks / vs (n,), laid out here like the cache (key_q8_index, value_q8_index; kv_dim = stride).
    m.def("kernel_attn_scores_q8", [](const std::string& isa, F32Array q, I8Array k, F32Array ks, int hd, float scale) {
        if (k.ndim() != 2 || k.shape(1) < hd || hd % 4 || q.size() % hd || q.size() == 0 || ks.size() != k.shape(0))
            throw ZenError("k must be (n, stride >= hd), ks (n,), q (nq, hd), hd a multiple of 4");
        const int n = int(k.shape(0)), nq = int(q.size() / hd), kvd = int(k.shape(1));
        py::array_t<float> out(q.ndim() == 1 ? std::vector<py::ssize_t>{n} : std::vector<py::ssize_t>{nq, n});
        std::vector<uint8_t> tiles(size_t((n + kKeyTile - 1) / kKeyTile) * kvd * kKeyTile, 0xEE);
        for (int p = 0; p < n; ++p)
            for (int c = 0; c < kvd; ++c) tiles[key_q8_index(p, c, kvd)] = uint8_t(k.data()[size_t(p) * kvd + c] + 128);
        kernels_for(isa).attn_scores_q8(q.data(), nq, tiles.data(), ks.data(), int64_t(kvd) * kKeyTile, n, hd, scale,
                                        out.mutable_data(), n);
        return out;
    }, py::arg("isa"), py::arg("q"), py::arg("k"), py::arg("ks"), py::arg("hd"), py::arg("scale"));
    m.def("kernel_attn_values_q8", [](const std::string& isa, F32Array p, I8Array v, F32Array vs, int hd) {
        const int n = int(v.shape(0)), nq = n ? int(p.size() / n) : 0, kvd = int(v.shape(1));
        if (v.ndim() != 2 || kvd < hd || n == 0 || p.size() != py::ssize_t(nq) * n || vs.size() != n)
            throw ZenError("v must be (n, stride >= hd), vs (n,), p (nq, n)");
        py::array_t<float> out(p.ndim() == 1 ? std::vector<py::ssize_t>{hd} : std::vector<py::ssize_t>{nq, hd});
        std::fill(out.mutable_data(), out.mutable_data() + out.size(), 0.0f);
        std::vector<int8_t> quads(size_t((n + 3) / 4) * kvd * 4, int8_t(0x5A));  // the tail holds junk, as a cache may
        for (int i = 0; i < n; ++i)
            for (int c = 0; c < kvd; ++c) quads[value_q8_index(i, c, kvd)] = v.data()[size_t(i) * kvd + c];
        kernels_for(isa).attn_values_q8(p.data(), n, nq, quads.data(), vs.data(), int64_t(kvd) * 4, n, hd,
                                        out.mutable_data(), hd);
        return out;
    }, py::arg("isa"), py::arg("p"), py::arg("v"), py::arg("vs"), py::arg("hd"));
    m.def("kernel_quantize_s8", [](F32Array x) {
        py::array_t<int8_t> q(x.size());
        int32_t sum;
        const float d = quantize_s8(x.data(), int(x.size()), q.mutable_data(), &sum);
        return py::make_tuple(q, d, sum);
    }, py::arg("x"));
    m.def("kernel_softmax", [](const std::string& isa, F32Array x) {
        py::array_t<float> out(x.size());
        std::memcpy(out.mutable_data(), x.data(), x.size() * 4);
        float mx, *o = out.mutable_data();
        if (x.size()) {
            const float sum = kernels_for(isa).softmax_partial(o, int(x.size()), &mx);
            for (py::ssize_t i = 0; i < x.size(); ++i) o[i] /= sum;  // normalized (base 2), for the tests
        }
        return out;
    }, py::arg("isa"), py::arg("x"));
    m.def("kernel_swiglu", [](const std::string& isa, F32Array g, F32Array u) {
        if (g.size() != u.size()) throw ZenError("length mismatch");
        py::array_t<float> out(g.size());
        kernels_for(isa).swiglu(g.data(), u.data(), g.size(), out.mutable_data());
        return out;
    }, py::arg("isa"), py::arg("g"), py::arg("u"));
}

}  // namespace zen5
