// What a <kernel>_<isa>.cpp includes before its `#pragma GCC target` region (so that every
// inline function of the headers it includes first is compiled for the baseline, whichever TU
// the linker keeps it from), and the macros that open and close that region.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PIPELLM_X86 1
#endif

#define PIPELLM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define PIPELLM_TARGET_BEGIN(isa) \
  PIPELLM_PRAGMA(clang attribute push(__attribute__((target(isa))), apply_to = function))
#define PIPELLM_TARGET_END PIPELLM_PRAGMA(clang attribute pop)
#else
#define PIPELLM_TARGET_BEGIN(isa) PIPELLM_PRAGMA(GCC push_options) PIPELLM_PRAGMA(GCC target(isa))
#define PIPELLM_TARGET_END PIPELLM_PRAGMA(GCC pop_options)
#endif
