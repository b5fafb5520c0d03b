import torch, peft
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
from peft.optimizers import create_loraplus_optimizer
m = AutoModelForCausalLM.from_pretrained("repro-work/tiny")
pm = get_peft_model(m, LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
opt = create_loraplus_optimizer(pm, optimizer_cls=torch.optim.AdamW, lr=2e-4, loraplus_lr_ratio=16, loraplus_lr_embedding=1e-6)
names = {id(p): n for n, p in pm.named_parameters()}
for g in opt.param_groups:
    emb = [names[id(p)] for p in g["params"] if "lora_embedding" in names[id(p)]]
    if emb: print(f"peft {peft.__version__} RESULT lora_embedding params ({len(emb)}) in group lr={g['lr']:g} (loraplus_lr_embedding=1e-6, lr=2e-4)")
print(f"peft {peft.__version__} groups:", [(g['lr'], len(g['params'])) for g in opt.param_groups])
