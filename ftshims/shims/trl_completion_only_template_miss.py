"""TRL's ``DataCollatorForCompletionOnlyLM`` drops a whole example from the loss when it misses the template.

Why: the collator (TRL 0.6.0-0.19.x; removed in 0.20.0) looks for the response template's token ids (and the
instruction template's, when one is given) inside ``batch["labels"]``, which the parent
``DataCollatorForLanguageModeling`` has already pad-masked (every pad id is -100). On a miss it sets the whole
row to -100 and emits a ``UserWarning``: the example then contributes nothing to the loss. TRL 0.4-0.5 raised a
``RuntimeError`` instead. A miss is often not about one example but about every one of them:

* the template contains the pad token (``pad = eos = <|im_end|>`` and a template that starts with
  ``<|im_end|>``): those positions are -100 before the search, so it can never match and *every* example is
  dropped (trl#1191);
* the tokenizer encodes the template differently in context than alone (SentencePiece Llama-2/Mistral: trl#598,
  trl#980): the text is there, the ids are not;
* truncation cut the template off, or the data lacks it (trl#1183): the documented "ignored" case.

When every row of a batch is dropped the loss is 0 (or NaN) and training silently does nothing; with one of the
first two causes, a whole run trains on nothing while the warnings scroll by in the log.

The guard: wrap ``DataCollatorForCompletionOnlyLM.torch_call``. Before the original runs it finds, with TRL's
own criterion (the key's ids inside each example's ids with pad ids masked), which examples will miss, and why.
It reads every example layout TRL's collator accepts: a Mapping with ``input_ids`` (a dict, or the
``BatchEncoding`` that ``tokenizer(text)`` returns), a list or tuple of ids, a tensor or a numpy array. A layout
it cannot read (no ``input_ids``, nested ids, text) is left to TRL: the call proceeds untouched and
``status()`` counts it ("batches left unread"). Policy (option ``policy``, else
``FTSHIMS_COMPLETION_MISS_POLICY``, else ``auto``):

* ``auto`` (default): a ``ValueError`` naming the row, its text and the cause when the cause makes the template
  unmatchable (it contains the pad token, or it is tokenized differently in context: every example with it is
  dropped), or when none of the first ``FIRST_EXAMPLES`` (8) examples this collator collated kept its template
  (the template or the data is wrong: the run would train on nothing). Any other miss keeps TRL's behaviour —
  the row is dropped and TRL warns, even when it is the only row of its batch (batch size 1 and one truncated
  example: the Trainer takes a zero-loss step, as TRL's own tests expect) — with one ftshims warning per
  collator and the count in ``status()``;
* ``error``: a ``ValueError`` for every miss;
* ``warn``: never raises; one warning per collator naming the first miss and its cause, rows dropped as TRL does.

Nothing changes in the batches themselves: the guard decides only whether the call proceeds. Applies to
trl >=0.6.0,<0.20.0. Fallback: a collator class without ``torch_call``/``response_token_ids`` skips the shim.
"""

from __future__ import annotations

import logging
import numbers
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping

from .._util import acted, user_stacklevel
from ..spec import Choice, Observation, ProbeUnsupported, ShimSpec, Target

ENV_POLICY = "FTSHIMS_COMPLETION_MISS_POLICY"
POLICIES = ("auto", "error", "warn")

SPEC = ShimSpec(
    id="trl_completion_only_template_miss",
    since="0.1.0",
    title="DataCollatorForCompletionOnlyLM silently drops examples that miss the template",
    symptom="Examples whose response/instruction template is not found get all labels -100 (TRL only warns); a "
    "template containing the pad token or tokenized differently in context drops every example, loss 0/NaN",
    why="TRL 0.6-0.19 DataCollatorForCompletionOnlyLM masks a whole example when it cannot find the template in "
    "the pad-masked labels; when the template contains the pad token or tokenizes differently in context that is "
    "every example. The guard raises with the row and the cause instead.",
    requires={"trl": ">=0.6.0,<0.20.0"},
    fixed_in={},  # removed in TRL 0.20.0 (completion_only_loss on prompt/completion data replaces it)
    refs=(
        "https://github.com/huggingface/trl/issues/1191",
        "https://github.com/huggingface/trl/issues/598",
        "https://github.com/huggingface/trl/pull/622",
        "https://github.com/huggingface/trl/issues/980",
        "https://github.com/huggingface/trl/issues/1183",
    ),
    targets=(Target("trl.trainer.utils", "DataCollatorForCompletionOnlyLM.torch_call"),),
    modules=("trl.trainer.utils",),
    effect="guards",
    options={"policy": "auto"},
    choices={"policy": Choice(values=POLICIES, env=ENV_POLICY)},
)

