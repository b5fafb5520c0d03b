"""num_items_in_batch_overcount: the Trainer normalises a causal LM's summed loss by the labels the shifted
loss scores (transformers 4.57-5.10.0 counted position 0 of every row as well)."""

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry

SHIM = "num_items_in_batch_overcount"
probe_module = registry.get(SHIM).module


def test_full_labels_loss_is_mean_over_scored_tokens(evidence):
    assert_bug_and_fix(SHIM, evidence, "full labels", labels="full")


def test_loss_delegated_to_a_text_model_is_counted_too(evidence):
    """Kosmos-2 hands its labels to its text model, whose ForCausalLMLoss shifts (issue 37 lead 9: 16 counted for
    14 scored labels on 4.57.6, loss x0.875)."""
    assert_bug_and_fix(SHIM, evidence, "kosmos-2, loss delegated to its text model", labels="full", arch="kosmos-2")


def test_completion_only_labels_are_healthy_everywhere(evidence):
    """Position 0 is already -100: the count is right on every version, and the shim changes nothing."""
    assert_bug_and_fix(SHIM, evidence, "completion-only labels", expect_bug=False, labels="completion_only")


def _trainer(model):
    import tempfile

    from transformers import Trainer, TrainingArguments

    if not hasattr(Trainer, "_get_num_items_in_batch"):
        pytest.skip("this Trainer has no _get_num_items_in_batch (before 4.57)")
    out = tempfile.mkdtemp()
    return Trainer(model=model, args=probe_module._training_args(TrainingArguments, out))


def test_non_causal_model_count_unchanged():
    """A sequence-classification model's loss does not shift: its count is left to upstream."""
    import torch
    import transformers

    from ftshims import tiny

    config = transformers.LlamaConfig(**dict(tiny.TINY_LLAMA, num_labels=2))
    with tiny.quiet():
        model = transformers.AutoModelForSequenceClassification.from_config(config)
        trainer = _trainer(model)
    batch = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "labels": torch.tensor([0, 1])}
    plain = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    with ftshims.applied(only=[SHIM]):
        shimmed = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert (plain is None and shimmed is None) or int(plain) == int(shimmed)


def test_batches_are_not_modified_and_shift_labels_are_counted():
    import torch

    from ftshims import tiny

    with tiny.quiet():
        trainer = _trainer(tiny.tiny_llama())
    labels = torch.tensor([[5, 6, 7, 8], [9, 10, -100, -100]])
    batch = {"input_ids": labels.clamp(min=3), "labels": labels}
    shifted = dict(batch, shift_labels=torch.tensor([[6, 7, -100, -100], [10, -100, -100, -100]]))
    with ftshims.applied(only=[SHIM]) as report:
        if not report[SHIM].active:
            pytest.skip(f"{SHIM} not active on this stack: {report[SHIM].reason}")
        num = trainer._get_num_items_in_batch([batch, shifted], torch.device("cpu"))
        actions = ftshims.status()[SHIM].actions
    assert batch["labels"] is labels and shifted["labels"] is labels  # the training batches are untouched
    assert int(num) == 4 + 3  # labels[..., 1:] of the first batch, shift_labels of the second
    assert actions == {"batches counted over the scored labels": 2}


# Encoder-decoders: their decoders score every label (decoder_input_ids are the labels shifted right), so the count
# must stay over all labels (#46903). ftshims 0.1.0's backport counted labels[..., 1:] for them too: T5 got 10 for
# 2 x 6 labels.
ROWS, LABELS_PER_ROW = 2, 6


def _encoder_decoder(name):
    import transformers

    from ftshims import tiny

    common = dict(vocab_size=64, pad_token_id=0, decoder_start_token_id=0, eos_token_id=1)
    if name == "t5":
        config = transformers.T5Config(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2,
                                       **common)
        cls = transformers.T5ForConditionalGeneration
    else:
        config = transformers.BartConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                         decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                         max_position_embeddings=32, bos_token_id=2, **common)
        cls = transformers.BartForConditionalGeneration
    import torch

    torch.manual_seed(0)
    with tiny.quiet():
        return cls(config)


