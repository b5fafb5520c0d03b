"""ftshims.kernels.rotary: the compiled CPU kernel and the reference against an fp64 oracle.

The oracle is the reference backend run in fp64 on fp64 copies of the inputs;
the oracle itself is checked against two independent formulas (HF's
``rotate_half`` and a complex multiplication for the interleaved layout).
"""

from __future__ import annotations

import itertools
import logging
import math

import pytest

torch = pytest.importorskip("torch")

from ftshims.kernels import _build, _reference, rotary  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def compiled():
    """The CPU tests need the compiled extension: a build failure fails them (no silent skip)."""
    if not _build.load(jit=True):
        pytest.fail(f"ftshims rotary extension unavailable: {_build.status()['reason']}")
    return _build.status()


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# |error| <= REL[dtype] * |ref| + ABS[dtype] * max|ref|: the output's rounding (one ulp
# at most) plus fp32 (fp64) arithmetic error relative to the largest magnitude.
REL = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -10}
ABS = {torch.float32: 1e-6, torch.float64: 1e-13, torch.bfloat16: 1e-6, torch.float16: 1e-6}


def assert_close_to_oracle(out, ref, scale, dtype, what=""):
    err = (out.double() - ref).abs()
    top = ref.abs().max().item() if ref.numel() else 0.0
    bound = REL[dtype] * ref.abs() + ABS[dtype] * max(top, 1e-30)
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3g} exceeds tolerance (ratio {worst:.2f})"


def oracle(q, k, **kw):
    kw = dict(kw)
    for name in ("cos", "sin"):
        if kw.get(name) is not None:
            kw[name] = kw[name].double()
    if k is None:
        return rotary.apply_rotary(q.double(), backend="reference", **kw), None
    return rotary.apply_rotary_qk(q.double(), k.double(), backend="reference", **kw)


def make(shape, dtype, gen):
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


# ---------------------------------------------------------------------------
# the oracle against independent formulas


