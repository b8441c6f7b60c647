"""Segmented LoRA (pipellm/kernels/lora.py): the reference against a per-row float64 loop, the
Triton kernels (under TRITON_INTERPRET=1 without a GPU, tests/conftest.py) against the reference on
random inputs, the contract's checks. The interpreter's float32 -> bf16 casts truncate where
the GPU rounds to nearest, so a bf16 y is compared within one bf16 ulp (rtol 2^-7)."""

from __future__ import annotations

import pytest
import torch

from pipellm.kernels import dispatch
from pipellm.kernels.lora import (
    MAX_RANK,
    Tiling,
    cpu_packed,
    lora_delta_,
    lora_delta_reference,
    lora_delta_triton,
    tiling_for,
    vnni_pack,
)

DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]  # (x, y)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5)}
# (T, in, out, R, group sizes, tiling): decode-like groups, an empty group, several row blocks,
# rank tiles and splits of `in` with ragged last blocks, a rank above one rank tile
CASES = [
    (12, 32, 48, 8, [3, 0, 1, 4], None),
    (40, 72, 80, 48, [12, 0, 13, 5], Tiling(16, 32, 16, 32, 2)),
    (40, 96, 96, 16, [20, 10, 7], None),
    (30, 64, 40, 48, [9, 17, 0, 2], Tiling(16, 16, 32, 64, 3)),
    (20, 40, 56, 72, [6, 11], None),
]


