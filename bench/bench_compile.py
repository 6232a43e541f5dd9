"""Compile time of the first step (persistent compilation cache off / cold / warm) and recompilations after step 1.

1. First-step time of `python -m rloo_jax.train` (the settings of bench_rloo_step.py, small model by default),
   three fresh processes: `--compilation_cache false`; `true` with an empty cache folder (cold: compiles and
   writes the cache); `true` again with the same folder (warm: reads it). Reported from each run's own
   `step_time` of step 1, next to the mean warm step.
2. Recompilations: `rloo_jax.loop.train(cfg)` in this process for --steps (50) steps over the 256 prompts of 8..24
   words (prompt lengths vary every step, inside the one 32-token bucket), counting jax's monitoring events
   (`/jax/core/compile/backend_compile_duration` = an XLA compile, `/jax/core/compile/jaxpr_trace_duration` = a
   trace) that happen from the second rollout call (step 2) until the last `update` returned.

    .venv/bin/python bench/bench_compile.py [--size small] [--recompile-size tiny] [--steps 50]

There is no peer figure for compiles measured here: TRL (PyTorch eager) does not compile; its first step is
printed by bench_rloo_step.py. tunix's first step on these models was 5-9 s (DESIGN.md section 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from bench_rloo_step import SETTINGS, build_assets  # noqa: E402

COMPILE = "/jax/core/compile/backend_compile_duration"
TRACE = "/jax/core/compile/jaxpr_trace_duration"


def train_argv(model_dir: str, data: str, out: str, steps: int, cache: bool, cache_dir: str | None) -> list[str]:
    argv = ["--model_name_or_path", model_dir, "--dataset_name", data, "--reward_funcs", "bench_rloo_step:reward",
            "--output_dir", out, "--max_steps", str(steps), "--save_steps", str(10 * steps), "--seed", "0",
            "--lr_scheduler_type", "constant", "--compilation_cache", str(cache).lower(), "--max_prompt_length",
            "32", "--prompt_bucket", "32"]
    if cache_dir:
        argv += ["--compilation_cache_dir", cache_dir]
    for k, v in SETTINGS.items():
        argv += [f"--{k}", str(v)]
    return argv


def first_step(model_dir: str, data: str, cache: bool, cache_dir: str | None, steps: int = 4) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "rloo_jax.train", *train_argv(model_dir, data, out, steps, cache, cache_dir)]
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"rloo_jax failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        times = [r["step_time"] for r in rows if "step_time" in r and "reward" in r]
    return {"first_step_s": times[0], "warm_step_s": sum(times[1:]) / len(times[1:])}


def count_recompiles(model_dir: str, data: str, steps: int) -> dict:
    """Compiles/traces in steps 2..steps of one in-process training run."""
    import jax

    from rloo_jax import loop as train_mod
    from rloo_jax import programs as programs_mod
    from rloo_jax.cli import load_config

    events: list[tuple[float, str]] = []
    update_done: list[float] = []
    rollout_started: list[float] = []

    def listener(event: str, duration: float, **kwargs: object) -> None:
        if event in (COMPILE, TRACE):
            events.append((time.perf_counter(), event))

    original_init = programs_mod.Programs.__init__

    def init(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        original_init(self, *args, **kwargs)
        update = self.update

        def timed_update(*a, **k):  # noqa: ANN002, ANN003, ANN202
            out = update(*a, **k)
            jax.block_until_ready(out[1])
            update_done.append(time.perf_counter())
            return out

        self.update = timed_update
        sample = self.sample

        def timed_sample(*a, **k):  # noqa: ANN002, ANN003, ANN202
            rollout_started.append(time.perf_counter())
            return sample(*a, **k)

        self.sample = timed_sample

    jax.monitoring.register_event_duration_secs_listener(listener)
    programs_mod.Programs.__init__ = init
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = load_config(train_argv(model_dir, data, out, steps, cache=False, cache_dir=None))
            train_mod.train(cfg)
    finally:
        programs_mod.Programs.__init__ = original_init
        jax.monitoring.unregister_event_duration_listener(listener)
    # step 1 = everything up to the second rollout call (its update, logging and first metric reads included)
    lo, hi = rollout_started[1], update_done[-1]
    after = [e for t, e in events if lo <= t <= hi]
    first = [e for t, e in events if t < lo]
    return {"steps": len(update_done), "step1_compiles": first.count(COMPILE), "step1_traces": first.count(TRACE),
            "later_compiles": after.count(COMPILE), "later_traces": after.count(TRACE)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--recompile-size", default="tiny")
    ap.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    res = {}
    with tempfile.TemporaryDirectory() as root:
        model_dir, data = build_assets(os.path.join(root, args.size), args.size)
        cache_dir = os.path.join(root, "jax_cache")
        res["cache_off"] = first_step(model_dir, data, False, None)
        res["cache_cold"] = first_step(model_dir, data, True, cache_dir)
        res["cache_warm"] = first_step(model_dir, data, True, cache_dir)
        for name in ("cache_off", "cache_cold", "cache_warm"):
            r = res[name]
            print(f"{args.size} {name:10s} first step {r['first_step_s']:.2f} s (warm steps {r['warm_step_s']:.3f} s)",
                  flush=True)
        rdir, rdata = build_assets(os.path.join(root, "r" + args.recompile_size), args.recompile_size)
        res["recompiles"] = count_recompiles(rdir, rdata, args.steps)
        r = res["recompiles"]
        print(f"{args.recompile_size}: {r['steps']} steps; step 1: {r['step1_compiles']} compiles "
              f"({r['step1_traces']} traces); steps 2-{r['steps']}: {r['later_compiles']} compiles "
              f"({r['later_traces']} traces)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
