"""Device meshes, the logical-axis rule table, and multi-host helpers ("sharding is data").

Model code names logical axes on every parameter (``embed``, ``mlp``, ``heads``, ``kv``, ``vocab``; see
``rloo_jax.models.logical_axes``); ONE small table here maps them onto three mesh axes:

- ``data``:   pure data parallelism; parameters are replicated along it (gradients all-reduced over it).
- ``fsdp``:   data parallelism whose devices also split every parameter (and its optimizer state) along the hidden
              dimension ``embed``; XLA gathers one layer's weights at a time where they are used.
- ``tensor``: Megatron-style model parallelism: the wide dimensions (MLP hidden, attention heads, KV heads,
              vocabulary) are split, so activations of one row are split too.
- ``expert``: expert parallelism (a mixture of experts): the experts ``[E, ...]`` are split, E / n whole experts
              per device (fsdp still splits each on ``embed``); every other weight and the batch are replicated
              along it. Only in a mesh made with ``expert`` > 1 (``make_mesh``): the default mesh has the three
              axes above. The rule ``expert -> (expert, tensor)`` also splits the experts over ``tensor`` where
              it divides them (whole experts per tensor shard, not a slice of every expert).

A batch ``[B, ...]`` is split over ``data x fsdp``. A mesh axis that does not divide a dimension is dropped for
that dimension (the dimension is replicated along it), so tiny test models and odd batch sizes still run.

Multi-host: ``initialize_distributed()`` (explicit coordinator, or auto-detected SLURM / Open MPI / TPU pod), each
process loads ``process_slice(...)`` of the prompts, ``host_local_batch_to_global`` makes the global array, and
``local_rows`` reads this process's rows of a global result back (e.g. completions to decode and reward).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from rloo_jax.efficiency import weights_stay

__all__ = [
    "BATCH_AXES",
    "KV_CACHE_AXES",
    "LOGICAL_RULES",
    "EXPERT_MESH_AXES",
    "MESH_AXES",
    "batch_sharding",
    "constrain",
    "constrain_batch",
    "detect_cluster",
    "fit_spec",
    "host_local_batch_to_global",
    "initialize_distributed",
    "kv_cache_sharding",
    "local_rows",
    "logical_to_spec",
    "make_mesh",
    "mesh_sizes",
    "param_shardings",
    "pin_layout",
    "process_slice",
    "replicate",
    "replicated",
    "reshaped",
    "rollout_shape",
    "row_major",
    "stationary_side",
    "host_memory",
    "shard_params",
    "state_shardings",
]

MESH_AXES = ("data", "fsdp", "tensor")
EXPERT_MESH_AXES = ("data", "fsdp", "expert", "tensor")  # a mesh with expert parallelism (`make_mesh` expert > 1)
BATCH_AXES = ("data", "fsdp")

Rules = Mapping[str, str | tuple[str, ...] | None]

# The one rule table. Why these: `embed` is in every weight, so FSDP along it splits all parameters (and Adam's
# two moments) by the fsdp size; the Megatron pairs (gate/up split on `mlp`, down on `mlp`; q/k/v on heads/kv, o
# on heads) keep one tensor all-reduce per block; `vocab` on tensor splits the largest matrices of small models
# (embedding, lm head) and the [N, V] logits. Batches go over data x fsdp (every data-parallel device). The layer
# axis of the stacked blocks is never split: a scan step needs its whole layer on every device of its shard.
LOGICAL_RULES: Rules = {
    "batch": BATCH_AXES,
    "layers": None,  # the stacked blocks' leading axis: every device holds its slice of every layer
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv": "tensor",
    "vocab": "tensor",
    "lora_rank": "fsdp",  # LoRA's rank axis: over fsdp where the adapter's other axis is not (`fit_spec`)
    # a mixture of experts' expert axis [E, ...]: over `expert` where the mesh has one, then `tensor`, so that a
    # tensor shard holds whole experts and `mlp` stays whole in them (a slice F / t of every expert, Qwen3-30B-A3B's
    # 768 / 4 = 192 columns, is stored in 128-lane TPU tiles as 256: a third more bytes for a decode step to read)
    "expert": ("expert", "tensor"),
    # the sampler's LM head [D, V] on an FSDP mesh (`sampling.rollout_weights`): V over fsdp, D over tensor, so that
    # a decode step's few rows go to the head and come back as their logits (`mesh.stationary_side` 1): left split
    # along D, each chip wrote and all-reduced float32 partial logits of all rows ([256, 201,088] for gpt-oss-20b)
    "decode_embed": "tensor",
    "decode_vocab": "fsdp",
}


# ----------------------------------------------------------------------------------------------- the mesh


def make_mesh(
    data_parallel: int = 1,
    fsdp: int = -1,
    tensor_parallel: int = 1,
    devices: Sequence[jax.Device] | None = None,
    expert_parallel: int = 1,
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (default: all devices of all processes); with
    ``expert_parallel`` > 1 a ``(data, fsdp, expert, tensor)`` one (`EXPERT_MESH_AXES`).

    One of the data / fsdp / tensor sizes may be ``-1``: it takes the remaining devices. E.g. 8 devices,
    ``(2, -1, 2)`` -> shape ``(2, 2, 2)``; ``(1, -1, 1)``, expert 4 -> ``(1, 2, 4, 1)``. Axis types are Auto, so
    the compiler propagates shardings and ``with_sharding_constraint`` works (``jax.make_mesh`` defaults to
    Explicit axes).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data_parallel": data_parallel, "fsdp": fsdp, "tensor_parallel": tensor_parallel}
    if expert_parallel != 1:
        if expert_parallel < 1:
            raise ValueError(f"expert_parallel must be a positive size, got {expert_parallel}")
        sizes["expert_parallel"] = expert_parallel
    shape = _resolve_mesh_shape(sizes, len(devices))
    axes = MESH_AXES
    if expert_parallel != 1:  # data, fsdp, expert, tensor: the expert axis between fsdp and tensor
        axes, shape = EXPERT_MESH_AXES, (shape[0], shape[1], expert_parallel, shape[2])
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Auto,) * len(axes), devices=devices)


def mesh_sizes(mesh: Mesh) -> tuple[int, int, int]:
    """A mesh's (data, fsdp, tensor) sizes, whether or not it has an expert axis."""
    return mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]


