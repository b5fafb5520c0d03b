"""``Trainer`` skips the gradient-accumulation division for heads whose loss ignores ``num_items_in_batch``.

Why: since 4.48.1 the Trainer decides whether a model normalises its own loss over the whole accumulated batch
from the signature of ``forward``: a class without an ``accepts_loss_kwargs`` attribute whose ``forward``
declares ``**kwargs`` counts as one (``model_accepts_loss_kwargs = True``). The Trainer then passes
``num_items_in_batch`` to ``forward`` and ``training_step`` no longer divides the loss by the number of
gradient-accumulation steps (and, with ``average_tokens_across_devices``, multiplies it by the number of
processes). Many heads declare ``**kwargs`` (4.54 gave them to the shared Llama-style
``GenericForSequenceClassification``/``GenericForTokenClassification``; 5.0 to almost every BERT, RoBERTa,
DeBERTa, T5, BART, Whisper ... head) but compute their loss with a per-micro-batch mean that never sees
``num_items_in_batch`` (``CrossEntropyLoss()``, or ``self.loss_function(...)`` called without the kwargs). For
them the loss and the gradients are multiplied by the number of accumulation steps: the logged loss and
``grad_norm`` grow with ``gradient_accumulation_steps``, ``max_grad_norm`` clips N times too early, SGD-like
optimizers take N times the step. transformers#47688 (open); PRs #47690 and #47836 were closed unmerged; 5.24.0
and 5.25.0 (read) still decide from the signature.

The fix, decided by observation, not by a list: the shim wraps ``Trainer.compute_loss`` and, on the first
training micro-batch for which the Trainer hands ``num_items_in_batch`` (a tensor) to the model's ``forward``,
watches that forward with a ``TorchFunctionMode`` that records every torch operation (a Tensor method, an
operator, a torch function, ``float()``/``.item()``/``.data_ptr()``) that receives the ``num_items_in_batch``
tensor, or a tensor read from it. Any normalisation by it is such an operation. When the forward returns (a
forward hook on the model, so the decision is in place before ``compute_loss`` scales the loss) without one,
the loss did not use ``num_items_in_batch``, and the shim sets ``trainer.model_accepts_loss_kwargs = False``
for that trainer: what transformers' own ``compute_loss`` docstring tells users to do ("If you are not using
``num_items_in_batch`` when computing your loss, make sure to overwrite ``self.model_accepts_loss_kwargs`` to
``False``"), and what 4.57 computed for BERT-style heads. From then on the Trainer divides by the
accumulation steps as for any model without loss kwargs. A model whose forward touches ``num_items_in_batch``
at all keeps upstream's behaviour; the mode only observes (every operation runs unchanged), so that model's
results stay bit-identical; the decision is taken once per trainer and model.

Applies to transformers >=4.48.1 (4.46.0-4.48.0 decided differently and have gradient-accumulation scaling bugs
of their own for every model: the advisories ``ga_loss_scaling_4_46`` to ``ga_loss_scaling_4_48_0``), unfixed in
every release read (4.48.1, 4.50.3, 4.52.4, 4.54.1, 4.57.6, 5.9.0, 5.16.1, 5.24.0, 5.25.0). It stays out, leaving the Trainer as it is, and says why in the shim's notes,
when it cannot tell: a model class that declares ``accepts_loss_kwargs`` itself (an explicit upstream decision),
a ``forward`` that is not transformers' own (remote code, a patched forward such as Liger's or unsloth's: their
fused losses may read the count outside torch's operator dispatch), a compiled model (``torch_compile`` or
``torch.compile``: the watch must not enter a traced graph), a ``compute_loss_func`` or a label smoother (the
Trainer computes the loss itself then), a trainer that sets ``loss_is_scaled_for_ga`` (5.24+), a
``num_items_in_batch`` that is not a tensor, or a forward the hook did not see. Subclasses that override
``compute_loss`` without calling it (TRL's DPO and reward trainers, which set the flag themselves) are not
reached.
"""

from __future__ import annotations

import logging
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import NamedTuple

from .._util import acted, warn_once
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

log = logging.getLogger("ftshims")

