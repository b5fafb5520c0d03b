"""What users get wrong in the batches they feed: checked on the batches the model really receives.

One detector, :class:`DataChecks`, looks at the training forward's ``input_ids`` /
``labels`` / ``attention_mask`` of the first ``data_steps`` optimizer steps and of
every ``read_every``-th step after. Per checked micro-batch it counts on the device
(a few comparisons and sums over the batch: no host read, no shape that depends on
values) and the counts are read with everything else at the monitor's read points;
the shares are judged over every batch checked so far, once the first
``data_steps`` steps are in (or at the end of a shorter run):

* ``labels_preshifted`` (causal LMs): more than ``shifted_share`` of the labels equal
  the *next* input id (``labels[t] == input_ids[t + 1]``) and fewer than half equal
  the input at their own position. The model shifts labels itself, so it is trained
  to predict the token after next. Not judged when the batch carries ``shift_labels``
  (then the model does not shift).
* ``padding_trained_on`` (labels aligned with the inputs, not encoder-decoder): more
  than ``padding_share`` of the scored labels sit on padding: positions the attention
  mask excludes, or, when pad != EOS, the leading/trailing run of pad ids (an all-ones
  mask hides nothing). With pad = EOS only the mask can tell padding from the real EOS.
* ``bos_doubled``: more than ``doubled_share`` of the rows start (at their first
  attended position) with BOS twice. ``trl_sft_double_bos_conversational`` (TRL
  0.15-0.16) produces it.
* ``rows_without_target`` (causal LMs, encoder-decoders): more than ``no_target_share``
  of the rows have no label the loss scores, counted in the micro-batches that have
  some (a micro-batch with none is ``labels_all_ignored``'s finding).
  ``trl_completion_only_template_miss`` produces it.
* ``rows_truncated`` (causal LMs): more than ``truncated_share`` of the rows fill the
  longest length of their batch and do not end with an EOS target, while the shorter
  (padded) rows do end with one: truncation cut their responses, and the model learns
  to never stop. Fixed-length chunks (no shorter rows) and data whose rows do not end
  in EOS are not judged.
* ``no_eos_target`` (causal LMs): rows of different lengths (padded: shorter than the longest row of their
  batch, by the attention mask or the pad runs) and no scored label in any checked batch is an EOS id (the
  tokenizer's, the config's or the generation config's), whatever the pad token is: the model is never
  trained to emit EOS and generates until max_new_tokens. Judged on the batches of ``data_steps`` steps and
  at least ``MIN_ROWS`` rows (not at the end of a shorter run). Fixed-length chunks and packed rows (no row
  shorter than another), encoders and encoder-decoders are not judged. With pad = EOS and EOS among the
  attended inputs, a collator masked the real EOS with the padding: that is ``eos_never_target``'s finding
  (it names the catalogue's fixes), and this one stays out.

:class:`SpecialTokenInvalid` (``special_token_invalid``, at train begin): a BOS/EOS id
of the tokenizer or the model's config outside the embedding's rows (a token added
without ``resize_token_embeddings``; the tokenizer's pad id too), or a causal LM trained
with a tokenizer that has no EOS token while the model's config has one.
"""

from __future__ import annotations

import sys
from typing import Dict, List, Optional

from . import Detector
from .. import facts

DATA_CODES = ("labels_preshifted", "padding_trained_on", "bos_doubled", "rows_without_target", "rows_truncated",
              "no_eos_target")
STOP_IDS = 8  # at most this many EOS ids (tokenizer, config, generation config) are compared
MIN_COMPARED = 8  # labels_preshifted needs at least this many labels compared
MIN_ROWS = 8  # no_eos_target needs at least this many rows with targets


