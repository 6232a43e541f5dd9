"""The compiled programs of a training step, as values the training loop calls and ``--compile_only`` lowers.

A ``Program`` is a jitted function (with its input and output shardings on a mesh) together with its abstract
inputs (``ShapeDtypeStruct``s with those shardings): ``program(*args)`` runs it, ``program.lower()`` compiles it
ahead of time (the TPU compiler in compile-only mode; a background thread during the first rollout). ``Programs``
builds them, once per batch shape, from the step's traced functions (``rloo_jax.step.Step``: any algorithm),
the optax transform, and the mesh:

    programs = Programs(graphdef, optimizer, StepConfig(sampling, algorithm=GRPO(...)), mesh=mesh)
    state = programs.init_state(params, ref_params)          # placed on its shardings
    sample = programs.sample_program(B, P)                    # Program: (state, ids, mask, key) -> Rollout
    update = programs.update_program(B, P, width, F)          # Program: (state, rollout, rewards, w) -> ...
    state, metrics = update(state, finish(state, sample(state, ids, mask, key)), rewards, w)
    update.lower().compile()                                  # what compile-only does

``mesh=None``: plain ``jax.jit`` on the default device. With a ``mesh`` (``rloo_jax.mesh.make_mesh``) parameters and
optimizer state are laid out by the rule table of ``rloo_jax.mesh`` (FSDP + tensor parallel; XLA gathers each
layer's weights where it is used, never the whole model on one device), batches over data x fsdp, scalars
replicated; ``update`` donates the state. Multi-process: pass global arrays
(``rloo_jax.mesh.host_local_batch_to_global`` for per-process rows, ``replicate`` for keys and weights).

Shapes: B prompts, G generations, N = B*G completions, P prompt length, C completion width, F reward functions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from rloo_jax.mesh import (
    LOGICAL_RULES,
    Rules,
    batch_sharding,
    fit_spec,
    kv_cache_sharding,
    param_shardings,
    replicate,
    replicated,
    shard_params,
    state_shardings,
)
from rloo_jax.models.transformer import ROUTE_DTYPE, Routes
from rloo_jax.optimizer import horizon_of
from rloo_jax.rewards import reward_model_jit
from rloo_jax.sampling import SamplingConfig, rollout_weights
from rloo_jax.step import Rollout, Step, StepConfig, TrainState, UpdatePlan, policy_params
from rloo_jax.turns import Turns

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The batch shapes a run's programs are built for (`Programs.compile_set`; `rloo_jax.build.Assembly.shapes`
    derives them from the run config): B prompts of P tokens, the completion widths the reference pass and the
    update run at (widest first: `step.completion_widths`), F host reward functions, the update plans the run's
    generation batches take (`step.run_plans`; None: every micro-batch, none carried), the evaluation batch and its
    sampler options (0 prompts: no evaluation), and the reference sync's alpha (None: never synced)."""

    prompts: int
    prompt_length: int
    widths: tuple[int, ...]
    num_rewards: int
    plans: tuple[UpdatePlan | None, ...] = (None,)
    eval_prompts: int = 0
    eval_sampling: SamplingConfig | None = None
    sync_alpha: float | None = None
    suffix_widths: tuple[int, ...] = ()  # multi-turn: the widths of a resumed turn's new tokens (turns.suffix_buckets)
    pause_at: int = 0  # multi-turn: rows paused before the sampler hands them to the host (0: all of them)


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program: ``fn`` (jitted, with its shardings) and ``args``, abstract inputs of the shapes and
    shardings it is called with. ``program(*arrays)`` runs it; ``program.lower()`` lowers it for those inputs
    (``.compile()`` then compiles it: on the same backend, the later call reuses the executable)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def lower(self) -> jax.stages.Lowered:
        return self.fn.lower(*self.args)


