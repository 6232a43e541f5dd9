"""Decoder-only transformer (the llama, phi3 and gpt_neox families of `config.py`), a causal LM head and a reward
head.

One module tree for every family: the differences are static `ModelConfig` flags (norm kind and placement, q/k
norms, MLP kind, biases, rotary fraction and per-layer tables, per-layer sliding windows, soft-capping, embedding
and attention scales, parallel residual), which keeps the weight tables in `hf.py` and the KV-cache code single.
Parameters are named (our path -> HF name in `hf.py`):

    model.embed.embedding [V, D]          ("vocab", "embed")
    model.layers.attn_norm.scale/bias     ("layers", "embed")   (unrolled: model.layers.{i}..., no "layers")
    model.layers.attn.{q,k,v,o}.kernel    q: ("layers", "embed", "heads"), k/v: (.., "embed", "kv"),
                                          o: ("layers", "heads", "embed")
    model.layers.attn.{q,k}_norm.scale    qk_norm "head": [Dh] (None); "full": [H*Dh] ("heads"), [K*Dh] ("kv")
    model.layers.attn.sinks               [H] (None)   (attention_sinks, GPT-OSS: a logit per head in the softmax)
    model.layers.post_attn_norm.scale     ("layers", "embed")   (norm_layout sandwich / post: on attn's output)
    model.layers.mlp_norm.scale/bias      ("layers", "embed")   (absent with norm_layout post, as attn_norm)
    model.layers.mlp.{gate,up,down}       gate/up: ("layers", "embed", "mlp"), down: ("layers", "mlp", "embed")
    model.layers.post_mlp_norm.scale      ("layers", "embed")   (norm_layout sandwich / post)
    model.layers.mlp.router               [D, E] ("layers", "embed", None)   (a routed layer, `MoE`, in place of
                                          the gate/up/down above); router_bias [E] (router_bias, GPT-OSS)
    model.layers.mlp.experts_{gate,up}    [E, D, F] ("layers", "expert", "embed", "mlp"); experts_down [E, F, D]
    model.layers.mlp.experts_*_bias       gate/up [E, F] ("expert", "mlp"), down [E, D] ("expert", "embed")
                                          (expert_bias, GPT-OSS)
    model.final_norm.scale/bias           ("embed",)
    lm_head.kernel [D, V]                 ("embed", "vocab")    (absent when embeddings are tied)
    score.kernel [D, 1]                   ("embed", None)       (RewardModel)
    ....{q,k,v,o,gate,up,down}.lora_a/b   A [din, r] (din's axis, "lora_rank"), B [r, dout] ("lora_rank", dout's): LoRA
    model.layers.attn.qkv_lora_a          fused query_key_value / qkv_proj: one A for q, k, v (their B apart)
    model.layers.mlp.gate_up_lora_a       Phi-3's fused gate_up_proj: one A for gate and up

With `scan_layers` (the default) the L blocks are ONE `Block` whose parameters carry a leading layer axis
[L, ...] (`stacked_blocks`, paths `model.layers.attn.q.kernel`, axes ("layers", ...)) run by `jax.lax.scan`:
compile time flat in depth. Without it they are a list (`model.layers.{i}.attn.q.kernel`), unrolled. Either way each
block runs under `jax.checkpoint` with a named `remat_policy` (see `config.REMAT_POLICIES`); the numbers are the
same, and so is the Hugging Face checkpoint (`hf.py` maps both layouts).

Shapes: B batch, T tokens, D hidden, H heads, K kv heads, Dh head dim, L layers, P prompt, C completion, G samples.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from rloo_jax import quant
from rloo_jax.mesh import (
    KV_CACHE_AXES,
    constrain,
    fit_spec,
    pin_layout,
    row_major,
    stationary_side,
)
from rloo_jax.models import attention, moe
from rloo_jax.models.attention import attend, attend_shared_prompt, visible
from rloo_jax.models.config import ModelConfig, ModelLoadError, rope_attention_factor, rope_inv_freq

__all__ = ["CausalLM", "RewardModel", "Routes", "Routing", "Transformer", "attend", "attend_shared_prompt"]


# ----------------------------------------------------------------------------------------------- pure functions
def positions_from_mask(mask: jax.Array) -> jax.Array:
    """Token positions counting only real tokens: max(cumsum(mask) - 1, 0), int32 [B, T].

    Example: mask [0, 0, 1, 1, 1] -> [0, 0, 0, 1, 2] (left padding gets position 0).
    """
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def last_token_index(mask: jax.Array) -> jax.Array:
    """Index of the last real token of each row: T - 1 - argmax(flip(mask)), int32 [B].

    Example: [[1, 1, 0], [0, 1, 1]] -> [1, 2]. Works for left and right padding, whatever the pad id.
    """
    t = mask.shape[-1]
    return (t - 1 - jnp.argmax(jnp.flip(mask.astype(jnp.int32), axis=-1), axis=-1)).astype(jnp.int32)


def left_align(ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Any padding -> left padding, real tokens kept in order (a stable sort of each row by its mask).

    Example: ids [[5, 6, 0]], mask [[1, 1, 0]] -> [[0, 5, 6]], [[0, 1, 1]].
    """
    order = jnp.argsort(mask.astype(jnp.int32), axis=1, stable=True)
    return jnp.take_along_axis(ids, order, axis=1), jnp.take_along_axis(mask, order, axis=1)


