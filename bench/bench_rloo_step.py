"""End-to-end RLOO step: rloo_jax (`python -m rloo_jax.train`) vs TRL 1.16 `RLOOTrainer`, one round.

Same offline checkpoints (Qwen2 tiny and small, built here with fixed seeds), same 256 synthetic prompts, same
Python reward, G=4, 8 completions per step, 32 new tokens, beta=0.05 (reference model on), lr 1e-5, float32, CPU,
11 steps; reports the mean `step_time` of steps 2-11 (both trainers log `step_time`, the wall time of one optimizer
step including generation) and the first step (compile for us).

    .venv/bin/python bench/bench_rloo_step.py [--sizes tiny small] [--steps 11] [--bf16] [--threads 2]
                                              [--gradient_checkpointing]

Gradient checkpointing is off for both trainers unless --gradient_checkpointing (then on for both): TRL's
`RLOOConfig` defaults to True (one more forward per block in the backward), ours is off on CPU, so the
default here sets TRL's to False for the same work. Each library runs in its own subprocess (fresh process, no
shared caches); ours with the persistent compilation cache off unless --cache. Results are printed as a table and
as JSON. One round only: bench_protocol.py runs the rounds, tunix and the plain-JAX floor the figures come from.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VOCAB = 836
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "small": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=8),
}
SETTINGS = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=32, beta=0.05,
                learning_rate=1e-5, temperature=1.0, logging_steps=1)


def build_assets(root: str, size: str) -> tuple[str, str]:
    """A Qwen2 checkpoint + word-level tokenizer (vocab 836) and a 256-prompt jsonl, all offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = ["<pad>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        padding_side="left")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                      bos_token_id=1, tie_word_embeddings=False, **SIZES[size])
    model_dir = os.path.join(root, f"qwen2-{size}")
    Qwen2ForCausalLM(cfg).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    import random

    rng = random.Random(0)
    data = os.path.join(root, "prompts.jsonl")
    with open(data, "w") as f:
        for _ in range(256):
            n = rng.randint(8, 24)
            f.write(json.dumps({"prompt": " ".join(f"w{rng.randint(2, VOCAB - 3)}" for _ in range(n))}) + "\n")
    return model_dir, data


def reward(prompts, completions, **kwargs):
    """Fraction of distinct words in the completion (a cheap Python reward, same for both)."""
    out = []
    for c in completions:
        toks = c.split()
        out.append(len(set(toks)) / max(len(toks), 1))
    return out


def step_stats(times: list[float], wall: float) -> dict:
    """First step, mean of the other steps (s/step) and the process's wall seconds."""
    return {"first_step_s": times[0], "step_s": sum(times[1:]) / len(times[1:]), "wall_s": wall}


def run_ours(model_dir: str, data: str, steps: int, bf16: bool, cache: bool, extra: list[str] = (),
             algorithm: str = "rloo") -> dict:
    """`python -m rloo_jax.train <algorithm>` in a fresh process; step times from its metrics.jsonl."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "rloo_jax.train", algorithm, "--model_name_or_path", model_dir, "--dataset_name",
               data,
               "--reward_funcs", "bench_rloo_step:reward", "--output_dir", out, "--max_steps", str(steps),
               "--save_steps", str(10 * steps), "--seed", "0", "--lr_scheduler_type",
               "constant", "--bf16", str(bf16).lower(), "--compilation_cache", str(cache).lower(),
               "--max_prompt_length", "32", "--prompt_bucket", "32"]
        for k, v in SETTINGS.items():
            cmd += [f"--{k}", str(v)]
        cmd += list(extra)
        env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"rloo_jax failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        times = [r["step_time"] for r in rows if "step_time" in r and "reward" in r]
    return step_stats(times, wall)


TRL_SCRIPT = r"""
import json, sys, time, torch
sys.path.insert(0, {here!r})
torch.set_num_threads({threads})
from datasets import load_dataset
from transformers import PreTrainedTokenizerFast, TrainerCallback
import trl
from bench_rloo_step import reward, SETTINGS
# AutoTokenizer would rebuild it as Qwen2Tokenizer (another pre-tokenizer: empty ids); load it as saved
tok = PreTrainedTokenizerFast.from_pretrained({model!r}, padding_side="left")
ds = load_dataset("json", data_files={data!r}, split="train")
times = []
class Timer(TrainerCallback):
    def on_step_begin(self, *a, **k): self.t = time.perf_counter()
    def on_step_end(self, *a, **k): times.append(time.perf_counter() - self.t)
args = trl.RLOOConfig(output_dir={out!r}, max_steps={steps}, report_to=[], use_cpu=True, bf16={bf16}, seed=0,
                      save_strategy="no", lr_scheduler_type="constant", gradient_checkpointing={gc}, **SETTINGS)
tr = trl.RLOOTrainer(model={model!r}, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok)
tr.add_callback(Timer())
tr.train()
print("RESULT", json.dumps(times))
"""


def run_trl(model_dir: str, data: str, steps: int, bf16: bool, threads: int, gc: bool = False) -> dict:
    """TRL's RLOOTrainer in a fresh process, torch on `threads` threads, gradient checkpointing `gc`."""
    with tempfile.TemporaryDirectory() as out:
        script = TRL_SCRIPT.format(here=HERE, threads=threads, model=model_dir, data=data, out=out, steps=steps,
                                   bf16=bf16, gc=gc)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode:
            raise RuntimeError(f"TRL failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        times = json.loads(proc.stdout.split("RESULT", 1)[1])
    return step_stats(times, wall)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=list(SIZES))
    ap.add_argument("--steps", type=int, default=11)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--cache", action="store_true", help="use our persistent compilation cache")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--gradient_checkpointing", action="store_true", help="on for both trainers (default: off)")
    ap.add_argument("--ours-args", default="", help="extra options for rloo_jax, e.g. '--gradient_checkpointing false'")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for size in args.sizes:
            model_dir, data = build_assets(os.path.join(root, size), size)
            gc = ["--gradient_checkpointing", str(args.gradient_checkpointing).lower()]
            ours = run_ours(model_dir, data, args.steps, args.bf16, args.cache, gc + args.ours_args.split())
            theirs = None if args.skip_trl else run_trl(model_dir, data, args.steps, args.bf16, args.threads,
                                                       args.gradient_checkpointing)
            results[size] = {"rloo_jax": ours, "trl": theirs}
            line = f"{size:6s} rloo_jax {ours['step_s']:.4f} s/step (first {ours['first_step_s']:.2f} s)"
            if theirs:
                line += (f" | TRL {theirs['step_s']:.4f} s/step (first {theirs['first_step_s']:.2f} s)"
                         f" | speed-up x{theirs['step_s'] / ours['step_s']:.2f}")
            print(line, flush=True)
    print(json.dumps({"dtype": "bf16" if args.bf16 else "f32", "steps": args.steps,
                      "gradient_checkpointing": args.gradient_checkpointing, "results": results}, indent=1))


if __name__ == "__main__":
    main()
