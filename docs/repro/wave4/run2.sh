export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
P=/work/venvs/ds/bin/python; U=/tmp/hE/u
r() { pk=$1; v=$2; f=$3; if [ "$v" = ds ]; then PP=; else PP=$U/$pk-$v; fi; echo "== $f $pk $v"; PYTHONPATH=$PP timeout 400 $P $f 2>&1 | grep -E "RESULT|groups|Error" | tail -4 | cut -c1-400; }
r peft 0.20.0 loraplus.py
r peft 0.21.0 loraplus.py
r peft 0.10.0 loraplus.py
r trl 1.14.1 dpo_prefix.py
r trl 1.14.2 dpo_prefix.py
r trl 0.27.1 dpo_eos.py
r trl 0.27.2 dpo_eos.py
r trl ds dpo_eos.py
r peft ds merge_drift.py
