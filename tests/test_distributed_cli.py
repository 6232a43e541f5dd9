"""Meshes and multi-host through `python -m rloo_jax.train`: 2x2x2 mesh == one device, two processes == one.

In this process: the mesh-aware config (global batch = per-device x data shards x steps, whole prompt groups,
prompts split over processes) and the distributed options. In subprocesses (``XLA_FLAGS`` must be set before jax
starts), all at once to share the two CPU cores: the tiny demo for 2 steps with evaluation at the last step on
1 device, on 8 forced CPU devices as a (data 2, fsdp 2, tensor 2) mesh, and as two processes of 4 devices each on
localhost (``--coordinator_address/--num_processes/--process_id``), plus a batch the data shards cannot split into
whole prompt groups. Every child is killed on failure or timeout.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rloo_jax.cli import config_from_dict, distributed_options, load_config
from rloo_jax.errors import ConfigError
from rloo_jax.metrics import read_jsonl
from tests.xla_flags import forced_devices

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240
# 2 optimizer steps of 16 completions (4 prompts x G=4); at the last step, evaluation: 64 test prompts x 4, 1 batch
COMMON = [
    "--num_generations", "4", "--max_steps", "2", "--max_completion_length", "6", "--logging_steps", "1",
    "--save_steps", "100", "--eval_steps", "2", "--num_generations_eval", "4", "--log_completions", "true",
    "--compilation_cache", "false",
    "--reward_funcs", "rloo_jax.demo:letters_reward",  # dense: the default echo_reward is ~0 for a random policy
]  # fmt: skip
MESH = ["--data_parallel", "2", "--fsdp", "2", "--tensor_parallel", "2"]
# the same global batches: 16 completions per device on 1 device = 4 per device x 4 data shards (2 data x 2 fsdp)
ONE_DEVICE = ["--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "256"]
PER_SHARD = ["--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "64"]
EXACT = ("step", "num_tokens", "learning_rate", "epoch", "num_truncated_prompts", "skipped_steps")


def base(**kw):
    values = {"model_name_or_path": "m", "dataset_name": "d", "reward_funcs": ["pkg.mod:f"]}
    values.update(kw)
    return values


# ------------------------------------------------------------------------------------------- config, in process
def test_global_batch_is_per_device_times_data_shards():
    cfg = config_from_dict(base(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2))
    assert (cfg.mesh_shape, cfg.data_shards, cfg.generation_batch_size, cfg.prompts_per_generation) == (
        (1, 1, 1), 1, 8, 2,
    )  # fmt: skip
    mesh = base(per_device_train_batch_size=4, num_generations=4, steps_per_generation=2, tensor_parallel=2)
    cfg = config_from_dict(mesh, device_count=8, process_count=2)
    assert (cfg.mesh_shape, cfg.data_shards, cfg.generation_batch_size, cfg.prompts_per_generation) == (
        (1, 4, 2), 4, 32, 8,
    )  # fmt: skip
    assert cfg.eval_batch_size == 8 * 4 and "device_count" not in cfg.to_dict()
    # the machine facts survive dataclasses.replace (which re-validates)
    again = dataclasses.replace(cfg, seed=1)
    assert (again.device_count, again.process_count, again.generation_batch_size) == (8, 2, 32)
    # per-device batch 2 < G = 4 is fine once 4 data shards make whole groups (TRL's rule)
    cfg = config_from_dict(base(per_device_train_batch_size=2, num_generations=4), device_count=8)
    assert (cfg.generation_batch_size, cfg.prompts_per_generation) == (16, 4)


@pytest.mark.parametrize(
    "values, devices, processes, message",
    [
        (
            {"per_device_train_batch_size": 1, "num_generations": 4, "fsdp": 2, "tensor_parallel": 4},
            8, 1,
            r"per_device_train_batch_size \* data-parallel shards \(data_parallel \* fsdp = 1 \* 2\) \* "
            r"steps_per_generation = 1 \* 2 \* 1 = 2 completions must be divisible by num_generations = 4",
        ),
        (
            {"per_device_train_batch_size": 2, "num_generations": 4, "tensor_parallel": 4},
            8, 2,
            "the 1 prompts of a generation batch cannot be split evenly over 2 processes",
        ),
        ({"data_parallel": 3}, 8, 1, "does not divide the 8 devices.*fix data_parallel"),
        ({"data_parallel": 2, "fsdp": 2, "tensor_parallel": 1}, 8, 1, "needs 4 devices but 8 are available"),
        ({"data_parallel": -1}, 8, 1, "at most one mesh size may be -1"),
        ({"data_parallel": 2}, 1, 1, "does not divide the 1 devices"),
        (
            {"per_device_eval_batch_size": 1, "eval_steps": 5, "num_generations_eval": 4, "fsdp": 2,
             "tensor_parallel": 4},
            8, 1,
            r"per_device_eval_batch_size \(1\) x 2 data-parallel shards must be divisible",
        ),
        ({"num_processes": 2, "process_id": 2}, 1, 1, r"process_id \(2\) must be below num_processes \(2\)"),
    ],
)  # fmt: skip
def test_mesh_and_batch_errors(values, devices, processes, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(base(**values), device_count=devices, process_count=processes)


def test_distributed_options_are_read_before_the_config(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("coordinator_address: 10.0.0.1:1234\nnum_processes: 4\n")
    assert distributed_options(["--config", str(f), "--process_id", "3"]) == ("10.0.0.1:1234", 4, 3)
    assert distributed_options(["--seed", "1"]) == (None, None, None)
    with pytest.raises(ConfigError, match="process_id .5. must be below num_processes .4."):
        distributed_options(["--config", str(f), "--process_id", "5"])
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--reward_funcs", "pkg.mod:f"]
    cfg = load_config([*argv, "--tensor_parallel", "2"], None, device_count=8)
    assert (cfg.mesh_shape, cfg.generation_batch_size) == ((1, 4, 2), 8 * 4)


# ------------------------------------------------------------------------------------------- subprocesses
def _env(devices: int, cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=forced_devices(devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        RLOO_JAX_CACHE=str(cache),  # the demo model and data, shared by all runs (written atomically)
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
    )
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS", "SLURM_NPROCS"):
        env.pop(name, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Start every CLI run together, wait for all; {name: {rc, stdout, stderr, out}}."""
    tmp = tmp_path_factory.mktemp("distributed_cli")
    cache, port = tmp / "cache", str(_free_port())
    two = [*COMMON, *MESH, *PER_SHARD, "--output_dir", str(tmp / "two"), "--coordinator_address",
           f"127.0.0.1:{port}", "--num_processes", "2", "--process_id"]  # fmt: skip
    commands = {
        "single": ([*COMMON, *ONE_DEVICE, "--output_dir", str(tmp / "single")], 1),
        "mesh": ([*COMMON, *MESH, *PER_SHARD, "--output_dir", str(tmp / "mesh")], 8),
        "process0": ([*two, "0"], 4),
        "process1": ([*two, "1"], 4),
        # 1 completion per device x 2 data shards (fsdp 2; tensor 4) = 2 completions: not one group of G = 4
        "bad_batch": (
            [
                *COMMON,
                "--per_device_train_batch_size",
                "1",
                "--fsdp",
                "2",
                "--tensor_parallel",
                "4",
                "--output_dir",
                str(tmp / "bad"),
            ],
            8,
        ),  # fmt: skip
    }
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "rloo_jax.train", *args],
            cwd=ROOT,
            env=_env(devices, cache),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name, (args, devices) in commands.items()
    }
    results = {}
    try:
        for name, p in procs.items():
            stdout, stderr = p.communicate(timeout=TIMEOUT)
            results[name] = {"rc": p.returncode, "stdout": stdout, "stderr": stderr}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    results["dirs"] = {name: tmp / name for name in ("single", "mesh", "two", "bad")}
    return results


