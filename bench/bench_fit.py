"""Will it fit? `--compile_only` for public model configs on named TPU slices: the table of README "Will it fit?".

For each (model, slice) pair this runs `python -m rloo_jax.train --compile_only --topology SLICE` in a fresh
process (config-only model folders from `fit_models.py`: no weights, no network), reads its compile_report.json
and prints one markdown row: per-chip peak of the rollout and the update against the chip's HBM, the update's
compiler FLOPs against model FLOPs, the decode loop's bytes per step against its floor, the roofline seconds of the
rollout, the update and the step (compiler-measured efficiency, BENCHMARKS.md), the verdict and the compile
seconds of each program. Settings (the Scale issue's): G=8, per_device_train_batch_size 8, steps_per_generation 4,
prompt 256, completion 1024, beta 0.04, bf16 compute, fsdp over all chips.

    .venv/bin/python bench/bench_fit.py [--algorithm grpo] [--models Qwen2.5-1.5B ...] [--slices v5e-8 ...]
        [--args "--remat_policy minimal"] [--layers 8 16 32] [--json out.json]

`--algorithm grpo` compiles GRPO's programs (TRL's GRPO defaults: loss_type dapo; pass --args "--beta 0" for its
default of no reference model). `--algorithm ppo` compiles PPO's (`PPO_SETTINGS`: four models on the chips: policy,
reference, a reward model of the policy's config, and a value model started from it). Every row also gives the
estimated tokens per second per chip (prompt + completion tokens of a step at the compiled lengths / estimated step
time / chips: NeMo-RL's measure).

`--layers` truncates each model to that many blocks (compile time against depth: README's "flat in depth").
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import fit_models  # noqa: E402
from fit_models import MODELS, write_model  # noqa: E402

SETTINGS = ["--num_generations", "8", "--per_device_train_batch_size", "8", "--steps_per_generation", "4",
            "--max_prompt_length", "256", "--prompt_bucket", "64", "--max_completion_length", "1024",
            "--beta", "0.04", "--bf16", "true", "--reward_funcs", "format"]
# PPO (TRL 1.12's defaults: 4 PPO epochs, 1 mini-batch): the same 8 x 4 micro-batches of completions per device and
# lengths, one completion per prompt; the policy's config as the reward model, which also starts the value model
PPO_SETTINGS = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4", "--num_ppo_epochs", "4",
                "--max_prompt_length", "256", "--prompt_bucket", "64", "--response_length", "1024",
                "--bf16", "true", "--pad_token", "<pad>"]


def run(model_dir: Path, data: Path, slice_name: str, out: Path, extra: list[str], algorithm: str = "rloo"
        ) -> tuple[dict, float, int]:
    settings = SETTINGS
    if algorithm == "ppo":
        reward = fit_models.write_reward_model(model_dir.parent, model_dir.name)
        settings = [*PPO_SETTINGS, "--reward_model_path", str(reward)]
    cmd = [sys.executable, "-m", "rloo_jax.train", algorithm, "--compile_only", "--topology", slice_name,
           "--model_name_or_path", str(model_dir), "--dataset_name", str(data), "--output_dir", str(out),
           *settings, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"{model_dir.name} on {slice_name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads((out / "compile_report.json").read_text()), wall, proc.returncode


def row(model: str, slice_name: str, report: dict, extra: list[str]) -> str:
    gib = 2**30
    hbm = report["hbm_bytes_per_chip"] / gib
    progs = report["programs"]
    cells = []
    for name in ("rollout", "update"):
        p = progs[name]
        mark = "" if p["fits"] else " ✗"
        cells.append(f"{p['peak_bytes_per_chip'] / gib:.1f}{mark}")
    verdict = "**fits**" if report["fits"] else "does not fit"
    secs = " / ".join(f"{progs[n]['compile_seconds']:.0f}" for n in ("rollout", "update"))
    up, ro = progs["update"], progs["rollout"]

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    decode = "-" if ro.get("decode_bytes_ratio") is None else (
        f"{(ro['decode_hbm_bytes_per_step'] + ro['decode_ici_bytes_per_step']) / 1e9:.1f} "
        f"({ro['decode_bytes_ratio']:.2f}x)")
    est = (f"{num(ro['estimated_seconds'], '.1f')} / {num(up['estimated_seconds'], '.1f')} / "
           f"{num(report['estimated_step_seconds'], '.1f')}")
    tokens = num(report.get("estimated_tokens_per_second_per_chip"), ",.0f")
    return (f"| {model} | {slice_name} ({report['chips']} chips, {hbm:.2f} GiB) | {' '.join(extra) or 'defaults'} | "
            f"{cells[0]} | {cells[1]} | {num(up['flops'] and up['flops'] / 1e12, '.0f')} | "
            f"{num(up['flops_ratio'], '.2f')}x | {decode} | {est} | {tokens} | {verdict} | {secs} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithm", default="rloo", choices=["rloo", "grpo", "ppo"])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--slices", nargs="+", default=["v5e-8", "v5p-8", "v6e-8"])
    ap.add_argument("--args", default="", help="extra trainer options, e.g. '--remat_policy minimal'")
    ap.add_argument("--layers", nargs="+", type=int, help="truncate each model to these depths, one run each")
    ap.add_argument("--json", help="also write every report to this JSON file")
    args = ap.parse_args()
    extra = shlex.split(args.args)
    reports = {}
    print("| model | slice | options | rollout peak GiB/chip | update peak GiB/chip | update TFLOP/chip | "
          "update FLOPs / model | decode GB/step/chip (x floor) | est. s rollout / update / step | est. tokens/s/chip "
          "| verdict | compile s (rollout / update) |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    with tempfile.TemporaryDirectory() as root:
        data = Path(root) / "prompts.jsonl"
        data.write_text('{"prompt": "w1 w2 w3"}\n')
        for model in args.models:
            for layers in args.layers or [None]:
                name = model if layers is None else f"{model}-L{layers}"
                if layers is not None:
                    fit_models.MODELS[name] = dict(MODELS[model], num_hidden_layers=layers)
                    if "layer_types" in MODELS[model]:
                        fit_models.MODELS[name]["layer_types"] = MODELS[model]["layer_types"][:layers]
                model_dir = write_model(Path(root), name)
                for slice_name in args.slices:
                    report, wall, _ = run(model_dir, data, slice_name, Path(root) / "out", extra, args.algorithm)
                    reports[f"{name} {slice_name}"] = report
                    print(row(name, slice_name, report, extra), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))


if __name__ == "__main__":
    main()
