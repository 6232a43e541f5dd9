"""The sampler on a mesh of its own (`--rollout_mesh`) through `python -m rloo_jax.train` on 8 forced CPU devices:
a run that switches the sampler's layout when it resumes continues bit for bit.

The run trains 2 steps on a (2, 2, 2) mesh with the sampler on the training mesh itself (`--rollout_mesh 2,2,2`:
FSDP gathers the weights at every decode step), checkpointing each step. Its last checkpoint and outputs are then
removed, as a crash after step 1 would leave them, and it resumes with the sampler tensor-parallel over all 8
devices (`--rollout_mesh 1,1,8`): it ends with the uninterrupted run's weights, metrics and completions, bit for
bit. The checkpoint holds no trace of the sampler's layout and the two layouts sample the same tokens. With beta
0: the sampler's log-probs enter the update only through the KL penalty, and those differ between tensor-parallel
degrees in their last bits (the heads' contributions summed in another order; within 1e-5, tests/test_mesh.py).
Subprocesses: XLA_FLAGS must be set before jax starts.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rloo_jax.metrics import read_jsonl
from tests.xla_flags import forced_devices

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300
COMMON = [
    "--num_generations", "4", "--max_steps", "2", "--max_completion_length", "6", "--logging_steps", "1",
    "--save_steps", "1", "--eval_steps", "None", "--log_completions", "true", "--compilation_cache", "false",
    "--data_parallel", "2", "--fsdp", "2", "--tensor_parallel", "2", "--per_device_train_batch_size", "4",
    "--beta", "0",
    "--reward_funcs", "rloo_jax.demo:letters_reward",  # dense: the default echo_reward is ~0 for a random policy
]  # fmt: skip


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=forced_devices(8),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        RLOO_JAX_CACHE=str(cache),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS", "SLURM_NPROCS"):
        env.pop(name, None)
    return env


def _start(out: Path, layout: str, cache: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rloo_jax.train", *COMMON, "--rollout_mesh", layout, "--output_dir", str(out)],
        cwd=ROOT, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _finish(procs: dict[str, subprocess.Popen]) -> dict[str, tuple[int, str, str]]:
    results = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            results[name] = (p.returncode, stdout, stderr)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, (rc, _, stderr) in results.items():
        assert rc == 0, f"{name}: {stderr[-5000:]}"
    return results


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _without_wall_time(rows: list[dict]) -> list[dict]:
    """Rows without wall times, and without the sampler/trainer gap: the sampler's log-probs move in their last
    bits with the tensor-parallel degree (see above), and the gap metric measures exactly those bits."""
    skip = ("step_time", "timing/", "sampling/sampling_logp_difference/")
    return [{k: v for k, v in r.items() if not k.startswith(skip)} for r in rows]


@pytest.mark.slow
def test_a_run_that_switches_the_sampler_layout_resumes_bit_exactly(tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    _finish({"straight": _start(out, "2,2,2", cache)})
    want = {"model": _sha256(out / "final" / "model.safetensors"), "metrics": read_jsonl(out / "metrics.jsonl"),
            "rollouts": read_jsonl(out / "rollouts.jsonl")}
    assert [r["step"] for r in want["metrics"]] == [1, 2] and want["metrics"][1]["grad_norm"] > 0
    shutil.rmtree(out / "checkpoints" / "2")  # as if the run had crashed after checkpoint 1
    shutil.rmtree(out / "final")
    resumed = _finish({"resumed": _start(out, "1,1,8", cache)})
    assert "Resuming from checkpoint" in resumed["resumed"][1]
    assert _sha256(out / "final" / "model.safetensors") == want["model"]
    assert _without_wall_time(read_jsonl(out / "metrics.jsonl")) == _without_wall_time(want["metrics"])
    got = read_jsonl(out / "rollouts.jsonl")
    # the records' sampler log-probs carry the same last-bit differences (measured max 3.8e-6 here)
    assert [{k: v for k, v in r.items() if k != "logprobs"} for r in got] == [
        {k: v for k, v in r.items() if k != "logprobs"} for r in want["rollouts"]]
    for g, w in zip(got, want["rollouts"], strict=True):
        np.testing.assert_allclose(g["logprobs"]["sampler"], w["logprobs"]["sampler"], rtol=0, atol=1e-5)
