"""The default shims and the monitor add no host-device synchronisation to a training step.

A project rule: whatever runs every training step adds no host-device sync. A CPU run shows
the signature of one: an op that reads a tensor's value on the host (``tests/hostsync.py``
counts them, by op and by the line that asked). Each scenario runs the same training steps
twice in this process, once without ftshims and once under the default ``ftshims.apply()``
(the model and batch built the same way each time, after the switch), and counts the
syncs of the *second* step: one-time work on the first step (a model's profile, a
Trainer's first micro-batch watched by ``num_items_in_batch_ignored``) is allowed. The
shims must add zero, op by op.

Scenarios: a custom loop (forward, backward, ``clip_grad_norm_``, AdamW step) on a tiny
Llama (plain, left-padded, eager left-padded, a packed row with restarting
``position_ids`` with and without an all-ones mask), GPT-2, a BERT sequence classifier,
RoBERTa fed by ``DataCollatorWithFlattening``, Gemma (``hidden_act="gelu"``, as released)
and this stack's hybrid (Qwen3.5, else Qwen3-Next), plain and packed; and a ``Trainer``
with gradient accumulation 2, where the Trainer-side shims act (``num_items_in_batch_*``,
the label smoother shims). Which shims are active comes from the registry (``apply()``'s
report); a scenario names the shims that acted in it.

The monitor (``ftshims.monitor.callback(read="log")``, the accelerator path) on a Trainer
run adds none between its read points: its steps that are not logging steps have exactly
the plain run's syncs, apart from its documented host-side token check (on CPU tensors:
the collated batch, and here the forward's ids, which live on the CPU in this run); at a
logging step its read is allowed, and counted.

Run as a script (``ST_PY=1 st t5_25 tests/lifecycle/test_no_host_sync.py``) it prints the
sync counts of every scenario, each way.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import tempfile

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import ftshims  # noqa: E402
from ftshims import _util  # noqa: E402
from ftshims.tiny import TINY_LLAMA, quiet  # noqa: E402
from tests.hostsync import SyncCounter, added, by_op, describe  # noqa: E402

VOCAB = 128
COUNTED_STEP = 2  # the step whose syncs are compared; step 1 may do one-time work


# ---------------------------------------------------------------------------
# models and batches (tiny, from configs)


def _from_config(config_class: str, auto: str = "AutoModelForCausalLM", attn: str = "sdpa", **fields):
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(0)
    with quiet():
        try:
            model = getattr(transformers, auto).from_config(config, attn_implementation=attn)
        except (TypeError, ValueError):  # < 4.36: no choice; a model without sdpa on this release: its default
            model = getattr(transformers, auto).from_config(config)
    return model.train()


def _ids(batch: int, length: int, seed: int = 0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _lm_batch(batch=2, length=16, left_pad=0):
    ids = _ids(batch, length)
    mask = torch.ones_like(ids)
    if left_pad:
        mask[0, :left_pad] = 0
        ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _packed_batch(lengths=(5, 7, 4), mask: bool = True):
    ids = torch.cat([_ids(1, n, seed=i)[0] for i, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)[:-1].tolist()))] = -100
    batch = {"input_ids": ids, "position_ids": positions, "labels": labels}
    if mask:
        batch["attention_mask"] = torch.ones_like(ids)  # LLaMA-Factory's packing: an all-ones mask
    return batch


def llama(attn="sdpa"):
    return _from_config("LlamaConfig", attn=attn, **TINY_LLAMA)


def gpt2():
    return _from_config("GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)


def gemma():
    fields = dict(TINY_LLAMA, head_dim=16, hidden_act="gelu", hidden_activation="gelu_pytorch_tanh")
    return _from_config("GemmaConfig", **fields)


def bert_classifier():
    return _from_config("BertConfig", "AutoModelForSequenceClassification", vocab_size=VOCAB, hidden_size=64,
                        num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                        num_labels=3)


def roberta():
    return _from_config("RobertaConfig", "AutoModelForMaskedLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=128, max_position_embeddings=66, pad_token_id=1)


def hybrid_family():
    """This stack's hybrid decoder whose masks come from masking_utils (None when it has none)."""
    from ftshims.shims import _packing

    for family in ("qwen3_5", "qwen3_next"):
        if _packing.family_available(family):
            return family
    return None


