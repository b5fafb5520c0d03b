export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
P=/work/venvs/ds/bin/python
U=/tmp/hE/u
r() { v=$1; f=$2; if [ "$v" = ds ]; then PP=; else PP=$U/trl-$v; fi; echo "== $f trl $v"; PYTHONPATH=$PP timeout 400 $P $f 2>&1 | grep -E "RESULT|trl [0-9]|Error|error" | tail -4 | cut -c1-400; }
r 1.5.1 grpo_none_reward.py
r 1.6.0 grpo_none_reward.py
r 1.8.0 gkd_eos_mask.py
r 1.9.0 gkd_eos_mask.py
r ds gkd_eos_mask.py
r 1.9.0 grpo_dapo_window.py
r 1.9.1 grpo_dapo_window.py
r 1.8.0 grpo_trunc_norm.py
r 1.9.0 grpo_trunc_norm.py
r 1.14.2 qdora_bf16.py
r ds qdora_bf16.py
