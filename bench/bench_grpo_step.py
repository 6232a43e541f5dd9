"""A GRPO step against an RLOO step of the same shape on this CPU (issue: "a GRPO step is no slower than an RLOO
step"): bench_rloo_step.py's run (Qwen2 tiny / small, G=4, 8 completions per step, 32 new tokens, float32, KL to
the reference on: beta 0.05 for both, so both hold a reference pass) through `python -m rloo_jax.train rloo` and
`python -m rloo_jax.train grpo` (loss_type dapo, TRL's default; `--loss-type` for another), alternating in one
sitting; each run in a fresh process, the warm step = the mean `step_time` of steps 2..N. Prints each round and the
median per-round ratio grpo / rloo with its range.

    .venv/bin/python bench/bench_grpo_step.py [--sizes tiny small] [--rounds 5] [--steps 11] [--loss-type dapo]
"""

import argparse
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_rloo_step import build_assets, run_ours  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--loss-type", default="dapo")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes:
            model_dir, data = build_assets(os.path.join(root, size), size)
            ratios, times = [], {"rloo": [], "grpo": []}
            for r in range(args.rounds):
                order = ("rloo", "grpo") if r % 2 == 0 else ("grpo", "rloo")
                got = {}
                for algo in order:
                    extra = ["--loss_type", args.loss_type] if algo == "grpo" else []
                    got[algo] = run_ours(model_dir, data, args.steps, False, False, extra, algorithm=algo)["step_s"]
                    times[algo].append(got[algo])
                ratios.append(got["grpo"] / got["rloo"])
                print(f"{size} round {r + 1}: rloo {got['rloo'] * 1e3:.1f} ms, grpo {got['grpo'] * 1e3:.1f} ms, "
                      f"ratio {ratios[-1]:.3f}", flush=True)
            print(f"{size}: rloo median {statistics.median(times['rloo']) * 1e3:.1f} ms, grpo median "
                  f"{statistics.median(times['grpo']) * 1e3:.1f} ms; grpo / rloo median {statistics.median(ratios):.3f}"
                  f" (range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)", flush=True)


if __name__ == "__main__":
    main()
