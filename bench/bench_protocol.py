"""The benchmark protocol (CPU): rloo_jax vs TRL vs tunix vs the plain-JAX floor, alternating fresh processes.

    .venv/bin/python bench/bench_protocol.py [--sizes tiny small] [--rounds 3] [--steps 11] [--json out.json]
                                             [--gradient_checkpointing] [--skip trl tunix floor]

For each size and each of R rounds, every contender runs once in its own fresh process, in an order that rotates
from round to round (so none always runs first or last):
  - ours: `python -m rloo_jax.train` (bench_rloo_step.run_ours);
  - TRL 1.16 `RLOOTrainer` (bench_rloo_step.run_trl), torch on --threads threads;
  - tunix (google-tunix, GRPO learner with its RLOO advantage estimator; bench/tunix_rloo.py) in its own virtual
    environment, which this script creates on first use in bench/.venv-tunix (tunix brings its own
    transformers; jax and flax are pinned to ours);
  - the floor: the same step's work as plain jitted JAX, each part timed alone (bench_forward_floor.step_floor).
Same checkpoint, tokenizer, prompts, Python reward and settings for the three trainers: G = 4, 8 completions per
step, 32 new tokens, beta = 0.05 (reference model on), AdamW lr 1e-5, float32, `--steps` optimizer steps; s/step
is the mean wall time of steps 2..N (step 1 compiles). Gradient checkpointing is off for all three unless
--gradient_checkpointing (on for ours and TRL; tunix 0.1.7's remat fails under our flax, so tunix is skipped):
TRL's `RLOOConfig` defaults to on, which costs it one more forward per block in the backward; ours is off on CPU by
default.

Reported per size: each round's s/step, then for each peer the median of the per-round ratios peer / ours with
their min-max, and ours / floor the same way. A ratio is only ever taken inside one round.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import metadata

import bench_rloo_step as e2e

TUNIX_VENV = os.path.join(e2e.HERE, ".venv-tunix")
TUNIX_PIN = "google-tunix==0.1.7"
CONTENDERS = ("ours", "trl", "tunix", "floor")


def tunix_requirements() -> list[str]:
    """tunix, with jax, jaxlib and flax pinned to the versions rloo_jax runs on (the same XLA for both)."""
    return [TUNIX_PIN] + [f"{name}=={metadata.version(name)}" for name in ("jax", "jaxlib", "flax")]


def ensure_tunix_venv(path: str = TUNIX_VENV) -> str:
    """The tunix venv's python, creating the venv and installing tunix_requirements() when they changed."""
    python, marker = os.path.join(path, "bin", "python"), os.path.join(path, ".installed")
    wanted = " ".join(tunix_requirements())
    if os.path.exists(marker) and open(marker).read() == wanted:
        return python
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", path], check=True)
    print(f"installing into {path}: {wanted}", flush=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *wanted.split()], check=True)
    with open(marker, "w") as f:
        f.write(wanted)
    return python


