"""The vectorised CPU kernel (csrc/rotary_cpu.h) against the pure-PyTorch reference, bit for bit where it can be.

With cos/sin handed in, the kernel computes exactly the reference's fp32 operations (``x0*c0 - x1*s0``,
``x1*c1 + x0*s1``, each product and difference rounded once, never fused; bf16/fp16 converted exactly to fp32
and rounded to nearest-even once at the end), so its output must be *identical* to the reference's in the same
storage dtype. With the angles made in-kernel (``rope_theta``/``inv_freq``), the phase is the reference's
(the product ``position * inv_freq`` in fp64) but the fp64 sine/cosine are another implementation's (fdlibm's
polynomials here, torch's Sleef or libm there), each within one fp64 ulp, so their fp32 roundings may differ by
one fp32 ulp in the rare case the exact value lies within an fp64 ulp of an fp32 midpoint: the bound is one fp32
ulp of cos/sin, and the tests also require such differences to be rare.

The shapes are chosen for the vector loop: rotary_dim/2 below, at and around the vector widths (8 and 16 fp32
lanes, 16 and 32 bf16 lanes), tails, partial rotary_dim, rows that are not contiguous, both memory orders,
GQA, one token with many heads (the head split across threads), and an output large enough for streaming stores.
Every instruction set this CPU has is exercised (torch's ``ATEN_CPU_CAPABILITY`` in child processes).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ftshims.kernels import _build, rotary  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not _build.load(jit=True):
        pytest.fail(f"ftshims rotary extension unavailable: {_build.status()['reason']}")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# rotary_dim / 2: 1, tails below one vector, one fp32 vector (AVX2 / AVX-512), one bf16 vector, odd tails after them
HALVES = [1, 3, 7, 8, 13, 16, 17, 31, 32, 33, 64, 67]


def make(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def both(q, k, **kw):
    """(kernel q, kernel k), (reference q, reference k) for the same call."""
    got = rotary.apply_rotary_qk(q.clone(), k.clone(), backend="cpu", **kw)
    ref = rotary.apply_rotary_qk(q.clone(), k.clone(), backend="reference", **kw)
    return got, ref


def assert_identical(got, ref, what):
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    if not torch.equal(got, ref):
        diff = (got.double() - ref.double()).abs()
        n = int((got != ref).sum())
        raise AssertionError(f"{what}: {n} of {got.numel()} elements differ from the reference (max {diff.max().item():.3g})")


def cos_sin_kwargs(source, rotary_dim, batch, seq, dtype, gen):
    if source == "table_half":
        return dict(cos=make((seq + 5, rotary_dim // 2), torch.float32, gen), sin=make((seq + 5, rotary_dim // 2), torch.float32, gen),
                    seqlen_offsets=3)
    if source == "table_full_storage":  # full width, in x's dtype (flash-attn / HF tables)
        return dict(cos=make((seq + 2, rotary_dim), dtype, gen), sin=make((seq + 2, rotary_dim), dtype, gen),
                    seqlen_offsets=torch.tensor([2, 0][:batch]))
    # HF: per token, full width, x's dtype
    return dict(cos=make((batch, seq, rotary_dim), dtype, gen), sin=make((batch, seq, rotary_dim), dtype, gen))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_cos_sin_path_is_bit_identical_to_the_reference(dtype):
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for half, interleaved, source, layout in itertools.product(
        HALVES, (False, True), ("table_half", "table_full_storage", "token_full"), ("bshd", "bhsd")
    ):
        rotary_dim = 2 * half
        head_dim = rotary_dim + (2 if half % 2 else 0)  # odd halves also leave a pass-through tail
        batch, seq, hq, hk = 2, 5, 3, 2
        shape = (lambda h: (batch, seq, h, head_dim)) if layout == "bshd" else (lambda h: (batch, h, seq, head_dim))
        q, k = make(shape(hq), dtype, gen), make(shape(hk), dtype, gen)
        kw = cos_sin_kwargs(source, rotary_dim, batch, seq, dtype, gen)
        conjugate, scaling = bool(half % 3 == 0), (1.2345 if half % 2 else 1.0)  # 1.2345: not exact in fp32
        got, ref = both(q, k, rotary_dim=rotary_dim, interleaved=interleaved, layout=layout, conjugate=conjugate,
                        attention_scaling=scaling, **kw)
        what = f"{dtype} half={half} inter={interleaved} {source} {layout} conj={conjugate} scale={scaling}"
        assert_identical(got[0], ref[0], what + " q")
        assert_identical(got[1], ref[1], what + " k")
        checked += 1
    assert checked == len(HALVES) * 2 * 3 * 2


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_in_place_and_non_contiguous_rows_are_bit_identical(dtype):
    gen = torch.Generator().manual_seed(12)
    for half, interleaved in itertools.product((7, 16, 33), (False, True)):
        rd = 2 * half
        views = {  # views of one [2, 6, 5, 2 rd + 3] buffer
            "dim stride 2": lambda t: t[:, :, :3, 1 : 1 + 2 * rd : 2],
            "sliced heads": lambda t: t[:, :, 1:5:2, 3 : 3 + rd],
            "rows start off the vector boundary": lambda t: t[:, :, :4, 1 : 1 + rd],
        }
        cos = make((1, 6, rd), dtype, gen)
        sin = make((1, 6, rd), dtype, gen)
        for name, view in views.items():
            base = make((2, 6, 5, 2 * rd + 3), dtype, gen)
            x = view(base)
            ref = rotary.apply_rotary(x.clone(), cos=cos, sin=sin, interleaved=interleaved, backend="reference")
            got = rotary.apply_rotary(x, cos=cos, sin=sin, interleaved=interleaved, backend="cpu")
            assert_identical(got, ref, f"{dtype} {name} half={half} inter={interleaved}")
            before = base.clone()
            rotary.apply_rotary(x, cos=cos, sin=sin, interleaved=interleaved, inplace=True, backend="cpu")
            assert_identical(x, ref, f"{dtype} {name} in place half={half} inter={interleaved}")
            inside = torch.zeros_like(base, dtype=torch.bool)
            view(inside).fill_(True)
            assert torch.equal(base[~inside], before[~inside]), f"{name}: the in-place call wrote outside the view"
        # heads outermost in memory ([b, h, s, d] storage seen as [b, s, h, d]): rows visited head by head
        x = make((2, 5, 6, rd), dtype, gen).transpose(1, 2)
        ref = rotary.apply_rotary(x, cos=cos, sin=sin, interleaved=interleaved, backend="reference")
        got = rotary.apply_rotary(x, cos=cos, sin=sin, interleaved=interleaved, backend="cpu")
        assert_identical(got, ref, f"{dtype} heads outermost half={half} inter={interleaved}")


def float_ulp_distance(a, b):
    """|a - b| in fp32 ulps (a, b fp32 tensors of the same sign region)."""
    ia = a.contiguous().view(torch.int32).long()
    ib = b.contiguous().view(torch.int32).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs()


@pytest.mark.parametrize("scale", ["table", "near_limit", "beyond_limit"])
def test_in_kernel_sin_cos_within_one_fp32_ulp_of_fp64(scale):
    """cos/sin of the exact phase, made in-kernel, against fp64 cos/sin rounded to fp32: x = (1, 0) pairs give
    out0 = cos and out1 = sin exactly. Phases cover every quadrant, negative positions, up to the vector
    limit (2^28) and past it (the scalar fallback)."""
    gen = torch.Generator().manual_seed(13)
    half = 67
    if scale == "table":
        pos = torch.randint(-70000, 140000, (1, 4000), generator=gen)
        inv = rotary.default_inv_freq(2 * half, 500000.0)
    elif scale == "near_limit":
        pos = torch.randint(2 ** 27, 2 ** 28, (1, 500), generator=gen)
        inv = torch.rand(half, generator=gen, dtype=torch.float64).float() * 0.999 + 0.001
    else:
        pos = torch.randint(2 ** 28, 2 ** 33, (1, 300), generator=gen)
        inv = torch.rand(half, generator=gen, dtype=torch.float64).float() + 0.5
    x = torch.zeros(1, pos.shape[1], 1, 2 * half)
    x[..., :half] = 1.0
    out = rotary.apply_rotary(x, pos, inv_freq=inv, backend="cpu")[:, :, 0]
    phase = pos.double()[..., None] * inv.double()
    for got, want in ((out[..., :half], torch.cos(phase).float()), (out[..., half:], torch.sin(phase).float())):
        ulps = float_ulp_distance(got, want)
        assert ulps.max().item() <= 1, f"{scale}: {ulps.max().item()} ulps"
        assert (ulps > 0).float().mean().item() < 1e-3, f"{scale}: {(ulps > 0).float().mean().item():.2%} differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_theta_path_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(14)
    for half, interleaved, layout in itertools.product((3, 16, 17, 64), (False, True), ("bshd", "bhsd")):
        rd = 2 * half
        shape = (lambda h: (2, 37, h, rd + 2)) if layout == "bshd" else (lambda h: (2, h, 37, rd + 2))
        q, k = make(shape(4), dtype, gen), make(shape(1), dtype, gen)
        pos = torch.randint(0, 200000, (2, 37), generator=gen)
        got, ref = both(q, k, positions=pos, rope_theta=500000.0, rotary_dim=rd, interleaved=interleaved, layout=layout)
        for g, r, x in zip(got, ref, (q, k)):
            # one fp32 ulp of cos/sin moves an output by at most (|a| + |b|) * 2^-24, before its rounding to dtype
            pair_mag = x[..., :rd].double().abs()
            bound = 2 * pair_mag.amax(dim=-1, keepdim=True) * 2 ** -24
            diff = (g.double() - r.double()).abs()[..., :rd]
            if dtype != torch.float32:  # the rounding to bf16/fp16 may then flip by one ulp of the output
                bound = bound + r.double().abs()[..., :rd] * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
            assert (diff <= bound).all(), f"{dtype} half={half} {layout} inter={interleaved}: max diff {diff.max().item():.3g}"
            assert (g != r).float().mean().item() < 1e-2
            assert torch.equal(g[..., rd:], x[..., rd:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
def test_backward_equals_the_reference_gradients(dtype):
    gen = torch.Generator().manual_seed(15)
    for half, interleaved in ((16, False), (17, True), (64, False)):
        rd = 2 * half
        q = make((2, 9, 4, rd + 4), dtype, gen).transpose(1, 2).requires_grad_()  # HF's layout
        k = make((2, 9, 2, rd + 4), dtype, gen).transpose(1, 2).requires_grad_()
        gq, gk = make(q.shape, dtype, gen), make(k.shape, dtype, gen)
        cos, sin = make((2, 9, rd), dtype, gen), make((2, 9, rd), dtype, gen)
        grads = {}
        for backend in ("cpu", "reference"):
            oq, ok = rotary.apply_rotary_qk(q, k, cos=cos, sin=sin, rotary_dim=rd, interleaved=interleaved, layout="bhsd", backend=backend)
            grads[backend] = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
        for g, r, name in zip(grads["cpu"], grads["reference"], "qk"):
            # the reference's autograd sums the two contributions of each element in fp32, as the kernel does
            assert_identical(g, r, f"grad {name} half={half} inter={interleaved}")


def test_threads_heads_split_and_streaming_give_the_same_output():
    """One token with many heads (split over threads by heads), and an output past the streaming threshold
    (16 MiB), with 1 and 2 threads: identical, and identical to the reference."""
    gen = torch.Generator().manual_seed(16)
    cases = [
        ((1, 1, 64, 128), (1, 1, 8, 128), torch.bfloat16),   # decode step
        ((1, 2048, 32, 128), (1, 2048, 8, 128), torch.bfloat16),  # 21 MB of output: streamed
        ((1, 1024, 32, 128), (1, 1024, 8, 128), torch.float32),  # 21 MB, fp32
    ]
    threads = torch.get_num_threads()
    try:
        for shape_q, shape_k, dtype in cases:
            q, k = make(shape_q, dtype, gen), make(shape_k, dtype, gen)
            pos = torch.arange(shape_q[1]) + 1000
            outs = []
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(rotary.apply_rotary_qk(q, k, pos, rope_theta=500000.0, backend="cpu"))
                cos = torch.randn(shape_q[0], shape_q[1], shape_q[-1], generator=gen).to(dtype) if n == 1 else cos
                sin = torch.randn(shape_q[0], shape_q[1], shape_q[-1], generator=gen).to(dtype) if n == 1 else sin
                outs.append(rotary.apply_rotary_qk(q, k, cos=cos, sin=sin, backend="cpu"))
            for a, b in zip(outs[0] + outs[1], outs[2] + outs[3]):
                assert torch.equal(a, b), f"{shape_q} {dtype}: 1 and 2 threads differ"
            ref = rotary.apply_rotary_qk(q, k, cos=cos, sin=sin, backend="reference")
            assert_identical(outs[3][0], ref[0], f"{shape_q} {dtype} q")
            assert_identical(outs[3][1], ref[1], f"{shape_q} {dtype} k")
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------
# every instruction set of this CPU

CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from ftshims.kernels import rotary
    assert rotary.load()
    gen = torch.Generator().manual_seed(17)
    failures = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for half in (3, 16, 17, 64):
            for interleaved in (False, True):
                rd = 2 * half
                q = torch.randn(2, 7, 3, rd + 2, generator=gen, dtype=torch.float64).to(dtype)
                k = torch.randn(2, 3, 7, rd + 2, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
                cos = torch.randn(2, 7, rd, generator=gen, dtype=torch.float64).to(dtype)
                sin = torch.randn(2, 7, rd, generator=gen, dtype=torch.float64).to(dtype)
                kw = dict(cos=cos, sin=sin, rotary_dim=rd, interleaved=interleaved)
                got = rotary.apply_rotary_qk(q, k, backend="cpu", **kw)
                ref = rotary.apply_rotary_qk(q, k, backend="reference", **kw)
                if not all(torch.equal(g, r) for g, r in zip(got, ref)):
                    failures.append(f"{dtype} half={half} inter={interleaved}")
                pos = torch.randint(0, 100000, (2, 7), generator=gen)
                th = rotary.apply_rotary_qk(q, k, pos, rope_theta=1e4, rotary_dim=rd, interleaved=interleaved, backend="cpu")
                tr = rotary.apply_rotary_qk(q, k, pos, rope_theta=1e4, rotary_dim=rd, interleaved=interleaved, backend="reference")
                tol = 1e-6 if dtype == torch.float32 else 1e-2
                if not all(torch.allclose(g.float(), r.float(), rtol=tol, atol=tol) for g, r in zip(th, tr)):
                    failures.append(f"theta {dtype} half={half} inter={interleaved}")
    from ftshims.kernels import _build
    print(json.dumps({"isa": _build.status()["cpu_isa"], "failures": failures}))
    """
)


def available_capabilities():
    caps = ["default"]
    torch_cap = torch.backends.cpu.get_cpu_capability()
    if torch_cap in ("AVX2", "AVX512"):
        caps.append("avx2")
    if torch_cap == "AVX512":
        caps.append("avx512")
    return caps


@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_every_instruction_set_of_this_cpu(capability):
    if capability not in available_capabilities():
        pytest.skip(f"this CPU (torch: {torch.backends.cpu.get_cpu_capability()}) has no {capability}")
    if capability == _build.status()["cpu_isa"]:
        pytest.skip(f"{capability} is this process's: every other test here ran it")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = capability if sys.platform.startswith("linux") and os.uname().machine == "x86_64" else "default"
    assert result["isa"] == expected, result
    assert not result["failures"], result["failures"]