def reshaped(mesh: Mesh, shape: Sequence[int]) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh of ``shape`` over the very devices of ``mesh``, in the same order: e.g. the
    sampler's own layout of a training mesh (``rollout_shape``). The same rule table lays arrays out on it, and
    one jitted program may use both (a constraint onto the other mesh is a resharding between their layouts).
    ``shape`` (data, fsdp, tensor) of ``mesh`` itself gives ``mesh``; an expert axis is kept (its size, between
    fsdp and tensor). E.g. a (1, 8, 1) mesh reshaped (1, 1, 8): the fsdp axis's devices become the tensor axis's,
    in order."""
    shape = tuple(shape)
    if shape == mesh_sizes(mesh):
        return mesh
    return make_mesh(*shape, devices=list(mesh.devices.flat), expert_parallel=mesh.shape.get("expert", 1))


def rollout_shape(
    train_shape: Sequence[int],
    copy_bytes: float,
    device_bytes: float | None,
    heads: int,
    kv_heads: int,
    fraction: float = 0.25,
) -> tuple[int, int, int]:
    """The sampler's ``(data, fsdp, tensor)`` sizes for a training mesh of ``train_shape`` (the rule behind
    ``rollout_mesh`` None).

    Where training splits the weights over fsdp, a decode step on the training mesh would all-gather every
    layer from the other devices at every generated token. The sampler instead takes a mesh of its own over the
    same devices, fsdp 1 (each device holds its share of one compute-dtype copy of the weights, ``copy_bytes /
    tensor``, moved there once per generation), data-parallel over the devices its tensor parallelism leaves:

    - the training mesh's tensor size (whole weights per tensor shard) where that share is at most ``fraction`` of
      a device's memory: decoding then adds no collective at all;
    - else the largest tensor size ``t`` that divides the devices, the query heads and the KV heads (the KV cache
      splits by KV head; a multiple of training's), where ``copy_bytes / t`` is at most that: a tensor-parallel
      step adds two all-reduces per layer whatever ``t``, and each device reads and holds the least;
    - else, or with no fsdp in training or no memory figure (CPU): the training mesh itself.

    E.g. 8 devices, training (1, 8, 1), 32 heads / 8 KV heads, 16.9 GB devices (a 4.2 GB budget): 3 GB of weights
    -> (8, 1, 1); 16 GB -> t = 8 (2 GB each): (1, 1, 8); 64 GB -> (1, 8, 1).
    """
    data, fsdp, tensor = (int(x) for x in train_shape)
    n = data * fsdp * tensor
    sizes = [t for t in range(tensor, n + 1, tensor) if not (n % t or heads % t or kv_heads % t)]
    if fsdp == 1 or not device_bytes or not sizes:
        return data, fsdp, tensor
    for t in (tensor, sizes[-1]):
        if copy_bytes / t <= fraction * device_bytes:
            return n // t, 1, t
    return data, fsdp, tensor


def _resolve_mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
    """Fill in the one ``-1`` and check the product equals ``num_devices`` (``ValueError`` naming the options)."""
    described = ", ".join(f"{k}={v}" for k, v in sizes.items())
    free = [k for k, v in sizes.items() if v == -1]
    bad = [k for k, v in sizes.items() if v == 0 or v < -1]
    if bad:
        raise ValueError(f"mesh sizes must be positive or -1 (remaining devices): {described}")
    if len(free) > 1:
        raise ValueError(f"at most one mesh size may be -1 (remaining devices), got {described}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"mesh {described}: the fixed sizes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices, so {free[0]}=-1 has no integer value"
            )
        sizes = {k: (num_devices // fixed if v == -1 else v) for k, v in sizes.items()}
    elif fixed != num_devices:
        raise ValueError(
            f"mesh {described} needs {fixed} devices but {num_devices} are available; "
            "make data_parallel * fsdp * tensor_parallel equal the device count or set one of them to -1"
        )
    return tuple(sizes.values())


# ----------------------------------------------------------------------------------------------- rule table


def _mesh_axes_for(name: str | None, rules: Rules) -> tuple[str, ...]:
    target = rules.get(name) if name is not None else None
    if target is None:
        return ()
    return (target,) if isinstance(target, str) else tuple(target)


def fit_spec(
    logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules = LOGICAL_RULES
) -> PartitionSpec:
    """Logical axis names of an array -> a ``PartitionSpec`` that divides ``shape`` evenly.

    For each dimension, its mesh axes are kept from the left while their sizes' product divides the dimension;
    the first one that does not divide is dropped with everything after it (that dimension is replicated
    along them). A mesh axis is used at most once per array. E.g. mesh (data=2, fsdp=2, tensor=2),
    ``("embed", "mlp")``, shape ``(32, 3)`` -> ``P("fsdp", None)``; ``("batch",)``, shape ``(2,)`` -> ``P("data")``.
    """
    if len(logical) != len(shape):
        raise ValueError(f"logical axes {tuple(logical)} do not match the shape {tuple(shape)}")
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for name, dim in zip(logical, shape, strict=True):
        kept: list[str] = []
        for axis in _mesh_axes_for(name, rules):
            if axis not in mesh.shape:  # e.g. `expert` on a mesh without expert parallelism
                continue
            if axis in used or dim % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]):
                break
            kept.append(axis)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:  # P("fsdp", None) == P("fsdp"); the short form reads better in goldens
        spec.pop()
    return PartitionSpec(*spec)


def logical_to_spec(logical: Sequence[str | None], mesh: Mesh, rules: Rules = LOGICAL_RULES) -> PartitionSpec:
    """The rule table alone, ignoring shapes: ``("embed", "mlp")`` -> ``P("fsdp", "tensor")``."""
    return fit_spec(logical, [math.prod(mesh.shape.values())] * len(logical), mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    """A fully replicated sharding on ``mesh`` (scalars, keys, reward weights, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: Sequence[int] | None = None) -> NamedSharding:
    """Rows of a ``[B, ...]`` array over ``data x fsdp``; with ``shape``, axes not dividing ``B`` are dropped."""
    if shape is None:
        return NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    return NamedSharding(mesh, fit_spec(["batch"] + [None] * (len(shape) - 1), shape, mesh))


def constrain_batch(x: jax.Array, mesh: Mesh, axis: int = 0) -> jax.Array:
    """Inside a jit: ``x``'s dimension ``axis`` split over data x fsdp (others replicated), where it divides."""
    logical = [None] * x.ndim
    logical[axis] = "batch"
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, fit_spec(logical, x.shape, mesh)))


