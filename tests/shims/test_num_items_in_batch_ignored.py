"""num_items_in_batch_ignored: with gradient accumulation, a head whose forward takes **kwargs but whose loss ignores
num_items_in_batch is divided by the accumulation steps (transformers >=4.48.1 skip the division for it: loss and
gradients N times too large)."""

import sys

import pytest
from tests.shimcheck import assert_bug_and_fix

import ftshims
from ftshims import registry

SHIM = "num_items_in_batch_ignored"
probe_module = registry.get(SHIM).module


def _transformers_at_least(version):
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(version)


def test_xlnet_classifier_accumulated_step_equals_whole_batch(evidence):
    """XLNet's forward has had **kwargs since 4.x (for a removed use_cache): inflated on every release in range."""
    assert_bug_and_fix(SHIM, evidence, "XLNet sequence classification, 4 x 1 vs 2 x 2 accumulated", kind="xlnet_seqcls")


def test_llama_classifier_accumulated_step_equals_whole_batch(evidence):
    """Llama-style heads (GenericForSequenceClassification) take **kwargs from 4.54 on and drop them."""
    assert_bug_and_fix(SHIM, evidence, "Llama sequence classification, 4 x 1 vs 2 x 2 accumulated",
                       expect_bug=_transformers_at_least("4.54"), kind="llama_seqcls")


def test_bert_classifier_accumulated_step_equals_whole_batch(evidence):
    """BERT-style heads take **kwargs from 5.0 on (4.57 had none: divided, healthy)."""
    assert_bug_and_fix(SHIM, evidence, "BERT sequence classification, 4 x 1 vs 2 x 2 accumulated",
                       expect_bug=_transformers_at_least("5.0"), kind="bert_seqcls")


def test_causal_lm_is_healthy_everywhere(evidence):
    """Control: a causal LM normalises by num_items_in_batch itself."""
    assert_bug_and_fix(SHIM, evidence, "Llama causal LM, 4 x 1 vs 2 x 2 accumulated", expect_bug=False,
                       kind="llama_clm")


