"""TRL 0.7.5-0.7.10 ``DPOTrainer(loss_type="ipo")`` computes the IPO loss from *summed* sequence log-probs.

Why: IPO entered TRL in 0.7.5 (PR #1022) as one more branch of ``DPOTrainer.dpo_loss``:
``losses = (logits - 1 / (2 * beta)) ** 2`` with ``logits`` the policy/reference log-ratio margin. The
log-probs it is fed come from ``concatenated_forward``, which calls the static ``get_batch_logps(...,
average_log_prob=False)`` for every loss type (0.7.10 ``trl/trainer/dpo_trainer.py`` line 969): the sum of the
completion's token log-probs. The IPO target margin ``1/(2*beta)`` is then compared with a quantity that grows
with the completion's length, so what ``beta`` means depends on how long the answers are (a 40-token and a
400-token dataset need betas ten times apart). After the IPO authors pointed this out, TRL 0.7.11 (PR #1265,
HF "pref-tuning" blog erratum) passes ``average_log_prob=self.loss_type == "ipo"``: IPO works on the per-token
*average*, every other loss type keeps the sum. (Whether the paper's pi(y|x) "is" the average is debated in
trl#1677; TRL has defined TRL's IPO by the average ever since, and this shim makes 0.7.5-0.7.10 agree with that
definition, so that a beta tuned on any later TRL means the same thing here.)

The fix, 0.7.11's: wrap ``DPOTrainer.concatenated_forward`` and, for a trainer whose ``loss_type`` is
``"ipo"``, make the ``DPOTrainer.get_batch_logps`` call inside it average: its sums divided by the number of
scored labels, counted as ``get_batch_logps`` counts them, which is ``average_log_prob=True`` bit for bit except
for a completion with no scored label (see Follow-ups). The two
wraps talk through a ``ContextVar`` set only for the duration of that one ``concatenated_forward`` call, so
concurrent trainers in other threads (or a sigmoid trainer nested inside) are not affected, and nothing is
written on the trainer. Policy *and* reference log-probs go through ``concatenated_forward`` (also when
``precompute_ref_log_probs=True`` computes them up front), so both sides of the margin are averaged, as in
0.7.11. Every other loss type (sigmoid, hinge, kto_pair) takes the untouched path: bit-identical.

Subclasses: one that overrides ``concatenated_forward`` without calling ``super()`` never reaches the wrap and
keeps its own behaviour; one that calls ``super()`` gets the fix. One that overrides ``get_batch_logps`` (or sets
it on the instance) decides itself how log-probs are reduced: the shim cannot tell what its override does with
the flag, so it passes through and says so once per class.

Applies to trl >=0.7.5,<0.7.11 (0.7.4 has no ``loss_type`` at all). Fallback: a DPOTrainer without the static
``get_batch_logps(logits, labels, average_log_prob, ...)`` or ``concatenated_forward(model, batch)`` is skipped
(target missing). Precomputed reference log-probs stored in a dataset by an unshimmed run are sums and are used
as they are: recompute them with the shim applied.

Follow-ups: trl#1033 (the per-token average of a completion with no scored label is 0/0 = NaN, which makes
the loss and every gradient NaN; TRL 0.29.0 divides by clamp(count, min=1)) — carried. In 0.7.5-0.7.10 every
response ends in EOS, so an empty completion needs max_prompt_length >= max_length (truncation cuts every
response away) or a custom collator; the summed version gave such a row 0, 0.7.11 gives NaN, this shim (since
ftshims 0.2.0) gives 0 as TRL 0.29.0 does. The IPO branch read in trl 0.7.11, 0.8.0, 0.8.6, 0.9.6, 0.12.0,
0.23.1-0.28.0 and 0.29.1-1.16.0: IPO keeps the per-token average throughout (0.9: / size_completion;
0.12-0.28: / loss_mask.sum(-1); 0.29+: / clamp(min=1)); trl#1677 questions the average, and TRL kept it
(1.16.0: confirmed with the IPO authors).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import re
import sys
import typing

from .._util import acted, warn_once
from ..spec import FollowUp, Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="trl_ipo_summed_logps",
    since="0.2.0",
    title="DPOTrainer's IPO loss uses summed instead of length-averaged log-probs",
    symptom='DPOTrainer(loss_type="ipo") compares the summed completion log-prob margin with 1/(2*beta): the '
    "effective beta depends on completion length, and betas tuned on TRL >=0.7.11 mean something else",
    why="TRL 0.7.5-0.7.10 feed IPO's squared loss (logits - 1/(2*beta))**2 with summed sequence log-probs; TRL "
    "0.7.11 averages them over the completion's tokens for IPO only. The shim makes the IPO path average as 0.7.11 "
    "does (a completion with no scored label gives 0, not NaN, as in 0.29.0) and leaves the other loss types "
    "untouched.",
    requires={"trl": ">=0.7.5,<0.7.11"},
    fixed_in={"trl": "0.7.11"},
    refs=(
        "https://github.com/huggingface/trl/pull/1265",
        "https://github.com/huggingface/trl/pull/1022",
        "https://github.com/huggingface/blog/pull/1785",
        "https://github.com/huggingface/trl/issues/1677",
        "https://github.com/huggingface/trl/issues/1033",
    ),
    backports=("https://github.com/huggingface/trl/pull/1265",),
    follow_ups=(
        FollowUp("https://github.com/huggingface/trl/issues/1033", "the per-token average of a completion with no "
                 "scored label is 0/0 = NaN, which makes the loss and every gradient NaN; TRL 0.29.0 divides by "
                 "clamp(count, min=1)", carried=True),
    ),
    follow_ups_checked="The IPO branch read in trl 0.7.11, 0.8.0, 0.8.6, 0.9.6, 0.12.0, 0.23.1-0.28.0 and "
    "0.29.1-1.16.0: IPO keeps the per-token average throughout (0.9: / size_completion; 0.12-0.28: / "
    "loss_mask.sum(-1); 0.29+: / clamp(min=1)); trl#1677 questions the average, and TRL kept it (1.16.0: confirmed "
    "with the IPO authors).",
    targets=(
        Target("trl.trainer.dpo_trainer", "DPOTrainer.concatenated_forward", params=("model", "batch")),
        Target("trl.trainer.dpo_trainer", "DPOTrainer.get_batch_logps", params=("logits", "labels", "average_log_prob")),
    ),
    modules=("trl.trainer.dpo_trainer",),
)

log = logging.getLogger("ftshims")

# True while DPOTrainer.concatenated_forward runs for an IPO trainer whose get_batch_logps is DPOTrainer's.
# A ContextVar, not a flag on the trainer: per thread (and per asyncio task), nothing written on the user's object.
_AVERAGE = contextvars.ContextVar("ftshims_trl_ipo_average", default=False)

_SAID: set = set()


def _defining_class(cls, name):
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass
    return None


def install(patcher, options) -> None:
    from ..spec import TargetMissing

    module = sys.modules["trl.trainer.dpo_trainer"]
    cls = getattr(module, "DPOTrainer", None)
    if cls is None:
        raise TargetMissing("trl.trainer.dpo_trainer.DPOTrainer is missing")
    own = vars(cls)
    if "concatenated_forward" not in own or not isinstance(own.get("get_batch_logps"), staticmethod):
        raise TargetMissing("DPOTrainer has no concatenated_forward or no static get_batch_logps")
    params = list(inspect.signature(own["get_batch_logps"].__func__).parameters)
    if params[:3] != ["logits", "labels", "average_log_prob"]:
        raise TargetMissing(f"DPOTrainer.get_batch_logps{tuple(params)}: not (logits, labels, average_log_prob, ...)")
    signature = inspect.signature(own["get_batch_logps"].__func__)

    def concatenated_forward(wrapped, instance, args, kwargs):
        average = getattr(instance, "loss_type", None) == "ipo"
        if average and ("get_batch_logps" in vars(instance)
                        or _defining_class(type(instance), "get_batch_logps") is not cls):
            # The subclass reduces log-probs its own way: whether it honours average_log_prob is its business.
            average = False
            warn_once(_SAID, type(instance), lambda: log.warning(
                "trl_ipo_summed_logps: %s overrides get_batch_logps; its IPO log-probs are left as it computes them "
                "(TRL <0.7.11 passes average_log_prob=False, 0.7.11 passes True for IPO)", type(instance).__qualname__))
        token = _AVERAGE.set(average)  # set False too: a sigmoid trainer nested in an IPO call stays summed
        try:
            return wrapped(*args, **kwargs)
        finally:
            _AVERAGE.reset(token)

    def get_batch_logps(wrapped, instance, args, kwargs):
        if not _AVERAGE.get():
            return wrapped(*args, **kwargs)
        try:
            call = signature.bind(*args, **kwargs)
        except TypeError:
            return wrapped(*args, **kwargs)  # upstream's own error for a call it cannot take
        call.apply_defaults()
        if call.arguments["average_log_prob"]:
            return wrapped(*args, **kwargs)  # an explicit True (TRL passes False) is left to the caller
        # TRL computes the sums; divide them by the number of scored labels, counted as get_batch_logps counts them
        # (labels shifted by one for decoder-only models). That is 0.7.11's average_log_prob=True bit for bit, except
        # that a completion with no scored label gives its sum, 0, instead of 0/0 = NaN (trl#1033): TRL 0.29.0
        # divides by clamp(min=1) the same way.
        summed = wrapped(*args, **kwargs)
        labels = call.arguments["labels"]
        if not call.arguments.get("is_encoder_decoder", False):
            labels = labels[:, 1:]
        scored = (labels != call.arguments.get("label_pad_token_id", -100)).sum(-1)
        acted(SPEC.id, "IPO log-probs averaged")
        return summed / scored.clamp(min=1).to(summed.device)

    patcher.wrap(cls, "concatenated_forward", concatenated_forward)
    patcher.wrap(cls, "get_batch_logps", get_batch_logps)


# ---------------------------------------------------------------------------
# Reproduction

_WORDS = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(20)]

# prompt, chosen, rejected: completions of 1 to 6 words, so summed and averaged log-probs differ row by row
ROWS = [
    ("w0 w1", " w2", " w3 w4 w5 w6 w7 w8"),
    ("w9 w10 w11", " w12 w13 w14 w15", " w16 w17"),
]


def tokenizer():
    """A WordLevel tokenizer whose pad/bos/eos ids (0/1/2) match ``ftshims.tiny.TINY_LLAMA``."""
    from ..tiny import word_tokenizer

    return word_tokenizer(_WORDS, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def trainer(loss_type: str, output_dir: str, beta: float = 0.5):
    """A DPOTrainer(loss_type=...) on two tiny random Llamas (policy, reference) and the ``ROWS`` dataset."""
    try:
        from trl import DPOTrainer
    except ImportError:
        raise ProbeUnsupported("this TRL has no DPOTrainer") from None
    init = inspect.signature(DPOTrainer.__init__).parameters
    if "loss_type" not in init or "tokenizer" not in init:
        raise ProbeUnsupported("this TRL's DPOTrainer takes no loss_type/tokenizer keyword (the 0.7-0.11 API)")
    annotation = init["loss_type"].annotation
    declared = typing.get_args(annotation)  # Literal[...] on 0.7.x-0.11
    if isinstance(annotation, str):  # postponed annotations: read the names from the text
        declared = tuple(re.findall(r"[\"']([a-z_]+)[\"']", annotation))
    if declared and loss_type not in declared:
        # TRL 0.7.4 declares Literal["sigmoid", "hinge"]: IPO arrived in 0.7.5 (PR #1022)
        raise ProbeUnsupported(f"this TRL's DPOTrainer has no loss_type {loss_type!r} ({annotation})")
    if not isinstance(inspect.getattr_static(DPOTrainer, "get_batch_logps", None), staticmethod):
        raise ProbeUnsupported("this TRL's DPOTrainer has no static get_batch_logps (the 0.7-0.8 API)")
    import datasets
    import trl
    from transformers import TrainingArguments

    from ..tiny import quiet, tiny_llama

    # TRL 0.9-0.11 want a DPOConfig (a TrainingArguments) as args; the keywords below still override it there
    TrainingArguments = getattr(trl, "DPOConfig", TrainingArguments)  # noqa: N806

    data = datasets.Dataset.from_list([{"prompt": p, "chosen": c, "rejected": r} for p, c, r in ROWS])
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=len(ROWS), remove_unused_columns=False,
                  report_to=[])
    targs = inspect.signature(TrainingArguments.__init__).parameters
    kwargs["use_cpu" if "use_cpu" in targs else "no_cuda"] = True
    with quiet():
        datasets.disable_progress_bar()
        return DPOTrainer(tiny_llama(seed=0), tiny_llama(seed=1), beta=beta, loss_type=loss_type,
                          args=TrainingArguments(**kwargs), train_dataset=data, tokenizer=tokenizer(),
                          max_length=32, max_prompt_length=16)


def own_logps(model, batch, side: str):
    """(summed, averaged, completion lengths) of ``side``'s completion log-probs, computed here row by row."""
    import torch

    ids, mask, labels = (batch[f"{side}_{k}"] for k in ("input_ids", "attention_mask", "labels"))
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    scored = target != -100
    token = torch.gather(logits.log_softmax(-1), 2, target.clamp(min=0).unsqueeze(2)).squeeze(2) * scored
    lengths = scored.sum(-1)
    return token.sum(-1), token.sum(-1) / lengths, lengths


