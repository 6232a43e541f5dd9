"""One assembly for the loop and compile-only: for RLOO, GRPO and PPO, the programs a short training run on a 4-device
mesh builds are among compile-only's compile set, with the same abstract inputs and shardings, and the two build the
same optimizer (learning rate schedule included: compile-only once built PPO's without its updates per step).

The runs need 4 devices, so they run in a subprocess (`XLA_FLAGS` must be set before jax is imported)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xla_flags import forced_devices

ROOT = Path(__file__).resolve().parents[1]

WORKER = r'''
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from rloo_jax import build, loop
from rloo_jax.algorithms import CONFIGS
from rloo_jax.cli import load_config

tmp = sys.argv[1]
# RLOO: the reference synced every step (TR-DPO); GRPO: optimizer steps spanning generation batches (plans) and three
# completion widths; PPO: its value and reward models, shuffled micro-batches, several updates a step
EXTRA = {"rloo": ["--sync_ref_model", "true", "--ref_model_sync_steps", "1", "--max_steps", "1", "--eval_steps", "1"],
         "grpo": ["--steps_per_generation", "3", "--gradient_accumulation_steps", "2", "--completion_bucket", "2",
                  "--per_device_train_batch_size", "2", "--num_generations", "4", "--max_steps", "2"],
         "ppo": ["--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "2", "--max_steps", "1"]}
out = {}
for name, extra in EXTRA.items():
    cls = CONFIGS[name]
    argv = [name, "--output_dir", f"{tmp}/{name}", "--logging_steps", "1", "--eval_steps", "none",
            "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4", "--save_steps", "100",
            "--compilation_cache", "false", *extra]
    cfg = load_config(argv, cls.DEMO, jax.device_count())
    s = loop.setup(cfg)
    loop.resume(s)
    loop.loop(s, loop.StopRequest())
    s.ckpt.close(); s.sinks.close(); s.rollouts.close()
    ran = dict(s.programs._programs)  # what the loop built, by (program, shapes...)
    aot = build.assemble(cfg, jax.devices(), abstract=True, platform="cpu")
    aot.abstract_state()
    widths = sorted({key[2] for key in ran if key[0] == "sample"})
    for p in widths:
        aot.compile_set(dataclasses.replace(aot.shapes, prompt_length=p))
    compiled = aot.programs._programs
    leaves = lambda program: [(str(a.shape), str(a.dtype), str(getattr(a, "sharding", None)))
                              for a in jax.tree.leaves(program.args)]
    same = {str(key): leaves(program) == leaves(compiled[key]) for key, program in ran.items() if key in compiled}
    # the optimizers: the same updates of the same gradients, step after step
    params = {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros((4,))}
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.5), params)
    def updates(opt):
        state, seen = opt.init(params), []
        for _ in range(4):
            u, state = opt.update(grads, state, params)
            seen.append(np.asarray(u["kernel"]).ravel()[:2].tolist())
        return seen
    out[name] = {"ran": sorted(str(k) for k in ran), "missing": sorted(str(k) for k in ran if k not in compiled),
                 "same": same, "optimizer": [updates(s.programs.optimizer), updates(aot.optimizer)],
                 "updates_per_step": cfg.updates_per_step}
print(json.dumps(out))
'''


@pytest.mark.slow
def test_the_loop_runs_what_compile_only_compiles(tmp_path):
    env = dict(os.environ, XLA_FLAGS=forced_devices(4), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    result = subprocess.run([sys.executable, "-c", WORKER, str(tmp_path)], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for name, run in out.items():
        assert run["missing"] == [], (name, run["missing"])
        assert run["same"] and all(run["same"].values()), (name, run["same"])
        loop_opt, aot_opt = run["optimizer"]
        assert loop_opt == aot_opt, name
    # what each run exercised: evaluation and the reference sync (RLOO), carried plans and narrower widths (GRPO),
    # the value model, shuffled micro-batches and several updates a step (PPO)
    kinds = {name: {key.split("'")[1] for key in run["ran"]} for name, run in out.items()}
    assert {"sample", "finish", "update", "score", "sync_reference"} <= kinds["rloo"]
    assert len([k for k in out["rloo"]["ran"] if k.startswith("('sample'")]) == 2  # training's and evaluation's
    assert "longest" in kinds["grpo"] and any("UpdatePlan(carried=1" in k for k in out["grpo"]["ran"])
    assert {"sample", "finish", "update", "score"} <= kinds["ppo"] and out["ppo"]["updates_per_step"] > 1
