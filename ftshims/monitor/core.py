"""The :class:`Monitor`: hooks on the model and the optimizer, device-side accumulators, and the read points.

Per training forward (a forward pre-hook and a forward hook on the model, only
while it is training with grad enabled) and per optimizer step (a step pre-hook
on the optimizer, or ``after_step()``), the detectors record *device tensors*:
label counts, the loss, a hash of the input ids, the gradient norm. Nothing is
read back then. :meth:`Monitor.read` stacks everything recorded since the last
read into one tensor per device and copies it to the host once; the detectors
judge the host values there. When it reads:

* model on the CPU (``read="auto"``): at every optimizer step, before the
  update; reading a CPU tensor is no synchronisation at all;
* on an accelerator: at the Trainer's logging steps (``on_log``, right after the
  Trainer's own ``tr_loss.item()``), or every ``read_every`` steps, and at
  ``read()``/``close()`` in a custom loop;
* ``read="step"``: at every optimizer step anywhere (one synchronisation per step).

One-time checks (train begin, the first packed batch, a non-finite batch) read
what they need when they run: a handful of synchronisations per run, never per step.

The gradient norm is the one before clipping, the Trainer's own (see ``_record_norm``'s comment): the return
value of ``Accelerator.clip_grad_norm_`` / ``torch.nn.utils.clip_grad_norm_``, the ``total_norm`` given to
``clip_grads_with_norm_``, under DeepSpeed the engine's global norm; else the monitor's own over ``p.grad``.
Under DeepSpeed ``p.grad`` is None at the optimizer step: for the first ``grad_steps`` steps a hook per
trainable parameter notes that a gradient reached it (:meth:`Monitor.has_grad`).
"""

from __future__ import annotations

import logging
import math
import os
import types
from typing import Any, Dict, List, Optional

from . import catalogue
from . import options as options_mod
from .findings import Finding, MonitorError
from .jsonl import JsonlWriter

log = logging.getLogger("ftshims.monitor")

KEEP_BATCHES = 8  # inputs of the last micro-batches held for a re-run (localization) between reads


def rank_and_world():
    """``(rank, world size)``: from torch.distributed when it is initialised, else RANK/WORLD_SIZE."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


_CLIPPING = {"patcher": None, "monitors": []}  # the gradient-norm wrappers, shared by the live monitors

# _record_norm: where the monitor takes the step's gradient norm *before clipping*: the value the Trainer
# itself logs. Each wrapper keeps what it sees (a device tensor as it is, or the float DeepSpeed's path
# returns) for every live monitor; the last one called in a step wins, the outermost: the Trainer's own call.
#
# * ``accelerate.Accelerator.clip_grad_norm_``: its return value is the Trainer's ``grad_norm`` on every
#   accelerate and engine (DDP, FSDP2, DeepSpeed: the engine's global norm). accelerate 1.16 computes it with
#   ``get_total_norm`` + ``clip_grads_with_norm_``, never calling ``torch.nn.utils.clip_grad_norm_``: a wrapper
#   of that alone saw nothing there, and the monitor's own norm after clipping was the clipped one (0.99999
#   where the Trainer logs 1.549);
# * ``torch.nn.utils.clip_grad_norm_``: its return value (custom loops, apex);
# * ``torch.nn.utils.clip_grads_with_norm_`` (torch >= 2.6): the ``total_norm`` it is given (custom loops on
#   torch's two-part API; transformers 5's mixed-mesh clipping).
#
# Under DeepSpeed, when nothing asked for the norm this step (transformers 4 with max_grad_norm=0), the ZeRO
# optimizer's ``_global_grad_norm`` (what ``DeepSpeedEngine.get_global_grad_norm()`` returns) is read instead:
# an attribute, no device work. ``ftshims.canary`` checks these attach points (``ATTACH_POINTS``).


def _record_norm(total) -> None:
    if total is None or isinstance(total, bool):
        return
    if hasattr(total, "detach"):
        value = total.detach()
    elif isinstance(total, (int, float)):
        value = float(total)
    else:
        return
    for monitor in list(_CLIPPING["monitors"]):
        monitor._clip_norm = (monitor.step, value)


def _clip_grad_norm_(wrapped, instance, args, kwargs):
    """``torch.nn.utils.clip_grad_norm_`` / ``Accelerator.clip_grad_norm_``: the total norm it returns, before
    clipping, is the step's gradient norm for every live monitor."""
    total = wrapped(*args, **kwargs)
    _record_norm(total)
    return total


def _clip_grads_with_norm_(wrapped, instance, args, kwargs):
    """``torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm, ...)``: ``total_norm`` is the
    norm before clipping."""
    total = kwargs.get("total_norm", args[2] if len(args) > 2 else None)
    result = wrapped(*args, **kwargs)
    _record_norm(total)
    return result


def _wrap_accelerator(patcher):
    def install(module) -> None:
        from ..spec import TargetMissing

        owner = getattr(module, "Accelerator", None)
        if not isinstance(owner, type) or not callable(getattr(owner, "clip_grad_norm_", None)):
            raise TargetMissing("accelerate.accelerator.Accelerator.clip_grad_norm_ is missing: the monitor takes "
                                "the gradient norm from torch's clipping functions only")
        patcher.wrap(owner, "clip_grad_norm_", _clip_grad_norm_)

    return install