log = logging.getLogger("ftshims")


class TemplateMissError(ValueError):
    """A completion-only collator would drop an example from the loss because it cannot find its template."""


# ---------------------------------------------------------------------------
# What TRL will do with each example, found before it does it


def _ids_of(example):
    """The token ids of one example as a list of ints, in every layout TRL's collator accepts (a Mapping with
    ``input_ids`` — a dict or a ``BatchEncoding`` —, a list or tuple of ids, a tensor, a numpy array); ``None`` for
    a layout this guard does not read (then the guard stays out of the call)."""
    ids = example.get("input_ids") if isinstance(example, Mapping) else example
    if ids is None or isinstance(ids, (str, bytes)):
        return None
    if hasattr(ids, "tolist"):  # torch tensors, numpy arrays
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, numbers.Integral) for t in ids):
        return None  # nested ids ([1, n] tensors), text, or something else: TRL's own code decides what it means
    return [int(t) for t in ids]


def _contains(row, key) -> bool:
    n = len(key)
    return n > 0 and any(row[i : i + n] == key for i in range(len(row) - n + 1))


def _cause(collator, ids, key, template, pad_id) -> tuple:
    """(systematic, words) for a key that TRL's search will not find in ``ids``."""
    if pad_id is not None and pad_id in key:
        return True, (f"the template's ids {key} contain the pad token id {pad_id}, which the collator masks to -100 "
                      "before it searches, so it can never match (trl#1191); use a template without the pad token, "
                      "or a pad token distinct from eos")
    text = None
    tokenizer = getattr(collator, "tokenizer", None)
    if isinstance(template, str) and tokenizer is not None:
        try:
            text = tokenizer.decode(ids)
        except Exception:  # noqa: BLE001 (no text, no diagnosis beyond the ids)
            text = None
    if text is not None and template.strip() and template.strip() in text:
        return True, (f"the template text {template!r} is in the example but its ids {key} are not: the tokenizer "
                      "encodes it differently in context (trl#598); pass the ids of its in-context encoding "
                      "as the template")
    return False, (f"the template {template!r} (ids {key}) is not in the example ({len(ids)} tokens): truncated, or "
                   "missing from the data")


def misses(collator, examples):
    """``[(row, key name, systematic, cause, ids)]`` for the examples TRL's collator will drop; ``None`` when an
    example's layout is one this guard does not read."""
    tokenizer = getattr(collator, "tokenizer", None)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    keys = [("response", getattr(collator, "response_token_ids", None), getattr(collator, "response_template", None))]
    if getattr(collator, "instruction_template", None) is not None:
        keys.append(("instruction", getattr(collator, "instruction_token_ids", None), collator.instruction_template))
    keys = [(name, _ids_of(key), template) for name, key, template in keys if key is not None and len(key)]
    if any(key is None for _, key, _ in keys):
        return None  # template ids in a form TRL itself would not match: not this guard's question
    rows = [_ids_of(example) for example in examples]
    if any(ids is None for ids in rows):
        return None  # a feature layout this guard does not read: say nothing rather than guess
    found = []
    for row, ids in enumerate(rows):
        searched = [-100 if t == pad_id else t for t in ids]
        for name, key, template in keys:
            if not _contains(searched, key):
                systematic, cause = _cause(collator, ids, key, template, pad_id)
                found.append((row, name, systematic, cause, ids))
                break  # one cause per row is enough: the row is dropped either way
    return found


