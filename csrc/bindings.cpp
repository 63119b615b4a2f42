// pybind11 boundary: only token ids, scalars, float arrays and byte blobs cross it. Arguments
// are converted under the GIL, the math runs with the GIL released, and C++ errors surface as
// typed Python exceptions (ContextOverflow, BadSnapshot, ModelMismatch, BadModel < ZenError).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <thread>

#include "decoder.h"
#include "sampler.h"

namespace py = pybind11;
using namespace zen5;

namespace {

// Holds the Model plus the Python objects that own the memory its weights point into.
struct PyModel {
    std::shared_ptr<Model> model;
    std::vector<py::object> keepalive;
};

Config config_from_dict(const py::dict& d) {
    Config c;
    c.arch = d["arch"].cast<std::string>();
    c.n_layer = d["n_layer"].cast<int>();
    c.n_embd = d["n_embd"].cast<int>();
    c.n_ff = d["n_ff"].cast<int>();
    c.n_head = d["n_head"].cast<int>();
    c.n_head_kv = d["n_head_kv"].cast<int>();
    c.head_dim = d["head_dim"].cast<int>();
    c.vocab_size = d["vocab_size"].cast<int>();
    c.n_ctx_train = d["n_ctx_train"].cast<int>();
    c.rms_eps = d["rms_eps"].cast<float>();
    c.rope_theta = d["rope_theta"].cast<float>();
    c.rope_neox = d["rope_neox"].cast<bool>();
    c.qkv_bias = d["qkv_bias"].cast<bool>();
    c.qk_norm = d["qk_norm"].cast<bool>();
    c.tied_output = d["tied_output"].cast<bool>();
    return c;
}

py::array_t<float> to_array(const std::vector<float>& v) {
    py::array_t<float> a(v.size());
    std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
    return a;
}

const Kernels& kernels_for(const std::string& isa) { return kernels_by_name(isa.c_str()); }

// (n, kv_dim) key rows in the cache's transposed tiles of kKeyTile positions; the last tile's
// unused positions hold NaN, which no score may read.
template <typename T>
std::vector<T> key_tiles(const T* k, int n, int kv_dim) {
    const int tiles = (n + kKeyTile - 1) / kKeyTile;
    std::vector<T> out(size_t(tiles) * kv_dim * kKeyTile, sizeof(T) == 2 ? T(0x7E00) : T(NAN));
    copy_key_tiles(out.data(), const_cast<T*>(k), n, kv_dim, false);
    return out;
}

using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;
using U8Array = py::array_t<uint8_t, py::array::c_style>;

void register_kernels(py::module_& m) {
    // Direct access to each kernel of either table, for the ref-vs-AVX-512 tests.
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
    });
    m.def("kernel_matmul_int8", [](const std::string& isa, int type, U8Array w, int64_t rows, int64_t cols, F32Array x) {
        const Kernels& k = kernels_for(isa);
        const size_t rb = row_bytes(type, cols);
        if (rb == 0 || size_t(w.size()) != rb * size_t(rows)) throw ZenError("weight bytes do not match type/shape");
        if (x.ndim() != 2 || x.shape(1) != cols) throw ZenError("x must be (n, cols)");
        PackedWeights pw;
        AlignedBytes storage;
        if (!pack_weights(WeightView{w.data(), type, rows, cols, rb}, pw, storage)) throw ZenError("type is not packable");
        const int n = int(x.shape(0));
        std::vector<int8_t> q(size_t(n) * cols);
        std::vector<float> d(size_t(n) * cols / QK);
        std::vector<int32_t> c(size_t(n) * cols / QK);
        std::vector<float> ds(size_t(n) * cols / QK);
        k.quantize_act(x.data(), n, cols, n, q.data(), d.data(), c.data(), ds.data());
        py::array_t<float> y({py::ssize_t(n), py::ssize_t(rows)});
        k.matmul_int8(pw, 0, rows, QuantAct{q.data(), d.data(), c.data(), ds.data(), cols, n}, n, y.mutable_data(), rows);
        return y;
    });
    m.def("kernel_dequant_row", [](const std::string& isa, int type, U8Array src, int64_t n) {
        const size_t rb = row_bytes(type, n);
        if (rb == 0 || size_t(src.size()) < rb) throw ZenError("source bytes do not match type/length");
        py::array_t<float> out(n);
        kernels_for(isa).dequant_row(type, src.data(), n, out.mutable_data());
        return out;
    });
    m.def("kernel_dot", [](const std::string& isa, F32Array a, F32Array b) {
        if (a.size() != b.size()) throw ZenError("length mismatch");
        return kernels_for(isa).dot(a.data(), b.data(), a.size());
    });
    m.def("kernel_axpy", [](const std::string& isa, float alpha, F32Array x, F32Array y) {
        if (x.size() != y.size()) throw ZenError("length mismatch");
        py::array_t<float> out(y.size());
        std::memcpy(out.mutable_data(), y.data(), y.size() * 4);
        kernels_for(isa).axpy(alpha, x.data(), out.mutable_data(), x.size());
        return out;
    });
    m.def("kernel_add", [](const std::string& isa, F32Array y, F32Array x) {
        if (x.size() != y.size()) throw ZenError("length mismatch");
        py::array_t<float> out(y.size());
        std::memcpy(out.mutable_data(), y.data(), y.size() * 4);
        kernels_for(isa).add(out.mutable_data(), x.data(), x.size());
        return out;
    });
    m.def("kernel_rmsnorm", [](const std::string& isa, F32Array x, F32Array w, float eps) {
        if (x.size() != w.size()) throw ZenError("length mismatch");
        py::array_t<float> out(x.size());
        kernels_for(isa).rmsnorm(x.data(), w.data(), x.size(), eps, out.mutable_data());
        return out;
    });
    // q: (hd,) or (nq, hd); k: (n, stride >= hd) rows, tiled here like the cache (kernels.h)
    // with kv_dim = stride. Scores: (n,) or (nq, n).
    m.def("kernel_attn_scores", [](const std::string& isa, F32Array q, F32Array k, int hd, float scale) {
        if (k.ndim() != 2 || k.shape(1) < hd || q.size() % hd || q.size() == 0) throw ZenError("k must be (n, stride >= hd), q (nq, hd)");
        const int n = int(k.shape(0)), nq = int(q.size() / hd);
        py::array_t<float> out(q.ndim() == 1 ? std::vector<py::ssize_t>{n} : std::vector<py::ssize_t>{nq, n});
        const std::vector<float> tiles = key_tiles(k.data(), n, int(k.shape(1)));
        kernels_for(isa).attn_scores(q.data(), nq, tiles.data(), k.shape(1) * kKeyTile, n, hd, scale, out.mutable_data(), n);
        return out;
    });
    m.def("kernel_to_f16", [](const std::string& isa, F32Array x) {
        py::array_t<uint16_t> out(x.size());
        kernels_for(isa).to_f16(x.data(), x.size(), out.mutable_data());
        return out;
    });
    m.def("kernel_attn_scores_h", [](const std::string& isa, F32Array q, py::array_t<uint16_t, py::array::c_style> k, int hd, float scale) {
        if (k.ndim() != 2 || k.shape(1) < hd || q.size() % hd || q.size() == 0) throw ZenError("k must be (n, stride >= hd), q (nq, hd)");
        const int n = int(k.shape(0)), nq = int(q.size() / hd);
        py::array_t<float> out(q.ndim() == 1 ? std::vector<py::ssize_t>{n} : std::vector<py::ssize_t>{nq, n});
        const std::vector<uint16_t> tiles = key_tiles(k.data(), n, int(k.shape(1)));
        kernels_for(isa).attn_scores_h(q.data(), nq, tiles.data(), k.shape(1) * kKeyTile, n, hd, scale, out.mutable_data(), n);
        return out;
    });
    // p: (n,) or (nq, n); v: (n, stride >= hd). Output: (hd,) or (nq, hd), from zero.
    m.def("kernel_attn_values_h", [](const std::string& isa, F32Array p, py::array_t<uint16_t, py::array::c_style> v, int hd) {
        const int n = int(v.shape(0)), nq = n ? int(p.size() / n) : 0;
        if (v.ndim() != 2 || v.shape(1) < hd || n == 0 || p.size() != py::ssize_t(nq) * n) throw ZenError("v must be (n, stride >= hd), p (nq, n)");
        py::array_t<float> out(p.ndim() == 1 ? std::vector<py::ssize_t>{hd} : std::vector<py::ssize_t>{nq, hd});
        std::fill(out.mutable_data(), out.mutable_data() + out.size(), 0.0f);
        kernels_for(isa).attn_values_h(p.data(), n, nq, v.data(), v.shape(1), n, hd, out.mutable_data(), hd);
        return out;
    });
    // The q8_0 cache's kernels: k / v (n, stride >= hd) int8 rows with one scale per position,
    // ks / vs (n,), laid out here like the cache (key_q8_index, value_q8_index; kv_dim = stride).
    using I8Array = py::array_t<int8_t, py::array::c_style>;
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
    });
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
    });
    m.def("kernel_quantize_s8", [](F32Array x) {
        py::array_t<int8_t> q(x.size());
        int32_t sum;
        const float d = quantize_s8(x.data(), int(x.size()), q.mutable_data(), &sum);
        return py::make_tuple(q, d, sum);
    });
    m.def("kernel_softmax", [](const std::string& isa, F32Array x) {
        py::array_t<float> out(x.size());
        std::memcpy(out.mutable_data(), x.data(), x.size() * 4);
        float mx, *o = out.mutable_data();
        if (x.size()) {
            const float sum = kernels_for(isa).softmax_partial(o, int(x.size()), &mx);
            for (py::ssize_t i = 0; i < x.size(); ++i) o[i] /= sum;  // normalized (base 2), for the tests
        }
        return out;
    });
    m.def("kernel_attn_values", [](const std::string& isa, F32Array p, F32Array v, int hd) {
        const int n = int(v.shape(0)), nq = n ? int(p.size() / n) : 0;
        if (v.ndim() != 2 || v.shape(1) < hd || n == 0 || p.size() != py::ssize_t(nq) * n) throw ZenError("v must be (n, stride >= hd), p (nq, n)");
        py::array_t<float> out(p.ndim() == 1 ? std::vector<py::ssize_t>{hd} : std::vector<py::ssize_t>{nq, hd});
        std::fill(out.mutable_data(), out.mutable_data() + out.size(), 0.0f);
        kernels_for(isa).attn_values(p.data(), n, nq, v.data(), v.shape(1), n, hd, out.mutable_data(), hd);
        return out;
    });
    m.def("kernel_swiglu", [](const std::string& isa, F32Array g, F32Array u) {
        if (g.size() != u.size()) throw ZenError("length mismatch");
        py::array_t<float> out(g.size());
        kernels_for(isa).swiglu(g.data(), u.data(), g.size(), out.mutable_data());
        return out;
    });
}

}  // namespace