class Programs:
    """Builds and caches the step's programs for one (model, algorithm, mesh); also calls them on arrays
    (``rollout``, ``sample``, ``finish``, ``longest``, ``score``, ``update``, ``sync_reference``: the program for
    the arguments' shapes).

    LoRA: ``graphdef`` is the model with adapters, ``ref_graphdef`` the same model without them; ``init_state``
    then takes the adapters as ``params`` and the base as ``frozen`` (with ``ref_graphdef`` the reference, or
    with ``ref_params``, a copy of the starting adapters). ``rollout_mesh``: the
    sampler's own mesh over the mesh's devices (``rloo_jax.mesh.reshaped``, e.g. tensor-parallel decode where
    training is FSDP); the sampling program moves the policy's weights into its layout once per call and hands its
    outputs back in the training layout. None: the training mesh. ``value_graphdef`` / ``reward_graphdef``: a value
    model trained with the policy and a reward model scored on the device (``rloo_jax.step.Step``);
    ``init_state`` then takes their parameters.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        optimizer: Any,  # an optax transformation, or `optimizer.Scheduled` (its horizon an update argument)
        cfg: StepConfig,
        mesh: jax.sharding.Mesh | None = None,
        rules: Rules | None = None,
        ref_graphdef: nnx.GraphDef | None = None,
        rollout_mesh: jax.sharding.Mesh | None = None,
        value_graphdef: nnx.GraphDef | None = None,
        reward_graphdef: nnx.GraphDef | None = None,
    ) -> None:
        self.step = Step(graphdef, optimizer, cfg, mesh, ref_graphdef, rollout_mesh, value_graphdef, reward_graphdef)
        self.graphdef, self.optimizer, self.cfg, self.mesh = graphdef, optimizer, cfg, mesh
        self._horizon: Any = None  # placed by `horizon` when a program first runs (never for compile-only)
        self.rules = LOGICAL_RULES if rules is None else rules
        self.state_shardings: TrainState | None = None  # fixed by init_state / abstract_state on a mesh
        self.state_abstract: TrainState | None = None  # the state as ShapeDtypeStructs (with its shardings)
        self._jits: dict[tuple, Callable] = {}
        self._programs: dict[tuple, Program] = {}

    @property
    def horizon(self) -> Any:
        """The learning-rate schedule's horizon (`optimizer.Scheduled`), an argument of the update program:
        replicated on the mesh (host values without one)."""
        if self._horizon is None:
            held = horizon_of(self.optimizer)
            self._horizon = held if self.mesh is None else jax.tree.map(lambda h: replicate(h, self.mesh), held)
        return self._horizon

    @property
    def rollout_mesh(self) -> jax.sharding.Mesh | None:
        """The sampler's mesh (the training mesh unless another was given)."""
        return self.step.rollout_mesh

    @property
    def ref_graphdef(self) -> nnx.GraphDef:
        return self.step.ref_graphdef

    # -- the state ----------------------------------------------------------------------------------------------
    def init_state(
        self, params: nnx.State, ref_params: nnx.State | None = None, frozen: nnx.State | None = None,
        value_params: nnx.State | None = None, reward_params: nnx.State | None = None,
    ) -> TrainState:
        """A fresh state; ``ref_params`` is required when the algorithm needs a reference (usually a copy of the
        initial policy), unless ``frozen`` is given (LoRA: ``params`` are the adapters, ``frozen`` the base, which
        with the adapters off is the reference unless ``ref_params`` holds a copy of the starting adapters);
        ``value_params`` / ``reward_params`` with a value / device reward model. With a mesh the state is created
        directly on its shardings."""
        ref_params = self._check_reference(ref_params, frozen)
        self._check_models(value_params, reward_params)
        self.abstract_state(params, ref_params, frozen, value_params, reward_params)
        if self.mesh is None:
            return self.step.new_state(params, ref_params, frozen, value_params, reward_params)
        shardings = self.state_shardings
        params = shard_params(params, shardings.params)
        value_params = None if value_params is None else shard_params(value_params, shardings.value_params)
        state = TrainState(
            params=params,
            opt_state=None,
            ref_params=None if ref_params is None else shard_params(ref_params, shardings.ref_params),
            step=replicate(np.zeros((), np.int32), self.mesh),
            frozen=None if frozen is None else shard_params(frozen, shardings.frozen),
            algo_state=replicate(jax.device_get(self.step.algorithm.init_state()), self.mesh),
            value_params=value_params,
            reward_params=None if reward_params is None else shard_params(reward_params, shardings.reward_params),
        )
        if self.cfg.carries:  # the carried optimizer step's partial sums, laid out as the parameters
            state = state.replace(grad_acc=jax.jit(self.step.new_accumulator, out_shardings=shardings.grad_acc)(
                state.trained))
        return state.replace(opt_state=jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(state.trained))

    def abstract_state(
        self, params: nnx.State, ref_params: nnx.State | None = None, frozen: nnx.State | None = None,
        value_params: nnx.State | None = None, reward_params: nnx.State | None = None,
    ) -> TrainState:
        """The state ``init_state`` would build, as ``ShapeDtypeStruct`` leaves (with their shardings on a mesh),
        for ahead-of-time compilation without any parameter in memory. ``params``/``ref_params``/``frozen`` (and
        the value and reward models') may themselves be abstract (``nnx.eval_shape``). Fixes the state's shardings
        the programs take."""
        ref_params = ref_params if self.step.keeps_reference(frozen, ref_params) else None
        self._check_models(value_params, reward_params)
        abstract = jax.eval_shape(self.step.new_state, params, ref_params, frozen, value_params, reward_params)
        if self.mesh is not None:
            self.state_shardings = state_shardings(abstract, self.mesh, self.rules)
            self.step.grad_shardings = self.state_shardings.trained
            abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                                    self.state_shardings)
        self.state_abstract = abstract
        return abstract

    def _check_models(self, value_params: nnx.State | None, reward_params: nnx.State | None) -> None:
        """A value / reward model's parameters exactly when the step has its graph."""
        for name, params, graphdef in (("value_params", value_params, self.step.value_graphdef),
                                       ("reward_params", reward_params, self.step.reward_graphdef)):
            if (params is None) != (graphdef is None):
                raise ValueError(f"{name} {'missing' if params is None else 'given'}: the programs were built "
                                 f"{'with' if graphdef is not None else 'without'} its model")

    def _check_reference(self, ref_params: nnx.State | None, frozen: nnx.State | None) -> nnx.State | None:
        """The reference to keep: None when the algorithm needs none or the frozen base is the reference (LoRA
        without a copy of the starting adapters)."""
        if not self.step.keeps_reference(frozen, ref_params):
            return None
        if ref_params is None:
            raise ValueError("this algorithm (beta != 0) needs ref_params (a frozen copy of the initial policy)")
        return ref_params

    # -- shardings and abstract batches -------------------------------------------------------------------------
    def _state(self) -> TrainState:
        if self.state_abstract is None:
            raise RuntimeError("Programs: call init_state (or abstract_state) first: it fixes the state's layout")
        return self.state_abstract

    def _sharding(self, rows: int) -> NamedSharding | None:
        return None if self.mesh is None else batch_sharding(self.mesh, (rows,))

    def _replicated(self) -> NamedSharding | None:
        return None if self.mesh is None else replicated(self.mesh)

    def _rollout_shardings(self, num_prompts: int, finished: bool) -> Rollout:
        """A ``Rollout`` of shardings: prompts ``[B, ..]`` and completions ``[N, ..]`` over data x fsdp (rows only:
        any width); ``finished``: as ``finish`` returns it (reference log-probs when the algorithm needs them, the
        sampler's own when the old ones are recomputed), else as ``sample`` returns it."""
        b, n = self._sharding(num_prompts), self._sharding(num_prompts * self.cfg.num_generations)
        return Rollout(
            prompt_ids=b, prompt_mask=b, completion_ids=n, completion_mask=n, is_truncated=n, old_logps=n,
            ref_logps=n if self.cfg.algorithm.needs_reference and finished else None,
            sampler_logps=n if self.cfg.recompute and finished else None,
            values=n if self.step.value_graphdef is not None and finished else None,
            scores=n if self.step.reward_graphdef is not None and finished else None,
            tool_mask=n if self.cfg.multi_turn else None,
            routes=self._routes_like(b, n),
        )

    def _routes_like(self, prompts: Any, completions: Any) -> Routes | None:
        """A ``Routes`` of `prompts` / `completions` leaves under routing replay (``StepConfig.routes``), else None."""
        return None if self.cfg.routes is None else Routes(prompt=prompts, completion=completions)

    def _sds(self, shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def _abstract_rollout(self, num_prompts: int, prompt_len: int, width: int, finished: bool,
                          num_generations: int | None = None) -> Rollout:
        b, p, n = num_prompts, prompt_len, num_prompts * (num_generations or self.cfg.num_generations)
        bs, ns = self._sharding(num_prompts), self._sharding(n)
        i32, f32 = jnp.int32, jnp.float32
        with_ref = finished and self.cfg.algorithm.needs_reference
        with_sampler = finished and self.cfg.recompute
        with_values = finished and self.step.value_graphdef is not None
        with_scores = finished and self.step.reward_graphdef is not None
        return Rollout(
            prompt_ids=self._sds((b, p), i32, bs), prompt_mask=self._sds((b, p), i32, bs),
            completion_ids=self._sds((n, width), i32, ns), completion_mask=self._sds((n, width), i32, ns),
            is_truncated=self._sds((n,), jnp.bool_, ns), old_logps=self._sds((n, width), f32, ns),
            ref_logps=self._sds((n, width), f32, ns) if with_ref else None,
            sampler_logps=self._sds((n, width), f32, ns) if with_sampler else None,
            values=self._sds((n, width), f32, ns) if with_values else None,
            scores=self._sds((n, self.step.device_rewards), f32, ns) if with_scores else None,
            tool_mask=self._sds((n, width), i32, ns) if self.cfg.multi_turn else None,
            routes=None if self.cfg.routes is None else self._routes_like(
                self._sds((b, p, *self.cfg.routes), ROUTE_DTYPE, bs), self._sds((n, width, *self.cfg.routes),
                                                                               ROUTE_DTYPE, ns)),
        )

    def _key(self) -> jax.ShapeDtypeStruct:
        key = jax.eval_shape(lambda: jax.random.key(0))
        return self._sds(key.shape, key.dtype, self._replicated())

    def _jit(self, key: tuple, make: Callable[[], Callable]) -> Callable:
        """One jitted function per (program, shardings): on a mesh the shardings depend on the batch sizes."""
        if key not in self._jits:
            self._jits[key] = make()
        return self._jits[key]

    def _on_mesh(self, f: Callable) -> Callable:
        """``f`` traced under the mesh, so the model's activation constraints (``rloo_jax.mesh.constrain``) apply."""
        if self.mesh is None:
            return f

        def traced(*args: object) -> object:
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                return f(*args)

        return traced

    def _program(self, key: tuple, make: Callable[[], Program]) -> Program:
        if key not in self._programs:
            self._programs[key] = make()
        return self._programs[key]

    # -- the programs -------------------------------------------------------------------------------------------
    def sample_program(self, num_prompts: int, prompt_len: int, sampling: SamplingConfig | None = None) -> Program:
        """``(state, prompt_ids [B, P], prompt_mask [B, P], key) -> Rollout`` (``max_new_tokens`` wide, no reference
        log-probs). ``sampling``: other sampler options (evaluation), default the step's."""
        sc = self.cfg.sampling if sampling is None else sampling

        def make() -> Program:
            b = self._sharding(num_prompts)
            fn = self._jit(("sample", b, sc), lambda: jax.jit(
                self._on_mesh(lambda s, i, m, k: self.step.sample(s, i, m, k, sc)),
                in_shardings=None if self.mesh is None else (self.state_shardings, b, b, self._replicated()),
                out_shardings=None if self.mesh is None else self._sampled_shardings(num_prompts, sc),
            ))
            ids = self._sds((num_prompts, prompt_len), jnp.int32, b)
            return Program("sample", fn, (self._state(), ids, ids, self._key()))

        return self._program(("sample", num_prompts, prompt_len, sc), make)

    def _sampled_shardings(self, num_prompts: int, sc: SamplingConfig) -> Rollout:
        if sc.num_generations == self.cfg.num_generations:
            return self._rollout_shardings(num_prompts, finished=False)
        b, n = self._sharding(num_prompts), self._sharding(num_prompts * sc.num_generations)
        return Rollout(prompt_ids=b, prompt_mask=b, completion_ids=n, completion_mask=n, is_truncated=n,
                       old_logps=n, ref_logps=None, tool_mask=n if self.cfg.multi_turn else None,
                       routes=self._routes_like(b, n))

    # -- the multi-turn rollout (rloo_jax.turns): the host runs the tools between these programs ------------------
    def _turns_abstract(self, num_prompts: int, prompt_len: int, sc: SamplingConfig, pause_at: int) -> Turns:
        """The ``Turns`` a start program returns, as ``ShapeDtypeStruct``s (with shardings on a mesh: per-row arrays
        over data x fsdp, the KV caches as ``mesh.kv_cache_sharding``)."""
        ids = jax.ShapeDtypeStruct((num_prompts, prompt_len), jnp.int32)
        key = jax.eval_shape(lambda: jax.random.key(0))
        shapes = jax.eval_shape(lambda s, i, m, k: self.step.start_turns(s, i, m, k, pause_at, sc), self._state(),
                                ids, ids, key)
        if self.mesh is None:
            return shapes
        shardings = self._turns_shardings(shapes)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings)

    def _turns_shardings(self, shapes: Turns) -> Turns | None:
        if self.mesh is None:
            return None
        cache = shapes.cache
        kv = lambda a: kv_cache_sharding(self.mesh, a.shape)  # noqa: E731
        rows = lambda a: batch_sharding(self.mesh, a.shape)  # noqa: E731
        # a mixture of experts' recorded routes, layer-major [L, rows, T, K]: rows over data x fsdp
        routes = lambda a: None if a is None else NamedSharding(  # noqa: E731
            self.mesh, fit_spec((None, "batch", None, None), a.shape, self.mesh))
        placed = jax.tree.map(rows, shapes.replace(cache=None))
        return placed.replace(cache=cache.replace(
            prompt=cache.prompt.replace(k=kv(cache.prompt.k), v=kv(cache.prompt.v), mask=rows(cache.prompt.mask),
                                        lengths=rows(cache.prompt.lengths), routes=routes(cache.prompt.routes)),
            k=kv(cache.k), v=kv(cache.v), routes=routes(cache.routes)))

    def turns_start_program(self, num_prompts: int, prompt_len: int, pause_at: int,
                            sampling: SamplingConfig | None = None) -> Program:
        """``(state, prompt_ids [B, P], prompt_mask [B, P], key) -> Turns``: every row's first turn."""
        sc = self.cfg.sampling if sampling is None else sampling

        def make() -> Program:
            b = self._sharding(num_prompts)
            out = self._turns_shardings(self._turns_abstract(num_prompts, prompt_len, sc, pause_at))
            fn = self._jit(("turns_start", b, sc, pause_at), lambda: jax.jit(
                self._on_mesh(lambda s, i, m, k: self.step.start_turns(s, i, m, k, pause_at, sc)),
                in_shardings=None if self.mesh is None else (self.state_shardings, b, b, self._replicated()),
                out_shardings=out,
            ))
            ids = self._sds((num_prompts, prompt_len), jnp.int32, b)
            return Program("turns_start", fn, (self._state(), ids, ids, self._key()))

        return self._program(("turns_start", num_prompts, prompt_len, pause_at, sc), make)

    def turns_resume_program(self, num_prompts: int, prompt_len: int, width: int, pause_at: int,
                             sampling: SamplingConfig | None = None) -> Program:
        """``(state, Turns, suffix [N, T], suffix_len [N], finish [N], key) -> Turns``: the next turns, the new
        tokens padded to ``width`` T (one program per width)."""
        sc = self.cfg.sampling if sampling is None else sampling

        def make() -> Program:
            turns = self._turns_abstract(num_prompts, prompt_len, sc, pause_at)
            shardings = self._turns_shardings(turns)
            n = num_prompts * sc.num_generations
            ns = self._sharding(n)
            fn = self._jit(("turns_resume", ns, sc, pause_at, width), lambda: jax.jit(
                self._on_mesh(lambda s, t, x, xl, f, k: self.step.resume_turns(s, t, x, xl, f, k, pause_at, sc)),
                in_shardings=None if self.mesh is None else (self.state_shardings, shardings, ns, ns, ns,
                                                             self._replicated()),
                out_shardings=shardings, donate_argnums=1,
            ))
            args = (self._state(), turns, self._sds((n, width), jnp.int32, ns), self._sds((n,), jnp.int32, ns),
                    self._sds((n,), jnp.bool_, ns), self._key())
            return Program("turns_resume", fn, args)

        return self._program(("turns_resume", num_prompts, prompt_len, width, pause_at, sc), make)

    def turns_close_program(self, num_prompts: int, prompt_len: int, pause_at: int,
                            sampling: SamplingConfig | None = None) -> Program:
        """``Turns -> Rollout``: the conversations as a sampled rollout with its tool mask (``Step.close_turns``)."""
        sc = self.cfg.sampling if sampling is None else sampling

        def make() -> Program:
            turns = self._turns_abstract(num_prompts, prompt_len, sc, pause_at)
            fn = self._jit(("turns_close", self._sharding(num_prompts * sc.num_generations), sc), lambda: jax.jit(
                self._on_mesh(lambda t: self.step.close_turns(t, sc)),
                in_shardings=None if self.mesh is None else (self._turns_shardings(turns),),
                out_shardings=None if self.mesh is None else self._sampled_shardings(num_prompts, sc),
            ))
            return Program("turns_close", fn, (turns,))

        return self._program(("turns_close", num_prompts, prompt_len, pause_at, sc), make)

    def finish_program(self, num_prompts: int, prompt_len: int, width: int) -> Program:
        """``(state, sampled Rollout) -> Rollout`` cut to ``width`` completion positions, with the reference (and
        recomputed old) log-probs."""

        def make() -> Program:
            ro_in = self._rollout_shardings(num_prompts, finished=False)
            fn = self._jit(("finish", ro_in.completion_ids, width), lambda: jax.jit(
                self._on_mesh(lambda s, r: self.step.finish(s, r, width)),
                in_shardings=None if self.mesh is None else (self.state_shardings, ro_in),
                out_shardings=None if self.mesh is None else self._rollout_shardings(num_prompts, finished=True),
            ))
            sampled = self._abstract_rollout(num_prompts, prompt_len, self.cfg.sampling.max_new_tokens, False)
            return Program("finish", fn, (self._state(), sampled))

        return self._program(("finish", num_prompts, prompt_len, width), make)

    def rollout_program(self, num_prompts: int, prompt_len: int) -> Program:
        """``finish(sample(...), max_new_tokens)`` in one program: ``(state, ids, mask, key) -> Rollout``."""

        def make() -> Program:
            b = self._sharding(num_prompts)
            fn = self._jit(("rollout", b), lambda: jax.jit(
                self._on_mesh(self.step.rollout),
                in_shardings=None if self.mesh is None else (self.state_shardings, b, b, self._replicated()),
                out_shardings=None if self.mesh is None else self._rollout_shardings(num_prompts, finished=True),
            ))
            ids = self._sds((num_prompts, prompt_len), jnp.int32, b)
            return Program("rollout", fn, (self._state(), ids, ids, self._key()))

        return self._program(("rollout", num_prompts, prompt_len), make)

    def longest_program(self, num_prompts: int) -> Program:
        """``completion_ids [N, C] -> []``: the longest EOS-cut completion, replicated."""

        def make() -> Program:
            fn = self._jit(("longest",), lambda: jax.jit(self.step.longest, out_shardings=self._replicated()))
            n, c = num_prompts * self.cfg.num_generations, self.cfg.sampling.max_new_tokens
            return Program("longest", fn, (self._sds((n, c), jnp.int32, self._sharding(n)),))

        return self._program(("longest", num_prompts), make)

    def _rewards(self, num_prompts: int, num_rewards: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """The host's rewards ``[N, F]`` and the weights of every reward ``[R + F]`` (device reward models first)."""
        n = num_prompts * self.cfg.num_generations
        return (self._sds((n, num_rewards), jnp.float32, self._sharding(n)),
                self._sds((self.step.device_rewards + num_rewards,), jnp.float32, self._replicated()))

    def order_shape(self, num_prompts: int) -> tuple[int, int]:
        """``update``'s micro-batch rows with ``row_order``: [updates x gradient_accumulation_steps, rows]."""
        n = num_prompts * self.cfg.num_generations
        micro = self.cfg.updates_per_generation * self.cfg.gradient_accumulation_steps
        return micro, n // self.cfg.steps_per_generation

    def score_program(self, num_prompts: int, prompt_len: int, width: int, num_rewards: int) -> Program:
        """``(rollout, rewards_per_func [N, F], reward_weights [F]) -> (targets, metrics)``: the algorithm's
        advantages (what the rollout records show) and the generation metrics."""

        def make() -> Program:
            ro = self._rollout_shardings(num_prompts, finished=True)
            n, rep = ro.completion_ids, self._replicated()
            fn = self._jit(("score", n), lambda: jax.jit(
                self._on_mesh(self.step.score),
                in_shardings=None if self.mesh is None else (ro, n, rep),
                out_shardings=None if self.mesh is None else (n, rep),
            ))
            rewards, weights = self._rewards(num_prompts, num_rewards)
            return Program("score", fn, (self._abstract_rollout(num_prompts, prompt_len, width, True), rewards,
                                         weights))

        return self._program(("score", num_prompts, prompt_len, width, num_rewards), make)

    def update_program(self, num_prompts: int, prompt_len: int, width: int, num_rewards: int,
                       plan: UpdatePlan | None = None) -> Program:
        """``(state, rollout, rewards_per_func [N, F], reward_weights [R + F][, order]) -> (state, metrics)``;
        donates the state. ``order`` (``cfg.row_order``): ``[updates x gradient_accumulation_steps, rows]`` int32.
        ``plan``: which micro-batches run (``Step.update``; None: all of them, none carried): one program per plan.
        ``metrics``: ``Step.update``'s (``generation`` / ``micro`` / ``update``)."""
        plan = None if plan == self.cfg.default_plan() else plan

        def make() -> Program:
            ro = self._rollout_shardings(num_prompts, finished=True)
            n, rep = ro.completion_ids, self._replicated()
            ordered = self.cfg.row_order

            def update(state: TrainState, rollout: Rollout, rewards: Array, weights: Array, horizon: Any,
                       *order: Array) -> tuple[TrainState, dict[str, Any]]:  # named `update` (logs, reports)
                return self.step.update(state, rollout, rewards, weights, *order, plan=plan, horizon=horizon)

            fn = self._jit(("update", n, plan), lambda: jax.jit(
                self._on_mesh(update),
                in_shardings=None if self.mesh is None else (self.state_shardings, ro, n, rep, rep) + (rep,) * ordered,
                out_shardings=None if self.mesh is None else (self.state_shardings, rep),
                donate_argnums=0,
            ))
            rewards, weights = self._rewards(num_prompts, num_rewards)
            horizon = jax.tree.map(lambda h: self._sds((), h.dtype, rep), horizon_of(self.optimizer))
            order = (self._sds(self.order_shape(num_prompts), jnp.int32, rep),) if ordered else ()
            return Program("update", fn, (self._state(), self._abstract_rollout(num_prompts, prompt_len, width, True),
                                          rewards, weights, horizon, *order))

        return self._program(("update", num_prompts, prompt_len, width, num_rewards, plan), make)

    def device_scores_program(self, num_prompts: int, prompt_len: int, sampling: SamplingConfig | None = None
                              ) -> Program:
        """``(state, sampled Rollout) -> [N, R]``: the device reward models' scores (``Step.device_scores``), for
        rollouts of ``sample_program`` with ``sampling`` (evaluation)."""
        sc = self.cfg.sampling if sampling is None else sampling

        def make() -> Program:
            n = self._sharding(num_prompts * sc.num_generations)
            fn = self._jit(("device_scores", n, sc), lambda: jax.jit(
                self._on_mesh(self.step.device_scores),
                in_shardings=None if self.mesh is None else (self.state_shardings,
                                                             self._sampled_shardings(num_prompts, sc)),
                out_shardings=n,
            ))
            sampled = self._abstract_rollout(num_prompts, prompt_len, sc.max_new_tokens, False, sc.num_generations)
            return Program("device_scores", fn, (self._state(), sampled))

        return self._program(("device_scores", num_prompts, prompt_len, sc), make)

    def sync_reference_program(self, alpha: float) -> Program:
        """``state -> state`` with the reference moved towards the policy (TR-DPO)."""

        def make() -> Program:
            fn = self._jit(("sync_reference", alpha), lambda: jax.jit(
                lambda s: self.step.sync_reference(s, alpha),
                in_shardings=None if self.mesh is None else (self.state_shardings,),
                out_shardings=self.state_shardings,
            ))
            return Program("sync_reference", fn, (self._state(),))

        return self._program(("sync_reference", alpha), make)

    # -- calls on arrays (the program for their shapes) ---------------------------------------------------------
    def rollout(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array) -> Rollout:
        return self.rollout_program(*prompt_ids.shape)(state, prompt_ids, prompt_mask, key)

    def sample(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array,
               sampling: SamplingConfig | None = None) -> Rollout:
        return self.sample_program(*prompt_ids.shape, sampling)(state, prompt_ids, prompt_mask, key)

    def start_turns(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array, pause_at: int,
                    sampling: SamplingConfig | None = None) -> Turns:
        return self.turns_start_program(*prompt_ids.shape, pause_at, sampling)(state, prompt_ids, prompt_mask, key)

    def resume_turns(self, state: TrainState, t: Turns, suffix: Array, suffix_len: Array, finish: Array, key: Array,
                     pause_at: int, sampling: SamplingConfig | None = None) -> Turns:
        b, p = t.prompt_ids.shape
        program = self.turns_resume_program(b, p, suffix.shape[1], pause_at, sampling)
        return program(state, t, suffix, suffix_len, finish, key)

    def close_turns(self, t: Turns, pause_at: int, sampling: SamplingConfig | None = None) -> Rollout:
        return self.turns_close_program(*t.prompt_ids.shape, pause_at, sampling)(t)

    def finish(self, state: TrainState, rollout: Rollout, width: int) -> Rollout:
        return self.finish_program(*rollout.prompt_ids.shape, width)(state, rollout)

    def longest(self, rollout: Rollout) -> int:
        """The generation batch's longest completion, EOS included (``max_new_tokens`` when one has no EOS): the
        width ``finish`` must keep (``completion_width``). One small program; every process gets the value."""
        ids = rollout.completion_ids
        out = self.longest_program(ids.shape[0] // self.cfg.num_generations)(ids)
        return int(np.asarray(out.addressable_data(0) if self.mesh is not None else out))

    def score(self, rollout: Rollout, rewards_per_func: Array, reward_weights: Array
              ) -> tuple[dict[str, Array], dict[str, Array]]:
        b, p = rollout.prompt_ids.shape
        program = self.score_program(b, p, rollout.completion_ids.shape[1], rewards_per_func.shape[1])
        return program(rollout, rewards_per_func, reward_weights)

    def update(self, state: TrainState, rollout: Rollout, rewards_per_func: Array, reward_weights: Array,
               order: Array | None = None, plan: UpdatePlan | None = None) -> tuple[TrainState, dict[str, Any]]:
        b, p = rollout.prompt_ids.shape
        program = self.update_program(b, p, rollout.completion_ids.shape[1], rewards_per_func.shape[1], plan)
        return program(state, rollout, rewards_per_func, reward_weights, self.horizon,
                       *(() if order is None else (order,)))

    def device_scores(self, state: TrainState, rollout: Rollout, sampling: SamplingConfig | None = None) -> Array:
        return self.device_scores_program(*rollout.prompt_ids.shape, sampling)(state, rollout)

    def sync_reference(self, state: TrainState, alpha: float) -> TrainState:
        return self.sync_reference_program(alpha)(state)

    def compile_set(self, shapes: Shapes) -> list[Program]:
        """Exactly the programs a training run of these `shapes` calls (the loop builds each on first use; this
        builds them up front), each named for its place in the step: `sample`; `longest` (with several completion
        widths); per width w (the widest bare, the others `@w`): `finish`, `update` (`[carried+micro]` for a plan
        that carries micro-batches) and `score` (the advantages the rollout records show); `eval_sample` and
        `eval_scores` (a device reward model's); `sync_reference`. Programs of the same function and shapes are the
        loop's own objects (one cache), renamed."""
        b, p, widest = shapes.prompts, shapes.prompt_length, shapes.widths[0]
        if self.cfg.multi_turn:  # the conversations: first turns, each width of resumed turns, the closing rollout
            pause = min(shapes.pause_at or b * self.cfg.num_generations, b * self.cfg.num_generations)
            named = [("turns_start", self.turns_start_program(b, p, pause))]
            named += [(f"turns_resume@{w}", self.turns_resume_program(b, p, w, pause)) for w in shapes.suffix_widths]
            named.append(("turns_close", self.turns_close_program(b, p, pause)))
        else:
            named = [("sample", self.sample_program(b, p))]
            if len(shapes.widths) > 1:
                named.append(("longest", self.longest_program(b)))
        for w in shapes.widths:
            at = "" if w == widest else f"@{w}"
            named.append((f"finish{at}", self.finish_program(b, p, w)))
            for plan in shapes.plans:
                tag = "" if plan is None else f"[{plan.carried}+{plan.micro_batches}]"
                named.append((f"update{at}{tag}", self.update_program(b, p, w, shapes.num_rewards, plan)))
            named.append((f"score{at}", self.score_program(b, p, w, shapes.num_rewards)))
        if shapes.eval_prompts and self.cfg.multi_turn:
            e, sc = shapes.eval_prompts, shapes.eval_sampling
            pause = min(shapes.pause_at or e * sc.num_generations, e * sc.num_generations)
            named.append(("eval_turns_start", self.turns_start_program(e, p, pause, sc)))
            named += [(f"eval_turns_resume@{w}", self.turns_resume_program(e, p, w, pause, sc))
                      for w in shapes.suffix_widths]
            named.append(("eval_turns_close", self.turns_close_program(e, p, pause, sc)))
        elif shapes.eval_prompts:
            named.append(("eval_sample", self.sample_program(shapes.eval_prompts, p, shapes.eval_sampling)))
            if self.step.reward_graphdef is not None:
                named.append(("eval_scores", self.device_scores_program(shapes.eval_prompts, p, shapes.eval_sampling)))
        if shapes.sync_alpha is not None:
            named.append(("sync_reference", self.sync_reference_program(shapes.sync_alpha)))
        return [dataclasses.replace(program, name=name) for name, program in named]

    def layout_program(self) -> Program:
        """``state -> weights``: what ``sample`` spends moving the policy's weights into the sampler's layout once per
        call (``sampling.rollout_weights``; inside ``sample``, not a program the loop runs on its own), alone, for
        compile-only's report."""

        def move(state: TrainState) -> nnx.State:
            with jax.sharding.use_abstract_mesh(self.rollout_mesh.abstract_mesh):
                return rollout_weights(self.graphdef, policy_params(state), self.mesh.abstract_mesh)

        return Program("rollout_layout", jax.jit(move), (self._state(),))

    def compile_update(self, prompt_shape: tuple[int, int], num_rewards: int, width: int | None = None,
                       plan: UpdatePlan | None = None) -> None:
        """Compile ``update`` for prompts ``[B, P]`` (completions ``width`` wide, default ``max_new_tokens``) before
        its first call; that call then reuses the executable. The trainer runs this in a thread while the first
        rollout compiles and runs: XLA compiles the two programs on two cores at once."""
        width = width or self.cfg.sampling.max_new_tokens
        self.update_program(*prompt_shape, width, num_rewards, plan).lower().compile()


def reward_model_program(name: str, model: Any, mesh: jax.sharding.Mesh | None, shape: tuple[int, int]) -> Program:
    """The trainer's call of a host reward model (`rloo_jax.rewards.reward_model_jit`) as a program: `model`'s
    forward over global batches of `shape` [N, T] (token ids, mask), its parameters sharded by the rule table as the
    policy's (abstract `model`: nothing in memory)."""
    graphdef, params = nnx.split(model)
    shardings = None if mesh is None else param_shardings(params, mesh)
    placed = params if mesh is None else jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    ids = jax.ShapeDtypeStruct(shape, jnp.int32)
    return Program(name, reward_model_jit(graphdef, mesh, shardings, shape), (placed, ids, ids))


def flat_metrics(metrics: dict[str, Any]) -> dict[str, Array]:
    """``Step.update``'s metrics as one flat dict of scalars for a whole generation batch (tests, benchmarks and
    the research API): the generation metrics, each micro-batch metric and each update metric reduced over the
    batch's updates (``rloo_jax.step.reduce_metric``; ``grad_norm``: its mean)."""
    from rloo_jax.step import reduce_metric

    out = dict(metrics["generation"])
    for group in ("micro", "update"):
        out.update({name: reduce_metric(name, v) for name, v in metrics[group].items()})
    return out