# How many examples a collator may collate without one keeping its template before the auto policy calls the
# template or the data wrong: enough that one truncated example (or a few) at the start of a run, at any batch
# size, never stops it; few enough that a run training on nothing stops within its first steps.
FIRST_EXAMPLES = 8


class _Seen:
    """What one collator has collated so far (examples, examples that kept their template, whether it warned)."""

    __slots__ = ("examples", "kept", "warned")

    def __init__(self):
        self.examples = 0
        self.kept = 0
        self.warned = False


# id(collator) -> (weak reference to it, _Seen). Keyed by identity: TRL's collators are dataclasses, which compare
# by value and so cannot be dictionary keys; an entry goes when its collator does.
_SEEN: dict = {}
_SEEN_LOCK = threading.RLock()  # re-entrant: a weak-reference callback may run while it is held


def _forget(key, ref) -> None:
    with _SEEN_LOCK:
        if _SEEN.get(key, (None,))[0] is ref:
            del _SEEN[key]


def _seen(collator) -> _Seen:
    key = id(collator)
    with _SEEN_LOCK:
        entry = _SEEN.get(key)
        if entry is not None and entry[0]() is collator:
            return entry[1]
        try:
            ref = weakref.ref(collator, lambda dead, key=key: _forget(key, dead))
        except TypeError:  # a collator class that takes no weak references: count this call alone
            return _Seen()
        seen = _Seen()
        _SEEN[key] = (ref, seen)
        return seen


def _describe(collator, miss) -> str:
    row, name, _, cause, ids = miss
    tokenizer = getattr(collator, "tokenizer", None)
    try:
        text = tokenizer.decode(ids) if tokenizer is not None else str(ids)
    except Exception:  # noqa: BLE001
        text = str(ids)
    if len(text) > 160:
        text = text[:160] + "..."
    return f"row {row} ({text!r}) would get no labels: {name} template not found: {cause}"


def _guard(policy, wrapped, instance, args, kwargs):
    examples = args[0] if args else kwargs.get("examples")
    try:
        found = misses(instance, examples) if examples is not None else None
    except (TypeError, ValueError, AttributeError, KeyError, IndexError) as exc:
        # The guard's own reading failed on input TRL accepts: TRL's call decides, untouched.
        log.debug("trl_completion_only_template_miss: examples not read (%s); TRL's collator runs unguarded", exc)
        found = None
    if found is None:
        acted(SPEC.id, "batches left unread")
        return wrapped(*args, **kwargs)
    seen = _seen(instance)
    with _SEEN_LOCK:
        seen.examples += len(examples)
        seen.kept += len(examples) - len({m[0] for m in found})
        examples_so_far, kept_so_far = seen.examples, seen.kept
    if found:
        systematic = [m for m in found if m[2]]
        nothing_kept = kept_so_far == 0 and examples_so_far >= FIRST_EXAMPLES
        refuse = policy == "error" or (policy == "auto" and (systematic or nothing_kept))
        if refuse:
            acted(SPEC.id, "batches refused")
            first = systematic[0] if systematic else found[0]
            every_row = len({m[0] for m in found}) == len(examples)
            whole = " (every example of this batch: its loss would be 0)" if every_row else ""
            if nothing_kept and not systematic and policy == "auto":
                whole += (f"; none of the {examples_so_far} examples this collator has collated kept its template, "
                          "so the run would train on nothing")
            raise TemplateMissError(
                f"DataCollatorForCompletionOnlyLM would drop {len(found)} of {len(examples)} examples from the loss"
                f"{whole}. First: {_describe(instance, first)}. (ftshims guard trl_completion_only_template_miss; "
                f"policy={policy}; set policy 'warn' or {ENV_POLICY}=warn to let TRL drop them)"
            )
        acted(SPEC.id, "examples dropped with a warning", len(found))
        if not seen.warned:
            seen.warned = True
            warnings.warn(
                f"trl_completion_only_template_miss: DataCollatorForCompletionOnlyLM drops {len(found)} of "
                f"{len(examples)} examples of this batch from the loss; {_describe(instance, found[0])} "
                "(said once per collator; ftshims counts them in status())",
                UserWarning,
                stacklevel=user_stacklevel(),
            )
    return wrapped(*args, **kwargs)


