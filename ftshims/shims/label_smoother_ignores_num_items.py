"""``Trainer`` label smoothing multiplies the loss by the gradient-accumulation steps for models with loss kwargs.

Why: with ``label_smoothing_factor > 0`` the Trainer pops the labels and computes the loss itself with its
``LabelSmoother``, which averages over the micro-batch's tokens. For a model the Trainer counts as taking loss kwargs
(``model_accepts_loss_kwargs``: every Llama-style causal LM, and any head whose ``forward`` declares ``**kwargs``)
``training_step`` does not divide by the accumulation steps, because it expects a loss normalised by
``num_items_in_batch`` over the whole accumulated batch; and with ``average_tokens_across_devices`` ``compute_loss``
multiplies by the number of processes. The smoother never received ``num_items_in_batch``, so the loss and the
gradients are N times too large at N accumulation steps (and times the number of processes): label smoothing on a
Llama with ``gradient_accumulation_steps=4`` logs 18.44 instead of 4.61 (transformers#46731). 5.15.0 (PR #47261)
gives ``LabelSmoother.__call__`` a ``num_items_in_batch`` argument (sum over the tokens, divided by it) and passes it
from ``compute_loss``.

The backport: the shim wraps ``Trainer.compute_loss`` and, while it runs for a trainer with a ``LabelSmoother``, no
``compute_loss_func``, ``model_accepts_loss_kwargs`` and a ``num_items_in_batch``, notes that count for that trainer's
smoother in a thread-local; a wrapper on ``LabelSmoother.__call__`` then computes 5.15.0's loss with it (the same
expression, copied from 5.15.0's ``trainer_pt_utils.py``). Everything else calls the installed smoother unchanged:
no count (models without loss kwargs, whose loss the Trainer divides by the accumulation steps itself), a subclass of
``LabelSmoother``, calls outside ``compute_loss`` and nested trainers (the mark is per smoother and restored).
TRL's ``SFTTrainer`` from 1.15.0 (its fused LM head gives no full logits) calls ``self.label_smoother`` in its own
``compute_loss``, which never reaches ``Trainer.compute_loss``, and passes the count only from transformers 5.15.0: the
same wrapper marks the count for ``SFTTrainer.compute_loss`` (installed when ``trl.trainer.sft_trainer`` is imported,
TRL >= 1.15.0 only; older SFTTrainers smooth inside ``Trainer.compute_loss``). SFT, 4 rows on a tiny Llama, lr 0,
TRL 1.16.0 + transformers 4.57.6: loss 4.170 / 8.341 / 16.68 at 1 / 2 / 4 accumulation steps without it, 4.170 at
all three with it and ``num_items_in_batch_overcount`` (transformers 5.25.0 gives 4.170 everywhere).
With ``label_smoothing_peft_unshifted`` (prefix-tuned PEFT models) the two compose: this shim comes first in
SHIM_IDS, so its smoother layer is the inner one and sees the shifted, padded labels that shim passes on; applied the
other way round (two ``apply()`` calls), this shim leaves such a call to the other one.

Applies to transformers >=4.48.1,<5.15.0: 4.48.1 is the first release whose ``training_step`` skips the division for
models with loss kwargs whatever the loss (4.46.0-4.48.0 had their own scaling bugs, see the advisories
``ga_loss_scaling_4_46`` to ``ga_loss_scaling_4_48_0``); read in 4.48.1, 4.52.4, 4.57.6, 5.9.0 and 5.14.1 (bug) and
5.15.0, 5.16.1, 5.24.0, 5.25.0 (fixed). The count the smoother divides by is the one the installed Trainer computes;
on 4.57-5.10.0 ``num_items_in_batch_overcount`` makes it the labels the shifted loss scores, as 5.10.1+ count.

Follow-ups: none. The fix carried is #47261 (5.15.0). LabelSmoother.__call__ and compute_loss's two label_smoother
calls are identical in 5.15.0, 5.16.1, 5.24.0 and 5.25.0 (read); no revert or regression report found.
"""

from __future__ import annotations

import sys
import threading

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target
from . import _packing