SPEC = ShimSpec(
    id="num_items_in_batch_ignored",
    since="0.2.0",
    title="Trainer skips the gradient-accumulation division for heads whose forward takes **kwargs but whose "
    "loss ignores num_items_in_batch",
    symptom="gradient_accumulation_steps=N with a BERT/RoBERTa/DeBERTa/T5/BART/Whisper head (5.x) or a "
    "Llama-style sequence/token-classification head (4.54+): loss and gradients N times too large, logged loss "
    "and grad_norm grow with N, max_grad_norm clips N times too early (also times the number of processes with "
    "average_tokens_across_devices), silently",
    why="The Trainer assumes that a model whose forward declares **kwargs normalises its loss by "
    "num_items_in_batch, and then skips the division by the accumulation steps; hundreds of heads declare **kwargs "
    "but average their loss per micro-batch. The shim watches the first training forward and, when no operation "
    "used num_items_in_batch, sets model_accepts_loss_kwargs=False for that trainer, as transformers' docs say to.",
    requires={"transformers": ">=4.48.1"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/transformers/issues/47688",
        "https://github.com/huggingface/transformers/pull/47690",
        "https://github.com/huggingface/transformers/pull/47836",
        "https://github.com/huggingface/transformers/issues/37766",
    ),
    targets=(Target("transformers.trainer", "Trainer.compute_loss", params=("model", "inputs", "num_items_in_batch")),),
    modules=("transformers.trainer",),
)

# Per trainer: the model its decision was taken for and the decision ("used", "ignored", or why it stayed out).
_DECIDED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_NOTED: set = set()
_NOTES: list = []  # the installed patcher's notes (status()), bound by install()


def _note(reason: str) -> None:
    def emit():
        _NOTES.append(f"left a trainer as it is: {reason}")
        log.info("%s: left a trainer as it is: %s", SPEC.id, reason)

    warn_once(_NOTED, reason, emit)


def _unwrap_peft(model):
    get_base = getattr(model, "get_base_model", None)
    if callable(get_base) and "peft" in sys.modules:
        try:
            return get_base()
        except Exception:  # noqa: BLE001 - an unusual wrapper: judge the model as it is
            return model
    return model


def _is_compiled(model) -> bool:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    compiled_cls = getattr(eval_frame, "OptimizedModule", None) if eval_frame is not None else None
    if compiled_cls is not None and isinstance(model, compiled_cls):
        return True
    return getattr(model, "_compiled_call_impl", None) is not None  # nn.Module.compile()


def stays_out(trainer, model, num_items_in_batch):
    """Why the shim must not judge this call (None when it may watch it). ``model`` is what compute_loss calls."""
    import torch

    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        return "the Trainer does not pass loss kwargs to this model"
    if not isinstance(num_items_in_batch, torch.Tensor):
        return "num_items_in_batch is not a tensor"
    if getattr(trainer, "compute_loss_func", None) is not None:
        return "a compute_loss_func computes the loss"
    if getattr(trainer, "label_smoother", None) is not None:
        return "the label smoother computes the loss"
    if getattr(type(trainer), "loss_is_scaled_for_ga", None) is not None or \
            vars(trainer).get("loss_is_scaled_for_ga") is not None:
        return "the trainer sets loss_is_scaled_for_ga itself"
    args = getattr(trainer, "args", None)
    inner = getattr(trainer, "model", None)
    if getattr(args, "torch_compile", False) or _is_compiled(model) or _is_compiled(inner):
        return "the model is compiled (the watch must not enter a traced graph)"
    if inner is None or not hasattr(inner, "register_forward_hook"):
        return "the trainer has no model module to watch"
    base = _unwrap_peft(inner)
    if hasattr(base, "accepts_loss_kwargs"):
        return f"{type(base).__name__} declares accepts_loss_kwargs itself"
    if "forward" in vars(base):
        return f"{type(base).__name__}.forward is replaced on the instance"
    forward = getattr(type(base), "forward", None)
    module = getattr(forward, "__module__", "") or ""
    if not module.startswith("transformers."):
        return f"{type(base).__name__}.forward is not transformers' own (defined in {module or 'unknown'})"
    return None


