"""torchrun, 2 ranks, gloo: one JSONL per rank, the summary of every rank on rank 0, and
ranks_identical_batches with a sampler that does not shard but not with DistributedSampler.

ftshims' own machinery (no transformers involved): the default stack only, like tests/e2e/test_distributed.py.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .runs import default_stack_only

pytestmark = [pytest.mark.slow, default_stack_only]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "dist" / "ranks.py"


def test_two_ranks_per_rank_jsonl_and_identical_batches(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTSHIMS_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        findings = json.loads((tmp_path / f"result.rank{rank}.json").read_text())
        assert findings["plain"] == [["ranks_identical_batches", 1]], findings
        assert findings["sharded"] == [], findings
        for name in ("plain", "sharded"):
            records = [json.loads(line) for line in (tmp_path / f"{name}.rank{rank}.jsonl").read_text().splitlines()]
            assert {r["rank"] for r in records} == {rank}
            assert records[0]["type"] == "header" and records[0]["world_size"] == 2
            assert [r["step"] for r in records if r["type"] == "step"] == [1, 2, 3, 4]
            summary = records[-1]
            assert summary["type"] == "summary"
            expected = [["ranks_identical_batches"]] * 2 if name == "plain" else [[], []]
            assert summary["ranks"] == expected, summary
    assert not (tmp_path / "plain.jsonl").exists(), "a distributed run writes one file per rank"
    # the summary line is logged once, by rank 0, with the other rank's findings
    summaries = [line for line in result.stderr.splitlines() if "1 finding in 4 steps" in line]
    assert summaries == ["ftshims.monitor: 1 finding in 4 steps: ranks_identical_batches (step 1); "
                         "other ranks: rank 1: ranks_identical_batches"], result.stderr[-3000:]
