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
"""

from __future__ import annotations

import logging
import math
import os
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


_CLIPPING = {"patcher": None, "monitors": []}  # the clip_grad_norm_ wrapper, shared by the live monitors


def _clip_grad_norm_(wrapped, instance, args, kwargs):
    """``torch.nn.utils.clip_grad_norm_``: the total norm it returns (before clipping; a device tensor, kept
    as it is) is the step's gradient norm for every live monitor. After clipping, the monitor's own norm would
    only show the clipped value."""
    total = wrapped(*args, **kwargs)
    if hasattr(total, "detach"):
        for monitor in list(_CLIPPING["monitors"]):
            monitor._clip_norm = (monitor.step, total.detach())
    return total


def _watch_clipping(monitor, on: bool) -> None:
    """Wrap ``torch.nn.utils.clip_grad_norm_`` (through ftshims' Patcher) while at least one monitor is live."""
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
            _CLIPPING["patcher"] = patcher
        elif not watching and _CLIPPING["patcher"] is not None:
            _CLIPPING["patcher"].undo()
            _CLIPPING["patcher"] = None


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
        self._handles: List[Any] = []
        self.first_device = next((p.device for p in model.parameters()), torch.device("cpu"))
        mode = self.options["read"]
        self.read_each_step = mode == "step" or (mode == "auto" and self.first_device.type in ("cpu", "meta"))
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
        _watch_clipping(self, True)

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        _watch_clipping(self, False)

    # -- the per-step hooks (device work only) ----------------------------------------------------

    def _training_forward(self, module) -> bool:
        import torch

        return not self._busy and not self._closed and module.training and torch.is_grad_enabled()

    def _pre_hook(self, module, args, kwargs):
        if not self._training_forward(module):
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

    def _grads(self) -> None:
        """Once per optimizer step, while the gradients exist: the grad norm (device) and the per-step grad checks."""
        self._grads_done_for = self.step
        import torch

        floats = self._step_floats.setdefault(self.step, {})
        clipped, self._clip_norm = self._clip_norm, None
        if clipped is not None and clipped[0] == self.step:
            floats["grad_norm"] = clipped[1]  # the norm clip_grad_norm_ computed before clipping
            grads = []
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
        if self.read_each_step:
            self.read()
        elif not self.in_trainer and self.step % self.options["read_every"] == 0:
            self.read()
            self.check()
        self.steps_done += 1
        self.step = (global_step if global_step is not None else self.step) + 1
        self._index = 0

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

    def logged(self, step: int, logs: Dict[str, Any]) -> None:
        """The Trainer's ``on_log``: its numbers to the JSONL, its loss to loss_spike when the model returns none."""
        if self.writer is not None:
            self.writer.log(step, logs)
        spike = self.detectors.by_code.get("loss_spike")
        if spike is not None:
            spike.logged(self, step, logs)

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
            for detector in self.detectors.read:
                detector.read(self, view)
            if self.writer is not None:
                self.writer.step(view.step, view.loss, view.grad_norm, view.lr)

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
        if not self.findings:
            return f"no findings in {self.steps_done} steps"
        codes = ", ".join(f"{f.code} (step {f.step})" for f in self.findings[:12])
        more = f" and {len(self.findings) - 12} more" if len(self.findings) > 12 else ""
        return f"{len(self.findings)} finding{'s' if len(self.findings) != 1 else ''} in {self.steps_done} steps: {codes}{more}"

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
