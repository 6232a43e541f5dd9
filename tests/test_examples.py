"""examples/ run as a user runs them (a fresh process, offline, from the repository root), for a few steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rloo_jax.metrics import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, summary", [
    ("grpo_letters.py", r"GRPO: 2 steps, last logged reward (\d\.\d+) \(step 2\)"),
    ("ppo_letters.py", r"PPO: 2 steps, last logged score (-?\d\.\d+) \(step 2\)"),
])
def test_example_runs(script, summary, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(ROOT / "examples" / script), "--max_steps", "2", "--output_dir", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(summary, r.stdout)
    assert m, r.stdout[-2000:]
    steps = [rec for rec in read_jsonl(out / "metrics.jsonl") if "step" in rec]
    assert steps and steps[-1]["step"] == 2
    assert (out / "final" / "model.safetensors").is_file()
