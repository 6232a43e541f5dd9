"""Mixture-of-experts math: top-k routing, dropless grouped matmuls over tokens sorted by expert, the load-balancing
loss. Pure functions; `transformer.MoE` holds the parameters.

A routed MLP sends each of T tokens to K of E experts (`route`), computes every (token, expert) pair (no capacity,
none dropped) and sums the experts' outputs weighted by the gate weights:

    y_t = sum_k w_tk * expert_{e_tk}(x_t)          expert_e(x) = down_e(silu(gate_e(x)) * up_e(x))

GPT-OSS's experts carry biases and a clamped SwiGLU (`clamped_swiglu`): expert_e(x) = down_e(swiglu(gate_e(x) + bg_e,
up_e(x) + bu_e)) + bd_e; its router (`route` with `topk_softmax`) softmaxes the K largest logits (its router's bias
is in the logits).

The T*K pairs are sorted by expert, so each expert's rows are one contiguous group, and each projection is ONE
grouped matmul over all experts (`experts_apply`, `grouped_matmul`). The same function runs in the sampler (prefill,
one-token decode steps) and in the training forwards. `moe_implementation` (a `ModelConfig` field and a run option,
resolved per platform by `resolve` as attention's `attn_implementation`) picks the grouped matmul:

- `ragged_dot`: `jax.lax.ragged_dot`. On TPU its forward is sparse, but its weight gradient (the transpose) costs
  every expert for every row: (1 + E) / 2 times a sparse gradient (BENCHMARKS.md Session 18).
- `megablox`: jax's Pallas TPU grouped matmul (`jax.experimental.pallas.ops.tpu.megablox.gmm`, its own VJP with
  `tgmm` for the weights): sparse forward and gradient. Off a TPU it runs interpreted (tests; slow). A Mosaic
  kernel cannot be partitioned by XLA, so on a mesh it runs inside `experts_apply_sharded`'s `shard_map`.

None: megablox on TPU (and `--compile_only` for a TPU), ragged_dot elsewhere.

Shapes: T tokens, D hidden, E experts, K experts per token, F an expert's hidden size, L routed layers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.megablox import gmm
from jax.sharding import PartitionSpec as P

from rloo_jax.efficiency import rows_move
from rloo_jax.hlo import grouped_matmul_flops_scope
from rloo_jax.mesh import fit_spec
from rloo_jax.models.attention import target_platform

__all__ = ["clamped_swiglu", "experts_apply", "experts_apply_sharded", "gate_weights", "grouped_matmul",
           "load_balancing_loss", "load_balancing_stats", "megablox_tiling", "moving_rows", "mxfp4_dequantize",
           "resolve", "route", "route_mismatch", "sort_by_expert"]

IMPLEMENTATIONS = ("ragged_dot", "megablox")
# megablox is a Pallas TPU kernel: on the CPU it runs interpreted (slow: tests, small runs); on a GPU not at all
AVAILABLE: dict[str, tuple[str, ...]] = {"cpu": IMPLEMENTATIONS, "gpu": ("ragged_dot",), "tpu": IMPLEMENTATIONS}
_ROW_TILE = 128  # megablox's largest row tile: each group also computes its partial first tile, up to E - 1 more
_MAX_TILE = 512  # its contraction / output tile (MaxText's is 512-1024); a partial last tile is masked by the kernel


def resolve(implementation: str | None, platform: str) -> str:
    """The grouped matmul to run: `implementation`, or for None the best on `platform` ("cpu", "gpu", "tpu"):
    megablox on TPU, ragged_dot elsewhere. ValueError (one line naming the valid values there) for one the platform
    does not offer. Example: resolve(None, "tpu") -> "megablox"; resolve("megablox", "gpu") -> ValueError."""
    platform = "gpu" if platform in ("cuda", "rocm") else platform
    if implementation is None:
        return "megablox" if platform == "tpu" else "ragged_dot"
    valid = AVAILABLE.get(platform, ("ragged_dot",))
    if implementation not in valid:
        raise ValueError(f"moe_implementation={implementation!r} is not available on {platform}; valid there: "
                         f"{', '.join(valid)} (None: the best of them)")
    return implementation


def megablox_tiling(m: int, k: int, n: int, groups: int = 1) -> tuple[int, int, int]:
    """megablox's (rows, contraction, output) tiles for [m, k] x [k, n] over `groups` groups of rows: rows the mean
    group's rows rounded up to a power of two in [16 (bf16's sublane tile), `_ROW_TILE`], at most m rounded up to
    16. Each group computes whole row tiles, its first one shared with the group before, so short groups (a decode
    step: a few rows an expert) take small tiles; the weights are read once a tile either way. k and n one tile
    size, as the backward swaps them (its input gradient is [m, n] x [n, k]): k and n's larger rounded up to 128
    lanes, at most `_MAX_TILE`. A tile need not divide k or n: the kernel masks a partial last tile (gpt-oss's 2,880
    = 5.6 x 512; no copy of the weights padded).
    Example: (100, 64, 32) -> (112, 128, 128); (4096, 2880, 2880, 8) -> (128, 512, 512); (512, 64, 32, 128) -> 16
    rows (4 an expert)."""
    lanes = min(_MAX_TILE, -(-max(k, n) // 128) * 128)
    mean = -(-m // groups)
    rows = min(_ROW_TILE, max(16, 1 << (mean - 1).bit_length()))
    return min(rows, -(-m // 16) * 16), lanes, lanes


def grouped_matmul(rows: jax.Array, w: jax.Array, sizes: jax.Array, implementation: str = "ragged_dot",
                   interpret: bool | None = None, offset: jax.Array | int | None = None) -> jax.Array:
    """Each group's rows times its matrix: rows [M, K] (the groups' rows contiguous, in order), w [G, K, N], sizes
    [G] int32 (sum <= M) -> [M, N] float32, out[m] = rows[m] @ w[g] for the row's group g; the rows past sum(sizes)
    (no group) give 0. Inputs in their dtype (rows and w the same), float32 accumulation.

    `offset`: w [G', K, N] holds more matrices than the G groups (every layer's experts, [L * E, K, N]) and group g's
    is w[offset + g]. megablox reads them where they lie (its `group_offset`, -offset, shifts the matrix each tile
    reads); a copy of the G out of the stack would be written and read again at every call (a decode step, per
    layer: BENCHMARKS.md Session 19). ragged_dot slices them out.

    `implementation` (`IMPLEMENTATIONS`): one `jax.lax.ragged_dot`, or megablox `gmm` (Pallas; `interpret` None:
    interpreted unless compiling for a TPU) with `megablox_tiling`, the rows padded to whole row tiles. Its FLOPs
    for `rloo_jax.hlo` (the compiler counts none in a kernel): each group's rows in whole tiles of tm rows, at most
    (M / tm + min(G, M) - 1) tiles of [tm, K] x [K, N], the same for each kernel of its backward.
    Example: rows [[1], [2], [3]], w [[[10]], [[100]]], sizes [1, 1] -> [[10], [200], [0]].
    """
    g = sizes.shape[0]
    if implementation == "ragged_dot":
        w = w if offset is None else jax.lax.dynamic_slice_in_dim(w, offset, g)
        return jax.lax.ragged_dot(rows, w, sizes, preferred_element_type=jnp.float32)
    m, k = rows.shape
    tm, tk, tn = megablox_tiling(m, k, w.shape[2], g)
    padded = -(-m // tm) * tm
    # gmm leaves the rows outside every group unwritten (garbage, NaN when interpreted), in its output and in its
    # input gradient: a select on both sides (not a multiply: NaN * 0 is NaN) keeps them out of y and of d rows
    grouped = (jnp.arange(padded) < jnp.sum(sizes))[:, None]
    lhs = jnp.where(grouped, jnp.pad(rows, ((0, padded - m), (0, 0))), jnp.zeros((), rows.dtype))
    interpret = target_platform() != "tpu" if interpret is None else interpret
    bound = 2 * tm * (padded // tm + min(g, m) - 1) * k * w.shape[2]
    group_offset = None if offset is None else -jnp.asarray(offset, jnp.int32)  # G' >= G: no group left unwritten
    # bf16 inputs: a float32 matmul precision of highest (bf16 with --matmul_precision highest) would ask Mosaic for
    # an fp32-precision matmul of bf16 vectors, which it refuses ("Bad lhs type", measured: forward and gradient);
    # bf16 products are exact in the float32 accumulator anyway
    precision = "default" if rows.dtype == jnp.bfloat16 else jax.config.jax_default_matmul_precision
    reads = None if offset is None else (g, w.shape[0])  # for `rloo_jax.hlo`: of the stack, the G matrices
    with jax.named_scope(grouped_matmul_flops_scope(bound, reads)), jax.default_matmul_precision(precision):
        y = gmm(lhs, w, sizes, jnp.float32, (tm, tk, tn), group_offset, interpret=interpret)
    return jnp.where(grouped, y, 0.0)[:m]


def route(logits: jax.Array, k: int, norm_topk: bool = False, topk_softmax: bool = False
          ) -> tuple[jax.Array, jax.Array]:
    """Qwen3-MoE's routing (transformers' Qwen3MoeTopKRouter): p = softmax(logits) in float32, each token's K largest
    p (largest first; ties: the lower expert id), with `norm_topk` divided by their sum. `topk_softmax` (GPT-OSS's
    GptOssTopKRouter): the K largest logits, weights softmax over those K alone (`norm_topk` then changes nothing).

    logits [T, E] -> (experts [T, K] int32, weights [T, K] float32).
    Example: logits [[0, ln 2, ln 3]], k 2 -> experts [[2, 1]], weights [[1/2, 1/3]] (norm_topk or topk_softmax:
    [[0.6, 0.4]]).
    """
    if topk_softmax:
        top, experts = jax.lax.top_k(logits.astype(jnp.float32), k)
        return experts.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    top, experts = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k)
    return experts.astype(jnp.int32), top / jnp.sum(top, -1, keepdims=True) if norm_topk else top


def gate_weights(logits: jax.Array, experts: jax.Array, norm_topk: bool = False, topk_softmax: bool = False
                 ) -> jax.Array:
    """The weights `route` gives the experts `experts` [T, K] (e.g. the sampler's, replayed) under the current
    logits [T, E]: softmax(logits) at those experts, renormalised with `norm_topk` (`topk_softmax`: the softmax of
    those experts' logits) -> [T, K] float32.
    Differentiable in the logits, so the router trains under routing replay. Where `experts` is what `route` chose,
    the same numbers. Example: logits [[0, ln 2, ln 3]], experts [[0, 2]] -> [[1/6, 1/2]] (norm_topk or
    topk_softmax: [[0.25, 0.75]]).
    """
    if topk_softmax:
        return jax.nn.softmax(jnp.take_along_axis(logits.astype(jnp.float32), experts, axis=-1), axis=-1)
    picked = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), experts, axis=-1)
    return picked / jnp.sum(picked, -1, keepdims=True) if norm_topk else picked


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GPT-OSS's expert activation (transformers' GptOssExperts._apply_gate): g = min(gate, limit),
    u = clip(up, -limit, limit) -> (u + 1) * g * sigmoid(alpha * g), elementwise, any shape.
    Example: alpha 1, limit 7: gate 0, up 5 -> 0; gate 9, up 9 -> 8 * 7 * sigmoid(7) = 55.95."""
    g = jnp.minimum(gate, limit)
    u = jnp.clip(up, -limit, limit)
    return (u + 1) * (g * jax.nn.sigmoid(g * alpha))


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """The T*K (token, slot) pairs of `experts` [T, K] ordered by expert (stable: token order within an expert) ->
    (order [T*K]: the flat pair index t * K + k of each sorted row, group_sizes [E] int32).
    Example: experts [[2, 0], [1, 2]], E 3 -> order [1, 2, 0, 3], group_sizes [1, 1, 2]."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, sizes


def experts_apply(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, dtype: jnp.dtype = jnp.float32, biases: tuple[jax.Array, ...] | None = None,
                  swiglu: tuple[float, float] | None = None, first: jax.Array | int = 0,
                  implementation: str = "ragged_dot", lora: tuple | None = None, lora_scale: float = 0.0,
                  layer: jax.Array | None = None, contract: str | None = None) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x_t) over the pairs whose expert is one of gate's, dropless:
    x [T, D], experts / weights [T, K], gate / up [E', D, F], down [E', F, D] -> [T, D] float32. `biases`
    (GPT-OSS): (gate [E', F], up [E', F], down [E', D]) added to each expert's projections; `swiglu` (alpha,
    limit): the activation is `clamped_swiglu`, else silu(gate) * up.

    gate / up / down hold the experts first .. first + E' - 1 (all E with `first` 0, E' = E: the whole sum); a
    pair routed to another expert adds 0 (one expert shard's share, `experts_apply_sharded`). The pairs are sorted
    by expert (`sort_by_expert`, the others last, outside every group) and each projection is one
    `grouped_matmul` (`implementation`: ragged_dot or megablox) over the E' groups, in `dtype` with float32
    accumulation (biases added in float32); the activation in float32, rounded once to `dtype` (as
    `transformer.MLP`). The weighted sum over the K slots is in float32. Example: E 4 on 2 shards, experts
    [[0, 3]]: shard 0 (first 0) adds w_00 * expert_0(x_0), shard 1 (first 2) w_01 * expert_3(x_0).

    `lora` (peft's LoRA on expert parameters): ((A [E', din, r], B [E', r, dout]) or None) for gate, up, down; a
    projection with one adds lora_scale * (h A_e) B_e for each row's expert e, two more grouped matmuls over the same
    groups (h A_e rounded to `dtype`, as `transformer.Dense` rounds x A).

    `layer` (a decode step's scan over the layers): gate / up / down are every layer's experts, [L, E', D, F] /
    [L, E', F, D], and layer `layer`'s are used: megablox reads them in place in the stack (`grouped_matmul`'s
    offset) where the stack is in `dtype`; otherwise (ragged_dot, or a cast) they are sliced out. Biases and
    adapters are the layer's own.

    `contract` (a mesh axis of n devices, inside a `shard_map`: the weights stay where they lie): gate / up hold
    this device's D / n of their input rows [E', D / n, F] and down its D / n output columns [E', F, D / n]. Each
    device projects its slice of x's hidden units, one psum over `contract` adds the n partial products of gate
    and up (and of x A for their adapters) before the activation, and down gives this device's D / n columns of
    the output: -> [T, D / n] (down's bias and adapter B [E', ., D / n] are the slice's too).
    """
    if layer is not None and (implementation != "megablox" or any(w.dtype != dtype for w in (gate, up, down))):
        gate, up, down, layer = gate[layer], up[layer], down[layer], None
    t, k = experts.shape
    e = gate.shape[-3]
    offset = None if layer is None else layer * e  # this layer's first expert in the [L * E', ...] stack
    if layer is not None:
        gate, up, down = (w.reshape(-1, *w.shape[2:]) for w in (gate, up, down))
    if contract is not None:  # this device's slice of the hidden units, the rows of its slice of gate and up
        width = gate.shape[-2]
        x = jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(contract) * width, width, axis=1)
    local = experts - first
    own = (local >= 0) & (local < e)
    order, sizes = sort_by_expert(jnp.where(own, local, e), e + 1)  # group e: the other shards' pairs
    sizes = sizes[:e]  # rows past the groups' sum come out of the grouped matmul as 0
    rows = jnp.take(x.astype(dtype), order // k, axis=0)  # [T*K, D]
    owner = jnp.take(jnp.where(own, local, e).reshape(-1), order)  # [T*K] each sorted row's local expert (e: none)

    # gate's and up's products of a slice of the hidden units are partial: summed over `contract`
    total = (lambda y: jax.lax.psum(y, contract)) if contract is not None else (lambda y: y)

    def project(h: jax.Array, w: jax.Array, i: int) -> jax.Array:
        whole = total if i < 2 else (lambda y: y)
        y = whole(grouped_matmul(h, w.astype(dtype), sizes, implementation, offset=offset))
        if lora is not None and lora[i] is not None:
            a, b = (v.astype(dtype) for v in lora[i])
            ha = whole(grouped_matmul(h, a, sizes, implementation)).astype(dtype)
            y = y + lora_scale * grouped_matmul(ha, b, sizes, implementation)
        if biases is None:
            return y
        bias = jnp.take(biases[i].astype(jnp.float32), jnp.minimum(owner, e - 1), axis=0)
        return y + jnp.where((owner < e)[:, None], bias, 0.0)  # another shard's rows stay 0 (their weight is 0)

    g, u = project(rows, gate, 0), project(rows, up, 1)
    h = (jax.nn.silu(g) * u if swiglu is None else clamped_swiglu(g, u, *swiglu)).astype(dtype)
    y = project(h, down, 2)  # [T*K, D], sorted
    y = jnp.zeros_like(y).at[order].set(y).reshape(t, k, -1)  # back to (token, slot) order
    return jnp.einsum("tk,tkd->td", jnp.where(own, weights.astype(jnp.float32), 0.0), y)


def experts_apply_sharded(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
                          down: jax.Array, dtype: jnp.dtype = jnp.float32, axis: str = "expert",
                          biases: tuple[jax.Array, ...] | None = None,
                          swiglu: tuple[float, float] | None = None, implementation: str = "ragged_dot",
                          lora: tuple | None = None, lora_scale: float = 0.0, layer: jax.Array | None = None,
                          moves: bool | None = None) -> jax.Array:
    """`experts_apply` with the E experts split as the rule table splits them on the context mesh (over `axis`,
    then `tensor`, as far as those divide E: n shards of E / n, in order): x [B, T, D], experts / weights [B, T, K],
    gate / up [E, D, F], down [E, F, D] -> [B, T, D] float32.

    Expert parallelism in a `jax.shard_map` over the whole mesh: rows split as the batch is (data x fsdp, where
    they divide; the expert and tensor axes carry no rows, so every shard of them holds the same tokens and no
    token is gathered), each device holds E / n whole experts (their fsdp split is gathered on entry, as FSDP
    gathers a layer where it is used) and computes only its experts' (token, expert) pairs, first = index * E / n;
    one psum over the expert axes adds the n partial sums: y = sum_shards sum_{k: e_tk on the shard} w_tk expert(x_t).
    Whole experts on a tensor shard rather than a slice of each: a slice F / t of every expert (Qwen3-30B-A3B's
    768 / 4 = 192 columns) is stored in the TPU's 128-lane tiles as 256, a third more bytes for a decode step to
    read. Where `tensor` does not divide E but F, each expert's hidden units are split over it as a dense MLP's are
    (Megatron's tensor parallelism: gate / up [E', D, F / t], down [E', F / t, D]; the activation is elementwise in
    F) and the same psum adds the t partial sums. Either way no device gathers another's experts, which would bring
    every expert to every chip at every decode step.
    A mesh that splits no experts: `experts_apply` itself, except for megablox on more than one device, which runs
    in the same `shard_map` with every expert on every device (n = 1: XLA cannot partition a Mosaic kernel).
    `biases` [E, ...] and the adapters `lora` split as the experts are (with F over tensor: down's bias added by one
    tensor shard only; gate's and up's A and down's B whole on every tensor shard). `axis`'s size must divide E.

    A few rows against experts split over fsdp along D (a decode step on an FSDP mesh: `moves`, by default
    `moving_rows` for the experts' dtype; quantized experts' caller decides from their codes): the experts stay and
    the rows move
    (`experts_apply`'s `contract`): each device gathers its data shard's rows, projects its slice of their hidden
    units, the partial products of gate and up are summed over fsdp, and each device's D / n output columns go
    back to the rows' devices (an all-to-all). Gathering a layer's experts instead would move 1.2 GB of
    Qwen3-30B-A3B's per step and layer to every chip of a v5e-8; the rows' partial sums are 12.6 MB.

    `layer`: gate / up / down are every layer's, [L, E, ...], as `experts_apply` takes them. They enter the
    `shard_map` whole where they already lie as its shards (a sampler's own mesh, one device, or fsdp where the rows
    move); where an FSDP mesh gathers the experts the layer's are sliced out first, as the layer is gathered anyway
    (gathering the stack would bring every layer's experts to every device at every layer).
    """
    mesh = jax.sharding.get_abstract_mesh()
    b, t, d = x.shape
    e_all = gate.shape[-3]
    n = 1 if mesh.empty else mesh.shape.get(axis, 1)
    if e_all % n:
        raise ValueError(f"{e_all} experts do not split over the {n} devices of the mesh axis {axis!r}")
    # the experts' mesh axes and each expert's F's, as the rule table lays them out (`mesh.LOGICAL_RULES`: the
    # experts over `expert` x `tensor` as far as those divide E, F over `tensor` where that is left)
    split, tp = (None, None) if mesh.empty else (
        _nontrivial(entry, mesh) for entry in (*fit_spec(("expert", "mlp"), (e_all, gate.shape[-1]), mesh),
                                               None, None)[:2])
    summed = tuple(a for entry in (split, tp) for a in _names(entry))  # the axes whose shards hold partial sums
    rows = None if mesh.empty else (*fit_spec(("batch",), (b,), mesh), None)[0]
    # A few rows against experts split over fsdp (a decode step on the FSDP training mesh: 64-256 rows x K pairs
    # against a layer's 1.2 GB of Qwen3-30B-A3B experts): the rows move, not the weights (`moving_rows`)
    if moves is None:
        moves = moving_rows(b, t, experts.shape[-1], gate.shape[-3:], gate.dtype.itemsize)
    contract = "fsdp" if moves else None
    if not summed and contract is None and (mesh.empty or implementation == "ragged_dot" or mesh.size == 1):
        flat = lambda a: a.reshape(b * t, -1)  # noqa: E731
        return experts_apply(flat(x), flat(experts), flat(weights), gate, up, down, dtype, biases,
                             swiglu, implementation=implementation, lora=lora, lora_scale=lora_scale, layer=layer
                             ).reshape(b, t, d)
    spec = P(rows, None, None)
    wanted = ((split, contract, tp), (split, contract, tp), (split, tp, contract))  # each projection's shards
    stored = (("embed", "mlp"), ("embed", "mlp"), ("mlp", "embed"))  # their logical axes after (layers, expert)
    if layer is not None and not all(
            _laid_out(fit_spec(("layers", "expert", *axes), w.shape, mesh), (None, *want), mesh)
            for w, axes, want in zip((gate, up, down), stored, wanted, strict=True)):
        gate, up, down, layer = gate[layer], up[layer], down[layer], None
    stacked = (None,) if layer is not None else ()
    gathered = contract is not None and contract in _names(rows)  # the rows gathered over fsdp, and scattered back

    def local(x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array,
              down: jax.Array, biases: tuple[jax.Array, ...] | None, lora: tuple | None, layer: jax.Array | None
              ) -> jax.Array:
        if gathered:
            x, experts, weights = (jax.lax.all_gather(a, contract, axis=0, tiled=True) for a in (x, experts, weights))
        bl = x.shape[0]
        # the tokens as varying along the summed axes (each shard uses them for its own pairs / hidden units): the
        # transpose then adds the shards' cotangents (a psum). Without it the row gather by the shard's (varying)
        # order is typed invariant (the gather takes its operand's type) and its cotangent is summed over the
        # shards before the scatter back by each shard's own order: x's gradient came out wrong (measured: off by
        # its own size)
        flat = lambda a: (jax.lax.pcast(a, summed, to="varying") if summed else a).reshape(bl * t, -1)  # noqa: E731
        first = 0 if split is None else jax.lax.axis_index(split) * gate.shape[-3]
        if biases is not None and tp is not None:  # down's bias once in the sum over the tensor shards
            biases = (*biases[:2], jnp.where(jax.lax.axis_index(tp) == 0, biases[2], jnp.zeros_like(biases[2])))
        y = experts_apply(flat(x), flat(experts), flat(weights), gate, up, down, dtype, biases, swiglu, first,
                          implementation, lora, lora_scale, layer, contract)
        y = (jax.lax.psum(y, summed) if summed else y).reshape(bl, t, -1)
        if gathered:  # each device its own rows back, with all D columns
            return jax.lax.all_to_all(y, contract, 0, 2, tiled=True)
        if contract is None:
            return y
        # rows not split over fsdp (a batch it does not divide): every device has them all and its D / n columns,
        # put in place and summed (rather than an all-gather, whose transpose differs between shard_map's typed
        # mode, ragged_dot's, and megablox's untyped one, which hands each device 1 / n of a replicated cotangent)
        columns = jnp.zeros((*y.shape[:2], d), y.dtype)
        return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(
            columns, y, jax.lax.axis_index(contract) * y.shape[2], axis=2), contract)

    experts_spec = tuple(P(*stacked, *want) for want in wanted)
    bias_spec = None if biases is None else (P(split, tp), P(split, tp), P(split, contract))
    # an adapter's (A, B) split as its projection: F (gate / up's B, down's A) over tensor, D (gate / up's A, down's
    # B) over fsdp where the weights stay, the rank axis whole
    lora_spec = None if lora is None else tuple(
        None if ab is None else (P(split, tp, None), P(split, None, contract)) if i == 2
        else (P(split, contract, None), P(split, None, tp)) for i, ab in enumerate(lora))
    # megablox's kernel declares its output without a varying-axes type, which shard_map's check refuses
    layer_spec = None if layer is None else P()
    fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, *experts_spec, bias_spec, lora_spec, layer_spec),
                       out_specs=spec, check_vma=implementation == "ragged_dot")
    return fn(x, experts, weights, gate, up, down, biases, lora, layer)