def _watch_clipping(monitor, on: bool) -> None:
    """Wrap the clipping functions (through ftshims' Patcher) while at least one monitor is live."""
    import torch.nn.utils

    from ..patching import LOCK, Patcher

    with LOCK:
        watching = _CLIPPING["monitors"]
        if on and monitor not in watching:
            watching.append(monitor)
        elif not on and monitor in watching:
            watching.remove(monitor)
        if watching and _CLIPPING["patcher"] is None:
            patcher = Patcher("monitor")
            patcher.wrap(torch.nn.utils, "clip_grad_norm_", _clip_grad_norm_)
            if callable(getattr(torch.nn.utils, "clip_grads_with_norm_", None)):  # torch >= 2.6
                patcher.wrap(torch.nn.utils, "clip_grads_with_norm_", _clip_grads_with_norm_)
            patcher.when_imported("accelerate.accelerator", _wrap_accelerator(patcher))  # now, or when imported
            _CLIPPING["patcher"] = patcher
        elif not watching and _CLIPPING["patcher"] is not None:
            _CLIPPING["patcher"].undo()
            _CLIPPING["patcher"] = None


def _attach_points():
    """What the monitor wraps or relies on in other packages, checked by ``ftshims.canary`` like shim targets:
    ``(Target, names the target's source must mention)``. torch's (``clip_grad_norm_``, ``clip_grads_with_norm_``
    (>= 2.6), ``Optimizer.register_step_pre_hook``, module forward hooks ``with_kwargs``) are not: the canary
    downloads no torch release; the monitor checks them where it runs (``hasattr``) and falls back."""
    from ..spec import Target

    events = ("on_train_begin", "on_step_begin", "on_step_end", "on_log", "on_save", "on_train_end")
    return (
        # the callback's events (trainer.py); on_pre_optimizer_step since 4.45 (the optimizer's hook before)
        *[(Target("transformers.trainer_callback", f"CallbackHandler.{event}"), ()) for event in events],
        (Target("transformers.trainer_callback", "CallbackHandler.on_pre_optimizer_step", when=">=4.45"), ()),
        # attach.py: FTSHIMS_MONITOR wraps Trainer.__init__ and adds the callback
        (Target("transformers.trainer", "Trainer.__init__"), ()),
        (Target("transformers.trainer", "Trainer.add_callback", params=("callback",)), ()),
        # the Trainer's gradient norm comes from a clip_grad_norm_ (accelerate's, or torch's) ...
        (Target("transformers.trainer", "Trainer"), ("clip_grad_norm_",)),
        # ... whose return value is the norm before clipping, on every engine
        (Target("accelerate.accelerator", "Accelerator.clip_grad_norm_", params=("parameters", "max_norm")), ()),
        # DeepSpeed: the engine's global norm (transformers 4 asks the engine), kept by the ZeRO optimizers as
        # _global_grad_norm, which the monitor reads when nothing asked for it
        (Target("deepspeed.runtime.engine", "DeepSpeedEngine.get_global_grad_norm"), ("_global_grad_norm",)),
        (Target("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer.step"), ("_global_grad_norm",)),
        (Target("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.step"), ("_global_grad_norm",)),
    )


ATTACH_POINTS = _attach_points()


def deepspeed_optimizer(model, optimizer):
    """The DeepSpeed (ZeRO) optimizer behind ``optimizer`` (accelerate's wrapper holds it as ``.optimizer``) or
    behind ``model`` when it is a ``DeepSpeedEngine`` (a custom loop); None outside DeepSpeed."""
    candidates = [optimizer]
    if _from_deepspeed(model):
        candidates.append(getattr(model, "optimizer", None))
    for found in candidates:
        for _ in range(4):
            if found is None:
                break
            if _from_deepspeed(found):
                return found
            found = getattr(found, "optimizer", None)
    return None


def _sharded(model) -> bool:
    """Whether the model's parameters are sharded across ranks: FSDP2's DTensors, FSDP1's flat parameters."""
    for p in model.parameters():
        name = type(p).__name__
        if name == "DTensor" or hasattr(p, "_local_tensor") or "FlatParameter" in name:
            return True
    return False


def _from_deepspeed(obj) -> bool:
    return obj is not None and type(obj).__module__.split(".", 1)[0] == "deepspeed"


class Micro:
    """One training forward: its step, device-side counts (``ints``/``floats``), host facts, and its inputs."""

    __slots__ = ("step", "index", "ints", "floats", "host", "call")

    def __init__(self, step: int, index: int, call):
        self.step = step
        self.index = index  # 0 for the first micro-batch of its step
        self.ints: Dict[str, Any] = {}
        self.floats: Dict[str, Any] = {}
        self.host: Dict[str, Any] = {}
        self.call = call  # (args, kwargs) of the forward, for a re-run


class StepView:
    """What a read gives the detectors for one optimizer step: host values per micro-batch, and per step."""

    def __init__(self, step: int):
        self.step = step
        self.micros: List[Micro] = []
        self.values: List[Dict[str, Any]] = []  # host values of each micro-batch (ints and floats together)
        self.grad_norm: Optional[float] = None
        self.lr: Optional[float] = None

    @property
    def loss(self) -> Optional[float]:
        """The step's loss: micro-batch losses summed when the Trainer normalised them by num_items_in_batch, else averaged."""
        losses = [v["loss"] for v in self.values if "loss" in v]
        if not losses:
            return None
        summed = all("num_items" in v for v in self.values if "loss" in v)
        return float(sum(losses)) if summed else float(sum(losses)) / len(losses)


