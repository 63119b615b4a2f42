// pybind11 boundary: only token ids, scalars, float arrays and byte blobs cross it. Arguments
// are converted under the GIL, the math runs with the GIL released, and C++ errors surface as
// typed Python exceptions (ContextOverflow, BadSnapshot, ModelMismatch, BadModel < ZenError).
// This is the production API; its type stub is python/zen5/_native/__init__.pyi, checked against
// the built module by tests/test_native_stub.py. The tests' kernel hooks are bindings_testing.cpp.
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <thread>

#include "bindings.h"
#include "decoder.h"
#include "deepseek_v4.h"
#include "sampler.h"

using namespace zen5;

namespace {

// The arena cache's outcome (arena_cache.h) for zen5.weight_cache: status, why a file was not
// used, whether the background promotion to huge pages is done.
static py::dict cache_info(const ArenaCache& c) {
    py::dict d;
    d["status"] = c.status(), d["miss"] = c.miss(), d["promoted"] = c.promoted();
    return d;
}

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

V4Config v4_config_from_dict(const py::dict& d) {
    V4Config c;
    auto i = [&](const char* k) { return d[k].cast<int>(); };
    auto f = [&](const char* k) { return d[k].cast<float>(); };
    c.vocab = i("vocab_size"), c.hidden = i("hidden"), c.n_layers = i("n_layers"), c.n_heads = i("n_heads");
    c.head_dim = i("head_dim"), c.rope_dim = i("rope_dim"), c.q_rank = i("q_rank"), c.o_groups = i("o_groups");
    c.o_rank = i("o_rank"), c.window = i("window"), c.ratios = d["ratios"].cast<std::vector<int>>();
    c.index_heads = i("index_heads"), c.index_dim = i("index_dim"), c.index_topk = i("index_topk");
    c.n_experts = i("n_experts"), c.top_k = i("top_k"), c.moe_inter = i("moe_inter");
    c.n_hash_layers = i("n_hash_layers"), c.route_scale = f("route_scale"), c.swiglu_limit = f("swiglu_limit");
    c.hc_mult = i("hc_mult"), c.hc_iters = i("hc_iters"), c.hc_eps = f("hc_eps"), c.rms_eps = f("rms_eps");
    c.n_ctx_train = i("n_ctx_train");
    return c;
}

// safetensors dtype names -> the type ids TensorIn carries (GGML's; I32 is 26)
int dtype_id(const std::string& dt) {
    if (dt == "F32") return GGML_F32;
    if (dt == "F16") return GGML_F16;
    if (dt == "BF16") return GGML_BF16;
    if (dt == "I32") return 26;
    if (dt == "F8_E4M3") return kTypeFP8;
    if (dt == "MXFP4") return kTypeMXFP4;  // the checkpoint's I8 tensors of packed e2m1 pairs
    if (dt == "F8_E8M0") return kTypeE8M0;
    throw BadModel("unsupported tensor dtype " + dt);
}

// A flat (tokens * n_layers * k) record as a (tokens, n_layers, k) array.
py::array_t<int32_t> per_layer(const std::vector<int32_t>& v, int n_layers, int k) {
    py::array_t<int32_t> a({py::ssize_t(v.size() / (size_t(n_layers) * k)), py::ssize_t(n_layers), py::ssize_t(k)});
    std::memcpy(a.mutable_data(), v.data(), v.size() * 4);
    return a;
}

struct PyV4Model {
    std::shared_ptr<V4Model> model;
    std::vector<py::object> keepalive;
};

py::array_t<float> to_array(const std::vector<float>& v) {
    py::array_t<float> a(v.size());
    std::memcpy(a.mutable_data(), v.data(), v.size() * sizeof(float));
    return a;
}

// The methods a sequence's state offers Python, the same for Context and V4Context so zen5.engine
// drives either: eval (logits of every token or only the last), rewind (optionally handing back
// the last logits), snapshot/restore, logits, n_past, n_ctx. The math runs without the GIL.
template <class Ctx, class Vocab>
void def_state_api(py::class_<Ctx>& cls, Vocab vocab) {
    cls.def("eval", [vocab](Ctx& c, const std::vector<int32_t>& tokens, bool all_logits) -> py::object {
           const int n = int(tokens.size());
           if (!all_logits) {
               py::gil_scoped_release nogil;
               c.eval(tokens.data(), n);
               return py::none();
           }
           py::array_t<float> out({py::ssize_t(n), py::ssize_t(vocab(c))});
           float* dst = out.mutable_data();
           {
               py::gil_scoped_release nogil;
               c.eval(tokens.data(), n, dst);
           }
           return out;
       },
       py::arg("tokens"), py::arg("all_logits") = false)
        .def("rewind", [vocab](Ctx& c, int n, std::optional<F32Array> last_logits) {
                 if (last_logits && (last_logits->ndim() != 1 || last_logits->shape(0) != vocab(c)))
                     throw ZenError("rewind: last_logits must be a (vocab_size,) float32 array");
                 py::gil_scoped_release nogil;  // a DeepSeek V4 rewind may evaluate tokens again
                 c.rewind(n, last_logits ? last_logits->data() : nullptr);
             },
             py::arg("n"), py::arg("last_logits") = py::none())
        .def("snapshot", [](const Ctx& c) {
            std::string s;
            {
                py::gil_scoped_release nogil;
                s = c.snapshot();
            }
            return py::bytes(s);
        })
        .def("restore", [](Ctx& c, const py::bytes& b) {
            std::string s = b;
            py::gil_scoped_release nogil;
            c.restore(s);
        }, py::arg("blob"))
        .def("logits", [](const Ctx& c) {
            if (!c.logits_valid()) throw ZenError("no logits: evaluate at least one token first");
            return to_array(c.logits());
        })
        .def_property_readonly("n_past", &Ctx::n_past)
        .def_property_readonly("n_ctx", &Ctx::n_ctx);
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
        .def(py::init([](const py::dict& cfg, const py::list& tensors, F32Array inv_freq, int threads,
                         const std::string& cache_path, uint64_t cache_key, bool cache_write, int load_threads) {
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
                     pm->model = std::make_shared<Model>(std::move(c), ins, std::move(freq), threads,
                                                         CacheSpec{cache_path, cache_key, cache_write}, load_threads);
                 }
                 return pm;
             }),
             py::arg("config"), py::arg("tensors"), py::arg("rope_inv_freq"), py::arg("threads"),
             py::arg("cache_path") = "", py::arg("cache_key") = 0, py::arg("cache_write") = true,
             py::arg("load_threads") = 0)
        .def_property_readonly("weight_cache", [](const PyModel& p) { return cache_info(p.model->weight_cache()); })
        .def("finish_weight_cache", [](PyModel& p) {
            py::gil_scoped_release nogil;
            p.model->finish_weight_cache();
        })
        .def_property_readonly("fingerprint", [](const PyModel& p) { return p.model->fingerprint; })
        .def_property_readonly("n_params", [](const PyModel& p) { return p.model->n_params; })
        .def_property_readonly("threads", [](const PyModel& p) { return p.model->pool.size(); })
        .def_property_readonly("weight_bytes", [](const PyModel& p) { return p.model->weight_bytes(); });
    // Memory planning before anything is allocated (the engine's fit check): the arena bytes of one
    // matrix (0 for what is read from the file in place), and a KV cache's bytes for n_ctx.
    m.def("dtype_id", &dtype_id, py::arg("dtype"));  // a native tensor list's dtype -> owned_matrix_bytes' type
    m.def("owned_matrix_bytes", [](int type, int64_t rows, int64_t cols) {
        return owned_bytes(WeightView{nullptr, type, rows, cols, row_bytes(type, cols)});
    }, py::arg("type"), py::arg("rows"), py::arg("cols"));
    m.def("kv_cache_bytes", [](const py::dict& cfg, int n_ctx, const std::string& kv) {
        return KvCache::bytes_for(config_from_dict(cfg), n_ctx, kv_type_from_name(kv));
    }, py::arg("config"), py::arg("n_ctx"), py::arg("kv"));

