"""examples/ run as a user runs them (a fresh process, offline, from the repository root), for a few steps."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rloo_jax.metrics import read_jsonl
from tests.fixtures_models import tools_policy  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script, summary", [
    ("grpo_letters.py", r"GRPO: 2 steps, last logged reward (\d\.\d+) \(step 2\)"),
    ("ppo_letters.py", r"PPO: 2 steps, last logged score (-?\d\.\d+) \(step 2\)"),
    ("grpo_tools.py", r"GRPO with tools: 2 steps, reward (\d\.\d+) \(to step 2\) .* tool calls per completion"),
    ("grpo_moe.py", r"GRPO on a mixture of experts: 2 steps, reward (\d\.\d+) \(to step 2\) .* routing mismatch "
                    r"(\d\.\d+) -> (\d\.\d+), aux_loss"),
])
def test_example_runs(script, summary, tmp_path, request):
    if script == "grpo_tools.py":
        request.getfixturevalue("tools_policy")  # the tool-calling policy, built once per run (the example reads it)
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