def moving_rows(rows: int, tokens: int, k: int, shape: tuple[int, int, int], itemsize: float) -> bool:
    """`rows_move` on the context mesh for a routed layer of x [rows, tokens, D], K experts a token, experts gate
    [E, D, F] (`shape`) stored at `itemsize` bytes a weight (4-bit codes: about half a byte): where the rule table
    splits the experts over fsdp along D (`embed`) and the batch's split (data x fsdp) leaves few pairs per data
    shard. False without a mesh or fsdp."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("fsdp", 1) == 1:
        return False
    e, d, f = shape
    on_d = lambda axes, dims, i: "fsdp" in _names((*fit_spec(axes, dims, mesh), None, None, None)[i])  # noqa: E731
    if not (on_d(("expert", "embed", "mlp"), (e, d, f), 1) and on_d(("expert", "mlp", "embed"), (e, f, d), 2)):
        return False
    batch = (*fit_spec(("batch",), (rows,), mesh), None)[0]
    others = math.prod(mesh.shape[a] for a in _names(batch) if a != "fsdp")  # the rows' other splits (data)
    return rows_move(rows * tokens * k // others, e, d, itemsize)


def _names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """A PartitionSpec entry's mesh axes: None -> (), "tensor" -> ("tensor",), a tuple as it is."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _nontrivial(entry: str | tuple[str, ...] | None, mesh: jax.sharding.AbstractMesh
                ) -> str | tuple[str, ...] | None:
    """A PartitionSpec entry without the mesh axes of size 1 (they split nothing): ("expert", "tensor") on tensor 1
    -> "expert"; None where none is left."""
    kept = tuple(a for a in _names(entry) if mesh.shape[a] > 1)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _laid_out(spec: P, want: tuple, mesh: jax.sharding.AbstractMesh) -> bool:
    """Whether an array stored with `spec` is split exactly as `want` (an entry a dimension's mesh axes or None:
    whole) on `mesh`, whose axes of size 1 split nothing. Example: P(None, None, "fsdp", "tensor") on fsdp 1 x
    tensor 4 is (None, None, None, "tensor")."""
    padded = tuple(spec) + (None,) * (len(want) - len(spec))
    return [_nontrivial(e, mesh) for e in padded] == [_nontrivial(e, mesh) for e in want]