SPEC = ShimSpec(
    id="label_smoother_ignores_num_items",
    since="0.2.0",
    title="Trainer label smoothing ignores num_items_in_batch: loss and gradients x gradient_accumulation_steps for "
    "models with loss kwargs",
    symptom="label_smoothing_factor > 0 with gradient_accumulation_steps = N on a Llama-style causal LM (or any model "
    "whose forward takes **kwargs): logged loss and gradients N times too large (18.44 instead of 4.61 at N = 4), "
    "max_grad_norm clips N times too early; also times the number of processes with average_tokens_across_devices",
    why="The Trainer skips the division by the accumulation steps for models that take loss kwargs, expecting a loss "
    "normalised by num_items_in_batch, but its LabelSmoother averaged per micro-batch and never got the count. "
    "The shim hands the count to the smoother as 5.15.0 does (PR #47261).",
    requires={"transformers": ">=4.48.1,<5.15.0"},
    fixed_in={"transformers": "5.15.0"},
    refs=(
        "https://github.com/huggingface/transformers/issues/46731",
        "https://github.com/huggingface/transformers/pull/47261",
        "https://github.com/huggingface/transformers/pull/46734",
    ),
    backports=("https://github.com/huggingface/transformers/pull/47261",),
    follow_ups_checked="LabelSmoother.__call__ and compute_loss's two label_smoother calls are identical in 5.15.0, "
    "5.16.1, 5.24.0 and 5.25.0 (read); no revert or regression report found.",
    targets=(
        Target("transformers.trainer", "Trainer.compute_loss", params=("model", "inputs", "num_items_in_batch")),
        Target("transformers.trainer_pt_utils", "LabelSmoother.__call__", params=("model_output", "labels",
                                                                                 "shift_labels")),
    ),
    modules=("transformers.trainer", "transformers.trainer_pt_utils"),
)

# id(smoother) -> the num_items_in_batch its trainer's compute_loss is running with, per thread.
_STATE = threading.local()


def _marks() -> dict:
    marks = getattr(_STATE, "marks", None)
    if marks is None:
        marks = _STATE.marks = {}
    return marks


def _compute_loss(wrapped, instance, args, kwargs):
    smoother = getattr(instance, "label_smoother", None)
    count = args[3] if len(args) > 3 else kwargs.get("num_items_in_batch")
    labels_cls = getattr(sys.modules.get("transformers.trainer_pt_utils"), "LabelSmoother", None)
    if (smoother is None or count is None or type(smoother) is not labels_cls
            or getattr(instance, "compute_loss_func", None) is not None
            or not getattr(instance, "model_accepts_loss_kwargs", False)):
        return wrapped(*args, **kwargs)
    marks = _marks()
    key = id(smoother)
    had, previous = key in marks, marks.get(key)
    marks[key] = count
    try:
        return wrapped(*args, **kwargs)
    finally:
        if had:
            marks[key] = previous
        else:
            marks.pop(key, None)


def smoothed_loss(smoother, model_output, labels, shift_labels, num_items_in_batch):
    """``LabelSmoother.__call__`` of transformers 5.15.0 with its ``num_items_in_batch`` (trainer_pt_utils.py)."""
    import torch
    from torch import nn

    logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
    if shift_labels:
        logits = logits[..., :-1, :].contiguous()
        labels = labels[..., 1:].contiguous()

    log_probs = -nn.functional.log_softmax(logits, dim=-1)
    if labels.dim() == log_probs.dim() - 1:
        labels = labels.unsqueeze(-1)

    padding_mask = labels.eq(smoother.ignore_index)
    labels = torch.clamp(labels, min=0)
    nll_loss = log_probs.gather(dim=-1, index=labels)
    smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)

    nll_loss.masked_fill_(padding_mask, 0.0)
    smoothed.masked_fill_(padding_mask, 0.0)

    if torch.is_tensor(num_items_in_batch):
        denominator = num_items_in_batch.to(nll_loss.device)
    else:
        denominator = num_items_in_batch
    nll_loss = nll_loss.sum() / denominator
    smoothed = smoothed.sum() / (denominator * log_probs.shape[-1])
    return (1 - smoother.epsilon) * nll_loss + smoother.epsilon * smoothed


