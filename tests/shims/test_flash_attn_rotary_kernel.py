"""The opt-in speed shim flash_attn_rotary_kernel against the *released* flash-attn rotary files.

Same sources and fixture as tests/shims/test_flash_attn_rotary.py. A speed shim
has no bug to fix: its "bug" scenario is a difference from flash-attn's own
kernel beyond about one rounding of the dtype, and must never show, neither
without the shim (trivially) nor with it.
"""

from __future__ import annotations

import inspect

import pytest
from tests.shimcheck import assert_bug_and_fix
from tests.shims.test_flash_attn_rotary import _case_inputs, _tables, fa_modules, fa_version  # noqa: F401  (fa_version: the fixture)

torch = pytest.importorskip("torch")

SHIM = "flash_attn_rotary_kernel"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["bshd", "interleaved", "varlen", "qkv"])
def test_same_results_as_flash_attn_kernel(evidence, fa_version, case, dtype):
    assert_bug_and_fix(SHIM, evidence, f"{fa_version}/{case}/{dtype}", expect_bug=False, case=case, dtype=dtype)


def test_is_opt_in(fa_version):
    import ftshims

    _, ops = fa_modules()
    with ftshims.applied() as report:
        assert report[SHIM].status != "applied"
        assert report["flash_attn_rotary"].status == "applied"
    with ftshims.applied(include=[SHIM]) as report:
        assert report[SHIM].status == "applied", report[SHIM].reason
    assert inspect.unwrap(ops.apply_rotary) is ops.apply_rotary


def test_public_apis_route_through_kernel_with_grad(fa_version):
    import ftshims
    from ftshims.kernels import rotary as kernel
    from ftshims.shims.flash_attn_rotary import cpu_triton

    layers, _ = fa_modules()
    gen = torch.Generator().manual_seed(5)
    cos, sin = _tables(16, 16, torch.float32)
    x = torch.randn(2, 5, 2, 16, generator=gen, requires_grad=True)
    qkv = torch.randn(2, 5, 3, 2, 16, generator=gen)
    kv = torch.randn(2, 5, 2, 2, 16, generator=gen)
    calls = []
    original = kernel.apply_rotary

    def spy(*args, **kwargs):
        calls.append(kwargs.get("layout"))
        return original(*args, **kwargs)

    with cpu_triton():
        ref_out = layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
        (ref_grad,) = torch.autograd.grad(ref_out.sum(), x)
        ref_qkv = layers.apply_rotary_emb_qkv_(qkv.clone(), cos, sin)
        ref_kv = layers.apply_rotary_emb_kv_(kv.clone(), cos, sin)
        with ftshims.applied(only=[SHIM]):
            kernel.apply_rotary = spy
            try:
                out = layers.apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
                (grad,) = torch.autograd.grad(out.sum(), x)
                out_func = layers.apply_rotary_emb_func(x, cos, sin, seqlen_offsets=2)
                got_qkv = layers.apply_rotary_emb_qkv_(qkv.clone(), cos, sin)
                got_kv = layers.apply_rotary_emb_kv_(kv.clone(), cos, sin)
            finally:
                kernel.apply_rotary = original
    assert len(calls) >= 5
    for got, ref in ((out, ref_out), (grad, ref_grad), (out_func, ref_out), (got_qkv, ref_qkv), (got_kv, ref_kv)):
        assert torch.allclose(got, ref, atol=2e-6), (got - ref).abs().max()


CASES = [
    # (dtype, interleaved, rotary_dim, varlen, offsets, inplace, conjugate)
    (torch.float32, False, 32, False, 0, False, False),
    (torch.float32, True, 32, False, 3, False, True),
    (torch.float32, False, 16, False, "tensor", True, False),
    (torch.float32, True, 24, True, "tensor", False, False),
    (torch.float32, False, 32, True, 0, True, True),
    (torch.bfloat16, False, 32, False, "tensor", False, False),
    (torch.float16, True, 16, True, 2, False, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v).replace("torch.", "") for v in c))
def test_core_parity_with_released_triton(fa_version, case):
    import ftshims
    from ftshims.shims.flash_attn_rotary import cpu_triton

    dtype = case[0]
    _, ops = fa_modules()
    x, cos, sin, kw = _case_inputs(case, CASES.index(case))
    with cpu_triton():
        released = ops.apply_rotary(x.clone(), cos, sin, **kw)
        with ftshims.applied(only=[SHIM]):
            assert ops.apply_rotary is not inspect.unwrap(ops.apply_rotary)  # patched
            ours = ops.apply_rotary(x.clone(), cos, sin, **kw)
    # the Triton interpreter truncates its fp32 -> bf16/fp16 stores (a GPU rounds to nearest): up to one ulp apart
    tol = {torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    assert torch.allclose(ours.float(), released.float(), atol=tol * 4, rtol=tol), (ours - released).abs().max()


def test_signatures_are_the_released_ones_and_revert(fa_version):
    import ftshims

    layers, ops = fa_modules()
    core = inspect.signature(ops.apply_rotary)
    released = ops.apply_rotary
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].status == "applied", report[SHIM].reason
        assert inspect.signature(ops.apply_rotary) == core
        assert inspect.signature(layers.apply_rotary) == core
        assert inspect.unwrap(layers.apply_rotary) is released
    assert ops.apply_rotary is released and layers.apply_rotary is released


def test_stacked_on_the_default_fixes(fa_version):
    """include=[...] applies the fix shim too: its fixes hold, the rotation is ftshims' kernel's."""
    import ftshims
    from ftshims.kernels import rotary as kernel
    from ftshims.shims.flash_attn_rotary import cpu_triton, fp64_table, reference_rotary, ulp_errors

    layers, ops = fa_modules()
    calls = []
    original = kernel.apply_rotary

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    gen = torch.Generator().manual_seed(8)
    qkv = torch.randn(2, 4, 3, 2, 32, generator=gen).bfloat16()
    with cpu_triton(), ftshims.applied(include=[SHIM]) as report:
        assert report[SHIM].status == "applied" and report["flash_attn_rotary"].status == "applied"
        kernel.apply_rotary = spy
        try:
            emb = layers.RotaryEmbedding(32)
            out = emb(qkv.clone(), seqlen_offset=3000)
            assert emb._cos_cached.dtype == torch.float32
            cos, sin = fp64_table(torch.arange(3000, 3004), 32)
            ref = reference_rotary(qkv[:, :, :2], cos[:, None], sin[:, None])
            assert ulp_errors(out[:, :, :2], ref, qkv[:, :, :2]) <= 0.6  # fp32 table, fp32 math, rounded to nearest
            out_t = emb(qkv.clone(), seqlen_offset=torch.tensor([2990, 4000]))  # the fix shim grows the table
            assert emb._cos_cached.shape[0] == 4004
            cos_t, sin_t = fp64_table(torch.arange(4000, 4004), 32)
            ref_t = reference_rotary(qkv[1, :, :2], cos_t[:, None], sin_t[:, None])
            assert ulp_errors(out_t[1, :, :2], ref_t, qkv[1, :, :2]) <= 0.6
            with pytest.raises(ValueError, match="outside the cos/sin table"):
                layers.apply_rotary_emb(qkv[:, :, 0], cos.float(), sin.float(), seqlen_offsets=torch.tensor([0, 1]))
        finally:
            kernel.apply_rotary = original
    assert calls
    assert inspect.unwrap(ops.apply_rotary) is ops.apply_rotary
