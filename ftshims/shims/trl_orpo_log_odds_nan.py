"""TRL's ORPO loss cancels catastrophically when a response is likely: NaN/inf log-odds and gradients.

Why: ``ORPOTrainer.odds_ratio_loss`` (TRL 0.8.2-0.26.x) computes the log odds ratio as
``(c - r) - (log1p(-exp(c)) - log1p(-exp(r)))`` for the policy's (length-averaged) log-probs ``c``
(chosen) and ``r`` (rejected), in their own dtype. As a log-prob approaches 0 (probability 1),
``exp(logp)`` rounds to 1 and ``log1p(-1)`` is ``-inf``: in bfloat16 that already happens at
``logp = -1e-4`` (``exp`` has 8 bits of mantissa), so the log-odds is ``inf``/NaN, the loss NaN or a
silent 0 and the gradients NaN; the run blows up (trl#3237, trl#2564, trl#1473). In float32 the same
cancellation loses 7 % of the log-odds and 14 % of the gradient at ``logp = -1e-7`` and gives ``inf``
below ~6e-8. TRL PR #4763 (first released in 0.27.0, in ``trl/experimental/orpo/orpo_trainer.py``)
casts both log-probs to float32 and computes ``log(1 - exp(x))`` with a two-branch ``log1mexp``:
``log1p(-exp(x))`` for ``x < -ln 2`` and ``log(-expm1(x))`` above. Earlier PRs did not touch this:
#1491 (0.8.2) introduced ``log1p``, #2274 (0.12.0) replaced ``log(sigmoid(.))`` by ``logsigmoid``.

The fix: replace ``ORPOTrainer.odds_ratio_loss`` with the 0.27.0 computation (same ``.float()``
cast, same ``log1mexp`` branch point and operations: the forward values are bit-identical to TRL
0.27+), keeping the rest of the installed version's method as it is: TRL 0.8.2-0.11.x keep
``log(sigmoid(log_odds))`` (0.12.0+ ``logsigmoid``), and 0.8.2-0.10.x keep returning the two logging
means as Python floats (``.item()``). Which of the three released variants is installed is read from
the original method's code (the names it uses), not guessed from the version.

What changes where there was no bug, exactly as upgrading to TRL 0.27 would: float32 log-probs below
``-ln 2`` give bit-identical results; between ``-ln 2`` and 0 the ``log(-expm1)`` branch rounds
differently (more accurately; below 1e-7 relative). bfloat16/float16 log-probs give float32 losses
and rewards (upstream's cast; the old bf16 results carried bf16 rounding, ~4e-3 relative). Beyond
0.27.0 (since ftshims 0.2.0; ``trl_orpo_log1mexp_nan_grad`` does the same on TRL 0.27+): each branch
of ``log1mexp`` is clamped to its own domain, so float32 log-probs above ~-3e-8, where 0.27.0's
gradient is NaN (``torch.where`` differentiates the unused ``log1p`` branch too), get finite
gradients with unchanged forward values, and a log-prob of exactly 0 gets a finite log-odds (87.3
instead of inf) where 0.27.0 gives inf and a NaN gradient.

Applies to trl >=0.8.2 (ORPO's first release),<0.27.0, in ``trl.trainer.orpo_trainer`` (<0.26) and
``trl.experimental.orpo.orpo_trainer`` (0.26.x, which ``trl.trainer.orpo_trainer`` subclasses).
Fallback: a class without ``odds_ratio_loss(self, policy_chosen_logps, policy_rejected_logps)``, or
whose method no longer computes ``log1p(-exp(.))`` (already fixed, or changed), is left alone
(target missing); a method another library replaced is left alone (foreign patch).

Follow-ups: none. ORPOTrainer.odds_ratio_loss and log1mexp read in trl 0.27.0, 0.27.2, 0.28.0,
0.29.1, 1.0.0, 1.4.0, 1.9.0 and 1.16.0 (trl/experimental/orpo/orpo_trainer.py): identical to
#4763's; trl#3237 and #2564 were answered with #4763, and no later change or regression report
was found.
"""

from __future__ import annotations

import inspect
import math
import warnings

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

PARAMS = ("policy_chosen_logps", "policy_rejected_logps")
# The branch point TRL 0.27.0 uses (its literal): -ln 2.
_LN2_NEG = -0.6931471805599453

