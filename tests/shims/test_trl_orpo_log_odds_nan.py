"""trl_orpo_log_odds_nan: TRL 0.8.2-0.26 ORPOTrainer.odds_ratio_loss computes log(1 - exp(logp)) as TRL 0.27
does (float32, stable log1mexp): no NaN/inf log-odds or gradients for likely responses, nothing else changed."""

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range
from ftshims.spec import ProbeUnsupported
from ftshims.versions import in_range, installed_version

SHIM = "trl_orpo_log_odds_nan"
shim_module = registry.get(SHIM).module

HEALTHY = dict(chosen=(-2.0, -1.0, -5.0), rejected=(-3.0, -1.5, -4.0))


def test_bf16_logps_near_zero(evidence):
    """bf16 log-probs -1e-4 / -1e-3: exp rounds to 1, log1p(-1) = -inf, loss and gradients NaN."""
    assert_bug_and_fix(SHIM, evidence, "bf16 logps chosen -1e-4, rejected -1e-3", dtype="bfloat16",
                       chosen=(-1e-4, -2.0), rejected=(-1e-3, -3.0))


def test_fp32_logps_near_zero(evidence):
    """float32 log-probs -1e-7 / -1e-6: the log-odds is 7 % off and the gradient 14 %."""
    assert_bug_and_fix(SHIM, evidence, "fp32 logps chosen -1e-7, rejected -1e-6", dtype="float32",
                       chosen=(-1e-7,), rejected=(-1e-6,))


@pytest.mark.skipif(not in_range(installed_version("trl") or "0", "<0.27.0"),
                    reason="trl >= 0.27 has its own log1mexp: trl_orpo_log1mexp_nan_grad's")
def test_fp32_logps_at_the_edge(evidence):
    """float32 chosen log-probs -1e-8 and 0: log-odds inf and NaN gradients, also with TRL 0.27's formula (the
    unused log1p branch's gradient); finite with the shim's clamped branches (since 0.2.0)."""
    assert_bug_and_fix(SHIM, evidence, "fp32 logps chosen -1e-8 and 0", dtype="float32", chosen=(-1e-8, 0.0, -2.0),
                       rejected=(-1e-3, -1e-3, -3.0))


def test_log1mexp_is_trl_0_27s_with_finite_gradients():
    """The shim's log1mexp gives TRL 0.27.0's bits for every float32 log-prob from -60 to -1.2e-38 (its finite
    gradients too), a finite gradient where 0.27.0's is NaN (above ~-3e-8), and log(tiny) instead of -inf at 0."""
    import math

    def trl_0_27(x):  # trl/experimental/orpo/orpo_trainer.py, 0.27.0 lines 76-80
        return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))

    tiny = torch.finfo(torch.float32).tiny
    grid = torch.cat([-torch.logspace(math.log10(60.0), -37.9, 4001), torch.tensor([-0.6931471805599453, -tiny])])
    a, b = grid.clone().requires_grad_(True), grid.clone().requires_grad_(True)
    ya, yb = trl_0_27(a), shim_module.log1mexp(b)
    assert torch.equal(ya, yb)
    ya.sum().backward()
    yb.sum().backward()
    nan = torch.isnan(a.grad)
    assert bool(nan.any()) and bool(torch.isfinite(b.grad).all())
    assert torch.equal(a.grad[~nan], b.grad[~nan])
    assert float(shim_module.log1mexp(torch.zeros(1))) == pytest.approx(math.log(tiny))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_moderate_logps_unharmed(evidence, dtype):
    assert_bug_and_fix(SHIM, evidence, f"{dtype} logps -1..-5 (healthy)", expect_bug=False, dtype=dtype, **HEALTHY)


def _call(dtype, chosen, rejected):
    trainer = shim_module.bare_trainer()
    c = torch.tensor(chosen, dtype=dtype, requires_grad=True)
    r = torch.tensor(rejected, dtype=dtype, requires_grad=True)
    out = type(trainer).odds_ratio_loss(trainer, c, r)
    out[0].sum().backward()
    return out, c.grad, r.grad


@pytest.fixture
def affected():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    try:
        shim_module.orpo_class()
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))


def test_fp32_below_minus_ln2_bit_identical(affected):
    """float32 log-probs below -ln 2 take the same log1p(-exp(x)) branch: every output and gradient unchanged."""
    plain, pgc, pgr = _call(torch.float32, **HEALTHY)
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].active, report[SHIM].reason
        shimmed, sgc, sgr = _call(torch.float32, **HEALTHY)
    assert len(plain) == len(shimmed) == 5
    for a, b in zip(plain, shimmed):
        assert type(a) is type(b)  # .item() floats stay floats (TRL <0.11), tensors stay tensors
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert a == b
    assert torch.equal(pgc, sgc) and torch.equal(pgr, sgr)


def test_matches_trl_0_27_formula_and_keeps_the_version_shape(affected):
    """bf16 inputs: float32 outputs as in TRL 0.27 (upstream's cast); the values equal the 0.27 body's, and the
    version's own ratio (log(sigmoid) before 0.12) and return types are kept; old and new agree within bf16 rounding."""
    chosen, rejected = (-0.3, -2.0, -1.2), (-0.5, -3.0, -0.9)
    plain, _, _ = _call(torch.bfloat16, chosen, rejected)
    with ftshims.applied(only=[SHIM]):
        shimmed, gc, gr = _call(torch.bfloat16, chosen, rejected)
    assert shimmed[0].dtype == shimmed[1].dtype == torch.float32
    c = torch.tensor(chosen, dtype=torch.bfloat16).float()
    r = torch.tensor(rejected, dtype=torch.bfloat16).float()
    log_odds = (c - r) - (shim_module.log1mexp(c) - shim_module.log1mexp(r))  # TRL 0.27.0's body
    assert torch.equal(shimmed[1], 0.1 * c) and torch.equal(shimmed[2], 0.1 * r)
    assert float(torch.as_tensor(shimmed[4]).detach()) == float(torch.mean(log_odds).detach())
    assert torch.allclose(shimmed[0], 0.1 * torch.nn.functional.logsigmoid(log_odds), rtol=1e-6, atol=0)
    assert type(plain[3]) is type(shimmed[3]) and type(plain[4]) is type(shimmed[4])
    assert torch.allclose(plain[0].float(), shimmed[0], rtol=3e-2, atol=0)
    assert bool(gc.isfinite().all()) and bool(gr.isfinite().all())


def test_reverts_to_the_original_method(affected):
    cls = shim_module._defining_class(shim_module.orpo_class())
    original = vars(cls)["odds_ratio_loss"]
    with ftshims.applied(only=[SHIM]):
        assert vars(cls)["odds_ratio_loss"] is not original
    assert vars(cls)["odds_ratio_loss"] is original
