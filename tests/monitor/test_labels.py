"""eos_never_target (pad = EOS collation), loss_count_mismatch (the Trainer's num_items_in_batch) and
labels_all_ignored, on real Trainer runs."""

import torch

import ftshims
from ftshims.monitor import catalogue

from .runs import assert_explains, corpus, default_stack_only, in_order, rows_dataset, train

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, 64)]


def _eos_run():
    """A pad = EOS tokenizer, examples of different lengths each ending in EOS, transformers' causal-LM collator."""
    from transformers import DataCollatorForLanguageModeling

    from ftshims import tiny

    tokenizer = tiny.word_tokenizer(WORDS, bos_token="<s>", eos_token="</s>")
    tokenizer.pad_token = tokenizer.eos_token
    g = torch.Generator().manual_seed(0)
    examples = []
    for i in range(64):
        n = 4 + int(torch.randint(0, 6, (1,), generator=g))
        words = " ".join(f"w{3 + (i + 2 * k) % 60}" for k in range(n))
        examples.append({"input_ids": tokenizer(words)["input_ids"] + [tokenizer.eos_token_id]})
    model = tiny.tiny_llama(vocab_size=len(WORDS), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                            bos_token_id=tokenizer.bos_token_id)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return model, examples, collator, tokenizer


def test_eos_never_a_label_when_pad_is_eos():
    shim = "eos_label_kept_when_pad_is_eos"  # opt-in: apply() alone leaves it out
    ftshims.apply()
    model, examples, collator, tokenizer = _eos_run()
    broken = train(model, examples, max_steps=50, logging_steps=10, trainer_kwargs={"data_collator": collator})
    assert broken.error is None, broken.error
    finding = broken.only("eos_never_target")
    assert finding.step == 50 and finding.detail["eos_in_inputs"] > 0 and finding.detail["eos_labels"] == 0
    assert_explains(finding, shim)
    assert "opt-in" in finding.message and "include=['eos_label_kept_when_pad_is_eos']" in finding.message
    advisory = "trl_sft_eos_label_masked_when_pad_is_eos"
    assert (advisory in finding.explains) == catalogue.exists_here(advisory)
    ftshims.revert()
    ftshims.apply(include=[shim])
    model, examples, collator, tokenizer = _eos_run()
    train(model, examples, max_steps=50, logging_steps=10, trainer_kwargs={"data_collator": collator}).none()


def test_num_items_in_batch_counting_unscored_labels():
    shim, advisory = "num_items_in_batch_overcount", "num_items_in_batch_overcount_4_46"
    from ftshims import tiny

    data = rows_dataset(corpus(n=32, seq=16))
    ftshims.apply(exclude=[shim])
    broken = train(tiny.tiny_llama(), data, max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=2,
                   monitor={"off": []})  # runs.train() leaves loss_count_mismatch out where no shim fixes it
    assert broken.error is None, broken.error
    if not (catalogue.exists_here(shim) or catalogue.exists_here(advisory)):
        broken.none()  # counted right (5.10.1+), or no num_items_in_batch at all (< 4.46)
        return
    finding = broken.only("loss_count_mismatch")
    # 2 micro-batches of 2 rows x 16 labels: the loss scores 2 x 2 x 15; the overcount adds position 0 of each row
    assert finding.detail["scored_labels"] == 60 and finding.detail["num_items_in_batch"] == 64, finding.detail
    assert finding.step == 1 and finding.detail["micro_batches"] == 2
    if catalogue.exists_here(shim):
        assert finding.explains == [shim]
        assert_explains(finding, shim)
        ftshims.revert()
        ftshims.apply()
        train(tiny.tiny_llama(), data, max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=2).none()
    else:  # 4.46.2-4.56: counted inline, no shim can fix it; the advisory says so
        assert finding.explains == [advisory] and finding.detail["applied"] == {advisory: False}


@default_stack_only
def test_batch_without_targets():
    from ftshims import tiny

    rows = corpus(n=16, seq=16)
    rows["labels"][4:8] = -100  # the second batch of 4 rows has nothing to predict
    ftshims.apply()
    result = train(tiny.tiny_llama(), rows_dataset(rows), max_steps=3, trainer_class=in_order(),
                   monitor={"off": ["nonfinite_loss"]})
    finding = result.only("labels_all_ignored")
    assert finding.step == 2
    assert finding.explains == [c for c in ("trl_completion_only_template_miss",) if catalogue.exists_here(c)]
