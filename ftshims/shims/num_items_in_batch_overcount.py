"""``Trainer`` divides a causal LM's summed loss by one label too many per row.

Why: since 4.46 the Trainer sums the token losses of all gradient-accumulation
micro-batches and divides by ``num_items_in_batch``, which
``Trainer._get_num_items_in_batch`` counts as ``labels.ne(-100)`` over the
*unshifted* labels. ``ForCausalLMLoss`` scores ``labels[..., 1:]`` (or the
``shift_labels`` a collator supplies): the label at position 0 is never a
target. So every row whose first label is not -100 adds one to the denominator
and the loss and gradients come out smaller by rows/tokens per step
(0.1-1 % at usual lengths, 1/8 on an 8-token row); padded and padding-free
batches of the same data disagree. Completion-only labels (position 0 already
-100) are not affected. transformers PR #46204 (first released in 5.10.1;
5.9.0 and earlier count every label) counts over ``labels[..., 1:]`` or
``shift_labels`` when the model's loss is ``ForCausalLMLoss``.

The fix: wrap ``Trainer._get_num_items_in_batch`` and, when the unwrapped
model's ``loss_type`` maps to ``ForCausalLMLoss`` in ``LOSS_MAPPING`` and its
config is not an encoder-decoder (the upstream test as 5.15.0 has it), hand it
shallow copies of the batches whose ``labels`` are the
labels the loss scores (``shift_labels`` if present, else ``labels[..., 1:]``).
The original then counts, gathers across devices and divides for DataParallel
exactly as before; the batches used for training are not modified.

Applies to transformers >=4.57,<5.10.1 (reproduced on 4.57.6; the same count is
in 4.57.0, 5.0.0, 5.5.4 and 5.9.0). 4.46-4.56 count inline in
``get_batch_samples``, with version-specific gathering: no narrow wrap point,
so they get the advisory ``num_items_in_batch_overcount_4_46`` instead.
Fallback: models whose loss does not shift labels (classification, masked LM,
encoder-decoders, custom ``compute_loss_func`` on a model without
``loss_type``) and batches whose labels are not tensors pass through unchanged.
So do PEFT prompt tuning, p-tuning and multitask prompt tuning (since ftshims 0.2.0):
``PeftModelForCausalLM.forward`` prepends ``num_virtual_tokens`` labels of -100, so
the shifted loss scores every label of the batch (the last virtual position predicts
label 0) and the installed count over all labels is exact; ``labels[..., 1:]`` would
drop one target per row (5.10.1+ upstream counts it that way: 14 for 16 scored
labels on a tiny prompt-tuned Llama on 5.24.0, an upstream bug of its own).

Follow-ups: #46903 (encoder-decoders counted over all labels, 5.15.0) — carried.
``"ForConditionalGeneration"`` maps to ``ForCausalLMLoss`` too, so #46204 alone also counted T5, BART,
Whisper, Florence2 ... over ``labels[..., 1:]``, although their decoders score
every label (``decoder_input_ids`` are the labels shifted right): one target
lost per row (5.10.1-5.14.1 upstream, and this shim in ftshims 0.1.0: T5 with a
``compute_loss_func`` got 10 for 2 x 6 labels). 5.15.0 adds ``and not
config.is_encoder_decoder``; so does this shim, which leaves encoder-decoders
exactly as the installed Trainer counts them. The double-shifted encoder-decoder
losses of the same era (Moonshine, Florence2 ... fixed in 5.13/5.15) are not
this shim's: their count stays upstream's. Later releases change only how the
count is divided for tensor/context/sequence parallelism (5.24:
``/ (tp * cp * sp)``), which the wrapped original keeps doing as installed.

Beyond upstream: only a model whose ``forward`` computes its loss with
``self.loss_function``, or hands its labels to the one child that does (a decoder whose ``loss_type`` maps to
``ForCausalLMLoss``: Kosmos-2's ``text_model``; since ftshims 0.3.0, issue 37: 16
counted for 14 scored labels on a tiny Kosmos-2, 4.57.6), is counted over ``labels[..., 1:]``. The decoders of
encoder-decoder families (BartForCausalLM, Pegasus, Marian, mBART, Blenderbot,
PLBart, MVP, BigBird-Pegasus) and CpmAnt are ``*ForCausalLM`` by name but score
every label (the zoo gate's Trainer step: 184 labels scored, 183 counted); they
keep the installed count. Models that shift by hand without ``loss_function``
(Mamba 4.57) keep it too: the shim cannot tell what they score, so it stays out.
"""

