"""Learning progress judged from first principles (issue 35): each mistake of the issue gives its finding with its
cause, and healthy references (several architectures, LoRA, bf16 autocast, left padding, pad = EOS) give none.

* a learning rate far too high: ``loss_diverging`` (above ln 128, the loss of a uniform predictor over the tiny
  vocabulary, from step 2) and ``updates_too_large`` (the first AdamW step moves the weights by ~50 x their size);
* a learning rate of 1e-8 (typed for 1e-4): ``updates_vanishing`` (||dw||/||w|| ~ 5e-7);
* bf16 weights at lr 1e-5 (what transformers 5 loads by default for bf16 checkpoints): ``updates_lost`` (85-92 %
  of the elements with a gradient unchanged); fp32 weights with bf16 autocast: silent;
* padded rows none of which ends with EOS: ``no_eos_target``, whatever the pad token (with pad = EOS and the
  rows' EOS masked by the collator, test_labels.py's eos_never_target names the catalogue's fixes instead);
* an optimizer built before the LoRA adapters: ``trainable_not_in_optimizer`` at train begin;
* a custom loop that evaluated (``model.eval()``) and trains on without ``model.train()``: ``model_in_eval_mode``.

Tiny Llama (vocabulary 128; pad 0, BOS 1, EOS 2), learnable rows of ids 3..127 (runs.corpus).
"""

import math

import pytest
import torch

import ftshims
from .runs import corpus, default_stack_only, in_order, rows_dataset, train

pytestmark = default_stack_only

PAD, BOS, EOS = 0, 1, 2


def _llama(**overrides):
    from ftshims import tiny

    return tiny.tiny_llama(attn="sdpa", **overrides)


def _build(model_class: str, config_class: str, attn="eager", **fields):
    """A tiny randomly initialised ``transformers.<model_class>`` from ``<config_class>(**fields)``."""
    import transformers

    from ftshims import tiny

    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(0)
    with tiny.quiet():
        try:
            return getattr(transformers, model_class)._from_config(config, attn_implementation=attn)
        except (TypeError, ValueError):
            return getattr(transformers, model_class)(config)


def _run(model, rows, steps=12, **kwargs):
    ftshims.apply()
    kwargs.setdefault("per_device_train_batch_size", 8)
    result = train(model, rows_dataset(rows), max_steps=steps, **kwargs)
    assert result.error is None, result.error
    return result


def _codes(result):
    return sorted(result.codes)


def test_learning_rate_far_too_high_diverges_from_the_first_steps():
    result = _run(_llama(), corpus(n=512), learning_rate=1.0, lr_scheduler_type="constant")
    assert _codes(result) == ["loss_diverging", "updates_too_large"], [f.line() for f in result.findings]
    diverging = next(f for f in result.findings if f.code == "loss_diverging")
    assert diverging.step <= 7 and diverging.detail["criterion"] == "uniform", diverging.detail  # no warm-up wait
    assert diverging.detail["classes"] == 128 and diverging.detail["uniform_loss"] == pytest.approx(math.log(128))
    assert all(loss > diverging.detail["threshold"] for loss in diverging.detail["losses"])
    assert "worse than guessing" in diverging.message and "learning rate far too high" in diverging.message
    large = next(f for f in result.findings if f.code == "updates_too_large")
    assert large.step == 1 and large.detail["ratio"] > 0 and max(large.detail["ratios"]) > 10, large.detail
    # the same run at lr 1e-3: it learns, silently
    healthy = _run(_llama(), corpus(n=512), learning_rate=1e-3, lr_scheduler_type="constant")
    healthy.none()


def test_classifier_diverging_above_ln_num_labels():
    """A sequence classifier's head scores num_labels classes: the reference is ln 4."""
    def model():
        return _build("LlamaForSequenceClassification", "LlamaConfig", attn="sdpa", vocab_size=128, hidden_size=64,
                      intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                      num_labels=4, pad_token_id=PAD)

    rows = corpus(n=512, seq=16)
    rows["labels"] = rows["input_ids"][:, 1] % 4  # the class: learnable from the first tokens
    rows.pop("attention_mask")
    result = _run(model(), rows, learning_rate=3.0, lr_scheduler_type="constant",
                  monitor={"off": ["updates_too_large"]})
    finding = result.only("loss_diverging")
    assert finding.detail["classes"] == 4 and finding.detail["uniform_loss"] == pytest.approx(math.log(4))
    _run(model(), rows, learning_rate=1e-3).none()


