"""``checkpoint_key_missing`` / ``checkpoint_tensor_empty`` / ``checkpoint_tensor_changed``: each save verified.

After every save the ``Trainer`` makes (its ``on_save`` event; :meth:`Monitor.saved` in a custom loop), the
weights written to disk are read back and compared with the weights in memory
(:mod:`ftshims.checkpoint.verify`: what the save should hold, from the model: PEFT's adapter state dict with
its ``modules_to_save`` copies and resized embeddings, else the state dict, tied aliases counted once; under
DeepSpeed ZeRO-3 the partitioned parameters gathered first, every rank taking part):

* ``checkpoint_key_missing``: a tensor of the model is not in the files (or a weight file cannot be read back);
  when the files name tensors the model does not have (transformers 5 saves some layouts converted back, MoE
  experts one tensor each), only the tensors both name are compared (``verify.compare_saved``);
* ``checkpoint_tensor_empty``: a tensor with no elements, or all zeros, on disk while the model's is not;
* ``checkpoint_tensor_changed``: another dtype, shape or values on disk than in memory.

Then ``ftshims-manifest.json`` goes beside the files (:mod:`ftshims.checkpoint.manifest`: the SHA-256 and size
of every file of the checkpoint, the tensors' dtypes and shapes) with ``ftshims-reference.safetensors``: the
logits of the model in memory on a fixed input of 4 token ids (eval mode, no gradient, no random number drawn),
which ``python -m ftshims.doctor --checkpoint DIR --reload`` compares with the reloaded model's (not under ZeRO-3
or FSDP, where an extra forward outside the engine's step is a risk to the run: see ``_sharded``). With every
code ``off``, nothing is read, written or computed at a save.

Cost: at each save (never per step) one read of the weight files and one hash of every file written, plus one
4-token forward; under several ranks one barrier (the hashes wait for every rank's files) and, under ZeRO-3,
the gather the Trainer's own save does. Checkpoints saved in a sharded format only (FSDP's SHARDED_STATE_DICT,
DeepSpeed without gathered 16-bit weights) have no full weight file, and FSDP's DTensor parameters would need a
collective to gather: these saves are hashed, not compared (one info line says so).
"""

from __future__ import annotations

import logging
import os

from . import Detector

log = logging.getLogger("ftshims.monitor")

CODES = ("checkpoint_key_missing", "checkpoint_tensor_empty", "checkpoint_tensor_changed")
REFERENCE_IDS = 4  # tokens of the fixed reference input