def bos_id(model, tokenizer) -> Optional[int]:
    """The BOS id: the tokenizer's when given, else the model config's (None when neither has one)."""
    if tokenizer is not None:
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        value = getattr(tok, "bos_token_id", None)
        if isinstance(value, int):
            return value
    value = facts.config_value(facts.config(model), "bos_token_id")
    if isinstance(value, (list, tuple)):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def stop_ids(model, eos: List[int]) -> List[int]:
    """Every id that ends a generation: the tokenizer's EOS (``eos``), the config's and the generation config's
    (a chat model often stops on several: ``<|im_end|>`` and ``<|endoftext|>``)."""
    found = list(eos)
    base = facts.base_model(model)
    for source in (facts.config(model), getattr(base, "generation_config", None)):
        value = facts.config_value(source, "eos_token_id") if source is not None else None
        for each in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(each, int) and not isinstance(each, bool) and each >= 0 and each not in found:
                found.append(each)
    return found[:STOP_IDS]


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


class DataChecks(Detector):
    codes = DATA_CODES

    def __init__(self):
        self.steps = set()  # optimizer steps whose batches were checked
        self.judged_steps = set()  # those whose counts a read has added
        self.counts: Dict[str, int] = {}
        self.longest = 0
        self.fresh = False  # counts added since the last judgement

    def begin(self, mon) -> None:
        if not hasattr(mon, "shifts_labels"):
            mon.shifts_labels = facts.shifts_labels(mon.model)
        ids = facts.special_ids(mon.model, mon.tokenizer)
        self.eos: List[int] = [e for e in ids.eos if isinstance(e, int)][:4]
        self.pad: Optional[int] = ids.pad
        self.bos = bos_id(mon.model, mon.tokenizer)
        self.stop = stop_ids(mon.model, self.eos)
        cfg = facts.config(mon.model)
        self.encoder_decoder = bool(getattr(cfg, "is_encoder_decoder", False))
        self.on = {code: code not in mon.options["off"] for code in DATA_CODES}

    # -- per training forward: device work only -----------------------------------------------------

    def _checked(self, mon) -> bool:
        step = mon.step
        if step in self.steps:
            return True
        if len(self.steps) < mon.options["data_steps"] or step % mon.options["read_every"] == 0:
            self.steps.add(step)
            return True
        return False

    def batch(self, mon, inputs, micro) -> None:
        ids = inputs.get("input_ids")
        if ids is None or not hasattr(ids, "dim") or ids.dim() != 2 or ids.is_floating_point() or ids.shape[1] < 2:
            return
        if not self._checked(mon):
            return
        mask = inputs.get("attention_mask")
        if mask is None or not hasattr(mask, "shape") or tuple(mask.shape) != tuple(ids.shape):
            mask = None  # none, or a 4D / custom mask: positions are not told apart by it
        else:
            mask = mask.bool()
        ints = micro.ints
        pad_runs = None
        if self.pad is not None and self.pad not in self.eos:
            is_pad = ids.eq(self.pad).int()
            leading, trailing = is_pad.cumprod(-1), is_pad.flip(-1).cumprod(-1).flip(-1)
            pad_runs = (leading + trailing).bool()  # the padding at either end of each row
        if self.on["bos_doubled"] and self.bos is not None:
            self._bos(ids, mask, pad_runs, ints)
        labels = inputs.get("labels")
        if (labels is None or not hasattr(labels, "shape") or labels.is_floating_point() or labels.dim() != 2
                or inputs.get("shift_labels") is not None):
            return
        if self.encoder_decoder:
            if self.on["rows_without_target"]:
                self._rows_without_target(labels.ne(-100).sum(-1), ints)
            return
        if not mon.shifts_labels or tuple(labels.shape) != tuple(ids.shape):
            return
        self._causal(ids, labels, mask, pad_runs, ints)

    def _bos(self, ids, mask, pad_runs, ints) -> None:
        rows, length = ids.shape
        if mask is not None:
            first = mask.long().argmax(-1)  # the first attended position (left padding)
        elif pad_runs is not None and self.pad != self.bos:
            first = ids.eq(self.pad).int().cumprod(-1).sum(-1).clamp(max=length - 1)  # after the leading pads
        elif self.pad == self.bos:
            return  # left padding with pad = BOS and no mask: a doubled BOS cannot be told from padding
        else:
            first = ids.new_zeros(rows)
        second = (first + 1).clamp(max=length - 1)
        head = ids.gather(1, first[:, None])[:, 0]
        after = ids.gather(1, second[:, None])[:, 0]
        ints["d_rows"] = rows
        ints["d_bos2"] = (head.eq(self.bos) & after.eq(self.bos) & second.ne(first)).sum()

    def _causal(self, ids, labels, mask, pad_runs, ints) -> None:
        rows, length = ids.shape
        scored = labels[:, 1:].ne(-100)  # what the shifted loss scores
        per_row = scored.sum(-1)
        if self.on["rows_without_target"]:
            self._rows_without_target(per_row, ints)
        if self.on["labels_preshifted"]:
            own = labels[:, :-1]
            compared = own.ne(-100)
            if mask is not None:
                compared = compared & mask[:, 1:]
            ints["d_cmp"] = compared.sum()
            ints["d_next"] = (own.eq(ids[:, 1:]) & compared).sum()
            ints["d_same"] = (own.eq(ids[:, :-1]) & compared).sum()
        if self.on["padding_trained_on"] and (mask is not None or pad_runs is not None):
            padding = None if mask is None else ~mask[:, 1:]
            if pad_runs is not None:
                padding = pad_runs[:, 1:] if padding is None else padding | pad_runs[:, 1:]
            ints["d_scored"] = scored.sum()
            ints["d_padlab"] = (scored & padding).sum()
        if self.on["no_eos_target"] and self.stop:
            self._stop_labels(ids, labels, scored, per_row, mask, pad_runs, ints)
        if self.on["rows_truncated"] and self.eos:
            if mask is not None:
                lengths = mask.sum(-1)
            elif pad_runs is not None:
                lengths = length - pad_runs.sum(-1)  # rows without a mask: their pad runs are the padding
            else:
                return
            targets = labels[:, 1:]
            is_eos = targets.eq(self.eos[0])
            for other in self.eos[1:]:
                is_eos = is_eos | targets.eq(other)
            positions = scored.long() * (1 + self._arange(ids, length - 1))
            last = positions.argmax(-1)  # the last scored label of each row
            ends_eos = (is_eos & scored).gather(1, last[:, None])[:, 0]
            has = per_row.gt(0)
            longest = lengths.max()
            full = lengths.eq(longest)
            short = has & ~full
            ints["d_trows"] = rows
            ints["d_short"] = short.sum()
            ints["d_short_eos"] = (short & ends_eos).sum()
            ints["d_cut"] = (has & full & ~ends_eos).sum()
            ints["d_longest"] = longest

    def _stop_labels(self, ids, labels, scored, per_row, mask, pad_runs, ints) -> None:
        """Scored labels that are an EOS id, and rows shorter than the longest of their batch (device counts)."""
        if mask is not None:
            lengths = mask.sum(-1)
        elif pad_runs is not None:
            lengths = labels.shape[1] - pad_runs.sum(-1)
        else:
            return  # no mask and pad = EOS (or no pad id): row lengths cannot be told
        targets = labels[:, 1:]
        stop = targets.eq(self.stop[0])
        for other in self.stop[1:]:
            stop = stop | targets.eq(other)
        has = per_row.gt(0)
        if self.pad is not None and self.pad in self.stop and mask is not None:
            # attended EOS in the inputs with pad = EOS: a collator masked them with the padding, which is
            # eos_never_target's finding (it names the catalogue's fixes); this one stays out of it
            ints["d_eos_in"] = (ids.eq(self.pad) & mask).sum()
        ints["d_eos_scored"] = (stop & scored).sum()
        ints["d_vrows"] = has.sum()
        ints["d_vshort"] = (has & lengths.lt(lengths.max())).sum()

    @staticmethod
    def _rows_without_target(per_row, ints) -> None:
        """Rows with no scored label, counted in micro-batches that have some (a batch with none at all is
        labels_all_ignored's finding)."""
        partial = per_row.gt(0).any().long()
        ints["d_lrows"] = partial * per_row.shape[0]
        ints["d_empty"] = per_row.eq(0).sum() * partial

    @staticmethod
    def _arange(ids, n: int):
        import torch

        return torch.arange(n, device=ids.device)[None, :]

    # -- at a read: host values -----------------------------------------------------------------

    def read(self, mon, view) -> None:
        for values in view.values:
            added = False
            for key, value in values.items():
                if key.startswith("d_"):
                    if key == "d_longest":
                        self.longest = max(self.longest, int(value))
                    else:
                        self.counts[key] = self.counts.get(key, 0) + int(value)
                    added = True
            if added:
                self.fresh = True
                self.judged_steps.add(view.step)
        if self.fresh and len(self.judged_steps) >= mon.options["data_steps"]:
            self.judge(mon, view.step)

    def close(self, mon) -> None:
        if self.fresh:
            self.judge(mon, mon.completed_step)

    def judge(self, mon, step: int) -> None:
        self.fresh = False
        c = self.counts
        opts = mon.options
        batches = f"in the batches of {len(self.judged_steps)} optimizer step{'s' if len(self.judged_steps) != 1 else ''}"
        compared, ahead, same = c.get("d_cmp", 0), c.get("d_next", 0), c.get("d_same", 0)
        if (compared >= MIN_COMPARED and _share(ahead, compared) > opts["shifted_share"]
                and _share(same, compared) < 0.5):
            mon.report("labels_preshifted", step,
                       f"{ahead} of {compared} labels ({_share(ahead, compared):.0%}) equal the next input id "
                       f"(labels[t] == input_ids[t+1]) {batches}: the labels are already shifted, and "
                       f"{type(facts.base_model(mon.model)).__name__} shifts them again, so it learns the token after "
                       "next; pass labels = input_ids (unshifted, -100 where nothing is to be learned)",
                       (), {"labels_equal_next_input": ahead, "labels_equal_own_input": same, "labels_compared": compared,
                            "fraction": _share(ahead, compared)})
        scored, on_pad = c.get("d_scored", 0), c.get("d_padlab", 0)
        if scored and on_pad and _share(on_pad, scored) > opts["padding_share"]:
            how = "positions the attention mask excludes"
            if self.pad is not None and self.pad not in self.eos:
                how += f", or the pad id {self.pad} (not EOS) at the ends of the rows"
            mon.report("padding_trained_on", step,
                       f"{on_pad} of {scored} scored labels ({_share(on_pad, scored):.0%}) are padding ({how}) "
                       f"{batches}: the loss trains the model to predict padding; set the labels of padding to -100 "
                       "(labels[attention_mask == 0] = -100, or a collator that masks pad tokens)",
                       (), {"labels_on_padding": on_pad, "scored_labels": scored, "fraction": _share(on_pad, scored),
                            "pad_id": self.pad})
        rows, doubled = c.get("d_rows", 0), c.get("d_bos2", 0)
        if doubled and _share(doubled, rows) > opts["doubled_share"]:
            candidates = ("trl_sft_double_bos_conversational",) if "trl" in sys.modules else ()
            mon.report("bos_doubled", step,
                       f"{doubled} of {rows} rows ({_share(doubled, rows):.0%}) start with BOS (id {self.bos}) twice "
                       f"{batches}: text that already starts with BOS (a chat template rendering it) was tokenized with "
                       "add_special_tokens=True; tokenize templated text with add_special_tokens=False, or use "
                       "apply_chat_template(tokenize=True)", candidates,
                       {"rows_doubled": doubled, "rows": rows, "fraction": _share(doubled, rows), "bos_id": self.bos})
        lrows, empty = c.get("d_lrows", 0), c.get("d_empty", 0)
        if empty and _share(empty, lrows) > opts["no_target_share"]:
            candidates = ("trl_completion_only_template_miss",) if "trl" in sys.modules else ()
            mon.report("rows_without_target", step,
                       f"{empty} of {lrows} rows ({_share(empty, lrows):.0%}) have no label the loss scores {batches}: "
                       "they train nothing (a response cut off by truncation, or a completion template not found); "
                       "raise max_length or truncate the prompt instead, and drop rows without targets",
                       candidates, {"rows_without_target": empty, "rows": lrows, "fraction": _share(empty, lrows)})
        vrows, vshort, stops = c.get("d_vrows", 0), c.get("d_vshort", 0), c.get("d_eos_scored", 0)
        # evidence of a training run: the batches of data_steps optimizer steps and MIN_ROWS rows (a run of one or
        # two steps, such as the zoo gate's, says nothing about how the data end)
        enough = len(self.judged_steps) >= opts["data_steps"] and vrows >= MIN_ROWS
        if enough and vshort and not stops and not c.get("d_eos_in") and "d_eos_scored" in c:
            pad_is_eos = self.pad is not None and self.pad in self.stop
            mon.report("no_eos_target", step,
                       f"no scored label is EOS (ids {self.stop}) in {vrows} rows {batches}, {vshort} of them padded "
                       f"(shorter than their batch): the model is never trained to stop and generates until "
                       "max_new_tokens; the rows do not end with EOS"
                       + (f" (pad = EOS, id {self.pad}: the tokenizer must still append one to each row)" if pad_is_eos
                          else "") + ": append tokenizer.eos_token to each response and keep its label", (),
                       {"rows": vrows, "padded_rows": vshort, "eos_labels": 0, "eos_ids": self.stop, "pad_id": self.pad})
        trows, cut = c.get("d_trows", 0), c.get("d_cut", 0)
        short, short_eos = c.get("d_short", 0), c.get("d_short_eos", 0)
        if cut and short_eos and 2 * short_eos >= short and _share(cut, trows) > opts["truncated_share"]:
            mon.report("rows_truncated", step,
                       f"{cut} of {trows} rows ({_share(cut, trows):.0%}) fill the maximum length ({self.longest} tokens) "
                       f"and do not end with an EOS target, while {short_eos} of {short} shorter rows do {batches}: "
                       "truncation cut their responses, and the model learns not to stop; raise max_length, "
                       "truncate prompts rather than responses, or drop the rows that do not fit",
                       (), {"rows_cut": cut, "rows": trows, "fraction": _share(cut, trows), "max_length": self.longest,
                            "shorter_rows": short, "shorter_rows_ending_in_eos": short_eos, "eos_ids": self.eos})


