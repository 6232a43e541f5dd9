"""A reward model beside the policy: `--compile_only` of a policy with a reward model of the same architecture on named
TPU slices (config-only folders from `fit_models.py`; the reward model is the policy's config as
`*ForSequenceClassification`, one label). The reward model is sharded like the policy and its weights stay on the
chips beside the train state, so every program's peak includes them. Settings: `bench_fit.py`'s.

    .venv/bin/python bench/bench_reward_fit.py [--model Llama-3.1-8B] [--slices v5p-8 v6e-8] [--args "--use_peft"]
"""

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_fit import run  # noqa: E402
from fit_models import MODELS, write_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Llama-3.1-8B", choices=list(MODELS))
    ap.add_argument("--slices", nargs="+", default=["v5p-8", "v6e-8"])
    ap.add_argument("--args", default="", help="extra trainer options, e.g. '--use_peft --lora_r 64'")
    args = ap.parse_args()
    gib = 2**30
    print("| policy + reward model | slice | options | reward model weights GiB/chip | peak GiB/chip: rollout / update"
          " / reward model | HBM GiB | verdict | compile s (reward model) |")
    print("|---|---|---|---:|---:|---:|---|---:|")
    with tempfile.TemporaryDirectory() as root:
        data = Path(root) / "prompts.jsonl"
        data.write_text('{"prompt": "w1 w2 w3"}\n')
        policy = write_model(Path(root), args.model)
        rm = write_model(Path(root) / "rm", args.model)
        config = json.loads((rm / "config.json").read_text())
        config.update(architectures=[config["architectures"][0].replace("CausalLM", "SequenceClassification")],
                      num_labels=1)
        (rm / "config.json").write_text(json.dumps(config, indent=1))
        for slice_name in args.slices:
            extra = ["--reward_model_name_or_path", str(rm), *shlex.split(args.args)]
            report, _, _ = run(policy, data, slice_name, Path(root) / "out", extra)
            p = report["programs"]
            peaks = " / ".join(f"{p[n]['peak_bytes_per_chip'] / gib:.1f}{'' if p[n]['fits'] else ' ✗'}"
                               for n in ("rollout", "update", "reward_model_0"))
            weights = report["settings"]["reward_model_bytes_per_chip"][0] / gib
            verdict = "**fits**" if report["fits"] else "does not fit"
            print(f"| {args.model} x2 | {slice_name} | {args.args or 'full fine-tuning'} | {weights:.2f} | {peaks} | "
                  f"{report['hbm_bytes_per_chip'] / gib:.2f} | {verdict} | "
                  f"{p['reward_model_0']['compile_seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
