"""FLOP utilisation of the update step (loss forward + backward + AdamW) on this CPU.

Achieved FLOP/s = FLOPs of one `Programs.update` / its median wall time, divided by this machine's matmul peak
measured in the same run (best of 20 jitted n x n x n matmuls, n = 2048; bf16 inputs with f32 accumulation for
--bf16). FLOPs two ways: XLA's count of the compiled update (`compiled.cost_analysis()["flops"]`, which includes
the attention and the rematerialised vocabulary chunks) and the textbook 6 * params * tokens (tokens = the
positions the update runs: one prompt per group plus the G completions). Settings of bench_rloo_step.py (2 prompts x
G=4, 32 new tokens; prompts bucketed to 32).

    .venv/bin/python bench/bench_flops.py [--sizes small] [--repeats 10] [--bf16]

No GPU or TPU is available to this project: figures are for XLA:CPU only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import distinct_reward, make_step, matmul_peak, prompts


def update_flops(size: str, repeats: int, dtype: str) -> dict[str, float]:
    step, state = make_step(size, dtype)
    ids, mask = prompts(2)
    weights = jnp.ones((1,), jnp.float32)
    ro = jax.block_until_ready(step.rollout(state, ids, mask, jax.random.key(0)))
    rewards = jnp.asarray(distinct_reward(np.asarray(ro.completion_ids)))
    compiled = step.update_program(*ro.prompt_ids.shape, ro.completion_ids.shape[1], 1).lower().compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    xla_flops = float(cost["flops"])
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    tokens = int(ro.prompt_ids.size + ro.completion_ids.size)
    times = []
    for i in range(repeats + 1):
        ro = jax.block_until_ready(step.rollout(state, ids, mask, jax.random.key(i)))
        t0 = time.perf_counter()
        state, m = step.update(state, ro, rewards, weights)
        jax.block_until_ready((state, m))
        times.append(time.perf_counter() - t0)
    sec = statistics.median(times[1:])
    return {"update_s": sec, "xla_gflop": xla_flops / 1e9, "6NT_gflop": 6 * n_params * tokens / 1e9,
            "params_m": n_params / 1e6, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["small"])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--bf16", action="store_true")
    args = ap.parse_args()
    dtype = "bfloat16" if args.bf16 else "float32"
    peak = matmul_peak(2048, dtype)
    print(f"matmul peak ({dtype} 2048^3, best of 20): {peak / 1e9:.1f} GFLOP/s")
    out = {"peak_gflops": peak / 1e9, "dtype": dtype}
    for size in args.sizes:
        r = update_flops(size, args.repeats, dtype)
        peak_after = matmul_peak(2048, dtype)  # again, after: the machine is shared, so bracket the measurement
        r["peak_after_gflops"] = peak_after / 1e9
        for name in ("xla_gflop", "6NT_gflop"):
            r[name.replace("gflop", "util")] = r[name] * 1e9 / r["update_s"] / max(peak, peak_after)
        out[size] = r
        print(f"{size}: update {r['update_s'] * 1e3:.1f} ms; {r['params_m']:.1f}M params, {r['tokens']} tokens; "
              f"XLA {r['xla_gflop']:.2f} GFLOP -> {r['xla_gflop'] / r['update_s']:.1f} GFLOP/s "
              f"({100 * r['xla_util']:.0f}% of peak); 6NT {r['6NT_gflop']:.2f} GFLOP -> "
              f"{r['6NT_gflop'] / r['update_s']:.1f} GFLOP/s ({100 * r['6NT_util']:.0f}%); peak after "
              f"{peak_after / 1e9:.1f} GFLOP/s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