def test_learning_rate_typo_1e_8_vanishing_updates():
    result = _run(_llama(), corpus(n=512), learning_rate=1e-8)
    finding = result.only("updates_vanishing")
    assert finding.detail["ratio"] < 1e-6 and "1e-8 typed for 1e-4" in finding.message
    assert finding.step == 3 and finding.detail["steps"] == [1, 2, 3]  # judged on the first 3 steps
    losses = [h["loss"] for h in result.trainer.state.log_history if "loss" in h]
    assert max(losses) - min(losses) > 1e-4  # the loss moves (batches differ): loss_not_moving cannot see it


def test_bf16_weights_without_master_copy_lose_the_updates():
    """transformers 5 loads a bf16 checkpoint in bf16 (dtype="auto"): AdamW's steps at lr 1e-5 round away."""
    result = _run(_llama().to(torch.bfloat16), corpus(n=512), learning_rate=1e-5)
    finding = result.only("updates_lost")
    assert finding.detail["lost_share"] > 0.8 and finding.detail["dtypes"] == ["bfloat16"], finding.detail
    for fix in ("dtype=torch.float32", "bf16=True", "stochastic rounding", "Kahan"):
        assert fix in finding.message, fix
    # the fix: fp32 weights, bf16 autocast
    _run(_llama(), corpus(n=512), learning_rate=1e-5, bf16=True).none()