def constrain(x: jax.Array, logical: Sequence[str | None], rules: Rules = LOGICAL_RULES) -> jax.Array:
    """Inside a function traced under a mesh (``jax.sharding.use_abstract_mesh``, as ``rloo_jax.programs`` traces on a
    mesh): ``x`` laid out by the logical names of its dimensions, e.g. activations ``("batch", None, None)``; a
    no-op without one. Without these the partitioner may keep a whole batch on every device (it saw only the
    weights' layout) and compute it there, which the TPU compiler did for the training forward."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, fit_spec(logical, x.shape, mesh, rules))


def stationary_side(rows: int, shape: tuple[int, int], axes: tuple[str | None, str | None], itemsize: int
                    ) -> int | None:
    """Which side of a weight [din, dout] (`shape`, logical `axes`) split over fsdp a product with `rows` rows
    (split over data x fsdp) should leave it split on, on the context mesh: 0 (din: q, k, v, gate, up), 1 (dout: o,
    down), or None to gather the weight (a training micro-batch, a long prefill; no fsdp; the weight or the rows
    not split over fsdp). By the bytes each chip receives (`efficiency.weights_stay`, one data shard's rows)."""
    mesh = jax.sharding.get_abstract_mesh()
    n = 1 if mesh.empty else mesh.shape.get("fsdp", 1)
    if n == 1 or "fsdp" not in _entry_names((*fit_spec(("batch",), (rows,), mesh), None)[0]):
        return None
    spec = (*fit_spec(axes, shape, mesh), None, None)[:2]
    side = next((i for i, a in enumerate(spec) if a == "fsdp"), None)  # fsdp alone on that side
    if side is None or "fsdp" in _entry_names(spec[1 - side]):
        return None
    return side if weights_stay(rows // mesh.shape.get("data", 1), *shape, itemsize, side, n) else None


def _entry_names(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


KV_CACHE_AXES = (None, "batch", "kv", None, None)  # [L, rows, K heads, slots, Dh]


def kv_cache_sharding(mesh: Mesh, shape: Sequence[int], rules: Rules = LOGICAL_RULES) -> NamedSharding:
    """A KV cache ``[L, rows, K, S, Dh]`` (kv-head-major; prompt: rows = B, S = P; generated: rows = N, S = C):
    rows over data x fsdp, K heads over tensor (split as the k/v projections are), where they divide."""
    return NamedSharding(mesh, fit_spec(KV_CACHE_AXES, shape, mesh, rules))


def row_major(x: jax.Array, logical: Sequence[str | None], rules: Rules = LOGICAL_RULES) -> jax.Array:
    """Inside a jit: ``x`` kept in row-major memory layout (last dimension minor), laid out over the context mesh
    by its logical axis names as in `constrain` (`pin_layout`)."""
    return pin_layout(x, logical, tuple(range(x.ndim)), rules)


def pin_layout(x: jax.Array, logical: Sequence[str | None], major_to_minor: Sequence[int],
               rules: Rules = LOGICAL_RULES) -> jax.Array:
    """Inside a jit: ``x`` in the memory layout ``major_to_minor`` (its dimensions from the most major to the
    minor one: ``(0, 1, 2)`` row-major; ``(1, 0, 2)`` the first two swapped), laid out over the context mesh by its
    logical axis names as in `constrain`. The layout is pinned on each device's shard (``shard_map``): XLA's SPMD
    partitioner does not split a layout constraint and would gather the whole array onto every device."""
    layout = Layout(major_to_minor=tuple(major_to_minor))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return with_layout_constraint(x, layout)
    spec = fit_spec(logical, x.shape, mesh, rules)
    pin = jax.shard_map(lambda a: with_layout_constraint(a, layout), mesh=mesh, in_specs=spec, out_specs=spec)
    return pin(jax.lax.with_sharding_constraint(x, spec))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def param_shardings(model_or_state: nnx.Module | nnx.State, mesh: Mesh, rules: Rules = LOGICAL_RULES) -> nnx.State:
    """A State shaped like ``nnx.state(model, nnx.Param)`` with a ``NamedSharding`` in each Variable.

    Accepts a module, its param State (concrete, or abstract from ``nnx.eval_shape``/``jax.eval_shape``): the
    logical names come from each Param's ``out_sharding`` metadata, shapes from its value. Dimensions that a mesh
    axis does not divide are replicated along it (``fit_spec``).
    """
    state = nnx.state(model_or_state, nnx.Param) if isinstance(model_or_state, nnx.Module) else model_or_state

    def one(v: nnx.Variable) -> nnx.Variable:
        logical = v.get_metadata().get("out_sharding") or (None,) * len(v.shape)
        return v.replace(NamedSharding(mesh, fit_spec(tuple(logical), v.shape, mesh, rules)))

    return jax.tree.map(one, state, is_leaf=_is_variable)


def host_memory() -> Any:
    """A context placing new arrays in host memory (JAX's CPU device, uncommitted), where whole weights may wait
    before they are sharded; the default device when the CPU backend is not enabled (JAX_PLATFORMS without cpu)."""
    try:
        return jax.default_device(jax.local_devices(backend="cpu")[0])
    except RuntimeError:
        return contextlib.nullcontext()


def shard_params(params: Any, shardings: Any) -> Any:
    """Place ``params`` (any pytree, e.g. a param State) onto ``shardings`` (same structure or a prefix).

    Single process: ``jax.device_put`` (each device receives only its shard). Multi-process (a sharding spans
    other hosts' devices): every process holds the same full host value and builds its local shards from it.
    """

    def put(x: Any, s: NamedSharding) -> jax.Array:
        if s.is_fully_addressable:
            return jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda index: host[index])

    return jax.tree.map(put, params, shardings)


def _param_like(tree: Any, params: Any) -> bool:
    """A subtree of an optimizer state that mirrors ``params`` (Adam's mu/nu, momentum, ...)."""
    return jax.tree.structure(tree) == jax.tree.structure(params)


def state_shardings(
    train_state: Any,
    mesh: Mesh,
    rules: Rules = LOGICAL_RULES,
    param_fields: Sequence[str] = ("params", "ref_params", "frozen", "value_params", "reward_params"),
) -> Any:
    """Shardings for a whole train state (concrete or ``jax.eval_shape`` abstract): same pytree structure.

    ``params``/``ref_params``/``frozen``/``value_params``/``reward_params``: the rule table (``param_shardings``).
    ``opt_state``: every subtree with the trained parameters' structure (optax moments mirror them: ``params``, or
    ``(params, value_params)`` with a value model) takes their sharding leaf by leaf where the shapes agree
    (factored statistics of another shape are replicated); everything else, e.g. ``count``, ``step``, is
    replicated. ``grad_acc`` (carried gradients, ``rloo_jax.step.Accumulator``): its gradients as the trained
    parameters, the rest replicated.
    """
    params = train_state.params
    if getattr(train_state, "value_params", None) is not None:  # one optimizer over policy and value model
        params = (params, train_state.value_params)
    p_shard = param_shardings(params, mesh, rules)
    p_leaves = jax.tree.leaves(p_shard)
    p_shapes = [x.shape for x in jax.tree.leaves(params)]
    rep = replicated(mesh)

    def mirror(sub: Any) -> Any:
        leaves, treedef = jax.tree.flatten(sub)
        out = [s if x.shape == shape else rep for x, s, shape in zip(leaves, p_leaves, p_shapes, strict=True)]
        return jax.tree.unflatten(treedef, out)

    def opt(sub: Any) -> Any:
        return mirror(sub) if _param_like(sub, params) else jax.tree.map(lambda _: rep, sub)

    fields = {}
    for name in (f.name for f in dataclasses.fields(train_state)):
        value = getattr(train_state, name)
        if name in param_fields and value is not None:
            fields[name] = param_shardings(value, mesh, rules)
        elif name == "opt_state":
            fields[name] = jax.tree.map(opt, value, is_leaf=lambda t: _param_like(t, params))
        elif name == "grad_acc" and value is not None:  # carried gradients: laid out as the trained parameters
            fields[name] = value.replace(grads=mirror(value.grads), stats=jax.tree.map(lambda _: rep, value.stats),
                                         loss=rep)
        else:
            fields[name] = jax.tree.map(lambda _: rep, value)
    return train_state.replace(**fields)


# ----------------------------------------------------------------------------------------------- multi-host


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """Which multi-process launcher started us, from its environment: "slurm", "mpi", "tpu" or None.

    Only launches with more than one process count: a single SLURM task, a 1-rank ``mpirun`` or a single-host
    TPU VM run as one plain process. ``jax.distributed.initialize()`` with no arguments reads the coordinator,
    process count and index from these same environments.
    """
    env = os.environ if environ is None else environ

    def count(name: str) -> int:
        try:
            return int(env.get(name, "1") or "1")
        except ValueError:
            return 1

    if count("SLURM_NTASKS") > 1 or count("SLURM_NPROCS") > 1:
        return "slurm"
    if count("OMPI_COMM_WORLD_SIZE") > 1:
        return "mpi"
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1 or count("MEGASCALE_NUM_SLICES") > 1 or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
        return "tpu"
    return None


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Start JAX's multi-process runtime when this is a multi-process run; returns whether it did.

    Explicit arguments (or the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment
    variables, handy for a few processes on one machine) go to ``jax.distributed.initialize``. Otherwise a SLURM,
    Open MPI or TPU-pod launch is detected and ``jax.distributed.initialize()`` reads its environment; a single
    plain host does nothing. Call before any other JAX work (the backend must not be started yet).
    """
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS") or None
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    if jax.distributed.is_initialized():
        return True
    explicit = (coordinator_address, num_processes, process_id)
    if any(a is not None for a in explicit):
        if any(a is None for a in explicit):
            raise ValueError(
                "initialize_distributed needs all of coordinator_address, num_processes and process_id "
                f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r})"
            )
        if num_processes == 1:
            return False
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
        return True
    if detect_cluster() is None:
        return False
    jax.distributed.initialize()
    return True


def process_slice(global_batch: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """The rows ``[i * b, (i + 1) * b)`` of a global batch that process ``i`` loads, ``b = global_batch / count``.

    Matches ``batch_sharding`` on a mesh from ``make_mesh`` (devices in process order, batch on the leading
    mesh axes). E.g. 8 prompts, 2 processes: process 1 loads ``slice(4, 8)``.
    """
    index = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    if global_batch % count:
        raise ValueError(f"a global batch of {global_batch} cannot be split evenly over {count} processes")
    per = global_batch // count
    return slice(index * per, (index + 1) * per)


def host_local_batch_to_global(
    local: np.ndarray | jax.Array, mesh: Mesh, sharding: NamedSharding | None = None
) -> jax.Array:
    """This process's rows ``[b, ...]`` -> the global ``[b * process_count, ...]`` array, split over the mesh.

    Every process calls it with its own rows (``process_slice``), e.g. prompts, or Python reward-function outputs
    ``[n_local, F]`` that the sharded update consumes as ``[N, F]`` without any host gather. Default sharding:
    ``batch_sharding`` fitted to the global shape.
    """
    local = np.asarray(local)
    global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
    sharding = batch_sharding(mesh, global_shape) if sharding is None else sharding
    return jax.make_array_from_process_local_data(sharding, local, global_shape)


def replicate(value: Any, mesh: Mesh) -> Any:
    """A pytree of host values (the same on every process: keys, reward weights) -> replicated global arrays."""
    rep = replicated(mesh)

    def put(x: Any) -> jax.Array:
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            impl = jax.random.key_impl(x)
            return jax.random.wrap_key_data(put(jax.random.key_data(x)), impl=impl)
        host = np.asarray(x)
        return jax.make_array_from_process_local_data(rep, host, host.shape)

    return jax.tree.map(put, value)


def local_rows(x: jax.Array) -> np.ndarray:
    """The rows of a global ``[N, ...]`` array held by this process's devices, in global order, as numpy.

    The inverse of ``host_local_batch_to_global``: e.g. the completions this process decodes and rewards. A fully
    replicated (or single-process) array gives all rows.
    """
    if x.is_fully_addressable:
        return np.asarray(x)
    shards = x.addressable_shards
    ranges = sorted({_rows(s.index[0], x.shape[0]) for s in shards})
    offset = {}
    total = 0
    for start, stop in ranges:
        offset[start] = total
        total += stop - start
    out = np.empty((total, *x.shape[1:]), x.dtype)
    for s in shards:  # replicas along other mesh axes write the same values
        start, stop = _rows(s.index[0], x.shape[0])
        out[(slice(offset[start], offset[start] + stop - start), *s.index[1:])] = np.asarray(s.data)
    return out


def _rows(index: slice, n: int) -> tuple[int, int]:
    start, stop, _ = index.indices(n)
    return start, stop


def per_chip_bytes(tree: Any) -> int:
    """Bytes one chip holds of a pytree of `ShapeDtypeStruct`s with shardings (the largest shard per leaf)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += -(-int(np.prod(shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(x.dtype) // 8)  # uint4: 1/2
    return total


ROLLOUT_COPY_FRACTION = 0.25  # of a device's memory: the most the sampler's share of the weights may take by default


def device_memory_bytes() -> int | None:
    """The memory of this process's first device (TPU/GPU `memory_stats()["bytes_limit"]`); None on CPU."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else stats.get("bytes_limit")


def rollout_mesh_shape(cfg: Any, model: Any, device_bytes: int | None = None) -> tuple[int, int, int]:
    """The run config's `rollout_mesh` resolved to (data, fsdp, tensor) sizes for the policy `model`. None:
    `rloo_jax.mesh.rollout_shape` (whole weights on every device where one compute-dtype copy of the policy takes at
    most ROLLOUT_COPY_FRACTION of `device_bytes`, this process's device by default, the compile-only slice's chip; else
    tensor-parallel as far as the heads allow where that share fits; else the training mesh). With expert_parallel:
    the training mesh. Every process decides alike (same devices)."""
    if cfg.expert_parallel > 1:  # the sampler runs the experts as training does, on its mesh
        return cfg.mesh_shape
    if cfg.rollout_mesh is not None:
        sizes = dict(zip(("data", "fsdp", "tensor"), cfg.rollout_mesh, strict=True))
        return _resolve_mesh_shape(sizes, cfg.device_count)
    device_bytes = device_memory_bytes() if device_bytes is None else device_bytes
    config = model.config
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    bf16 = cfg.bf16 if cfg.bf16 is not None else config.dtype == "bfloat16"  # None: as the model loaded
    copy = params * (2 if bf16 else 4)
    return rollout_shape(cfg.mesh_shape, copy, device_bytes, config.num_heads, config.num_kv_heads,
                         ROLLOUT_COPY_FRACTION)