def hybrid():
    from ftshims.shims import _packing

    with quiet():
        return _packing.tiny_decoder(hybrid_family(), "sdpa")


def _seqcls_batch():
    batch = _lm_batch(left_pad=0)
    batch["attention_mask"][1, -5:] = 0  # right padding
    batch["labels"] = torch.tensor([0, 2])
    return batch


def _flattened_batch():
    """What transformers' DataCollatorWithFlattening returns for three examples (MLM-style labels kept)."""
    from transformers import DataCollatorWithFlattening

    features = [{"input_ids": _ids(1, n, seed=i)[0].tolist()} for i, n in enumerate((6, 9, 5))]
    return dict(DataCollatorWithFlattening()(features))


# name -> (model builder, batch builder, needs)
LOOP = {
    "llama": (llama, _lm_batch, None),
    "llama-left-padded": (llama, lambda: _lm_batch(left_pad=5), None),
    "llama-eager-left-padded": (lambda: llama("eager"), lambda: _lm_batch(left_pad=5), None),
    "llama-eager-fp16-left-padded": (lambda: llama("eager").half(), lambda: _lm_batch(left_pad=5), None),
    "llama-packed-ones-mask": (llama, _packed_batch, None),
    "llama-packed-no-mask": (llama, lambda: _packed_batch(mask=False), None),
    "gpt2": (gpt2, lambda: _lm_batch(left_pad=3), None),
    "bert-seqcls": (bert_classifier, _seqcls_batch, None),
    "roberta-flattened": (roberta, _flattened_batch, "DataCollatorWithFlattening"),
    "gemma": (gemma, _lm_batch, None),
    "hybrid": (hybrid, _lm_batch, "hybrid"),
    "hybrid-packed": (hybrid, lambda: _packed_batch(mask=False), "hybrid"),
}


def _skip_reason(needs):
    if needs == "hybrid" and hybrid_family() is None:
        return f"transformers {transformers.__version__} has no Qwen3.5 / Qwen3-Next"
    if needs == "DataCollatorWithFlattening" and not hasattr(transformers, "DataCollatorWithFlattening"):
        return f"transformers {transformers.__version__} has no DataCollatorWithFlattening"
    return None


# ---------------------------------------------------------------------------
# running with and without ftshims


@contextlib.contextmanager
def _shims(on: bool):
    """The default ``apply()`` for the block (nothing at all when ``on`` is False); the report, and what acted."""
    ftshims.revert()
    _util.ACTIONS.clear()
    state = {"report": None, "acted": {}}
    if on:
        state["report"] = ftshims.apply()
    try:
        yield state
    finally:
        state["acted"] = {shim: n for (shim, _), n in _util.ACTIONS.items()}
        ftshims.revert()


def run_loop(make_model, make_batch, on: bool, steps: int = COUNTED_STEP):
    """Syncs per step of a custom training loop; and the shims that acted."""
    with _shims(on) as state, SyncCounter() as counter:
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(1, steps + 1):
            batch = make_batch()
            counter.step(step)
            out = model(**batch)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            counter.step(None)
    return counter.counts, state


def _trainer(model, rows, output_dir, monitor=None, **arguments):
    from transformers import Trainer, TrainingArguments

    defaults = dict(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                    learning_rate=1e-3, logging_steps=100, save_strategy="no", report_to=[], disable_tqdm=True,
                    use_cpu=True, dataloader_num_workers=0, seed=0)
    defaults.update(arguments)
    with quiet():
        args = TrainingArguments(**defaults)
        return Trainer(model=model, args=args, train_dataset=rows, data_collator=_collate,
                       callbacks=[monitor] if monitor is not None else None)