from __future__ import annotations

import sys

from .._util import acted
from ..spec import FollowUp, Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="num_items_in_batch_overcount",
    since="0.3.0",
    title="Trainer counts position-0 labels a causal LM never scores into num_items_in_batch",
    symptom="causal LM loss and gradients under-scaled by rows/tokens per step (the first label of each row is "
    "counted but never predicted); padded and padding-free runs of the same data give different losses",
    why="From transformers 4.46 to 5.9 the Trainer normalises the summed causal-LM loss by the number of labels "
    "that are not -100, counting position 0 of every row, which the shifted loss never scores. The shim counts the "
    "labels the loss scores, as 5.10.1 does.",
    requires={"transformers": ">=4.57,<5.10.1"},
    fixed_in={"transformers": "5.10.1"},
    refs=(
        "https://github.com/huggingface/transformers/pull/46204",
        "https://github.com/huggingface/transformers/pull/46335",
        "https://github.com/huggingface/transformers/pull/46903",
    ),
    backports=("https://github.com/huggingface/transformers/pull/46204",),
    follow_ups=(
        FollowUp("https://github.com/huggingface/transformers/pull/46903", "encoder-decoders counted over all labels, "
                 "5.15.0", carried=True),
    ),
    targets=(Target("transformers.trainer", "Trainer._get_num_items_in_batch", params=("batch_samples", "device")),),
    modules=("transformers.trainer",),
)


def loss_shifts_labels(trainer) -> bool:
    """Whether the trainer's model is a decoder whose loss is ``ForCausalLMLoss`` (the 5.15.0 test)."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    model = getattr(trainer, "model", None)
    get_base = getattr(model, "get_base_model", None)  # a PeftModel
    if callable(get_base):
        try:
            model = get_base()
        except Exception:  # noqa: BLE001 - an unusual wrapper: keep the model as it is
            pass
    try:
        loss_type = getattr(model, "loss_type", None)
        if not (isinstance(loss_type, str) and LOSS_MAPPING.get(loss_type) is ForCausalLMLoss):
            return False
        # Encoder-decoders map to ForCausalLMLoss by name ("ForConditionalGeneration") but score every label (#46903).
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        return loss_goes_through_loss_function(type(model)) or delegated_causal_loss(model) is not None
    except Exception:  # noqa: BLE001 - a model whose loss_type property raises: no decision, no change
        return False


def delegated_causal_loss(model):
    """The sub-model that computes ``model``'s loss, when ``model.forward`` hands its labels to one (Kosmos-2's
    ``text_model``) instead of calling ``self.loss_function``; else None.

    A direct child counts when ``model.forward`` names it (``self.<child>(...)``), it is a decoder (not an
    encoder-decoder) whose ``loss_type`` maps to ``ForCausalLMLoss``, whose own ``forward`` takes ``labels`` and
    computes its loss with ``self.loss_function`` (the shifted ForCausalLMLoss), and it is the only such child:
    that loss scores ``labels[..., 1:]``. Anything less certain is None, and the installed count stays.
    """
    import inspect

    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    forward = inspect.unwrap(getattr(type(model), "forward", None))
    code = getattr(forward, "__code__", None)
    if code is None or "labels" not in code.co_varnames:
        return None
    found = []
    for name, child in model.named_children():
        if name not in code.co_names:
            continue
        loss_type = getattr(child, "loss_type", None)
        if not (isinstance(loss_type, str) and LOSS_MAPPING.get(loss_type) is ForCausalLMLoss):
            continue
        if getattr(getattr(child, "config", None), "is_encoder_decoder", False):
            continue
        try:
            takes_labels = "labels" in inspect.signature(type(child).forward).parameters
        except (TypeError, ValueError):
            takes_labels = False
        if takes_labels and loss_goes_through_loss_function(type(child)):
            found.append(child)
    return found[0] if len(found) == 1 else None


def loss_goes_through_loss_function(cls) -> bool:
    """Whether ``cls.forward`` computes its loss with ``self.loss_function`` (the shifted ForCausalLMLoss). The
    decoders of encoder-decoder families (BartForCausalLM, Pegasus, Marian, mBART, Blenderbot, PLBart, MVP,
    BigBird-Pegasus, CpmAnt ...) are named ``*ForCausalLM`` but score every label with a plain cross-entropy (their
    callers shift); counting ``labels[..., 1:]`` for them dropped one target per row (zoo gate, 4.57.6: 184 -> 183).
    Upstream's test (#46204, 5.10.1+) goes by the name alone and has the same undercount for them."""
    import inspect

    forward = inspect.unwrap(getattr(cls, "forward", None))
    code = getattr(forward, "__code__", None)
    return code is not None and "loss_function" in code.co_names


