"""The jitted core of a training step: rollout (sample + reference log-probs) and update (advantages + optax).

A step is two pure functions over a ``TrainState`` pytree; only the host work between them (decoding text,
Python reward functions) lives in the trainer loop:

    rollout = step.rollout(state, prompt_ids, prompt_mask, key)          # jitted: sampler, ref log-probs
    rewards_per_func = <host: decode, reward functions / reward models>   # [B*G, F] with NaN for None
    state, metrics = step.update(state, rollout, rewards_per_func, w)   # jitted: RLOO + optimizer updates

With a device mesh (``RLOOStep(..., mesh=make_mesh(...))``) the same functions are jitted with explicit shardings:
parameters and optimizer state by the rule table of ``rloo_jax.mesh`` (FSDP + tensor parallel; XLA gathers each
layer's weights where it is used, never the whole model on one device), batches over data x fsdp, scalars
replicated; ``update`` still donates the state.

Shapes: B prompts, G generations, N = B*G completions, P prompt length, C completion length.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import NamedSharding

from rloo_jax.logprobs import completion_mask, masked_mean, per_token_logps_from_hidden
from rloo_jax.mesh import (
    BATCH_AXES,
    LOGICAL_RULES,
    Rules,
    batch_sharding,
    constrain_batch,
    replicate,
    replicated,
    shard_params,
    state_shardings,
)
from rloo_jax.rloo import (
    RLOOOptions,
    clipped_objective,
    importance_sampling_weights,
    kl_loss,
    sampling_logp_difference,
    score_completions,
)
from rloo_jax.sampling import SamplingConfig, generate_fn

Array = jax.Array


@struct.dataclass
class TrainState:
    """Everything that changes during training (a pytree; checkpoint it whole)."""

    params: nnx.State  # what is trained: the policy's nnx.Param state, or with LoRA its adapters only
    opt_state: optax.OptState
    ref_params: nnx.State | None  # frozen reference policy; None when beta == 0 or with LoRA
    step: Array  # [] int32, optimizer updates applied so far
    frozen: nnx.State | None = None  # LoRA: the base model (never trained; also the reference); else None


@struct.dataclass
class Rollout:
    """One generation batch, ready to be scored."""

    prompt_ids: Array  # [B, P] int32, left-padded
    prompt_mask: Array  # [B, P] int32
    completion_ids: Array  # [N, C] int32, right-padded with pad
    completion_mask: Array  # [N, C] int32 (zero rows for truncated completions if mask_truncated_completions)
    is_truncated: Array  # [N] bool
    old_logps: Array  # [N, C] float32, behaviour-policy log-probs: the sampler's, or recomputed by `finish`
    ref_logps: Array | None  # [N, C] float32, reference log-probs; None when beta == 0
    sampler_logps: Array | None = None  # [N, C] float32, the sampler's when old_logps were recomputed, else None


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static, hashable options of a step (TRL names). Built once from the run config."""

    sampling: SamplingConfig
    rloo: RLOOOptions = RLOOOptions()
    """The algorithm's knobs (beta, epsilon, normalisation, clipping, KL estimator, loss level ...)."""
    num_iterations: int = 1
    """Optimisation passes over each generation batch (PPO epochs)."""
    steps_per_generation: int = 1
    """Micro-batches the generation batch is split into."""
    gradient_accumulation_steps: int = 1
    """Micro-batches whose gradients are averaged into one optimizer update."""
    dropout_seed: int | None = None
    """LoRA dropout in the update's forwards: micro-batch i of update u draws from fold_in(fold_in(key(seed),
    step + u), i) (None: no dropout; the model's `lora.dropout` is then unused)."""
    recompute_old_logps: bool | None = None
    """Old log-probs from a training forward at the sampling parameters (``finish``, beside the reference pass)
    instead of the sampler's; the KL in the reward then uses them too. None: when off-policy or with dropout
    (the update's own forward cannot stand in for them then). See ``recompute``."""
    logprob_chunk: int = 64
    """Sequence positions unembedded at a time when computing log-probs (bounds the [.., V] logits held: at
    8 rows x 1024 positions and V = 152k, 64 keeps the log-prob pass under 1/8 of the full float32 logits;
    see BENCHMARKS.md). Completions no longer than this are unembedded in one piece."""

    def __post_init__(self) -> None:
        if self.steps_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"steps_per_generation ({self.steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.recompute_old_logps is False and not self.on_policy:
            raise ValueError("an off-policy step needs recomputed old log-probs (recompute_old_logps None or True)")

    @property
    def num_generations(self) -> int:
        return self.sampling.num_generations

    @property
    def temperature(self) -> float:
        """Temperature of every log-prob (greedy sampling records log-probs at 1, like the sampler)."""
        return self.sampling.temperature or 1.0

    @property
    def on_policy(self) -> bool:
        """One update per generation batch: old = stop_gradient(current), the ratio is exactly 1."""
        return self.num_iterations == 1 and self.steps_per_generation == self.gradient_accumulation_steps

    @property
    def recompute(self) -> bool:
        """Whether ``finish`` recomputes the old log-probs with a training forward (TRL's rule: off-policy). On
        policy without dropout the update's forward runs at the sampling parameters and stands in for it: the
        ratio is exactly 1 and the sampler/trainer gap is measured there, at no extra cost."""
        if self.recompute_old_logps is not None:
            return self.recompute_old_logps
        return not self.on_policy or self.dropout_seed is not None

    @property
    def updates_per_generation(self) -> int:
        return self.num_iterations * self.steps_per_generation // self.gradient_accumulation_steps


