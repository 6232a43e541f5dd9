"""Completion buckets on the CPU: the reference pass and the update at the bucket that holds the longest
completion vs at max_completion_length, for a generation batch whose completions end early.

The small model of bench_rloo_step.py (2 prompts x G = 4), `--max-new` 128 new tokens, completions cut by an EOS
at lengths drawn from 1..`--longest` (one completion exactly that long), as a length-penalising reward makes
them. Times `finish` (cut + reference log-probs) + `update` at both widths, alternating, median of `--repeats`;
prints both gradient norms (the same, to float rounding).

    .venv/bin/python bench/bench_buckets.py [--size small] [--max-new 128] [--longest 37] [--bucket 16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import EOS_ID, PAD_ID, distinct_reward, make_step, prompts

from rloo_jax.logprobs import completion_mask
from rloo_jax.step import completion_width


def early_ending(rollout, ends):  # noqa: ANN001, ANN201 - a Rollout in, a Rollout out
    ids = np.asarray(rollout.completion_ids).copy()
    for r, e in enumerate(ends):
        ids[r, :e] = np.where(ids[r, :e] == EOS_ID, EOS_ID + 1, ids[r, :e])
        ids[r, e], ids[r, e + 1:] = EOS_ID, PAD_ID
    ids = jnp.asarray(ids)
    mask, truncated = completion_mask(ids, (EOS_ID,), PAD_ID)
    return rollout.replace(completion_ids=ids, completion_mask=mask, is_truncated=truncated,
                           old_logps=rollout.old_logps * mask)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small")
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--longest", type=int, default=37)
    ap.add_argument("--bucket", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    step, state = make_step(args.size, new_tokens=args.max_new)
    ids, mask = (jnp.asarray(x) for x in prompts(2))
    sampled = step.sample(state, ids, mask, jax.random.key(0))
    rng = np.random.default_rng(0)
    ends = rng.integers(0, args.longest, sampled.completion_ids.shape[0])
    ends[0] = args.longest - 1
    sampled = early_ending(sampled, ends)
    width = completion_width(step.longest(sampled), args.max_new, args.bucket)
    rewards = jnp.asarray(distinct_reward(np.asarray(sampled.completion_ids)))
    weights = jnp.ones((1,), jnp.float32)
    times: dict[int, list[float]] = {width: [], args.max_new: []}
    losses = {}
    for i in range(args.repeats + 1):  # the first round compiles
        for w in (width, args.max_new):
            state_i = jax.tree.map(jnp.copy, state)
            t0 = time.perf_counter()
            rollout = step.finish(state_i, sampled, w)
            state_i, metrics = step.update(state_i, rollout, rewards, weights)
            jax.block_until_ready((state_i, metrics))
            if i:
                times[w].append(time.perf_counter() - t0)
            losses[w] = float(metrics["update"]["grad_norm"][0])  # (the on-policy loss is ~0: its gradient counts)
    lengths = np.asarray(sampled.completion_mask).sum(1)
    print(f"{args.size}: max_new_tokens {args.max_new}, completion lengths {lengths.tolist()} (mean "
          f"{lengths.mean():.1f}), bucket {args.bucket} -> width {width}")
    for w, t in times.items():
        print(f"  finish + update at width {w:4d}: median {statistics.median(t) * 1e3:7.1f} ms "
              f"(min {min(t) * 1e3:.1f}, max {max(t) * 1e3:.1f}), grad norm {losses[w]:.6f}")
    full, cut = statistics.median(times[args.max_new]), statistics.median(times[width])
    print(f"  speed-up {full / cut:.2f}x; grad norm difference {abs(losses[width] - losses[args.max_new]):.1e}")


if __name__ == "__main__":
    main()
