"""accelerate_dispatch_resume_epoch: a DataLoaderDispatcher made by skip_first_batches passes set_epoch on to the
seedable sampler behind its SkipBatchSampler, so a mid-epoch resume replays the right shuffle; loaders without a
skip, shard loaders and iterable datasets are untouched."""

import os
import pickle
import tempfile

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry
from ftshims.probing import in_affected_range

SHIM = "accelerate_dispatch_resume_epoch"
shim_module = registry.get(SHIM).module


def test_dispatcher_skip_then_set_epoch(evidence):
    """transformers 5.x's order: the skipped dispatcher's set_epoch(1) never reached the sampler."""
    assert_bug_and_fix(SHIM, evidence, "dispatch_batches, skip then set_epoch")


@pytest.mark.parametrize("dispatch,order", [(True, "set_epoch_then_skip"), (False, "skip_then_set_epoch"),
                                            (False, "set_epoch_then_skip")])
def test_other_orders_and_shard_loaders_are_healthy(evidence, dispatch, order):
    assert_bug_and_fix(SHIM, evidence, f"dispatch={dispatch}, {order} (healthy)", expect_bug=False,
                       dispatch=dispatch, order=order)


@pytest.fixture
def affected():
    if not in_affected_range(SHIM)[0]:
        pytest.skip("outside the shim's range")
    from accelerate.state import PartialState

    PartialState()


def _epochs(loader, epochs=(0, 1, 2)):
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        out.append(([b.tolist() for b in loader], loader.iteration))
    return out


def test_loaders_without_a_skip_are_bit_identical(affected):
    """Plain dispatcher and shard loaders over three epochs, and a dispatcher over an iterable dataset
    skipped mid-epoch: the same batches and iteration counters with the shim, and it never acts."""
    import torch
    from accelerate.data_loader import prepare_data_loader, skip_first_batches
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    def runs():
        torch.manual_seed(0)
        made = [shim_module._loader(True), shim_module._loader(False)]
        out = [_epochs(loader) for loader in made]
        stream = prepare_data_loader(DataLoader(Stream(), batch_size=2), device=torch.device("cpu"),
                                     dispatch_batches=True, put_on_device=True)
        resumed = skip_first_batches(stream, 2)
        resumed.set_epoch(1)
        out.append([b.tolist() for b in resumed])
        return out

    plain = runs()
    with ftshims.applied(only=[SHIM]) as report:
        assert report[SHIM].active, report[SHIM].reason
        shimmed = runs()
        assert ftshims.status()[SHIM].actions == {}
    assert shimmed == plain


def test_reverts_to_the_original_method(affected):
    from accelerate.data_loader import DataLoaderDispatcher

    original = vars(DataLoaderDispatcher)["set_epoch"]
    with ftshims.applied(only=[SHIM]):
        assert vars(DataLoaderDispatcher)["set_epoch"] is not original
    assert vars(DataLoaderDispatcher)["set_epoch"] is original


def _train(out, seen, resume=None):
    import torch
    from transformers import Trainer, TrainingArguments

    from ftshims import tiny

    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": torch.tensor([i + 3, 5, 6]), "idx": i}

    def collate(rows):
        seen.append([r["idx"] for r in rows])
        ids = torch.stack([r["input_ids"] for r in rows])
        return {"input_ids": ids, "labels": ids}

    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, num_train_epochs=2, save_steps=5,
                             save_strategy="steps", report_to=[], use_cpu=True, logging_steps=100, seed=0,
                             disable_tqdm=True, remove_unused_columns=False,
                             accelerator_config={"dispatch_batches": True})
    with tiny.quiet():
        Trainer(model=tiny.tiny_llama(), args=args, train_dataset=Items(), data_collator=collate).train(
            resume_from_checkpoint=resume)
    return seen


def test_trainer_resume_with_dispatch_batches(affected):
    """A Trainer with dispatch_batches=True, 4 steps an epoch, resumed from the checkpoint of step 5 (epoch 1):
    with the shim the resumed steps see the batches of the uninterrupted run (without it, on transformers 5.x,
    they do not: its Trainer skips before set_epoch)."""
    from packaging.version import Version

    from ftshims.versions import installed_version

    with tempfile.TemporaryDirectory() as out:
        full = _train(out, [])[5:]
        try:
            plain = _train(out, [], resume=os.path.join(out, "checkpoint-5"))
        except pickle.UnpicklingError as exc:  # no resume at all: nothing for the shim to fix or harm here
            pytest.skip(f"transformers {installed_version('transformers')} cannot resume under torch >= 2.6 "
                        f"(its rng-state torch.load meets weights_only=True): {str(exc).splitlines()[0]}")
        with ftshims.applied(only=[SHIM]):
            shimmed = _train(out, [], resume=os.path.join(out, "checkpoint-5"))
    assert shimmed == full
    if Version(installed_version("transformers")) >= Version("5.9"):
        assert plain != full
