"""Whole-trainer parity with TRL 1.16 for every GRPO loss type, on and off policy, RLOO, and both given a PeftModel
with non-zero adapters (tests/trainer_parity.py): prints the largest per-step difference of each compared metric
and of the final weights.

    .venv/bin/python bench/bench_trl_parity.py [--steps 8] [--lr 2e-3] [--only dapo|vespo|peft]
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from tests import trainer_parity as tp  # noqa: E402

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")


def cases() -> dict[str, tuple[str, dict]]:
    out = {}
    for loss in LOSS_TYPES:
        extra = {"importance_sampling_level": "sequence"} if loss == "luspo" else {}
        out[f"grpo/{loss}/off"] = ("grpo", dict(loss_type=loss, beta=0.04, **extra))
        out[f"grpo/{loss}/on"] = ("grpo", dict(loss_type=loss, beta=0.04, entropy_coef=0.01,
                                               gradient_accumulation_steps=4, by_position=False, **extra))
    out["rloo/off"] = ("rloo", dict(beta=0.05))
    out["rloo/on"] = ("rloo", dict(beta=0.05, gradient_accumulation_steps=4, by_position=False))
    # a PeftModel with non-zero adapters: the reference is a frozen copy of them (TRL's "ref" adapter)
    out["rloo/peft/off"] = ("rloo", dict(beta=0.05, peft_model=True))
    out["grpo/dapo/peft/off"] = ("grpo", dict(loss_type="dapo", beta=0.04, peft_model=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--only", default="", help="run the cases whose name contains this (e.g. vespo, peft)")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp()
    model = tp.build_model(os.path.join(tmp, "m"))
    rows = []
    for name, (kind, options) in cases().items():
        if args.only not in name:
            continue
        options = dict(options, learning_rate=args.lr, max_steps=args.steps)
        theirs = tp.run_trl(kind, model, os.path.join(tmp, name.replace("/", "_") + "_trl"), **options)
        ours = tp.run_ours(kind, model, os.path.join(tmp, name.replace("/", "_") + "_ours"), **options)
        r = tp.compare(theirs, ours)
        worst = {k: v for k, v in r["metrics"].items() if k in ("loss", "kl", "entropy", "grad_norm")}
        rows.append((name, r["steps"], worst, r["weights"]))
        print(name, r["steps"], {k: f"{a:.1e} abs / {b:.1e} rel" for k, (a, b) in worst.items()},
              f"weights {r['weights']:.1e}", flush=True)
    print("\n| run | steps | loss | kl | entropy | grad_norm | final weights |\n|---|---|---|---|---|---|---|")
    for name, steps, worst, weights in rows:
        cells = ["-" if k not in worst else f"{worst[k][0]:.1e} / {worst[k][1]:.1e}"
                 for k in ("loss", "kl", "entropy", "grad_norm")]
        print(f"| {name} | {steps} | {' | '.join(cells)} | {weights:.1e} |")


if __name__ == "__main__":
    main()
