"""Shims that read user-provided examples or batches read every layout upstream accepts (issue 34).

A collator's examples come as dicts, as the ``BatchEncoding`` that ``tokenizer(text)`` returns (a Mapping, not a
dict), as lists of ids, tensors or numpy arrays; a Trainer's batches are dicts or ``BatchEncoding`` (what
``DataCollatorWithPadding`` returns); a preference row is a dict or another Mapping. For each shim that reads such
input, each layout must give what the plain-dict layout gives (the shim acts the same way), and a layout the shim
does not read must leave upstream's call untouched. trl_completion_only_template_miss has its own layout tests in
its test file.
"""

from __future__ import annotations

import collections.abc

import pytest

import ftshims
from ftshims.probing import in_affected_range


class RowMapping(collections.abc.Mapping):
    """A read-only Mapping that is not a dict (what a user's dataset wrapper may yield)."""

    def __init__(self, data):
        self._data = dict(data)

    def __getitem__(self, key):
        return self._data[key]

    def __iter__(self):
        return iter(self._data)

    def __len__(self):
        return len(self._data)


def _batch_encoding(data):
    from transformers import BatchEncoding

    return BatchEncoding(dict(data))


def _skip_outside(shim_id):
    affected, reason = in_affected_range(shim_id)
    if not affected:
        pytest.skip(f"{shim_id} outside its range here: {reason}")


# ---------------------------------------------------------------------------
# num_items_in_batch_overcount: the Trainer's batches


@pytest.mark.parametrize("layout", ["dict", "BatchEncoding"])
def test_overcount_counts_every_batch_layout(layout):
    import torch

    from ftshims import registry, tiny

    shim = "num_items_in_batch_overcount"
    _skip_outside(shim)
    from transformers import Trainer, TrainingArguments

    if not hasattr(Trainer, "_get_num_items_in_batch"):
        pytest.skip("this Trainer has no _get_num_items_in_batch")
    import tempfile

    with tiny.quiet():
        trainer = Trainer(model=tiny.tiny_llama(),
                          args=registry.get(shim).module._training_args(TrainingArguments, tempfile.mkdtemp()))
    labels = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])
    make = {"dict": dict, "BatchEncoding": _batch_encoding}[layout]
    batches = [make({"input_ids": labels.clamp(min=3), "labels": labels})]
    with ftshims.applied(only=[shim]):
        counted = trainer._get_num_items_in_batch(batches, torch.device("cpu"))
        acted = ftshims.status()[shim].actions.get("batches counted over the scored labels", 0)
    assert int(counted) == 4 and acted == 1, (layout, counted)  # labels[..., 1:] != -100: 3 + 1
    assert type(batches[0]) is type(make({})) and batches[0]["labels"].shape == (2, 4)  # the user's batch untouched


# ---------------------------------------------------------------------------
# trl_extract_prompt_boundary: preference rows


@pytest.mark.parametrize("layout", ["dict", "Mapping"])
def test_extract_prompt_reads_every_row_layout(layout):
    shim = "trl_extract_prompt_boundary"
    _skip_outside(shim)
    from trl.data_utils import extract_prompt

    row = {"chosen": "Q: hi A: Sure", "rejected": "Q: hi A: Sure thing"}
    example = dict(row) if layout == "dict" else RowMapping(row)
    with ftshims.applied(only=[shim]):
        from trl.data_utils import extract_prompt as wrapped

        result = wrapped(example)
    assert result == {"prompt": "Q: hi A: Sure", "chosen": "", "rejected": " thing"}, (layout, result)
    assert extract_prompt(dict(row)) != result  # the negative control: upstream's split in range


# ---------------------------------------------------------------------------
# trl_padding_free_position_ids: the padding-free collator's examples


def _padding_free_collator():
    from ftshims import registry

    module = registry.get("trl_padding_free_position_ids").module
    return module.collator_for("sdpa")


@pytest.mark.parametrize("layout", ["dict", "BatchEncoding", "dict of numpy arrays", "dict of tensors"])
def test_padding_free_collator_reads_every_example_layout(layout):
    import numpy as np
    import torch

    shim = "trl_padding_free_position_ids"
    _skip_outside(shim)
    ids = [[5, 6, 7], [8, 9, 10, 11]]
    make = {
        "dict": lambda i: {"input_ids": i},
        "BatchEncoding": lambda i: _batch_encoding({"input_ids": i}),
        "dict of numpy arrays": lambda i: {"input_ids": np.array(i)},
        "dict of tensors": lambda i: {"input_ids": torch.tensor(i)},
    }[layout]
    collator = _padding_free_collator()

    def collate(examples):
        try:
            return collator(examples)
        except Exception as exc:  # noqa: BLE001 - a layout TRL itself refuses is refused the same way with the shim
            return type(exc).__name__

    plain = collate([make(i) for i in ids])
    with ftshims.applied(only=[shim]):
        shimmed = collate([make(i) for i in ids])
        reference = collate([{"input_ids": i} for i in ids])
    if isinstance(plain, str):
        assert shimmed == plain
        return
    assert shimmed["position_ids"].tolist() == reference["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert shimmed["input_ids"].tolist() == plain["input_ids"].tolist()


# ---------------------------------------------------------------------------
# eos_label_kept_when_pad_is_eos (opt-in): the LM collator's examples


@pytest.mark.parametrize("layout", ["dict", "BatchEncoding", "list of ids", "tensor", "numpy array"])
def test_eos_label_collator_reads_every_example_layout(layout):
    import numpy as np
    import torch

    from ftshims import registry

    shim = "eos_label_kept_when_pad_is_eos"
    _skip_outside(shim)
    from transformers import DataCollatorForLanguageModeling

    module = registry.get(shim).module
    tok = module.tokenizer()
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in module.TEXTS]
    make = {
        "dict": lambda i: {"input_ids": i},
        "BatchEncoding": lambda i: _batch_encoding({"input_ids": i}),
        "list of ids": list,
        "tensor": torch.tensor,
        "numpy array": np.array,
    }[layout]
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    with ftshims.applied(only=[shim]):
        reference = collator([{"input_ids": i} for i in ids])
        try:
            shimmed = collator([make(i) for i in ids])
        except Exception as exc:  # noqa: BLE001 - compare with what transformers does with it unshimmed
            shimmed = type(exc).__name__
    if isinstance(shimmed, str):
        try:
            plain = collator([make(i) for i in ids])
        except Exception as exc:  # noqa: BLE001
            plain = type(exc).__name__
        assert shimmed == plain
        return
    assert shimmed["labels"].tolist() == reference["labels"].tolist(), layout