SPEC = ShimSpec(
    id="trl_orpo_log_odds_nan",
    since="0.2.0",
    unpinned="trl 0.26.x alone has ORPO under trl.experimental with the bug (0.27.0 fixed it), and no stack pins that "
    "one release line: odds_ratio_loss is the same code in 0.24.0 (tested on t4_57_trl024) and in 0.26.0-0.26.2 "
    "(read in the wheels)",
    title="ORPO odds-ratio loss is NaN/inf when a response's log-prob nears 0",
    symptom="ORPOTrainer: log_odds_chosen/loss NaN or inf and NaN gradients (bf16 log-probs above ~-1e-3; float32 "
    "above ~-1e-7 loses precision, above ~-6e-8 inf), the run blows up",
    why="TRL 0.8.2-0.26 compute ORPO's log odds with log1p(-exp(logp)) in the log-probs' dtype, which cancels to "
    "-inf when a response is very likely (bf16: logp -1e-4). The shim computes it as TRL 0.27 does: in float32 "
    "with a stable log1mexp.",
    requires={"trl": ">=0.8.2,<0.27.0"},
    fixed_in={"trl": "0.27.0"},
    refs=(
        "https://github.com/huggingface/trl/issues/3237",
        "https://github.com/huggingface/trl/pull/4763",
        "https://github.com/huggingface/trl/issues/2564",
        "https://github.com/huggingface/trl/issues/1473",
    ),
    backports=("https://github.com/huggingface/trl/pull/4763",),
    follow_ups_checked="ORPOTrainer.odds_ratio_loss and log1mexp read in trl 0.27.0, 0.27.2, 0.28.0, 0.29.1, 1.0.0, "
    "1.4.0, 1.9.0 and 1.16.0 (trl/experimental/orpo/orpo_trainer.py): identical to #4763's; trl#3237 and #2564 "
    "were answered with #4763, and no later change or regression report was found.",
    targets=(
        Target("trl.trainer.orpo_trainer", "ORPOTrainer.odds_ratio_loss", params=PARAMS, when="<0.26.0"),
        Target("trl.experimental.orpo.orpo_trainer", "ORPOTrainer.odds_ratio_loss", params=PARAMS, when=">=0.26.0"),
    ),
    modules=("trl",),
)

MODULES = ("trl.trainer.orpo_trainer", "trl.experimental.orpo.orpo_trainer")


def log1mexp(x):
    """``log(1 - exp(x))`` for ``x <= 0``: TRL 0.27.0's two branches (same branch point and operations), each
    fed only the inputs it is meant for, so that both are finite with finite gradients everywhere.

    ``torch.where`` differentiates both branches and multiplies the unused one's gradient by 0; 0.27.0's
    ``log1p(-exp(x))`` is ``-inf`` with an infinite gradient for float32 ``x`` above ~-3e-8 (``exp`` rounds to
    1), so the product is NaN there although that branch is not selected. Feeding the ``log1p`` branch ``x``
    only below ``-ln 2`` (``-ln 2`` elsewhere) and the ``log(-expm1)`` branch ``x`` only in ``[-ln 2, -tiny]``
    changes no selected value except ``x`` in ``(-tiny, 0]`` (``tiny``: the smallest normal float, 1.2e-38 in
    float32): 0.27.0 gives ``-inf`` at ``x = 0`` (an infinite log-odds, a NaN gradient), this gives
    ``log(tiny)`` (-87.3 in float32), finite. The inputs are chosen with ``torch.where``, not ``clamp``: from
    torch 2.14 ``clamp``'s gradient at its bounds is 0, which would zero TRL's finite gradient at ``-ln 2``
    and ``-tiny``; a selection passes every selected input's gradient through unchanged on every torch."""
    import torch

    tiny = torch.finfo(x.dtype).tiny if x.is_floating_point() else torch.finfo(torch.float32).tiny
    below = x < _LN2_NEG
    ln2 = torch.full_like(x, _LN2_NEG)
    small = torch.log1p(-torch.exp(torch.where(below, x, ln2)))
    large = torch.log(-torch.expm1(torch.where(below, ln2, torch.where(x > -tiny, torch.full_like(x, -tiny), x))))
    return torch.where(below, small, large)


