"""The CUDA rotary kernel against the fp64 oracle (marked gpu; skipped without CUDA).

Run on a GPU machine: ``pytest -m gpu tests/gpu`` (gpu/check.sh does it after building).
"""

from __future__ import annotations

import itertools
import os

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from ftshims.kernels import _build, rotary  # noqa: E402

DEV = "cuda"
REL = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -10}
ABS = {torch.float32: 2e-6, torch.float64: 1e-13, torch.bfloat16: 2e-6, torch.float16: 2e-6}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not _build.load(jit=True):
        pytest.fail(f"extension unavailable: {_build.status()['reason']}")
    if not _build.has_cuda_kernels():
        pytest.fail("the extension was built without CUDA kernels (no toolkit found at build time?)")


def check(out, ref, dtype, what=""):
    err = (out.double().cpu() - ref.cpu()).abs()
    top = ref.abs().max().item() if ref.numel() else 0.0
    bound = REL[dtype] * ref.cpu().abs() + ABS[dtype] * max(top, 1e-30)
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3g} (ratio {worst:.2f})"


def oracle(q, k, **kw):
    kw = {n: (v.double().cpu() if n in ("cos", "sin") else (v.cpu() if isinstance(v, torch.Tensor) else v)) for n, v in kw.items()}
    q64 = q.double().cpu()
    if k is None:
        return rotary.apply_rotary(q64, backend="reference", **kw), None
    return rotary.apply_rotary_qk(q64, k.double().cpu(), backend="reference", **kw)


