"""The training health monitor: catch the catalogue's bugs, and ones it does not know, by their symptoms in the running job.

The doctor (``python -m ftshims.doctor``) looks at a stack *before* a run; the
monitor watches the run. Each symptom is a :class:`Finding` with a stable
``code``; ``explains`` lists the catalogue entries (shims and advisories) whose
bug produces that symptom on the installed versions, and ``detail["applied"]``
says whether each is applied here::

    import ftshims.monitor
    trainer = Trainer(..., callbacks=[ftshims.monitor.callback()])   # TRL's trainers too
    trainer.train()
    # [trainable_without_grad] step 4: LoRA weights got no gradient in 4 optimizer steps: ...;
    #   lora_reentrant_checkpointing fixes this on transformers 4.57.6 and is not applied (ftshims.apply())

* ``FTSHIMS_MONITOR=1`` (or a JSON object of options) attaches it to every
  Trainer of every process through the start-up hook (LLaMA-Factory, axolotl,
  torchrun); ``FTSHIMS_MONITOR_LOG=run.jsonl`` writes JSON lines (one file per
  rank). ``ftshims.revert()`` detaches it.
* Custom loops: ``mon = Monitor(model, optimizer)``, then ``mon.after_backward(loss)``,
  ``mon.after_step()``, and ``mon.close()`` at the end.
* ``python -m ftshims.monitor report run.jsonl [--html out.html]``.

Options (:mod:`ftshims.monitor.options`, checked when given: an unknown name or
value is a ``ValueError``): ``policy`` (``"warn"``, ``"raise"`` or per code; ``"skip"``
for ``nonfinite_loss``, ``nonfinite_grad``, ``loss_spike``, ``grad_norm_spike``),
``max_skips``, ``off`` (codes), ``warmup``, ``spike_sigmas``, ``grad_steps``, ``eos_steps``,
``hash_every``, ``frozen_samples``, ``read``, ``read_every``, ``localize``, ``log``,
the data checks' thresholds, ``diverge_steps``, ``diverge_factor``, ``update_every``,
``update_ratio_min``, ``update_ratio_max``, ``lost_share``.

The skip defence (opt-in, :meth:`Monitor._arm_skip`): with ``policy={"nonfinite_loss":
"skip", ...}`` an update whose loss or gradient norm is not finite (or that spikes) is
not applied, on every rank; the Trainer's scheduler holds at that step; DeepSpeed's own
overflow skip is recorded instead of doubled. It reads one flag per step.

Cost: no host-device synchronisation per step. What runs every step is device
work only: a few reductions over the batch's label and id tensors in a forward
pre-hook, the detached loss kept by a forward hook, the gradient norm
(``torch.nn.utils.get_total_norm``) and ``p.grad is None`` checks in the
optimizer's step pre-hook, and on sampled steps the update statistics (a device
copy of 8 x 16384 sampled weight elements before the update, four scalars per
tensor after it, in the optimizer's step post-hook). The results stay on the device as 0-d tensors,
accumulated per step, until a *read point* stacks them into one tensor per
device and copies it to the host once: on an accelerator, the Trainer's logging
steps (``on_log``, right after the Trainer's own ``tr_loss.item()``
synchronisation; every ``read_every`` steps in a custom loop); on the CPU, where
reading a tensor synchronises nothing, every step (so a NaN is localized with
the weights that produced it). ``read="step"`` reads every step anywhere.
One-time checks (train begin, the first packed batch, a non-finite batch) read
what they need once. ``bench/monitor.py`` measures the overhead side by side.

Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

from .findings import Finding, MonitorError
from .options import CODES

__all__ = ["callback", "Monitor", "Finding", "MonitorError", "CODES", "attach_to_trainers", "detach_from_trainers"]


def callback(**options):
    """A ``transformers.TrainerCallback`` running the monitor: ``Trainer(..., callbacks=[callback()])``."""
    from .trainer import callback as make

    return make(**options)


def attach_to_trainers(**options) -> None:
    """Every ``Trainer`` built from now on gets ``callback(**options)`` (what ``FTSHIMS_MONITOR`` does)."""
    from .attach import attach_to_trainers as attach

    attach(**options)


def detach_from_trainers() -> None:
    from .attach import detach_from_trainers as detach

    detach()


def __getattr__(name):
    if name == "Monitor":
        from .core import Monitor

        return Monitor
    if name == "MonitorCallback":
        from .trainer import MonitorCallback

        return MonitorCallback
    raise AttributeError(f"module 'ftshims.monitor' has no attribute {name!r}")