def probe(loss_type: str = "ipo") -> Observation:
    """Run ``concatenated_forward`` and ``get_batch_loss_metrics`` of a ``DPOTrainer(loss_type=...)`` on two rows
    whose completions have 1-6 tokens: are the log-probs it uses the ones its loss is defined on (per-token
    averages for IPO as TRL >=0.7.11 defines it, sums for every other loss type)?"""
    import tempfile

    import torch

    from ..tiny import quiet

    with tempfile.TemporaryDirectory() as out:
        dpo = trainer(loss_type, out)
        batch = dpo.data_collator([dpo.train_dataset[i] for i in range(len(ROWS))])
        policy, ref = dpo.model.eval(), dpo.ref_model.eval()
        with torch.no_grad(), quiet():
            result = dpo.concatenated_forward(policy, batch)
            loss, _ = dpo.get_batch_loss_metrics(policy, batch)
    chosen, rejected = (result["chosen_logps"], result["rejected_logps"]) if isinstance(result, dict) else result[:2]
    pc_sum, pc_avg, c_len = own_logps(policy, batch, "chosen")
    pr_sum, pr_avg, r_len = own_logps(policy, batch, "rejected")
    rc_sum, rc_avg, _ = own_logps(ref, batch, "chosen")
    rr_sum, rr_avg, _ = own_logps(ref, batch, "rejected")
    averaged = loss_type == "ipo"  # the definition since TRL 0.7.11
    want_c, want_r = (pc_avg, pr_avg) if averaged else (pc_sum, pr_sum)
    used = torch.cat([chosen.float(), rejected.float()])
    ok_logps = torch.allclose(used, torch.cat([want_c, want_r]), rtol=1e-4, atol=1e-5)
    saw_sums = torch.allclose(used, torch.cat([pc_sum, pr_sum]), rtol=1e-4, atol=1e-5)
    words = (f"loss_type={loss_type}, completion lengths chosen {c_len.tolist()} rejected {r_len.tolist()}; "
             f"chosen logps used {_fmt(chosen)} (own sums {_fmt(pc_sum)}, own averages {_fmt(pc_avg)}); "
             f"rejected logps used {_fmt(rejected)} (sums {_fmt(pr_sum)}, averages {_fmt(pr_avg)})")
    if loss_type == "ipo":
        margin = lambda pc, pr, rc, rr: ((pc - pr) - (rc - rr) - 1 / (2 * dpo.beta)) ** 2  # noqa: E731
        on_avg = margin(pc_avg, pr_avg, rc_avg, rr_avg).mean()
        on_sum = margin(pc_sum, pr_sum, rc_sum, rr_sum).mean()
        ok_loss = torch.allclose(loss.float(), on_avg, rtol=1e-4, atol=1e-5)
        words += (f"; IPO loss {float(loss):.5f} (on averages {float(on_avg):.5f}, on sums {float(on_sum):.5f}, "
                  f"beta={dpo.beta})")
    else:
        ok_loss = True
    if ok_logps and ok_loss:
        return Observation(False, f"log-probs as the loss defines them ({'averaged' if averaged else 'summed'}): "
                                  + words)
    what = "summed log-probs fed to the IPO loss" if averaged and saw_sums else "log-probs not as the loss defines them"
    return Observation(True, f"{what}: " + words)


def _fmt(t) -> str:
    return "[" + ", ".join(f"{float(v):.4f}" for v in t.detach().flatten()) + "]"