class CheckpointVerified(Detector):
    codes = CODES

    def __init__(self):
        self.notes = set()

    def saved(self, mon, directory: str, step: int) -> None:
        # Every rank takes the same path up to the end (barriers, ZeRO-3's gather): no rank may return early on
        # what it sees on disk. A rank that writes nothing can get here before rank 0 made the directory (DeepSpeed
        # with save_only_model: rank 1 returned, rank 0 waited at the barrier for ever).
        import torch.distributed as dist

        distributed = mon.world > 1 and dist.is_available() and dist.is_initialized()
        model = mon.model
        reference = None if _sharded(model) else _reference_logits(model)  # the same decision on every rank
        if distributed:
            dist.barrier()  # every rank's files are written before rank 0 reads and hashes them
        gathered = _gathered(model)
        with gathered:
            if mon.rank == 0 and directory and os.path.isdir(directory):
                self._verify(mon, model, directory, step, reference)
        if distributed:
            dist.barrier()  # the manifest is complete before any rank goes on (a later save may rotate this one)

    def _verify(self, mon, model, directory, step, reference) -> None:
        from ...checkpoint import manifest
        from ...checkpoint.verify import compare_saved, expected_weights, read_weights, tensor_records, weight_files

        name = os.path.basename(os.path.normpath(directory))
        records = None
        dtensors = any(hasattr(p, "full_tensor") for p in model.parameters())
        if dtensors and "fsdp" not in self.notes:  # gathering DTensors is a collective; rank 0 verifies alone
            self.notes.add("fsdp")
            log.info("%s: FSDP (DTensor) parameters: the save is hashed, not compared with memory", name)
        if weight_files(directory) and not dtensors:
            on_disk, where, unreadable = read_weights(directory)
            problems, renamed = compare_saved(on_disk, expected_weights(model))
            if renamed and "renamed" not in self.notes:
                self.notes.add("renamed")
                log.info("%s: the save names %d tensors otherwise than the model (e.g. %s: a layout converted on "
                         "save): only the tensors both name are compared", name, len(renamed), renamed[0])
            problems += [{"problem": "missing", "key": text.split(":", 1)[0], "detail": text} for text in unreadable]
            records = tensor_records(on_disk)
            self._report(mon, name, step, problems)
        elif "sharded" not in self.notes:
            self.notes.add("sharded")
            log.info("%s: no full weight file (a sharded save): hashed, not compared with memory", name)
        written = None
        if reference is not None:
            from safetensors.torch import save_file

            save_file(reference, os.path.join(directory, manifest.REFERENCE_NAME))
            written = {"file": manifest.REFERENCE_NAME, "input_ids": reference["input_ids"].tolist()}
        manifest.write(directory, "ftshims.monitor", tensors=records, reference=written, global_step=step)

    def _report(self, mon, name, step, problems) -> None:
        groups = {"checkpoint_key_missing": [p for p in problems if p["problem"] == "missing"],
                  "checkpoint_tensor_empty": [p for p in problems if p["problem"] in ("empty", "zero")],
                  "checkpoint_tensor_changed": [p for p in problems if p["problem"] == "changed"]}
        what = {"checkpoint_key_missing": "missing from the saved files",
                "checkpoint_tensor_empty": "empty or all zeros on disk, not in memory",
                "checkpoint_tensor_changed": "saved with another dtype, shape or values than in memory"}
        for code, found in groups.items():
            if not found:
                continue
            first = "; ".join(f"{p['key']} ({p['detail']})" for p in found[:3])
            mon.report(code, step, f"{name}: {len(found)} tensor{'s' if len(found) != 1 else ''} {what[code]}: {first}"
                       f"{' ...' if len(found) > 3 else ''}", (),
                       {"checkpoint": name, "tensors": [p["key"] for p in found], "problems": found[:20]})


class _Nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _gathered(model):
    """DeepSpeed ZeRO-3: the partitioned parameters gathered (a collective: every rank enters); else nothing."""
    params = [p for p in model.parameters() if hasattr(p, "ds_id")]
    if not params:
        return _Nothing()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _sharded(model) -> bool:
    """Parameters partitioned by DeepSpeed ZeRO-3 or sharded as DTensors (FSDP2). No reference forward there: an
    extra forward outside the engine's own step can leave ZeRO-3's parameter coordinator in a state whose next
    backward fails (seen with the monitor's packing re-run: deepspeed 0.19.8, TRL's packed SFT batches, "The size of
    tensor a (0) must match the size of tensor b (64)"), and the reference is a convenience for ``--reload``, not
    worth a risk to the run."""
    return any(hasattr(p, "ds_id") or hasattr(p, "full_tensor") for p in model.parameters())


def _reference_logits(model):
    """``{"input_ids", "logits"}`` (CPU, float32) of ``model`` on 4 fixed token ids, in eval mode without a
    gradient; None when the model takes no ``input_ids`` or returns no logits."""
    import torch

    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    rows = getattr(getattr(embeddings, "weight", None), "ds_shape", None) or getattr(getattr(embeddings, "weight", None), "shape", None)
    if not rows:
        return None
    vocab = int(rows[0])
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    ids = (torch.arange(REFERENCE_IDS, dtype=torch.long) * 7919 % max(vocab - 3, 1) + 3).clamp(max=vocab - 1)[None]
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            out = model(input_ids=ids.to(device))
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, dict):
            logits = out.get("logits")
    except Exception as exc:  # a model whose forward needs more than input_ids: no reference, said once
        log.info("no reference logits for --reload: the forward on input_ids alone raised %s", type(exc).__name__)
        return None
    finally:
        model.train(was_training)
    if logits is None or not hasattr(logits, "detach"):
        return None
    return {"input_ids": ids.contiguous(), "logits": logits.detach().float().cpu().contiguous()}
