import torch, transformers
from transformers import BloomConfig, BloomForCausalLM
torch.manual_seed(0)
m = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=2)).eval()
x = torch.randint(0, 64, (2, 8)); s = torch.randint(0, 64, (2, 8)); s[:, -1] = -100   # pre-shifted labels, as CP/SP hand them
with torch.no_grad():
    l = torch.randint(0, 64, (2, 8)); out = m(input_ids=x, labels=l, shift_labels=s)
    buggy = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 64), l[:, 1:].reshape(-1))
    ref = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 64), s.reshape(-1), ignore_index=-100)
print(transformers.__version__, "RESULT loss with labels and shift_labels:", None if out.loss is None else round(out.loss.item(), 5), "CE(logits, shift_labels) =", round(ref.item(), 5), "CE(logits[:-1], labels[1:]) =", round(buggy.item(), 5))