def _collate(rows):
    return {key: torch.stack([torch.as_tensor(row[key]) for row in rows]) for key in rows[0]}


def _bucketed(trainer, counter):
    """Count each optimizer step (its batches fetched, its micro-batches, clipping, the update) in its own
    bucket, and what follows it (logging) in ``("after", step)``."""
    from transformers import TrainerCallback

    fetch = trainer.get_batch_samples

    def get_batch_samples(*args, **kwargs):
        counter.step(trainer.state.global_step + 1)
        return fetch(*args, **kwargs)

    trainer.get_batch_samples = get_batch_samples

    class Buckets(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            counter.step(("after", state.global_step))

        def on_train_end(self, args, state, control, **kwargs):
            counter.step(None)

    trainer.add_callback(Buckets())


def run_trainer(make_model, make_rows, on: bool, monitor_options=None, **arguments):
    """Syncs per optimizer step of ``Trainer.train()``; and the shims that acted (and the monitor, if any)."""
    with _shims(on) as state, tempfile.TemporaryDirectory() as output_dir:
        monitor = None
        if monitor_options is not None:
            import ftshims.monitor

            monitor = ftshims.monitor.callback(**monitor_options)
        trainer = _trainer(make_model(), make_rows(), output_dir, monitor, **arguments)
        with SyncCounter() as counter:
            _bucketed(trainer, counter)
            with quiet():
                trainer.train()
        state["monitor"] = monitor
    return counter.counts, state


def _lm_rows(n=16, length=12):
    ids = _ids(n, length, seed=1)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row.clone()} for row in ids]


def _seqcls_rows(n=16, length=12):
    ids = _ids(n, length, seed=2)
    return [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": torch.tensor(i % 3)}
            for i, row in enumerate(ids)]


def prefix_tuned_llama():
    from peft import PrefixTuningConfig, get_peft_model

    with quiet():
        return get_peft_model(llama(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))


TRAINER = {
    "trainer-bert-seqcls-ga2": (bert_classifier, _seqcls_rows, {}),
    "trainer-prefix-tuning-label-smoothing": (prefix_tuned_llama, _lm_rows, {"label_smoothing_factor": 0.1}),
    "trainer-llama-ga2": (llama, _lm_rows, {}),
    "trainer-llama-ga2-label-smoothing": (llama, _lm_rows, {"label_smoothing_factor": 0.1}),
}


# Reads that only happen on CPU tensors (an explicit ``device.type == "cpu"`` branch: free on the host, where this
# test runs), each with the test showing that its device branch reads nothing: (file, function) -> that test.
HOST_ONLY = {
    ("ftshims/shims/roberta_flattened_position_ids.py", "forward"):
        "tests/shims/test_roberta_flattened_position_ids.py::test_reads_no_value_off_the_cpu",
}
# The reads the packing detection costs, allowed and named (left open: docs/hostsync.md). Deciding whether a row
# holds several examples needs one value from the device (bool(starts.any())); without it the shims would have to
# give every unpacked batch an explicit mask, which moves SDPA off its is_causal kernels (numbers and speed change
# on a GPU). (file, function) -> why. Any other added read fails.
PACKING_DETECTION = {
    ("ftshims/shims/_packing.py", "segments"):
        "packing_block_mask / packing_recurrent_state: _packing.segments() reads bool(starts.any()) once per mask "
        "build of a masking_utils decoder (unpacked batches too), and once in packing_recurrent_state's base forward",
    ("ftshims/shims/encoder_packing_block_mask.py", "packed_segments"):
        "encoder_packing_block_mask: packed_segments() reads bool(starts.any()) once per padding-free forward of an "
        "encoder it keeps apart (transformers 5.x; the BERT/RoBERTa line only before 5.25)",
    ("ftshims/shims/packing_recurrent_state.py", "_spans"):
        "packing_recurrent_state: _spans() reads segment_ids.tolist() on a packed forward of a hybrid model",
}
# Upstream's own check of a custom 4D mask (``attention_mask.max() != 0``, 4.37-4.52 per-family route): it reads
# only when packing_block_mask handed it the block mask of a packed row, in place of the padding check it skips.
UPSTREAM_4D_MASK_CHECK = "_update_causal_mask"