# ----------------------------------------------------------------------------------------------- pure pieces


def completion_logps(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    prompt_ids: Array,
    prompt_mask: Array,
    completion_ids: Array,
    completion_mask: Array,
    temperature: float,
    chunk: int = 64,  # StepConfig.logprob_chunk
    with_entropy: bool = False,
    dropout_key: Array | None = None,
    frozen_unembed: bool = False,
) -> Array | tuple[Array, Array]:
    """Per-token log-probs of the completions under ``params``: ``[N, C]`` float32 (and entropy ``[N, C]``).

    prompt_ids/mask ``[N, P]`` (one prompt per completion) or ``[B, P]`` with ``N = B*G`` (prompt ``r // G`` for
    completion ``r``); completion ids/mask ``[N, C]``. Each distinct prompt row runs through the model once and its
    G completions attend to its keys (``CausalLM.completion_hidden_states``; the same numbers as one forward over
    ``[prompt; completion]``, without repeating the prompt G times). The vocabulary projection runs in chunks of
    ``chunk`` positions (``per_token_logps_from_hidden``). With LoRA, ``params`` is ``lora.merge_params(base,
    adapters)``; ``dropout_key`` applies the adapters' dropout (training forwards), and ``frozen_unembed`` (the
    head gets no gradient) computes the log-probs' gradient in the forward pass (``per_token_logps_from_hidden``).
    """
    model = nnx.merge(graphdef, params)
    if completion_ids.shape[0] % prompt_ids.shape[0]:
        raise ValueError(f"{completion_ids.shape[0]} completions do not split into {prompt_ids.shape[0]} prompts")
    hidden = model.completion_hidden_states(prompt_ids, prompt_mask, completion_ids, completion_mask, dropout_key)
    return per_token_logps_from_hidden(
        hidden, model.unembed, completion_ids, temperature, chunk_size=chunk, with_entropy=with_entropy,
        frozen_unembed=frozen_unembed,
    )


def _completion_stats(mask: Array, lengths: Array, is_truncated: Array) -> dict[str, Array]:
    """TRL's ``completions/*`` metrics from the EOS-cut lengths ``[N]``."""
    lengths = lengths.astype(jnp.float32)
    term = (~is_truncated).astype(jnp.float32)
    n_term = jnp.sum(term)
    return {
        "completions/mean_length": jnp.mean(lengths),
        "completions/min_length": jnp.min(lengths),
        "completions/max_length": jnp.max(lengths),
        "completions/clipped_ratio": jnp.mean(is_truncated.astype(jnp.float32)),
        # TRL: 0 when no completion terminated
        "completions/mean_terminated_length": jnp.where(n_term > 0, jnp.sum(lengths * term) / n_term, 0.0),
    }


def completion_width(longest: int, max_length: int, bucket: int) -> int:
    """The completion width the reference pass and the update run at: the smallest ``bucket * 2^k`` that holds
    the generation batch's ``longest`` completion, at most ``max_length`` (``bucket`` 0: always ``max_length``).

    Example: bucket 128, max 1024: longest 300 -> 512, 1000 -> 1024, 1 -> 128. At most
    ``ceil(log2(max_length / bucket)) + 1`` widths, so as many compiled programs of each kind.
    """
    if bucket <= 0 or bucket >= max_length:
        return max_length
    width = bucket
    while width < longest:
        width *= 2
    return min(width, max_length)


def truncate(rollout: Rollout, width: int) -> Rollout:
    """The first ``width`` completion positions of every ``[N, C]`` array. Nothing is lost when every completion
    (EOS included) fits: the positions beyond are padding, masked out of every log-prob, loss and metric."""

    def cut(x: Array | None) -> Array | None:
        return None if x is None else x[:, :width]

    return rollout.replace(
        completion_ids=cut(rollout.completion_ids), completion_mask=cut(rollout.completion_mask),
        old_logps=cut(rollout.old_logps), ref_logps=cut(rollout.ref_logps), sampler_logps=cut(rollout.sampler_logps),
    )


