"""LoRA: train low-rank adapters on a frozen base model; the reference is the base with its adapters off (or, for
adapters that start from given values, the base with a frozen copy of them: `rloo_jax.policy.policy`).

Plain pytrees all the way (the research API):

    base_model = load_causal_lm(path)                          # no adapters
    model = with_adapters(base_model, lora_spec("llama", 16, 32), key)   # same base, A random, B = 0
    graphdef, adapters, base = split_adapters(model)           # adapters: the only trainable State
    ref_graphdef = nnx.graphdef(base_model)                    # the reference: nnx.merge(ref_graphdef, base)
    logps = completion_logps(graphdef, merge_params(base, adapters), ...)   # gradients w.r.t. adapters only

A projection with an adapter computes y = x W + scale * dropout(x) A B (A [din, r], B [r, dout], scale = alpha / r
or alpha / sqrt(r) with rsLoRA); B starts at zero, so the first policy equals the base exactly. Adapters are
`LoRAParam`s (a `Param` type of their own) next to the weights they adapt, stacked on the layer axis with
`scan_layers` and sharded by the same rule table (the rank axis over fsdp where the other axis is not). Export:
`models.save_adapter` (a PEFT folder), `merge_adapters` (a plain model with W + scale * A B).

QLoRA: `quantize_base(base_model, QuantSpec("nf4"))` stores the base's block projections (and a mixture of
experts' experts) quantized (`rloo_jax.quant`) before `with_adapters`; `dequantize_base` makes it a plain model
again.

A mixture of experts' experts get adapters only when `spec.target_parameters` names them (peft's
`target_parameters`): per expert A [E, din, r], B [E, r, dout] (`transformer.MoE`), merged as W_e + scale A_e B_e.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from rloo_jax import quant
from rloo_jax.models.config import LoRASpec, ModelConfig, ModelLoadError, lora_spec
from rloo_jax.models.transformer import MLP, Attention, CausalLM, Dense, LoRAParam, MoE
from rloo_jax.quant import QuantSpec

__all__ = [
    "LoRAParam",
    "LoRASpec",
    "QuantSpec",
    "dequantize_base",
    "init_adapters",
    "lora_spec",
    "merge_adapters",
    "merge_params",
    "quantize_base",
    "split_adapters",
    "with_adapters",
]


def _name(path: tuple) -> tuple[str, int | None]:
    """A parameter's path without its layer index, and that index in the list layout (None when stacked)."""
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path if not hasattr(k, "name")]  # not `.value`
    if len(keys) > 2 and keys[1] == "layers" and keys[2].isdigit():
        return ".".join(keys[:2] + keys[3:]), int(keys[2])
    return ".".join(keys), None


def init_adapters(adapters: nnx.State, key: jax.Array) -> nnx.State:
    """peft's initialisation: every A ~ U(-1/sqrt(din), 1/sqrt(din)) (kaiming-uniform, a = sqrt(5)), every B = 0.

    Each layer's A is drawn from fold_in(fold_in(key, crc32(name)), layer), so the stacked and the list layouts
    hold the same numbers. An expert adapter's A [E, din, r] (peft's `ParamWrapper`: kaiming-uniform on its
    [E * r, din] weight, the same bound) is one draw per layer. `adapters` may be abstract (`nnx.eval_shape`): the
    values only need its shapes.
    """
    def one(path: tuple, x: jax.Array) -> jax.Array:
        name, layer = _name(path)
        if not name.endswith("lora_a"):
            return jnp.zeros(x.shape, x.dtype)
        k = jax.random.fold_in(key, zlib.crc32(name.encode()))
        din = x.shape[-2]
        bound = 1.0 / din**0.5
        ndim = 3 if name.rsplit(".", 1)[-1].startswith("experts_") else 2  # one layer's A: [E, din, r] or [din, r]

        def draw(i: int) -> jax.Array:
            return jax.random.uniform(jax.random.fold_in(k, i), x.shape[-ndim:], jnp.float32, -bound, bound)

        value = draw(layer or 0) if x.ndim == ndim else jnp.stack([draw(i) for i in range(x.shape[0])])
        return value.astype(x.dtype)

    return jax.tree_util.tree_map_with_path(one, adapters)