def rnd(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(DEV, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_matrix_vs_fp64(dtype):
    gen = torch.Generator().manual_seed(0)
    b, s, hq, hk = 2, 37, 5, 2
    n = 0
    for head_dim, rd, inter, source, pos_kind, inplace, layout in itertools.product(
        (128, 40), ("full", "partial"), (False, True), ("theta", "table_half", "table_full", "token"),
        ("default", "explicit", "offset_tensor"), (False, True), ("bshd", "bhsd"),
    ):
        rotary_dim = head_dim if rd == "full" else head_dim // 2
        if source == "token" and pos_kind != "default":
            continue
        kw = dict(rotary_dim=rotary_dim, interleaved=inter, layout=layout)
        if pos_kind == "explicit":
            kw["positions"] = torch.randint(0, 300, (b, s), generator=gen).to(DEV)
        elif pos_kind == "offset_tensor":
            kw["seqlen_offsets"] = torch.randint(0, 200, (b,), generator=gen, dtype=torch.int32).to(DEV)
        if source == "theta":
            kw["rope_theta"] = 5e5
            kw["attention_scaling"] = 1.25
        elif source.startswith("table"):
            w = rotary_dim // 2 if source == "table_half" else rotary_dim
            kw["cos"], kw["sin"] = rnd((600, w), torch.float32, gen), rnd((600, w), torch.float32, gen)
        else:
            kw["cos"], kw["sin"] = rnd((b, s, rotary_dim), dtype, gen), rnd((b, s, rotary_dim), dtype, gen)
        shp = (lambda h: (b, s, h, head_dim)) if layout == "bshd" else (lambda h: (b, h, s, head_dim))
        q, k = rnd(shp(hq), dtype, gen), rnd(shp(hk), dtype, gen)
        ref_q, ref_k = oracle(q, k, **kw)
        out_q, out_k = rotary.apply_rotary_qk(q.clone(), k.clone(), inplace=inplace, backend="cuda", **kw)
        what = f"{dtype} hd={head_dim} rd={rotary_dim} inter={inter} {source} {pos_kind} inplace={inplace} {layout}"
        check(out_q, ref_q, dtype, what)
        check(out_k, ref_k, dtype, what)
        n += 1
    assert n > 300


def test_cuda_matches_cpu_kernel_bitwise_in_fp64():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(3, 50, 4, 64, generator=gen, dtype=torch.float64)
    pos = torch.randint(0, 10000, (3, 50), generator=gen)
    cpu = rotary.apply_rotary(q, pos, rope_theta=1e4, backend="cpu")
    gpu = rotary.apply_rotary(q.to(DEV), pos.to(DEV), rope_theta=1e4, backend="cuda").cpu()
    assert torch.allclose(cpu, gpu, atol=1e-12, rtol=0)


def test_unaligned_and_strided_fall_back_to_scalar_path():
    gen = torch.Generator().manual_seed(2)
    base = rnd((2, 9, 3, 131), torch.bfloat16, gen)
    q = base[..., 1:129]  # misaligned by one element: no 16-byte vectors
    ref, _ = oracle(q, None, rope_theta=1e4)
    check(rotary.apply_rotary(q, rope_theta=1e4, backend="cuda"), ref, torch.bfloat16, "unaligned")
    qs = base[..., 0:128:2]  # dim stride 2
    ref, _ = oracle(qs, None, rope_theta=1e4)
    check(rotary.apply_rotary(qs, rope_theta=1e4, backend="cuda"), ref, torch.bfloat16, "dim stride 2")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_varlen(dtype):
    gen = torch.Generator().manual_seed(3)
    lens = [17, 0, 64, 1, 300]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    x = rnd((int(cu[-1]), 6, 128), dtype, gen)
    offs = torch.tensor([0, 3, 100, 7, 9])
    for inter, offsets in itertools.product((False, True), (0, offs)):
        kw = dict(layout="thd", cu_seqlens=cu, seqlen_offsets=offsets, interleaved=inter, rope_theta=1e4)
        ref, _ = oracle(x, None, **kw)
        kw_dev = dict(kw, cu_seqlens=cu.to(DEV), seqlen_offsets=offsets.to(DEV) if isinstance(offsets, torch.Tensor) else offsets)
        check(rotary.apply_rotary(x, backend="cuda", **kw_dev), ref, dtype, f"varlen {inter}")


def test_gradcheck_fp64():
    gen = torch.Generator().manual_seed(4)
    q = rnd((2, 5, 3, 16), torch.float64, gen).requires_grad_()
    k = rnd((2, 5, 1, 16), torch.float64, gen).requires_grad_()
    cos, sin = rnd((2, 5, 16), torch.float64, gen), rnd((2, 5, 16), torch.float64, gen)
    pos = torch.randint(0, 50, (2, 5), generator=gen).to(DEV)
    assert torch.autograd.gradcheck(lambda q, k: rotary.apply_rotary_qk(q, k, pos, rope_theta=100.0, rotary_dim=12, backend="cuda"), (q, k))
    assert torch.autograd.gradcheck(lambda q, k: rotary.apply_rotary_qk(q, k, cos=cos, sin=sin, interleaved=True, backend="cuda"), (q, k))
    assert torch.autograd.gradcheck(lambda q: rotary.apply_rotary(q * 1, pos, rope_theta=100.0, inplace=True, backend="cuda"), (q,))


def test_bad_input_raises_before_launch():
    x = torch.randn(2, 5, 3, 8, device=DEV)
    tab = torch.randn(10, 4, device=DEV)
    with pytest.raises(ValueError):
        rotary.apply_rotary(x, cos=tab, sin=tab, seqlen_offsets=torch.tensor([0, 6], device=DEV), backend="cuda")
    with pytest.raises(ValueError):
        rotary.apply_rotary(x, torch.arange(5), rope_theta=1e4, backend="cuda")  # positions on the CPU
    with pytest.raises(ValueError):
        rotary.apply_rotary(x.squeeze(0)[:, :1].expand(5, 3, 8), layout="thd", cu_seqlens=torch.tensor([0, 4], device=DEV), rope_theta=1e4, backend="cuda")
    torch.cuda.synchronize()  # no sticky error from a launched kernel


def test_opcheck_and_compile():
    gen = torch.Generator().manual_seed(5)
    q = rnd((2, 3, 4, 16), torch.float32, gen).requires_grad_()
    k = rnd((2, 3, 2, 16), torch.float32, gen)
    inv = rotary.default_inv_freq(16, 1e4, DEV)
    pos = torch.randint(0, 9, (2, 3), generator=gen).to(DEV)
    torch.library.opcheck(torch.ops.ftshims.rotary.default, (q, k, None, None, inv, pos, None, None, 0, 16, False, False, 1.0))

    def f(q, k):
        a, b = rotary.apply_rotary_qk(q, k, pos, rope_theta=1e4, backend="cuda")
        return a.sum() + 2 * b.sum()

    expected = f(q, k)  # eager first: loading/JIT-building cannot happen while Dynamo traces
    compiled = torch.compile(f, fullgraph=True)
    assert torch.allclose(compiled(q, k), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not os.environ.get("FTSHIMS_FA_GPU_SOURCES"), reason="no flash-attn sources carried (gpu/check.sh sets this)")
def test_parity_with_flash_attn_triton_on_gpu():
    import sys

    sys.path.insert(0, os.environ["FTSHIMS_FA_GPU_SOURCES"])
    try:
        from flash_attn.ops.triton.rotary import apply_rotary
    finally:
        sys.path.pop(0)
    gen = torch.Generator().manual_seed(6)
    for dtype, inter in itertools.product((torch.float32, torch.bfloat16), (False, True)):
        x = rnd((2, 333, 8, 128), dtype, gen)
        phase = torch.arange(600, dtype=torch.float32)[:, None] * rotary.default_inv_freq(96, 1e4)
        cos, sin = phase.cos().to(DEV, dtype), phase.sin().to(DEV, dtype)
        offs = torch.randint(0, 200, (2,), generator=gen, dtype=torch.int32).to(DEV)
        theirs = apply_rotary(x, cos, sin, seqlen_offsets=offs, interleaved=inter)
        ours = rotary.apply_rotary(x, cos=cos, sin=sin, rotary_dim=96, seqlen_offsets=offs, interleaved=inter, backend="cuda")
        tol = 2e-6 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(ours.float(), theirs.float(), atol=4 * tol, rtol=tol)