def test_oracle_matches_hf_rotate_half_and_complex_rotation():
    gen = torch.Generator().manual_seed(1)
    b, s, h, d = 2, 9, 3, 16
    x = make((b, s, h, d), torch.float64, gen)
    pos = torch.randint(0, 10000, (b, s), generator=gen)
    inv = rotary.default_inv_freq(d, 10000.0)
    phase = pos.double()[..., None] * inv.double()  # [b, s, d/2]

    emb = torch.cat((phase, phase), dim=-1)[:, :, None]
    rot_half = torch.cat((-x[..., d // 2:], x[..., : d // 2]), dim=-1)
    hf = x * emb.cos() + rot_half * emb.sin()
    ours = rotary.apply_rotary(x, pos, rope_theta=10000.0, backend="reference")
    assert torch.allclose(ours, hf, atol=1e-12, rtol=0)

    xc = torch.view_as_complex(x.reshape(b, s, h, d // 2, 2).contiguous())
    gptj = torch.view_as_real(xc * torch.polar(torch.ones_like(phase), phase)[:, :, None]).reshape(b, s, h, d)
    ours_i = rotary.apply_rotary(x, pos, rope_theta=10000.0, interleaved=True, backend="reference")
    assert torch.allclose(ours_i, gptj, atol=1e-12, rtol=0)


def test_default_inv_freq_is_transformers_formula():
    for dim, theta in ((128, 10000.0), (64, 500000.0), (96, 1e6)):
        hf = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        got = rotary.default_inv_freq(dim, theta)
        assert got.dtype == torch.float32 and torch.equal(got, hf)


# ---------------------------------------------------------------------------
# the matrix: every layout / dtype / partial dim / angle source / positions kind


def _angle_kwargs(source, rotary_dim, batch, seq, dtype, gen, positions_kind):
    kw = {}
    table_rows = 300
    if positions_kind == "explicit":
        kw["positions"] = torch.randint(0, 200, (batch, seq), generator=gen)
    elif positions_kind == "offset_int":
        kw["seqlen_offsets"] = 17
    elif positions_kind == "offset_tensor":
        kw["seqlen_offsets"] = torch.randint(0, 100, (batch,), generator=gen, dtype=torch.int32)
    if source == "theta":
        kw["rope_theta"] = 10000.0
    elif source == "inv_freq":
        kw["inv_freq"] = (torch.rand(rotary_dim // 2, generator=gen) * 2).float()
        kw["attention_scaling"] = 0.75
    elif source in ("table_half", "table_full"):
        width = rotary_dim // 2 if source == "table_half" else rotary_dim
        kw["cos"] = make((table_rows, width), torch.float32, gen)
        kw["sin"] = make((table_rows, width), torch.float32, gen)
    elif source == "token_full":
        if positions_kind != "default":
            return None  # per-token cos/sin take no positions
        kw["cos"] = make((1, seq, rotary_dim), dtype, gen)
        kw["sin"] = make((1, seq, rotary_dim), dtype, gen)
    return kw


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_matrix_against_fp64_oracle(dtype):
    gen = torch.Generator().manual_seed(2)
    batch, seq, hq, hk, d = 2, 6, 4, 2, 16
    checked = 0
    for interleaved, rotary_dim, source, positions_kind, inplace, layout in itertools.product(
        (False, True), (16, 8, 6), ("theta", "inv_freq", "table_half", "table_full", "token_full"),
        ("default", "explicit", "offset_int", "offset_tensor"), (False, True), ("bshd", "bhsd"),
    ):
        kw = _angle_kwargs(source, rotary_dim, batch, seq, dtype, gen, positions_kind)
        if kw is None:
            continue
        shape_q = (batch, seq, hq, d) if layout == "bshd" else (batch, hq, seq, d)
        shape_k = (batch, seq, hk, d) if layout == "bshd" else (batch, hk, seq, d)
        q, k = make(shape_q, dtype, gen), make(shape_k, dtype, gen)
        ref_q, ref_k = oracle(q, k, rotary_dim=rotary_dim, interleaved=interleaved, layout=layout, **kw)
        q_in, k_in = q.clone(), k.clone()
        out_q, out_k = rotary.apply_rotary_qk(
            q_in, k_in, rotary_dim=rotary_dim, interleaved=interleaved, layout=layout, inplace=inplace, backend="cpu", **kw
        )
        if inplace:
            assert out_q is q_in and out_k is k_in
        else:
            assert torch.equal(q_in, q) and torch.equal(k_in, k), "out-of-place call modified its input"
        what = f"{dtype} inter={interleaved} rd={rotary_dim} {source} {positions_kind} inplace={inplace} {layout}"
        scale = 4.0
        assert_close_to_oracle(out_q, ref_q, scale, dtype, what)
        assert_close_to_oracle(out_k, ref_k, scale, dtype, what)
        # the pass-through part is bit-identical
        assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("source", ["theta", "table_half", "table_full"])
def test_varlen_restarts_positions_per_sequence(dtype, source):
    gen = torch.Generator().manual_seed(3)
    lens = [3, 0, 5, 1]
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)
    total, heads, d = cu[-1].item(), 3, 8
    x = make((total, heads, d), dtype, gen)
    offsets = torch.tensor([0, 4, 2, 7])
    kw = _angle_kwargs(source, d, 1, total, dtype, gen, "default")
    for interleaved, offs in itertools.product((False, True), (0, offsets)):
        got = rotary.apply_rotary(x, layout="thd", cu_seqlens=cu, seqlen_offsets=offs, interleaved=interleaved, backend="cpu", **kw)
        ref, _ = oracle(x, None, layout="thd", cu_seqlens=cu, seqlen_offsets=offs, interleaved=interleaved, **kw)
        assert_close_to_oracle(got, ref, 4.0, dtype, f"varlen {source} {interleaved}")
        # each sequence equals a batched call on that sequence alone
        for i in range(len(lens)):
            lo, hi = cu[i].item(), cu[i + 1].item()
            if lo == hi:
                continue
            off = offs if isinstance(offs, int) else int(offs[i])
            alone = rotary.apply_rotary(x[lo:hi][None], seqlen_offsets=off, interleaved=interleaved, backend="cpu", **kw)[0]
            assert torch.equal(alone, got[lo:hi])


def test_phase_is_fp32_exact_at_long_positions():
    # A plain fp32 product p * inv_freq is off by up to ulp(p)/2 rad: ~0.03 at p = 1e6.
    # The kernel recovers the product's rounding error, so it stays at fp32 resolution.
    d = 128
    pos = torch.tensor([[0, 4095, 32767, 131071, 1_000_003, 8_388_607]])
    x = torch.ones(1, pos.shape[1], 1, d)
    inv = rotary.default_inv_freq(d, 10000.0)
    got = rotary.apply_rotary(x, pos, inv_freq=inv, backend="cpu")
    ref = rotary.apply_rotary(x.double(), pos, inv_freq=inv, backend="reference")
    assert (got.double() - ref).abs().max().item() < 5e-7
    naive_phase = pos.float()[..., None] * inv  # what an fp32 cos(p * f) computes
    naive_err = (naive_phase.double() - pos.double()[..., None] * inv.double()).abs().max().item()
    assert naive_err > 1e-2  # the naive error the kernel avoids


def test_reference_backend_agrees_with_oracle():
    gen = torch.Generator().manual_seed(4)
    q, k = make((2, 5, 3, 16), torch.bfloat16, gen), make((2, 5, 1, 16), torch.bfloat16, gen)
    pos = torch.randint(0, 4096, (2, 5), generator=gen)
    got = rotary.apply_rotary_qk(q, k, pos, rope_theta=5e5, rotary_dim=12, interleaved=True, backend="reference")
    ref = oracle(q, k, positions=pos, rope_theta=5e5, rotary_dim=12, interleaved=True)
    for g, r in zip(got, ref):
        assert_close_to_oracle(g, r, 4.0, torch.bfloat16, "reference")


def test_strided_inputs_and_outputs():
    gen = torch.Generator().manual_seed(5)
    base = make((3, 8, 2, 5, 40), torch.float32, gen)
    q = base[:, :, 0, :, 4:36:2]  # non-contiguous in every dim, dim stride 2
    k = base[:, :, 1, 1:3, 8:24]  # dim stride 1 but sliced
    pos = torch.arange(8)
    got_q, got_k = rotary.apply_rotary_qk(q, k[..., :16], pos, rope_theta=1e4, backend="cpu")
    ref_q, ref_k = oracle(q, k[..., :16], positions=pos, rope_theta=1e4)
    assert_close_to_oracle(got_q, ref_q, 4.0, torch.float32, "strided q")
    assert_close_to_oracle(got_k, ref_k, 4.0, torch.float32, "strided k")
    before = base.clone()
    rotary.apply_rotary(q, pos, rope_theta=1e4, inplace=True, backend="cpu")
    assert_close_to_oracle(q, ref_q, 4.0, torch.float32, "strided in place")
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[:, :, 0, :, 4:36:2] = False
    assert torch.equal(base[mask], before[mask]), "in-place write touched elements outside the view"


def test_conjugate_inverts():
    gen = torch.Generator().manual_seed(6)
    x = make((2, 7, 3, 32), torch.float64, gen)
    pos = torch.randint(0, 1000, (2, 7), generator=gen)
    y = rotary.apply_rotary(x, pos, rope_theta=1e4, rotary_dim=24, backend="cpu")
    back = rotary.apply_rotary(y, pos, rope_theta=1e4, rotary_dim=24, conjugate=True, backend="cpu")
    assert torch.allclose(back, x, atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------
# autograd


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", ["theta_gqa", "table_interleaved_partial", "token_full", "varlen"])
def test_gradcheck_fp64(case, inplace):
    gen = torch.Generator().manual_seed(7)
    if case == "varlen":
        cu = torch.tensor([0, 2, 5], dtype=torch.int32)
        q = make((5, 2, 8), torch.float64, gen).requires_grad_()
        k = make((5, 1, 8), torch.float64, gen).requires_grad_()
        kw = dict(layout="thd", cu_seqlens=cu, rope_theta=100.0, seqlen_offsets=torch.tensor([3, 1]))
    else:
        q = make((2, 4, 3, 8), torch.float64, gen).requires_grad_()
        k = make((2, 4, 1, 8), torch.float64, gen).requires_grad_()
        if case == "theta_gqa":
            kw = dict(positions=torch.randint(0, 50, (2, 4), generator=gen), rope_theta=100.0, attention_scaling=1.3)
        elif case == "table_interleaved_partial":
            kw = dict(cos=make((10, 3), torch.float64, gen), sin=make((10, 3), torch.float64, gen), rotary_dim=6,
                      interleaved=True, seqlen_offsets=torch.tensor([1, 4]))
        else:
            kw = dict(cos=make((2, 4, 8), torch.float64, gen), sin=make((2, 4, 8), torch.float64, gen))

    def fn(q, k):
        if inplace:
            q, k = q * 1, k * 1  # in place on non-leaf copies
        return rotary.apply_rotary_qk(q, k, inplace=inplace, backend="cpu", **kw)

    assert torch.autograd.gradcheck(fn, (q, k))


def test_backward_matches_reference_autograd():
    gen = torch.Generator().manual_seed(8)
    q = make((2, 5, 4, 16), torch.float32, gen).requires_grad_()
    pos = torch.randint(0, 100, (2, 5), generator=gen)
    go = make((2, 5, 4, 16), torch.float32, gen)
    (g_kernel,) = torch.autograd.grad(rotary.apply_rotary(q, pos, rope_theta=1e4, rotary_dim=10, backend="cpu"), q, go)
    (g_ref,) = torch.autograd.grad(rotary.apply_rotary(q, pos, rope_theta=1e4, rotary_dim=10, backend="reference"), q, go)
    assert torch.allclose(g_kernel, g_ref, atol=1e-5, rtol=1e-5)


def test_cos_requiring_grad_uses_reference(caplog):
    gen = torch.Generator().manual_seed(9)
    x = make((1, 3, 2, 8), torch.float64, gen)
    cos = make((1, 3, 8), torch.float64, gen).requires_grad_()
    sin = make((1, 3, 8), torch.float64, gen)
    with caplog.at_level(logging.WARNING, logger="ftshims"):
        out = rotary.apply_rotary(x, cos=cos, sin=sin)
    out.sum().backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0
    with pytest.raises(rotary.BackendUnavailable):
        rotary.apply_rotary(x, cos=cos, sin=sin, backend="cpu")


# ---------------------------------------------------------------------------
# registration: opcheck (schema, fake impl, autograd) and torch.compile


def test_opcheck():
    gen = torch.Generator().manual_seed(10)
    q = make((2, 3, 4, 8), torch.float32, gen).requires_grad_()
    k = make((2, 3, 2, 8), torch.float32, gen)
    inv = rotary.default_inv_freq(8, 1e4)
    pos = torch.randint(0, 9, (2, 3), generator=gen)
    args = (q, k, None, None, inv, pos, None, None, 0, 8, False, False, 1.0)
    torch.library.opcheck(torch.ops.ftshims.rotary.default, args)
    cos, sin = make((12, 4), torch.float32, gen), make((12, 4), torch.float32, gen)
    args_ = (q.detach().clone(), None, cos, sin, None, None, torch.tensor([1, 2]), None, 3, 8, True, True, 0.5)
    torch.library.opcheck(torch.ops.ftshims.rotary_.default, args_)


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(11)
    q = make((2, 4, 3, 8), torch.float32, gen)
    k = make((2, 4, 1, 8), torch.float32, gen)
    pos = torch.arange(4)

    def f(q, k):
        a, b = rotary.apply_rotary_qk(q, k, pos, rope_theta=1e4, layout="bshd", backend="cpu")
        x = q + 1
        rotary.apply_rotary(x, pos, rope_theta=1e4, inplace=True, backend="cpu")
        return a.sum() * 2 + b.sum() + x.sum()

    expected = f(q, k)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.allclose(compiled(q, k), expected, atol=1e-5)
    qr = q.clone().requires_grad_()
    compiled(qr, k).backward()
    qe = q.clone().requires_grad_()
    f(qe, k).backward()
    assert torch.allclose(qr.grad, qe.grad, atol=1e-5)


# ---------------------------------------------------------------------------
# bad input: ValueError before any kernel runs, for every backend


def _bad_cases():
    x = torch.randn(2, 5, 3, 8)
    pos = torch.arange(5)
    tab = torch.randn(10, 4)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    xt = torch.randn(5, 3, 8)
    return [
        ("int x", lambda b: rotary.apply_rotary(x.long(), pos, rope_theta=1e4, backend=b)),
        ("3-D x bshd", lambda b: rotary.apply_rotary(x[0], pos, rope_theta=1e4, backend=b)),
        ("odd rotary_dim", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, rotary_dim=5, backend=b)),
        ("rotary_dim > head_dim", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, rotary_dim=10, backend=b)),
        ("no angle source", lambda b: rotary.apply_rotary(x, pos, backend=b)),
        ("two angle sources", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, cos=tab, sin=tab, backend=b)),
        ("cos without sin", lambda b: rotary.apply_rotary(x, pos, cos=tab, backend=b)),
        ("bf16 inv_freq", lambda b: rotary.apply_rotary(x, pos, inv_freq=torch.ones(4, dtype=torch.bfloat16), backend=b)),
        ("inv_freq length", lambda b: rotary.apply_rotary(x, pos, inv_freq=torch.ones(3), backend=b)),
        ("cos width", lambda b: rotary.apply_rotary(x, pos, cos=torch.randn(10, 3), sin=torch.randn(10, 3), backend=b)),
        ("cos/sin shapes", lambda b: rotary.apply_rotary(x, pos, cos=tab, sin=torch.randn(11, 4), backend=b)),
        ("cos/sin dtypes", lambda b: rotary.apply_rotary(x, pos, cos=tab, sin=tab.double(), backend=b)),
        ("position past table", lambda b: rotary.apply_rotary(x, pos + 6, cos=tab, sin=tab, backend=b)),
        ("negative position", lambda b: rotary.apply_rotary(x, pos - 1, cos=tab, sin=tab, backend=b)),
        ("tensor offset past table", lambda b: rotary.apply_rotary(x, cos=tab, sin=tab, seqlen_offsets=torch.tensor([0, 6]), backend=b)),
        ("int offset past table", lambda b: rotary.apply_rotary(x, cos=tab, sin=tab, seqlen_offsets=6, backend=b)),
        ("offsets shape", lambda b: rotary.apply_rotary(x, rope_theta=1e4, seqlen_offsets=torch.tensor([0, 1, 2]), backend=b)),
        ("float offsets", lambda b: rotary.apply_rotary(x, rope_theta=1e4, seqlen_offsets=torch.tensor([0.0, 1.0]), backend=b)),
        ("float positions", lambda b: rotary.apply_rotary(x, pos.float(), rope_theta=1e4, backend=b)),
        ("positions shape", lambda b: rotary.apply_rotary(x, torch.arange(4), rope_theta=1e4, backend=b)),
        ("token cos with positions", lambda b: rotary.apply_rotary(x, pos, cos=torch.randn(2, 5, 8), sin=torch.randn(2, 5, 8), backend=b)),
        ("token cos seq", lambda b: rotary.apply_rotary(x, cos=torch.randn(2, 4, 8), sin=torch.randn(2, 4, 8), backend=b)),
        ("k head_dim", lambda b: rotary.apply_rotary_qk(x, torch.randn(2, 5, 1, 6), pos, rope_theta=1e4, backend=b)),
        ("k dtype", lambda b: rotary.apply_rotary_qk(x, torch.randn(2, 5, 1, 8).double(), pos, rope_theta=1e4, backend=b)),
        ("cu_seqlens end", lambda b: rotary.apply_rotary(xt, layout="thd", cu_seqlens=torch.tensor([0, 2, 4]), rope_theta=1e4, backend=b)),
        ("cu_seqlens start", lambda b: rotary.apply_rotary(xt, layout="thd", cu_seqlens=torch.tensor([1, 2, 5]), rope_theta=1e4, backend=b)),
        ("cu_seqlens decreasing", lambda b: rotary.apply_rotary(xt, layout="thd", cu_seqlens=torch.tensor([0, 4, 3, 5]), rope_theta=1e4, backend=b)),
        ("cu_seqlens float", lambda b: rotary.apply_rotary(xt, layout="thd", cu_seqlens=cu.float(), rope_theta=1e4, backend=b)),
        ("cu_seqlens without thd", lambda b: rotary.apply_rotary(x, cu_seqlens=cu, rope_theta=1e4, backend=b)),
        ("varlen offset past table", lambda b: rotary.apply_rotary(xt, layout="thd", cu_seqlens=cu, cos=tab, sin=tab, seqlen_offsets=torch.tensor([0, 8]), backend=b)),
        ("bad layout", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, layout="bsdh", backend=b)),
        ("bad theta", lambda b: rotary.apply_rotary(x, pos, rope_theta=-1.0, backend=b)),
        ("nan scaling", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, attention_scaling=float("nan"), backend=b)),
        ("bad backend", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, backend="tpu")),
        ("cuda backend on cpu tensors", lambda b: rotary.apply_rotary(x, pos, rope_theta=1e4, backend="cuda")),
    ]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("case", [c[0] for c in _bad_cases()])
def test_bad_input_raises_value_error(case, backend):
    fn = dict(_bad_cases())[case]
    with pytest.raises(ValueError):
        fn(backend)


@pytest.mark.parametrize(
    "args",
    [
        "rank3", "odd", "both_sources", "pos_past_table", "offset_tensor_past_table", "cu_end", "inplace_expanded",
    ],
)
def test_raw_op_validates_too(args):
    # The registered op itself checks its arguments (it can be called directly).
    x = torch.randn(2, 5, 3, 8)
    tab = torch.randn(10, 4)
    inv = torch.ones(4)
    op = torch.ops.ftshims.rotary
    calls = {
        "rank3": lambda: op(x[0], None, None, None, inv, None, None, None, 0, 8, False, False, 1.0),
        "odd": lambda: op(x, None, None, None, inv, None, None, None, 0, 7, False, False, 1.0),
        "both_sources": lambda: op(x, None, tab, tab, inv, None, None, None, 0, 8, False, False, 1.0),
        "pos_past_table": lambda: op(x, None, tab, tab, None, torch.full((1, 5), 10), None, None, 0, 8, False, False, 1.0),
        "offset_tensor_past_table": lambda: op(x, None, tab, tab, None, None, torch.tensor([0, 6]), None, 0, 8, False, False, 1.0),
        "cu_end": lambda: op(x[:1], None, None, None, inv, None, None, torch.tensor([0, 3]), 0, 8, False, False, 1.0),
        "inplace_expanded": lambda: torch.ops.ftshims.rotary_(torch.randn(1, 5, 1, 8).expand(2, 5, 3, 8), None, None, None, inv, None, None, None, 0, 8, False, False, 1.0),
    }
    with pytest.raises(ValueError):
        calls[args]()


# ---------------------------------------------------------------------------
# backend selection


def test_backend_env_var(monkeypatch):
    x = torch.randn(1, 3, 2, 8)
    monkeypatch.setenv(rotary.BACKEND_ENV, "reference")
    assert rotary.resolve_backend("cpu") == ("reference", None)
    monkeypatch.setenv(rotary.BACKEND_ENV, "bogus")
    with pytest.raises(ValueError, match=rotary.BACKEND_ENV):
        rotary.apply_rotary(x, rope_theta=1e4)
    monkeypatch.setenv(rotary.BACKEND_ENV, "auto")
    assert rotary.resolve_backend("cpu") == ("cpu", None)


def test_auto_falls_back_with_reason_and_explicit_raises(monkeypatch, caplog):
    # Simulate an extension that failed to build.
    state = dict(_build._STATE)
    monkeypatch.setattr(_build, "_STATE", dict(state, loaded=False, tried=True, how="jit-failed", reason="JIT build failed: no compiler"))
    monkeypatch.setattr(rotary, "_WARNED", set())
    x = torch.randn(1, 3, 2, 8)
    with caplog.at_level(logging.WARNING, logger="ftshims"):
        out = rotary.apply_rotary(x, rope_theta=1e4, backend="auto")
    assert "no compiler" in caplog.text and "reference" in caplog.text
    assert torch.allclose(out, rotary.apply_rotary(x, rope_theta=1e4, backend="reference"))
    with pytest.raises(rotary.BackendUnavailable, match="no compiler"):
        rotary.apply_rotary(x, rope_theta=1e4, backend="cpu")


def test_cuda_tensors_need_cuda_kernels(monkeypatch):
    monkeypatch.setattr(_build, "_STATE", dict(_build._STATE, cuda=False))
    assert rotary.resolve_backend("cuda", "auto")[0] == "reference"
    with pytest.raises(rotary.BackendUnavailable):
        rotary.resolve_backend("cuda", "cuda")


def test_empty_inputs():
    x = torch.randn(0, 5, 3, 8)
    assert rotary.apply_rotary(x, rope_theta=1e4, backend="cpu").shape == x.shape
    y = torch.randn(2, 0, 3, 8)
    assert rotary.apply_rotary(y, rope_theta=1e4, backend="cpu").shape == y.shape


def test_inv_freq_from_config_uses_transformers_rope_init():
    transformers = pytest.importorskip("transformers")
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: F401
    except ImportError:
        pytest.skip("this transformers has no rope-init functions (< 4.45)")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=5e5)
    inv, scale = rotary.inv_freq_from_config(config)
    assert scale == 1.0 and torch.equal(inv, rotary.default_inv_freq(16, 5e5))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    if hasattr(config, "rope_parameters") and isinstance(config.rope_parameters, dict):
        cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
                                       rope_parameters=dict(yarn, rope_theta=1e4))
    else:
        cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_scaling=yarn)
    inv_y, scale_y = rotary.inv_freq_from_config(cfg)
    assert inv_y.dtype == torch.float32 and inv_y.shape == (8,)
    assert scale_y == pytest.approx(0.1 * math.log(4.0) + 1.0)