def _step(kind, shim_on, accumulation=2):
    import contextlib

    context = ftshims.applied(only=[SHIM]) if shim_on else contextlib.nullcontext()
    with context as report:
        if shim_on and not report[SHIM].active:
            pytest.skip(f"{SHIM} not active on this stack: {report[SHIM].reason}")
        return probe_module.first_step(kind, batch_size=4 // accumulation, accumulation=accumulation)


def test_model_that_uses_num_items_in_batch_is_bit_identical():
    """Do no harm: the watched forward of a model whose loss uses the count runs the same operations (the mode only
    looks), and the trainer keeps model_accepts_loss_kwargs: every accumulated gradient is bit-identical."""
    import torch

    plain, shimmed = _step("llama_clm", shim_on=False), _step("llama_clm", shim_on=True)
    assert plain.accepts_loss_kwargs and shimmed.accepts_loss_kwargs
    assert plain.loss == shimmed.loss and torch.equal(plain.grads, shimmed.grads)


def test_a_forward_nested_in_the_first_one_does_not_decide(monkeypatch):
    """A forward of the same model run from inside the training forward (ftshims' monitor re-runs a packed row from
    its forward pre-hook) ends first, before the loss has used the count: it must not decide. It did (4.52 with the
    monitor's packing check): the trainer was switched to dividing a causal LM's loss by the accumulation steps."""
    import torch

    build = probe_module.build

    def with_a_nested_forward(kind):
        model, rows = build(kind)
        ran = []

        def rerun(module, args, kwargs):
            if not ran and module.training:
                ran.append(True)
                with torch.no_grad():
                    module(input_ids=kwargs["input_ids"][:1, :3])

        model.register_forward_pre_hook(rerun, with_kwargs=True)
        return model, rows

    plain = _step("llama_clm", shim_on=False)
    monkeypatch.setattr(probe_module, "build", with_a_nested_forward)
    shimmed = _step("llama_clm", shim_on=True)
    assert shimmed.accepts_loss_kwargs, "the nested forward decided that the loss ignores num_items_in_batch"
    assert plain.loss == shimmed.loss and torch.equal(plain.grads, shimmed.grads)


def test_fixed_step_is_the_step_without_accumulation():
    """The fixed accumulated step equals the model's own loss over the 4 rows at once: same gradients."""
    import torch

    whole, fixed = probe_module.whole_batch("llama_seqcls"), _step("llama_seqcls", shim_on=True)
    assert not fixed.accepts_loss_kwargs
    assert torch.allclose(whole.grads, fixed.grads, rtol=1e-5, atol=1e-7)
    assert abs(whole.loss - fixed.loss) < 1e-5


# What the watch counts as a use of num_items_in_batch: any operation on it, or on a tensor read from it.
@pytest.mark.parametrize("use,used", [
    (lambda loss, n: loss / n, True),
    (lambda loss, n: loss.sum() / n.to(loss.device), True),
    (lambda loss, n: loss / float(n), True),
    (lambda loss, n: loss / n.item(), True),
    (lambda loss, n: loss / n.data, True),  # a property that returns a tensor hands the watch on
    (lambda loss, n: [loss / d for d in [n]][0], True),
    (lambda loss, n: loss.mean() if n.shape == () and n.device.type == "cpu" else loss, False),  # metadata only
    (lambda loss, n: loss.mean(), False),
])
def test_watch_counts_every_use(use, used):
    import torch

    n = torch.tensor(4)
    watch = probe_module._Watch(n)
    with watch.mode:
        use(torch.ones(4), n)
    assert watch.used is used


def _trainer(model, **extra):
    import tempfile

    from transformers import Trainer, TrainingArguments

    from ftshims import tiny

    with tiny.quiet():
        args = TrainingArguments(output_dir=tempfile.mkdtemp(), report_to=[], **extra)
        return Trainer(model=model, args=args)


def test_stays_out_where_it_cannot_tell():
    """A forward that is not transformers' own, an explicit accepts_loss_kwargs, a compiled model, a non-tensor count
    and a compute_loss_func: the shim leaves the trainer's decision alone and says why."""
    import torch

    model, _ = probe_module.build("llama_seqcls")
    trainer = _trainer(model)
    count = torch.tensor(4)
    if not getattr(trainer, "model_accepts_loss_kwargs", False):
        pytest.skip("LlamaForSequenceClassification takes no **kwargs here (before 4.54)")
    assert probe_module.stays_out(trainer, model, count) is None
    assert "not a tensor" in probe_module.stays_out(trainer, model, 4)
    trainer.args.torch_compile = True  # (torch.compile(model) is caught too: OptimizedModule, nn.Module.compile())
    assert "compiled" in probe_module.stays_out(trainer, model, count)
    trainer.args.torch_compile = False

    class Custom(type(model)):
        def forward(self, *args, **kwargs):  # a user's own forward: its loss may read the count any way
            return super().forward(*args, **kwargs)

    custom = Custom(model.config)
    assert "not transformers' own" in probe_module.stays_out(_trainer(custom), custom, count)

    class Declared(type(model)):
        accepts_loss_kwargs = True

    declared = Declared(model.config)
    trainer = _trainer(declared)
    assert "declares accepts_loss_kwargs" in probe_module.stays_out(trainer, declared, count)
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    assert "compute_loss_func" in probe_module.stays_out(trainer, declared, count)


def test_peft_classifier_is_fixed():
    """LoRA on a Llama classifier: the PeftModel passes **kwargs down, the base model's loss ignores the count."""
    pytest.importorskip("peft")
    if not _transformers_at_least("4.54"):
        pytest.skip("LlamaForSequenceClassification takes no **kwargs here (before 4.54)")
    from peft import LoraConfig, get_peft_model

    from ftshims import tiny

    def run(shim_on):
        model, rows = probe_module.build("llama_seqcls")
        config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
        with tiny.quiet():
            peft_model = get_peft_model(model, config)
        import contextlib

        context = ftshims.applied(only=[SHIM]) if shim_on else contextlib.nullcontext()
        with context, tiny.quiet():
            trainer = _trainer(peft_model, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                               learning_rate=0.0, max_steps=1, remove_unused_columns=False, save_strategy="no",
                               **({"use_cpu": True} if _transformers_at_least("4.38") else {}))
            trainer.train_dataset = rows
            trainer.remove_callback(sys.modules["transformers.trainer_callback"].PrinterCallback)
            loss = trainer.train().training_loss
        return loss, trainer.model_accepts_loss_kwargs

    (plain_loss, plain_flag), (fixed_loss, fixed_flag) = run(False), run(True)
    assert plain_flag and not fixed_flag
    assert fixed_loss == pytest.approx(plain_loss / 2, rel=1e-5)


def test_decided_before_compute_loss_scales_by_the_processes(monkeypatch):
    """With average_tokens_across_devices (the default from 4.54) compute_loss multiplies the loss of a model that
    takes loss kwargs by the number of processes: N ranks gave an affected head N times its gradient even without
    accumulation. The decision is taken in a forward hook, before that scaling."""
    import torch

    model, rows = probe_module.build("llama_seqcls")
    trainer = _trainer(model)
    if not getattr(trainer, "model_accepts_loss_kwargs", False) or \
            not getattr(trainer.args, "average_tokens_across_devices", False):
        pytest.skip("no loss kwargs for this head, or no average_tokens_across_devices, on this version")
    monkeypatch.setattr(type(trainer.accelerator), "num_processes", property(lambda self: 2))  # as on 2 ranks
    batch = {key: torch.tensor([row[key] for row in rows]) for key in ("input_ids", "labels")}
    model.train()
    with torch.no_grad():
        reference = float(model(**batch).loss)
        plain = float(trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(len(rows))))
        with ftshims.applied(only=[SHIM]):
            fixed_trainer = _trainer(model)
            fixed = float(fixed_trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(len(rows))))
    assert plain == pytest.approx(2 * reference, rel=1e-6)
    assert fixed == pytest.approx(reference, rel=1e-6) and not fixed_trainer.model_accepts_loss_kwargs
