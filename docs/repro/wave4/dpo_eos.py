# DPO on conversational data: does tokenization append an EOS after the template's end of turn?
import torch, trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
tok = AutoTokenizer.from_pretrained("repro-work/tiny")
# end of turn "w249" differs from eos "</s>"
tok.chat_template = ("{% for m in messages %}{% if m['role']=='user' %}<|user|> {{ m['content'] }} w249 {% else %}<|assistant|> "
                     "{{ m['content'] }} w249 {% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
model = AutoModelForCausalLM.from_pretrained("repro-work/tiny")
ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "w10 w11"}],
                         "chosen": [{"role": "assistant", "content": "w20 w21 w22"}],
                         "rejected": [{"role": "assistant", "content": "w30 w31 w32"}]}] * 4)
args = DPOConfig(output_dir="repro-work/out_dpo_eos", use_cpu=True, bf16=False, report_to="none", max_steps=1, per_device_train_batch_size=2)
tr = DPOTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
ex = tr.train_dataset[0]
key = "chosen_input_ids" if "chosen_input_ids" in ex else "chosen_ids"
print(f"trl {trl.__version__} RESULT chosen tail={tok.convert_ids_to_tokens(ex[key][-3:])} eos={tok.eos_token}")
