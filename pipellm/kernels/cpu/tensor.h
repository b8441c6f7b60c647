// The ATen a kernel source needs: Tensor with its methods, the dtype dispatch macros and the
// factories the kernels call. Included instead of <torch/extension.h>, which pulls in all of
// torch's C++ frontend and pybind11 and costs each translation unit minutes to compile;
// bindings.cpp, which defines the Python module, adds torch's pybind11 headers.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

using at::Tensor;