def make_case(T, d_in, d_out, rank, sizes, x_dtype=torch.float32, y_dtype=torch.float32,
              n_slots=3, seed=0):
    """Random y [T, out], x [T, in], a [S, in, R], b [S, R, out]; the groups' rows a random
    subset of the batch in random order; slots drawn at random (repeats allowed)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, d_in, generator=g).to(x_dtype)
    a = (torch.randn(n_slots, d_in, rank, generator=g) / d_in**0.5).to(x_dtype)
    b = (torch.randn(n_slots, rank, d_out, generator=g) / rank**0.5).to(x_dtype)
    y = torch.randn(T, d_out, generator=g).to(y_dtype)
    n = sum(sizes)
    rows = torch.randperm(T, generator=g)[:n]
    starts = torch.tensor([0] + sizes).cumsum(0)
    slots = torch.randint(0, n_slots, (len(sizes),), generator=g)
    return y, x, a, b, rows, starts, slots, max(sizes, default=0)


def per_row_float64(y, x, a, b, rows, starts, slots) -> torch.Tensor:
    """y[r] + x[r] @ a[s] @ b[s] for each row r of each group, one row at a time, in float64."""
    out = y.double().clone()
    for g, slot in enumerate(slots.tolist()):
        for r in rows[starts[g] : starts[g + 1]].tolist():
            out[r] += x[r].double() @ a[slot].double() @ b[slot].double()
    return out


def others(y, rows) -> torch.Tensor:
    """The rows of y that no group holds."""
    keep = torch.ones(y.shape[0], dtype=torch.bool)
    keep[rows] = False
    return y[keep]


@pytest.mark.parametrize(("x_dtype", "y_dtype"), DTYPES)
@pytest.mark.parametrize("case", CASES[:3])
def test_reference_matches_per_row_float64(case, x_dtype, y_dtype):
    y, x, a, b, rows, starts, slots, max_rows = make_case(*case[:5], x_dtype, y_dtype)
    want = per_row_float64(y, x, a, b, rows, starts, slots)
    y0 = y.clone()
    lora_delta_reference(y, x, a, b, rows, starts, slots, max_rows)
    assert y.dtype == y_dtype
    assert (y[rows] != y0[rows]).float().mean() > 0.9  # the deltas landed
    torch.testing.assert_close(y.double(), want.to(y_dtype).double(), **TOL[y_dtype])
    assert torch.equal(others(y, rows), others(y0, rows))


@pytest.mark.parametrize(("x_dtype", "y_dtype"), DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_triton_matches_reference(case, x_dtype, y_dtype):
    y, x, a, b, rows, starts, slots, max_rows = make_case(*case[:5], x_dtype, y_dtype, seed=1)
    want, y0 = y.clone(), y.clone()
    lora_delta_reference(want, x, a, b, rows, starts, slots, max_rows)
    lora_delta_triton(y, x, a, b, rows, starts, slots, max_rows, tiling=case[5])
    torch.testing.assert_close(y, want, **TOL[y_dtype])
    assert torch.equal(others(y, rows), others(y0, rows))


def test_triton_takes_strided_views_and_a_larger_max_rows():
    """x and y columns of wider tensors, a and b slices of larger stacks, rows a strided view;
    max_rows above the largest group (more row blocks, which exit at once)."""
    y, x, a, b, rows, starts, slots, max_rows = make_case(24, 40, 48, 16, [5, 9, 3], seed=2)
    y_wide = torch.randn(24, 64)
    y_wide[:, 8:56] = y
    x_wide, a_big, b_big = torch.randn(24, 50), torch.randn(4, 40, 20), torch.randn(4, 20, 48)
    x_wide[:, 10:], a_big[:3, :, :16], b_big[:3, :16] = x, a, b
    want = y.clone()
    lora_delta_reference(want, x, a, b, rows, starts, slots, max_rows)
    lora_delta_triton(y_wide[:, 8:56], x_wide[:, 10:], a_big[:3, :, :16], b_big[:3, :16],
                      torch.stack([rows, -rows], 1)[:, 0], starts, slots, max_rows + 20)
    torch.testing.assert_close(y_wide[:, 8:56], want, **TOL[torch.float32])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_public_function_dispatches_in_place(backend):
    y, x, a, b, rows, starts, slots, max_rows = make_case(16, 32, 48, 16, [4, 2, 0], seed=3)
    want, y0 = y.clone(), y.clone()
    lora_delta_reference(want, x, a, b, rows, starts, slots, max_rows)
    previous = dispatch.backend()
    dispatch.set_backend(backend)
    try:
        assert lora_delta_(y, x, a, b, rows, starts, slots, max_rows) is None
    finally:
        dispatch.set_backend(previous)
    torch.testing.assert_close(y, want, **TOL[torch.float32])
    assert not torch.equal(y[rows], y0[rows])
    assert torch.equal(others(y, rows), others(y0, rows))


@pytest.mark.parametrize("fn", [lora_delta_reference, lora_delta_triton])
def test_no_rows_or_no_groups_leave_y_unchanged(fn):
    y, x, a, b, _, _, _, _ = make_case(8, 32, 32, 8, [1])
    y0 = y.clone()
    empty = torch.zeros(0, dtype=torch.int64)
    fn(y, x, a, b, empty, torch.zeros(1, dtype=torch.int64), empty, 0)  # G = 0
    fn(y, x, a, b, empty, torch.zeros(3, dtype=torch.int64), torch.tensor([0, 2]), 0)  # n = 0
    assert torch.equal(y, y0)


def _bad(case: str):
    """One argument list of make_case's shapes broken as `case` names."""
    y, x, a, b, rows, starts, slots, max_rows = make_case(20, 32, 48, 16, [4, 0, 6])
    args = dict(y=y, x=x, a=a, b=b, rows=rows, starts=starts, slots=slots, max_rows=max_rows)
    bad = {
        "starts_short_of_n": dict(starts=torch.tensor([0, 4, 4, 9])),
        "starts_past_n": dict(starts=torch.tensor([0, 4, 4, 11])),
        "starts_decreasing": dict(starts=torch.tensor([0, 5, 4, 10])),
        "starts_length": dict(starts=torch.tensor([0, 4, 10])),
        "max_rows_too_small": dict(max_rows=5),
        "rank_too_large": dict(a=torch.randn(3, 32, MAX_RANK + 1),
                               b=torch.randn(3, MAX_RANK + 1, 48)),
        "a_in_mismatch": dict(a=torch.randn(3, 40, 16)),
        "b_out_mismatch": dict(b=torch.randn(3, 16, 40)),
        "rank_mismatch": dict(b=torch.randn(3, 8, 48)),
        "slots_count_mismatch": dict(b=torch.randn(2, 16, 48)),
        "x_rows_mismatch": dict(x=torch.randn(19, 32)),
        "a_dtype": dict(a=a.to(torch.bfloat16)),
        "y_dtype": dict(y=y.to(torch.int32)),
        "rows_int32": dict(rows=rows.int()),
        "slot_out_of_range": dict(slots=torch.tensor([0, 1, 3])),
        "row_out_of_range": dict(rows=torch.cat([rows[:-1], torch.tensor([20])])),
        "max_rows_not_int": dict(max_rows=torch.tensor(6)),
    }[case]
    return {**args, **bad}