def _encoder_decoder_step(name, shims_on: bool):
    """One Trainer step (two micro-batches of ROWS x LABELS_PER_ROW) with a compute_loss_func that records the
    num_items_in_batch it is handed; returns (the counts seen, the loss of each micro-batch)."""
    import inspect
    import tempfile

    import torch
    from transformers import Trainer, TrainingArguments

    from ftshims import tiny

    if "compute_loss_func" not in inspect.signature(Trainer.__init__).parameters:
        pytest.skip("this Trainer has no compute_loss_func (before 4.46)")
    torch.manual_seed(1)
    rows = []
    for _ in range(2 * ROWS):
        labels = torch.randint(5, 64, (LABELS_PER_ROW,)).tolist()
        # compute_loss_func makes the Trainer pop the labels, so the decoder inputs come with the batch (shifted right)
        rows.append({"input_ids": torch.randint(5, 64, (8,)).tolist(), "labels": labels,
                     "decoder_input_ids": [0] + labels[:-1]})
    seen, losses = [], []

    def compute_loss(outputs, labels, num_items_in_batch=None):
        seen.append(None if num_items_in_batch is None else int(num_items_in_batch))
        logits = outputs.logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                                 reduction="sum") / (num_items_in_batch or labels.numel())
        losses.append(float(loss))
        return loss

    with tempfile.TemporaryDirectory() as out, tiny.quiet():
        args = probe_module._training_args(TrainingArguments, out)
        args = TrainingArguments(**dict(args.to_dict(), output_dir=out, gradient_accumulation_steps=2, max_steps=1,
                                        save_strategy="no", learning_rate=0.0, disable_tqdm=True, report_to=[]))
        context = ftshims.applied(only=[SHIM]) if shims_on else _nothing()
        with context:
            model = _encoder_decoder(name)
            Trainer(model=model, args=args, train_dataset=rows, compute_loss_func=compute_loss).train()
    return seen, losses


def _nothing():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_count_is_every_label(name):
    """T5/BART with a compute_loss_func: num_items_in_batch is all 2 x 2 x 6 labels, with the shim as without it."""
    plain_seen, plain_losses = _encoder_decoder_step(name, shims_on=False)
    shim_seen, shim_losses = _encoder_decoder_step(name, shims_on=True)
    if plain_seen != [None] * 2:  # 4.46-4.52 hand no count to a model without loss kwargs (T5/BART there)
        assert plain_seen == [2 * ROWS * LABELS_PER_ROW] * 2, plain_seen  # upstream counts every decoder target
    assert shim_seen == plain_seen, f"the shim changed an encoder-decoder's count: {shim_seen} vs {plain_seen}"
    assert shim_losses == plain_losses


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_encoder_decoder_is_not_a_shifting_loss(name):
    """The decision itself, on every stack that has LOSS_MAPPING: loss_type maps to ForCausalLMLoss, yet no shift."""
    from ftshims import tiny

    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        pytest.skip("no transformers.loss (before 4.46)")
    model = _encoder_decoder(name)
    if LOSS_MAPPING.get(getattr(model, "loss_type", None)) is not ForCausalLMLoss:
        pytest.skip(f"no trap on this version: {type(model).__name__}.loss_type is {getattr(model, 'loss_type', None)!r}")
    # the trap: "ForConditionalGeneration" maps to ForCausalLMLoss
    with tiny.quiet():
        trainer = _trainer(model)
    assert not probe_module.loss_shifts_labels(trainer)


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning"])
def test_prompt_learning_that_prepends_labels_keeps_the_full_count(method):
    """Do no harm: PEFT prompt tuning / p-tuning prepend num_virtual_tokens labels of -100, so the shifted loss scores
    every label of the batch (label 0 by the last virtual position). The installed count over all labels is exact;
    counting labels[..., 1:] would drop one target per row (16 -> 14 here)."""
    import torch
    from peft import PromptEncoderConfig, PromptTuningConfig, get_peft_model

    from ftshims import tiny

    config = (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3) if method == "prompt_tuning" else
              PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=3, encoder_hidden_size=16))
    with tiny.quiet():
        model = get_peft_model(tiny.tiny_llama(), config)
        trainer = _trainer(model)
    batch = tiny.batch(batch_size=2, seq_len=8)
    padded = torch.cat([torch.full((2, 3), -100), batch["labels"]], dim=1)  # what PEFT's forward hands the loss
    scored = int(padded[..., 1:].ne(-100).sum())
    with ftshims.applied(only=[SHIM]) as report:
        if not report[SHIM].active:
            pytest.skip(f"{SHIM} not active here: {report[SHIM].reason}")
        shimmed = trainer._get_num_items_in_batch([batch], torch.device("cpu"))
    assert int(shimmed) == scored == 16