def variant(func):
    """``(logsigmoid, item)`` of an unfixed ``odds_ratio_loss``: which of TRL's released bodies it is.

    0.8.2-0.10.x: ``torch.log(F.sigmoid(.))`` and ``.item()`` means; 0.11.x: the same with tensor
    means; 0.12.0-0.26.x: ``F.logsigmoid`` and tensor means. Raises TargetMissing when the code is
    not the cancelling formula (already fixed, or rewritten).
    """
    code = getattr(func, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    if "log1mexp" in names or not {"log1p", "exp", "beta", "accelerator"} <= names:
        raise TargetMissing("ORPOTrainer.odds_ratio_loss no longer computes log1p(-exp(logp)): fixed or changed")
    logsigmoid = "logsigmoid" in names
    if not logsigmoid and "sigmoid" not in names:
        raise TargetMissing("ORPOTrainer.odds_ratio_loss: neither logsigmoid nor log(sigmoid): changed")
    return logsigmoid, "item" in names


def make_odds_ratio_loss(logsigmoid: bool, item: bool, original):
    import torch
    import torch.nn.functional as F

    def odds_ratio_loss(self, policy_chosen_logps, policy_rejected_logps):
        if not (torch.is_tensor(policy_chosen_logps) and torch.is_tensor(policy_rejected_logps)):
            return original(self, policy_chosen_logps, policy_rejected_logps)  # not a shape TRL passes: untouched
        # TRL 0.27.0 (PR #4763): float32, and log(1 - exp(x)) without the cancellation near x = 0.
        policy_chosen_logps = policy_chosen_logps.float()
        policy_rejected_logps = policy_rejected_logps.float()
        log_odds = (policy_chosen_logps - policy_rejected_logps) - (
            log1mexp(policy_chosen_logps) - log1mexp(policy_rejected_logps)
        )
        # The rest as the installed version has it (log(sigmoid) before 0.12.0, .item() means before 0.11.0).
        ratio = F.logsigmoid(log_odds) if logsigmoid else torch.log(F.sigmoid(log_odds))
        losses = self.beta * ratio
        chosen_rewards = self.beta * (policy_chosen_logps.to(self.accelerator.device)).detach()
        rejected_rewards = self.beta * (policy_rejected_logps.to(self.accelerator.device)).detach()
        acted(SPEC.id, "odds-ratio losses computed stably in float32")
        if item:
            return losses, chosen_rewards, rejected_rewards, torch.mean(ratio).item(), torch.mean(log_odds).item()
        return losses, chosen_rewards, rejected_rewards, torch.mean(ratio), torch.mean(log_odds)

    odds_ratio_loss.__doc__ = getattr(original, "__doc__", None)
    odds_ratio_loss.__wrapped__ = original
    return odds_ratio_loss


def _defining_class(cls):
    """The class in ``cls``'s MRO whose body defines ``odds_ratio_loss``."""
    for klass in cls.__mro__:
        if "odds_ratio_loss" in vars(klass):
            return klass
    return None


def install(patcher, options) -> None:
    def part(module):
        cls = vars(module).get("ORPOTrainer")
        if not isinstance(cls, type):
            raise TargetMissing(f"{module.__name__}.ORPOTrainer is missing")
        owner = _defining_class(cls)
        if owner is None:
            raise TargetMissing(f"{module.__name__}.ORPOTrainer.odds_ratio_loss is missing")
        if owner is not cls:
            if owner.__module__ in MODULES:
                return  # a subclass of TRL's own ORPOTrainer (0.26's trl.trainer one): patched where it is defined
            raise TargetMissing(f"{module.__name__}.ORPOTrainer inherits odds_ratio_loss from {owner.__module__}")
        original = vars(cls)["odds_ratio_loss"]
        if not inspect.isfunction(original):
            raise TargetMissing(f"{module.__name__}.ORPOTrainer.odds_ratio_loss is not a plain method")
        params = list(inspect.signature(original).parameters)
        if params != ["self", *PARAMS]:
            raise TargetMissing(f"{module.__name__}.ORPOTrainer.odds_ratio_loss{tuple(params)}: changed signature")
        logsigmoid, item = variant(original)
        patcher.replace(cls, "odds_ratio_loss", make_odds_ratio_loss(logsigmoid, item, original))

    from packaging.version import Version

    from ..versions import installed_version

    # ORPO lives in trl.trainer before 0.26; 0.26.x defines it in trl.experimental (trl.trainer's is a subclass).
    experimental = Version(installed_version("trl") or "0") >= Version("0.26.0.dev0")
    patcher.when_imported(MODULES[1] if experimental else MODULES[0], part)


# ---------------------------------------------------------------------------
# Reproduction

# Relative error (vs float64 on the same rounded inputs) above which a log-odds or gradient counts as wrong.
# The old bf16 code was within 2.4e-2 on the log-probs tried from -0.3 to -5; the fixed one within 3e-3 (bf16 grads).
TOLERANCE = 5e-2


def orpo_class():
    try:
        from trl.trainer.orpo_trainer import ORPOTrainer
    except ImportError:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TRL's "importing from trl.experimental" notice, said by our probe
                from trl.experimental.orpo.orpo_trainer import ORPOTrainer
        except ImportError as exc:
            raise ProbeUnsupported(f"this TRL has no ORPOTrainer ({exc})") from None
    return ORPOTrainer


def bare_trainer(beta: float = 0.1):
    """An ``ORPOTrainer`` with only what ``odds_ratio_loss`` reads (``beta``, ``accelerator.device``)."""
    import types

    import torch

    trainer = object.__new__(orpo_class())
    trainer.beta = beta
    trainer.accelerator = types.SimpleNamespace(device=torch.device("cpu"))
    return trainer


def reference(chosen, rejected, beta: float = 0.1):
    """``(losses, log_odds, d loss/d chosen, d loss/d rejected)`` in float64 with ``log(-expm1(x))``."""
    import torch
    import torch.nn.functional as F

    c = chosen.detach().double().requires_grad_(True)
    r = rejected.detach().double().requires_grad_(True)
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))
    losses = beta * F.logsigmoid(log_odds)
    losses.sum().backward()
    return losses.detach(), log_odds.detach(), c.grad, r.grad