    py::class_<Context> context(m, "Context");
    context
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
        .def_property_readonly("kv_bytes_reserved", &Context::kv_bytes_reserved)
        .def_property_readonly("kv_bytes_resident", &Context::kv_bytes_resident);
    def_state_api(context, [](const Context& c) { return c.model().cfg.vocab_size; });

    // DeepSeek V4 (deepseek_v4.h): tensors under the official names, [(name, dtype, shape, uint8 array)]
    py::class_<PyV4Model>(m, "DeepSeekV4Model")
        .def(py::init([](const py::dict& cfg, const py::list& tensors, F32Array freq_main, F32Array freq_compress,
                         int threads, const std::string& cache_path, uint64_t cache_key, bool cache_write, int load_threads) {
                 auto pm = std::make_unique<PyV4Model>();
                 std::vector<TensorIn> ins;
                 for (const auto& item : tensors) {
                     auto tup = item.cast<py::tuple>();
                     auto arr = tup[3].cast<py::array>();
                     if (!(arr.flags() & py::array::c_style)) throw BadModel("tensor data must be C-contiguous");
                     ins.push_back(TensorIn{tup[0].cast<std::string>(), dtype_id(tup[1].cast<std::string>()),
                                            tup[2].cast<std::vector<int64_t>>(),
                                            static_cast<const uint8_t*>(arr.data()), size_t(arr.nbytes())});
                     pm->keepalive.push_back(arr);
                 }
                 std::vector<float> fm(freq_main.data(), freq_main.data() + freq_main.size());
                 std::vector<float> fc(freq_compress.data(), freq_compress.data() + freq_compress.size());
                 V4Config c = v4_config_from_dict(cfg);
                 {
                     py::gil_scoped_release nogil;
                     pm->model = std::make_shared<V4Model>(std::move(c), ins, std::move(fm), std::move(fc), threads,
                                                           CacheSpec{cache_path, cache_key, cache_write}, load_threads);
                 }
                 return pm;
             }),
             py::arg("config"), py::arg("tensors"), py::arg("freq_main"), py::arg("freq_compress"), py::arg("threads"),
             py::arg("cache_path") = "", py::arg("cache_key") = 0, py::arg("cache_write") = true,
             py::arg("load_threads") = 0)
        .def_property_readonly("weight_cache", [](const PyV4Model& p) { return cache_info(p.model->weight_cache()); })
        .def("finish_weight_cache", [](PyV4Model& p) {
            py::gil_scoped_release nogil;
            p.model->finish_weight_cache();
        })
        .def_property_readonly("fingerprint", [](const PyV4Model& p) { return p.model->fingerprint; })
        .def_property_readonly("n_params", [](const PyV4Model& p) { return p.model->n_params; })
        .def_property_readonly("threads", [](const PyV4Model& p) { return p.model->pool.size(); })
        .def_property_readonly("weight_bytes", [](const PyV4Model& p) { return p.model->weight_bytes(); })
        // bytes the matmuls read by part: [(attention, ffn less routed experts, one routed expert)] per layer
        .def("layer_bytes", [](const PyV4Model& p) {
            py::list out;
            for (const auto& b : p.model->layer_bytes()) out.append(py::make_tuple(b.attn, b.ffn, b.expert));
            return out;
        })
        .def_property_readonly("head_bytes", [](const PyV4Model& p) { return p.model->head_bytes(); })
        // routed experts, packed on first use: bytes packed so far, bytes when all are
        .def_property_readonly("expert_bytes_packed", [](const PyV4Model& p) { return p.model->expert_bytes_packed(); })
        .def_property_readonly("expert_bytes_total", [](const PyV4Model& p) { return p.model->expert_bytes_total(); })
        .def("prepare_all_experts", [](const PyV4Model& p) {
            py::gil_scoped_release nogil;
            p.model->prepare_all_experts();
        });