class _Watch:
    """Records whether any torch operation receives one tensor (or a tensor read from it).

    A ``TorchFunctionMode`` sees every torch function, Tensor method and operator while it is active; it only
    looks at the arguments and calls the operation unchanged. Reading a property (``.shape``, ``.device``) is
    not a use; a property that returns a tensor (``.data``, ``.T``) hands on a watched tensor.
    """

    def __init__(self, tensor):
        from torch.overrides import TorchFunctionMode

        watch = self
        self.ids = {id(tensor)}
        self.keep = [tensor]  # keeps the ids valid while watching
        self.used = False

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                result = func(*args, **kwargs)
                if not watch.used and watch._touches(args, kwargs):
                    if getattr(func, "__name__", "") == "__get__":
                        watch._hand_on(result)
                    else:
                        watch.used = True
                return result

        self.mode = Mode()

    def _touches(self, args, kwargs) -> bool:
        todo = list(args) + list(kwargs.values())
        seen = 0
        while todo and seen < 10000:
            seen += 1
            item = todo.pop()
            if id(item) in self.ids:
                return True
            if isinstance(item, (list, tuple)):
                todo.extend(item)
            elif isinstance(item, Mapping):  # dicts, BatchEncoding, ModelOutput
                todo.extend(item.values())
        return False

    def _hand_on(self, result) -> None:
        import torch

        if isinstance(result, torch.Tensor):
            self.ids.add(id(result))
            self.keep.append(result)


def _num_items(args, kwargs):
    if len(args) > 3:
        return args[3]
    return kwargs.get("num_items_in_batch")


def _compute_loss(wrapped, instance, args, kwargs):
    num_items_in_batch = _num_items(args, kwargs)
    if num_items_in_batch is None:
        return wrapped(*args, **kwargs)
    model = args[0] if args else kwargs.get("model")
    inner = getattr(instance, "model", None)
    training = bool(getattr(inner, "training", False))
    with _LOCK:
        decided = _DECIDED.get(instance)
    if not training or (decided is not None and decided[0] is inner):
        return wrapped(*args, **kwargs)
    reason = stays_out(instance, model, num_items_in_batch)
    if reason is not None:
        if getattr(instance, "model_accepts_loss_kwargs", False):
            _note(reason)
        with _LOCK:
            _DECIDED[instance] = (inner, reason)
        return wrapped(*args, **kwargs)

    watch = _Watch(num_items_in_batch)
    outcome = []
    depth = [0]

    def enter(module, hook_args):
        depth[0] += 1

    def decide(module, hook_args, output):
        depth[0] -= 1
        # Only the outermost call decides: a forward of the same model run inside it (ftshims' monitor re-runs a
        # packed row from its forward pre-hook; other tools may too) ends first and has not seen the loss yet
        if outcome or depth[0] > 0:
            return
        outcome.append("used" if watch.used else "ignored")
        if not watch.used:
            # Before compute_loss goes on: it scales by the number of processes only while the flag is True.
            instance.model_accepts_loss_kwargs = False

    entered = inner.register_forward_pre_hook(enter, prepend=True)  # before any other pre-hook's nested forward
    handle = inner.register_forward_hook(decide)
    try:
        with watch.mode:
            result = wrapped(*args, **kwargs)
    finally:
        handle.remove()
        entered.remove()
    if not outcome:
        _note("the model's forward hook did not run inside compute_loss")
        outcome.append("not seen")
    with _LOCK:
        _DECIDED[instance] = (inner, outcome[0])
    if outcome[0] == "ignored":
        acted(SPEC.id, "trainers set to divide by the accumulation steps")
        log.info("%s: %s's loss does not use num_items_in_batch: the Trainer divides it by the gradient "
                 "accumulation steps (model_accepts_loss_kwargs=False)", SPEC.id, type(_unwrap_peft(inner)).__name__)
    return result


def install(patcher, options) -> None:
    global _NOTES
    trainer = sys.modules["transformers.trainer"]
    _NOTES = patcher.notes
    _NOTED.clear()
    patcher.wrap(trainer.Trainer, "compute_loss", _compute_loss)


