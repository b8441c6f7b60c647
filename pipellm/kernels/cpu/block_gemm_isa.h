// What a block_gemm_<isa>.cpp includes before its target region (isa_target.h).
#pragma once

#include "block_gemm.h"
#include "isa_target.h"