class SpecialTokenInvalid(Detector):
    codes = ("special_token_invalid",)

    def begin(self, mon) -> None:
        rows = facts.embedding_rows(mon.model)
        cfg = facts.config(mon.model)
        tok = getattr(mon.tokenizer, "tokenizer", mon.tokenizer)
        named = []  # (where, name, id)
        if tok is not None:
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                value = getattr(tok, name, None)
                if isinstance(value, int):
                    named.append(("tokenizer", name, value))
        if cfg is not None:
            for name in ("bos_token_id", "eos_token_id"):
                value = facts.config_value(cfg, name)
                for each in (value if isinstance(value, (list, tuple)) else [value]):
                    if isinstance(each, int) and not isinstance(each, bool):
                        named.append(("config", name, each))
        if rows:
            bad = [(w, n, v) for w, n, v in named if v >= rows]  # a negative id is a config's "none" (-1)
            if bad:
                shown = ", ".join(f"the {w}'s {n} {v}" for w, n, v in bad)
                mon.report("special_token_invalid", 0,
                           f"{shown} {'is' if len(bad) == 1 else 'are'} outside the model's {rows} embedding rows "
                           f"(ids 0..{rows - 1}): a token added to the tokenizer without model.resize_token_embeddings"
                           f"(len(tokenizer)), or a config from another vocabulary; resize the embeddings or fix the id",
                           (), {"invalid": [{"where": w, "name": n, "id": v} for w, n, v in bad], "embedding_rows": rows})
                return
        if tok is not None and getattr(tok, "eos_token_id", None) is None and hasattr(tok, "eos_token_id"):
            if not hasattr(mon, "shifts_labels"):
                mon.shifts_labels = facts.shifts_labels(mon.model)
            wanted = facts.config_value(cfg, "eos_token_id")
            if mon.shifts_labels and wanted is not None:
                mon.report("special_token_invalid", 0,
                           f"the tokenizer has no EOS token, but the model's config stops on EOS id {wanted}: "
                           "rows tokenized with it cannot end with EOS and the model never learns to stop; set "
                           "tokenizer.eos_token (the model's) before tokenizing",
                           (), {"tokenizer_eos": None, "config_eos": wanted})