def with_adapters(model: CausalLM, spec: LoRASpec, key: jax.Array, param_dtype: str | None = None) -> CausalLM:
    """`model` (no adapters) with adapters on `spec.targets`, initialised by `init_adapters` and stored in
    `param_dtype` (default: the model's); its base parameters are the very arrays of `model`. An abstract model
    (`nnx.eval_shape`) gives an abstract result."""
    if model.config.lora is not None:
        raise ValueError("the model already has adapters")
    if spec.experts and not model.config.is_moe:
        raise ModelLoadError(f"lora_target_parameters {', '.join(spec.target_parameters)}: a "
                             f"{model.config.model_type} model has no experts (they are a mixture of experts')")
    cfg = model.config.replace(lora=spec, param_dtype=param_dtype or model.config.param_dtype)
    graphdef, abstract_adapters, _ = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, nnx.Rngs(0))), LoRAParam, ...)
    base = nnx.state(model, nnx.Param)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(base)):
        adapters = jax.eval_shape(lambda: init_adapters(abstract_adapters, key))
    else:
        adapters = init_adapters(abstract_adapters, key)
    return nnx.merge(graphdef, adapters, base)


def split_adapters(model: CausalLM) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, adapters, base): the adapters (`LoRAParam`s) apart from every other parameter."""
    graphdef, adapters, base = nnx.split(model, LoRAParam, ...)
    return graphdef, adapters, base


def merge_params(base: nnx.State, adapters: nnx.State) -> nnx.State:
    """One State of the whole model (what `nnx.merge(graphdef, ...)` and `completion_logps` take)."""
    return nnx.merge_state(base, adapters)


def merge_adapters(model: CausalLM) -> CausalLM:
    """A plain model (no adapters) whose weights are W + scale * A B, computed in float32 and stored in W's
    dtype: the same function as the adapted model up to that rounding (exact to float32 for float32 weights). A
    quantized base is dequantized first (`dequantize_base`, into the compute dtype), so W is what the policy
    multiplied by."""
    if model.config.quant is not None:
        model = dequantize_base(model)
    spec = model.config.lora
    if spec is None:
        return model
    model = nnx.clone(model)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, MoE):
            _merge_experts(node, spec.scale)
        if not isinstance(node, Attention | MLP):
            continue
        shared = getattr(node, "qkv_lora_a", None) or getattr(node, "gate_up_lora_a", None)  # a fused A
        for dense in (getattr(node, n, None) for n in ("q", "k", "v", "o", "gate", "up", "down")):
            if not isinstance(dense, Dense) or dense.lora_b is None:
                continue
            a = (dense.lora_a if dense.lora_a is not None else shared)[...].astype(jnp.float32)
            delta = jnp.einsum("...ir,...ro->...io", a, dense.lora_b[...].astype(jnp.float32))
            w = dense.kernel[...]
            dense.kernel[...] = (w.astype(jnp.float32) + spec.scale * delta).astype(w.dtype)
    plain = nnx.eval_shape(lambda: CausalLM(model.config.replace(lora=None), nnx.Rngs(0)))
    return nnx.merge(nnx.graphdef(plain), split_adapters(model)[2])


def _merge_experts(node: MoE, scale: float) -> None:
    """A routed MLP's expert weights W_e + scale * A_e B_e in place (float32, stored in W's dtype); peft's
    `ParamWrapper.merge` adds the same per-expert delta to the 3-D parameter."""
    for name, a, b in (("gate", node.experts_gate_up_lora_a, node.experts_gate_lora_b),
                       ("up", node.experts_gate_up_lora_a, node.experts_up_lora_b),
                       ("down", node.experts_down_lora_a, node.experts_down_lora_b)):
        if a is None:
            continue
        delta = jnp.einsum("...eir,...ero->...eio", a[...].astype(jnp.float32), b[...].astype(jnp.float32))
        w = getattr(node, f"experts_{name}")
        w[...] = (w[...].astype(jnp.float32) + scale * delta).astype(w[...].dtype)


# ------------------------------------------------------------------------------------------------ QLoRA
def _dotted(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", k)) for k in path)


def _rebuild(model: CausalLM, config: ModelConfig, leaf: Callable[[str, Any, dict[str, Any]], Any]) -> CausalLM:
    """A model of `config` (built abstractly) whose parameter at each dotted path p is `leaf(p, its abstract value,
    {path: array} of model)`."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: CausalLM(config, nnx.Rngs(0))))
    source = {_dotted(p): x for p, x in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model)))}
    pure = jax.tree_util.tree_map_with_path(lambda p, x: leaf(_dotted(p), x, source), nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _where(x: Any) -> Any:
    """Compute on the device `x` lives on: a model waiting in host memory is quantized there, not on an
    accelerator (a 70B model's codes alone would not fit one chip)."""
    devices = getattr(x, "devices", None)
    return jax.default_device(next(iter(devices()))) if callable(devices) else contextlib.nullcontext()


def _per_layer(fn: Callable[[Any], Any], x: Any) -> Any:
    """fn(x) for one kernel [din, dout] or stacked kernels [L, din, dout] (one layer at a time, stacked after: the
    host holds one layer's float32 temporaries, not L of them); abstract in, abstract out."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.eval_shape(fn, x)
    with _where(x):
        if x.ndim == 2:
            return fn(x)
        return jax.tree.map(lambda *ys: jnp.stack(ys), *(fn(x[i]) for i in range(x.shape[0])))


_STORED = {"qkernel": "codes", "qscale": "scale", "qscale2": "scale2"}  # Dense's attribute -> quant's name


def _stored(path: str) -> tuple[str, str] | None:
    """A quantized parameter's dotted path -> (the path of the weight it stores, quant's name for it): a Dense's
    `x.qscale` -> ("x.kernel", "scale"), MoE's `x.experts_up_codes` -> ("x.experts_up", "codes"); None for any
    other parameter."""
    stem, _, name = path.rpartition(".")
    if name in _STORED:
        return f"{stem}.kernel", _STORED[name]
    weight, _, part = name.rpartition("_")
    if weight in ("experts_gate", "experts_up", "experts_down") and part in ("codes", "scale", "scale2"):
        return f"{stem}.{weight}", part
    return None


def quantize_base(model: CausalLM, spec: QuantSpec) -> CausalLM:
    """`model` (no adapters, not yet quantized) with its block projections' kernels, and a mixture of experts'
    expert weights (each expert's [din, dout] alone, as a kernel), quantized by `spec`
    (`rloo_jax.quant.quantize`: codes + scales), once, on the device the weights are on; embeddings, the LM head,
    norms, routers and biases kept as they are (bitsandbytes keeps the LM head, and fused 3-D expert parameters,
    too). An abstract model (`nnx.eval_shape`) gives an abstract result."""
    if model.config.lora is not None or model.config.quant is not None:
        raise ValueError("quantize the base before adding adapters, and only once")
    one = jax.jit(lambda w: quant.quantize(w, spec))
    done: dict[str, dict[str, Any]] = {}

    def leaf(path: str, _: Any, source: dict[str, Any]) -> Any:
        stored = _stored(path)
        if stored is None:
            return source[path]
        weight, name = stored
        if weight not in done:
            done[weight] = _per_layer(one, source[weight])
        return done[weight][name]

    return _rebuild(model, model.config.replace(quant=spec), leaf)


def dequantize_base(model: CausalLM, dtype: str | None = None) -> CausalLM:
    """A quantized model (adapters, if any, kept) as a plain one: every quantized kernel and expert weight
    dequantized into `dtype` (default: the compute dtype, what the forward multiplies by).
    `dequantize_base(quantize_base(m, s))` computes what the quantized model computes, up to the order of the
    float32 sums in its blocked matmul (the experts, dequantized before their grouped matmuls: exactly)."""
    spec = model.config.quant
    if spec is None:
        return model
    dt = jnp.dtype(dtype or model.config.dtype)

    def leaf(path: str, target: Any, source: dict[str, Any]) -> Any:
        if path in source:  # not a quantized weight
            return source[path]
        stored = {}
        for p, x in source.items():
            weight = _stored(p)
            if weight is not None and weight[0] == path:
                stored[weight[1]] = x
        shape = target.shape
        if isinstance(stored["codes"], jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(shape, dt)
        with _where(stored["codes"]):
            w = quant.dequantize(stored, spec, dt)
            return (w if spec.kind == "int8" else quant.unblock(w)).reshape(shape)

    return _rebuild(model, model.config.replace(quant=None), leaf)
