"""NEFTune noise in padding-free (packed) rows is scaled by the row's length instead of each example's.

Why: ``TrainingArguments(neftune_noise_alpha=...)`` (and TRL's ``SFTConfig``) adds uniform noise of magnitude
alpha / sqrt(L * d) to the input embeddings, where the NEFTune paper's L is the length of the example. transformers'
hook (``neftune_post_forward_hook``, from the reference code) takes L as the row length, ``output.size(1)``. With
padding-free batches (``DataCollatorWithFlattening``, TRL ``padding_free=True``, ``packing=True``) one row holds many
examples, so every token gets far less noise than the method specifies: x0.25 for 16 examples of 128 tokens in one
row, x1/sqrt(n) for n equal examples (measured on 4.57.6 and 5.25.0: std 0.0080 instead of 0.0319). The run trains
with NEFTune nominally on and its regularisation mostly gone, silently (huggingface/transformers#34659; PR #35799, which
would scale per sequence, is open).

When: transformers >=4.35.0, NEFTune's first release (the hook is the same in every release read, 4.35-5.25; run on
4.40.2, 4.46.3, 4.57.6, 5.1.0, 5.16.1, 5.25.0; unfixed in 5.25.0). The shim wraps ``Trainer.training_step``, which notes the batch's ``position_ids`` when the batch is
padding-free (``position_ids``, no ``attention_mask``), and the NEFTune hook where the Trainer reads it
(``transformers.trainer``'s copy on 4.x-5.1, ``transformers.integrations.neftune`` later). During such a step the hook
draws the very same noise as upstream (same random numbers, same ``uniform_(-m, m)`` with m = alpha / sqrt(L * d))
and scales each token's noise by sqrt(L / l), l its example's length (examples start where the position does not
follow the previous one): alpha / sqrt(l * d), as for that example alone. Tokens whose example is the whole row get
factor exactly 1: their noise is bit-identical to upstream's. No value is read on the host.

Left alone (upstream's noise exactly): padded batches (an ``attention_mask``: the reference implementation scales
by the padded length too, and the dossier's x0.5 at 4x padding is that reference behaviour, not changed here),
steps without ``position_ids``, evaluation (the hook adds nothing outside training), models whose embeddings see a
different shape than the batch's position ids (prompt tuning's virtual tokens), anything under ``torch.compile``,
and NEFTune hooks registered outside the Trainer. Padding at the end of a TRL padding-free row (position 0 each)
counts as one-token examples, as the varlen attention treats it: those padding tokens, isolated and unlabelled,
get alpha / sqrt(d).
"""

from __future__ import annotations

import contextvars
import sys

from .._util import acted, compiling, method_binder
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

HOOK = "neftune_post_forward_hook"
HOOK_MODULES = ("transformers.trainer", "transformers.integrations.neftune")

SPEC = ShimSpec(
    id="neftune_noise_packed_rows",
    since="0.3.0",
    title="NEFTune noise in padding-free (packed) rows is scaled by the row length, not each example's",
    symptom="neftune_noise_alpha with padding-free / packed batches: every token gets noise alpha/sqrt(row_length*d) "
    "instead of alpha/sqrt(example_length*d): x0.25 for 16 packed examples of 128 tokens; NEFTune mostly off, silently",
    why="The NEFTune hook scales the noise by the padded row length; a packed row holds many examples. The shim "
    "scales each token's noise by its own example's length, as the method specifies.",
    requires={"transformers": ">=4.35.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/34659",
        "https://github.com/huggingface/transformers/pull/35799",
    ),
    targets=(Target("transformers.trainer", "Trainer.training_step", params=("model", "inputs")),),
    modules=("transformers.trainer",),
)

# The position_ids of the padding-free batch whose training step is running (None otherwise).
_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("ftshims_neftune_positions", default=None)


def example_lengths(position_ids):
    """``[batch, length]``: the length of the example each token belongs to. An example starts wherever the position
    does not follow the previous one. Tensor operations only: nothing is read on the host."""
    import torch

    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    segment = starts.long().cumsum(-1) - 1
    counts = torch.zeros_like(segment).scatter_add_(1, segment, torch.ones_like(segment))
    return counts.gather(1, segment)


def _padding_free_positions(inputs):
    import torch

    if not hasattr(inputs, "get") or inputs.get("attention_mask") is not None:
        return None
    position_ids = inputs.get("position_ids")
    if not torch.is_tensor(position_ids) or position_ids.dim() != 2 or position_ids.is_floating_point():
        return None
    return position_ids


def _training_step_wrapper(bind):
    def training_step(wrapped, instance, args, kwargs):
        if compiling() or getattr(instance, "neftune_noise_alpha", None) is None:
            return wrapped(*args, **kwargs)
        call = bind(args, kwargs)
        positions = _padding_free_positions(call.get("inputs")) if call is not None else None
        if positions is None:
            return wrapped(*args, **kwargs)
        token = _POSITIONS.set(positions)
        try:
            return wrapped(*args, **kwargs)
        finally:
            _POSITIONS.reset(token)

    return training_step