@pytest.mark.parametrize("fn", [lora_delta_reference, lora_delta_triton])
@pytest.mark.parametrize("case", [
    "starts_short_of_n", "starts_past_n", "starts_decreasing", "starts_length",
    "max_rows_too_small", "rank_too_large", "a_in_mismatch", "b_out_mismatch", "rank_mismatch",
    "slots_count_mismatch", "x_rows_mismatch", "a_dtype", "y_dtype", "rows_int32",
    "slot_out_of_range", "row_out_of_range", "max_rows_not_int"])
def test_bad_inputs_raise(case, fn):
    args = _bad(case)
    y0 = args["y"].clone()
    with pytest.raises(ValueError):
        fn(**args)
    assert torch.equal(args["y"], y0)


def test_tiling_for_decode_and_prefill():
    decode, prefill = tiling_for(4, 4096, 16, 16), tiling_for(512, 4096, 16, 2)
    assert decode.block_m == 16 and prefill.block_m == 64
    assert decode.num_warps == 4 and prefill.num_warps == 8
    assert decode.splits > 1 and decode.splits * 16 <= 264 + 16  # split-K fills the GPU
    assert prefill.splits <= decode.splits
    for t in (decode, prefill, tiling_for(3, 40, 8, 1), tiling_for(70, 96, 256, 4)):
        blocks = (t.block_m, t.block_k, t.block_r, t.block_n)
        assert all(v >= 16 and v & (v - 1) == 0 for v in blocks) and t.splits >= 1
    assert tiling_for(3, 40, 8, 1).block_k == 64  # `in` of 40 fits one 64-wide step


@pytest.mark.gpu
@pytest.mark.parametrize("d_out", [4096, 14336])
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("sizes", [[64] * 4, [1, 7, 16, 3, 40, 0, 9, 12, 2, 30, 5, 11, 8, 6, 50,
                                               17]])
def test_triton_large_gpu(d_out, rank, sizes):
    """Real sizes on CUDA (bf16 x and y): T 256, in 4096, 4 or 16 groups."""
    case = make_case(256, 4096, d_out, rank, sizes, torch.bfloat16, torch.bfloat16,
                     n_slots=len(sizes), seed=4)
    y, x, a, b, rows, starts, slots, max_rows = (
        t.cuda() if isinstance(t, torch.Tensor) else t for t in case)
    want, y0 = y.clone(), y.clone()
    lora_delta_reference(want, x, a, b, rows, starts, slots, max_rows)
    lora_delta_triton(y, x, a, b, rows, starts, slots, max_rows)
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=2e-2)
    assert torch.equal(others(y, rows), others(y0, rows))


@pytest.fixture(params=["avx2", "avx512"])
def cpu_level(request):
    """The C++ kernel (pipellm/kernels/cpu/lora.cpp) at each ISA level this CPU runs: its variant is
    chosen by the block GEMMs' level, so the AVX2 one is tested on any x86 machine."""
    from pipellm.kernels.cpu import extension, isa

    ext = extension()
    assert ext is not None, "the C++ CPU kernels did not build (see the log)"
    if request.param not in isa.cpu_levels():
        pytest.skip(f"this CPU does not run {request.param} ({isa.describe()})")
    previous = ext.block_gemm_isa()
    ext.set_block_gemm_isa(request.param)
    yield ext
    ext.set_block_gemm_isa(previous)