# peft types whose PeftModelForCausalLM.forward prepends num_virtual_tokens labels of -100 to the batch's labels
# (peft 0.4.0-0.21.2, the branch after prefix tuning and CPT): the causal shift then scores every label of the batch,
# label 0 by the last virtual position, so the installed count over all labels is the right one.
PREPENDING = ("PROMPT_TUNING", "P_TUNING", "MULTITASK_PROMPT_TUNING")


def prepends_ignored_labels(model) -> bool:
    """Whether ``model`` is a PeftModel whose active adapter prepends ignored labels (prompt tuning, p-tuning,
    multitask prompt tuning)."""
    try:
        config = model.active_peft_config
    except (AttributeError, KeyError, TypeError):  # not a PeftModel, or no single active adapter
        return False
    kind = getattr(config, "peft_type", None)
    return str(getattr(kind, "value", kind)) in PREPENDING


def scored_labels(batch):
    """The labels ``ForCausalLMLoss`` scores for ``batch``, or None when they cannot be told."""
    shifted = batch.get("shift_labels") if hasattr(batch, "get") else None
    if shifted is not None and hasattr(shifted, "ne"):
        return shifted
    labels = batch.get("labels") if hasattr(batch, "get") else None
    if labels is None or not hasattr(labels, "ne") or getattr(labels, "dim", lambda: 0)() < 1:
        return None
    return labels[..., 1:]


def _get_num_items_in_batch(wrapped, instance, args, kwargs):
    if args:
        batch_samples, rest = args[0], args[1:]
    else:
        batch_samples, rest = kwargs.pop("batch_samples", None), ()
    if not batch_samples or not isinstance(batch_samples, list) or not loss_shifts_labels(instance):
        return wrapped(batch_samples, *rest, **kwargs)
    if prepends_ignored_labels(getattr(instance, "model", None)):
        return wrapped(batch_samples, *rest, **kwargs)  # every label is scored: the installed count is right
    counted = []
    for batch in batch_samples:
        labels = scored_labels(batch) if hasattr(batch, "keys") and "labels" in batch else None
        if labels is None:
            return wrapped(batch_samples, *rest, **kwargs)  # not a plain causal-LM batch: leave it to upstream
        copy = dict(batch)
        copy["labels"] = labels
        counted.append(copy)
    acted(SPEC.id, "batches counted over the scored labels", len(counted))
    return wrapped(counted, *rest, **kwargs)


def install(patcher, options) -> None:
    trainer = sys.modules["transformers.trainer"]
    patcher.wrap(trainer.Trainer, "_get_num_items_in_batch", _get_num_items_in_batch)


# ---------------------------------------------------------------------------
# Reproduction

LABELS = {
    # every label a target (plain causal LM / SFT without completion masking), one row right-padded
    "full": [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, -100, -100, -100]],
    # completion-only: the prompt (position 0 included) masked
    "completion_only": [[-100, -100, -100, 8, 9, 10, 11, 12], [-100, -100, 22, 23, 24, -100, -100, -100]],
}


