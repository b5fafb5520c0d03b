"""The zoo gate's Trainer step: ``Trainer.training_step`` on the tiny model, plain vs under ``ftshims.apply()``.

The forward/backward steps of ``gate.py`` call the model directly; the shims that act inside the ``Trainer``
(how ``num_items_in_batch`` is counted, how the loss is scaled for gradient accumulation, what a
``compute_loss_func`` receives) are only reached through it. For every class with a loss (causal LM, seq2seq,
image-text-to-text, speech seq2seq, masked LM, sequence classification) the gate runs two steps on the fp32 model
it already built for its sdpa group (eager where sdpa is not selectable):

* ``trainer_ga2``: gradient accumulation 2: ``get_batch_samples`` over two micro-batches (this is where the
  Trainer counts ``num_items_in_batch``), then ``training_step`` on each, gradients accumulated;
* ``trainer_lossfn``: the same count with a ``compute_loss_func`` (a summed token cross-entropy divided by
  ``num_items_in_batch``, shifted for decoders, as users write it), one ``training_step`` on the first
  micro-batch. Releases without ``compute_loss_func`` (< 4.46) skip it.

The record holds the step losses, ``num_items_in_batch`` (-1 when the Trainer counts nothing) and the accumulated
gradients, compared like every other step; ``probe`` keeps the label counts the ``num_items_scored`` direction
check needs. The micro-batches are rows 0-1 of the class's main batch (one full row, one left-padded row; the
multimodal row 0 carries the image) with labels: the tokens themselves (pad and image positions -100; without an
``attention_mask``, the pad ids) for decoders, and the same with an 8-token prompt masked in the second micro-batch; 20 decoder targets (the last 5
masked in the second) and, as ``DataCollatorForSeq2Seq`` gives them, the decoder inputs (the targets shifted
right) for encoder-decoders; every 3rd / 5th token for masked LMs; one class per row for classifiers.

In the shimmed run ``gate.py`` passes ``run`` a ``ftshims.monitor.callback()`` (the monitor's false positives
measured at zoo scale): ``run`` fires on it the events ``Trainer.train()`` fires around one optimizer step, since
these steps call ``training_step`` without ``train()``.

Nothing here catches exceptions: ``gate.py`` runs these functions inside its capture and records what they raise.
"""

from __future__ import annotations

import inspect
import tempfile
from typing import Optional

import torch

import inputs as zin

LOSS_LABELS = ("causal_lm", "seq2seq_lm", "image_text_to_text", "speech_seq2seq", "masked_lm", "seq_cls")
STEPS = ("trainer_ga2", "trainer_lossfn")
PROMPT = 8  # masked prompt tokens of the second decoder micro-batch
SEQ2SEQ_PAD = 5  # right-padded decoder targets of the second encoder-decoder micro-batch
_OUT_DIR = None


def batch_kind(labels, takes) -> Optional[str]:
    """How the class is trained: ``decoder`` (shifted token loss), ``seq2seq`` (decoder targets), ``masked``,
    ``cls``; None for classes without a loss the gate can give labels to."""
    labels = set(labels)
    if "labels" not in takes or not labels & set(LOSS_LABELS):
        return None
    if labels & {"seq2seq_lm", "speech_seq2seq"}:
        return "seq2seq"
    if labels & {"causal_lm", "image_text_to_text"}:
        return "seq2seq" if "decoder_input_ids" in takes else "decoder"
    if "masked_lm" in labels:
        return "masked"
    return "cls"


def _rows(batch: dict, n: int) -> dict:
    """The first ``n`` rows of every tensor whose first dimension is the batch (token ids, masks, audio)."""
    lead = next((batch[k] for k in ("input_ids", "input_features", "input_values") if k in batch), None)
    if lead is None or lead.shape[0] <= n:
        return dict(batch)
    rows = lead.shape[0]
    return {k: (v[:n] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows else v)
            for k, v in batch.items()}


