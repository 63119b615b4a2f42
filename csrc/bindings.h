// What the binding files share: the array types they accept and the testing submodule's entry.
// bindings.cpp is the production module (zen5._native); bindings_testing.cpp adds the kernel-level
// hooks only tests use, as the submodule zen5._native.testing.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "kernels/kernels.h"

namespace py = pybind11;

namespace zen5 {

// float32 input arrays: C-contiguous, converted from other dtypes
using F32Array = py::array_t<float, py::array::c_style | py::array::forcecast>;

inline const Kernels& kernels_for(const std::string& isa) { return kernels_by_name(isa.c_str()); }

// Defines zen5._native.testing under the production module m.
void register_testing(py::module_& m);

}  // namespace zen5
