"""How far from the hardware? Plain jitted JAX for the RLOO step's shapes, and our model's forward against it.

    .venv/bin/python bench/bench_forward_floor.py [--size small] [--batch 8] [--tokens 56]          # forward check
    .venv/bin/python bench/bench_forward_floor.py --step [--size small] [--json]                    # step floor

Forward check: our model's forward (and forward+backward) vs a bare chain of the same matmuls, same run. The bare
chain has the Qwen2's per-layer matmuls (q, k, v, o, gate, up, down) and a softmax attention, no norms, RoPE,
masks or GQA: a lower bound for any implementation's forward on this machine.

Step floor (`--step`): the work of one RLOO step of bench_rloo_step.py written as plain jitted JAX with no
trainer around it, each part timed alone (median of repeats) at float32:
  - decode: prefill 8 rows x 24 prompt tokens, then 31 KV-cache decode steps (32 new tokens), greedy, the cache
    kv-head-major so attention reads it in place;
  - forward: the reference log-probs, one causal forward over 8 x 56 tokens with the vocabulary head and
    log-softmax;
  - update: forward + backward of the sequence-level policy-gradient loss over 8 x 56 tokens, then AdamW.
Same layer shapes as the Qwen2 checkpoint (q/k/v/o with grouped kv heads, gated MLP, untied head), no norms or
RoPE. The floor is the sum of the three: the step's model work written plainly, with no trainer, sampler
bookkeeping, reward or logging around it. It is not a strict lower bound: a trainer can beat it with less work (ours
prefills each prompt once for its G completions) or better kernels.
"""

import argparse
import json
import time

import common  # noqa: F401  (sets JAX_PLATFORMS, sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from rloo_jax.models import init_causal_lm

PROMPT, NEW = 24, 32  # the longest bench prompt and the completion length of bench_rloo_step.py


def median_ms(fn, *args, n: int = 10) -> float:
    """Median wall milliseconds of n calls of fn(*args), after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def plain_params(cfg: dict, seed: int = 0) -> dict:
    """Random float32 weights with the checkpoint's shapes: embed [V, d], per layer q/k/v/o/gate/up/down, head."""
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = d // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = dict(q=(d, d), k=(d, kv), v=(d, kv), o=(d, d), gate=(d, f), up=(d, f), down=(f, d))
    rng = np.random.default_rng(seed)
    draw = lambda s: jnp.asarray(rng.normal(size=s) * 0.02, jnp.float32)  # noqa: E731
    layers = [{k: draw(s) for k, s in shapes.items()} for _ in range(cfg["num_hidden_layers"])]
    return {"embed": draw((v, d)), "layers": layers, "head": draw((d, v))}


def attention(q, k, v, heads: int, visible):
    """Softmax attention, q [B, T, H*h], k/v [B, S, K*h] (K kv heads repeated to H), visible [T, S] -> [B*T, H*h]."""
    b, t, hh = q.shape
    s, h = k.shape[1], hh // heads
    q = q.reshape(b, t, heads, h)
    k = jnp.repeat(k.reshape(b, s, -1, h), heads // (k.shape[-1] // h), axis=2)
    v = jnp.repeat(v.reshape(b, s, -1, h), heads // (v.shape[-1] // h), axis=2)
    scores = jnp.where(visible, jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(h), -1e30)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v).reshape(b * t, hh)


def mlp(x, w):
    """The gated MLP on rows x [N, d]: down(silu(gate(x)) * up(x))."""
    return (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]


def block(x, w, k, v, heads: int, visible):
    """One pre-norm-free block on rows x [B*T, d] attending to k/v [B, S, K*h] -> [B*T, d]."""
    b = k.shape[0]
    x = x + attention((x @ w["q"]).reshape(b, -1, x.shape[-1]), k, v, heads, visible) @ w["o"]
    return x + mlp(x, w)


def prefill(params: dict, ids, heads: int):
    """Causal forward over ids [B, T] (matmuls on [B*T, d] rows) -> hidden rows [B*T, d], per-layer (k, v)."""
    b, t = ids.shape
    x = params["embed"][ids.reshape(-1)]
    causal, kv = jnp.tril(jnp.ones((t, t), bool)), []
    for w in params["layers"]:
        k, v = (x @ w["k"]).reshape(b, t, -1), (x @ w["v"]).reshape(b, t, -1)
        x = block(x, w, k, v, heads, causal)
        kv.append((k, v))
    return x, kv


def plain_logps(params: dict, ids, heads: int):
    """Per-token log-probs of ids[:, 1:] under a causal forward over ids [B, T] -> [B, T-1]."""
    b, t = ids.shape
    x = prefill(params, ids, heads)[0].reshape(b, t, -1)[:, :-1]
    logp = jax.nn.log_softmax(x.reshape(b * (t - 1), -1) @ params["head"], -1).reshape(b, t - 1, -1)
    return jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]