def _hook(wrapped, instance, args, kwargs):
    import torch

    if compiling() or len(args) != 3 or kwargs:
        return wrapped(*args, **kwargs)
    module, _, output = args
    positions = _POSITIONS.get()
    if positions is None or not module.training or not torch.is_tensor(output) or output.dim() != 3 \
            or tuple(positions.shape) != tuple(output.shape[:2]):
        return wrapped(*args, **kwargs)
    # upstream's draw, number for number (neftune_post_forward_hook, 4.35-5.25)
    dims = torch.tensor(output.size(1) * output.size(2))
    mag_norm = module.neftune_noise_alpha / torch.sqrt(dims)
    noise = torch.zeros_like(output).uniform_(-mag_norm, mag_norm)
    lengths = example_lengths(positions.to(output.device))
    row = output.size(1)
    scale = torch.where(lengths == row, torch.ones((), device=output.device),
                        torch.sqrt(row / lengths.to(torch.float32)))
    acted(SPEC.id, "padding-free NEFTune noise scaled per example")
    return output + noise * scale[..., None].to(noise.dtype)


def install(patcher, options) -> None:
    from ..patching import require_params

    trainer_module = sys.modules["transformers.trainer"]
    trainer = trainer_module.Trainer
    require_params(trainer.training_step, ("model", "inputs"), "transformers.trainer.Trainer.training_step")
    if callable(vars(trainer_module).get(HOOK)):  # 4.x-5.1: Trainer._activate_neftune registers its module's copy
        patcher.wrap(trainer_module, HOOK, _hook)
    else:
        def part(module):
            if not callable(vars(module).get(HOOK)):
                raise TargetMissing(f"transformers.integrations.neftune.{HOOK} not found")
            patcher.wrap(module, HOOK, _hook)

        patcher.when_imported("transformers.integrations.neftune", part)
    patcher.wrap(trainer, "training_step", _training_step_wrapper(method_binder(trainer.training_step)))


# ---------------------------------------------------------------------------
# Reproduction

def noise_of_step(lengths=(16,) * 8, alpha: float = 5.0, padding_free: bool = True, seed: int = 0):
    """One ``Trainer.train()`` step (``max_steps=1``) of a tiny Llama with ``neftune_noise_alpha``: the noise its input
    embeddings got, ``[tokens, hidden]``. ``padding_free``: the examples in one row with restarting position ids and no
    attention mask (DataCollatorWithFlattening's batch); else one example per row with an attention mask."""
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from .. import tiny
    from .num_items_in_batch_overcount import _training_args

    model = tiny.tiny_llama()
    generator = torch.Generator().manual_seed(seed)
    examples = [torch.randint(3, 100, (n,), generator=generator) for n in lengths]
    if padding_free:
        ids = torch.cat(examples)[None]
        batch = {"input_ids": ids, "labels": ids.clone(),
                 "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    else:
        ids = torch.stack(examples)
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    seen = []
    clean = torch.nn.functional.embedding(ids, model.get_input_embeddings().weight).detach()

    def first_layer_input(module, args, kwargs):  # after every embedding hook (NEFTune's comes later than ours)
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden - clean).detach())

    handle = model.model.layers[0].register_forward_pre_hook(first_layer_input, with_kwargs=True)
    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        args = _training_args(TrainingArguments, out)
        for name, value in dict(neftune_noise_alpha=alpha, max_steps=1, save_strategy="no", logging_strategy="no",
                                per_device_train_batch_size=1, seed=seed, learning_rate=0.0).items():
            setattr(args, name, value)
        trainer = Trainer(model=model, args=args, train_dataset=[0], data_collator=lambda features: dict(batch))
        try:
            trainer.train()
        finally:
            handle.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def probe(examples: int = 8, length: int = 16) -> Observation:
    """``examples`` examples of ``length`` tokens packed in one padding-free row, one Trainer step with NEFTune
    alpha 5: is each token's noise std that of its example alone (alpha / sqrt(3 * length * d))?"""
    from transformers import TrainingArguments

    if not hasattr(TrainingArguments, "neftune_noise_alpha"):
        raise ProbeUnsupported("no NEFTune in this transformers (4.35+)")
    noise = noise_of_step((length,) * examples)
    hidden = noise.shape[-1]
    expected = 5.0 / (length * hidden) ** 0.5 / 3 ** 0.5
    std = float(noise.std())
    ratio = std / expected
    detail = (f"{examples} examples of {length} tokens in one row: noise std {std:.5f}, the method's "
              f"{expected:.5f} (x{ratio:.2f})")
    return Observation(not 0.85 < ratio < 1.15, detail)