PYBIND11_MODULE(_native, m) {
    m.doc() = "zen5 native decoder: weights, KV cache, kernels";
    const Kernels& active = select_kernels();  // throws ImportError-worthy RuntimeError on bad ZEN5_FORCE_ISA

    auto base = py::register_exception<ZenError>(m, "ZenError", PyExc_RuntimeError);
    py::register_exception<ContextOverflow>(m, "ContextOverflow", base.ptr());
    py::register_exception<BadSnapshot>(m, "BadSnapshot", base.ptr());
    py::register_exception<ModelMismatch>(m, "ModelMismatch", base.ptr());
    py::register_exception<BadModel>(m, "BadModel", base.ptr());

    m.attr("isa") = active.name;
    m.attr("version") = ZEN5_VERSION;
    m.def("avx512_supported", &cpu_supports_avx512);
    // [(name, missing)] for every ISA tier, worst to best; missing is "" when this CPU, OS and
    // build can run it
    m.def("isa_tiers", [] {
        py::list out;
        for (int i = 0; i < kTierCount; ++i) {
            const IsaTier t = isa_tier(i);
            out.append(py::make_tuple(t.name, t.missing));
        }
        return out;
    });
    // sampler.h; the Python Sampler draws u from its seeded Generator
    m.def("sample_token", [](F32Array logits, double temperature, int top_k, double top_p, double min_p, double u) {
        const py::ssize_t n = logits.size();
        if (n == 0 || n > INT32_MAX) throw ZenError("logits must hold 1 to 2^31-1 values");
        if (!(temperature > 0.0) || !(top_p > 0.0 && top_p <= 1.0) || !(min_p >= 0.0 && min_p <= 1.0) || !(u >= 0.0 && u < 1.0))
            throw ZenError("sample_token: temperature > 0, top_p in (0, 1], min_p in [0, 1], u in [0, 1)");
        return sample_token(logits.data(), int(n), temperature, top_k, top_p, min_p, u);
    }, py::arg("logits"), py::arg("temperature"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"));
    m.def("hardware_threads", [] { return int(std::thread::hardware_concurrency()); });

    py::class_<PyModel>(m, "Model")
        .def(py::init([](const py::dict& cfg, const py::list& tensors, F32Array inv_freq, int threads) {
                 auto pm = std::make_unique<PyModel>();
                 std::vector<TensorIn> ins;
                 for (const auto& item : tensors) {
                     auto tup = item.cast<py::tuple>();
                     auto arr = tup[3].cast<py::array>();
                     if (!(arr.flags() & py::array::c_style)) throw BadModel("tensor data must be C-contiguous");
                     ins.push_back(TensorIn{tup[0].cast<std::string>(), tup[1].cast<int>(),
                                            tup[2].cast<std::vector<int64_t>>(),
                                            static_cast<const uint8_t*>(arr.data()), size_t(arr.nbytes())});
                     pm->keepalive.push_back(arr);
                 }
                 std::vector<float> freq(inv_freq.data(), inv_freq.data() + inv_freq.size());
                 Config c = config_from_dict(cfg);
                 {
                     py::gil_scoped_release nogil;  // fingerprinting reads every weight byte
                     pm->model = std::make_shared<Model>(std::move(c), ins, std::move(freq), threads);
                 }
                 return pm;
             }),
             py::arg("config"), py::arg("tensors"), py::arg("rope_inv_freq"), py::arg("threads"))
        .def_property_readonly("fingerprint", [](const PyModel& p) { return p.model->fingerprint; })
        .def_property_readonly("n_params", [](const PyModel& p) { return p.model->n_params; })
        .def_property_readonly("threads", [](const PyModel& p) { return p.model->pool.size(); });

    py::class_<Context>(m, "Context")
        // kv: "f32" | "f16" | "q8_0"; "" takes the matmul path's default (int8: f16, f32: f32)
        .def(py::init([](const PyModel& pm, int n_ctx, const std::string& isa, const std::string& matmul,
                         const std::string& kv) {
                 if (matmul != "int8" && matmul != "f32") throw ZenError("matmul must be int8 or f32, got " + matmul);
                 const KvType t = !kv.empty() ? kv_type_from_name(kv) : matmul == "int8" ? KvType::F16 : KvType::F32;
                 return std::make_unique<Context>(pm.model, n_ctx, isa.empty() ? nullptr : &kernels_for(isa),
                                                  matmul == "int8", t);
             }),
             py::arg("model"), py::arg("n_ctx"), py::arg("isa") = "", py::arg("matmul") = "int8", py::arg("kv") = "",
             py::keep_alive<1, 2>())
        .def_property_readonly("isa", &Context::isa)
        .def_property_readonly("kv_type", [](const Context& c) { return kv_type_name(c.kv_type()); })
        .def_property_readonly("kv_bytes_per_token", &Context::kv_bytes_per_token)
        .def("eval", [](Context& c, const std::vector<int32_t>& tokens, bool all_logits) -> py::object {
                 const int n = int(tokens.size());
                 if (!all_logits) {
                     py::gil_scoped_release nogil;
                     c.eval(tokens.data(), n);
                     return py::none();
                 }
                 py::array_t<float> out({py::ssize_t(n), py::ssize_t(c.model().cfg.vocab_size)});
                 float* dst = out.mutable_data();
                 {
                     py::gil_scoped_release nogil;
                     c.eval(tokens.data(), n, dst);
                 }
                 return out;
             },
             py::arg("tokens"), py::arg("all_logits") = false)
        .def("rewind", [](Context& c, int n, std::optional<F32Array> last_logits) {
                 if (!last_logits) return c.rewind(n);
                 if (last_logits->ndim() != 1 || last_logits->shape(0) != c.model().cfg.vocab_size)
                     throw ZenError("rewind: last_logits must be a (vocab_size,) float32 array");
                 c.rewind(n, last_logits->data());
             },
             py::arg("n"), py::arg("last_logits") = py::none())
        .def("snapshot", [](const Context& c) {
            std::string s;
            {
                py::gil_scoped_release nogil;
                s = c.snapshot();
            }
            return py::bytes(s);
        })
        .def("restore", [](Context& c, const py::bytes& b) {
            std::string s = b;
            py::gil_scoped_release nogil;
            c.restore(s);
        })
        .def("logits", [](const Context& c) {
            if (!c.logits_valid()) throw ZenError("no logits: evaluate at least one token first");
            return to_array(c.logits());
        })
        .def_property_readonly("n_past", &Context::n_past)
        .def_property_readonly("n_ctx", &Context::n_ctx);

    register_kernels(m);
}
