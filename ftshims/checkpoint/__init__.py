"""Checkpoints you can trust: what a save wrote, checked against what was in memory, and whether a resume can be exact.

Shared by the monitor (``ftshims.monitor``: each ``Trainer`` save verified while training, a manifest written
beside the files), the doctor (``python -m ftshims.doctor --checkpoint DIR``: the same checks offline) and the
resume guards among the shims:

* :mod:`ftshims.checkpoint.layout`: what a ``Trainer`` checkpoint directory holds (weights, adapter, optimizer,
  scheduler, RNG, trainer state, DeepSpeed's ``global_step*``), and what a resume from it would lack
  (a ``save_only_model`` checkpoint has no optimizer, scheduler or RNG state);
* :mod:`ftshims.checkpoint.manifest`: ``ftshims-manifest.json``, the SHA-256 and size of every file written,
  and its re-check (a changed byte names its file);
* :mod:`ftshims.checkpoint.verify`: the weights on disk against the weights in memory (a missing key, an empty
  or all-zero tensor, a changed dtype or shape), adapter config against adapter weights, tokenizer against
  embedding rows, and with ``reload`` the reloaded model's logits against the reference saved with the manifest.

Importing this package imports neither torch nor transformers.
"""

from __future__ import annotations

__all__ = ["ResumeNotExact", "MANIFEST_NAME"]

MANIFEST_NAME = "ftshims-manifest.json"


class ResumeNotExact(ValueError):
    """Raised by ftshims' resume guards before a ``Trainer`` resume that would silently differ from the
    uninterrupted run (``resume_save_only_model_restarts_lr_schedule``,
    ``resume_iterable_dataset_wrapped_pass_replays``): the message says why and what to do instead."""