def inputs_of(args, kwargs) -> Dict[str, Any]:
    """The batch tensors a detector reads, from a forward call (``input_ids`` may be the first positional)."""
    found = {name: kwargs.get(name) for name in ("input_ids", "labels", "attention_mask", "position_ids", "shift_labels")}
    if found["input_ids"] is None and args:
        import torch

        if torch.is_tensor(args[0]) and not args[0].is_floating_point():
            found["input_ids"] = args[0]
    if "num_items_in_batch" in kwargs:
        found["num_items_in_batch"] = kwargs["num_items_in_batch"]
    return found


class Monitor:
    """The training health monitor, for a custom loop (the Trainer callback wraps one)::

        mon = ftshims.monitor.Monitor(model, optimizer)
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            mon.after_backward(loss)
            optimizer.step()
            mon.after_step()
            optimizer.zero_grad()
        mon.close()              # the summary; mon.findings holds every Finding

    Without ``optimizer``, call ``after_step()`` before ``zero_grad()`` (it then
    looks at the gradients). ``tokenizer`` (optional) gives the pad/EOS ids
    (else the model's config). Options: :mod:`ftshims.monitor.options`.
    """

    def __init__(self, model, optimizer=None, tokenizer=None, **options):
        self.options = options_mod.check(options)
        import torch

        from ..settings import parse_monitor_log

        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.findings: List[Finding] = []
        self.step = 1  # the optimizer step being accumulated (the Trainer's global_step after it)
        self.steps_done = 0
        self.rank, self.world = rank_and_world()
        self.pid = os.getpid()
        self.in_trainer = False
        self._count: Dict[str, int] = {}
        self._pending: List[Micro] = []
        self._held: List[Micro] = []  # the last KEEP_BATCHES micro-batches, for a re-run
        self._step_floats: Dict[int, Dict[str, Any]] = {}  # step -> {"grad_norm": tensor, "lr": float}
        self._index = 0
        self._busy = False  # our own re-runs: the hooks stand aside
        self._closed = False
        self._grads_done_for = 0
        self._clip_norm = None  # (step, norm) from clip_grad_norm_ this step
        self._zero = None  # the DeepSpeed optimizer, under DeepSpeed
        self._rerun_together = False  # ZeRO-3: localization re-runs only where every rank re-runs alike
        self._handles: List[Any] = []
        self._grad_hooks: List[Any] = []  # per-parameter gradient hooks, the first grad_steps steps (DeepSpeed)
        self._grad_seen: set = set()  # id() of the parameters a gradient reached this step (through those hooks)
        self.engine: Dict[str, Any] = {}  # the engine that keeps the gradients, and what that changes (header)
        self.first_device = next((p.device for p in model.parameters()), torch.device("cpu"))
        mode = self.options["read"]
        self.read_each_step = mode == "step" or (mode == "auto" and self.first_device.type in ("cpu", "meta"))
        # the skip defence (policy "skip"): see _arm_skip
        self.skip_codes = options_mod.skip_codes(self.options["policy"])
        self.skipped: List[Dict[str, Any]] = []  # every skipped step: {"step", "reasons", "by", "consecutive"}
        self.last_step_skipped = False  # custom loops: step the scheduler only when this is False
        self._skip_by: Optional[str] = None  # "monitor" (the optimizer's step is not called) or "deepspeed"
        self._skip_step: Optional[int] = None  # the step whose update is dropped, decided before the update
        self._consecutive_skips = 0
        self._spiking: Dict[str, int] = {}  # spike code -> the last step whose value was above its threshold
        self._outer_optimizer = optimizer
        self._restore_step = None  # (optimizer, its own step attribute or None, our wrapper) while wrapped
        self._last_view: Optional["StepView"] = None  # the view of the step being judged (skip decisions)
        self.hooks_updates = False  # an optimizer step post-hook is registered (the update statistics)
        self.eval_forwards = 0  # forwards with gradients on while the model is in eval mode, this step
        if self.skip_codes:
            self.read_each_step = True  # a skip is decided before the update: one read per step (opt-in cost)
        path = self.options["log"] or parse_monitor_log()
        self.writer = JsonlWriter(path, self.rank, self.world) if path else None
        from .detectors import build

        self.detectors = build(self)
        self._attach(optimizer)
        self.begin()

    # -- attaching --------------------------------------------------------------------------------

    def _attach(self, optimizer) -> None:
        model = self.model
        self._handles.append(model.register_forward_pre_hook(self._pre_hook, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._post_hook, with_kwargs=True))
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps the torch one
        if inner is not None and hasattr(inner, "register_step_pre_hook"):
            self._handles.append(inner.register_step_pre_hook(self._optimizer_pre_hook))
            self.optimizer = inner
        if inner is not None and hasattr(inner, "register_step_post_hook") and self.detectors.updated:
            self._handles.append(inner.register_step_post_hook(self._optimizer_post_hook))
            self.hooks_updates = True
        self._zero = deepspeed_optimizer(model, optimizer)
        if self._zero is not None:
            self._attach_deepspeed()
        elif self.world > 1 and self.options["localize"] and _sharded(model):
            # FSDP: a re-run's forward gathers the sharded parameters, a collective: one rank re-running alone
            # hangs or breaks the process group (seen on gloo: "collective mismatch"). As under ZeRO-3, the ranks
            # agree before re-running (at a step whose global gradient norm is not finite).
            self._rerun_together = True
            note = ("localize under sharded parameters (FSDP): a re-run gathers them, so it runs only where every "
                    "rank re-runs its batch the same way; otherwise the finding names no module")
            self.engine.setdefault("notes", []).append(note)
            if self.rank == 0:
                log.info("%s", note)
        if self.skip_codes:
            self._arm_skip(optimizer)
        _watch_clipping(self, True)

    def _attach_deepspeed(self) -> None:
        """DeepSpeed moves each gradient into its partitioned buffers as it arrives and leaves ``p.grad`` None:
        for the first ``grad_steps`` steps a hook on each trainable parameter notes that a gradient reached it
        (a host flag, no device work; :meth:`has_grad`), then the hooks go. The gradient norm is the engine's.
        Under ZeRO-3 the parameters are partitioned too: a re-run of one rank's batch gathers them (a collective),
        so localization re-runs only where the ranks agree (:meth:`_agree_on_rerun`), and the monitor says so
        now; what cannot work here (no norm computed) is a warning now, not silence later."""
        zero = self._zero
        stage = 3 if any(hasattr(p, "ds_id") for p in self.model.parameters()) else None
        if stage is None:
            stage = getattr(zero, "zero_stage", None) or (2 if getattr(zero, "partition_gradients", False) else None)
        notes = []
        no_norm = getattr(zero, "compute_grad_norm", True) is False
        if no_norm:
            notes.append("DeepSpeed computes no gradient norm here (zero_optimization.compute_grad_norm=false): "
                         "grad_norm stays empty, grad_norm_spike and nonfinite_grad cannot fire")
        if self.options["localize"] and stage == 3 and self.world > 1:
            if no_norm:
                self.options["localize"] = False
                notes.append("localize is off under DeepSpeed ZeRO-3 without a gradient norm: re-running one rank's "
                             "batch gathers the partitioned parameters, a collective the other ranks would not join")
            else:  # the global norm is the same on every rank: a non-finite one is a step every rank looks at
                self._rerun_together = True
                notes.append("localize under DeepSpeed ZeRO-3: a re-run gathers the partitioned parameters, so it "
                             "runs only where every rank re-runs its batch the same way (the ranks agree at the step "
                             "whose global gradient norm is not finite); otherwise the finding names no module")
        if stage == 3 and "packing_contaminated" in self.detectors.by_code:  # detectors/packing.py says why
            notes.append("packing_contaminated is not judged under DeepSpeed ZeRO-3: its two extra forwards would go "
                         "through the engine's parameter gathering and break the run's next backward; the packing "
                         "does not depend on the engine: run the check on one process (the same model and collator)")
        self.engine = {"name": "deepspeed", "zero_stage": stage, "optimizer": type(zero).__name__, "notes": notes}
        if self.rank == 0:
            for note in notes:  # what cannot work is a warning; how localize works under ZeRO-3 is information
                if not note.startswith("packing_contaminated"):  # logged at the first packed row, where it matters
                    (log.info if note.startswith("localize under") else log.warning)("%s", note)
        for p in self.model.parameters():
            if p.requires_grad:
                self._grad_hooks.append(p.register_hook(self._grad_arrived(id(p))))

    def _grad_arrived(self, key: int):
        seen = self._grad_seen

        def hook(grad):
            if not self._busy:
                seen.add(key)
            return None

        return hook

    def has_grad(self, p) -> bool:
        """Whether parameter ``p`` got a gradient in the step being judged (before the update): ``p.grad``, or,
        where the engine keeps gradients elsewhere (DeepSpeed), the monitor's own note that one reached it.
        Meaningful in the ``grads`` moment of the first ``grad_steps`` optimizer steps."""
        return p.grad is not None or id(p) in self._grad_seen

    def _drop_grad_hooks(self) -> None:
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks.clear()

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._restore_step is not None:
            owner, original, ours = self._restore_step
            self._restore_step = None
            if owner.__dict__.get("step") is ours:  # else something wrapped it since (a scheduler): ours stays, inert
                if original is None:
                    owner.__dict__.pop("step", None)
                else:
                    owner.step = original
        self._drop_grad_hooks()
        _watch_clipping(self, False)

    # -- the per-step hooks (device work only) ----------------------------------------------------

    def _training_forward(self, module) -> bool:
        import torch

        return not self._busy and not self._closed and module.training and torch.is_grad_enabled()

    def _pre_hook(self, module, args, kwargs):
        if not self._training_forward(module):
            if not module.training and not self._busy and not self._closed:
                import torch

                if torch.is_grad_enabled():  # a forward that builds a graph, in eval mode: model_in_eval_mode's
                    self.eval_forwards += 1
            return None
        micro = Micro(self.step, self._index, (args, kwargs))
        self._index += 1
        inputs = inputs_of(args, kwargs)
        if inputs.get("num_items_in_batch") is not None:
            micro.ints["num_items"] = inputs["num_items_in_batch"]
        for detector in self.detectors.batch:
            detector.batch(self, inputs, micro)
        self._pending.append(micro)
        self._held.append(micro)
        if len(self._held) > KEEP_BATCHES:
            self._held.pop(0).call = None  # its batch is no longer held: nothing keeps those tensors alive
        return None

    def _post_hook(self, module, args, kwargs, output):
        if not self._training_forward(module) or not self._pending:
            return None
        micro = self._pending[-1]
        loss = output.get("loss") if hasattr(output, "get") else None
        if loss is not None and hasattr(loss, "detach") and loss.numel() == 1:
            micro.floats["loss"] = loss.detach()
        for detector in self.detectors.output:
            detector.output(self, micro, output)
        return None

    def _optimizer_post_hook(self, optimizer, args, kwargs):
        """Right after the update (not called for a step the skip defence dropped): the update statistics."""
        if not self._busy and not self._closed:
            for detector in self.detectors.updated:
                detector.updated(self)
        return None

    def _optimizer_pre_hook(self, optimizer, args, kwargs):
        if not self._busy and not self._closed:
            self.pre_update()
        return None

    def pre_update(self) -> None:
        """Gradients complete, weights not updated yet (the optimizer's step pre-hook, the Trainer's
        ``on_pre_optimizer_step``): the gradient checks, and the read when reading every step."""
        if self._grads_done_for == self.step:
            return
        self._grads()
        if self.read_each_step:
            self.read()
        if self._skip_by == "monitor":
            self._decide_skip()

    def _grads(self) -> None:
        """Once per optimizer step, while the gradients exist: the grad norm (device) and the per-step grad checks."""
        self._grads_done_for = self.step
        import torch

        floats = self._step_floats.setdefault(self.step, {})
        clipped, self._clip_norm = self._clip_norm, None
        grads = []
        if clipped is not None and clipped[0] == self.step:
            floats["grad_norm"] = clipped[1]  # the norm clip_grad_norm_ computed before clipping
        elif self._zero is not None:  # the engine's global norm, before clipping (p.grad is None there)
            norm = getattr(self._zero, "_global_grad_norm", None)
            if norm is not None:
                floats["grad_norm"] = norm.detach() if hasattr(norm, "detach") else float(norm)
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if grads:
            get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
            if get_total_norm is not None:
                floats["grad_norm"] = get_total_norm(grads, 2.0, False, None).detach()
            else:  # torch < 2.6
                floats["grad_norm"] = torch.linalg.vector_norm(torch.stack([g.detach().float().norm() for g in grads]))
        group = getattr(self.optimizer, "param_groups", None)
        if group:
            lr = group[0].get("lr")
            floats["lr"] = lr if hasattr(lr, "detach") else float(lr) if lr is not None else None  # a tensor lr stays on the device
        for detector in self.detectors.grads:
            detector.grads(self)

    # -- the skip defence (policy "skip") ---------------------------------------------------------

    def _arm_skip(self, optimizer) -> None:
        """Arm policy ``"skip"``. Where the optimizer is a torch optimizer, its ``step`` is wrapped (an instance
        attribute, removed at :meth:`detach`): before the update, with the gradients complete, the step's loss,
        gradient norm and spike judgements are read (one read per step: the defence's cost) and, where a skip
        code saw its symptom on *any* rank (one ``all_reduce`` MAX of a flag per step in a distributed run), the
        update is not applied: the optimizer's ``step`` is not called (weights and optimizer state stay as they
        were), the gradients are dropped, and under accelerate the step counts as skipped
        (``optimizer_step_was_skipped``), so the Trainer and accelerate hold the learning-rate scheduler, as for
        an fp16 overflow. Under DeepSpeed the engine skips a step whose global gradient norm is not finite
        itself: the monitor turns that check on where it is off (ZeRO-1/2) and records DeepSpeed's skips;
        it never skips a second time. Under a GradScaler (fp16), the scaler skips non-finite steps itself."""
        if self._zero is not None:
            spikes = sorted(self.skip_codes - {"nonfinite_loss", "nonfinite_grad"})
            if spikes:
                raise ValueError(f"options['policy']: 'skip' for {', '.join(spikes)} cannot work under DeepSpeed: the "
                                 "engine applies the update inside backward(), before a spike can be judged; "
                                 "allowed there: 'skip' for nonfinite_loss / nonfinite_grad (DeepSpeed's own skip)")
            # ZeRO-1/2: off in fp32 (the engine's choice; only a non-finite norm, when computed, skips) and where a
            # bf16 config turns it off; ZeRO-3 checks the norm always
            if getattr(self._zero, "check_grad_overflow", True) is False:
                self._zero.check_grad_overflow = True
                self.engine.setdefault("notes", []).append(
                    "policy skip: DeepSpeed's overflow check (check_grad_overflow) turned on, so that the engine skips "
                    "a step whose gradients are not finite")
            self._skip_by = "deepspeed"
            return
        if getattr(optimizer, "scaler", None) is not None:  # accelerate's AcceleratedOptimizer with a GradScaler
            self._skip_by = None
            note = ("policy skip: fp16 loss scaling (a GradScaler) skips every step with non-finite gradients itself "
                    "and lowers the scale; the monitor adds no skip")
            self.engine.setdefault("notes", []).append(note)
            if self.rank == 0:
                log.info("%s", note)
            return
        inner = self.optimizer
        if inner is None or not callable(getattr(inner, "step", None)):
            raise ValueError("options['policy']: 'skip' needs the optimizer, to leave its step out: "
                             "Monitor(model, optimizer, policy={...})")
        original = inner.__dict__.get("step")  # an instance attribute already there (an LR scheduler's wrapper)
        wrapped = inner.step

        def step(optimizer, *args, **kwargs):
            if self._closed:
                return wrapped(*args, **kwargs)
            if not self._busy:
                self.pre_update()  # a no-op when the step pre-hook or the Trainer's event already ran it
            skip = self._skip_step is not None and self._skip_step == self.step
            self._hold_schedule(skip)
            self.last_step_skipped = skip
            if skip:
                optimizer.zero_grad(set_to_none=True)  # the poisoned gradients are dropped, on every rank
                return None
            return wrapped(*args, **kwargs)

        # a bound method, as torch's LR schedulers expect when they wrap optimizer.step (step.__func__)
        inner.step = types.MethodType(step, inner)
        self._restore_step = (inner, original, inner.step)
        self._skip_by = "monitor"

    def note_spike(self, code: str, step: int) -> None:
        """A spike detector saw a value above its threshold at ``step`` (policy "skip" drops that update)."""
        self._spiking[code] = step

    def _local_skip_reasons(self) -> List[str]:
        view = self._last_view
        if view is None or view.step != self.step:
            return []
        reasons = []
        losses = [v["loss"] for v in view.values if v.get("loss") is not None]
        loss_bad = any(not math.isfinite(loss) for loss in losses)
        norm_bad = view.grad_norm is not None and not math.isfinite(view.grad_norm)
        if loss_bad and "nonfinite_loss" in self.skip_codes:
            reasons.append("nonfinite_loss")
        elif norm_bad and not loss_bad and "nonfinite_grad" in self.skip_codes:
            reasons.append("nonfinite_grad")
        elif loss_bad or norm_bad:  # e.g. skip for nonfinite_grad only, and the loss is NaN: its gradient is too
            if self.skip_codes & {"nonfinite_loss", "nonfinite_grad"}:
                reasons.append("nonfinite_loss" if loss_bad else "nonfinite_grad")
        for code in ("loss_spike", "grad_norm_spike"):
            if code in self.skip_codes and self._spiking.get(code) == self.step:
                reasons.append(code)
        return reasons

    def _decide_skip(self) -> None:
        """Before the update of ``self.step``: skip it where any rank saw a skip code's symptom."""
        reasons = self._local_skip_reasons()
        flags = sum(1 << options_mod.SKIPPABLE.index(code) for code in reasons)
        if self.world > 1:
            flags = self._agree(flags)
            reasons = [code for i, code in enumerate(options_mod.SKIPPABLE) if flags & (1 << i)]
        if flags:
            self._skip_step = self.step
            self._record_skip(reasons, "monitor")
        else:
            self._consecutive_skips = 0

    def _agree(self, flags: int) -> int:
        """Every rank's skip flags, OR-ed (an all_reduce MAX per bit: one collective of a few ints per step)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return flags
        backend = str(dist.get_backend()).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
        bits = torch.tensor([(flags >> i) & 1 for i in range(len(options_mod.SKIPPABLE))], dtype=torch.int32, device=device)
        dist.all_reduce(bits, op=dist.ReduceOp.MAX)
        return sum(int(b) << i for i, b in enumerate(bits.tolist()))

    def _deepspeed_skipped(self) -> None:
        """After DeepSpeed's step: the ZeRO optimizer's ``overflow`` (a host flag) says whether the engine skipped
        the update (a non-finite global gradient norm; fp16 loss-scale overflows too). Recorded once, as DeepSpeed's."""
        if not bool(getattr(self._zero, "overflow", False)):
            self._consecutive_skips = 0
            return
        scaler = type(getattr(self._zero, "loss_scaler", None)).__name__
        if scaler == "DynamicLossScaler" or getattr(self._zero, "dynamic_loss_scale", False):
            # fp16 loss scaling: DeepSpeed lowers the scale and skips; its own limit (the minimum scale) applies
            self._record_skip(["fp16_overflow"], "deepspeed", counted=False)
            return
        self._record_skip(["nonfinite_grad"], "deepspeed")

    def _record_skip(self, reasons: List[str], by: str, counted: bool = True) -> None:
        if counted:
            self._consecutive_skips += 1
        record = {"step": int(self.step), "reasons": list(reasons), "by": by, "consecutive": self._consecutive_skips}
        self.skipped.append(record)
        if self.writer is not None:
            self.writer.skip(record)
        limit = self.options["max_skips"]
        what = ("not applied: weights and optimizer state unchanged, gradients dropped" if by == "monitor" else
                "skipped by DeepSpeed (its overflow check), recorded by the monitor")
        if self.rank == 0:
            log.warning("step %d: the update was %s (%s; %d consecutive, max_skips %d)", self.step, what,
                        ", ".join(reasons), self._consecutive_skips, limit)
        if counted and self._consecutive_skips >= limit:
            finding = Finding(reasons[0] if reasons[0] in options_mod.CODES else "nonfinite_grad", "error", int(self.step),
                              f"{self._consecutive_skips} consecutive updates skipped ({', '.join(reasons)}), max_skips "
                              f"{limit}: the run cannot recover by skipping; stopped with the weights of step "
                              f"{self.step - self._consecutive_skips}", [], {"skipped": self.skipped[-limit:]})
            raise MonitorError(f"ftshims.monitor {finding.line()}", finding)

    def _hold_schedule(self, skipped: bool) -> None:
        """accelerate's ``AcceleratedOptimizer`` (no GradScaler): report the step as skipped, so that the Trainer
        (``optimizer_step_was_skipped``) and ``AcceleratedScheduler`` do not step the learning-rate scheduler."""
        outer = self._outer_optimizer
        if outer is not None and outer is not self.optimizer and isinstance(getattr(outer, "_is_overflow", None), bool) \
                and getattr(outer, "scaler", None) is None:
            outer._is_overflow = skipped

    # -- custom loops -----------------------------------------------------------------------------

    def after_backward(self, loss=None) -> None:
        """After ``loss.backward()``: records ``loss`` (the one back-propagated) for this micro-batch."""
        if loss is None or not hasattr(loss, "detach"):
            return
        micro = self._pending[-1] if self._pending and self._pending[-1].step == self.step else None
        if micro is None:
            micro = Micro(self.step, self._index, None)
            self._index += 1
            self._pending.append(micro)
        micro.floats["loss"] = loss.detach().reshape(-1)[0] if loss.numel() else loss.detach()

    def after_step(self) -> None:
        """After ``optimizer.step()`` (before ``zero_grad()`` when no optimizer was given)."""
        self.pre_update()
        self.end_step()

    def end_step(self, global_step: Optional[int] = None) -> None:
        """Close the current optimizer step (the Trainer's ``on_step_end``)."""
        if self._skip_by == "deepspeed":
            self._deepspeed_skipped()
        if self.read_each_step:
            self.read()
        elif not self.in_trainer and self.step % self.options["read_every"] == 0:
            self.read()
            self.check()
        self.steps_done += 1
        self.step = (global_step if global_step is not None else self.step) + 1
        self._index = 0
        self.eval_forwards = 0
        self._grad_seen.clear()
        if self._grad_hooks and self.steps_done >= self.options["grad_steps"]:
            self._drop_grad_hooks()

    @property
    def completed_step(self) -> int:
        """The last optimizer step finished (what a periodic check between steps reports)."""
        return max(0, self.step - 1)

    def begin_step(self, global_step: int) -> None:
        """The Trainer's ``on_step_begin``: the step being accumulated is ``global_step + 1``."""
        self.step = global_step + 1
        self._index = 0

    def host_batch(self, features, batch) -> None:
        """A batch as the collator returned it, on the host (the Trainer callback's ``collate_fn`` wrapper):
        token ids checked before they reach the device; boundary-less flattened rows noted for the packing check.
        In a DataLoader worker process only the token check runs, and raises (the main process re-raises it)."""
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        tokens = self.detectors.by_code.get("token_id_out_of_range")
        if tokens is not None and ids is not None and hasattr(ids, "device") and ids.device.type == "cpu":
            if os.getpid() == self.pid:
                tokens.host_check(self, ids, "in the batch the collator returned, before it reaches the model (the "
                                  "DataLoader may fetch it a step ahead)")
            else:
                tokens.worker_check(ids)
        packing = self.detectors.by_code.get("packing_contaminated")
        if packing is not None and os.getpid() == self.pid:
            packing.note_collated(features, batch)

    def saved(self, directory: str, global_step: Optional[int] = None) -> None:
        """After a checkpoint was written to ``directory`` (the Trainer's ``on_save``; in a custom loop, after your
        ``save_pretrained``), on every rank: the files against the model in memory, and a manifest beside them."""
        if self._closed:
            return
        step = self.completed_step if global_step is None else int(global_step)
        for detector in self.detectors.saved:
            detector.saved(self, directory, step)

    def logged(self, step: int, logs: Dict[str, Any]) -> None:
        """The Trainer's ``on_log``: its numbers to the JSONL, its loss to loss_spike when the model returns none."""
        if self.writer is not None:
            self.writer.log(step, logs)
        for code in ("loss_spike", "loss_diverging"):
            detector = self.detectors.by_code.get(code)
            if detector is not None:
                detector.logged(self, step, logs)

    # -- reading ----------------------------------------------------------------------------------

    def read(self) -> None:
        """Copy every value recorded since the last read to the host (one copy per device) and judge it."""
        pending, self._pending = self._pending, []
        step_floats, self._step_floats = self._step_floats, {}
        values = _to_host(pending, step_floats)
        views: Dict[int, StepView] = {}
        for micro, host in zip(pending, values["micros"]):
            view = views.setdefault(micro.step, StepView(micro.step))
            view.micros.append(micro)
            view.values.append(host)
        for step, floats in values["steps"].items():
            view = views.setdefault(step, StepView(step))
            view.grad_norm = floats.get("grad_norm")
            view.lr = floats.get("lr")
        for step in sorted(views):
            view = views[step]
            self._last_view = view
            if self._rerun_together:
                self._agree_on_rerun(view)
            for detector in self.detectors.read:
                detector.read(self, view)
            if self.writer is not None:
                self.writer.step(view.step, view.loss, view.grad_norm, view.lr)

    def _agree_on_rerun(self, view) -> None:
        """ZeRO-3 or FSDP (sharded parameters), at a step whose global gradient norm is not finite (the same on
        every rank: every rank reads it at the same point): the ranks tell each other which re-run they would do (the batch's forward for a
        non-finite loss, forward and backward for a non-finite gradient; one ``all_gather_object``, only at such
        a step, before the first non-finite finding). Where they differ, the re-runs' collectives would not
        match: this read localizes nothing (the finding names no module)."""
        norm = view.grad_norm
        if norm is None or math.isfinite(norm) or self.seen("nonfinite_loss") or self.seen("nonfinite_grad"):
            return
        import torch.distributed as dist

        losses = [v["loss"] for v in view.values if v.get("loss") is not None]
        path = "forward" if any(not math.isfinite(loss) for loss in losses) else "backward"
        gathered: List[Any] = [None] * self.world
        dist.all_gather_object(gathered, path)
        self.options["localize"] = len(set(gathered)) == 1
        if not self.options["localize"] and self.rank == 0:
            log.warning("step %d: the ranks would re-run different passes (%s): not localized (sharded parameters: "
                        "DeepSpeed ZeRO-3 / FSDP)",
                        view.step, ", ".join(f"rank {r}: {p}" for r, p in enumerate(gathered)))

    def check(self) -> None:
        """The periodic checks (frozen-parameter checksums): at logging steps, every read_every steps, at close."""
        for detector in self.detectors.check:
            detector.check(self)

    # -- findings ---------------------------------------------------------------------------------

    def report(self, code: str, step: int, message: str, candidates=(), detail=None, once: bool = True) -> Optional[Finding]:
        """Record a finding (once per code unless ``once=False``): log it, write it, raise it if its policy says so."""
        if code in self.options["off"] or (once and self._count.get(code)):
            return None
        explains, applied, tail = catalogue.explain(candidates)
        detail = _jsonable(dict(detail or {}))
        detail["applied"] = applied
        severity = options_mod.CODES[code][0]
        finding = Finding(code, severity, int(step), f"{message}; {tail}", explains, detail)
        self.findings.append(finding)
        self._count[code] = self._count.get(code, 0) + 1
        if self.rank == 0:
            (log.warning if severity != options_mod.INFO else log.info)("%s", finding.line())
        if self.writer is not None:
            self.writer.finding(finding)
        if self.options["policy"][code] == "raise":
            raise MonitorError(f"ftshims.monitor {finding.line()}", finding)
        return finding

    def seen(self, code: str) -> int:
        return self._count.get(code, 0)

    # -- begin / end ------------------------------------------------------------------------------

    def begin(self) -> None:
        header = {"options": options_mod.public(self.options), "model": type(self.model).__name__}
        if self.engine:
            header["engine"] = self.engine
        fingerprint = _fingerprint()
        header.update(fingerprint)
        if self.rank == 0 and "fingerprint" in fingerprint:
            log.info("watching %s; ftshims fingerprint %s", type(self.model).__name__,
                     fingerprint["fingerprint"].get("hash"))
        if self.writer is not None:
            self.writer.header(header)
        for detector in self.detectors.begin:
            detector.begin(self)

    def summary(self) -> str:
        skipped = ""
        if self.skipped:
            steps = ", ".join(str(s["step"]) for s in self.skipped[:12]) + (" ..." if len(self.skipped) > 12 else "")
            skipped = f"; {len(self.skipped)} update{'s' if len(self.skipped) != 1 else ''} skipped (step {steps})"
        if not self.findings:
            return f"no findings in {self.steps_done} steps{skipped}"
        codes = ", ".join(f"{f.code} (step {f.step})" for f in self.findings[:12])
        more = f" and {len(self.findings) - 12} more" if len(self.findings) > 12 else ""
        return (f"{len(self.findings)} finding{'s' if len(self.findings) != 1 else ''} in {self.steps_done} steps: "
                f"{codes}{more}{skipped}")

    def close(self) -> str:
        """Read what is left, run the end-of-run checks, log and write the summary, remove the hooks."""
        if self._closed:
            return self.summary()
        try:
            self.read()
            self.check()
            for detector in self.detectors.close:
                detector.close(self)
        finally:
            self._closed = True
            self.detach()
            per_rank = _gather_codes(self)
            text = self.summary()
            if self.rank == 0:
                if per_rank and any(per_rank[1:]):
                    text += "; other ranks: " + "; ".join(
                        f"rank {r}: {', '.join(codes) or 'none'}" for r, codes in enumerate(per_rank) if r)
                log.warning("%s", text) if self.findings or (per_rank and any(per_rank)) else log.info("%s", text)
            if self.writer is not None:
                self.writer.summary(self, per_rank)
                self.writer.close()
        return text