def _smoother_call(wrapped, instance, args, kwargs):
    count = _marks().get(id(instance))
    if count is None:
        return wrapped(*args, **kwargs)
    names = ("model_output", "labels", "shift_labels")
    call = dict(zip(names, args))
    call.update(kwargs)
    if set(call) - set(names) or "model_output" not in call or "labels" not in call:
        return wrapped(*args, **kwargs)  # a call this version's signature does not describe: leave it alone
    if not call.get("shift_labels") and _peft_shim_will_shift(instance):
        # label_smoothing_peft_unshifted sits inside this layer (applied after this shim, out of SHIM_IDS order) and
        # would shift and pad these labels: its loss is the right one to keep, scaled as upstream scales it
        return wrapped(*args, **kwargs)
    acted(SPEC.id, "smoothed losses normalised by num_items_in_batch")
    return smoothed_loss(instance, call["model_output"], call["labels"], call.get("shift_labels", False), count)


def _peft_shim_will_shift(smoother) -> bool:
    """Whether ``label_smoothing_peft_unshifted`` marked this smoother for the current compute_loss call. Applied in
    SHIM_IDS order its layer is outside this one and has already set shift_labels=True by the time this one runs."""
    other = sys.modules.get("ftshims.shims.label_smoothing_peft_unshifted")
    state = getattr(other, "_STATE", None)
    return state is not None and getattr(state, "smoother", None) is smoother


# TRL's SFTTrainer calls its label smoother itself, without the count below transformers 5.15.0, from this release.
TRL_SFT_SMOOTHS_ITSELF = "1.15.0"
COMPUTE_LOSS_PARAMS = ("model", "inputs", "return_outputs", "num_items_in_batch")


def _sft_part(patcher):
    """Mark the count for ``trl.SFTTrainer.compute_loss`` too (TRL >= 1.15.0, which no longer calls
    ``Trainer.compute_loss`` on its label-smoothing path); on older TRL the Trainer's wrapper already sees it."""
    import inspect

    from packaging.version import InvalidVersion, Version

    from ..spec import TargetMissing
    from ..versions import installed_version

    def install_part(module):
        try:
            version = Version(installed_version("trl") or "0")
        except InvalidVersion:
            raise TargetMissing("trl's version is not PEP 440: its SFTTrainer is left alone") from None
        if version < Version(TRL_SFT_SMOOTHS_ITSELF):
            return  # SFTTrainer's label smoothing runs inside Trainer.compute_loss, wrapped above
        cls = vars(module).get("SFTTrainer")
        method = vars(cls).get("compute_loss") if isinstance(cls, type) else None
        if not inspect.isfunction(method):
            raise TargetMissing("trl.trainer.sft_trainer.SFTTrainer.compute_loss is missing")
        params = tuple(inspect.signature(method).parameters)[1:5]
        if params != COMPUTE_LOSS_PARAMS:
            raise TargetMissing(f"SFTTrainer.compute_loss{params}: not {COMPUTE_LOSS_PARAMS}")
        patcher.wrap(cls, "compute_loss", _compute_loss)

    return install_part


def install(patcher, options) -> None:
    trainer = sys.modules["transformers.trainer"]
    pt_utils = sys.modules["transformers.trainer_pt_utils"]
    patcher.wrap(trainer.Trainer, "compute_loss", _compute_loss)
    patcher.wrap(pt_utils.LabelSmoother, "__call__", _smoother_call)
    patcher.when_imported("trl.trainer.sft_trainer", _sft_part(patcher))


# ---------------------------------------------------------------------------
# Reproduction

def first_step(batch_size: int, accumulation: int, smoothing: float = 0.1, trainer: str = "trainer"):
    """The logged loss and the accumulated gradients of one Trainer step (learning rate 0) on a tiny Llama;
    ``trainer="sft"``: of one TRL ``SFTTrainer`` step on the same rows."""
    import torch

    from .. import tiny

    torch.manual_seed(0)
    model = tiny.tiny_llama()
    generator = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(4):
        ids = torch.randint(5, 128, (8,), generator=generator).tolist()
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:]})  # position 0 masked: every count agrees
    if trainer == "sft":
        return sft_first_step(model, [{"input_ids": row["input_ids"]} for row in rows], batch_size, accumulation,
                              smoothing)
    loss, grads, _ = tiny.trainer_first_step(model, rows, batch_size, accumulation, label_smoothing_factor=smoothing)
    return loss, grads