    // The same methods as Context, so zen5.engine drives either.
    py::class_<V4Context> v4context(m, "DeepSeekV4Context");
    v4context
        .def(py::init([](const PyV4Model& pm, int n_ctx, const std::string& isa, bool qat) {
                 return std::make_unique<V4Context>(pm.model, n_ctx, isa.empty() ? nullptr : &kernels_for(isa), qat);
             }),
             py::arg("model"), py::arg("n_ctx"), py::arg("isa") = "", py::arg("qat") = true, py::keep_alive<1, 2>())
        .def_property_readonly("isa", &V4Context::isa)
        .def_property_readonly("qat", &V4Context::qat)
        .def_property_readonly("kv_type", [](const V4Context&) { return "f32"; })
        .def_property_readonly("kv_bytes_per_token", &V4Context::bytes_per_token)
        .def_property_readonly("rebuilt_tokens", &V4Context::rebuilt_tokens)
        // the last eval's expert ids (n, n_layers, top_k) and indexer picks (n, n_layers, index_topk; -1 pads)
        .def("last_experts", [](const V4Context& c) {
            return per_layer(c.last_experts(), c.model().cfg.n_layers, c.model().cfg.top_k);
        })
        .def("last_selected", [](const V4Context& c) {
            return per_layer(c.last_selected(), c.model().cfg.n_layers, std::max(c.model().cfg.index_topk, 1));
        })
        // seconds per stage since the last reset: layer l's attention half at 2l, FFN half at 2l + 1, the rest last
        .def("stage_seconds", [](const V4Context& c) { return c.stage_seconds(); })
        .def("reset_stage_seconds", &V4Context::reset_stage_seconds);
    def_state_api(v4context, [](const V4Context& c) { return c.model().cfg.vocab; });

    register_testing(m);
}
