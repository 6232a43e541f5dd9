"""One optimizer update on CPU: the non-finite skip as elementwise selects (what `make_optimizer` builds for an
accelerator) against `optax.apply_if_finite` (what it builds for CPU) and no skip at all.

clip_by_global_norm(1.0) -> AdamW over 44 float32 matrices shaped like the "small" benchmark model's (26M
parameters), parameters and state donated, jitted; prints the median and minimum of 20 timed calls.

    .venv/bin/python bench/bench_optimizer.py
"""

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from rloo_jax.optimizer import NEVER, skip_if_not_finite  # noqa: E402

SHAPES = [(836, 512)] * 2 + [(512, 512)] * 24 + [(512, 2048)] * 12 + [(2048, 512)] * 6


def time_update(tx: optax.GradientTransformation, calls: int = 20) -> tuple[float, float]:
    params = [jnp.full(s, 0.01, jnp.float32) for s in SHAPES]
    grads = [jnp.full(s, 1e-3, jnp.float32) for s in SHAPES]

    def step(p, s, g):  # noqa: ANN001, ANN202
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(step, donate_argnums=(0, 1))
    p, s = step(params, tx.init(params), grads)  # compile
    jax.block_until_ready(p)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        p, s = step(p, s, grads)
        jax.block_until_ready(p)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], times[0]


def main() -> None:
    def inner() -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5))

    for name, tx in [("selects (accelerators)", skip_if_not_finite(inner())),
                     ("apply_if_finite (CPU)", optax.apply_if_finite(inner(), NEVER)),
                     ("no skip", inner())]:
        median, best = time_update(tx)
        print(f"{name:24s} median {median * 1e3:6.1f} ms  min {best * 1e3:6.1f} ms")


if __name__ == "__main__":
    main()
