"""New tokens/s of rloo_jax.sampling.generate vs transformers generate() on tiny and small Qwen2 checkpoints.

Both sides: the same locally built checkpoint (fixed seed), float32, CPU, sampling at temperature 1 with no
top-k/top-p, exactly 32 new tokens (no EOS stopping: ours gets no eos ids, transformers gets min_new_tokens),
B prompts x G=4 samples. Reports the first call (ours: trace + compile) separately from the mean of warm runs.

    .venv/bin/python bench/bench_generate.py                 # tiny + small, batch 8 and 32
    .venv/bin/python bench/bench_generate.py --micro         # token-choice kernels only
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import EOS_ID, PAD_ID, SIZES, VOCAB  # noqa: E402 -- the model shapes of every bench

from rloo_jax import sampling  # noqa: E402


def build_checkpoint(size: str, out_dir: Path) -> Path:
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=PAD_ID,
        eos_token_id=EOS_ID, bos_token_id=2, **SIZES[size],
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).float().eval()
    model.save_pretrained(out_dir)
    return out_dir


def prompts(num_prompts: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded random prompts of 8..16 tokens (ids avoid pad/eos/bos)."""
    rng = np.random.default_rng(seed)
    ids = np.full((num_prompts, 16), PAD_ID, np.int64)
    mask = np.zeros_like(ids)
    for b in range(num_prompts):
        n = int(rng.integers(8, 17))
        ids[b, 16 - n :] = rng.integers(3, VOCAB, size=n)
        mask[b, 16 - n :] = 1
    return ids, mask


def timed(fn, i: int) -> float:
    t = time.perf_counter()
    fn(i)
    return time.perf_counter() - t


def ours_call(path: Path, ids: np.ndarray, mask: np.ndarray, group: int, new: int):
    """A function i -> None running our generate with key i (blocks until done)."""
    from rloo_jax.models import load_causal_lm

    model = load_causal_lm(path)

    def call(i: int) -> None:
        gen = sampling.generate(model, ids, mask, key=jax.random.key(i), max_new_tokens=new, num_generations=group,
                                temperature=1.0, pad_token_id=PAD_ID, prompt_bucket=16)
        gen.completion_ids.block_until_ready()
        assert int(gen.lengths.min()) == new

    return call


def hf_call(path: Path, ids: np.ndarray, mask: np.ndarray, group: int, new: int):
    """A function i -> None running transformers' generate (torch seed i), exactly `new` tokens per row."""
    import torch
    import transformers

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float().eval()
    input_ids = torch.from_numpy(np.repeat(ids, group, axis=0))
    attention_mask = torch.from_numpy(np.repeat(mask, group, axis=0))

    def call(i: int) -> None:
        torch.manual_seed(i)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                                 temperature=1.0, top_k=None, top_p=None, max_new_tokens=new, min_new_tokens=new,
                                 pad_token_id=PAD_ID, eos_token_id=EOS_ID)
        assert out.shape[1] == ids.shape[1] + new

    return call


def run_generate(args: argparse.Namespace) -> None:
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.new_tokens} new tokens; G={args.group}; "
          f"mean of {args.runs} warm runs, ours and transformers alternating")
    print(f"{'model':6} {'batch':>5}  {'ours first':>10}  {'ours tok/s':>10}  {'HF first':>8}  {'HF tok/s':>9}  ratio"
          "   (new tokens/s from the mean time; ratio = HF time / ours)")
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            path = build_checkpoint(size, Path(tmp) / size)
            for num_prompts in args.prompts:
                ids, mask = prompts(num_prompts)
                tokens = num_prompts * args.group * args.new_tokens
                ours = ours_call(path, ids, mask, args.group, args.new_tokens)
                hf = hf_call(path, ids, mask, args.group, args.new_tokens)
                o_first, h_first = timed(ours, 0), timed(hf, 0)
                o_times, h_times = [], []
                for i in range(1, args.runs + 1):  # alternate, so both see the same machine load
                    o_times.append(timed(ours, i))
                    h_times.append(timed(hf, i))
                o_mean, h_mean = float(np.mean(o_times)), float(np.mean(h_times))
                o_med, h_med = float(np.median(o_times)), float(np.median(h_times))
                print(f"{size:6} {num_prompts * args.group:5d}  {o_first:9.2f}s  {tokens / o_mean:10.0f}  "
                      f"{h_first:7.2f}s  {tokens / h_mean:9.0f}  {h_mean / o_mean:5.2f}x   (medians: "
                      f"{tokens / o_med:.0f} vs {tokens / h_med:.0f} tok/s, {h_med / o_med:.2f}x)", flush=True)


def run_micro(args: argparse.Namespace) -> None:
    """Per-call microseconds of the token-choice kernels on [N, V] logits (jitted, warm)."""

    def us(fn, *xs: jax.Array, n: int) -> float:
        jax.block_until_ready(fn(*xs))
        t = time.perf_counter()
        for _ in range(n):
            out = fn(*xs)
        jax.block_until_ready(out)
        return (time.perf_counter() - t) / n * 1e6

    kernels = {
        "categorical": jax.jit(lambda x, k: jax.random.categorical(k, x, axis=-1)),
        "inverse_cdf": jax.jit(lambda x, k: sampling.inverse_cdf_sample(x, sampling.row_uniforms(k, 0, x.shape[0]))),
        "argmax": jax.jit(lambda x, k: jnp.argmax(x, axis=-1)),
        "greedy_tokens": jax.jit(lambda x, k: sampling.greedy_tokens(x)),
    }
    print(f"{'N':>3} {'V':>7}  " + "  ".join(f"{name:>13}" for name in kernels) + "   (microseconds per call)")
    for rows, vocab in ((8, 836), (32, 836), (8, 32_000), (32, 151_936)):
        x = jax.random.normal(jax.random.key(0), (rows, vocab)) * 3
        key = jax.random.key(1)
        n = 200 if vocab < 10_000 else 10
        row = [us(fn, x, key, n=n) for fn in kernels.values()]
        print(f"{rows:3d} {vocab:7d}  " + "  ".join(f"{v:13.0f}" for v in row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=sorted(SIZES))
    parser.add_argument("--prompts", nargs="+", type=int, default=[2, 8], help="prompts per batch (x G rows)")
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--micro", action="store_true", help="only the token-choice kernel timings")
    args = parser.parse_args()
    run_micro(args) if args.micro else run_generate(args)


if __name__ == "__main__":
    main()
