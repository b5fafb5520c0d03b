"""trl_orpo_log1mexp_nan_grad: TRL 0.27+ ORPO's log1mexp differentiates the unused log1p branch (NaN gradient
for float32 log-probs above ~-3e-8) and is -inf at 0 (infinite log-odds); with the shim every branch sees only
its own domain: forward values bit-identical to TRL's for every log-prob below -1.2e-38, gradients finite."""

import math

import pytest
import torch
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range
from ftshims.spec import ProbeUnsupported

SHIM = "trl_orpo_log1mexp_nan_grad"
shim_module = registry.get(SHIM).module
MODULE = shim_module.MODULE

HEALTHY = dict(chosen=(-2.0, -1.0, -5.0, -1e-3, -1e-7), rejected=(-3.0, -1.5, -4.0, -1e-2, -1e-6))


def test_fp32_logps_at_the_edge(evidence):
    """float32 chosen log-probs -1e-8 (NaN gradient) and 0 (log-odds inf, NaN gradient): finite with the shim."""
    assert_bug_and_fix(SHIM, evidence, "fp32 logps chosen -1e-8 and 0", dtype="float32")


def test_bf16_logps_at_the_edge(evidence):
    """bf16 inputs are cast to float32 first (TRL 0.27's own cast): the same edge."""
    assert_bug_and_fix(SHIM, evidence, "bf16 logps chosen -1e-8 and 0", dtype="bfloat16")


def test_healthy_logps_unharmed(evidence):
    assert_bug_and_fix(SHIM, evidence, "fp32 logps -1e-7..-5 (healthy)", expect_bug=False, dtype="float32", **HEALTHY)


@pytest.fixture
def affected():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range (trl < 0.27: trl_orpo_log_odds_nan's)")
    try:
        shim_module.probe(chosen=(-1.0,), rejected=(-2.0,))
    except ProbeUnsupported as exc:
        pytest.skip(str(exc))


def _odds(chosen, rejected, dtype=torch.float32):
    from ftshims.shims.trl_orpo_log_odds_nan import bare_trainer

    trainer = bare_trainer()
    c = torch.tensor(chosen, dtype=dtype, requires_grad=True)
    r = torch.tensor(rejected, dtype=dtype, requires_grad=True)
    out = type(trainer).odds_ratio_loss(trainer, c, r)
    out[0].sum().backward()
    return out, c.grad, r.grad


def test_forward_bit_identical_and_gradients_finite(affected):
    """Over float32 log-probs from -60 to -1.2e-38 (both branches, the branch point, the ~-3e-8 edge) TRL's
    log1mexp and the shim's give the same bits; the shim's gradient is finite everywhere, TRL's is NaN above
    ~-3e-8; at 0 TRL gives -inf, the shim log(tiny)."""
    import sys

    tiny = torch.finfo(torch.float32).tiny
    grid = torch.cat([-torch.logspace(math.log10(60.0), -37.9, 4001), torch.tensor([-0.6931471805599453, -tiny])])
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].active, report[SHIM].reason
        shimmed = sys.modules[MODULE].log1mexp
    upstream = vars(sys.modules[MODULE])["log1mexp"]
    assert shimmed is not upstream
    x_up = grid.clone().requires_grad_(True)
    x_sh = grid.clone().requires_grad_(True)
    y_up, y_sh = upstream(x_up), shimmed(x_sh)
    assert torch.equal(y_up, y_sh)
    y_up.sum().backward()
    y_sh.sum().backward()
    assert bool(torch.isfinite(x_sh.grad).all())
    nan_up = torch.isnan(x_up.grad)
    assert bool(nan_up.any()) and float(grid[nan_up].min()) > -6e-8  # TRL's NaN gradients: only at the edge
    assert torch.equal(x_up.grad[~nan_up], x_sh.grad[~nan_up])  # every finite TRL gradient unchanged
    zero = torch.zeros(1, requires_grad=True)
    assert float(upstream(torch.zeros(1))) == -math.inf
    value = shimmed(zero)
    value.sum().backward()
    assert float(value.detach()) == pytest.approx(math.log(tiny)) and bool(torch.isfinite(zero.grad).all())


def test_odds_ratio_loss_outputs_unchanged_for_healthy_logps(affected):
    plain, pgc, pgr = _odds(**HEALTHY)
    with ftshims.applied(only=[SHIM]):
        shimmed, sgc, sgr = _odds(**HEALTHY)
        actions = ftshims.status()[SHIM].actions
    for a, b in zip(plain, shimmed):
        assert torch.equal(a, b)
    assert torch.equal(pgc, sgc) and torch.equal(pgr, sgr)
    assert sum(actions.values()) == 2  # one call per log-prob tensor


def test_rejected_at_zero_gives_a_finite_loss(affected):
    """A rejected response at probability 1: TRL's loss is -inf (log-odds -inf); the shim's is finite and the
    gradient pushes the rejected log-prob down."""
    plain, _, _ = _odds((-0.5,), (0.0,))
    with ftshims.applied(only=[SHIM]):
        shimmed, gc, gr = _odds((-0.5,), (0.0,))
    assert float(plain[0].detach()) == -math.inf
    assert math.isfinite(float(shimmed[0])) and float(shimmed[4]) < -80
    assert bool(torch.isfinite(gc).all()) and bool(torch.isfinite(gr).all())


def test_compiles_fullgraph(affected):
    import sys

    x = torch.tensor([-1e-8, 0.0, -2.0])
    with ftshims.applied(only=[SHIM]):
        fn = sys.modules[MODULE].log1mexp
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="eager", fullgraph=True)(x)
        torch._dynamo.reset()
        assert torch.equal(compiled, fn(x))


def test_reverts_to_the_original_function(affected):
    import sys

    module = sys.modules[MODULE]
    original = vars(module)["log1mexp"]
    with ftshims.applied(only=[SHIM]):
        assert vars(module)["log1mexp"] is not original
    assert vars(module)["log1mexp"] is original