def _ok(runs: dict, name: str) -> dict:
    r = runs[name]
    assert r["rc"] == 0, f"{name}: {r['stderr'][-5000:]}"
    return r


def _train_rows(path: Path) -> list[dict]:
    return [r for r in read_jsonl(path / "metrics.jsonl") if "reward" in r]


def _eval_rows(path: Path) -> list[dict]:
    return [r for r in read_jsonl(path / "metrics.jsonl") if "eval_reward" in r]


def _assert_same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] and got
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        for name, value in w.items():
            if name == "step_time" or name.startswith("timing/"):  # wall times
                continue
            if name in EXACT:
                assert g[name] == value, name
            else:
                assert g[name] == pytest.approx(value, abs=1e-5), (g["step"], name)


def _completions(path: Path) -> list[tuple]:
    return [(r["step"], r["prompt"], r["completion"]) for r in read_jsonl(path / "rollouts.jsonl")]


def test_mesh_2x2x2_equals_one_device(runs):
    _ok(runs, "single"), _ok(runs, "mesh")
    single, mesh = runs["dirs"]["single"], runs["dirs"]["mesh"]
    want = _train_rows(single)
    assert [r["step"] for r in want] == [1, 2] and want[1]["kl"] > 0 and want[0]["grad_norm"] > 0
    _assert_same_metrics(_train_rows(mesh), want)
    _assert_same_metrics(_eval_rows(mesh), _eval_rows(single))  # evaluation through the sharded rollout
    assert len(_completions(single)) == 2 * 16 and _completions(mesh) == _completions(single)