def _where(site: str):
    path, _, rest = site.rpartition(":")
    return path, rest.partition("(")[2].rstrip(")")


def _without(counts, sites):
    return collections.Counter({key: n for key, n in counts.items() if _where(key[1]) not in sites})


def _assert_none_added(name, plain, shimmed, state, step=COUNTED_STEP):
    counted = _without(shimmed[step], HOST_ONLY)
    extra = added(plain[step], counted)
    if not extra:
        return
    message = (f"{name}: the default shims add host reads to training step {step}: {extra} "
               f"(shims that acted: {state['acted']})\n{describe(plain[step], shimmed[step])}")
    grown = {_where(site) for (op, site), n in counted.items() if n > plain[step][(op, site)]}
    allowed = set(PACKING_DETECTION)
    if "packing_block_mask" in state["acted"]:
        allowed |= {where for where in grown if where[0].startswith("transformers/") and where[1] == UPSTREAM_4D_MASK_CHECK}
    if grown and grown <= allowed:
        print("allowed (packing detection): " + message)  # counted, named, and shown with -s
        return
    raise AssertionError(message)


# ---------------------------------------------------------------------------
# the tests


@pytest.fixture(autouse=True)
def _isolated():
    ftshims.revert()
    yield
    ftshims.revert()


@pytest.mark.parametrize("name", list(LOOP))
def test_default_shims_add_no_sync_to_a_training_step(name):
    make_model, make_batch, needs = LOOP[name]
    reason = _skip_reason(needs)
    if reason:
        pytest.skip(reason)
    plain, _ = run_loop(make_model, make_batch, on=False)
    shimmed, state = run_loop(make_model, make_batch, on=True)
    assert state["report"] is not None and state["report"].applied  # the registry's defaults were in place
    _assert_none_added(name, plain, shimmed, state)


def test_the_count_sees_a_sync_a_wrapper_adds():
    """The comparison can fail: a forward pre-hook that reads one value (``int(ids.max())``, what a shim's range
    check might do) and one ``.tolist()`` is found, with its line."""

    def read(module, args, kwargs):
        int(kwargs["input_ids"].max())
        kwargs["labels"][0, :2].tolist()

    def reading_llama():
        model = llama()
        model.register_forward_pre_hook(read, with_kwargs=True)
        return model

    plain, _ = run_loop(llama, _lm_batch, on=False)
    reading, _ = run_loop(reading_llama, _lm_batch, on=False)
    assert added(plain[COUNTED_STEP], reading[COUNTED_STEP]) == {"aten::_local_scalar_dense": 1, "Tensor.tolist": 1}
    assert "test_no_host_sync.py" in describe(plain[COUNTED_STEP], reading[COUNTED_STEP])


@pytest.mark.parametrize("name", list(TRAINER))
def test_default_shims_add_no_sync_to_a_trainer_step(name):
    make_model, make_rows, arguments = TRAINER[name]
    if not hasattr(transformers.Trainer, "get_batch_samples"):
        pytest.skip(f"transformers {transformers.__version__}: no Trainer.get_batch_samples (4.46+) to count steps by")
    plain, _ = run_trainer(make_model, make_rows, on=False, **arguments)
    shimmed, state = run_trainer(make_model, make_rows, on=True, **arguments)
    for step in (COUNTED_STEP, COUNTED_STEP + 1):
        _assert_none_added(name, plain, shimmed, state, step)


