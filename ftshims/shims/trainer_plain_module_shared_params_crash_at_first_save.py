"""A plain ``nn.Module`` whose layers share a Parameter trains, then dies at the first checkpoint save.

Why: for a model that is not a ``PreTrainedModel`` (a custom wrapper, a value-head model, a PPO policy), the
``Trainer`` saves its ``state_dict()`` with ``safetensors.torch.save_file`` (``Trainer._save``, the non-
``PreTrainedModel`` branch), which refuses tensors that share memory. A model whose embedding and output layer
share one Parameter (tied by hand) therefore trains normally until the first ``save_steps`` boundary, hours in,
and dies with ``RuntimeError: Some tensors share memory, this will lead to duplicate memory on disk``. On
transformers 4.x ``save_safetensors=False`` avoids it; 5.x removed that argument, so there is no switch left.
Reproduced on 4.57.6 and 5.25.0 (dossier-wave5 lead 11; huggingface/trl#5150, hiyouga/LlamaFactory PR #10137).

The fix: wrap ``Trainer._save``. When the ``Trainer`` is about to take that branch (no state dict given, the
model and its unwrapped form not a ``PreTrainedModel``/``PeftModel``, safetensors on) and the state dict holds
tensors sharing storage, it passes the state dict with every name but the first of each shared tensor written
as a copy (the same values in its own storage; the file holds them twice). Dropping the alias instead, as
``save_pretrained`` does for tied weights, does not resume: the ``Trainer``'s ``_load_from_checkpoint`` then
reports the missing key through ``_issue_warnings_after_load``, which reads ``model._keys_to_ignore_on_save``, an
attribute only ``PreTrainedModel`` has (AttributeError, 4.57.6). With the copy, ``load_state_dict`` writes the same
values into the shared Parameter under both names: the sharing stays, and the resumed run equals the
uninterrupted one. The copy costs the shared tensor's size in memory and on disk at each save. Models
without shared tensors, ``PreTrainedModel``/``PeftModel`` saves and pickle saves (``save_safetensors=False``)
go to the original unchanged.

Applies to transformers >= 4.35.0 (``save_safetensors`` defaults to True from 4.35.0; 4.34.1 read: False), unfixed
in 5.25.0. Fallback: a changed ``_save`` signature skips the shim (target check).
"""

from __future__ import annotations

from .._util import acted
from ..spec import Observation, ShimSpec, Target

SPEC = ShimSpec(
    id="trainer_plain_module_shared_params_crash_at_first_save",
    since="0.3.0",
    title="Trainer checkpoint of a plain nn.Module with shared parameters raises 'Some tensors share memory'",
    symptom="a custom nn.Module (not a PreTrainedModel) whose layers share a Parameter trains, then every checkpoint "
    "save raises RuntimeError: Some tensors share memory (safetensors); 5.x has no save_safetensors switch",
    why="Trainer._save writes a plain module's state_dict with safetensors.torch.save_file, which refuses shared "
    "tensors. The shim hands it the shared tensors' other names as copies; the resume loads the same values into "
    "the shared Parameter under both names.",
    requires={"transformers": ">=4.35.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/issues/5150",
        "https://github.com/hiyouga/LlamaFactory/pull/10137",
    ),
    targets=(Target("transformers.trainer", "Trainer._save", params=("output_dir", "state_dict")),),
    modules=("transformers.trainer",),
)


def _storage_key(tensor):
    try:
        return tensor.untyped_storage().data_ptr(), tensor.device.type
    except Exception:  # tensor subclasses without a plain storage: never treated as shared
        return None


def without_aliases(state_dict):
    """``(state dict whose shared tensors are stored once per name, copied names)``; the same object when nothing is
    shared."""
    seen, dropped = set(), []
    for name, tensor in state_dict.items():
        key = _storage_key(tensor) if hasattr(tensor, "untyped_storage") else None
        if key is None or tensor.numel() == 0:
            continue
        if key in seen:
            dropped.append(name)
        seen.add(key)
    if not dropped:
        return state_dict, []
    copies = set(dropped)
    return {name: tensor.clone() if name in copies else tensor for name, tensor in state_dict.items()}, dropped


def _takes_the_safetensors_branch(trainer) -> bool:
    import sys

    trainer_module = sys.modules["transformers.trainer"]
    supported = tuple(c for c in (getattr(trainer_module, "PreTrainedModel", None),
                                  getattr(trainer_module, "PeftModel", None)) if isinstance(c, type))
    model = trainer.model
    if isinstance(model, supported):
        return False
    unwrap = getattr(getattr(trainer, "accelerator", None), "unwrap_model", None)
    if unwrap is not None and isinstance(unwrap(model), supported):
        return False
    return bool(getattr(trainer.args, "save_safetensors", True))  # 5.x: no switch, always safetensors


def _save(wrapped, instance, args, kwargs):
    given = kwargs.get("state_dict", args[1] if len(args) > 1 else None)
    if given is None and _takes_the_safetensors_branch(instance):
        state_dict, dropped = without_aliases(instance.model.state_dict())
        if dropped:
            acted(SPEC.id, "saves with shared tensors written as copies")
            output_dir = kwargs.get("output_dir", args[0] if args else None)
            return wrapped(output_dir, state_dict=state_dict)
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    patcher.wrap_method("transformers.trainer", "Trainer._save", _save)


# ---------------------------------------------------------------------------
# Reproduction


def _model(shared: bool):
    import torch

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.head = torch.nn.Linear(8, 16, bias=False)
            if shared:
                self.head.weight = self.emb.weight  # tied by hand

        def forward(self, input_ids, labels=None):
            logits = self.head(self.emb(input_ids))
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return {"loss": loss, "logits": logits}

    torch.manual_seed(0)
    return Tied()


def _train(out, shared, resume=None):
    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny

    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(0, 16, (6,), generator=g), "labels": torch.randint(0, 16, (6,), generator=g)}
            for _ in range(8)]
    model = _model(shared)
    args = TrainingArguments(out, per_device_train_batch_size=2, max_steps=4, save_steps=2, report_to=[], **tiny.on_cpu(),
                             disable_tqdm=True, learning_rate=1e-2, logging_strategy="no", seed=0)
    with tiny.quiet():
        Trainer(model=model, args=args, train_dataset=rows).train(resume_from_checkpoint=resume)
    return model


def probe(shared: bool = True) -> Observation:
    """A two-layer plain module (embedding and head sharing one Parameter when ``shared``), 4 steps, a checkpoint at
    step 2, then a resume from it. The bug: the save raises; or the resume does not give the uninterrupted weights."""
    import tempfile

    import torch

    from .. import tiny

    with tempfile.TemporaryDirectory() as out:
        try:
            full = _train(out, shared)
        except RuntimeError as exc:
            return Observation(True, f"shared={shared}: the first checkpoint save raised: {' '.join(str(exc).split())[:110]}")
        with tiny.resumable():
            resumed = _train(out + "/resumed", shared, resume=out + "/checkpoint-2")
    same = torch.equal(full.emb.weight, resumed.emb.weight) and torch.equal(full.head.weight, resumed.head.weight)
    tied = resumed.head.weight is resumed.emb.weight
    bug = not same or tied != shared
    return Observation(bug, f"shared={shared}: saved; resumed from checkpoint-2: final weights equal the "
                            f"uninterrupted run's: {same}; still shared: {tied}")
