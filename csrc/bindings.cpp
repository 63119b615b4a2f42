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
#include "sampler.h"

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
        }, py::arg("blob"))
        .def("logits", [](const Context& c) {
            if (!c.logits_valid()) throw ZenError("no logits: evaluate at least one token first");
            return to_array(c.logits());
        })
        .def_property_readonly("n_past", &Context::n_past)
        .def_property_readonly("n_ctx", &Context::n_ctx);

    register_testing(m);
}
