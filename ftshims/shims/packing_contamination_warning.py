"""TRL packing strategies that make packed examples attend to each other, by design, say nothing: warn once.

Why: some TRL packers concatenate examples into fixed-length rows and keep no
record of where each example starts. No mask or position ids can isolate the
examples afterwards, so every example attends to the ones packed before it
(and examples are cut at row boundaries):

* ``ConstantLengthDataset`` (``trl.trainer.utils``, TRL <=0.19; what
  ``SFTTrainer(packing=True)`` uses up to TRL 0.14), trl#805, trl#1230;
* ``pack_examples`` (``trl.data_utils``, TRL 0.15–0.19; SFTTrainer's packer in 0.15);
* ``pack_dataset`` with ``strategy="wrapped"`` (TRL 0.19+), and every
  ``pack_dataset`` call on TRL 0.16–0.18, which only had the wrapped strategy.

TRL emits no warning for any of them (it only warns that packing wants flash
attention, or about ``padding_free`` with ``"wrapped"``). This cannot be fixed
from outside: the boundary information is gone. So the shim does the next
best thing: one clear ``PackingContaminationWarning`` per packer and process
(while applied), naming the fix: ``packing_strategy="bfd"`` (``"ffd"`` on TRL
0.19; TRL >=0.19 is needed), which keeps per-example position ids that
ftshims' ``packing_block_mask`` / ``trl_padding_free_position_ids`` shims (or
flash attention) turn into isolation. The doctor carries the same advisory.

The fix: wrap ``ConstantLengthDataset.__init__``, ``pack_examples`` and
``pack_dataset`` where they exist (each as its module is imported, including
the copies ``sft_trainer`` imports by name). Nothing else changes: the data
packed is exactly the same.

Applies to every trl version that has one of these packers (>=0.4; unfixed).
"""

from __future__ import annotations

import inspect
import warnings

from .._util import acted, user_stacklevel
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target

SPEC = ShimSpec(
    id="packing_contamination_warning",
    since="0.1.0",
    title="TRL packing strategies that contaminate by design warn",
    symptom="ConstantLengthDataset / pack_examples / packing_strategy='wrapped' silently let packed examples attend "
    "to each other (no example boundaries are kept)",
    why='Some TRL packers concatenate examples into fixed-length rows and keep no record of where each starts, so nothing can isolate them afterwards. The shim cannot fix that; it warns once, naming an isolating strategy.',
    effect='warns',
    requires={"trl": ">=0.4"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/issues/805",
        "https://github.com/huggingface/trl/issues/1230",
        "https://github.com/huggingface/trl/pull/3521",
    ),
    targets=(
        Target("trl.trainer.utils", "ConstantLengthDataset.__init__", when="<0.20"),
        Target("trl.data_utils", "pack_examples", when=">=0.15,<0.20"),
        Target("trl.data_utils", "pack_dataset", when=">=0.16"),
    ),
    modules=("trl",),
)


class PackingContaminationWarning(UserWarning):
    """Packed examples will attend to each other: the packer keeps no example boundaries."""


def _fix_advice() -> str:
    from packaging.version import Version

    from ..versions import installed_version

    trl = Version(installed_version("trl") or "0")
    if trl >= Version("0.20"):
        return "use packing_strategy='bfd' (keeps per-example position_ids)"
    if trl >= Version("0.19"):
        return "use packing_strategy='ffd' (keeps per-example position_ids)"
    return "upgrade to TRL >=0.20 and use SFTTrainer(packing=True, packing_strategy='bfd')"


def _message(what: str) -> str:
    return (
        f"ftshims: {what} concatenates examples without keeping their boundaries, so packed examples attend to "
        f"each other (cross-contamination) and examples are cut at row ends. Fix: {_fix_advice()}; with eager/sdpa "
        "attention keep ftshims' packing_block_mask shim applied (transformers >=4.37), or use flash attention."
    )


def _warner():
    """A ``warn(what)`` that warns once per packer for as long as this install lasts."""
    warned = set()

    def warn(what: str) -> None:
        acted(SPEC.id, "contaminating packers seen")
        if what in warned:
            return
        warned.add(what)
        warnings.warn(_message(what), PackingContaminationWarning, stacklevel=user_stacklevel())

    return warn