def install(patcher, options) -> None:
    from ..spec import TargetMissing

    utils = sys.modules["trl.trainer.utils"]
    cls = getattr(utils, "DataCollatorForCompletionOnlyLM", None)
    if cls is None or "torch_call" not in vars(cls):
        raise TargetMissing("trl.trainer.utils.DataCollatorForCompletionOnlyLM.torch_call is missing")
    # apply() has checked the option and FTSHIMS_COMPLETION_MISS_POLICY (ftshims.settings) and put the winner here.
    policy = options.get("policy") or "auto"

    def torch_call(wrapped, instance, args, kwargs):
        return _guard(policy, wrapped, instance, args, kwargs)

    patcher.wrap(cls, "torch_call", torch_call)


# ---------------------------------------------------------------------------
# Reproduction

_WORDS = ["<unk>", "<s>", "<|im_end|>", "<|im_start|>", "user", "assistant", "###", "Answer:"] + list("abcdefgh")


def tokenizer():
    """A WordLevel tokenizer with ChatML-style markers; pad = eos = ``<|im_end|>`` (the Qwen setup of trl#1191)."""
    from ..tiny import word_tokenizer

    return word_tokenizer(_WORDS, bos_token="<s>", eos_token="<|im_end|>", pad_token="<|im_end|>")


SCENARIOS = {
    # (response template, texts of the batch)
    "pad_in_template": ("<|im_end|> <|im_start|> assistant",
                        ["<|im_start|> user a b <|im_end|> <|im_start|> assistant c d <|im_end|>",
                         "<|im_start|> user e <|im_end|> <|im_start|> assistant f g h <|im_end|>"]),
    "truncated": ("### Answer:", ["a b ### Answer: c d", "e f g h a b c"]),
    # the template is in none of the data: FIRST_EXAMPLES examples, none of them kept
    "all_missing": ("### Answer:", ["a b c d", "e f g h", "a c e g", "b d f h", "a b", "c d", "e f", "g h"]),
    "healthy": ("### Answer:", ["a b ### Answer: c d", "e ### Answer: f g h"]),
}


def probe(case: str = "pad_in_template") -> Observation:
    """Collate the examples of ``SCENARIOS[case]`` with DataCollatorForCompletionOnlyLM: is an example dropped
    from the loss (all labels -100) without an error that names the row and the cause?"""
    try:
        from trl.trainer.utils import DataCollatorForCompletionOnlyLM
    except ImportError:
        raise ProbeUnsupported("this TRL has no DataCollatorForCompletionOnlyLM") from None
    template, texts = SCENARIOS[case]
    scenario = case
    tok = tokenizer()
    collator = DataCollatorForCompletionOnlyLM(template, tokenizer=tok, mlm=False)
    features = [{"input_ids": tok(t, add_special_tokens=False)["input_ids"]} for t in texts]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            batch = collator(features)
        except TemplateMissError as exc:
            text = str(exc)
            if "row " in text and "template not found" in text:
                return Observation(False, f"{scenario}: refused with a clear error: {text[:160]}...")
            return Observation(True, f"{scenario}: an error without the row and cause: {text[:160]}")
        except RuntimeError as exc:  # TRL <0.6 raised on a miss (outside the range)
            return Observation(False, f"{scenario}: TRL raised on the miss: {str(exc)[:120]}")
    labels = batch["labels"]
    dropped = [i for i in range(labels.shape[0]) if bool((labels[i] == -100).all())]
    if dropped:
        return Observation(True, f"{scenario}: rows {dropped} of {labels.shape[0]} silently dropped from the loss "
                                 f"(all labels -100), {int((labels != -100).sum())} supervised tokens left")
    return Observation(False, f"{scenario}: every row keeps its completion labels "
                              f"({int((labels != -100).sum())} supervised tokens)")
