"""A dispatching data loader resumed mid-epoch replays the wrong epoch's shuffle (accelerate >= 1.15).

Why: resuming in the middle of epoch ``k`` builds a fresh loader with ``skip_first_batches``, whose batch
sampler is a ``SkipBatchSampler`` around the original one. ``DataLoaderShard.set_epoch`` reaches the
shuffling sampler through it (``batch_sampler.batch_sampler.sampler``); ``DataLoaderDispatcher.set_epoch``
(``dispatch_batches=True``) only looks at ``batch_sampler.sampler``, which a ``SkipBatchSampler`` does not
have, and then at the dataset. So after the skip, ``set_epoch(k)`` (and the ``set_epoch(self.iteration)``
every ``__iter__`` starts with) never reaches accelerate's ``SeedableRandomSampler`` (the default): in a
fresh process it still has epoch 0, and the rest of epoch ``k`` is drawn from epoch 0's permutation. Some
samples of that epoch are trained twice, others not at all, and the resumed run differs from the
uninterrupted one. transformers 5.x's ``Trainer`` calls ``skip_first_batches`` first and ``set_epoch``
after (4.x did it the other way round), so every mid-epoch resume with
``accelerator_config={"dispatch_batches": True}`` and a map-style dataset hits it. accelerate PR #4071
(1.15.0) fixed the other order for ``DataLoaderShard`` (the skipped loader now carries ``iteration``) and
left the dispatcher's ``set_epoch`` "for a next PR"; it is unchanged in 1.16.0, the newest release.

The fix: wrap ``DataLoaderDispatcher.set_epoch``. When the loader's batch sampler is a ``SkipBatchSampler``
whose inner batch sampler has a ``sampler`` with ``set_epoch``, it does what ``set_epoch`` does on the loader
the skip was made from: record the epoch in ``iteration`` and call the sampler's ``set_epoch``. Any other
loader (no skip, an iterable dataset, a sampler without ``set_epoch``) goes to the original unchanged.

Applies to accelerate >=1.15.0 (no fixed release yet). Before 1.15.0 ``skip_first_batches`` does not carry
``iteration`` to the new loader, whose ``__iter__`` then calls ``set_epoch(0)``: reaching the sampler there
would break the 4.x order, which works on those versions by accident (the sampler keeps the epoch the
original loader set), so the shim stays out and the advisory
``accelerate_resume_epoch_lost_before_1_15`` covers those versions. Fallback: a ``set_epoch`` without an
``epoch`` parameter, or a missing ``SkipBatchSampler``, leaves the shim skipped (target missing).
"""

from __future__ import annotations

import sys

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

SPEC = ShimSpec(
    id="accelerate_dispatch_resume_epoch",
    since="0.2.0",
    title="DataLoaderDispatcher.set_epoch does not reach the sampler after skip_first_batches",
    symptom="resume mid-epoch with dispatch_batches=True (transformers 5.x Trainer, or skip then set_epoch): the "
    "rest of the epoch comes from epoch 0's shuffle; samples repeated or skipped, the resumed run differs",
    why="accelerate's DataLoaderDispatcher.set_epoch looks for batch_sampler.sampler, which the SkipBatchSampler of "
    "a resumed loader lacks, so the seedable sampler keeps epoch 0 and the resumed epoch replays the wrong shuffle. "
    "The shim sets the epoch on the sampler behind the skip, as DataLoaderShard.set_epoch does.",
    requires={"accelerate": ">=1.15.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/accelerate/pull/4071",
    ),
    targets=(Target("accelerate.data_loader", "DataLoaderDispatcher.set_epoch", params=("epoch",)),),
    modules=("accelerate.data_loader",),
)


def skipped_sampler(loader):
    """The shuffling sampler behind ``loader``'s ``SkipBatchSampler`` when its ``set_epoch`` cannot reach it; else None."""
    data_loader = sys.modules.get("accelerate.data_loader")
    skip_class = getattr(data_loader, "SkipBatchSampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    if skip_class is None or not isinstance(batch_sampler, skip_class) or hasattr(batch_sampler, "sampler"):
        return None
    sampler = getattr(getattr(batch_sampler, "batch_sampler", None), "sampler", None)
    return sampler if callable(getattr(sampler, "set_epoch", None)) else None


def _set_epoch(wrapped, instance, args, kwargs):
    sampler = skipped_sampler(instance)
    if sampler is None or len(args) + len(kwargs) != 1:
        return wrapped(*args, **kwargs)
    epoch = args[0] if args else kwargs["epoch"]
    # What set_epoch does on the loader the skip was made from (its first branch, the sampler's).
    if instance.iteration != epoch:
        instance.iteration = epoch
    sampler.set_epoch(epoch)
    acted(SPEC.id, "epochs set on the sampler behind a skip")


def install(patcher, options) -> None:
    data_loader = sys.modules["accelerate.data_loader"]
    if not isinstance(getattr(data_loader, "SkipBatchSampler", None), type):
        raise TargetMissing("accelerate.data_loader.SkipBatchSampler is missing")
    patcher.wrap_method("accelerate.data_loader", "DataLoaderDispatcher.set_epoch", _set_epoch)


# ---------------------------------------------------------------------------
# Reproduction


def _loader(dispatch: bool):
    import torch
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader

    base = DataLoader(list(range(16)), batch_size=2, shuffle=True)
    return prepare_data_loader(base, device=torch.device("cpu"), dispatch_batches=dispatch, put_on_device=True,
                               use_seedable_sampler=True, data_seed=42)


def probe(dispatch: bool = True, order: str = "skip_then_set_epoch", skip: int = 3) -> Observation:
    """16 items, batches of 2, accelerate's seedable shuffle. Epochs 0 and 1 run through one loader; then a
    fresh loader (a resumed process) skips ``skip`` batches of epoch 1, with ``set_epoch(1)`` after the skip
    (``order="skip_then_set_epoch"``, transformers 5.x's Trainer) or before it (``"set_epoch_then_skip"``,
    4.x's). The bug: the resumed batches are not the rest of the uninterrupted epoch 1."""
    from packaging.version import Version

    from ..versions import installed_version

    if Version(installed_version("accelerate") or "0") < Version("1.15.0"):
        raise ProbeUnsupported("accelerate <1.15 does not carry the epoch to a skipped loader (advisory "
                               "accelerate_resume_epoch_lost_before_1_15); this shim starts at 1.15.0")
    from accelerate.data_loader import skip_first_batches
    from accelerate.state import PartialState

    PartialState()
    loader = _loader(dispatch)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([batch.tolist() for batch in loader])
    fresh = _loader(dispatch)
    if order == "set_epoch_then_skip":
        fresh.set_epoch(1)
        resumed = skip_first_batches(fresh, skip)
    else:
        resumed = skip_first_batches(fresh, skip)
        resumed.set_epoch(1)
    got = [batch.tolist() for batch in resumed]
    want = epochs[1][skip:]
    seen = sorted(i for batch in epochs[1][:skip] + got for i in batch)
    detail = (f"{type(loader).__name__}, {order}: resumed epoch 1 after {skip} batches {got}, uninterrupted {want}; "
              f"{len(seen) - len(set(seen))} sample(s) seen twice in the epoch")
    return Observation(got != want, detail)
