"""Is the model the bottleneck? Our forward (and forward+backward) vs a bare chain of the same matmuls, same run.

    .venv/bin/python bench/bench_forward_floor.py [--size small] [--batch 8] [--tokens 56]

The bare chain has the small Qwen2's per-layer matmuls (q, k, v, o, gate, up, down) and a softmax attention, no
norms, RoPE, masks or GQA: a lower bound for any implementation's forward on this machine.
"""

import argparse
import time

import common  # noqa: F401  (sets JAX_PLATFORMS, sys.path)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rloo_jax.models import init_causal_lm


def median_ms(fn, *args, n: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=list(common.SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=56)
    args = ap.parse_args()
    cfg = common.hf_config(args.size)
    graphdef, params = nnx.split(init_causal_lm(cfg, seed=0))
    b, t, d, f = args.batch, args.tokens, cfg["hidden_size"], cfg["intermediate_size"]
    ids = jnp.asarray(np.random.default_rng(0).integers(2, 800, (b, t)), jnp.int32)
    mask = jnp.ones((b, t), jnp.int32)

    @jax.jit
    def forward(p, ids, mask):
        return nnx.merge(graphdef, p).hidden_states(ids, mask)

    @jax.jit
    def forward_backward(p, ids, mask):
        return jax.grad(lambda q: jnp.sum(nnx.merge(graphdef, q).hidden_states(ids, mask) ** 2))(p)

    rng = np.random.default_rng(1)
    shapes = [(d, d)] * 4 + [(d, f)] * 2 + [(f, d)]
    ws = [jnp.asarray(rng.normal(size=s) * 0.02, jnp.float32) for s in shapes]

    @jax.jit
    def bare(x, ws):
        for _ in range(cfg["num_hidden_layers"]):
            q, k, v = (x @ w for w in ws[:3])
            s = jnp.einsum("bqd,bkd->bqk", q.reshape(b, t, d), k.reshape(b, t, d))
            a = (jax.nn.softmax(s, -1) @ v.reshape(b, t, d)).reshape(-1, d)
            x = x + a @ ws[3]
            x = x + (jax.nn.silu(x @ ws[4]) * (x @ ws[5])) @ ws[6]
        return x

    x = jnp.ones((b * t, d), jnp.float32)
    fwd, fb, floor = median_ms(forward, params, ids, mask), median_ms(forward_backward, params, ids, mask, n=5), \
        median_ms(bare, x, ws)
    print(f"{args.size} [{b}, {t}]: forward {fwd:.1f} ms | bare matmul chain {floor:.1f} ms | "
          f"ratio {fwd / floor:.2f} | forward+backward {fb:.1f} ms")


if __name__ == "__main__":
    main()
