"""TRL's ``extract_prompt`` splits text preference rows at the wrong place at the two ends of the prefix scan.

Why: preference data with an implicit prompt (``chosen``/``rejected`` without a ``prompt`` column) is split
by ``trl.data_utils.extract_prompt`` (used by ``maybe_extract_prompt`` and mapped over the dataset by
``DPOTrainer``, ``KTOTrainer``, ORPO, CPO, TPO): the prompt is the longest common prefix, moved back by one
when it ends in a space. The loop ``for idx in range(min(len(chosen), len(rejected)))`` gets both ends wrong:

* when the texts never differ within the shorter length (``chosen`` is a prefix of ``rejected``, a "stop
  here" vs "go on" pair, or the two are equal), the loop ends without ``break`` and ``idx`` keeps its last
  value ``n - 1``: the last shared character is cut from the prompt and starts both completions, mid-word
  (``"Q: hi A: Sure"`` / ``"Q: hi A: Sure thing"`` -> prompt ``"Q: hi A: Sur"``, chosen ``"e"``,
  rejected ``"e thing"``);
* when they differ at the first character and ``chosen`` ends with a space, the space check reads
  ``chosen[idx - 1]`` = ``chosen[-1]`` and sets ``idx = -1``: the prompt becomes all of ``chosen`` but its
  last character, and the completions are the last character of each (``"Paris "`` / ``"London"`` ->
  prompt ``"Paris"``, chosen ``" "``, rejected ``"n"``).

DPO then trains on those rows as given. The code is the same in every release from TRL 0.12.0 (which added
the space rule) to 1.16.0, the newest; five upstream PRs fixing it were closed unmerged (#6079, #6472,
#6498, #6703, #6960).

The fix: wrap ``extract_prompt`` (the definition and every module-level alias: ``trl``, ``trl.data_utils``,
the DPO/KTO/TPO trainer modules that imported it by name). For two text completions it finds the common
prefix itself; in the two cases above it returns the split upstream means, the one the closed PRs compute:
the whole common prefix, moved back by one when it ends in a space exactly as for a difference
(``"Q: hi A: Sure"``, ``""``, ``" thing"``; ``""``, ``"Paris "``, ``"London"``). Every other example is
passed to the original, so its output is upstream's, unchanged.

Applies to trl >=0.12.0, every release so far (fixed_in is empty). At install the shim calls the original on
``{"chosen": "ab", "rejected": "ab c"}``; if that already returns the prompt ``"ab"`` (fixed upstream), the
shim is skipped. Fallback, left as upstream does it: conversational rows (lists of messages), where a
conversation that is a prefix of the other keeps its last shared message in both completions (the split
that keeps both completions non-empty, which the chat-template tokenisation needs); rows without text
``chosen``/``rejected``; empty completions (upstream raises ``UnboundLocalError``).
"""

from __future__ import annotations

import sys

from .._util import acted
from ..spec import Observation, ProbeUnsupported, ShimSpec, Target, TargetMissing

SPEC = ShimSpec(
    id="trl_extract_prompt_boundary",
    since="0.2.0",
    title="extract_prompt cuts implicit prompts one character short, or wraps around, at the ends of the prefix scan",
    symptom="DPO/KTO/ORPO/CPO on text preference rows without a prompt column: a chosen that is a prefix of its "
    "rejected (or equal) loses its last shared character to both completions, mid-word; a pair that differs at "
    "the first character with chosen ending in a space gets prompt = chosen[:-1], completions = last characters",
    why="trl.data_utils.extract_prompt (0.12.0-1.16.0) leaves idx at n-1 when chosen and rejected never differ and "
    "reads chosen[-1] when they differ at index 0, so such rows are split mid-word or wrapped around. The shim "
    "returns the full common prefix for those rows and leaves every other row to the original.",
    requires={"trl": ">=0.12.0"},
    fixed_in={},
    refs=(
        "https://github.com/huggingface/trl/pull/6079",
        "https://github.com/huggingface/trl/pull/6472",
        "https://github.com/huggingface/trl/pull/6498",
        "https://github.com/huggingface/trl/pull/6703",
        "https://github.com/huggingface/trl/pull/6960",
    ),
    targets=(Target("trl.data_utils", "extract_prompt", params=("example",)),),
    modules=("trl.data_utils",),
)


