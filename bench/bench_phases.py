"""Phase breakdown of one rloo_jax RLOO step: generation, reference log-probs, reward, update (same run).

The settings of bench_rloo_step.py (Qwen2 tiny/small shapes, random init, 2 prompts x G=4, 32 new tokens,
beta=0.05, AdamW lr 1e-5). Each phase is its own jitted function timed with block_until_ready; `rollout` (the
trainer's one jitted call = generation + reference log-probs) and the whole step are timed too, so the sum of the
parts can be checked against them. Warm-up (compile) calls are excluded; reports the median of --repeats.

    .venv/bin/python bench/bench_phases.py [--sizes tiny small] [--repeats 10] [--bf16]

TRL 1.16's breakdown on the small model (DESIGN.md section 4, measured earlier on this CPU, quiet machine):
generation 0.44 s, old+ref log-probs 0.26 s, loss forward 0.15 s, backward+AdamW 0.34 s (1.19 s per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import distinct_reward, make_step, prompts, timeit

from rloo_jax.sampling import generate_fn
from rloo_jax.step import completion_logps


def phases(size: str, repeats: int, dtype: str) -> dict[str, float]:
    step, state = make_step(size, dtype)
    ids, mask = prompts(2)
    ids, mask = jnp.asarray(ids), jnp.asarray(mask)
    key = jax.random.key(0)
    cfg = step.cfg
    g = cfg.num_generations
    gen = jax.jit(lambda p, i, m, k: generate_fn(step.graphdef, p, i, m, k, cfg.sampling))
    ref = jax.jit(lambda p, i, m, c, cm: completion_logps(step.graphdef, p, jnp.repeat(i, g, 0),
                                                          jnp.repeat(m, g, 0), c, cm, cfg.temperature,
                                                          cfg.logprob_chunk))
    weights = jnp.ones((1,), jnp.float32)

    out = gen(state.params, ids, mask, key)
    jax.block_until_ready(ref(state.ref_params, ids, mask, out.completion_ids, out.completion_mask))
    ro = step.rollout(state, ids, mask, key)
    rewards = jnp.asarray(distinct_reward(np.asarray(ro.completion_ids)))
    state, _ = step.update(state, ro, rewards, weights)  # compiles
    jax.block_until_ready(state)

    res = {}
    res["generation"] = timeit(lambda: jax.block_until_ready(gen(state.params, ids, mask, key)), repeats)
    res["ref_logps"] = timeit(lambda: jax.block_until_ready(
        ref(state.ref_params, ids, mask, out.completion_ids, out.completion_mask)), repeats)
    res["rollout (gen+ref, one jit)"] = timeit(lambda: jax.block_until_ready(step.rollout(state, ids, mask, key)),
                                               repeats)
    res["reward (host)"] = timeit(lambda: distinct_reward(np.asarray(ro.completion_ids)), repeats)
    upd = []
    for _ in range(repeats):
        ro_i = jax.block_until_ready(step.rollout(state, ids, mask, key))
        t0 = time.perf_counter()
        state = jax.block_until_ready(step.update(state, ro_i, rewards, weights))[0]  # donates the old state
        upd.append(time.perf_counter() - t0)
    res["update (loss fwd+bwd+AdamW)"] = upd

    def whole() -> None:
        nonlocal state
        r = step.rollout(state, ids, mask, key)
        rw = jnp.asarray(distinct_reward(np.asarray(r.completion_ids)))
        state, m = step.update(state, r, rw, weights)
        jax.block_until_ready(m)

    res["whole step"] = timeit(whole, repeats)
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    dtype = "bfloat16" if args.bf16 else "float32"
    results = {}
    for size in args.sizes:
        r = phases(size, args.repeats, dtype)
        results[size] = r
        print(f"{size} ({dtype}), median of {args.repeats}:")
        for name, sec in r.items():
            print(f"  {name:32s} {sec * 1e3:9.2f} ms")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