@pytest.fixture(params=["tiles", "emulated"])
def amx_lora(request):
    """A module whose lora_delta runs the AMX variant given packed bf16 stacks: the main one on
    this CPU's tiles (at the avx512 level the AMX variant needs), or
    pipellm/kernels/cpu/emulated.py's on emulated tiles (any CPU with AVX512-BF16), else a skip."""
    from pipellm.kernels.cpu import emulated, extension, isa

    if request.param == "emulated":
        if not emulated.runnable():
            pytest.skip(f"the emulated AMX kernels need AVX512-BF16 ({isa.describe()})")
        yield emulated.module()
        return
    if "amx" not in isa.cpu_levels():
        pytest.skip(f"this CPU has no AMX ({isa.describe()})")
    ext = extension()
    previous = ext.block_gemm_isa()
    ext.set_block_gemm_isa("avx512")
    yield ext
    ext.set_block_gemm_isa(previous)


CPU_DTYPES = [*DTYPES, (torch.float16, torch.float16), (torch.bfloat16, torch.float16)]


@pytest.mark.parametrize(("x_dtype", "y_dtype"), CPU_DTYPES)
@pytest.mark.parametrize("T,d_in,d_out,rank,sizes", [
    (12, 32, 48, 16, [3, 0, 1, 4]),  # decode-like, an empty group
    (40, 72, 80, 48, [12, 0, 13, 5]),  # R of 3 vectors (avx512), blocks of 4 rows + a ragged one
    (64, 96, 208, 64, [20, 10, 7, 27]),  # out past one chunk with a ragged last chunk
    (9, 40, 16, 80, [9]),  # R past one chunk, one group of every row
])
def test_cpu_kernel_matches_reference(cpu_level, T, d_in, d_out, rank, sizes, x_dtype, y_dtype):
    y, x, a, b, rows, starts, slots, max_rows = make_case(T, d_in, d_out, rank, sizes, x_dtype,
                                                          y_dtype, seed=T + rank)
    want, y0 = y.clone(), y.clone()
    lora_delta_reference(want, x, a, b, rows, starts, slots, max_rows)
    cpu_level.lora_delta(y, x, a, b, rows, starts, slots, [d_out])
    tol = TOL[torch.float32] if y_dtype == torch.float32 else dict(rtol=2**-7, atol=1e-3)
    torch.testing.assert_close(y.float(), want.float(), **tol)
    assert not torch.equal(y[rows], y0[rows])
    assert torch.equal(others(y, rows), others(y0, rows))


def test_cpu_kernel_through_the_public_function_and_its_checks(cpu_level):
    """lora_delta_ on CPU tensors runs the C++ kernel where it takes the operands (R a multiple
    of 16), the reference where not (R 8); bad groups are an error, not a write out of range."""
    for rank in (16, 8):
        y, x, a, b, rows, starts, slots, max_rows = make_case(20, 64, 32, rank, [5, 6], seed=rank)
        want = y.clone()
        lora_delta_reference(want, x, a, b, rows, starts, slots, max_rows)
        lora_delta_(y, x, a, b, rows, starts, slots, max_rows)
        torch.testing.assert_close(y, want, **TOL[torch.float32])
    y, x, a, b, rows, starts, slots, _ = make_case(20, 64, 32, 16, [5, 6])
    for bad in (dict(rows=rows + 20), dict(slots=slots + 3), dict(starts=starts.flip(0))):
        args = dict(rows=rows, starts=starts, slots=slots) | bad
        with pytest.raises(RuntimeError, match="out of range|starts|slots"):
            cpu_level.lora_delta(y, x, a, b, args["rows"], args["starts"], args["slots"], [32])