def policy_params(state: TrainState) -> nnx.State:
    """The whole policy's parameters: ``state.params``, or with LoRA the frozen base merged with the adapters."""
    return state.params if state.frozen is None else nnx.merge_state(state.frozen, state.params)


def sync_reference(params: nnx.State, ref_params: nnx.State, alpha: float) -> nnx.State:
    """TR-DPO reference update: ``ref <- alpha * policy + (1 - alpha) * ref`` (leafwise)."""
    return jax.tree.map(lambda p, r: (alpha * p + (1.0 - alpha) * r).astype(r.dtype), params, ref_params)


# ----------------------------------------------------------------------------------------------- the step


class RLOOStep:
    """Holds only static things (graphdef, optax transform, StepConfig, mesh) and the jitted step functions.

    LoRA: ``graphdef`` is the model with adapters, ``ref_graphdef`` the same model without them; the state trains
    the adapters (``params``) on a ``frozen`` base, which with ``ref_graphdef`` is also the reference (no copy).

    ``rollout_mesh``: the sampler's own mesh over the mesh's devices (``rloo_jax.mesh.reshaped``, e.g.
    tensor-parallel decode where training is FSDP); the sampling program moves the policy's weights into its
    layout once per call and hands its outputs back in the training layout. None: the training mesh.

    ``mesh=None``: plain ``jax.jit`` on the default device. With a ``mesh`` (``rloo_jax.mesh.make_mesh``), call
    ``init_state`` first: it places the state on its shardings (``self.state_shardings``), which the jitted
    functions then take as explicit ``in_shardings``/``out_shardings``; batch arrays are split over data x fsdp
    (each function is compiled once per batch shape). Multi-process: pass global arrays
    (``rloo_jax.mesh.host_local_batch_to_global`` for per-process rows, ``replicate`` for keys and weights).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        optimizer: optax.GradientTransformation,
        cfg: StepConfig,
        mesh: jax.sharding.Mesh | None = None,
        rules: Rules | None = None,
        ref_graphdef: nnx.GraphDef | None = None,
        rollout_mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        self.graphdef = graphdef
        self.ref_graphdef = graphdef if ref_graphdef is None else ref_graphdef
        self.optimizer = optimizer
        self.cfg = cfg
        self.mesh = mesh
        self.rollout_mesh = mesh if rollout_mesh is None else rollout_mesh  # the sampler's layout (its own mesh)
        self.rules = LOGICAL_RULES if rules is None else rules
        self.state_shardings: TrainState | None = None  # set by init_state when there is a mesh
        self._sharded_jits: dict[tuple, Callable] = {}
        self._longest_jit = jax.jit(self._longest, out_shardings=None if mesh is None else replicated(mesh))
        if mesh is None:
            self.rollout: Callable[..., Rollout] = jax.jit(self._rollout)
            self.sample: Callable[..., Rollout] = jax.jit(self._sample)
            self.finish: Callable[..., Rollout] = jax.jit(self._finish, static_argnums=2)
            self.update: Callable[..., tuple[TrainState, dict[str, Array]]] = jax.jit(self._update, donate_argnums=0)
            self.score: Callable[..., tuple[Array, dict[str, Array]]] = jax.jit(self._score)
            self.sync_reference = jax.jit(self._sync_reference, static_argnums=1)
        else:
            self.rollout = self._sharded_rollout
            self.sample = self._sharded_sample
            self.finish = self._sharded_finish
            self.update = self._sharded_update
            self.score = self._sharded_score
            self.sync_reference = self._sharded_sync_reference
            # traced under the mesh, so the model's activation constraints (`rloo_jax.mesh.constrain`) apply
            self._rollout, self._update = self._on_mesh(self._rollout), self._on_mesh(self._update)
            self._sample, self._finish = self._on_mesh(self._sample), self._on_mesh(self._finish)

    def init_state(
        self, params: nnx.State, ref_params: nnx.State | None = None, frozen: nnx.State | None = None
    ) -> TrainState:
        """A fresh state; ``ref_params`` is required when beta > 0 (usually a copy of the initial policy), unless
        ``frozen`` is given (LoRA: ``params`` are the adapters, ``frozen`` the base, which is the reference).

        With a mesh the state is created directly on its shardings (the optimizer state is initialised sharded).
        """
        ref_params = self._check_reference(ref_params, frozen)
        if self.mesh is None:
            return TrainState(
                params=params,
                opt_state=self.optimizer.init(params),
                ref_params=ref_params,
                step=jnp.zeros((), jnp.int32),
                frozen=frozen,
            )
        shardings = self._fix_shardings(params, ref_params, frozen)
        params = shard_params(params, shardings.params)
        return TrainState(
            params=params,
            opt_state=jax.jit(self.optimizer.init, out_shardings=shardings.opt_state)(params),
            ref_params=None if ref_params is None else shard_params(ref_params, shardings.ref_params),
            step=replicate(np.zeros((), np.int32), self.mesh),
            frozen=None if frozen is None else shard_params(frozen, shardings.frozen),
        )

    def _check_reference(self, ref_params: nnx.State | None, frozen: nnx.State | None) -> nnx.State | None:
        """The reference to keep: None when beta == 0 or when the frozen base is the reference (LoRA)."""
        if self.cfg.rloo.beta == 0.0 or frozen is not None:
            return None
        if ref_params is None:
            raise ValueError("beta != 0 needs ref_params (a frozen copy of the initial policy)")
        return ref_params

    def _on_mesh(self, f: Callable) -> Callable:
        def traced(*args: object) -> object:
            with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
                return f(*args)

        return traced

    def abstract_state(
        self, params: nnx.State, ref_params: nnx.State | None = None, frozen: nnx.State | None = None
    ) -> TrainState:
        """The state ``init_state`` would build, as ``ShapeDtypeStruct`` leaves (with their shardings on a mesh):
        for ahead-of-time compilation (``lower_rollout``, ``lower_update``) without any parameter in memory.
        ``params``/``ref_params``/``frozen`` may themselves be abstract (``nnx.eval_shape``)."""
        ref_params = None if self.cfg.rloo.beta == 0.0 or frozen is not None else ref_params
        abstract = jax.eval_shape(self._new_state, params, ref_params, frozen)
        if self.mesh is None:
            return abstract
        shardings = self._fix_shardings(params, ref_params, frozen)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)

    def _new_state(self, params: nnx.State, ref_params: nnx.State | None, frozen: nnx.State | None) -> TrainState:
        return TrainState(params, self.optimizer.init(params), ref_params, jnp.zeros((), jnp.int32), frozen)

    def _fix_shardings(
        self, params: nnx.State, ref_params: nnx.State | None, frozen: nnx.State | None = None
    ) -> TrainState:
        """The state's shardings by the rule table (``self.state_shardings``, which the sharded jits take)."""
        abstract = jax.eval_shape(self._new_state, params, ref_params, frozen)
        self.state_shardings = state_shardings(abstract, self.mesh, self.rules)
        return self.state_shardings

    # -- sharded entry points (mesh given) ----------------------------------------------------------------------
    def _jit(self, name: str, key: tuple, make: Callable[[], Callable]) -> Callable:
        """One jitted function per (entry point, batch shardings): shardings depend on the batch sizes."""
        if self.state_shardings is None and name != "score":
            raise RuntimeError("RLOOStep with a mesh: call init_state first (it fixes the state's shardings)")
        if (name, *key) not in self._sharded_jits:
            self._sharded_jits[(name, *key)] = make()
        return self._sharded_jits[(name, *key)]

    def _rollout_shardings(
        self, num_prompts: int, with_ref: bool = True
    ) -> tuple[NamedSharding, NamedSharding, Rollout]:
        """Shardings of the prompts ``[B, ..]``, the completions ``[N, ..]`` (rows only: any width) and a whole
        ``Rollout`` (``with_ref``: as ``finish`` returns it, with its reference log-probs when beta != 0 and the
        sampler's log-probs when the old ones are recomputed; else as ``sample`` returns it)."""
        b = batch_sharding(self.mesh, (num_prompts,))
        n = batch_sharding(self.mesh, (num_prompts * self.cfg.num_generations,))
        ro = Rollout(
            prompt_ids=b, prompt_mask=b, completion_ids=n, completion_mask=n, is_truncated=n, old_logps=n,
            ref_logps=n if self.cfg.rloo.beta != 0.0 and with_ref else None,
            sampler_logps=n if self.cfg.recompute and with_ref else None,
        )
        return b, n, ro

    def _rollout_jit(self, num_prompts: int) -> Callable:
        if self.mesh is None:
            return self.rollout
        b, _, ro = self._rollout_shardings(num_prompts)
        return self._jit("rollout", (b,), lambda: jax.jit(
            self._rollout, in_shardings=(self.state_shardings, b, b, replicated(self.mesh)), out_shardings=ro
        ))

    def _sharded_rollout(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array) -> Rollout:
        return self._rollout_jit(prompt_ids.shape[0])(state, prompt_ids, prompt_mask, key)

    def _sharded_sample(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array) -> Rollout:
        b, _, ro = self._rollout_shardings(prompt_ids.shape[0], with_ref=False)
        fn = self._jit("sample", (b,), lambda: jax.jit(
            self._sample, in_shardings=(self.state_shardings, b, b, replicated(self.mesh)), out_shardings=ro
        ))
        return fn(state, prompt_ids, prompt_mask, key)

    def _sharded_finish(self, state: TrainState, rollout: Rollout, width: int) -> Rollout:
        num_prompts = rollout.prompt_ids.shape[0]
        _, n, ro_in = self._rollout_shardings(num_prompts, with_ref=False)
        _, _, ro = self._rollout_shardings(num_prompts)
        fn = self._jit("finish", (n, width), lambda: jax.jit(
            lambda s, r: self._finish(s, r, width), in_shardings=(self.state_shardings, ro_in), out_shardings=ro
        ))
        return fn(state, rollout)

    def longest(self, rollout: Rollout) -> int:
        """The generation batch's longest completion, EOS included (``max_new_tokens`` when one has no EOS): the
        width ``finish`` must keep (``completion_width``). One small program; every process gets the value."""
        return int(np.asarray(self._longest_jit(rollout.completion_ids).addressable_data(0)))

    def _sharded_score(
        self, rollout: Rollout, rewards_per_func: Array, reward_weights: Array
    ) -> tuple[Array, dict[str, Array]]:
        _, n, ro = self._rollout_shardings(rollout.prompt_ids.shape[0])
        rep = replicated(self.mesh)
        fn = self._jit("score", (n,), lambda: jax.jit(
            self._score, in_shardings=(ro, n, rep), out_shardings=(n, rep)
        ))
        return fn(rollout, rewards_per_func, reward_weights)

    def _update_jit(self, num_prompts: int) -> Callable:
        if self.mesh is None:
            return self.update
        _, n, ro = self._rollout_shardings(num_prompts)
        rep = replicated(self.mesh)
        return self._jit("update", (n,), lambda: jax.jit(
            self._update,
            in_shardings=(self.state_shardings, ro, n, rep),
            out_shardings=(self.state_shardings, rep),
            donate_argnums=0,
        ))

    def _sharded_update(
        self, state: TrainState, rollout: Rollout, rewards_per_func: Array, reward_weights: Array
    ) -> tuple[TrainState, dict[str, Array]]:
        return self._update_jit(rollout.prompt_ids.shape[0])(state, rollout, rewards_per_func, reward_weights)

    def compile_update(
        self, state: TrainState, prompt_shape: tuple[int, int], reward_weights: Array, width: int | None = None
    ) -> None:
        """Compile ``update`` for prompts ``[B, P]`` (completions ``width`` wide, default ``max_new_tokens``)
        before its first call; that call then reuses the executable.

        The trainer runs this in a thread while the first rollout compiles and runs: XLA compiles the two
        programs on two cores at once instead of one after the other (the first step's wall time). Rewards are
        ``[B*G, F]`` float32 with ``F = len(reward_weights)``.
        """
        self.lower_update(state, prompt_shape, reward_weights, width).compile()

    def _batch_sds(self, num_prompts: int) -> Callable[[tuple[int, ...], object], jax.ShapeDtypeStruct]:
        """Abstract batch arrays with the shardings of the real arguments (or jit would compile again)."""
        n = num_prompts * self.cfg.num_generations
        pb, nb = self._rollout_shardings(num_prompts)[:2] if self.mesh is not None else (None, None)
        return lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=nb if shape[0] == n else pb)

    def lower_rollout(self, state: TrainState, prompt_shape: tuple[int, int]) -> jax.stages.Lowered:
        """``rollout`` lowered for prompts ``[B, P]`` (``state`` concrete or from ``abstract_state``)."""
        b, p = prompt_shape
        sds = self._batch_sds(b)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=None if self.mesh is None else replicated(self.mesh))
        return self._rollout_jit(b).lower(state, sds((b, p), jnp.int32), sds((b, p), jnp.int32), key)

    def lower_update(
        self,
        state: TrainState,
        prompt_shape: tuple[int, int],
        reward_weights: Array | jax.ShapeDtypeStruct,
        width: int | None = None,
    ) -> jax.stages.Lowered:
        """``update`` lowered for prompts ``[B, P]``, completions ``width`` wide (default ``max_new_tokens``) and
        ``len(reward_weights)`` reward functions."""
        b, p = prompt_shape
        n, c = b * self.cfg.num_generations, width or self.cfg.sampling.max_new_tokens
        sds, i32, f32 = self._batch_sds(b), jnp.int32, jnp.float32
        rollout = Rollout(
            prompt_ids=sds((b, p), i32), prompt_mask=sds((b, p), i32), completion_ids=sds((n, c), i32),
            completion_mask=sds((n, c), i32), is_truncated=sds((n,), jnp.bool_), old_logps=sds((n, c), f32),
            ref_logps=sds((n, c), f32) if self.cfg.rloo.beta != 0.0 else None,
            sampler_logps=sds((n, c), f32) if self.cfg.recompute else None,
        )
        rewards = sds((n, reward_weights.shape[0]), f32)
        return self._update_jit(b).lower(state, rollout, rewards, reward_weights)

    def _sharded_sync_reference(self, state: TrainState, alpha: float) -> TrainState:
        fn = self._jit("sync_reference", (alpha,), lambda: jax.jit(
            lambda s: self._sync_reference(s, alpha),
            in_shardings=(self.state_shardings,),
            out_shardings=self.state_shardings,
        ))
        return fn(state)

    def _rows(self, x: Array, axis: int = 0) -> Array:
        """Keep a batch dimension split over data x fsdp after reshapes/repeats (no-op without a mesh)."""
        return x if self.mesh is None else constrain_batch(x, self.mesh, axis)

    # -- rollout ------------------------------------------------------------------------------------------------
    # rollout = finish(sample(...), max_new_tokens) in one program. The trainer calls the two apart: after
    # sampling it reads the longest completion and finishes (reference pass) and updates at the smallest
    # completion width that holds it (``completion_width``), which skips the padding of early-ending batches.
    def _rollout(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array) -> Rollout:
        return self._finish(state, self._sample(state, prompt_ids, prompt_mask, key), self.cfg.sampling.max_new_tokens)

    def _sample(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array) -> Rollout:
        """Sample the completions: the rollout without reference log-probs, ``max_new_tokens`` wide."""
        cfg = self.cfg
        sc = cfg.sampling
        gen = generate_fn(self.graphdef, policy_params(state), prompt_ids, prompt_mask, key, sc, self.rollout_mesh)
        prompt_ids, prompt_mask = _left_align(prompt_ids, prompt_mask)
        # TRL's mask/truncation rule (a pad id as last token counts as terminated)
        mask, truncated = completion_mask(gen.completion_ids, sc.eos_token_ids or (-1,), sc.pad_token_id)
        if cfg.rloo.mask_truncated_completions:
            mask = mask * (~truncated)[:, None].astype(mask.dtype)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=gen.completion_ids,
            completion_mask=mask,
            is_truncated=truncated,
            old_logps=gen.logps * mask,
            ref_logps=None,
        )

    def _longest(self, completion_ids: Array) -> Array:
        """[] int32: the longest EOS-cut completion (what ``_score``'s length metrics count)."""
        sc = self.cfg.sampling
        eos_mask, _ = completion_mask(completion_ids, sc.eos_token_ids or (-1,), sc.pad_token_id)
        return jnp.max(jnp.sum(eos_mask, axis=1))

    def _finish(self, state: TrainState, rollout: Rollout, width: int) -> Rollout:
        """The rollout cut to ``width`` completion positions (``truncate``), with the reference log-probs when
        beta != 0 and, when ``cfg.recompute``, the old log-probs from a training forward at the sampling
        parameters (no dropout; the sampler's kept as ``sampler_logps``). Both run in the update's micro-batches:
        these passes never hold more activations than a training step."""
        cfg = self.cfg
        rollout = truncate(rollout, width)
        if cfg.rloo.beta == 0.0 and not cfg.recompute:
            return rollout
        mask = rollout.completion_mask
        micro = self._micro_batches(
            rollout.prompt_ids, rollout.prompt_mask, {"completion_ids": rollout.completion_ids, "mask": mask}
        )
        ref = state.frozen if state.ref_params is None else state.ref_params  # LoRA: the base, adapters off
        passes = {"ref": (self.ref_graphdef, ref)} if cfg.rloo.beta != 0.0 else {}
        if cfg.recompute:  # the policy exactly as it sampled (same parameters; training forward, no dropout)
            passes["old"] = (self.graphdef, policy_params(state))

        def forward(i: Array) -> dict[str, Array]:
            mb = jax.tree.map(lambda x: self._rows(x[i]), micro)
            return {name: completion_logps(graphdef, params, mb["prompt_ids"], mb["prompt_mask"],
                                           mb["completion_ids"], mb["mask"], cfg.temperature, cfg.logprob_chunk)
                    for name, (graphdef, params) in passes.items()}

        out = {k: v.reshape(mask.shape) * mask for k, v in _map(forward, cfg.steps_per_generation).items()}
        if "ref" in out:
            rollout = rollout.replace(ref_logps=out["ref"])
        if "old" in out:
            rollout = rollout.replace(old_logps=out["old"], sampler_logps=rollout.old_logps)
        return rollout

    # -- scoring ------------------------------------------------------------------------------------------------
    def _score(self, rollout: Rollout, rewards_per_func: Array, reward_weights: Array) -> tuple[Array, dict]:
        """Advantages ``[N]`` and the generation-time metrics (rewards, KL, completion lengths)."""
        adv, metrics = score_completions(
            rewards_per_func,
            rollout.completion_mask,
            rollout.is_truncated,
            rollout.old_logps,
            rollout.ref_logps,
            num_generations=self.cfg.num_generations,
            reward_weights=reward_weights,
            options=self.cfg.rloo,
        )
        eos_mask, _ = completion_mask(
            rollout.completion_ids, self.cfg.sampling.eos_token_ids or (-1,), self.cfg.sampling.pad_token_id
        )
        lengths = jnp.sum(eos_mask, axis=1)
        metrics.update(_completion_stats(eos_mask, lengths, rollout.is_truncated))
        n_prompt_tokens = jnp.sum(rollout.prompt_mask) * self.cfg.num_generations
        metrics["num_tokens"] = (n_prompt_tokens + jnp.sum(lengths)).astype(jnp.float32)
        return adv, metrics

    # -- update -------------------------------------------------------------------------------------------------
    def _loss(
        self, params: nnx.State, frozen: nnx.State | None, mb: dict[str, Array], key: Array | None
    ) -> tuple[Array, dict[str, Array]]:
        cfg = self.cfg
        whole = params if frozen is None else nnx.merge_state(frozen, params)  # gradients reach `params` only
        logps, entropy = completion_logps(
            self.graphdef, whole, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["mask"],
            cfg.temperature, cfg.logprob_chunk, with_entropy=True, dropout_key=key,
            frozen_unembed=frozen is not None,  # LoRA: the head is part of the frozen base
        )
        mask = mb["mask"].astype(jnp.float32)
        old = jax.lax.stop_gradient(logps) if cfg.on_policy else mb["old_logps"]
        r = cfg.rloo
        # the sampler/trainer gap: training-forward log-probs at the sampling parameters vs the sampler's. Not
        # recomputed (on-policy, no dropout), this forward is that training forward.
        if cfg.recompute:
            trained, sampled = mb["old_logps"], mb["sampler_logps"]
        else:
            trained, sampled = jax.lax.stop_gradient(logps), mb["old_logps"]
        gap = sampling_logp_difference(trained, sampled, mask)
        weights = None
        if r.importance_sampling_mode is not None:
            weights, is_metrics = importance_sampling_weights(
                trained, sampled, mask, r.importance_sampling_mode, r.importance_sampling_clip_min,
                r.importance_sampling_clip_max,
            )
            gap.update(is_metrics)
        loss, metrics = clipped_objective(
            logps, old, mb["advantages"], mask, r.epsilon, r.epsilon_high, r.level, r.aggregation,
            importance_weights=weights,
        )
        metrics.update(gap)
        if r.beta != 0.0 and r.token_level_kl:
            loss = loss + r.beta * kl_loss(logps, mb["ref_logps"], mask, r.kl_estimator)
        metrics["entropy"] = masked_mean(entropy, mask)
        return loss, metrics

    def _update(
        self, state: TrainState, rollout: Rollout, rewards_per_func: Array, reward_weights: Array
    ) -> tuple[TrainState, dict[str, Array]]:
        cfg = self.cfg
        adv, metrics = self._score(rollout, rewards_per_func, reward_weights)
        spg, gas = cfg.steps_per_generation, cfg.gradient_accumulation_steps
        batch = {
            "completion_ids": rollout.completion_ids,
            "mask": rollout.completion_mask,
            "old_logps": rollout.old_logps,
            "advantages": adv,
        }
        if cfg.recompute:
            batch["sampler_logps"] = rollout.sampler_logps
        if cfg.rloo.beta != 0.0 and cfg.rloo.token_level_kl:
            batch["ref_logps"] = rollout.ref_logps
        micro = self._micro_batches(rollout.prompt_ids, rollout.prompt_mask, batch)
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)

        def micro_grads(params: nnx.State, u: Array, i: Array) -> tuple[nnx.State, dict[str, Array]]:
            mb = jax.tree.map(lambda x: self._rows(x[i]), micro)
            key = None
            if cfg.dropout_seed is not None:  # a fresh mask per update and micro-batch, reproducible on resume
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.dropout_seed), state.step + u), i)
            (loss, m), grads = grad_fn(params, state.frozen, mb, key)
            if self.state_shardings is not None:  # gradients reduce-scattered to the params' layout (FSDP)
                grads = jax.lax.with_sharding_constraint(grads, self.state_shardings.params)
            m["loss"] = loss
            return grads, m

        def one_update(carry: tuple[nnx.State, optax.OptState], u: Array) -> tuple[tuple, dict[str, Array]]:
            params, opt_state = carry
            first = (u % (spg // gas)) * gas
            if gas == 1:  # no zeros + add + divide over every parameter
                grads, m = micro_grads(params, u, first)
            else:

                def accumulate(grads_sum: nnx.State, j: Array) -> tuple[nnx.State, dict[str, Array]]:
                    grads, m = micro_grads(params, u, first + j)
                    return jax.tree.map(jnp.add, grads_sum, grads), m

                grads, m = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), jnp.arange(gas))
                grads = jax.tree.map(lambda x: x / gas, grads)
            grad_norm = optax.global_norm(grads)
            updates, opt_state = self.optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            # micro-batches of one update: TRL logs the mean of per-micro-batch values (clip ratios, loss, ...);
            # the sampler/trainer statistics are the generation batch's, whose extremes are the micro-batches'
            m = {name: _reduce(name, v) if name.startswith("sampling/") else jnp.mean(v) for name, v in m.items()}
            m["grad_norm"] = grad_norm
            return (params, opt_state), m

        (params, opt_state), ms = _scan(one_update, (state.params, state.opt_state), cfg.updates_per_generation)
        # TRL averages per-micro-batch values over the logging window; extremes keep their extreme
        metrics.update({name: _reduce(name, values) for name, values in ms.items()})
        new_state = state.replace(params=params, opt_state=opt_state, step=state.step + cfg.updates_per_generation)
        return new_state, metrics

    def _micro_batches(self, prompt_ids: Array, prompt_mask: Array, batch: dict[str, Array]) -> dict[str, Array]:
        """Completion arrays ``[N, ...]`` -> ``[spg, N / spg, ...]``: micro-batch i of the generation batch, with
        its prompts ``prompt_ids``/``prompt_mask`` ``[spg, B / spg, P]`` when every micro-batch holds whole groups
        whose prompts split evenly over the data shards (each prompt runs once, shared by its G completions: the
        forward's rows are [prompt; its G completions], so fewer prompts than shards would put every completion on
        every device), else a copy per completion ``[spg, N / spg, P]``."""
        g, spg = self.cfg.num_generations, self.cfg.steps_per_generation
        n = batch["completion_ids"].shape[0]
        if n % spg:
            raise ValueError(f"{n} completions cannot be split into steps_per_generation={spg} micro-batches")
        shards = 1 if self.mesh is None else int(np.prod([self.mesh.shape[a] for a in BATCH_AXES]))
        share = (n // spg) % g == 0 and (n // spg // g) % shards == 0
        batch = dict(
            batch,
            prompt_ids=prompt_ids if share else self._rows(jnp.repeat(prompt_ids, g, 0)),
            prompt_mask=prompt_mask if share else self._rows(jnp.repeat(prompt_mask, g, 0)),
        )
        return jax.tree.map(lambda x: self._rows(x.reshape(spg, x.shape[0] // spg, *x.shape[1:]), axis=1), batch)

    def _sync_reference(self, state: TrainState, alpha: float) -> TrainState:
        if state.frozen is not None:
            raise ValueError("with LoRA the reference is the frozen base (adapters off): there is no copy to sync")
        return state.replace(ref_params=sync_reference(state.params, state.ref_params, alpha))


def _reduce(name: str, values: Array) -> Array:
    """Per-micro-batch values of metric ``name`` -> one: the min of minima (``*_min``, ``*/min``), the max of
    maxima, else the mean."""
    if name.endswith(("_min", "/min")):
        return jnp.min(values)
    if name.endswith(("_max", "/max")):
        return jnp.max(values)
    return jnp.mean(values)


def _scan(f: Callable, init: object, length: int) -> tuple[object, object]:
    """``lax.scan(f, init, arange(length))``; one direct call when ``length == 1`` (XLA:CPU copies a while loop's
    carry, here the parameters and optimizer state, in and out)."""
    if length == 1:
        carry, y = f(init, jnp.zeros((), jnp.int32))
        return carry, jax.tree.map(lambda v: v[None], y)
    return jax.lax.scan(f, init, jnp.arange(length))


def _map(f: Callable[[Array], object], length: int) -> object:
    """``lax.map(f, arange(length))`` stacked ``[length, ...]`` (leafwise); one direct call when ``length == 1``."""
    if length == 1:
        return jax.tree.map(lambda x: x[None], f(jnp.zeros((), jnp.int32)))
    return jax.lax.map(f, jnp.arange(length))


def _left_align(prompt_ids: Array, prompt_mask: Array) -> tuple[Array, Array]:
    """Any padding -> left padding (stable), as the sampler sees the prompts."""
    order = jnp.argsort(prompt_mask.astype(jnp.int32), axis=1, stable=True)
    return (
        jnp.take_along_axis(prompt_ids.astype(jnp.int32), order, axis=1),
        jnp.take_along_axis(prompt_mask.astype(jnp.int32), order, axis=1),
    )
