"""``nonfinite_loss`` / ``nonfinite_grad``, localized once, after the fact.

Every step records the loss and the gradient norm as device scalars (the norm
is NaN/inf exactly when a gradient element is). At a read, the first step with
a non-finite loss is re-run once: the same batch, one more forward under
``torch.no_grad()`` with a forward pre-hook and a forward hook on every module
(removed right after), naming the first module whose *output* is not finite
while its floating *inputs* are: where the NaN is born, not where it spreads.
A non-finite gradient norm with a finite loss re-runs the batch's forward and
backward once (``torch.autograd.grad``, no ``.grad`` touched: after
``clip_grad_norm_`` every gradient is NaN) and names the last module, in forward
order, whose parameter gradients are not finite (a NaN born in the backward of
a module spreads to the modules before it). Never hooks on every step.

Where the read is every step (the CPU, ``read="step"``) the re-run sees the
weights that produced the NaN (before the update). Where it happens at a
logging step the update already ran: if the weights are no longer finite the
finding says so and names them (what a re-run can still tell).

Explains ``expand_mask_clamp`` when the batch is padded and attention is eager
in fp16 (fp16 weights or fp16 autocast): fully masked rows overflow to ``-inf``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

from . import Detector
from .. import facts


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def _tensors(value):
    import torch

    if torch.is_tensor(value):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict) or hasattr(value, "values") and hasattr(value, "keys"):
        for item in value.values():
            yield from _tensors(item)


def _all_finite(value) -> bool:
    import torch

    for t in _tensors(value):
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return False
    return True


def localize(model, call) -> Dict[str, Any]:
    """Re-run ``call`` (the forward's ``(args, kwargs)``) with a hook on every module: where the first
    non-finite output comes from. Runs once per run; returns what it found (``{}`` when all is finite)."""
    import torch

    args, kwargs = call
    order = []  # (name, class, inputs finite, output finite) in completion order
    entered: Dict[int, bool] = {}
    handles = []

    def pre(name):
        def hook(module, a, kw):
            masks = {k: v for k, v in kw.items() if "mask" not in k}  # additive masks hold -inf by design
            entered[id(module)] = _all_finite(a) and _all_finite(masks)
        return hook

    def post(name):
        def hook(module, a, kw, out):
            order.append((name, type(module).__name__, entered.get(id(module), True), _all_finite(out)))
        return hook

    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name), with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    first_bad = next(((n, c) for n, c, _, ok in order if not ok), None)
    born = next(((n, c) for n, c, inputs_ok, ok in order if inputs_ok and not ok), None)
    if first_bad is None:
        return {}
    where = born or first_bad
    return {"module": where[0] or "(the model)", "module_class": where[1],
            "first_nonfinite_output": first_bad[0] or "(the model)", "inputs_finite": born is not None}


def grad_origin(model, call) -> Optional[Dict[str, Any]]:
    """Re-run ``call``'s forward and backward once (``torch.autograd.grad``: no ``.grad`` is touched) and name
    the modules whose parameter gradients are not finite, the last in forward order first: a NaN born in the
    backward of a module spreads to the modules before it. Fresh gradients, because the ones left after
    ``clip_grad_norm_`` are all NaN once the total norm is (it scales every gradient by it)."""
    import torch

    args, kwargs = call
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with torch.enable_grad():
        output = model(*args, **kwargs)
        loss = output.get("loss") if hasattr(output, "get") else None
        if loss is None or not loss.requires_grad:
            return None
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    bad = [name for (name, _), g in zip(named, grads) if g is not None and not bool(torch.isfinite(g).all())]
    if not bad:
        return None
    modules = list(dict.fromkeys(name.rsplit(".", 1)[0] for name in bad))
    return {"module": modules[-1], "modules_with_nonfinite_grads": modules[-10:][::-1], "parameters": len(bad)}


class NonFinite(Detector):
    codes = ("nonfinite_loss", "nonfinite_grad")

    def batch(self, mon, inputs, micro) -> None:
        if not (mon.seen("nonfinite_loss") or mon.seen("nonfinite_grad")):
            micro.host["fp16_autocast"] = _fp16_autocast()

    def read(self, mon, view) -> None:
        if mon.seen("nonfinite_loss") or mon.seen("nonfinite_grad"):
            return
        for micro, values in zip(view.micros, view.values):
            if "loss" in values and not _finite(values["loss"]):
                self._loss(mon, view, micro, values["loss"])
                return
        if view.grad_norm is not None and not _finite(view.grad_norm) and all(_finite(v.get("loss", 0.0)) for v in view.values):
            self._grad(mon, view)

    def _context(self, mon, micro) -> Dict[str, Any]:
        import torch

        model = mon.model
        dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters() if p.is_floating_point()})
        fp16 = "float16" in dtypes or bool(micro is not None and micro.host.get("fp16_autocast"))
        padded = False
        if micro is not None and micro.call is not None:
            mask = micro.call[1].get("attention_mask")
            padded = bool(torch.is_tensor(mask) and mask.dim() == 2 and bool((mask == 0).any()))
        return {"attention": facts.attn_implementation(model), "dtypes": dtypes, "fp16": fp16, "padded_batch": padded}

    def _candidates(self, context, module_class=None) -> tuple:
        """expand_mask_clamp when the batch is padded, attention eager in fp16, and the NaN (when localized)
        is born in an attention module."""
        attention_born = module_class is None or "attention" in module_class.lower() or "attn" in module_class.lower()
        if context["fp16"] and context["padded_batch"] and context["attention"] == "eager" and attention_born:
            return ("expand_mask_clamp",)
        return ()

    def _loss(self, mon, view, micro, loss) -> None:
        context = self._context(mon, micro)
        detail: Dict[str, Any] = {"loss": str(loss), **context}
        where = ""
        if mon.options["localize"]:
            held = micro if micro.call is not None and micro in mon._held else None
            poisoned = facts.nonfinite_parameters(mon.model)
            if poisoned:
                detail["nonfinite_parameters"] = poisoned
            if held is not None:
                found = self._run(mon, held)
                detail.update(found)
                if found.get("module"):
                    where = f" in {found['module']} ({found['module_class']})"
                    if poisoned:
                        where += f", whose weights were already non-finite at the re-run ({poisoned[0]} ...)"
            else:
                detail["localized"] = "the batch is no longer held (read after more than 8 micro-batches)"
        mon.report("nonfinite_loss", view.step, f"the loss is {loss}{where}",
                   self._candidates(context, detail.get("module_class")), detail)

    def _grad(self, mon, view) -> None:
        micro = view.micros[0] if view.micros else None
        context = self._context(mon, micro)
        detail: Dict[str, Any] = {"grad_norm": str(view.grad_norm), **context}
        origin = None
        if mon.options["localize"]:
            poisoned = facts.nonfinite_parameters(mon.model)
            if poisoned:
                detail["nonfinite_parameters"] = poisoned
            for held in [m for m in view.micros if m.call is not None and m in mon._held]:
                origin = self._run(mon, held, grad_origin)
                if origin:
                    break
        where = ""
        if origin and origin.get("module"):
            detail.update(origin)
            where = f"; re-run, the last module in forward order with non-finite gradients: {origin['module']}"
            if detail.get("nonfinite_parameters"):
                where += f" (weights already non-finite at the re-run: {detail['nonfinite_parameters'][0]} ...)"
        mon.report("nonfinite_grad", view.step, f"the gradient norm is {view.grad_norm} while the loss is finite{where}",
                   self._candidates(context), detail)

    def _run(self, mon, micro, how=None) -> Dict[str, Any]:
        mon._busy = True
        try:
            return (how or localize)(mon.model, micro.call) or {}
        except Exception as exc:  # noqa: BLE001 - the finding stands without its localization
            return {"localize_error": f"{type(exc).__name__}: {exc}"}
        finally:
            mon._busy = False


def _fp16_autocast() -> bool:
    """Whether the forward about to run is under fp16 autocast (a host flag, no device work)."""
    import torch

    for device in ("cuda", "cpu"):
        try:
            if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16:
                return True
        except (TypeError, AttributeError):  # torch < 2.4: only the CUDA form exists
            return torch.is_autocast_enabled() and torch.get_autocast_gpu_dtype() == torch.float16
    return False