def plain_update(params: dict, opt_state, ids, adv, heads: int, opt):
    """One policy-gradient step: loss = -mean_b(A_b * sum_t logp[b, t]) -> grads -> AdamW."""
    loss = lambda p: -jnp.mean(adv * plain_logps(p, ids, heads).sum(-1))  # noqa: E731
    grads = jax.grad(loss)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def decode_layer(x, w, k, v, pos, visible):
    """One block for one new token per row: x [B, d], cache k/v [B, K, S, h] (kv-head-major, read in place)
    gets this token's k/v at `pos` -> (x, k, v)."""
    b, (kh, h) = x.shape[0], k.shape[1::2]
    k = jax.lax.dynamic_update_slice_in_dim(k, (x @ w["k"]).reshape(b, kh, 1, h), pos, 2)
    v = jax.lax.dynamic_update_slice_in_dim(v, (x @ w["v"]).reshape(b, kh, 1, h), pos, 2)
    q = (x @ w["q"]).reshape(b, kh, -1, h)
    s = jnp.where(visible, jnp.einsum("bkgh,bksh->bkgs", q, k) / np.sqrt(h), -1e30)
    x = x + jnp.einsum("bkgs,bksh->bkgh", jax.nn.softmax(s, -1), v).reshape(b, -1) @ w["o"]
    return x + mlp(x, w), k, v


def plain_decode(params: dict, prompt, heads: int, new: int):
    """Greedy generation of `new` tokens after prompt [B, P]: prefill, then new-1 KV-cache steps -> [B, new]."""
    b, p = prompt.shape
    x, kv = prefill(params, prompt, heads)
    h = x.shape[-1] // heads
    to_cache = lambda a: jnp.pad(a.reshape(b, p, -1, h).transpose(0, 2, 1, 3),  # noqa: E731
                                 ((0, 0), (0, 0), (0, new), (0, 0)))
    cache = [(to_cache(k), to_cache(v)) for k, v in kv]
    first = jnp.argmax(x.reshape(b, p, -1)[:, -1] @ params["head"], -1)

    def step(i, carry):
        tokens, cache = carry
        x, new_cache = params["embed"][tokens[:, i - 1]], []
        visible = jnp.arange(p + new) < p + i
        for w, (k, v) in zip(params["layers"], cache, strict=True):
            x, k, v = decode_layer(x, w, k, v, p + i - 1, visible)
            new_cache.append((k, v))
        return tokens.at[:, i].set(jnp.argmax(x @ params["head"], -1)), new_cache

    tokens = jnp.zeros((b, new), jnp.int32).at[:, 0].set(first)
    return jax.lax.fori_loop(1, new, step, (tokens, cache))[0]


def step_floor(size: str, batch: int = 8) -> dict:
    """Milliseconds of the plain decode, reference forward and update for `size` (float32), and their sum."""
    cfg = common.hf_config(size)
    heads, params = cfg["num_attention_heads"], plain_params(cfg)
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(2, cfg["vocab_size"], (batch, PROMPT + NEW)), jnp.int32)
    adv = jnp.asarray(rng.normal(size=batch), jnp.float32)
    opt = optax.adamw(1e-5, weight_decay=0.0)
    decode = jax.jit(lambda p, x: plain_decode(p, x, heads, NEW))
    forward = jax.jit(lambda p, x: plain_logps(p, x, heads))
    update = jax.jit(lambda p, s, x, a: plain_update(p, s, x, a, heads, opt))
    out = {"decode_ms": median_ms(decode, params, ids[:, :PROMPT]),
           "forward_ms": median_ms(forward, params, ids),
           "update_ms": median_ms(update, params, opt.init(params), ids, adv, n=5)}
    out["step_s"] = sum(out.values()) / 1000
    return out


def forward_check(size: str, b: int, t: int) -> str:
    """Our model's forward and forward+backward at [b, t] against the bare matmul chain, one line."""
    cfg = common.hf_config(size)
    graphdef, params = nnx.split(init_causal_lm(cfg, seed=0))
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
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
    return (f"{size} [{b}, {t}]: forward {fwd:.1f} ms | bare matmul chain {floor:.1f} ms | "
            f"ratio {fwd / floor:.2f} | forward+backward {fb:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=list(common.SIZES))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=56)
    ap.add_argument("--step", action="store_true", help="time the plain-JAX RLOO step floor instead")
    ap.add_argument("--json", action="store_true", help="with --step: print one `RESULT {json}` line")
    args = ap.parse_args()
    if not args.step:
        print(forward_check(args.size, args.batch, args.tokens))
        return
    floor = step_floor(args.size, args.batch)
    if args.json:
        print("RESULT", json.dumps(floor))
    else:
        print(f"{args.size} plain-JAX step floor: decode {floor['decode_ms']:.1f} ms + forward "
              f"{floor['forward_ms']:.1f} ms + update {floor['update_ms']:.1f} ms = {floor['step_s']:.3f} s")


if __name__ == "__main__":
    main()