def micro_batches(main: dict, kind: str, config, image_token=None, seed: int = 0) -> list:
    """Two labelled micro-batches from rows 0-1 of the main batch (see the module docstring); ``image_token``:
    the placeholder id of a multimodal batch, never a target."""
    gen = torch.Generator().manual_seed(seed + 7)
    base = {k: v for k, v in _rows(main, 2).items() if not k.startswith("__")}
    first, second = dict(base), dict(base)
    if kind == "decoder":
        ids = base["input_ids"]
        labels = ids.clone()
        if "attention_mask" in base:
            labels[base["attention_mask"] == 0] = -100
        else:  # a model without attention_mask (xLSTM): the padding inputs.py wrote (pad ids are never text ids)
            labels[ids == zin.pad_id(config)] = -100
        for key in ("mm_token_type_ids", "image_embeds_position_mask"):
            if key in base:
                labels[base[key] != 0] = -100
        if isinstance(image_token, int):
            labels[ids == image_token] = -100
        masked = labels.clone()
        masked[:, :PROMPT] = -100
        first["labels"], second["labels"] = labels, masked
    elif kind == "seq2seq":
        for key in ("decoder_input_ids", "decoder_attention_mask"):
            first.pop(key, None)
            second.pop(key, None)
        rows = zin.main_batch(base)
        targets = zin.text_ids(gen, config, (rows, zin.DECODER_LEN))
        padded = targets.clone()
        padded[:, -SEQ2SEQ_PAD:] = -100
        first["labels"], second["labels"] = targets, padded
        if "decoder_input_ids" in main:
            # as DataCollatorForSeq2Seq: the decoder inputs are the labels shifted right (a compute_loss_func
            # takes the labels away from the model, which then could not derive them)
            for batch in (first, second):
                batch["decoder_input_ids"] = shift_right(batch["labels"], config)
    elif kind == "masked":
        ids = base["input_ids"]
        keep = base["attention_mask"].bool() if "attention_mask" in base else ids.ne(zin.pad_id(config))
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        for batch, every in ((first, 3), (second, 5)):
            batch["labels"] = torch.where(keep & (positions % every == 0), ids, torch.full_like(ids, -100))
    else:  # cls
        rows = zin.main_batch(base)
        first["labels"] = torch.arange(rows) % 2
        second["labels"] = (torch.arange(rows) + 1) % 2
    return [first, second]


def shift_right(labels: torch.Tensor, config) -> torch.Tensor:
    """Decoder inputs from labels: the decoder start token, then the labels but the last, -100 as pad."""
    start = zin._cfg(config, "decoder_start_token_id", "bos_token_id")
    start = start[0] if isinstance(start, (list, tuple)) else start
    pad = zin.pad_id(config)
    out = torch.full_like(labels, pad)
    out[:, 0] = start if isinstance(start, int) and start >= 0 else pad
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == -100, pad)


def label_counts(batches: list) -> dict:
    """Labels that are not -100 over the micro-batches: all of them, and those a shifted loss scores."""
    everything = sum(int(b["labels"].ne(-100).sum()) for b in batches)
    shifted = sum(int(b["labels"][..., 1:].ne(-100).sum()) for b in batches if b["labels"].dim() >= 1)
    return {"labels_all": everything, "labels_shifted": shifted}


def user_loss(shift: bool):
    """A ``compute_loss_func`` as users write it: summed token cross-entropy over ``num_items_in_batch``."""

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs["logits"] if isinstance(outputs, dict) and "logits" in outputs else outputs[0]
        logits = logits.float()
        if logits.dim() == labels.dim() + 1 and logits.shape[:-1] == labels.shape:
            if shift:
                logits, labels = logits[..., :-1, :], labels[..., 1:]
            total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                      ignore_index=-100, reduction="sum")
        else:  # logits that do not line up with the labels (a model that inserts image features): a plain norm
            total = logits.pow(2).mean() * labels.ne(-100).sum()
        denom = num_items_in_batch if num_items_in_batch is not None else labels.ne(-100).sum().clamp(min=1)
        return total / denom

    return loss_func


def supports_loss_func() -> bool:
    from transformers import Trainer

    return "compute_loss_func" in inspect.signature(Trainer.__init__).parameters


def make_trainer(model, loss_func=None):
    """A CPU Trainer around ``model`` with gradient accumulation 2 (cheap: no optimizer, no data loader)."""
    global _OUT_DIR
    from transformers import Trainer, TrainingArguments

    if _OUT_DIR is None:
        _OUT_DIR = tempfile.mkdtemp(prefix="zoo-trainer-")
    params = inspect.signature(TrainingArguments.__init__).parameters
    kwargs = dict(output_dir=_OUT_DIR, report_to=[], per_device_train_batch_size=2, gradient_accumulation_steps=2)
    if "use_cpu" in params:
        kwargs["use_cpu"] = True
    elif "no_cuda" in params:
        kwargs["no_cuda"] = True
    extra = {"compute_loss_func": loss_func} if loss_func is not None else {}
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), **extra)
    trainer.current_gradient_accumulation_steps = 2  # set by the training loop in 4.48+; read by training_step
    return trainer


