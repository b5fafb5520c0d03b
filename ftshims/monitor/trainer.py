"""The ``transformers.TrainerCallback`` that runs a :class:`~ftshims.monitor.core.Monitor` inside ``Trainer.train()``.

Works with every ``Trainer`` subclass (TRL's SFT/DPO trainers, LLaMA-Factory's,
axolotl's): it only uses the callback events and the objects they carry.

* ``on_train_begin``: a Monitor on the trainer's model and optimizer (hooks), the
  train DataLoader's ``collate_fn`` wrapped for the host-side batch checks;
* ``on_step_begin`` / ``on_pre_optimizer_step`` / ``on_step_end``: the step
  boundaries (the optimizer's own step pre-hook covers versions without
  ``on_pre_optimizer_step``);
* ``on_log``: the read point on an accelerator (the Trainer has just synchronised
  for ``tr_loss.item()``), and the periodic checks;
* ``on_save``: the checkpoint just written, verified against the model (detectors/checkpoint.py);
* ``on_train_end``: the summary; hooks and the ``collate_fn`` wrapper removed.
"""

from __future__ import annotations

import os
from typing import List

from transformers import TrainerCallback

from . import options as options_mod
from .core import Monitor
from .findings import Finding


class MonitorCallback(TrainerCallback):
    def __init__(self, **options):
        options_mod.check(options)  # a bad option raises here, when it is given
        self.given = dict(options)
        self.monitor = None
        self._earlier: List[Finding] = []
        self._collate = None

    @property
    def findings(self) -> List[Finding]:
        """Every finding of every ``train()`` this callback watched."""
        return self._earlier + (self.monitor.findings if self.monitor is not None else [])

    def on_train_begin(self, args, state, control, model=None, optimizer=None, train_dataloader=None,
                       processing_class=None, tokenizer=None, **kwargs):
        self._finish()  # a previous train() that raised never reached on_train_end
        if self.monitor is not None:
            self._earlier.extend(self.monitor.findings)
            self.monitor = None
        if model is None:
            return
        monitor = Monitor(model, optimizer, tokenizer=processing_class if processing_class is not None else tokenizer,
                          **self.given)
        monitor.in_trainer = True
        # the schedule check (detectors/schedule.py) reads these at the first optimizer step (host values only)
        monitor.trainer_context = {"args": args, "state": state, "lr_scheduler": kwargs.get("lr_scheduler")}
        monitor.begin_step(state.global_step)
        self.monitor = monitor
        self._wrap_collate(train_dataloader)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._live():
            self.monitor.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._live():
            self.monitor.pre_update()

    def on_step_end(self, args, state, control, **kwargs):
        if self._live():
            self.monitor.pre_update()  # no-op when the optimizer's hook or on_pre_optimizer_step ran
            self.monitor.end_step(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self._live():
            return
        self.monitor.logged(state.global_step, logs or {})
        if not self.monitor.read_each_step:
            self.monitor.read()
        self.monitor.check()

    def on_save(self, args, state, control, **kwargs):
        if self._live():  # the Trainer's checkpoint folder (transformers' PREFIX_CHECKPOINT_DIR)
            self.monitor.saved(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"), state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self._finish()

    # -------------------------------------------------------------------------------------------

    def _live(self) -> bool:
        return self.monitor is not None and not self.monitor._closed

    def _finish(self) -> None:
        if self._collate is not None:
            loader, original = self._collate
            self._collate = None
            loader.collate_fn = original
        if self._live():
            self.monitor.close()

    def _wrap_collate(self, loader) -> None:
        # accelerate's DataLoaderShard (>= 0.30) delegates to the DataLoader it holds: that one iterates
        loader = getattr(loader, "__dict__", {}).get("base_dataloader", loader)
        original = getattr(loader, "collate_fn", None)
        if loader is None or not callable(original):
            return
        monitor = self.monitor

        def collate(features):
            batch = original(features)
            monitor.host_batch(features, batch)
            return batch

        loader.collate_fn = collate
        self._collate = (loader, original)


def callback(**options) -> MonitorCallback:
    """``Trainer(..., callbacks=[ftshims.monitor.callback()])``; options: :mod:`ftshims.monitor.options`."""
    return MonitorCallback(**options)