# ---------------------------------------------------------------------------
# the monitor

# Where the monitor may read values between its read points: the token-id check on CPU tensors (the collated
# batch on the host; in this CPU run the forward's ids too, which on an accelerator take the device-side branch,
# checked by test_monitor_token_check_reads_nothing_on_a_device)
MONITOR_HOST_SITES = ("ftshims/monitor/detectors/tokens.py",)


def _monitor_sites(counts):
    return collections.Counter({key: n for key, n in counts.items() if not key[1].startswith(MONITOR_HOST_SITES)})


def _monitor_runs():
    if not hasattr(transformers.Trainer, "get_batch_samples"):
        pytest.skip(f"transformers {transformers.__version__}: no Trainer.get_batch_samples (4.46+) to count steps by")
    arguments = dict(max_steps=4, logging_steps=3)
    plain, _ = run_trainer(llama, _lm_rows, on=False, **arguments)
    watched, state = run_trainer(llama, _lm_rows, on=False, monitor_options={"read": "log"}, **arguments)
    return plain, watched, state


def test_monitor_adds_no_sync_between_its_read_points():
    """read="log" (the accelerator path): steps 2 and 4 are not logging steps; step 3 is, and its read (after the
    Trainer's own tr_loss.item()) is the documented read point."""
    plain, watched, state = _monitor_runs()
    assert state["monitor"].monitor is not None and state["monitor"].monitor.steps_done == 4
    for step in (2, 3, 4):
        extra = added(plain[step], _monitor_sites(watched[step]))
        assert not extra, f"the monitor adds host reads to step {step}: {extra}\n{describe(plain[step], watched[step])}"
    for step in (("after", 2),):
        assert not added(plain[step], watched[step]), describe(plain[step], watched[step])
    read = added(plain[("after", 3)], watched[("after", 3)])
    assert read, "the logging step's read point should show the monitor's reads (is the counter blind?)"


def test_monitor_token_check_reads_nothing_on_a_device():
    """The forward-side token check on ids that are not CPU tensors (meta here: no values exist) is device work."""
    from ftshims.monitor.core import Micro
    from ftshims.monitor.detectors.tokens import TokenIdOutOfRange

    detector = TokenIdOutOfRange()
    detector.rows = VOCAB
    micro = Micro(1, 0, None)
    ids = torch.empty(2, 8, dtype=torch.long, device="meta")
    with SyncCounter() as counter:
        counter.step(1)
        detector.batch(None, {"input_ids": ids}, micro)
    assert not counter.counts[1] and set(micro.ints) == {"min_id", "max_id"}


if __name__ == "__main__":
    if sys.argv[1:] == ["monitor"]:
        plain, watched, _ = _monitor_runs()
        for step in sorted(set(plain) | set(watched), key=str):
            print(f"monitor step {step}: plain {dict(by_op(plain[step]))} | monitor {dict(by_op(watched[step]))}")
            print(describe(plain[step], watched[step]))
        sys.exit(0)
    selected = sys.argv[1:]
    for table, runner in ((LOOP, run_loop), (TRAINER, run_trainer)):
        for name, entry in table.items():
            if selected and name not in selected:
                continue
            reason = _skip_reason(entry[2]) if table is LOOP else None
            if reason:
                print(f"{name}: skipped ({reason})")
                continue
            extra = {} if table is LOOP else entry[2]
            plain, _ = runner(entry[0], entry[1], False, **extra)
            shimmed, state = runner(entry[0], entry[1], True, **extra)
            for step in sorted(set(plain) | set(shimmed), key=str):
                print(f"{name} step {step}: plain {dict(by_op(plain[step]))} | shims {dict(by_op(shimmed[step]))}")
            print(f"  acted: {state['acted']}")
            print(describe(plain[COUNTED_STEP], shimmed[COUNTED_STEP]))
