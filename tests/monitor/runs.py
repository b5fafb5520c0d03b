"""Real Trainer runs for the monitor's tests: tiny models from configs, synthetic data, no network."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, List, Optional

import pytest

VOCAB = 128
UNFIXABLE_COUNT = "num_items_in_batch_overcount_4_46"  # an advisory: no shim fixes it


def on_matrix_stack() -> bool:
    """Whether this run is one of the pinned-version matrix's non-default stacks (tests/conftest.py's test)."""
    import os

    from ftshims import datafiles

    return os.environ.get("FTSHIMS_STACK") in datafiles.matrix_stacks()


# Tests of the monitor's own machinery (options, the loop, the report, torchrun, healthy runs) do not depend on
# the pinned versions: the matrix spends its time on the catalogue-linked scenarios instead.
default_stack_only = pytest.mark.skipif(on_matrix_stack(), reason="the monitor's machinery: default stack only")


@dataclass
class Result:
    findings: list
    error: Optional[BaseException]
    callback: Any
    trainer: Any = None
    log: List[dict] = field(default_factory=list)

    @property
    def codes(self) -> List[str]:
        return [f.code for f in self.findings]

    def only(self, code: str):
        """The single finding, asserting it is the only one and has ``code``."""
        assert self.codes == [code], [f.line() for f in self.findings]
        return self.findings[0]

    def none(self) -> None:
        assert self.findings == [], [f.line() for f in self.findings]


def rows_dataset(rows: dict) -> list:
    n = rows["input_ids"].shape[0]
    return [{k: v[i] for k, v in rows.items()} for i in range(n)]


def corpus(n: int = 256, seq: int = 32, vocab: int = VOCAB, seed: int = 0) -> dict:
    """Learnable synthetic sequences: each row an arithmetic progression (start, stride from a few) modulo the
    vocabulary, above the special ids 0..2. The loss falls steadily, as on real text."""
    import torch

    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab - 3, (n, 1), generator=g)
    stride = torch.tensor([1, 2, 3, 5])[torch.randint(0, 4, (n, 1), generator=g)]
    ids = 3 + (start + stride * torch.arange(seq)) % (vocab - 3)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def training_args(output_dir: str, **overrides):
    import inspect

    from transformers import TrainingArguments

    args = dict(output_dir=output_dir, max_steps=6, per_device_train_batch_size=4, report_to=[], save_strategy="no",
                logging_steps=1, disable_tqdm=True, learning_rate=1e-3, seed=0)
    params = inspect.signature(TrainingArguments.__init__).parameters
    if "use_cpu" in params:
        args["use_cpu"] = True
    else:  # transformers < 4.34
        args["no_cuda"] = True
    args.update(overrides)
    return TrainingArguments(**args)


def monitor_options(given: Optional[dict] = None) -> dict:
    """``given``, and where no shim can fix the Trainer's label count (transformers 4.46.2-4.56) every
    causal-LM run shows loss_count_mismatch: test_labels.py proves it there, the other tests leave that
    detector out (unless they set ``off`` themselves)."""
    from ftshims.monitor import catalogue

    options = dict(given or {})
    if "off" not in options and catalogue.exists_here(UNFIXABLE_COUNT):
        options["off"] = ["loss_count_mismatch"]
    return options


def train(model, dataset, monitor: Optional[dict] = None, callbacks=(), trainer_class=None, trainer_kwargs=None,
          **args) -> Result:
    """``Trainer(...).train()`` with ``ftshims.monitor.callback(**monitor)``; an exception is returned, not raised."""
    import ftshims.monitor
    from ftshims import tiny

    if trainer_class is None:
        from transformers import Trainer as trainer_class
    callback = ftshims.monitor.callback(**monitor_options(monitor))
    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        trainer = trainer_class(model=model, args=training_args(out, **args), train_dataset=dataset,
                                callbacks=[callback, *callbacks], **(trainer_kwargs or {}))
        error = None
        try:
            trainer.train()
        except Exception as exc:  # the test asserts on it
            error = exc
        finally:
            callback._finish()  # a run that raised never reached on_train_end
    return Result(list(callback.findings), error, callback, trainer)


def in_order():
    """A ``Trainer`` that takes the examples in order (a SequentialSampler), so a test knows which step sees which."""
    import torch
    from transformers import Trainer

    class InOrder(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    return InOrder


def in_range_or_skip(catalogue_id: str) -> None:
    """Skip unless the bug behind ``catalogue_id`` exists on the installed stack (the registry / advisories say)."""
    from ftshims.monitor import catalogue

    if not catalogue.exists_here(catalogue_id):
        from ftshims import probing, registry

        if catalogue.is_shim(catalogue_id):
            reason = probing.in_affected_range(catalogue_id)[1] or f"needs one of {registry.get(catalogue_id).spec.needs_any}"
        else:
            reason = "its advisory does not match the installed versions"
        pytest.skip(f"{catalogue_id}'s bug does not exist on this stack: {reason}")


def assert_explains(finding, catalogue_id: str, applied: bool = False) -> None:
    assert catalogue_id in finding.explains, (finding.explains, finding.message)
    assert finding.detail["applied"][catalogue_id] is applied, finding.detail
    assert catalogue_id in finding.message