@pytest.mark.parametrize("ends", [[96, 128, 160], [128, 192, 256]])
def test_cpu_kernel_reads_only_the_part_blocks_of_b(cpu_level, ends):
    """b block-diagonal over the output's parts (a fused q/k/v, 16 rows of b each): the kernel
    given the parts equals the reference on that b, parts aligned to its column chunks or not;
    where they are aligned (64 columns), values off the blocks are not read at all."""
    y, x, a, b, rows, starts, slots, max_rows = make_case(30, 64, ends[-1], 48, [7, 11, 4],
                                                          torch.bfloat16, torch.bfloat16, seed=5)
    rp = 16
    block = torch.zeros(48, ends[-1], dtype=torch.bool)
    for j, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        block[j * rp : (j + 1) * rp, lo:hi] = True
    diag = b * block
    want, got, skipped = y.clone(), y.clone(), y.clone()
    lora_delta_reference(want, x, a, diag, rows, starts, slots, max_rows)
    cpu_level.lora_delta(got, x, a, diag, rows, starts, slots, ends)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    lora_delta_(y, x, a, diag, rows, starts, slots, max_rows, ends)  # the public function too
    torch.testing.assert_close(y.float(), want.float(), rtol=2**-7, atol=1e-3)
    if ends[0] % 64 == 0:
        cpu_level.lora_delta(skipped, x, a, b, rows, starts, slots, ends)  # b off-block unread
        torch.testing.assert_close(skipped.float(), want.float(), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("y_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,d_in,d_out,rank,sizes,ends", [
    (12, 64, 48, 16, [3, 0, 1, 4], [48]),  # decode-like, an empty group
    (40, 96, 80, 48, [12, 0, 13, 5], [32, 64, 80]),  # 3 parts, a ragged last column block
    (40, 96, 192, 48, [12, 0, 13, 5], [64, 128, 192]),  # 3 parts of whole column blocks
    (64, 128, 208, 64, [20, 10, 7, 27], [208]),  # groups past one block of 16 rows, 4 C tiles
    (9, 32, 16, 80, [9], [16]),  # R past 4 C tiles
])
def test_cpu_amx_tiles_match_reference(amx_lora, T, d_in, d_out, rank, sizes, ends, y_dtype):
    """The kernel's AMX variant (pipellm/kernels/cpu/lora_amx.cpp: bf16 x, a and b given packed
    too), on this CPU's tiles or on emulated ones: the reference within h's rounding to bf16 (b
    block-diagonal over the parts; where they are whole blocks of 64 columns, its off-part
    values are not read), rows outside the groups untouched; it is what ran (its float32 y
    differs from the AVX-512 variant's, which keeps h in float32)."""
    from pipellm.kernels.cpu import extension

    ext = extension()
    y, x, a, b, rows, starts, slots, max_rows = make_case(T, d_in, d_out, rank, sizes,
                                                          torch.bfloat16, y_dtype, seed=T + rank)
    rp, block = rank // len(ends), torch.zeros(rank, d_out, dtype=torch.bool)
    for j, (lo, hi) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        block[j * rp : (j + 1) * rp, lo:hi] = True
    diag = b * block
    given = b if all(e % 64 == 0 for e in ends) else diag
    want, got, plain = y.clone(), y.clone(), y.clone()
    lora_delta_reference(want, x, a, diag, rows, starts, slots, max_rows)
    amx_lora.lora_delta(got, x, a, given, rows, starts, slots, ends, vnni_pack(a),
                        vnni_pack(given))
    previous = ext.block_gemm_isa()
    ext.set_block_gemm_isa("avx512")
    try:
        ext.lora_delta(plain, x, a, diag, rows, starts, slots, ends)  # no packed stacks
    finally:
        ext.set_block_gemm_isa(previous)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2e-2)
    assert torch.equal(others(got, rows), others(y, rows))
    if y_dtype == torch.float32:
        assert not torch.equal(got, plain)


def test_vnni_pack_and_when_the_cpu_gets_packed_stacks():
    """vnni_pack interleaves pairs of rows; cpu_packed gives packed bf16 stacks at the amx level
    only, never float32 ones."""
    from pipellm.kernels.cpu import isa

    t = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    p = vnni_pack(t)
    assert p.shape == (2, 2, 3, 2)
    for s, k, n in [(0, 0, 0), (1, 3, 2), (1, 2, 1)]:
        assert p[s, k // 2, n, k % 2] == t[s, k, n]
    a, b = torch.randn(2, 64, 16), torch.randn(2, 16, 32)
    assert cpu_packed(a, b) is None
    packed = cpu_packed(a.bfloat16(), b.bfloat16())
    assert (packed is not None) == (isa.selected() == "amx")
