"""Peak memory of the log-prob pass at a Qwen2-sized vocabulary: vocab-chunked vs materialised float32 logits.

V = 151,936, D = 896 (Qwen2.5-0.5B's head), B x T = 8 x 1024. Compiles (never runs) two jitted functions per path
and reads XLA's `compiled.memory_analysis()`: the log-prob pass alone (forward) and its gradient with respect to the
hidden states and the lm head (what the loss needs). Peak = temp + output bytes (arguments excluded: the hidden
states and the head are the same for both paths). The reference is the size of the float32 logits themselves,
B * T * V * 4 bytes.

    .venv/bin/python bench/bench_memory.py [--chunks 128 64 32]

Ours: `rloo_jax.logprobs.per_token_logps_from_hidden` (jax.checkpoint per chunk). Peer: the naive path (full
logits -> `per_token_logps`), which is what TRL does (it materialises `[B, T, V]` logits per forward micro-batch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from rloo_jax.logprobs import per_token_logps, per_token_logps_from_hidden  # noqa: E402

B, T, D, V = 8, 1024, 896, 151_936


def peak_bytes(fn, *args: jax.ShapeDtypeStruct) -> int:  # noqa: ANN001
    mem = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(mem.temp_size_in_bytes + mem.output_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", nargs="+", type=int, default=[128, 64, 32])
    args = ap.parse_args()
    h = jax.ShapeDtypeStruct((B, T, D), jnp.float32)
    w = jax.ShapeDtypeStruct((D, V), jnp.float32)
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32)
    logits_bytes = B * T * V * 4

    def naive(h, w, ids):  # noqa: ANN001, ANN202
        return per_token_logps(jnp.einsum("btd,dv->btv", h, w), ids)

    def chunked(chunk: int):  # noqa: ANN202
        def f(h, w, ids):  # noqa: ANN001, ANN202
            return per_token_logps_from_hidden(h, lambda x: jnp.einsum("...d,dv->...v", x, w), ids, chunk_size=chunk)

        return f

    def grad_of(f):  # noqa: ANN001, ANN202
        return jax.grad(lambda h, w, ids: jnp.sum(f(h, w, ids)), argnums=(0, 1))

    rows = {"naive (full logits)": naive} | {f"chunked {c}": chunked(c) for c in args.chunks}
    print(f"B x T = {B} x {T}, D = {D}, V = {V:,}: float32 logits = {logits_bytes / 2**20:,.0f} MiB")
    print(f"{'path':22s} {'forward MiB':>12s} {'x logits':>9s} {'fwd+grad MiB':>13s} {'x logits':>9s}")
    out = {"logits_mib": logits_bytes / 2**20}
    for name, f in rows.items():
        fwd, grad = peak_bytes(f, h, w, ids), peak_bytes(grad_of(f), h, w, ids)
        out[name] = {"forward_mib": fwd / 2**20, "grad_mib": grad / 2**20}
        print(f"{name:22s} {fwd / 2**20:12,.0f} {fwd / logits_bytes:9.3f} {grad / 2**20:13,.0f} "
              f"{grad / logits_bytes:9.3f}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