def fixed_boundary(chosen, rejected):
    """Where the prompt of two text completions ends, when upstream's loop gets it wrong; else None.

    None means "upstream's split is right": the texts differ somewhere after index 0, or at index 0
    with no trailing space, or one of them is empty (upstream raises there; left as it is).
    """
    n = min(len(chosen), len(rejected))
    if n == 0:
        return None
    for idx in range(n):
        if chosen[idx] != rejected[idx]:
            # Upstream reads chosen[idx - 1]: at idx 0 that is chosen[-1], and a trailing space makes idx -1.
            return 0 if idx == 0 and chosen[-1] == " " else None
    # Never different within the shorter text: the prompt is all of it (upstream leaves idx at n - 1),
    # moved back by one when it ends in a space, the rule upstream applies at a difference.
    return n - 1 if chosen[n - 1] == " " else n


def _extract_prompt(wrapped, instance, args, kwargs):
    example = args[0] if args else kwargs.get("example")
    try:
        chosen, rejected = example["chosen"], example["rejected"]
    except (TypeError, KeyError, IndexError):
        return wrapped(*args, **kwargs)
    if not (isinstance(chosen, str) and isinstance(rejected, str)):
        return wrapped(*args, **kwargs)  # conversational or token rows: upstream's split
    idx = fixed_boundary(chosen, rejected)
    if idx is None:
        return wrapped(*args, **kwargs)
    acted(SPEC.id, "preference rows split at the full common prefix")
    return {"prompt": chosen[:idx], "chosen": chosen[idx:], "rejected": rejected[idx:]}


# The row that tells a buggy extract_prompt from a fixed one (chosen a prefix of rejected).
_CANARY = {"chosen": "ab", "rejected": "ab c"}


def install(patcher, options) -> None:
    data_utils = sys.modules["trl.data_utils"]
    original = vars(data_utils).get("extract_prompt")
    if not callable(original):
        raise TargetMissing("trl.data_utils.extract_prompt is missing")
    try:
        canary = original(dict(_CANARY))
    except Exception as exc:  # noqa: BLE001 - a changed function: not the code this shim knows
        raise TargetMissing(f"trl.data_utils.extract_prompt changed ({type(exc).__name__}: {exc})") from None
    if not isinstance(canary, dict) or canary.get("prompt") != "a":
        raise TargetMissing(f"trl.data_utils.extract_prompt already splits {_CANARY} as {canary}: fixed or changed")
    # DPO/KTO/TPO import it by name, maybe_extract_prompt calls it through trl.data_utils: wrap every alias.
    patcher.wrap_aliases(original, _extract_prompt, packages=("trl",))


# ---------------------------------------------------------------------------
# Reproduction

CASES = {
    # chosen is a prefix of rejected ("stop here" preferred over "go on")
    "prefix": ({"chosen": "Q: hi A: Sure", "rejected": "Q: hi A: Sure thing"}, ("Q: hi A: Sure", "", " thing")),
    # equal texts (a tie row)
    "equal": ({"chosen": "Q: hi A: ok", "rejected": "Q: hi A: ok"}, ("Q: hi A: ok", "", "")),
    # different from the first character, chosen ends with a space
    "first_differs": ({"chosen": "Paris ", "rejected": "London"}, ("", "Paris ", "London")),
    # healthy rows: a difference after a space, a difference mid-word, no trailing space at index 0
    "healthy": ({"chosen": "Q: x A: yes", "rejected": "Q: x A: no"}, ("Q: x A:", " yes", " no")),
    "healthy_midword": ({"chosen": "The sky", "rejected": "The sea"}, ("The s", "ky", "ea")),
    "healthy_first": ({"chosen": "Paris", "rejected": "London"}, ("", "Paris", "London")),
}


def extractor():
    try:
        from trl.data_utils import maybe_extract_prompt
    except ImportError as exc:
        raise ProbeUnsupported(f"this TRL has no trl.data_utils.maybe_extract_prompt ({exc})") from None
    return maybe_extract_prompt


def probe(case: str = "prefix") -> Observation:
    """``maybe_extract_prompt`` (what the trainers map over an implicit-prompt dataset) on one text row
    of :data:`CASES`: is the split the full common prefix (with upstream's trailing-space rule)?"""
    example, (prompt, chosen, rejected) = CASES[case]
    got = extractor()(dict(example))
    seen = (got.get("prompt"), got.get("chosen"), got.get("rejected"))
    detail = f"{example} -> prompt {seen[0]!r}, chosen {seen[1]!r}, rejected {seen[2]!r}"
    if seen != (prompt, chosen, rejected):
        return Observation(True, detail + f" (expected {prompt!r}, {chosen!r}, {rejected!r})")
    return Observation(False, detail)