def result_line(proc: subprocess.CompletedProcess, who: str):
    """The JSON after `RESULT` in a finished subprocess's stdout (raise with its output tail if it failed)."""
    if proc.returncode or "RESULT" not in proc.stdout:
        raise RuntimeError(f"{who} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def run_tunix(python: str, model_dir: str, data: str, steps: int, gc: bool) -> dict:
    """bench/tunix_rloo.py in the tunix venv, fresh process; step times of its global steps."""
    cmd = [python, os.path.join(e2e.HERE, "tunix_rloo.py"), model_dir, data, "--steps", str(steps)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + (["--remat"] if gc else []), capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    out = result_line(proc, "tunix")
    return dict(e2e.step_stats(out["times"], time.perf_counter() - t0), versions=out["versions"])


def run_floor(size: str) -> dict:
    """bench_forward_floor.py --step in a fresh process: plain-JAX decode + forward + update for `size`."""
    cmd = [sys.executable, os.path.join(e2e.HERE, "bench_forward_floor.py"), "--step", "--json", "--size", size]
    return result_line(subprocess.run(cmd, capture_output=True, text=True), "floor")


def rotated(names: list[str], r: int) -> list[str]:
    """names rotated left by r: round r starts with the r-th contender."""
    k = r % len(names)
    return names[k:] + names[:k]


def run_round(names: list[str], r: int, size: str, model_dir: str, data: str, args, tunix_python: str | None
              ) -> dict:
    """One round: every contender once, fresh processes, in rotated order -> {name: result dict}."""
    gc = args.gradient_checkpointing
    calls = {
        "ours": lambda: e2e.run_ours(model_dir, data, args.steps, False, False,
                                     ["--gradient_checkpointing", str(gc).lower()]),
        "trl": lambda: e2e.run_trl(model_dir, data, args.steps, False, args.threads, gc),
        "tunix": lambda: run_tunix(tunix_python, model_dir, data, args.steps, gc),
        "floor": lambda: run_floor(size),
    }
    out = {}
    for name in rotated(names, r):
        out[name] = dict(calls[name](), load_1min=os.getloadavg()[0])
        print(f"  {size} round {r + 1} {name:5s} {out[name]['step_s']:.4f} s/step (load average "
              f"{out[name]['load_1min']:.2f} after)", flush=True)
    return out


def spread(values: list[float]) -> dict:
    """Median, min and max of per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict]) -> dict:
    """Per-round ratios peer / ours for each peer, ours / floor, and each contender's s/step: median, min-max."""
    names = rounds[0].keys()
    out = {f"{peer}/ours": spread([r[peer]["step_s"] / r["ours"]["step_s"] for r in rounds])
           for peer in names if peer in ("trl", "tunix")}
    if "floor" in names:
        out["ours/floor"] = spread([r["ours"]["step_s"] / r["floor"]["step_s"] for r in rounds])
    out.update({f"{name} s/step": spread([r[name]["step_s"] for r in rounds]) for name in names})
    return out


def table(size: str, rounds: list[dict], summary: dict) -> str:
    """Markdown: one row per round (s/step of each contender), then the ratios."""
    names = list(rounds[0])
    lines = [f"| {size}: round | " + " | ".join(f"{n} s/step" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    lines += [f"| {i + 1} | " + " | ".join(f"{r[n]['step_s']:.4f}" for n in names) + " |"
              for i, r in enumerate(rounds)]
    lines += [f"{size} {k}: median {v['median']:.4g}{'' if 's/step' in k else 'x'} (min {v['min']:.4g}, "
              f"max {v['max']:.4g})" for k, v in summary.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(e2e.SIZES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for TRL")
    ap.add_argument("--gradient_checkpointing", action="store_true", help="on for ours and TRL (tunix skipped)")
    ap.add_argument("--skip", nargs="*", default=[], choices=CONTENDERS[1:])
    ap.add_argument("--json", help="also write the rounds and the summary here")
    args = ap.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    names = [n for n in CONTENDERS if n not in args.skip]
    if args.gradient_checkpointing and "tunix" in names:
        print("tunix skipped: its remat (RematConfig.BLOCK or DECODER, nnx.remat of a bound block) fails under flax "
              f"{metadata.version('flax')} with TraceContextError (checked with {TUNIX_PIN})", flush=True)
        names.remove("tunix")
    tunix_python = ensure_tunix_venv() if "tunix" in names else None
    print(f"gradient checkpointing: {'on' if args.gradient_checkpointing else 'off'} for "
          f"{', '.join(n for n in names if n != 'floor')}; "
          f"rounds {args.rounds}, steps {args.steps} (s/step = mean of steps 2..{args.steps})", flush=True)
    report = {"gradient_checkpointing": args.gradient_checkpointing, "steps": args.steps, "sizes": {}}
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes:
            model_dir, data = e2e.build_assets(os.path.join(root, size), size)
            rounds = [run_round(names, r, size, model_dir, data, args, tunix_python) for r in range(args.rounds)]
            summary = summarize(rounds)
            report["sizes"][size] = {"rounds": rounds, "summary": summary}
            print(table(size, rounds, summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