def tiny_kosmos2():
    """A tiny Kosmos-2 (its loss is its text model's shifted ForCausalLMLoss), dropout off."""
    import torch
    import transformers

    from .. import tiny

    config = transformers.Kosmos2Config(
        text_config=dict(vocab_size=64, embed_dim=32, layers=2, attention_heads=4, ffn_dim=64,
                         max_position_embeddings=64),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=16),
        latent_query_num=4)
    torch.manual_seed(0)
    with tiny.quiet():
        return transformers.Kosmos2ForConditionalGeneration(config).eval()


def _kosmos2_probe(trainer_class, args_class) -> Observation:
    """Kosmos-2 (loss delegated to its text model): the Trainer's count against the labels the loss scores."""
    import tempfile

    import torch

    from .. import tiny

    model = tiny_kosmos2()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 64, (2, 12), generator=generator)
    labels = input_ids.clone()
    labels[:, 1:5] = -100  # the image slots are not scored
    image_mask = torch.zeros_like(input_ids)
    image_mask[:, 1:5] = 1
    batch = {"input_ids": input_ids, "labels": labels, "image_embeds_position_mask": image_mask,
             "pixel_values": torch.randn(2, 3, 32, 32, generator=generator)}
    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        trainer = trainer_class(model=model, args=_training_args(args_class, out))
        num = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
        with torch.no_grad():
            loss = float(trainer.compute_loss(model, dict(batch), num_items_in_batch=num))
            reference = float(model(**batch).loss)  # the model's own mean over what it scores
    scored = int(labels[:, 1:].ne(-100).sum())
    detail = (f"kosmos-2: num_items_in_batch={int(num)} for {scored} scored labels; loss {loss:.5f} vs the model's "
              f"mean {reference:.5f}")
    return Observation(int(num) != scored or abs(loss - reference) > 1e-5 * max(1.0, abs(reference)), detail)


def probe(labels: str = "full", arch: str = "llama") -> Observation:
    """A Trainer on a tiny Llama (or ``arch="kosmos-2"``): does ``compute_loss`` with the Trainer's own
    ``num_items_in_batch`` equal the mean cross-entropy over the tokens the causal loss scores?"""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny

    if not hasattr(Trainer, "_get_num_items_in_batch"):
        # before 4.57 the count is inline in get_batch_samples (4.46-4.56, see the advisory), or absent
        raise ProbeUnsupported("this Trainer has no _get_num_items_in_batch")
    if arch == "kosmos-2":
        return _kosmos2_probe(Trainer, TrainingArguments)
    model = tiny.tiny_llama()
    label_rows = torch.tensor(LABELS[labels])
    input_ids = torch.where(label_rows == -100, torch.full_like(label_rows, 30), label_rows)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": label_rows}
    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        args = _training_args(TrainingArguments, out)
        trainer = Trainer(model=model, args=args)
        device = torch.device("cpu")
        num = trainer._get_num_items_in_batch([batch], device)
        with torch.no_grad():
            loss = float(trainer.compute_loss(model, dict(batch), num_items_in_batch=num))
            logits = model(input_ids=input_ids, attention_mask=batch["attention_mask"]).logits
    target = label_rows[:, 1:]
    reference = float(torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=-100))
    scored = int(target.ne(-100).sum())
    detail = f"num_items_in_batch={int(num)} for {scored} scored labels; loss {loss:.5f} vs mean CE {reference:.5f}"
    if int(num) != scored or abs(loss - reference) > 1e-5 * max(1.0, abs(reference)):
        return Observation(True, detail)
    return Observation(False, detail)


def _training_args(TrainingArguments, out):
    import inspect

    params = inspect.signature(TrainingArguments.__init__).parameters
    kwargs = dict(output_dir=out, report_to=[], per_device_train_batch_size=2)
    if "use_cpu" in params:
        kwargs["use_cpu"] = True
    return TrainingArguments(**kwargs)