def fit_prompt_routes(routes: jax.Array, width: int) -> jax.Array:
    """Routes of left-aligned prompts [B, P', ...] (real tokens last) at another width P: right-aligned, cut or
    padded on the left with -1 (no record). Example: [[a, b, c]] at width 2 -> [[b, c]]; at 4 -> [[-1, a, b, c]]."""
    have = routes.shape[1]
    if have >= width:
        return routes[:, have - width:]
    pad = [(0, 0)] * routes.ndim
    pad[1] = (width - have, 0)
    return jnp.pad(routes, pad, constant_values=-1)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables for rotate-half RoPE, float32 [..., R]: angle = pos * concat(inv_freq, inv_freq), both tables
    times `scale` (LongRoPE's attention factor; 1 otherwise)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if scale == 1.0:
        return jnp.cos(emb), jnp.sin(emb)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """Soft-capping (Gemma 2): cap * tanh(x / cap), identity for cap None. E.g. cap 30: 30 -> 22.85, 1 -> 0.9996."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def pick(stacked: jax.Array, table: tuple[int, ...], layer: Any) -> jax.Array:
    """stacked[table[layer]]: a layer's entry of a per-kind stack [K, ...] (statically when `layer` is a Python int
    or every layer has the same kind; an index under `scan`)."""
    if len(set(table)) == 1:
        return stacked[table[0]]
    if isinstance(layer, int):
        return stacked[table[layer]]
    return stacked[jnp.asarray(table, jnp.int32)[layer]]


def switch(layer: Any, table: tuple[int, ...], fns: list[Callable], *args: Any) -> Any:
    """fns[table[layer]](*args): a layer's own attention (e.g. its sliding window), picked statically where `layer`
    is known, else by `lax.switch` (one branch runs; every branch is compiled)."""
    if len(fns) == 1:
        return fns[0](*args)
    if isinstance(layer, int):
        return fns[table[layer]](*args)
    return jax.lax.switch(jnp.asarray(table, jnp.int32)[layer], fns, *args)


def kv_cache_layout(cache: jax.Array) -> jax.Array:
    """Inside a jit: a generated-token KV cache [L, N, K, C, Dh] pinned to a memory layout a decode step's attention
    dots read in place, laid out over the context mesh (`KV_CACHE_AXES`). Left free, the TPU compiler lays the key
    cache out [.., C, K, Dh] (the tiling its RoPE'd one-slot update prefers), and the dots then copy a layer's slice
    first: one more copy of the key cache per decode step (BENCHMARKS.md, Session 3). Row-major (Dh minor) where Dh
    fills a TPU's 128-lane tiles, and off the TPU; a TPU's head dimension that is not a multiple of 128 goes second
    minor, the slots minor ([.., Dh, C] in memory): row-major, each slot of a 64-wide head (gpt-oss-20b, Llama-3.2)
    would take 128 lanes, twice the bytes a step reads. Slots minor, the step's one-slot write rewrites the tiles
    of 128 slots around it (1/8 of a 1,024-slot cache's bytes); packing two heads into a tile's 128 lanes would
    avoid that too, at twice the decode's attention FLOPs (BENCHMARKS.md, Session 23)."""
    dims = tuple(range(cache.ndim))
    if cache.shape[-1] % 128 and attention.target_platform() == "tpu":
        dims = (*dims[:-2], dims[-1], dims[-2])
    return pin_layout(cache, KV_CACHE_AXES, dims)


def _sink_args(sinks: jax.Array | None) -> tuple[jax.Array, ...]:
    """A layer's attention sinks as the trailing argument of an attention function (`attention.causal`), none
    without them (a model without sinks builds functions of q, k, v only)."""
    return () if sinks is None else (sinks,)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first R = cos.shape[-1] dims of each head (HF `rotate_half` convention), rest passes through.

    x [B, T, N, Dh]; cos, sin [B, T, R]. x_rot * cos + rotate_half(x_rot) * sin, rotate_half(a, b) = (-b, a).
    """
    r = cos.shape[-1]
    xr = x[..., :r].astype(jnp.float32)
    x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    out = (xr * cos[:, :, None, :] + rot * sin[:, :, None, :]).astype(x.dtype)
    return out if r == x.shape[-1] else jnp.concatenate([out, x[..., r:]], axis=-1)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """HF `ACT2FN` names we support -> jax function."""
    table = {
        "silu": jax.nn.silu,
        "swish": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_fast": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
    }
    if name not in table:
        raise ModelLoadError(f"hidden_act {name!r} is not supported; supported: {', '.join(sorted(table))}")
    return table[name]


# ----------------------------------------------------------------------------------------------- caches
@flax.struct.dataclass
class PromptCache:
    """Keys/values of B prompts, computed once by `prefill` and shared by their G samples."""

    k: jax.Array  # [L, B, K, P, Dh] (after RoPE; kv-head-major)
    v: jax.Array  # [L, B, K, P, Dh]
    mask: jax.Array  # [B, P] int32, 1 at real prompt tokens
    lengths: jax.Array  # [B] int32, real prompt tokens = position of the first generated token
    routes: jax.Array | None = None  # [L, B, P, K] the prompt tokens' experts (a mixture of experts), else None


@flax.struct.dataclass
class DecodeCache:
    """Prompt cache at batch B plus the generated keys/values of the B*G rows (row r samples prompt r // G)."""

    prompt: PromptCache
    k: jax.Array  # [L, B*G, K, C, Dh] (kv-head-major: slot s of head k is [l, r, k, s])
    v: jax.Array  # [L, B*G, K, C, Dh]
    # [L, B*G, C, K] the experts of the token fed at each slot (-1 until it is; -1 in a dense layer) with experts,
    # else None
    routes: jax.Array | None = None


ROUTE_DTYPE = jnp.int16  # expert ids as routes are kept (-1: none recorded)


@flax.struct.dataclass
class Routes:
    """Each token's experts in every layer, rows first (as a rollout keeps its arrays): the sampler's, replayed by
    the training forwards (routing replay). Expert ids, -1 where none was recorded (a dense layer, a token the
    sampler never fed: the router then chooses)."""

    prompt: jax.Array  # [B, P, L, K] of the prompts left-aligned (real tokens last; any width, right-aligned)
    completion: jax.Array  # [N, C, L, K], row r continuing prompt r // G


@flax.struct.dataclass
class Routing:
    """What the routers of one forward did, per layer (stacked [L, ...]): `experts` [L, B, T, K] the experts each
    token was routed to (-1 in a dense layer); with token weights (training forwards) the load-balancing statistics
    `counts`, `probs` [L, E] (`moe.load_balancing_stats`; zeros in a dense layer) and `chosen` [L, B, T, K] the
    router's own top-K (what it routes without replay; -1 in a dense layer), else None."""

    experts: jax.Array
    counts: jax.Array | None = None
    probs: jax.Array | None = None
    chosen: jax.Array | None = None


# ----------------------------------------------------------------------------------------------- modules
def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    # eager_sharding=False: names are metadata for a later mesh rule table, no mesh is needed to build.
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class LoRAParam(nnx.Param):
    """A low-rank adapter weight (`lora_a` [din, r], `lora_b` [r, dout]): a `Param` of its own type, so the adapters
    split from the frozen base with `nnx.split(model, LoRAParam, nnx.Param)`."""


def _logical(v: nnx.Variable, ndim: int) -> tuple[str | None, ...]:
    """A parameter's logical axis names, the trailing `ndim` of them: a stacked parameter's slice inside the layer
    scan has lost the leading "layers"."""
    return tuple(v.get_metadata().get("out_sharding") or (None,) * ndim)[-ndim:]


def _unsharded_embed(v: nnx.Variable) -> jax.Array:
    """A parameter's value laid out with its `embed` axis whole (gathered over fsdp) and its other axes as the rule
    table splits them, on the mesh traced on (a no-op without one)."""
    x = v[...]
    return constrain(x, tuple(None if a == "embed" else a for a in _logical(v, x.ndim)))


def _codes(v: nnx.Variable, wide: bool) -> jax.Array:
    """A 4-bit weight's codes [K, din/K, dout] as the matmul reads them, gathered over fsdp (`_unsharded_embed`).

    Traced for a TPU, the layer's slice is read in the stored layout and, in a `wide` product (several positions
    per row: a prefill, a log-prob or training forward), relayouted after the gather to [din/K, K, dout] (the
    kernel's row order, which the TPU compiler's matmul over many rows asks for; a decode step's takes the stored
    one). Left free, the compiler met that request in the log-prob passes (a loop over micro-batches around the
    layers' scan) by relayouting the whole stacked [L, ...] codes before the loop, where the copy lived through
    the decode loop: 2.1 GB per chip of Llama-3.1-70B on a v5e-16 (BENCHMARKS.md, Session 11). Here it costs one
    layer's codes at a time."""
    if attention.target_platform() != "tpu":
        return _unsharded_embed(v)
    x = v[...]
    axes = _logical(v, x.ndim)
    gathered = tuple(None if a == "embed" else a for a in axes)
    x = constrain(row_major(x, axes), gathered)
    return pin_layout(x, gathered, (1, 0, 2)) if wide else x


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout: x * keep / (1 - rate), keep ~ Bernoulli(1 - rate); identity without a key or rate."""
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def stationary_matmul(x: jax.Array, w: jax.Array, axes: tuple[str | None, str | None], side: int,
                      transposed: bool = False) -> jax.Array:
    """x [rows, din] @ w [din, dout] -> [rows, dout] float32 on the context mesh with w left where it lies, split
    over fsdp on `side` (`mesh.stationary_side`; logical `axes` of din and dout), and the rows moved to it: a decode
    step's few rows, where gathering the layer's weights at every step moves far more (Llama-3.1-8B's 436 MB a
    layer, bf16; gpt-oss-20b's 1.16 GB LM head). `transposed`: w is stored [dout, din] (a tied embedding as the
    LM head), contracted as it lies.
    - side 0 (din: q, k, v, gate, up): the rows' hidden units exchanged (an all-to-all: each device gets its din / n
      of all its data shard's rows), multiplied by its slice, the float32 partial sums reduce-scattered back into
      each device's rows;
    - side 1 (dout: o, down): the data shard's rows gathered, multiplied by the device's dout / n columns (summed
      over tensor where din is split there), the float32 columns exchanged back (an all-to-all).
    The same sums as `quant.blocked_matmul` in another order (the partial sums over fsdp)."""
    mesh = jax.sharding.get_abstract_mesh()
    rows = fit_spec(("batch",), (x.shape[0],), mesh)[0]
    w_spec = fit_spec(axes, w.shape[::-1] if transposed else w.shape, mesh)
    other = (*w_spec, None, None)[1 - side]  # the weight's other side: tensor or whole
    dims = "td,vd->tv" if transposed else "td,dv->tv"

    def dot(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum(dims, x, w, preferred_element_type=jnp.float32)

    if side == 0:
        def local(x: jax.Array, w: jax.Array) -> jax.Array:
            x = jax.lax.all_to_all(x, "fsdp", 1, 0, tiled=True)  # [r / n, din] -> [r, din / n]
            return jax.lax.psum_scatter(dot(x, w), "fsdp", scatter_dimension=0, tiled=True)

        w_in, out = ("fsdp", other), P(rows, other)
    else:
        def local(x: jax.Array, w: jax.Array) -> jax.Array:
            x = jax.lax.all_gather(x, "fsdp", axis=0, tiled=True)  # [r / n, din] -> [r, din]
            y = dot(x, w)
            y = y if other is None else jax.lax.psum(y, other)
            return jax.lax.all_to_all(y, "fsdp", 0, 1, tiled=True)  # [r, dout / n] -> [r / n, dout]

        w_in, out = (other, "fsdp"), P(rows, None)
    in_x = P(rows, None) if side == 0 else P(rows, other)
    specs = (in_x, P(*(w_in[::-1] if transposed else w_in)))
    return jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=out)(x, w)


class Dense(nnx.Module):
    """y = x @ kernel (+ bias) (+ scale * dropout(x) @ lora_a @ lora_b); weights in param dtype, math in the
    compute dtype. `lora` "ab": this layer's own adapter; "b": only B, its A shared with sibling layers (the
    caller passes `lora_x = dropout(x) @ A`, as GPT-NeoX's fused q/k/v); "": none. `quantize` (the blocks'
    projections) with `cfg.quant`: the kernel is stored as `qkernel` codes and `qscale` (+ `qscale2`) scales and
    dequantized to the compute dtype at every call (`rloo_jax.quant`)."""

    def __init__(
        self,
        din: int,
        dout: int,
        axes: tuple[str | None, str | None],
        bias: bool,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        name: str | None = None,
        lora: str = "",
        quantize: bool = False,
    ) -> None:
        pdt = jnp.dtype(cfg.param_dtype)
        w = jax.random.normal(rngs.params(), (din, dout), jnp.float32) * cfg.initializer_range
        # QLoRA's frozen base: the kernel as quantized codes and scales (`rloo_jax.quant`), the same draw quantized
        self.quant = cfg.quant if quantize else None
        stored = {"kernel": w.astype(pdt)} if self.quant is None else quant.quantize(w.astype(pdt), self.quant)
        logical = {"kernel": axes} if self.quant is None else quant.stored_axes(axes, self.quant)
        self.kernel = _param(stored["kernel"], axes) if self.quant is None else None
        self.qkernel, self.qscale, self.qscale2 = (
            _param(stored[n], logical[n]) if n in stored else None for n in ("codes", "scale", "scale2"))
        self.bias = _param(jnp.zeros((dout,), pdt), (axes[1],)) if bias else None
        self.dtype = jnp.dtype(cfg.dtype)
        self.axes = axes
        self.name = name  # the output's `checkpoint_name`, which remat policies select by
        # adapters start at zero (no randomness drawn: the base's initial values do not depend on them);
        # `models.lora.init_adapters` draws A. The rank axis ("lora_rank") splits over fsdp where the other axis
        # does not (an A on a 28672-wide MLP input, a B onto the heads): replicated, the adapters of Llama-3.1-70B
        # and their AdamW moments took 6.2 GiB of every chip of a v5e-16 (BENCHMARKS.md, Session 7).
        r = cfg.lora.rank if cfg.lora is not None and lora else 0
        self.lora_a = LoRAParam(jnp.zeros((din, r), pdt), out_sharding=(axes[0], "lora_rank"), eager_sharding=False) \
            if "a" in lora and r else None
        self.lora_b = LoRAParam(jnp.zeros((r, dout), pdt), out_sharding=("lora_rank", axes[1]), eager_sharding=False) \
            if r else None
        self.lora_scale = cfg.lora.scale if r else 0.0
        self.lora_dropout = cfg.lora.dropout if r else 0.0

    def weight(self, wide: bool = False) -> jax.Array:
        """The kernel in the compute dtype: [din, dout], or dequantized from its codes ([K, din/K, dout] for 4-bit,
        `quant.blocked_matmul` takes either). Codes and scales are gathered whole over fsdp first: left to itself
        the partitioner dequantized the shards and gathered the bf16 weight, 4x the bytes over ICI (BENCHMARKS.md).
        `wide`: the product has several positions per row (`_codes`)."""
        if self.quant is None:
            return self.kernel[...].astype(self.dtype)
        stored = {n: _codes(v, wide) if n == "codes" and self.quant.bits == 4 else _unsharded_embed(v)
                  for n, v in (("codes", self.qkernel), ("scale", self.qscale), ("scale2", self.qscale2))
                  if v is not None}
        return quant.dequantize(stored, self.quant, self.dtype)

    def lora_input(self, x: jax.Array, a: nnx.Param, key: jax.Array | None) -> jax.Array:
        """dropout(x) @ A in the compute dtype: [..., din] -> [N, r] (leading dims flattened)."""
        x = dropout(x.reshape(-1, x.shape[-1]).astype(self.dtype), self.lora_dropout, key)
        return jnp.dot(x, a[...].astype(self.dtype), preferred_element_type=jnp.float32).astype(self.dtype)

    def __call__(self, x: jax.Array, key: jax.Array | None = None, lora_x: jax.Array | None = None) -> jax.Array:
        # f32 accumulation, rounded once to the compute dtype (a no-op for f32). XLA:CPU runs a bf16 x bf16 -> f32
        # dot natively; a bf16-output dot it widens to f32 with a convert of both operands first.
        # Leading dims flattened: [B, T, din] -> [B*T, din], so the weight gradient contracts one token axis
        # (a 3-D dot made XLA:CPU transpose the activations for it; -12% fwd+bwd time on the MLP, BENCHMARKS.md).
        w = self.weight(wide=x.ndim > 2 and x.shape[-2] > 1)
        flat = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        # a decode step's few rows move to the weight's shards (`stationary_matmul`); 4-bit codes are gathered
        side = None if self.quant is not None else stationary_side(flat.shape[0], w.shape, self.axes,
                                                                   self.dtype.itemsize)
        y = quant.blocked_matmul(flat, w) if side is None else stationary_matmul(flat, w, self.axes, side)
        y = y if self.bias is None else y + self.bias[...].astype(jnp.float32)
        if self.lora_b is not None:
            h = self.lora_input(x, self.lora_a, key) if lora_x is None else lora_x
            b = self.lora_b[...].astype(self.dtype)
            y = y + self.lora_scale * jnp.dot(h, b, preferred_element_type=jnp.float32)
        y = y.astype(self.dtype).reshape(*x.shape[:-1], w.shape[-1])
        return y if self.name is None else checkpoint_name(y, self.name)


class Embedding(nnx.Module):
    """Token embedding table [V, D]; lookup returns the compute dtype (Gemma: times sqrt(D) rounded to it, as HF
    multiplies by `embed_scale` in the weights' dtype)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        w = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size), jnp.float32) * cfg.initializer_range
        self.embedding = _param(w.astype(jnp.dtype(cfg.param_dtype)), ("vocab", "embed"))
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = float(cfg.hidden_size**0.5) if cfg.embed_scale else None

    def __call__(self, ids: jax.Array) -> jax.Array:
        x = jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)
        return x if self.scale is None else x * jnp.asarray(self.scale, self.dtype)


class Norm(nnx.Module):
    """RMSNorm (llama: x / rms(x) * (offset + scale), offset 1 for Gemma's stored weights, else 0) or LayerNorm
    (gpt_neox: (x - mean) / std * scale + bias), in f32, over the last axis of size `dim` (default D)."""

    def __init__(self, cfg: ModelConfig, dim: int | None = None, axis: str | None = "embed") -> None:
        pdt, dim = jnp.dtype(cfg.param_dtype), dim or cfg.hidden_size
        self.offset = cfg.norm_offset
        self.scale = _param(jnp.full((dim,), 1.0 - cfg.norm_offset, pdt), (axis,))  # unit gain at init
        self.bias = _param(jnp.zeros((dim,), pdt), (axis,)) if cfg.family == "gpt_neox" else None
        self.eps = cfg.norm_eps
        self.dtype = jnp.dtype(cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if self.bias is None:
            y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
            w = self.scale[...].astype(jnp.float32)
            y = y * (w if self.offset == 0.0 else self.offset + w)
        else:
            mu = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
            y = (x - mu) * jax.lax.rsqrt(var + self.eps)
            y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(self.dtype)


def _lora(cfg: ModelConfig, name: str) -> str:
    """Which adapter weights projection `name` holds (see `Dense`)."""
    if cfg.lora is None:
        return ""
    ours = cfg.lora.modules
    if (name in ("q", "k", "v") and "qkv" in ours) or (name in ("gate", "up") and "gate_up" in ours):
        return "b"  # a fused projection's part: B only, A shared (`Attention.qkv_lora_a`, `MLP.gate_up_lora_a`)
    return "ab" if name in ours else ""


def _shared_a(cfg: ModelConfig, din: int, fused: bool) -> LoRAParam | None:
    """The one A [din, r] of a fused projection's adapter (None without one)."""
    if not fused:
        return None
    return LoRAParam(jnp.zeros((din, cfg.lora.rank), jnp.dtype(cfg.param_dtype)), out_sharding=("embed", "lora_rank"),
                     eager_sharding=False)


def _keys(key: jax.Array | None, n: int) -> list[jax.Array | None]:
    """n independent dropout keys (fold_in 0..n-1), or n Nones."""
    return [None] * n if key is None else [jax.random.fold_in(key, i) for i in range(n)]


class Attention(nnx.Module):
    """q/k/v/o projections (and q/k norms); the attention itself is a function passed in (full sequence or cached
    decode)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q = Dense(d, h * dh, ("embed", "heads"), cfg.qkv_bias, cfg, rngs, "query_proj", _lora(cfg, "q"), True)
        self.k = Dense(d, k * dh, ("embed", "kv"), cfg.qkv_bias, cfg, rngs, "key_proj", _lora(cfg, "k"), True)
        self.v = Dense(d, k * dh, ("embed", "kv"), cfg.qkv_bias, cfg, rngs, "value_proj", _lora(cfg, "v"), True)
        self.o = Dense(h * dh, d, ("heads", "embed"), cfg.o_bias, cfg, rngs, "out_proj", _lora(cfg, "o"), True)
        # fused query_key_value / qkv_proj: one A for q, k and v
        self.qkv_lora_a = _shared_a(cfg, d, _lora(cfg, "q") == "b")
        # q/k RMSNorms before RoPE: per head over Dh (Qwen3, Gemma 3) or over the whole projection (OLMo 2)
        self.qk_norm = cfg.qk_norm
        head = cfg.qk_norm == "head"
        self.q_norm = Norm(cfg, dh if head else h * dh, None if head else "heads") if cfg.qk_norm else None
        self.k_norm = Norm(cfg, dh if head else k * dh, None if head else "kv") if cfg.qk_norm else None
        # GPT-OSS: each head's sink logit, normal(0, initializer_range) as transformers draws it
        self.sinks = _param((jax.random.normal(rngs.params(), (h,), jnp.float32) * cfg.initializer_range).astype(
            jnp.dtype(cfg.param_dtype)), (None,)) if cfg.attention_sinks else None
        self.shape = (h, k, dh)

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, fn: Callable, key: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """x [B, T, D] -> (out [B, T, D], aux); fn(q [B,T,H,Dh], k, v [B,T,K,Dh]) -> (o [B,T,H,Dh], aux), with
        attention sinks fn(q, k, v, sinks [H] float32). `key`: the adapters' dropout key (training forwards with
        LoRA dropout only)."""
        b, t, _ = x.shape
        h, kh, dh = self.shape
        kq, kk, kv, ko = _keys(key, 4)
        xa = None if self.qkv_lora_a is None else self.q.lora_input(x, self.qkv_lora_a, kq)
        q, k = self.q(x, kq, xa), self.k(x, kk, xa)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.reshape(b, t, h, dh), k.reshape(b, t, kh, dh)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v(x, kv, xa).reshape(b, t, kh, dh)
        o, aux = fn(q, k, v) if self.sinks is None else fn(q, k, v, self.sinks[...].astype(jnp.float32))
        return self.o(o.reshape(b, t, h * dh), ko), aux


class MLP(nnx.Module):
    """llama, phi3: down(act(gate(x)) * up(x)) (gated); gpt_neox: down(act(up(x)))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        gated = cfg.gated_mlp
        self.gate = Dense(d, f, ("embed", "mlp"), bias, cfg, rngs, "mlpwi", _lora(cfg, "gate"), True) if gated else None
        self.up = Dense(d, f, ("embed", "mlp"), bias, cfg, rngs, "mlpwi", _lora(cfg, "up"), True)
        self.down = Dense(f, d, ("mlp", "embed"), bias, cfg, rngs, "mlpwo", _lora(cfg, "down"), True)
        self.gate_up_lora_a = _shared_a(cfg, d, _lora(cfg, "up") == "b")  # Phi-3's gate_up_proj: one A
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        # The activation in f32, rounded once (as torch's fused CPU/GPU kernels do): XLA:CPU emulates bf16
        # elementwise math op by op with a convert around each, which made this the slowest op of a bf16 decode.
        act, f32 = activation(self.act), jnp.float32
        kg, ku, kd = _keys(key, 3)
        xa = None if self.gate_up_lora_a is None else self.up.lora_input(x, self.gate_up_lora_a, kg)
        up = self.up(x, ku, xa).astype(f32)
        h = act(up) if self.gate is None else act(self.gate(x, kg, xa).astype(f32)) * up
        return self.down(h.astype(x.dtype), kd)


class MoE(nnx.Module):
    """A routed MLP (Qwen3-MoE's sparse block): the router [D, E] and E gated expert MLPs, gate / up [E, D, F], down
    [E, F, D] (`moe.py` has the math). GPT-OSS's (`router_bias`, `expert_bias`, `router_topk_softmax`,
    `swiglu_limit`): a router bias [E], expert biases gate / up [E, F] and down [E, D] (zero at init, as
    transformers), the top-k logits' softmax, the clamped SwiGLU.

    LoRA on the experts (`LoRASpec.experts`, peft's `target_parameters`): per expert e, W_e + scale * A_e B_e, as
    peft's `ParamWrapper`. transformers' fused gate_up_proj is one adapter: A [E, D, r] shared by gate and up
    (`experts_gate_up_lora_a`), its B [E, r, 2F] split into gate's and up's [E, r, F]; down_proj: A [E, F, r],
    B [E, r, D]. Without expert targets (peft's all-linear too) the experts have none.
    QLoRA (`config.quant`): the experts stored quantized as a `Dense` kernel is, expert by expert (each [din, dout]
    slice quantized alone: `quant.quantize` passes the leading expert axis through), as codes / scales
    `experts_*_codes`, `experts_*_scale` (+ `_scale2`), dequantized to the compute dtype in the layer before its
    grouped matmuls (a transient of one layer's experts). bitsandbytes leaves fused 3-D expert parameters alone."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        pdt = jnp.dtype(cfg.param_dtype)
        draw = lambda shape: (jax.random.normal(rngs.params(), shape, jnp.float32)  # noqa: E731
                              * cfg.initializer_range).astype(pdt)
        self.router = _param(draw((d, e)), ("embed", None))
        self.quant = cfg.quant
        self.moe_width = f
        gate, up, down = draw((e, d, f)), draw((e, d, f)), draw((e, f, d))
        self.experts_gate, self.experts_gate_codes, self.experts_gate_scale, self.experts_gate_scale2 = \
            _experts(gate, ("embed", "mlp"), self.quant)
        self.experts_up, self.experts_up_codes, self.experts_up_scale, self.experts_up_scale2 = \
            _experts(up, ("embed", "mlp"), self.quant)
        self.experts_down, self.experts_down_codes, self.experts_down_scale, self.experts_down_scale2 = \
            _experts(down, ("mlp", "embed"), self.quant)
        r = cfg.lora.rank if cfg.lora is not None else 0
        on = cfg.lora.experts if r else frozenset()
        self.experts_gate_up_lora_a = _expert_lora((e, d, r), ("embed", "lora_rank"), pdt, "gate_up" in on)
        self.experts_gate_lora_b = _expert_lora((e, r, f), ("lora_rank", "mlp"), pdt, "gate_up" in on)
        self.experts_up_lora_b = _expert_lora((e, r, f), ("lora_rank", "mlp"), pdt, "gate_up" in on)
        self.experts_down_lora_a = _expert_lora((e, f, r), ("mlp", "lora_rank"), pdt, "down" in on)
        self.experts_down_lora_b = _expert_lora((e, r, d), ("lora_rank", "embed"), pdt, "down" in on)
        self.lora_scale = cfg.lora.scale if on else 0.0
        self.router_bias = _param(draw((e,)), (None,)) if cfg.router_bias else None
        zeros = lambda shape, axes: _param(jnp.zeros(shape, pdt), axes)  # noqa: E731
        self.experts_gate_bias = zeros((e, f), ("expert", "mlp")) if cfg.expert_bias else None
        self.experts_up_bias = zeros((e, f), ("expert", "mlp")) if cfg.expert_bias else None
        self.experts_down_bias = zeros((e, d), ("expert", "embed")) if cfg.expert_bias else None
        self.swiglu = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)
        self.topk_softmax = cfg.router_topk_softmax
        self.k, self.norm_topk, self.replay = cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.routing_replay
        self.dtype = jnp.dtype(cfg.dtype)
        self.implementation = cfg.moe_implementation  # None: the best for the platform compiled for

    def __call__(self, x: jax.Array, route: jax.Array | None = None, weights: jax.Array | None = None,
                 layer: jax.Array | None = None) -> tuple[jax.Array, Routing]:
        """x [B, T, D] -> (y [B, T, D], this layer's `Routing` without the layer axis).

        `route` [B, T, K]: recorded experts (-1: none). With `routing_replay` a token with a record is routed to
        those experts, their gate weights from the current router logits (`moe.gate_weights`); else, and for a
        token without one, the router chooses (`moe.route`). `weights` [B, T]: token weights for the load-balancing
        statistics, computed only then. `layer`: this module holds every layer's experts ([L, E, ...]: the
        sampler's scan passes the stack whole, `Transformer.run_layers`) and runs layer `layer`'s."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        # router logits in the compute dtype with float32 accumulation (HF: F.linear in the hidden states' dtype)
        logits = jnp.dot(flat.astype(self.dtype), self.router[...].astype(self.dtype),
                         preferred_element_type=jnp.float32)
        if self.router_bias is not None:
            logits = logits + self.router_bias[...].astype(jnp.float32)
        logits = logits.astype(self.dtype)
        experts, gate_w = moe.route(logits, self.k, self.norm_topk, self.topk_softmax)
        chosen = experts
        if route is not None and self.replay:
            recorded = route.reshape(b * t, -1).astype(jnp.int32)
            experts = jnp.where(recorded[:, :1] >= 0, recorded, experts)
            gate_w = moe.gate_weights(logits, experts, self.norm_topk, self.topk_softmax)
        # HF rounds the gate weights to the hidden states' dtype before weighting the experts' outputs
        gate_w = gate_w.astype(self.dtype)
        # at trace time, for the platform compiled for (the run config checked availability)
        implementation = self.implementation or moe.resolve(None, attention.target_platform())
        biases = None if self.experts_gate_bias is None else tuple(
            v[...] for v in (self.experts_gate_bias, self.experts_up_bias, self.experts_down_bias))
        moves = None if self.quant is None else self.rows_move(b, t)
        y = moe.experts_apply_sharded(x, experts.reshape(b, t, -1), gate_w.reshape(b, t, -1),
                                      *(self.expert_weight(n, gathered=not moves) for n in ("gate", "up", "down")),
                                      self.dtype, biases=biases, swiglu=self.swiglu, lora=self.expert_adapters(),
                                      lora_scale=self.lora_scale, implementation=implementation, layer=layer,
                                      moves=moves)
        routing = Routing(experts=experts.reshape(b, t, -1))
        if weights is not None:
            counts, probs = moe.load_balancing_stats(logits, weights.reshape(-1), self.k)
            routing = routing.replace(counts=counts, probs=probs, chosen=chosen.reshape(b, t, -1))
        return checkpoint_name(y.astype(self.dtype).reshape(b, t, d), "mlpwo"), routing

    def rows_move(self, rows: int, tokens: int) -> bool:
        """Quantized experts: whether x [rows, tokens, D]'s rows move to them (`moe.moving_rows`, at their codes'
        and scales' bytes a weight, as `efficiency.Transformer.expert_bytes` counts them) where their codes' blocks
        split over fsdp as D does: each device then dequantizes its own slice, and no codes are gathered."""
        (e, d), f = self.router.shape[::-1], self.moe_width
        stored = sum(quant.stored_bytes(i, o, self.quant) for i, o in ((d, f), (d, f), (f, d))) / (3 * d * f)
        mesh = jax.sharding.get_abstract_mesh()
        fsdp = 1 if mesh.empty else mesh.shape.get("fsdp", 1)
        # gate's and up's codes [E, (K,) D (/ K), F]: D's blocks; down's [E, (K,) F (/ K), D]: D
        codes = ((self.experts_gate_codes, -2), (self.experts_up_codes, -2), (self.experts_down_codes, -1))
        blocks = all(v[...].shape[i] % fsdp == 0 for v, i in codes)
        return blocks and moe.moving_rows(rows, tokens, self.k, (e, d, f), stored)

    def expert_weight(self, name: str, gathered: bool = True) -> jax.Array:
        """The experts' weights `name` (gate, up, down): [E, din, dout], as stored, or dequantized from their codes
        into the compute dtype (QLoRA; this layer's alone, under the layer scan); `gathered` False: each device
        dequantizes the codes it holds (the rows move to the experts, `moe.moving_rows`)."""
        if self.quant is None:
            return getattr(self, f"experts_{name}")[...]
        # the codes and scales gathered over fsdp before dequantizing, as `Dense.weight` does (left to itself the
        # partitioner dequantized a kernel's shards and gathered the bf16 weight: 4x the bytes)
        place = _unsharded_embed if gathered else (lambda v: v[...])
        stored = {n: place(v) for n in ("codes", "scale", "scale2")
                  if (v := getattr(self, f"experts_{name}_{n}")) is not None}
        w = quant.dequantize(stored, self.quant, self.dtype)
        return w if self.quant.kind == "int8" else quant.unblock(w)

    def expert_adapters(self) -> tuple | None:
        """The experts' adapters as `moe.experts_apply` takes them: ((A, B) or None for gate, up, down), gate and up
        sharing gate_up_proj's A; None without any."""
        if self.experts_gate_up_lora_a is None and self.experts_down_lora_a is None:
            return None
        pair = lambda a, b: None if a is None else (a[...], b[...])  # noqa: E731
        a = self.experts_gate_up_lora_a
        return (pair(a, self.experts_gate_lora_b), pair(a, self.experts_up_lora_b),
                pair(self.experts_down_lora_a, self.experts_down_lora_b))


def _experts(w: jax.Array, axes: tuple[str, str], spec: quant.QuantSpec | None) -> tuple[nnx.Param | None, ...]:
    """Expert weights w [E, din, dout] with logical axes ("expert", *axes) as `MoE` holds them: (w, None, None, None)
    unquantized, else (None, codes, scale, scale2 or None), each expert quantized alone (`quant.quantize`; 4-bit:
    blocks of 64 rows of din within one output column of one expert, codes [E, K, din/K, dout])."""
    if spec is None:
        return _param(w, ("expert", *axes)), None, None, None
    stored, logical = quant.quantize(w, spec), quant.stored_axes(axes, spec)
    return (None, *(_param(stored[n], ("expert", *logical[n])) if n in stored else None
                    for n in ("codes", "scale", "scale2")))


def _expert_lora(shape: tuple[int, int, int], axes: tuple[str, str], pdt: Any, on: bool) -> LoRAParam | None:
    """A per-expert adapter weight [E, ., .] (zeros; `models.lora.init_adapters` draws A), None when `on` is
    False. Logical axes ("expert", *axes): expert-parallel as the experts, the rank over fsdp where it fits."""
    if not on:
        return None
    return LoRAParam(jnp.zeros(shape, pdt), out_sharding=("expert", *axes), eager_sharding=False)


def dense_routing(x: jax.Array, cfg: ModelConfig, with_stats: bool) -> Routing:
    """A dense layer's `Routing` in a model with routed layers (x [B, T, D]): experts -1, zero statistics."""
    b, t, _ = x.shape
    experts = jnp.full((b, t, cfg.num_experts_per_tok), -1, jnp.int32)
    if not with_stats:
        return Routing(experts=experts)
    zeros = jnp.zeros((cfg.num_experts,), jnp.float32)
    return Routing(experts=experts, counts=zeros, probs=zeros, chosen=experts)


class Block(nnx.Module):
    """A residual block; `norm_layout` pre: x += attn(n1(x)); x += mlp(n2(x)) (parallel: x += attn(n1(x)) +
    mlp(n2(x))); sandwich (Gemma): x += n3(attn(n1(x))); x += n4(mlp(n2(x))); post (OLMo 2): x += n3(attn(x));
    x += n4(mlp(x)). `sparse`: the MLP is routed (`MoE`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False) -> None:
        pre, post = cfg.norm_layout != "post", cfg.norm_layout != "pre"
        self.attn_norm = Norm(cfg) if pre else None
        self.attn = Attention(cfg, rngs)
        self.post_attn_norm = Norm(cfg) if post else None
        self.mlp_norm = Norm(cfg) if pre else None
        self.mlp = MoE(cfg, rngs) if sparse else MLP(cfg, rngs)
        self.post_mlp_norm = Norm(cfg) if post else None
        self.parallel = cfg.parallel_residual
        self.config = cfg

    def __call__(
        self, x: jax.Array, cos: jax.Array, sin: jax.Array, fn: Callable, key: jax.Array | None = None,
        route: jax.Array | None = None, weights: jax.Array | None = None, layer: jax.Array | None = None,
    ) -> tuple[jax.Array, Any, Routing | None]:
        """-> (x, the attention function's aux, this layer's `Routing`: None in a model without experts). `route`,
        `weights`, `layer`: see `MoE.__call__` (unused by a dense MLP)."""
        ka, km = _keys(key, 2)
        norm = lambda n, y: y if n is None else n(y)  # noqa: E731
        a, aux = self.attn(norm(self.attn_norm, x), cos, sin, fn, ka)

        def mlp(h: jax.Array) -> tuple[jax.Array, Routing | None]:
            if isinstance(self.mlp, MoE):
                return self.mlp(h, route, weights, layer)
            routing = dense_routing(h, self.config, weights is not None) if self.config.is_moe else None
            return self.mlp(h, km), routing

        if self.parallel:
            m, routing = mlp(self.mlp_norm(x))
            return x + a + m, aux, routing
        x = x + norm(self.post_attn_norm, a)
        m, routing = mlp(norm(self.mlp_norm, x))
        return x + norm(self.post_mlp_norm, m), aux, routing


def stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
    """L blocks as ONE `Block` whose parameters have a leading layer axis: kernel [L, din, dout], logical axes
    ("layers", ...). Initialised block by block in order, so the values equal L separately built blocks'. Every
    layer of one kind (a model mixing dense and routed layers runs unrolled: `ModelConfig.scan_layers`)."""
    blocks = [Block(cfg, rngs, sparse) for sparse in cfg.sparse_layers]
    graphdef, _ = nnx.split(blocks[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(nnx.split(b)[1] for b in blocks))
    block = nnx.merge(graphdef, stacked)
    for _, v in nnx.iter_graph(block):
        if isinstance(v, nnx.Param):
            v.set_metadata(out_sharding=("layers", *v.get_metadata()["out_sharding"]))
    return block


def _stacked_expert_weight(path: tuple, _: Any) -> bool:
    """The routed layers' expert weights (not their biases or adapters): `Transformer.run_layers`'s stacked_experts."""
    return path[-1] in ("experts_gate", "experts_up", "experts_down")


def remat_policy(name: str) -> Callable | None:
    """`REMAT_POLICIES` name -> a `jax.checkpoint` policy over the block's named values (None: no remat)."""
    cp = jax.checkpoint_policies
    saved = {
        "minimal": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi", "mlpwo"),
        "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
        "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    }
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "full_offloaded":
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=["decoder_layer_input"],
            offload_src="device",
            offload_dst="pinned_host",
        )
    return cp.save_only_these_names(*saved[name])


class Transformer(nnx.Module):
    """Embedding, L blocks (stacked by `stacked_blocks` with `scan_layers`, else a list), final norm: the backbone of
    `CausalLM` and `RewardModel`."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.embed = Embedding(cfg, rngs)
        # stacked for a scan; a list of blocks unrolled: XLA:CPU copies a layer's slice of stacked weights on every
        # use (a decode step included), so the unrolled path keeps each block's weights whole (BENCHMARKS.md)
        self.layers = stacked_blocks(cfg, rngs) if cfg.scan_layers else nnx.List([Block(cfg, rngs, sparse) for sparse
                                                                                 in cfg.sparse_layers])
        self.final_norm = Norm(cfg)
        # tuples of floats (exact float32 values) keep them static graph data, not array attributes
        freqs = lambda *a, **k: tuple(float(f) for f in rope_inv_freq(cfg.rotary_dim, *a, **k))  # noqa: E731
        self.inv_freq = freqs(cfg.rope_theta, cfg.rope_type, cfg.rope_factors)
        # LongRoPE: the long factors replace the short ones in a forward reaching past the original context
        longrope = cfg.rope_type == "longrope"
        self.long_inv_freq = freqs(cfg.rope_theta, cfg.rope_type, cfg.rope_factors, long=True) if longrope else None
        self.rope_switch = int(dict(cfg.rope_factors)["original_max_position_embeddings"]) if longrope else None
        self.rope_scale = rope_attention_factor(cfg.rope_type, cfg.rope_factors)
        # per layer: which RoPE table (`rope_tables`' stack: global, local, NoPE as present) and which window
        kinds = cfg.rope_kinds
        self.rope_set = tuple(sorted(set(kinds)))
        self.rope_index = tuple(self.rope_set.index(k) for k in kinds)
        self.local_inv_freq = freqs(cfg.local_rope_theta) if 1 in kinds else None
        windows = cfg.windows
        self.window_set = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
        self.window_index = tuple(self.window_set.index(w) for w in windows)
        self.attn_scale, self.attn_softcap = cfg.attn_scale, cfg.attn_softcap
        self.attention_sinks = cfg.attention_sinks
        self.attn_implementation = cfg.attn_implementation  # None: the best for the platform compiled for
        self.dtype = jnp.dtype(cfg.dtype)
        self.num_layers = cfg.num_layers
        self.scan_layers = cfg.scan_layers
        self.remat_policy = cfg.remat_policy
        self.is_moe = cfg.is_moe
        self.num_routed_layers = sum(cfg.sparse_layers)

    def rope_tables(self, positions: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
        """cos, sin [K, *positions.shape, R] float32: one table per RoPE kind the layers use (`rope_set`: global;
        Gemma 3's local base; NoPE as cos 1, sin 0, which `apply_rope` passes through exactly).

        LongRoPE (Phi-3): the long factors for rows `width` tokens wide (static: the padded row, prompt + completion
        for the training forward and for every step of a rollout) past original_max_position_embeddings, else the
        short ones: HF's rule for a forward over such rows (its positions arange(width)), so the log-probs of the
        update equal TRL's. A rollout decides once (its prompt width + max_new_tokens), so its sampler and its
        update use the same factors; HF's `generate` instead starts short and, once past, recomputes its cache with
        the long factors."""
        inv = self.inv_freq
        if self.long_inv_freq is not None and width > self.rope_switch:
            inv = self.long_inv_freq
        cos, sin = rope_cos_sin(positions, np.asarray(inv, np.float32), self.rope_scale)
        tables = []
        for kind in self.rope_set:
            if kind == 0:
                tables.append((cos, sin))
            elif kind == 1:
                tables.append(rope_cos_sin(positions, np.asarray(self.local_inv_freq, np.float32)))
            else:
                tables.append((jnp.ones_like(cos), jnp.zeros_like(sin)))
        return jnp.stack([c for c, _ in tables]), jnp.stack([s_ for _, s_ in tables])

    def attention_fns(self, build: Callable[..., Callable], *args: Any) -> list[Callable]:
        """`build(*args, window=w, ...)` (`attention.causal` / `attention.shared_prompt`) for each window the layers
        use, in `window_set` order (`switch` picks a layer's)."""
        return [build(*args, implementation=self.attn_implementation, window=w, dtype=self.dtype,
                      scale=self.attn_scale, softcap=self.attn_softcap, sinks=self.attention_sinks)
                for w in self.window_set]

    def run_layers(
        self,
        x: jax.Array,
        cos: jax.Array,
        sin: jax.Array,
        attention: Callable,
        xs: Any = None,
        carry: Any = None,
        dropout_key: jax.Array | None = None,
        routes: jax.Array | None = None,
        token_weights: jax.Array | None = None,
        stacked_experts: bool = False,
    ) -> tuple[jax.Array, Any, Any, Routing | None]:
        """x [B, T, D] through the L blocks -> (x, carry, ys stacked on a leading [L] axis, the routers' `Routing`
        [L, ...] (None without experts)); cos, sin: `rope_tables`.

        attention(q [B,T,H,Dh], k, v [B,T,K,Dh], layer, xs_l, carry, sinks) -> (o [B,T,H,Dh], carry, ys_l): the
        block's attention, given the layer index (traced under scan), this layer's slice of `xs` (e.g. its prompt KV
        cache), the loop `carry` (e.g. the decode caches, updated in place) and the layer's attention sinks [H]
        (None without them). Each block runs under
        `jax.checkpoint` with `remat_policy`; with `scan_layers` the blocks are one `lax.scan`, else unrolled.
        `dropout_key`: LoRA dropout in training forwards (layer l uses fold_in(key, l); remat redraws the same mask).
        `routes` [L, B, T, K]: recorded experts to replay (`MoE.__call__`); `token_weights` [B, T]: compute the
        load-balancing statistics with these weights.
        `stacked_experts` (the sampler's steps; not for a forward to differentiate: the experts' gradient would be a
        stack per layer): under the scan, the routed layers' expert weights stay one loop-invariant [L, E, ...]
        stack, each layer's read from it in place (`moe.experts_apply`'s `layer`), not sliced out by the scan: a
        grouped-matmul kernel is a custom call, into which XLA fuses no slice, so the scan's slice was a copy of
        the layer's experts, written and read again, at every decode step (3x the experts' bytes, BENCHMARKS.md
        Session 19). Quantized experts (dequantized per layer) are sliced as before.
        """
        policy = remat_policy(self.remat_policy)
        stack = None  # the experts' [L, ...] stacks when they stay whole (stacked_experts), set below

        def body(
            graphdef: nnx.GraphDef, state: tuple[jax.Array, Any], inputs: tuple[Any, Any, Any, Any]
        ) -> tuple[tuple[jax.Array, Any], Any]:
            h, c = state
            layer_params, layer, xs_l, route = inputs
            if stack is not None:
                layer_params = (stack, layer_params)

            def fn(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None = None) -> tuple[jax.Array, Any]:
                o, new_c, ys_l = attention(q, k, v, layer, xs_l, c, sinks)
                return o, (new_c, ys_l)

            h = checkpoint_name(constrain(h, ("batch", None, None)), "decoder_layer_input")
            key = None if dropout_key is None else jax.random.fold_in(dropout_key, layer)
            cos_l, sin_l = pick(cos, self.rope_index, layer), pick(sin, self.rope_index, layer)
            block = nnx.merge(graphdef, *layer_params) if stack is not None else nnx.merge(graphdef, layer_params)
            h, (c, ys_l), routing = block(h, cos_l, sin_l, fn, key, route, token_weights,
                                          layer if stack is not None else None)
            return (h, c), (ys_l, routing)

        def block_fn(graphdef: nnx.GraphDef) -> Callable:
            f = functools.partial(body, graphdef)
            # prevent_cse guards remat against XLA CSE in straight-line code; a scan body needs no guard
            return f if policy is None else jax.checkpoint(f, policy=policy, prevent_cse=not self.scan_layers)

        if self.scan_layers:
            graphdef, params = nnx.split(self.layers)
            if stacked_experts and isinstance(self.layers.mlp, MoE) and self.layers.mlp.quant is None:
                graphdef, stack, params = nnx.split(self.layers, _stacked_expert_weight, ...)
            inputs = (params, jnp.arange(self.num_layers), xs, routes)
            (x, carry), (ys, routing) = jax.lax.scan(block_fn(graphdef), (x, carry), inputs)
            return x, carry, ys, routing
        outs = []
        for layer, block in enumerate(self.layers):
            graphdef, params = nnx.split(block)
            xs_l, route = jax.tree.map(lambda a, i=layer: a[i], (xs, routes))
            (x, carry), out = block_fn(graphdef)((x, carry), (params, layer, xs_l, route))
            outs.append(out)
        ys, routing = jax.tree.map(lambda *a: jnp.stack(a), *outs)
        return x, carry, ys, routing

    def forward(
        self, ids: jax.Array, mask: jax.Array, return_kv: bool = False, width: int | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """ids, mask [B, T] -> (hidden after final norm [B, T, D], with `return_kv` the post-RoPE keys and
        values of every layer, kv-head-major [L, B, K, T, Dh] each, else None). `width`: the rows' full width for
        LongRoPE's choice (`rope_tables`; default T; a prefill passes T + the tokens it will decode)."""
        h, kvs, _ = self.forward_routed(ids, mask, return_kv, width)
        return h, kvs

    def forward_routed(
        self, ids: jax.Array, mask: jax.Array, return_kv: bool = False, width: int | None = None,
        routes: jax.Array | None = None, token_weights: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None, Routing | None]:
        """`forward`, and the routers' `Routing` [L, ...] (None without experts). `routes` [L, B, T, K]: recorded
        experts to replay; `token_weights` [B, T]: the load-balancing statistics' weights (`run_layers`)."""
        pos = positions_from_mask(mask)
        fns = self.attention_fns(attention.causal, mask, pos)
        cos, sin = self.rope_tables(pos, ids.shape[1] if width is None else width)

        def attention_fn(q: jax.Array, k: jax.Array, v: jax.Array, layer: Any, xs_l: Any, carry: Any,
                         sinks: jax.Array | None) -> tuple:
            kv = (k.swapaxes(1, 2), v.swapaxes(1, 2)) if return_kv else None
            return switch(layer, self.window_index, fns, q, k, v, *_sink_args(sinks)), carry, kv

        x, _, kvs, routing = self.run_layers(self.embed(ids), cos, sin, attention_fn, routes=routes,
                                             token_weights=token_weights)
        return self.final_norm(x), kvs, routing

    def forward_shared_prompt(
        self,
        prompt_ids: jax.Array,
        prompt_mask: jax.Array,
        completion_ids: jax.Array,
        completion_mask: jax.Array,
        dropout_key: jax.Array | None = None,
        routes: Routes | None = None,
    ) -> tuple[jax.Array, jax.Array, Routing | None]:
        """B prompts, each continued by G completions, without repeating the prompts G times.

        prompt_ids, prompt_mask [B, P] (left padding; any padding with eager attention); completion_ids,
        completion_mask [B*G, C] (row r continues prompt r // G; its mask is a prefix of ones) -> final-norm hidden
        states (prompt [B, P, D], completions [B*G, C, D]), equal to `forward` over each row's concatenation
        [prompt; completion]: completion token t of row r sits at position lengths[r // G] + cumsum(mask)[t] - 1
        and attends to its prompt's real tokens (keys computed once per prompt) and to its own earlier real
        tokens. Gradients reach the prompt keys and values through all G rows.

        With experts, also the routers' `Routing` [L, ...] over the packed rows [B, P + G*C] (else None), its
        load-balancing statistics weighted as G separate [prompt; completion] rows would be (each real prompt token
        G times, each real completion token once: the rows TRL's forward sees); `routes`: recorded experts to
        replay (prompt routes of left-aligned prompts, as `prompt_ids` must then be).
        """
        b, p = prompt_ids.shape
        n, c = completion_ids.shape
        g = n // b
        pmask, cmask = prompt_mask.astype(jnp.int32), completion_mask.astype(jnp.int32)
        p_pos = positions_from_mask(pmask)  # [B, P]
        # positions as transformers' `cumsum(mask) - mask`: real tokens continue the prompt; a padding position
        # takes the next real one's (its output is never a target, but TRL 1.12's PPO logs entropies there)
        c_pos = jnp.repeat(pmask.sum(-1), g)[:, None] + jnp.cumsum(cmask, axis=-1) - cmask  # [N, C]
        fns = self.attention_fns(attention.shared_prompt, pmask, p_pos, cmask, c_pos)
        # Row b packs prompt b and its G completions, [B, P + G*C, D]: the position-wise layers (norms, q/k/v/o,
        # MLP) run as one matmul per weight over all tokens (one weight-gradient dot each, not a prompt one plus
        # a completion one and their sum); only attention splits the row.
        cos, sin = self.rope_tables(jnp.concatenate([p_pos, c_pos.reshape(b, g * c)], axis=1), p + c)
        # two lookups, then concatenate: one gather over the packed ids trips XLA's SPMD partitioner (a slice
        # of the wrong shape) when the table is sharded over vocab x embed
        x = jnp.concatenate([self.embed(prompt_ids), self.embed(completion_ids).reshape(b, g * c, -1)], axis=1)

        def attention_fn(q: jax.Array, k: jax.Array, v: jax.Array, layer: Any, xs_l: Any, carry: Any,
                         sinks: jax.Array | None) -> tuple:
            # q [B, P + G*C, H, Dh], k/v [B, P + G*C, K, Dh]: the prompt part, and the completions' [N, C, ...]
            own = lambda x: x[:, p:].reshape(n, c, *x.shape[2:])  # noqa: E731
            o_prompt, o_comp = switch(layer, self.window_index, fns, q[:, :p], own(q), k[:, :p], v[:, :p], own(k),
                                      own(v), *_sink_args(sinks))
            return jnp.concatenate([o_prompt, o_comp.reshape(b, g * c, *q.shape[2:])], axis=1), carry, None

        weights, packed = None, None
        if self.is_moe:  # row b packs prompt b and its G completions
            weights = jnp.concatenate([pmask * g, cmask.reshape(b, g * c)], axis=1)
            if routes is not None:
                prompt_routes = fit_prompt_routes(routes.prompt, p)
                packed = jnp.concatenate([prompt_routes, routes.completion.reshape(b, g * c, *prompt_routes.shape[2:])
                                          .astype(prompt_routes.dtype)], axis=1)
                packed = jnp.moveaxis(packed, 2, 0)  # [L, B, P + G*C, K]
        x, _, _, routing = self.run_layers(x, cos, sin, attention_fn, dropout_key=dropout_key, routes=packed,
                                           token_weights=weights)
        x = self.final_norm(x)
        return x[:, :p], x[:, p:].reshape(n, c, x.shape[-1]), routing

    def decode(self, tokens: jax.Array, step: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        """One token per row: tokens [B*G] -> (hidden [B*G, D], cache with slot `step` written)."""
        p = cache.prompt
        b, bg = p.mask.shape[0], tokens.shape[0]
        g = bg // b
        pos = jnp.repeat(p.lengths, g) + step  # [B*G]
        cos, sin = self.rope_tables(pos[:, None], p.mask.shape[1] + cache.k.shape[3])
        q_pos = pos.reshape(b, g)
        p_pos = positions_from_mask(p.mask)
        c = jnp.arange(cache.k.shape[3])
        # per window the layers use: [W, B, G, 1, P] and [W, B, G, 1, C]
        p_allowed = jnp.stack([(p.mask[:, None, :] > 0) & visible(q_pos[:, :, None], p_pos[:, None, :], w)
                               for w in self.window_set])[:, :, :, None]
        g_allowed = jnp.stack([jnp.broadcast_to((c <= step) & visible(step, c, w), (b, g, 1, c.shape[0]))
                               for w in self.window_set])

        def attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: Any, xs_l: Any, carry: Any,
                      sinks: jax.Array | None) -> tuple:
            (pk, pv), (gk, gv) = xs_l, carry
            # k, v [B*G, 1, K, Dh] -> slot `step` of layer `layer` of the [L, B*G, K, C, Dh] caches, in place
            start = (layer, 0, 0, step, 0)
            gk = jax.lax.dynamic_update_slice(gk, k.swapaxes(1, 2)[None].astype(gk.dtype), start)
            gv = jax.lax.dynamic_update_slice(gv, v.swapaxes(1, 2)[None].astype(gv.dtype), start)
            gk, gv = kv_cache_layout(gk), kv_cache_layout(gv)
            o = attend_shared_prompt(
                q.reshape(b, g, 1, *q.shape[2:]),
                pk,
                pv,
                pick(p_allowed, self.window_index, layer),
                gk[layer],
                gv[layer],
                pick(g_allowed, self.window_index, layer),
                scale=self.attn_scale,
                softcap=self.attn_softcap,
                sinks=sinks,
            )
            return o.reshape(bg, 1, *q.shape[2:]), (gk, gv), None

        x = self.embed(tokens)[:, None]
        x, (gk, gv), _, routing = self.run_layers(x, cos, sin, attention, xs=(p.k, p.v), carry=(cache.k, cache.v),
                                                  stacked_experts=True)
        routes = cache.routes
        if routing is not None:  # the fed tokens' experts [L, B*G, 1, K] -> slot `step`
            routes = jax.lax.dynamic_update_slice(routes, routing.experts.astype(routes.dtype), (0, 0, step, 0))
        return self.final_norm(x)[:, 0], DecodeCache(prompt=p, k=gk, v=gv, routes=routes)

    def extend(self, tokens: jax.Array, start: jax.Array, valid: jax.Array, cache: DecodeCache
               ) -> tuple[jax.Array, DecodeCache]:
        """T tokens per row appended to each row's own cache at its own slot: tokens [N, T], start [N] int32 (row r's
        token t goes to completion slot ``start[r] + t``, position ``lengths[r // G] + start[r] + t``), valid [N, T]
        bool (False: not written, its output unused) -> (hidden [N, T, D], cache with the valid slots written).

        Query t of row r attends to its prompt's real tokens and to its own slots ``<= start[r] + t`` (the slots
        written before, and this chunk's tokens up to t): the same numbers as a forward over [prompt; completion
        slots up to the token]. A decode step is T = 1 with ``start`` the slot of the token fed; a resumed turn
        (tool results appended) is the new tokens only. Writes go to per-row slots, so rows may stand at
        different lengths: the multi-turn sampler (`rloo_jax.turns`)."""
        p = cache.prompt
        b, n, t = p.mask.shape[0], tokens.shape[0], tokens.shape[1]
        g, width = n // b, cache.k.shape[3]
        slots = start[:, None] + jnp.arange(t, dtype=start.dtype)[None, :]  # [N, T]
        pos = jnp.repeat(p.lengths, g)[:, None] + slots  # [N, T]
        cos, sin = self.rope_tables(pos, p.mask.shape[1] + width)
        q_pos, q_slot = pos.reshape(b, g, t), slots.reshape(b, g, t)
        p_pos = positions_from_mask(p.mask)
        c = jnp.arange(width)
        # per window the layers use: [W, B, G, T, P] and [W, B, G, T, C]
        p_allowed = jnp.stack([(p.mask[:, None, None, :] > 0) & visible(q_pos[..., None], p_pos[:, None, None, :], w)
                               for w in self.window_set])
        g_allowed = jnp.stack([(c <= q_slot[..., None]) & visible(q_slot[..., None], c, w) for w in self.window_set])

        # cache slot c of row r takes the chunk's token c - start[r] where that is one of its valid tokens
        src = c[None, :] - start[:, None]  # [N, C]
        src_t = jnp.clip(src, 0, t - 1)
        takes = (src >= 0) & (src < t) & jnp.take_along_axis(valid, src_t, axis=1)  # [N, C]

        def write(cache: jax.Array, new: jax.Array, layer: Any) -> jax.Array:
            """new [N, T, K, Dh] -> slots start[r] + t (where valid) of layer `layer` of the [L, N, K, C, Dh] cache:
            the layer's slice gathered and selected, written back in place. A scatter of the tokens into the
            [L, ...] cache would, on a TPU, copy the whole cache into the layout the scatter prefers and back at
            every layer of every step (the compiler's count: 40x the decode's memory floor; BENCHMARKS.md Session
            17)."""
            new = new.swapaxes(1, 2).astype(cache.dtype)  # [N, K, T, Dh]
            if t > 1:  # a resumed turn's tokens (once per tool round): each slot's own, [N, K, C, Dh]
                new = jnp.take_along_axis(new, src_t[:, None, :, None], axis=2)
            layer_slice = jnp.where(takes[:, None, :, None], new, cache[layer])
            return jax.lax.dynamic_update_slice(cache, layer_slice[None], (layer, 0, 0, 0, 0))

        def attention(q: jax.Array, k: jax.Array, v: jax.Array, layer: Any, xs_l: Any, carry: Any,
                      sinks: jax.Array | None) -> tuple:
            (pk, pv), (gk, gv) = xs_l, carry
            gk, gv = write(gk, k, layer), write(gv, v, layer)
            gk, gv = kv_cache_layout(gk), kv_cache_layout(gv)
            o = attend_shared_prompt(
                q.reshape(b, g, t, *q.shape[2:]), pk, pv, pick(p_allowed, self.window_index, layer),
                gk[layer], gv[layer], pick(g_allowed, self.window_index, layer),
                scale=self.attn_scale, softcap=self.attn_softcap, sinks=sinks,
            )
            return o.reshape(n, t, *q.shape[2:]), (gk, gv), None

        x = self.embed(tokens)
        x, (gk, gv), _, routing = self.run_layers(x, cos, sin, attention, xs=(p.k, p.v), carry=(cache.k, cache.v),
                                                  stacked_experts=True)
        routes = cache.routes
        if routing is not None:  # the valid tokens' experts [L, N, T, K] -> their slots, as the keys and values
            rows, where = jnp.arange(n)[:, None], jnp.where(valid, slots, width)  # invalid: out of bounds, dropped
            routes = routes.at[:, rows, where].set(routing.experts.astype(routes.dtype), mode="drop")
        return self.final_norm(x), DecodeCache(prompt=p, k=gk, v=gv, routes=routes)


def prompt_and_completion_states(
    model: Transformer,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    completion_ids: jax.Array,
    completion_mask: jax.Array,
    dropout_key: jax.Array | None = None,
    routes: Routes | None = None,
) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
    """Final-norm hidden states at each prompt's last real token, then at every completion token: [B*G, C + 1, D]
    (prompts [B, P] run once for their G completions [B*G, C], `Transformer.forward_shared_prompt`), and with
    experts transformers' load-balancing loss of the forward (`router_aux_loss`) and the routers' own choices for
    the completion tokens [B*G, C, L, K] (`Routing.chosen`, as `Routes.completion` lays recorded ones out; -1 in
    a dense layer), else None and None. `routes`: recorded experts to replay (`Routes`)."""
    # left-aligned prompts (what the sampler feeds): then each [prompt; completion] row's real tokens are one
    # contiguous run, as the fused attention implementations take them; nothing else depends on the padding
    prompt_ids, prompt_mask = left_align(prompt_ids, prompt_mask)
    hp, hc, routing = model.forward_shared_prompt(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                  dropout_key, routes)
    g = completion_ids.shape[0] // prompt_ids.shape[0]
    last = hp[jnp.arange(hp.shape[0]), last_token_index(prompt_mask)]  # [B, D]
    aux, chosen = None, None
    if routing is not None:
        tokens = jnp.sum(prompt_mask.astype(jnp.float32)) * g + jnp.sum(completion_mask.astype(jnp.float32))
        aux = router_aux_loss(routing, tokens, model.num_routed_layers)
        own = routing.chosen[:, :, prompt_ids.shape[1]:]  # [L, B, G*C, K]: the packed rows' completion part
        chosen = jnp.moveaxis(own.reshape(own.shape[0], *completion_ids.shape, -1), 0, 2)
    return jnp.concatenate([jnp.repeat(last, g, axis=0)[:, None], hc], axis=1), aux, chosen


def router_aux_loss(routing: Routing, tokens: jax.Array, layers: int) -> jax.Array:
    """transformers' `load_balancing_loss_func` of a forward from its `Routing` statistics [L, E] (dense layers
    add zeros) over `layers` routed layers and `tokens` weighted tokens: `moe.load_balancing_loss`."""
    return moe.load_balancing_loss(routing.counts.sum(0), routing.probs.sum(0), tokens * layers)


class CausalLM(nnx.Module):
    """Decoder-only causal LM. `model(ids, mask) -> logits [B, T, V] float32`; KV-cache methods for sampling."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.model = Transformer(config, rngs)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Dense(config.hidden_size, config.vocab_size, ("embed", "vocab"), False, config, rngs)
        )

    @classmethod
    def from_config(cls, config: ModelConfig, rngs: nnx.Rngs) -> CausalLM:
        """Random initialisation (normal(0, initializer_range) matrices, unit norms, zero biases)."""
        return cls(config, rngs)

    def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """[B, T] -> final-norm hidden states [B, T, D] in the compute dtype."""
        return self.model.forward(input_ids, attention_mask)[0]

    def completion_hidden_states(
        self,
        prompt_ids: jax.Array,
        prompt_mask: jax.Array,
        completion_ids: jax.Array,
        completion_mask: jax.Array,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """Hidden states that predict each completion token: [B*G, C, D], row r continuing prompt r // G.

        prompt [B, P], completions [B*G, C] (see `Transformer.forward_shared_prompt`: each prompt runs once).
        Entry t is the hidden state after the token before completion token t: the prompt's last real token
        for t = 0, completion token t - 1 otherwise; `unembed` of it scores completion token t. `dropout_key`: LoRA
        dropout (training forwards; no effect without adapters or with lora dropout 0).
        """
        return self.completion_states(prompt_ids, prompt_mask, completion_ids, completion_mask, dropout_key)[0]

    def completion_states(
        self,
        prompt_ids: jax.Array,
        prompt_mask: jax.Array,
        completion_ids: jax.Array,
        completion_mask: jax.Array,
        dropout_key: jax.Array | None = None,
        routes: Routes | None = None,
        with_routing: bool = False,
    ) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """`completion_hidden_states` [B*G, C, D] and, with experts, the forward's load-balancing loss (transformers'
        `aux_loss` of the G [prompt; completion] rows; else None). `routes`: the sampler's experts, replayed
        (`Routes`; with `routing_replay` False the router chooses anyway). `with_routing`: also the routers' own
        choices for the completion tokens [B*G, C, L, K] (`prompt_and_completion_states`; None without experts)."""
        h, aux, chosen = prompt_and_completion_states(self.model, prompt_ids, prompt_mask, completion_ids,
                                                      completion_mask, dropout_key, routes)
        return (h[:, :-1], aux, chosen) if with_routing else (h[:, :-1], aux)

    def unembed(self, h: jax.Array) -> jax.Array:
        """h [..., D] -> logits [..., V] float32 (lm head, or the tied embedding transposed), soft-capped with
        `final_softcap` (Gemma 2): every consumer of the logits (the sampler, log-probs, entropy) sees the capped
        ones, as HF's `logits` are."""
        dt = jnp.dtype(self.config.dtype)
        flat = h.reshape(-1, h.shape[-1]).astype(dt)  # one token axis for the weight gradient, as in `Dense`
        tied = self.lm_head is None
        head = self.model.embed.embedding if tied else self.lm_head.kernel
        w = head[...].astype(dt)
        axes = _logical(head, 2)[::-1] if tied else _logical(head, 2)  # of [D, V]; a tied embedding is [V, D]
        # A decode step's few rows move to a head split over fsdp (`stationary_matmul`), rather than gathering the
        # head at every step (gpt-oss-20b's 1.16 GB on a v5e-8): along V where the sampler laid it out so
        # (`sampling.rollout_weights`), else along D as stored
        side = stationary_side(flat.shape[0], (flat.shape[1], w.shape[0] if tied else w.shape[1]), axes, dt.itemsize)
        if side is not None:
            logits = stationary_matmul(flat, w, axes, side, transposed=tied)
        else:
            logits = jnp.einsum("td,vd->tv" if tied else "td,dv->tv", flat, w, preferred_element_type=jnp.float32)
        logits = softcap(logits, self.config.final_softcap)
        return logits.reshape(*h.shape[:-1], logits.shape[-1])

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """input_ids, attention_mask [B, T] -> logits [B, T, V] float32."""
        return self.unembed(self.hidden_states(input_ids, attention_mask))

    def prefill(
        self, prompt_ids: jax.Array, prompt_mask: jax.Array, max_new_tokens: int = 0
    ) -> tuple[jax.Array, PromptCache]:
        """Run the prompts once: -> (logits at each prompt's last real token [B, V] f32, PromptCache).
        `max_new_tokens`: the decode steps to follow (C of `init_decode_cache`), for LongRoPE's choice of factors
        (`Transformer.rope_tables`: rows of P + C tokens)."""
        h, (k, v), routing = self.model.forward_routed(prompt_ids, prompt_mask, return_kv=True,
                                                       width=prompt_ids.shape[1] + max_new_tokens)
        last = last_token_index(prompt_mask)
        logits = self.unembed(h[jnp.arange(h.shape[0]), last])
        mask = prompt_mask.astype(jnp.int32)
        cache = PromptCache(
            k=k,  # [L, B, K, P, Dh]
            v=v,
            mask=mask,
            lengths=mask.sum(-1).astype(jnp.int32),
            routes=None if routing is None else routing.experts.astype(ROUTE_DTYPE),  # [L, B, P, K]
        )
        return logits, cache

    def init_decode_cache(self, prompt_cache: PromptCache, num_generations: int, max_new_tokens: int) -> DecodeCache:
        """Empty generated-token slots [L, B*G, K, C, Dh] next to the shared prompt cache."""
        n_layers, b, kh, _, dh = prompt_cache.k.shape
        shape = (n_layers, b * num_generations, kh, max_new_tokens, dh)
        zeros = jnp.zeros(shape, prompt_cache.k.dtype)
        routes = None
        if prompt_cache.routes is not None:  # -1 until the slot's token is fed
            k = prompt_cache.routes.shape[-1]
            routes = jnp.full((n_layers, b * num_generations, max_new_tokens, k), -1, ROUTE_DTYPE)
        return DecodeCache(prompt=prompt_cache, k=zeros, v=zeros, routes=routes)

    @staticmethod
    def recorded_routes(cache: DecodeCache) -> Routes | None:
        """The routes a sampler recorded in its caches, rows first (`Routes`): the prompts' (as prefilled, left
        aligned) and each completion slot's fed token's (-1 for a slot never fed: the last token and after);
        None without experts."""
        if cache.routes is None:
            return None
        return Routes(prompt=jnp.moveaxis(cache.prompt.routes, 0, 2), completion=jnp.moveaxis(cache.routes, 0, 2))

    def decode_step(self, tokens: jax.Array, step: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
        """tokens [B*G] at decode step `step` (position lengths[r // G] + step) -> (logits [B*G, V] f32, cache)."""
        h, cache = self.model.decode(tokens, step, cache)
        return self.unembed(h), cache

    def extend(self, tokens: jax.Array, start: jax.Array, valid: jax.Array, cache: DecodeCache
               ) -> tuple[jax.Array, DecodeCache]:
        """tokens [N, T] at per-row completion slots ``start [N] + t`` (``Transformer.extend``; ``valid`` [N, T]:
        which are written) -> (logits [N, T, V] f32, cache)."""
        h, cache = self.model.extend(tokens, start, valid, cache)
        return self.unembed(h), cache


class RewardModel(nnx.Module):
    """Backbone + bias-free `score` [D, 1] read at the last real token: `rm(ids, mask) -> scores [B] float32`."""

    def __init__(self, config: ModelConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        self.model = Transformer(config, rngs)
        self.score = Dense(config.hidden_size, 1, ("embed", None), False, config, rngs)

    @classmethod
    def from_config(cls, config: ModelConfig, rngs: nnx.Rngs) -> RewardModel:
        """Random initialisation, as `CausalLM.from_config`."""
        return cls(config, rngs)

    @staticmethod
    def new_head(config: ModelConfig, seed: int) -> Dense:
        """A fresh `score` head, normal(0, initializer_range) as transformers initialises a new one."""
        return Dense(config.hidden_size, 1, ("embed", None), False, config, nnx.Rngs(seed))

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
        """[B, T] -> scores [B] float32, pooled at `last_token_index(attention_mask)`."""
        h = self.model.forward(input_ids, attention_mask)[0]
        pooled = h[jnp.arange(h.shape[0]), last_token_index(attention_mask)]
        return self.head(pooled)

    def head(self, h: jax.Array) -> jax.Array:
        """The score head: h [..., D] -> [...] float32 (bias-free Linear D -> 1, float32 accumulation)."""
        w = self.score.kernel[...].astype(h.dtype)
        return jnp.einsum("...d,do->...o", h, w, preferred_element_type=jnp.float32)[..., 0]

    def completion_scores(
        self,
        prompt_ids: jax.Array,
        prompt_mask: jax.Array,
        completion_ids: jax.Array,
        completion_mask: jax.Array,
        dropout_key: jax.Array | None = None,
    ) -> jax.Array:
        """The head at every position from each prompt's last token on: [B*G, C + 1] float32.

        prompt [B, P], completions [B*G, C] (row r continues prompt r // G; each prompt runs once, as
        `CausalLM.completion_hidden_states`). Entry 0 is the head at the prompt's last real token, entry t >= 1 at
        completion token t - 1. So `out[:, :C]` are per-token values (entry t: the state before completion token
        t, TRL's value model read at `[P - 1 : -1]`), and `out[r, n_r]` with n_r the row's real completion tokens
        is the reward model's score of prompt + completion (its last real token; the prompt's for an empty one).
        """
        return self.head(prompt_and_completion_states(self.model, prompt_ids, prompt_mask, completion_ids,
                                                      completion_mask, dropout_key)[0])


def logical_axes(model: nnx.Module) -> nnx.State:
    """Logical axis names of every parameter: a State shaped like `nnx.state(model, nnx.Param)` whose leaves are
    tuples such as ("embed", "mlp") (map over it with `is_leaf=lambda x: isinstance(x, tuple)`)."""
    return jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"]),
        nnx.state(model, nnx.Param),
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
