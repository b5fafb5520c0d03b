"""TRL 0.27+ ORPO: NaN gradients for float32 log-probs above ~-3e-8, and an infinite log-odds at 0.

Why: TRL PR #4763 (first released in 0.27.0) fixed ORPO's catastrophic cancellation by computing the
log odds ratio in float32 with a two-branch ``log1mexp`` (module level in
``trl/experimental/orpo/orpo_trainer.py``, lines 78-82 in 0.28.0-1.0.0, 88-92 in 1.12.0-1.16.0)::

    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))   # t = -ln 2

``torch.where`` differentiates *both* branches and multiplies the unused one's gradient by 0. For a float32
log-prob ``x`` above ~-3e-8 (probability within 3e-8 of 1, a response the policy has memorised: common for
short chosen answers late in ORPO training) ``exp(x)`` rounds to 1, the unused ``log1p(-exp(x))`` branch is
``-inf`` with an infinite derivative, and ``0 * inf`` is NaN: the forward values are right, the gradient of
``odds_ratio_loss`` with respect to that log-prob is NaN, and one such example makes the step's gradients NaN.
At ``x = 0`` exactly (every token of the response at float32 probability 1) the used branch is ``log(0) = -inf``
too: the log-odds is ``+inf`` (chosen) or ``-inf`` (rejected: the loss is ``-inf``), and the gradient NaN.
Measured on TRL 1.16.0 (``odds_ratio_loss`` on a bare trainer, beta 0.1): chosen log-prob -1e-8 -> gradient
NaN (-5e-8: 99.94, finite); chosen 0 -> mean log-odds inf, gradient NaN. Unfixed in TRL 1.16.0, the newest
release (the same lines in 0.27.0, 0.27.2, 0.28.0, 0.29.1, 1.0.0, 1.4.0, 1.9.0, 1.12.0 and 1.16.0).

The fix: replace the module-level ``log1mexp`` of ``trl.experimental.orpo.orpo_trainer`` (``odds_ratio_loss``
looks it up there at each call) with ``trl_orpo_log_odds_nan.log1mexp``: the same two branches, each clamped
to its own domain (``x <= -ln 2`` for ``log1p(-exp(x))``, ``-ln 2 <= x <= -tiny`` for ``log(-expm1(x))``), so
neither is ever evaluated where it is infinite. Every forward value is bit-identical to TRL's except for ``x``
in ``(-tiny, 0]`` (``tiny`` = 1.2e-38, the smallest normal float32; in practice ``x = 0``), which gets
``log(tiny)`` = -87.3 instead of ``-inf``: a finite log-odds of about 87 (the loss there is 0 to float32
precision, as the limit is) and a finite gradient. Gradients everywhere else are TRL's (finite ones
bit-identical).

Applies to trl >=0.27.0 (the first release with ``log1mexp``). Fallback: a module without a ``log1mexp(x)``
function, or one whose code already clamps or no longer branches with ``torch.where`` (fixed or changed
upstream), is left alone (target missing); a ``log1mexp`` another library replaced is left to it. TRL 0.8.2-
0.26.x, where the whole formula cancels, is ``trl_orpo_log_odds_nan``'s (which carries this clamp too).
"""

from __future__ import annotations

import inspect
import sys

from .._util import acted, compiling
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

MODULE = "trl.experimental.orpo.orpo_trainer"

SPEC = ShimSpec(
    id="trl_orpo_log1mexp_nan_grad",
    since="0.2.0",
    title="TRL 0.27+ ORPO: NaN gradient for float32 log-probs above ~-3e-8, infinite log-odds at 0",
    symptom="ORPOTrainer (TRL 0.27.0-1.16.0): a response whose average log-prob is above ~-3e-8 in float32 (the "
    "policy gives it probability ~1) makes the gradient of the odds-ratio loss NaN although the loss is finite; at "
    "exactly 0 the log-odds is inf and the gradient NaN: the step's gradients become NaN",
    why="TRL 0.27's log1mexp computes both branches of torch.where(x < -ln2, log1p(-exp(x)), log(-expm1(x))) for "
    "every x; near 0 the unused log1p branch is -inf and its zero-weighted gradient is NaN, and at 0 the used "
    "branch is -inf. The shim clamps each branch to its own domain: same forward values, finite gradients.",
    requires={"trl": ">=0.27.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/pull/4763",
        "https://github.com/huggingface/trl/issues/3237",
        "https://github.com/pytorch/pytorch/issues/52248",
    ),
    targets=(Target(MODULE, "log1mexp", params=("x",)),),
    modules=(MODULE,),
)


def _upstream_unclamped(func) -> bool:
    """TRL 0.27.0-1.16.0's ``log1mexp``: ``torch.where`` over ``log1p(-exp(x))`` and ``log(-expm1(x))``, no clamp."""
    code = getattr(func, "__code__", None)
    names = set(code.co_names) if code is not None else set()
    return {"where", "log1p", "exp", "expm1", "log"} <= names and not names & {"clamp", "clamp_min", "clamp_max",
                                                                                 "clip", "nan_to_num"}


def _stable_log1mexp():
    from .trl_orpo_log_odds_nan import log1mexp as clamped

    def log1mexp(x):
        if not compiling():
            acted(SPEC.id, "log(1 - exp(x)) calls computed with clamped branches")
        return clamped(x)

    return log1mexp


def install(patcher, options) -> None:
    from ..foreign import foreign_origin

    module = sys.modules[MODULE]
    original = vars(module).get("log1mexp")
    if not inspect.isfunction(original):
        raise TargetMissing(f"{MODULE}.log1mexp is missing")
    if list(inspect.signature(original).parameters) != ["x"]:
        raise TargetMissing(f"{MODULE}.log1mexp{tuple(inspect.signature(original).parameters)}: changed signature")
    origin = foreign_origin(module, original, ("trl",))
    if origin:
        raise TargetMissing(f"{MODULE}.log1mexp was replaced by {origin}; left to it")
    if not _upstream_unclamped(original):
        raise TargetMissing(f"{MODULE}.log1mexp no longer branches unclamped with torch.where: fixed or changed")
    replacement = _stable_log1mexp()
    replacement.__doc__ = original.__doc__
    replacement.__wrapped__ = original
    patcher.replace(module, "log1mexp", replacement)


# ---------------------------------------------------------------------------
# Reproduction


def probe(dtype: str = "float32", chosen=(-1e-8, 0.0, -2.0), rejected=(-1e-3, -1e-3, -3.0)) -> Observation:
    """``ORPOTrainer.odds_ratio_loss`` on a bare trainer, loss summed and backpropagated
    (``trl_orpo_log_odds_nan.probe``): float32 log-probs -1e-8 and 0 for the chosen responses. The bug: a
    non-finite loss, log-odds or gradient, or one off the float64 value by more than 5 % where that is finite."""
    from ..versions import installed_version, older_than
    from . import trl_orpo_log_odds_nan

    if older_than(installed_version("trl") or "0", "0.27.0"):
        # before 0.27 the whole formula cancels: trl_orpo_log_odds_nan's bug, which this probe would show too
        raise ProbeUnsupported("trl < 0.27: no log1mexp (the cancelling formula is trl_orpo_log_odds_nan's)")
    return trl_orpo_log_odds_nan.probe(dtype=dtype, chosen=chosen, rejected=rejected)