def _strategy(func, args, kwargs):
    params = inspect.signature(func).parameters
    if "strategy" not in params:
        return "wrapped"  # TRL 0.16–0.18: pack_dataset only wraps
    bound = inspect.signature(func).bind_partial(*args, **kwargs)
    return bound.arguments.get("strategy", params["strategy"].default)


def install(patcher, options) -> None:
    warn = _warner()

    def constant_length_init(wrapped, instance, args, kwargs):
        warn("TRL ConstantLengthDataset")
        return wrapped(*args, **kwargs)

    def pack_examples(wrapped, instance, args, kwargs):
        warn("TRL pack_examples")
        return wrapped(*args, **kwargs)

    def pack_dataset(wrapped, instance, args, kwargs):
        if _strategy(wrapped, args, kwargs) == "wrapped":
            warn("TRL pack_dataset(strategy='wrapped')")
        return wrapped(*args, **kwargs)

    def trainer_utils(module):
        cls = vars(module).get("ConstantLengthDataset")
        if cls is not None:
            patcher.wrap(cls, "__init__", constant_length_init)

    def data_utils(module):
        for name, wrapper in (("pack_examples", pack_examples), ("pack_dataset", pack_dataset)):
            original = vars(module).get(name)
            if callable(original):
                patcher.wrap(module, name, wrapper)
                patcher.wrap_aliases(original, wrapper, packages=("trl",))

    patcher.when_imported("trl.trainer.utils", trainer_utils)
    patcher.when_imported("trl.data_utils", data_utils)


# ---------------------------------------------------------------------------
# Reproduction


def probe(packer: str = "wrapped") -> Observation:
    """Pack two examples (5 and 7 tokens) with a TRL packer that keeps no boundaries:
    ``"constant_length_dataset"``, ``"pack_examples"`` or ``"wrapped"``. The bug is silence:
    contamination without a warning that says so."""
    from . import _packing

    examples = _packing.example_pair(low=len(_packing.SPECIAL))
    with warnings.catch_warnings(record=True) as caught, _packing.quiet_datasets():
        warnings.simplefilter("always")
        rows = _pack(packer, examples)
    boundaries_kept = any("position_ids" in row or "seq_lengths" in row for row in rows)
    if boundaries_kept:
        return Observation(False, f"{packer}: the packed rows keep example boundaries")
    named = [w for w in caught if "attend to each other" in str(w.message) or "contaminat" in str(w.message)]
    if named:
        return Observation(False, f"{packer}: contaminates by design, and warned: {str(named[0].message)[:90]}...")
    return Observation(True, f"{packer}: packed examples attend to each other (no boundaries kept), silently")


def _pack(packer: str, examples):
    if packer == "constant_length_dataset":
        try:
            from trl.trainer.utils import ConstantLengthDataset
        except ImportError as exc:
            raise ProbeUnsupported(f"no importable trl.trainer.utils.ConstantLengthDataset ({exc})") from None
        import datasets

        from . import _packing

        tokenizer = _packing.tiny_tokenizer()
        texts = [" ".join(f"w{int(t)}" for t in e) for e in examples]
        dataset = ConstantLengthDataset(
            tokenizer,
            datasets.Dataset.from_list([{"text": t} for t in texts]),
            dataset_text_field="text",
            seq_length=8,  # the buffer (seq_length * chars_per_token * num_of_sequences chars) holds both texts
            infinite=False,
        )
        return [dict(row) for row in dataset]
    if packer == "pack_examples":
        try:
            from trl.data_utils import pack_examples
        except ImportError:
            raise ProbeUnsupported("this TRL has no pack_examples") from None
        packed = pack_examples({"input_ids": [e.tolist() for e in examples]}, seq_length=8)
        return [dict(zip(packed, values)) for values in zip(*packed.values())]
    if packer == "wrapped":
        try:
            from trl.data_utils import pack_dataset
        except ImportError:
            raise ProbeUnsupported("this TRL has no pack_dataset") from None
        import datasets

        dataset = datasets.Dataset.from_list([{"input_ids": e.tolist()} for e in examples])
        if "strategy" in inspect.signature(pack_dataset).parameters:
            return list(pack_dataset(dataset, 8, strategy="wrapped"))
        return list(pack_dataset(dataset, 8))
    raise ValueError(f"packer must be constant_length_dataset, pack_examples or wrapped, not {packer!r}")