def route_mismatch(recorded: jax.Array, chosen: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """How many recorded routing decisions the router would not make itself: recorded [..., K] experts (e.g. the
    sampler's; -1: no record, a dense layer or a token never fed), chosen [..., K] the router's own top-K, mask
    [...] (which tokens count) -> (mismatched, decisions) float32 scalars over the (token, slot) pairs with a
    record and the mask: decisions counts them, mismatched those whose recorded expert is not among the chosen
    (as sets: the same experts in another order match).
    Example: recorded [[0, 2], [1, 3], [-1, -1]], chosen [[2, 0], [1, 2], [0, 1]], mask [1, 1, 1] -> (1, 4)."""
    counted = (recorded >= 0) & (mask[..., None] > 0)  # [..., K]
    found = jnp.any(recorded[..., :, None] == chosen[..., None, :], axis=-1)  # [..., K]
    return jnp.sum(counted & ~found, dtype=jnp.float32), jnp.sum(counted, dtype=jnp.float32)


def load_balancing_stats(logits: jax.Array, token_weights: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """One routed layer's share of transformers' `load_balancing_loss_func` (with an attention mask): per expert,
    the weighted count of tokens whose top-k of softmax(logits) holds it (the router's own choice, whatever was
    replayed), and the weighted sum of its probability. logits [T, E], token_weights [T] (the mask; a prompt shared
    by G completions weighs G) -> (counts [E] (no gradient, as HF's), probs [E]) float32.
    Example: logits [[0, 0, ln 2]], weights [2], k 1 -> counts [0, 0, 2], probs [0.5, 0.5, 1.0]."""
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w = token_weights.astype(jnp.float32)
    _, chosen = jax.lax.top_k(p, k)
    counts = jnp.zeros(logits.shape[-1], jnp.float32).at[chosen.reshape(-1)].add(jnp.repeat(w, k))
    return jax.lax.stop_gradient(counts), jnp.einsum("t,te->e", w, p)


def load_balancing_loss(counts: jax.Array, probs: jax.Array, rows: jax.Array) -> jax.Array:
    """transformers' load-balancing loss from `load_balancing_stats` summed over the routed layers: counts, probs
    [E], rows = (routed layers) x (weighted tokens) -> E * sum_e (counts_e / rows) (probs_e / rows), a scalar.
    Balanced routing gives K. Example: counts [2, 0], probs [1.2, 0.8], rows 2 -> 2 * (1 * 0.6) = 1.2."""
    rows = jnp.maximum(rows, 1.0)
    return counts.shape[-1] * jnp.sum((counts / rows) * (probs / rows))


# the 16 values of a 4-bit FP4 (E2M1) code, as transformers' `FP4_VALUES`: bit 3 the sign
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An MXFP4 tensor as GPT-OSS checkpoints store experts (transformers' `convert_moe_packed_tensors`): blocks
    [E, R, G, 16] uint8 (two FP4 codes a byte, the low nibble first), scales [E, R, G] uint8 (a power of two per 32
    values, biased by 127) -> float32 [E, G * 32, R] (the last two axes swapped: the in-memory layout):
    out[e, 32 g + j, r] = FP4_VALUES[code_j] * 2 ** (scales[e, r, g] - 127). Exact in float32 (host numpy).
    Example: one byte 0x21 with scale 128 -> [0.5 * 2, 1.0 * 2] = [1.0, 2.0]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.ndim != 4:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected [E, R, G, B], [E, R, G]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [E, R, G, B, 2]: low nibble first
    values = FP4_VALUES[codes].reshape(*blocks.shape[:-1], -1)  # [E, R, G, 2B]
    out = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None]).astype(np.float32)
    return np.ascontiguousarray(out.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1))
