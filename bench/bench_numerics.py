"""Sampler vs trainer numerics on this CPU: the log-prob gap, the step-1 KL, importance-sampling ratios, and what
recomputing the old log-probs costs (docs/numerics.md).

The bench's Qwen2 shapes (tiny 0.18M, small 26M parameters, random init; `common.py`), 8 prompts x G=8, 64 new
tokens, temperature 1, beta 0.05, in float32 and bfloat16 compute. For each: the sampler's log-probs of the
sampled tokens against the training forward's at the same parameters (`sampling/sampling_logp_difference`), the
largest per-sequence sum of the gap, the step-1 `kl` (policy = reference) with the sampler's log-probs and with
recomputed ones, TRL GRPO's sequence ratio exp(sum of gaps) (min / max, share outside [1/1.2, 1.2]: where
`epsilon` 0.2 would clip it before any update), and the wall time of `finish` (reference pass) with and without
the recompute pass next to sampling and one update (medians of --repeats rounds, the phases interleaved in each
round; only ratios mean anything on a shared machine).

    .venv/bin/python bench/bench_numerics.py [--sizes tiny small] [--repeats 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from common import distinct_reward, make_step, prompts, timeit

import rloo_jax as rj
from rloo_jax.programs import Programs


def measure(size: str, dtype: str, steps: int, repeats: int) -> dict:
    step, state = make_step(size, dtype, num_prompts=8, group=8, new_tokens=64)
    cfg = dataclasses.replace(step.cfg, recompute_old_logps=True)
    recompute = Programs(step.graphdef, step.optimizer, cfg)
    ids, mask = (jnp.asarray(x) for x in prompts(8, seed=1))
    w = jnp.ones(1)
    out = {"gap_mean": [], "gap_max": [], "seq_gap_max": [], "kl_sampler": [], "kl_recomputed": [],
           "is_min": [], "is_max": [], "is_outside_1.2": []}
    for i in range(steps):  # each step samples from the updated policy (reference fixed)
        sampled = step.sample(state, ids, mask, jax.random.key(i))
        plain, ro = step.finish(state, sampled, 64), recompute.finish(state, sampled, 64)
        rewards = jnp.asarray(distinct_reward(np.asarray(ro.completion_ids)))
        gap = rj.sampling_logp_difference(ro.old_logps, ro.sampler_logps, ro.completion_mask)
        seq = jnp.sum((ro.old_logps - ro.sampler_logps) * ro.completion_mask, axis=1)
        weights, _ = rj.importance_sampling_weights(ro.old_logps, ro.sampler_logps, ro.completion_mask,
                                                    "sequence_truncate", None, None)
        if i == 0:
            out["kl_sampler"].append(float(step.score(plain, rewards, w)[1]["kl"]))
            out["kl_recomputed"].append(float(recompute.score(ro, rewards, w)[1]["kl"]))
        out["gap_mean"].append(float(gap["sampling/sampling_logp_difference/mean"]))
        out["gap_max"].append(float(gap["sampling/sampling_logp_difference/max"]))
        out["seq_gap_max"].append(float(jnp.max(jnp.abs(seq))))
        out["is_min"].append(float(jnp.min(weights)))
        out["is_max"].append(float(jnp.max(weights)))
        out["is_outside_1.2"].append(float(jnp.mean((weights > 1.2) | (weights < 1 / 1.2))))
        state, _ = step.update(state, plain, rewards, w)
    res = {k: (max(v) if k.endswith(("max", "1.2")) else min(v) if k.endswith("min") else statistics.mean(v))
           for k, v in out.items()}

    sampled = step.sample(state, ids, mask, jax.random.key(99))
    ro = step.finish(state, sampled, 64)
    rewards = jnp.asarray(distinct_reward(np.asarray(ro.completion_ids)))
    copy = jax.tree.map(jnp.copy, state)
    phases = {
        "finish_s": lambda: jax.block_until_ready(step.finish(state, sampled, 64)),
        "finish_recompute_s": lambda: jax.block_until_ready(recompute.finish(state, sampled, 64)),
        "sample_s": lambda: jax.block_until_ready(step.sample(state, ids, mask, jax.random.key(5))),
        "update_s": lambda: jax.block_until_ready(step.update(jax.tree.map(jnp.copy, copy), ro, rewards, w)),
    }
    times = {name: [] for name in phases}
    for fn in phases.values():
        fn()  # compiled and warm
    for _ in range(repeats):  # interleaved: a change in the machine's load falls on every phase alike
        for name, fn in phases.items():
            times[name] += timeit(fn, 1)
    res.update({name: statistics.median(t) for name, t in times.items()})
    step_s = res["sample_s"] + res["finish_s"] + res["update_s"]
    res["recompute_share_of_step"] = (res["finish_recompute_s"] - res["finish_s"]) / step_s
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    report = {}
    for size in args.sizes:
        for dtype in ("float32", "bfloat16"):
            report[f"{size}/{dtype}"] = r = measure(size, dtype, args.steps, args.repeats)
            print(size, dtype, json.dumps({k: float(f"{v:.3g}") for k, v in r.items()}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