def _relerr(got, want) -> float:
    """Max relative error of ``got`` where the float64 reference is finite; inf when ``got`` is not finite
    anywhere (a log-prob of exactly 0 has an infinite reference log-odds: there only finiteness counts)."""
    got, want = got.detach().double(), want.double()
    if not bool(got.isfinite().all()):
        return math.inf
    finite = want.isfinite()
    if not bool(finite.any()):
        return 0.0
    return float(((got - want).abs() / want.abs().clamp_min(1e-30))[finite].max())


def probe(dtype: str = "bfloat16", chosen=(-1e-4, -2.0), rejected=(-1e-3, -3.0)) -> Observation:
    """Call ``ORPOTrainer.odds_ratio_loss`` on a bare trainer with the given per-example policy
    log-probs (``dtype`` "bfloat16" or "float32") and backpropagate the loss sum. The bug: a
    non-finite loss, log-odds or gradient, or one off the float64 value by more than 5 %."""
    import torch

    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    trainer = bare_trainer()
    c = torch.tensor(chosen, dtype=dt, requires_grad=True)
    r = torch.tensor(rejected, dtype=dt, requires_grad=True)
    losses, _, _, _, mean_log_odds = type(trainer).odds_ratio_loss(trainer, c, r)
    losses.sum().backward()
    ref_losses, ref_log_odds, ref_gc, ref_gr = reference(c, r)
    mean_log_odds = float(mean_log_odds.detach() if torch.is_tensor(mean_log_odds) else mean_log_odds)
    errors = {
        "loss": _relerr(losses, ref_losses),
        "log_odds": _relerr(torch.tensor(mean_log_odds), ref_log_odds.mean()),
        "grad_chosen": _relerr(c.grad, ref_gc),
        "grad_rejected": _relerr(r.grad, ref_gr),
    }
    bad = {k: v for k, v in errors.items() if not v <= TOLERANCE}
    detail = (
        f"{dtype} logps chosen {list(chosen)} rejected {list(rejected)}: loss {[round(v, 8) for v in losses.tolist()]} "
        f"({losses.dtype}) vs float64 {[round(v, 8) for v in ref_losses.tolist()]}; mean log_odds {mean_log_odds:.6g} "
        f"vs {float(ref_log_odds.mean()):.6g}; grad chosen {c.grad.tolist()} "
        f"vs {[round(v, 4) for v in ref_gc.tolist()]}; "
        "max relative error " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
    )
    if bad:
        return Observation(True, detail + f" -> wrong: {', '.join(bad)}")
    return Observation(False, detail)