def _event(callback, name: str, trainer, **objects) -> None:
    """Fire one ``TrainerCallback`` event on ``callback`` alone, with the arguments ``Trainer.train()``'s
    ``CallbackHandler`` passes (args, state, control, then the objects); events a release lacks are skipped."""
    method = getattr(callback, name, None)
    if method is not None:
        method(trainer.args, trainer.state, trainer.control, **objects)


def run(model, batches: list, step: str, kind: str, seed: int, monitor=None):
    """One Trainer step (``trainer_ga2`` or ``trainer_lossfn``): (losses, num_items_in_batch or None, grads).

    ``monitor``: a ``ftshims.monitor.callback()`` watching the step. The step calls ``training_step`` itself (no
    ``train()``), so the callback gets the events ``train()`` fires around one optimizer step, in its order:
    ``on_train_begin`` (the model; no optimizer, no data loader), ``on_step_begin`` (after ``get_batch_samples``,
    as 4.46+ do), the micro-batches, ``on_pre_optimizer_step``, ``on_step_end``, and ``on_train_end`` (also when
    the step raises: the monitor removes its hooks). The gradients are taken after these events, so a monitor
    that changed them would be seen by the gate's comparison."""
    loss_func = user_loss(kind == "decoder") if step == "trainer_lossfn" else None
    trainer = make_trainer(model, loss_func)
    if monitor is not None:
        _event(monitor, "on_train_begin", trainer, model=model, optimizer=trainer.optimizer,
               lr_scheduler=trainer.lr_scheduler, train_dataloader=None, processing_class=None, tokenizer=None)
    try:
        samples = [dict(b) for b in batches]
        num = None
        get_samples = getattr(trainer, "get_batch_samples", None)
        if get_samples is not None:
            params = inspect.signature(get_samples).parameters
            args = (iter(samples), len(samples)) + ((torch.device("cpu"),) if "device" in params else ())
            samples, num = get_samples(*args)
        takes_num = "num_items_in_batch" in inspect.signature(trainer.training_step).parameters
        if monitor is not None:
            _event(monitor, "on_step_begin", trainer)
        losses = []
        for batch in samples[: 2 if step == "trainer_ga2" else 1]:
            torch.manual_seed(seed)
            loss = trainer.training_step(model, batch, num) if takes_num else trainer.training_step(model, batch)
            losses.append(loss.detach().float().reshape(1))
        if monitor is not None:
            _event(monitor, "on_pre_optimizer_step", trainer)
            _event(monitor, "on_step_end", trainer)
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        if monitor is not None:
            _event(monitor, "on_train_end", trainer)
    model.eval()
    return losses, (int(num) if num is not None else None), grads


def loss_probe(model, batch: dict) -> dict:
    """What the model's own loss does with ``batch`` (eval mode, no grad): ``first_label_scored`` (see below) and
    ``uses_num_items``: whether its loss changes with the ``num_items_in_batch`` keyword (None: it refuses it)."""
    out = {"first_label_scored": first_label_scored(model, batch), "uses_num_items": None}
    try:
        with torch.no_grad():
            a = model(**batch, num_items_in_batch=torch.tensor(3)).loss
            b = model(**batch, num_items_in_batch=torch.tensor(1000)).loss
        out["uses_num_items"] = bool(not torch.equal(a, b))
    except TypeError:  # a forward without **kwargs: the Trainer never hands it the count
        out["uses_num_items"] = None
    return out


def first_label_scored(model, batch: dict) -> Optional[bool]:
    """Whether the model's own loss scores position 0 of the labels: the loss with a different first target
    differs (None when no row has a first label)."""
    labels = batch["labels"]
    if labels.dim() < 2:
        return None
    rows = labels[:, 0].ne(-100)
    if not bool(rows.any()):
        return None
    other = labels.clone()
    other[rows, 0] = torch.where(labels[rows, 0] == zin.LOW_ID, zin.LOW_ID + 1, zin.LOW_ID)
    model.eval()
    with torch.no_grad():
        a = model(**{**batch, "labels": labels}).loss
        b = model(**{**batch, "labels": other}).loss
    return bool(not torch.equal(a, b))