def test_two_processes_equal_one_process_with_8_devices(runs):
    p0, p1 = _ok(runs, "process0"), _ok(runs, "process1")
    _ok(runs, "mesh")
    two, mesh = runs["dirs"]["two"], runs["dirs"]["mesh"]
    _assert_same_metrics(_train_rows(two), _train_rows(mesh))
    _assert_same_metrics(_eval_rows(two), _eval_rows(mesh))
    # every completion once (process 0 gathers the other process's rows for the records; nobody writes twice)
    assert _completions(two) == _completions(mesh)
    assert len(read_jsonl(two / "metrics.jsonl")) == 3  # 2 training rows + 1 evaluation row, written once
    assert (two / "final" / "model.safetensors").is_file() and (two / "config.yaml").is_file()
    assert (two / "checkpoints" / "2" / "commit_success.txt").is_file()  # written by both processes, via orbax
    assert "Done: 2 optimizer steps" in p0["stdout"] and "step 2/2" in p0["stdout"]
    assert "Done" not in p1["stdout"] and "step 2/2" not in p1["stdout"] and "eval step" not in p1["stdout"]


def test_final_export_of_sharded_params_matches_one_device(runs):
    from safetensors.numpy import load_file

    _ok(runs, "single"), _ok(runs, "process0")
    want = load_file(runs["dirs"]["single"] / "final" / "model.safetensors")
    for name in ("mesh", "two"):
        got = load_file(runs["dirs"][name] / "final" / "model.safetensors")
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key].shape == value.shape
            diff = abs(got[key] - value)
            # The runs differ only in f32 summation order. AdamW divides by sqrt(v) + eps (1e-8): a weight whose
            # gradient is near eps turns a rounding difference of ~1e-9 into an update difference up to ~lr/4,
            # so a few weights move by up to 1.2e-4 (measured on CI's CPU; 2 steps at lr 1e-3 and 5e-4 move a
            # weight by at most 1.5e-3). A misplaced or mis-gathered shard moves most weights of a matrix by ~0.1.
            assert diff.max() < 4e-4, (name, key)
            assert np.mean(diff < 1e-6) > 0.99, (name, key)


def test_batch_without_whole_groups_across_data_shards_is_a_config_error(runs):
    r = runs["bad_batch"]
    assert r["rc"] == 2, r["stderr"][-3000:]
    lines = [ln for ln in r["stderr"].splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith("error: the generation batch"), r["stderr"]
    assert "Traceback" not in r["stderr"]
    assert "data-parallel shards (data_parallel * fsdp = 1 * 2)" in lines[0]
    assert "must be divisible by num_generations = 4" in lines[0]
    assert not runs["dirs"]["bad"].exists()  # nothing written
