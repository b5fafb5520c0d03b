"""Hypothesis: random shapes, strides, layouts and options; the compiled CPU kernel vs the fp64 oracle."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ftshims.kernels import _build, rotary  # noqa: E402

REL = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -10}
ABS = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 1e-6, torch.float16: 1e-6}


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if not _build.load(jit=True):
        pytest.fail(f"ftshims rotary extension unavailable: {_build.status()['reason']}")


def strided(draw, shape, dtype, seed):
    """A tensor of `shape` that is a (possibly) non-contiguous view: padded dims, permuted storage."""
    gen = torch.Generator().manual_seed(seed)
    pads = [draw(st.integers(0, 2)) for _ in shape]
    big = torch.randn([s + p for s, p in zip(shape, pads)], generator=gen, dtype=torch.float64).to(dtype)
    order = draw(st.permutations(range(len(shape))))
    big = big.permute(*order).contiguous().permute(*[order.index(i) for i in range(len(shape))])
    starts = [draw(st.integers(0, p)) for p in pads]
    return big[tuple(slice(a, a + s) for a, s in zip(starts, shape))]


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    layout = draw(st.sampled_from(["bshd", "bhsd", "sbhd", "thd"]))
    batch = 1 if layout == "thd" else draw(st.integers(1, 3))
    seq = draw(st.integers(1, 9))
    hq, hk = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    head_dim = 2 * draw(st.integers(1, 24))
    rotary_dim = 2 * draw(st.integers(1, head_dim // 2))
    interleaved = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))
    shape = {
        "bshd": lambda h: (batch, seq, h, head_dim),
        "bhsd": lambda h: (batch, h, seq, head_dim),
        "sbhd": lambda h: (seq, batch, h, head_dim),
        "thd": lambda h: (seq, h, head_dim),
    }[layout]
    q = strided(draw, shape(hq), dtype, seed)
    k = strided(draw, shape(hk), dtype, seed + 1) if draw(st.booleans()) else None
    kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, layout=layout)
    gen = torch.Generator().manual_seed(seed + 2)
    if layout == "thd" and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(0, seq), min_size=0, max_size=3)))
        kw["cu_seqlens"] = torch.tensor([0] + cuts + [seq], dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    nseq = kw["cu_seqlens"].numel() - 1 if "cu_seqlens" in kw else batch
    source = draw(st.sampled_from(["theta", "inv_freq", "table", "token"]))
    if source == "token" and "cu_seqlens" not in kw:
        width = draw(st.sampled_from([rotary_dim // 2, rotary_dim]))
        kw["cos"] = torch.randn(draw(st.sampled_from([1, batch])), seq, width, generator=gen).to(dtype)
        kw["sin"] = torch.randn(kw["cos"].shape, generator=gen).to(dtype)
    else:
        if draw(st.booleans()):
            kw["positions"] = torch.randint(0, 64, (seq,) if layout == "thd" else (batch, seq), generator=gen)
        offsets = draw(st.sampled_from(["none", "int", "tensor"]))
        if offsets == "int":
            kw["seqlen_offsets"] = draw(st.integers(0, 20))
        elif offsets == "tensor":
            kw["seqlen_offsets"] = torch.randint(0, 20, (nseq,), generator=gen)
        if source == "theta":
            kw["rope_theta"] = draw(st.sampled_from([100.0, 1e4, 5e5]))
        elif source == "inv_freq":
            kw["inv_freq"] = torch.rand(rotary_dim // 2, generator=gen)
            kw["attention_scaling"] = draw(st.floats(0.5, 2.0))
        else:
            width = draw(st.sampled_from([rotary_dim // 2, rotary_dim]))
            rows = 64 + 20 + seq
            table_dtype = draw(st.sampled_from([torch.float32, dtype]))
            kw["cos"] = torch.randn(rows, width, generator=gen).to(table_dtype)
            kw["sin"] = torch.randn(rows, width, generator=gen).to(table_dtype)
    kw["conjugate"] = draw(st.booleans())
    return dtype, q, k, kw, draw(st.booleans())


def _oracle(q, k, kw):
    kw = dict(kw)
    for name in ("cos", "sin"):
        if name in kw:
            kw[name] = kw[name].double()
    if k is None:
        return rotary.apply_rotary(q.double(), backend="reference", **kw), None
    return rotary.apply_rotary_qk(q.double(), k.double(), backend="reference", **kw)


def _check(out, ref, dtype):
    err = (out.double() - ref).abs()
    top = ref.abs().max().item() if ref.numel() else 0.0
    bound = REL[dtype] * ref.abs() + ABS[dtype] * max(top, 1e-30)
    assert bool((err <= bound).all()), f"max error {err.max().item():.3g}"


# The number of examples comes from the hypothesis profile: 60 by default, 3000 with
# `--hypothesis-profile=fuzz` (the rotary_flash nox session; see tests/conftest.py).
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(cases())
def test_fuzz_against_oracle(case):
    dtype, q, k, kw, inplace = case
    ref_q, ref_k = _oracle(q, k, kw)
    q_in = q.clone() if not inplace else q
    if k is None:
        out_q = rotary.apply_rotary(q_in, backend="cpu", inplace=inplace, **kw)
        out_k = None
    else:
        out_q, out_k = rotary.apply_rotary_qk(q_in, k, backend="cpu", inplace=inplace, **kw)
    assert out_q.shape == q.shape and out_q.dtype == q.dtype
    _check(out_q, ref_q, dtype)
    if k is not None:
        _check(out_k, ref_k, dtype)
