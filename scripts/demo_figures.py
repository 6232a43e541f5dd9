"""The README's figures of the built-in demo (`make run`), read back from a run's outputs, and CI's check of them.

    python scripts/demo_figures.py [OUTPUT_DIR]      # default outputs/demo, where `make run` writes

prints one line, e.g. `demo: reward 0.010 -> 0.950 over 300 steps, evaluation 0.970, 253 of the last step's 256
completions are their prompt's answer`, and exits 1 when the run did not learn its task (final evaluation reward
below 0.7, the floor CI holds every host to: 0.77-0.97 measured, since 300 sampled steps amplify XLA:CPU's last-bit
differences between host CPUs; tests/test_train.py holds the same run to its own floors). `.ci/run` calls it after
`make run`, so each CI log states the figures of the host it ran on.
"""

import json
import pathlib
import sys

FLOOR = 0.7  # the final evaluation reward every host reached (lowest measured: 0.768)


def read_jsonl(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def figures(out: pathlib.Path) -> dict[str, float | int]:
    """first / last training reward, steps, final evaluation reward, exact answers among the last step's rollouts."""
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if "reward" in r]
    evals = [r for r in records if "eval_reward" in r]
    if not train or not evals:
        raise SystemExit(f"{out}: no training or evaluation records in metrics.jsonl")
    rollouts = read_jsonl(out / "rollouts.jsonl")
    last = [r for r in rollouts if r["step"] == max(r["step"] for r in rollouts)]
    exact = sum(r["completion"] == r["prompt"].removesuffix(":") for r in last)
    return {"first": train[0]["reward"], "last": train[-1]["reward"], "steps": train[-1]["step"],
            "eval": evals[-1]["eval_reward"], "exact": exact, "completions": len(last)}


def main(argv: list[str]) -> int:
    f = figures(pathlib.Path(argv[0] if argv else "outputs/demo"))
    print(f"demo: reward {f['first']:.3f} -> {f['last']:.3f} over {f['steps']} steps, evaluation {f['eval']:.3f}, "
          f"{f['exact']} of the last step's {f['completions']} completions are their prompt's answer")
    if f["eval"] < FLOOR:
        print(f"demo: the final evaluation reward {f['eval']:.3f} is below {FLOOR}: the demo did not learn its task")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