# ---------------------------------------------------------------------------------------------------


def _to_host(pending: List[Micro], step_floats: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """Host values of every micro-batch and step: one stacked copy per device and kind (int64 / float32)."""
    import torch

    slots = []  # (where, key, tensor, kind)
    micros: List[Dict[str, Any]] = [{} for _ in pending]
    steps: Dict[int, Dict[str, Any]] = {step: {} for step in step_floats}
    for i, micro in enumerate(pending):
        for kind, table in (("i", micro.ints), ("f", micro.floats)):
            for key, value in table.items():
                if torch.is_tensor(value):
                    slots.append((micros[i], key, value, kind))
                else:
                    micros[i][key] = value
    for step, table in step_floats.items():
        for key, value in table.items():
            if torch.is_tensor(value) and hasattr(value, "full_tensor"):  # a DTensor norm (FSDP2): its global value
                value = value.full_tensor()  # a collective when partial; every rank reads at the same points
            if torch.is_tensor(value):
                slots.append((steps[step], key, value, "f"))
            else:
                steps[step][key] = value
    groups: Dict[Any, list] = {}
    for slot in slots:
        groups.setdefault((slot[2].device, slot[3]), []).append(slot)
    for (device, kind), group in groups.items():
        if device.type == "cpu":  # nothing to copy: read each value as it is
            for target, key, tensor, _ in group:
                target[key] = tensor.reshape(-1)[0].item()
            continue
        dtype = torch.int64 if kind == "i" else torch.float32
        stacked = torch.stack([t.detach().reshape(-1)[0].to(dtype) for _, _, t, _ in group])
        for (target, key, _, _), value in zip(group, stacked.tolist()):  # the one device-to-host copy of this group
            target[key] = value
    return {"micros": micros, "steps": steps}


def _fingerprint() -> Dict[str, Any]:
    import ftshims

    if not hasattr(ftshims, "fingerprint"):
        return {}
    try:
        return {"fingerprint": ftshims.fingerprint()}
    except Exception as exc:  # the header says why instead of losing the run's monitor
        return {"fingerprint_error": f"{type(exc).__name__}: {exc}"}


def _gather_codes(mon: Monitor) -> Optional[List[List[str]]]:
    """Every rank's finding codes, on every rank (a collective: close() runs on every rank), or None alone."""
    if mon.world <= 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    gathered: List[Any] = [None] * mon.world
    dist.all_gather_object(gathered, [f.code for f in mon.findings])
    return gathered


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