# ---------------------------------------------------------------------------
# Reproduction

ROWS, SEQ = 4, 6


def build(kind: str):
    """A tiny model and its 4 training rows: "llama_seqcls", "bert_seqcls", "xlnet_seqcls" (affected), or
    "llama_clm" (its loss uses num_items_in_batch: the control)."""
    import torch
    import transformers

    from .. import tiny

    torch.manual_seed(0)
    small = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, intermediate_size=32)
    with tiny.quiet():
        if kind in ("llama_seqcls", "llama_clm"):
            config = transformers.LlamaConfig(**dict(small, num_hidden_layers=1, num_key_value_heads=2,
                                                     pad_token_id=0, num_labels=3))
            cls = (transformers.LlamaForSequenceClassification if kind == "llama_seqcls"
                   else transformers.LlamaForCausalLM)
        elif kind == "bert_seqcls":
            config = transformers.BertConfig(**dict(small, num_hidden_layers=1, num_labels=3, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0))
            cls = transformers.BertForSequenceClassification
        elif kind == "xlnet_seqcls":
            config = transformers.XLNetConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2, d_inner=32, num_labels=3,
                                             dropout=0.0, summary_last_dropout=0.0)
            cls = transformers.XLNetForSequenceClassification
        else:
            raise ValueError(f"unknown model kind {kind!r}")
        model = cls(config)
    generator = torch.Generator().manual_seed(1)
    rows = []
    for i in range(ROWS):
        ids = torch.randint(5, 64, (SEQ,), generator=generator).tolist()
        # the causal LM's first label is -100: transformers <5.10.1 would count it (num_items_in_batch_overcount)
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:] if kind == "llama_clm" else i % 3})
    return model, rows


def first_step(kind: str, batch_size: int, accumulation: int):
    """The loss the Trainer logs and the gradient norm after one optimizer step (learning rate 0)."""
    from .. import tiny

    model, rows = build(kind)
    loss, grads, trainer = tiny.trainer_first_step(model, rows, batch_size, accumulation)
    return Step(loss, grads, getattr(trainer, "model_accepts_loss_kwargs", False))


def whole_batch(kind: str):
    """The reference without the Trainer: the model's own loss over the 4 rows at once, and its gradients."""
    import torch

    model, rows = build(kind)
    model.train()
    batch = {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "labels")}
    loss = model(**batch).loss
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    return Step(float(loss.detach()), grads, False)


class Step(NamedTuple):
    loss: float  # as logged
    grads: object  # every accumulated gradient, flattened (a tensor)
    accepts_loss_kwargs: bool  # the trainer's model_accepts_loss_kwargs after the step

    @property
    def grad_norm(self) -> float:
        return float(self.grads.norm())


def probe(kind: str = "xlnet_seqcls") -> Observation:
    """The Trainer's first step over 4 rows as 2 x 2 (gradient accumulation) against the model's own loss over the
    4 rows at once: the logged loss and the gradient norm must agree."""
    import transformers
    from packaging.version import Version

    if Version("4.46") <= Version(transformers.__version__) < Version("4.48.1"):
        raise ProbeUnsupported("4.46.0-4.48.0 scale gradient accumulation wrongly for every model (the advisories "
                               "ga_loss_scaling_4_46 to ga_loss_scaling_4_48_0): this probe cannot single out the bug")
    whole, accumulated = whole_batch(kind), first_step(kind, batch_size=2, accumulation=2)
    loss_1, grad_1, loss_2, grad_2 = whole.loss, whole.grad_norm, accumulated.loss, accumulated.grad_norm
    detail = (f"{kind}: loss {loss_1:.4f} -> {loss_2:.4f}, grad norm {grad_1:.4f} -> {grad_2:.4f} (4 rows at once -> "
              f"Trainer, 2 x 2 accumulated); model_accepts_loss_kwargs={accumulated.accepts_loss_kwargs}")
    bug = abs(loss_2 - loss_1) > 1e-4 * max(1.0, abs(loss_1)) or abs(grad_2 - grad_1) > 1e-4 * max(1.0, abs(grad_1))
    return Observation(bug, detail)