def sft_first_step(model, rows, batch_size: int, accumulation: int, smoothing: float):
    """One TRL ``SFTTrainer`` optimizer step (learning rate 0, no clipping) on pre-tokenized ``rows``: the loss it
    logs and the accumulated gradients. TRL builds the labels (every token; position 0 is never scored)."""
    import gc
    import tempfile
    import warnings

    import torch

    from .. import tiny

    from packaging.version import Version

    from ..versions import installed_version

    version = Version(installed_version("trl") or "0")
    if version < Version(TRL_SFT_SMOOTHS_ITSELF):
        raise ProbeUnsupported(f"TRL {version}'s SFTTrainer smooths inside Trainer.compute_loss: the Trainer "
                               "scenario is the same code")
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import SFTConfig, SFTTrainer
    except (ImportError, RuntimeError) as exc:  # TRL's lazy module turns a failed import into a RuntimeError
        raise ProbeUnsupported(f"TRL's SFTTrainer cannot be imported here ({exc})") from None
    logged = {}

    class Grab(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs and "loss" not in logged:
                logged.update(logs)

    accumulated = {}
    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: accumulated.__setitem__(i, p.grad.clone()))
               for i, p in enumerate(model.parameters()) if p.requires_grad]
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, 128)]
    tokenizer = tiny.word_tokenizer(words, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    with tempfile.TemporaryDirectory() as out, tiny.quiet(), _packing.quiet_datasets(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            args = SFTConfig(output_dir=out, per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=accumulation, learning_rate=0.0, max_steps=1, logging_steps=1,
                             report_to=[], max_grad_norm=1e9, seed=0, save_strategy="no", disable_tqdm=True,
                             use_cpu=True, bf16=False, label_smoothing_factor=smoothing, dataset_num_proc=None)
            sft = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                             callbacks=[Grab()])
        except (TypeError, ValueError) as exc:
            raise ProbeUnsupported(f"this TRL's SFTTrainer cannot be set up this way ({exc})") from None
        for name in ("PrinterCallback", "ProgressCallback"):  # the logs a Trainer prints on stdout
            sft.remove_callback(getattr(sys.modules["transformers.trainer_callback"], name))
        gc.freeze()  # as tiny.trainer_first_step: accelerate's free_memory() gc.collect() is slow otherwise
        try:
            sft.train()
        finally:
            gc.unfreeze()
            for handle in handles:
                handle.remove()
    grads = torch.cat([accumulated[i].reshape(-1) for i in sorted(accumulated)])
    return float(logged["loss"]), grads


def probe(smoothing: float = 0.1, trainer: str = "trainer") -> Observation:
    """The same 4 rows as one batch and as 2 x 2 accumulated, with label smoothing: same loss and gradient norm?
    ``trainer="sft"``: through TRL's ``SFTTrainer`` (>= 1.15.0 calls the smoother itself)."""
    import transformers
    from packaging.version import Version

    if Version("4.46") <= Version(transformers.__version__) < Version("4.48.1"):
        raise ProbeUnsupported("4.46.0-4.48.0 scale gradient accumulation wrongly for every model (the advisories "
                               "ga_loss_scaling_4_46 to ga_loss_scaling_4_48_0): this probe cannot single out the bug")
    loss_1, grads_1 = first_step(4, 1, smoothing, trainer)
    loss_2, grads_2 = first_step(2, 2, smoothing, trainer)
    norm_1, norm_2 = float(grads_1.norm()), float(grads_2.norm())
    detail = (f"{'SFTTrainer' if trainer == 'sft' else 'Trainer'}, label_smoothing_factor={smoothing}: loss {loss_1:.4f} -> {loss_2:.4f}, grad norm {norm_1:.4f} -> "
              f"{norm_2:.4f} (4 x 1 -> 2 x 2 accumulated)")
    bug = abs(loss_2 - loss_1) > 1e-4 * max(1.0, abs(loss_1)) or abs(norm_2 - norm_1) > 1e-4 * max(1.0, norm_1)
    return Observation(bug, detail)