def _padded(n=64, seq=16, end_with_eos=True, pad=PAD, side="right", seed=0):
    """Rows of 8..seq tokens (ending with EOS or not), padded with ``pad`` to seq; labels -100 on the padding."""
    rows = corpus(n=n, seq=seq, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    for i, length in enumerate(torch.randint(8, seq + 1, (n,), generator=g).tolist()):
        row = rows["input_ids"][i, :length].clone()
        if end_with_eos:
            row[-1] = EOS
        rows["input_ids"][i] = pad
        rows["attention_mask"][i] = 0
        where = slice(0, length) if side == "right" else slice(seq - length, seq)
        rows["input_ids"][i, where] = row
        rows["attention_mask"][i, where] = 1
    rows["labels"] = rows["input_ids"].masked_fill(rows["attention_mask"] == 0, -100)
    return rows


@pytest.mark.parametrize("pad", [PAD, EOS])
def test_padded_rows_that_never_end_with_eos(pad):
    result = _run(_llama(pad_token_id=pad), _padded(end_with_eos=False, pad=pad), steps=4, trainer_class=in_order())
    finding = result.only("no_eos_target")
    assert finding.step == 4 and finding.detail["eos_labels"] == 0 and finding.detail["padded_rows"] > 0
    assert finding.explains == [] and "append tokenizer.eos_token" in finding.message
    assert ("pad = EOS" in finding.message) is (pad == EOS)


@pytest.mark.parametrize("case", ["eos_right", "eos_left", "pad_is_eos_label_kept", "fixed_length", "packed"])
def test_rows_that_stop_or_need_not_stop_are_silent(case):
    """Rows ending with EOS (right or left padding, pad = EOS with its label kept) and data without padded rows
    (fixed-length chunks, packed rows with position ids) give no finding."""
    overrides = {}
    if case == "eos_right":
        rows = _padded()
    elif case == "eos_left":
        rows = _padded(side="left")
    elif case == "pad_is_eos_label_kept":
        overrides["pad_token_id"] = EOS
        rows = _padded(pad=EOS)  # the row's own EOS is attended and labelled; the padding after it is not
    elif case == "fixed_length":
        rows = corpus(n=64, seq=16)  # chunks of a token stream: no EOS, no padding
    else:
        rows = corpus(n=64, seq=16)
        rows["position_ids"] = torch.cat([torch.arange(8), torch.arange(8)]).repeat(64, 1)  # two examples per row
        rows["input_ids"][:, 7] = EOS
        rows["labels"] = rows["input_ids"].clone()
    _run(_llama(**overrides), rows, steps=4, trainer_class=in_order(), remove_unused_columns=False).none()


def test_optimizer_built_before_the_lora_adapters():
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    base = _llama()
    optimizer = torch.optim.AdamW([p for p in base.parameters() if p.requires_grad], lr=1e-3)  # before the adapters
    with tiny.quiet():
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    result = _run(model, corpus(n=64), steps=3, trainer_kwargs={"optimizers": (optimizer, None)})
    finding = result.findings[0]
    assert finding.code == "trainable_not_in_optimizer" and finding.step == 0, [f.line() for f in result.findings]
    assert finding.detail["parameters"] == finding.detail["trainable"] == 8  # 2 layers x q/v x A/B
    assert "none of them is" in finding.message and "after get_peft_model" in finding.message


@pytest.mark.parametrize("case", ["lora", "bf16_autocast", "left_padding", "pad_is_eos", "gpt2", "qwen2", "t5", "bert_cls"])
def test_healthy_references_no_findings(case):
    """30 steps each at the defaults: every new detector silent on healthy runs of other architectures, LoRA,
    bf16 autocast, left padding and pad = EOS."""
    from ftshims import tiny

    args = {"learning_rate": 1e-3}
    rows = corpus(n=256, seq=16)
    if case == "lora":
        model = tiny.lora(_llama())
        args["learning_rate"] = 5e-3
    elif case == "bf16_autocast":
        model = _llama()
        args["bf16"] = True
    elif case == "left_padding":
        model, rows = _llama(), _padded(n=256, side="left")
    elif case == "pad_is_eos":
        model, rows = _llama(pad_token_id=EOS), _padded(n=256, pad=EOS)
    elif case == "gpt2":
        model = tiny.causal_lm("GPT2Config", attn="eager", vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                               n_positions=64, bos_token_id=1, eos_token_id=2)
        rows = _padded(n=256)
    elif case == "qwen2":
        model = tiny.causal_lm("Qwen2Config", attn="sdpa", vocab_size=128, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    elif case == "t5":
        model = _build("T5ForConditionalGeneration", "T5Config", vocab_size=128, d_model=64, d_ff=128, d_kv=16,
                       num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2)
        targets = rows["input_ids"][:, 8:].clone()
        targets[:, -1] = EOS
        rows = {"input_ids": rows["input_ids"][:, :8], "attention_mask": rows["attention_mask"][:, :8],
                "labels": targets}
    else:
        model = _build("BertForSequenceClassification", "BertConfig", vocab_size=128, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_labels=3)
        rows = {"input_ids": rows["input_ids"], "attention_mask": rows["attention_mask"],
                "labels": rows["input_ids"][:, 0] % 3}
    result = _run(model, rows, steps=30, **args)
    result.none()
    monitor = result.callback.monitor
    updates = next(d for d in monitor.detectors.all if type(d).__name__ == "UpdateStats")
    assert updates.off is None and updates.judged_once, (updates.off, updates.steps)  # the statistics ran
    losses = [h["loss"] for h in result.trainer.state.log_history if "loss" in h]
    assert min(losses[-5:]) < losses[0], losses  # it trained


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_custom_loop_left_in_eval_mode(mode):
    from ftshims import tiny
    from ftshims.monitor import Monitor

    model = _llama(attention_dropout=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, optimizer, off=["loss_count_mismatch"])
    model.eval()  # an evaluation before training ...
    if mode == "train":
        model.train()  # ... undone
    for step in range(3):
        batch = tiny.batch(batch_size=2, seq_len=8, seed=step)
        loss = model(**batch).loss
        loss.backward()
        mon.after_backward(loss)
        optimizer.step()
        mon.after_step()
        optimizer.zero_grad()
    mon.close()
    codes = [f.code for f in mon.findings]
    if mode == "train":
        assert codes == [], [f.line() for f in mon.findings]
        return
    assert codes == ["model_in_eval_mode"], [f.line() for f in mon.findings]
    finding = mon.findings[0]
    assert finding.step == 1 and "config.attention_dropout=0.1" in finding.message and "model.train()" in finding.message


def test_update_statistics_read_nothing_between_read_points():
    """``read="log"`` (the accelerator path), update statistics on every step: the monitor's code reads no tensor
    value at steps 2-4 (the hostsync counter sees what would be a synchronisation on a device), and the statistics
    of those steps arrive at the read point (step 5: ``read_every``)."""
    from tests.hostsync import SyncCounter

    from ftshims import tiny
    from ftshims.monitor import Monitor

    model = _llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = Monitor(model, optimizer, read="log", read_every=5, update_every=1, off=["loss_count_mismatch"])
    updates = next(d for d in mon.detectors.all if type(d).__name__ == "UpdateStats")
    with SyncCounter() as counter:
        for step in range(1, 6):
            counter.step(step)
            batch = tiny.batch(batch_size=2, seq_len=8, seed=step)
            loss = model(**batch).loss
            loss.backward()
            mon.after_backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            mon.after_step()
            optimizer.zero_grad()
            if step == 4:
                assert len(updates.results) == 4 and updates.steps == []  # device values, not read yet
    for step in (2, 3, 4):
        # the token-id check reads CPU ids by design (free on the host; device-side on an accelerator)
        ours = {key: n for key, n in counter.counts[step].items()
                if "ftshims/monitor" in key[1] and "detectors/tokens.py" not in key[1]}
        assert not ours, (step, ours)
    assert any("ftshims/monitor" in key[1] for key in counter.counts[5]), "the read point reads (a blind counter?)"
    assert updates.results == [] and updates.judged_once  # read and judged at step 5
    mon.close()
    assert mon.findings == [], [f.line() for f in mon.findings]
