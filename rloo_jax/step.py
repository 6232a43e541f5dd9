"""What one training step computes, for any algorithm: the traced functions the jitted programs run.

    sampled  = step.sample(state, prompt_ids, prompt_mask, key)         # the sampler (KV cache)
    rollout  = step.finish(state, sampled, width)                       # cut to width; reference / old log-probs
    rewards_per_func = <host: decode, reward functions / reward models>  # [N, F], NaN for None
    state, metrics = step.update(state, rollout, rewards_per_func, w)   # algorithm.score, then optimizer steps

An algorithm (``rloo_jax.algorithms``: RLOO, GRPO, ...) enters only through its pure functions: ``score`` (per-row
targets such as advantages, once per generation batch) and ``loss`` (one micro-batch), plus what they ask for
(reference log-probs, an entropy gradient, a state carried between optimizer steps). Nothing here is jitted or
placed on devices: ``rloo_jax.programs`` turns these functions into compiled programs (with shardings on a mesh)
that the training loop calls and ``--compile_only`` lowers.

Shapes: B prompts, G generations, N = B*G completions, P prompt length, C completion length, U optimizer updates
per generation batch, M = gradient_accumulation_steps micro-batches per update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from rloo_jax.algorithms import RLOO, Algorithm
from rloo_jax.algorithms.common import (
    ImportanceSampling,
    LossInputs,
    ScoreInputs,
    importance_sampling_weights,
    sampling_logp_difference,
)
from rloo_jax.errors import ConfigError
from rloo_jax.logprobs import completion_mask, masked_mean, per_token_logps_from_hidden
from rloo_jax.mesh import BATCH_AXES, constrain_batch
from rloo_jax.models import moe
from rloo_jax.models.transformer import Routes
from rloo_jax.optimizer import transformation_at
from rloo_jax.sampling import SamplingConfig, generate_fn
from rloo_jax.turns import Turns, resume_turns, start_turns
from rloo_jax.turns import completions as turns_completions

Array = jax.Array


@struct.dataclass
class TrainState:
    """Everything that changes during training (a pytree; checkpoint it whole)."""

    params: nnx.State  # what is trained: the policy's nnx.Param state, or with LoRA its adapters only
    opt_state: optax.OptState
    ref_params: nnx.State | None  # frozen reference: the policy's copy, with LoRA the starting adapters' or None
    step: Array  # [] int32, optimizer updates applied so far
    frozen: nnx.State | None = None  # LoRA: the base model (never trained; adapters off: new adapters' reference)
    algo_state: Any = None  # what the algorithm carries between optimizer steps (GRPO: its entropy controller)
    value_params: nnx.State | None = None  # a value model's nnx.Param state, trained with `params` (PPO); else None
    reward_params: nnx.State | None = None  # reward models scored on the device (frozen), else None
    grad_acc: Any = None  # an optimizer step begun in an earlier generation batch (`Accumulator`), else None

    @property
    def trained(self) -> Any:
        """What the optimizer steps: ``params``, or ``(params, value_params)`` with a value model (one AdamW over
        both, as TRL's PPO)."""
        return self.params if self.value_params is None else (self.params, self.value_params)


@struct.dataclass
class Accumulator:
    """The micro-batches of an optimizer step that one generation batch began and the next one completes (when
    ``steps_per_generation x num_iterations`` is not a multiple of ``gradient_accumulation_steps``): their summed
    gradients (float32, the trained pytree's structure), summed algorithm statistics and summed losses. How many
    micro-batches it holds is static (``UpdatePlan.carried``, the host's count)."""

    grads: Any
    stats: dict[str, Array] | None  # None for an algorithm without statistics (a checkpoint holds no empty dict)
    loss: Array  # [] float32


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """Which micro-batches of a generation batch one update program runs (static: one compiled program each).

    TRL's stream: micro-batch calls k = 0, 1, ...; a generation every ``spg x num_iterations`` calls (call k of a
    generation reads its micro-batch ``k % spg``); an optimizer step every ``gas`` calls, across generations.
    ``carried``: micro-batches of the current optimizer step already accumulated (``TrainState.grad_acc``) before this
    generation's first; ``micro_batches``: this generation's micro-batches to run (all ``spg x num_iterations``, or
    fewer where ``max_steps`` ends the run). Example: spg 3, gas 2: generation 0 runs (0, 3): one step, one micro-batch
    carried; generation 1 (1, 3): two steps, none carried; the phases repeat every gas / gcd(3, 2) = 2 generations.
    """

    carried: int
    micro_batches: int

    def steps(self, gas: int) -> int:
        """Optimizer steps the program completes: (carried + micro_batches) // gas."""
        return (self.carried + self.micro_batches) // gas

    def carried_out(self, gas: int) -> int:
        """Micro-batches left for the next generation's program: (carried + micro_batches) % gas."""
        return (self.carried + self.micro_batches) % gas


def plan_update(carried: int, remaining_steps: int, micro_per_generation: int, gas: int) -> UpdatePlan:
    """The next generation's ``UpdatePlan``: all its micro-batches, or only those the run's last
    ``remaining_steps`` optimizer steps need (TRL stops exactly at ``max_steps``). Example: carried 1, gas 2,
    3 micro-batches per generation: 5 steps left -> (1, 3); 1 left -> (1, 1)."""
    need = remaining_steps * gas - carried
    return UpdatePlan(carried, max(0, min(micro_per_generation, need)))


def run_plans(total_steps: int | None, micro_per_generation: int, gas: int) -> tuple[UpdatePlan | None, ...]:
    """Every distinct ``UpdatePlan`` the generation batches of a run of ``total_steps`` optimizer steps take, in
    order of first use (``plan_update`` from the first batch to the last; None for the default plan, as
    ``Programs.update_program`` keys it): the update programs such a run compiles. ``total_steps`` None: a run too
    long to end in the cycle shown (the steady state only). Example: 4 steps, 3 micro-batches per generation, gas 2
    -> (None, UpdatePlan(1, 3), UpdatePlan(0, 2)): 1 + 2 + 1 steps; None steps -> (None, UpdatePlan(1, 3))."""
    default = UpdatePlan(0, micro_per_generation)
    plans: dict[UpdatePlan | None, None] = {}
    carried, remaining = 0, total_steps
    while remaining is None or remaining > 0:
        plan = plan_update(carried, micro_per_generation if remaining is None else remaining, micro_per_generation,
                           gas) if remaining is not None else UpdatePlan(carried, micro_per_generation)
        key = None if plan == default else plan
        if remaining is None and key in plans:
            break  # the cycle of carried micro-batches closed
        plans[key] = None
        if remaining is not None:
            remaining -= plan.steps(gas)
        carried = plan.carried_out(gas)
    return tuple(plans)


def completion_widths(max_length: int, bucket: int) -> tuple[int, ...]:
    """Every completion width ``completion_width`` can choose, widest first: ``max_length`` and each ``bucket * 2^k``
    below it. Example: (1024, 128) -> (1024, 512, 256, 128); (12, 128) -> (12,); bucket 0 -> (max_length,)."""
    widths, w = [max_length], bucket
    while 0 < w < max_length:
        widths.insert(1, w)
        w *= 2
    return tuple(widths)


@struct.dataclass
class Rollout:
    """One generation batch, ready to be scored."""

    prompt_ids: Array  # [B, P] int32, left-padded
    prompt_mask: Array  # [B, P] int32
    completion_ids: Array  # [N, C] int32, right-padded with pad
    completion_mask: Array  # [N, C] int32 (zero rows for truncated completions if mask_truncated_completions)
    is_truncated: Array  # [N] bool
    old_logps: Array  # [N, C] float32, behaviour-policy log-probs: the sampler's, or recomputed by `finish`
    ref_logps: Array | None  # [N, C] float32, reference log-probs; None without a reference
    sampler_logps: Array | None = None  # [N, C] float32, the sampler's when old_logps were recomputed, else None
    values: Array | None = None  # [N, C] float32, the value model's estimates at sampling time (needs_values)
    scores: Array | None = None  # [N, R] float32, the reward models scored on the device (prompt + completion)
    tool_mask: Array | None = None  # [N, C] int32, multi-turn: 1 where the model sampled the token (0 at tool results)
    # routing replay (`StepConfig.routes`): the sampler's experts (`transformer.Routes`: prompt [B, P, L, K],
    # completion [N, C, L, K]) that the old-log-prob, reference and update forwards route the tokens to; else None
    routes: Routes | None = None

    @property
    def loss_mask(self) -> Array:
        """[N, C]: the tokens the loss, the KL, the entropy and the ratios see: ``completion_mask`` (every real token,
        the attention mask over the completion), times ``tool_mask`` in a multi-turn rollout (TRL's
        ``completion_mask * tool_mask``)."""
        return loss_mask(self.completion_mask, self.tool_mask)


def loss_mask(completion_mask: Array, tool_mask: Array | None) -> Array:
    """``completion_mask * tool_mask`` (``completion_mask`` when there is no tool mask): [N, C]. Example: mask
    ``[[1, 1, 1, 0]]``, tool mask ``[[1, 0, 1, 0]]`` -> ``[[1, 0, 1, 0]]``."""
    return completion_mask if tool_mask is None else completion_mask * tool_mask.astype(completion_mask.dtype)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static, hashable options of a step (TRL names). Built once from the run config."""

    sampling: SamplingConfig
    algorithm: Algorithm = RLOO()
    """What is optimised: its ``score`` and ``loss`` (``rloo_jax.algorithms``)."""
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
    instead of the sampler's. None: when off-policy, with dropout, or with the importance-sampling correction (the
    update's own forward cannot stand in for them then). See ``recompute``."""
    importance_sampling: ImportanceSampling | None = None
    """The sampler/trainer correction; None: off."""
    logprob_temperature: float | None = None
    """The temperature of every log-prob (training, old, reference); None: the sampler's (1 when greedy). TRL
    1.12's PPO divides by temperature + 1e-7."""
    pad_is_padding: bool = False
    """Every sampled pad token is padding too (out of the completion mask, out of attention), as TRL 1.12's PPO
    treats every pad id (``attention_mask = ids != pad``); else only what follows the EOS is."""
    multi_turn: bool = False
    """Rollouts are conversations (``rloo_jax.turns``: tool results between the model's turns): the rollout carries
    a ``tool_mask`` and the completion lengths count the model's tokens only (TRL's tool loop)."""
    given_logps: bool = False
    """The rollouts' log-probs come from a user's rollout_func (TRL: ``sampling_per_token_logps``): kept as
    ``sampler_logps`` (the old ones recomputed) and read by the off-policy mask (TRL's OPSM prefers them)."""
    row_order: bool = False
    """The update takes each micro-batch's rows as an input (``order [updates x gradient_accumulation_steps, rows]``
    int32, drawn on the host: PPO's per-epoch shuffles) instead of cutting the generation batch in order."""
    routes: tuple[int, int] | None = None
    """(L, K) of a mixture-of-experts policy's routes, which the sampler records (``Rollout.routes``); with
    ``routing_replay`` the old-log-prob, reference and update forwards replay them (each token to the sampler's
    experts, the gate weights from the current router), and either way the update measures its router's own choices
    against them (``sampling/routing_mismatch``); None: no routes, the router of each forward chooses."""
    routing_replay: bool = True
    """Whether the forwards replay ``routes`` (off: they are recorded for the metric only)."""
    router_aux_loss_coef: float = 0.0
    """A mixture of experts' load-balancing loss (transformers' ``aux_loss`` of the training forward), added to each
    micro-batch's loss with this weight and logged as ``aux_loss`` (TRL 1.16's GRPO / RLOO); 0: off."""
    logprob_chunk: int = 64
    """Sequence positions unembedded at a time when computing log-probs (bounds the [.., V] logits held: at
    8 rows x 1024 positions and V = 152k, 64 keeps the log-prob pass under 1/8 of the full float32 logits;
    see BENCHMARKS.md). Completions no longer than this are unembedded in one piece."""

    def __post_init__(self) -> None:
        if self.row_order and self.micro_per_generation % self.gradient_accumulation_steps:
            raise ValueError(
                f"row_order: steps_per_generation x num_iterations ({self.micro_per_generation}) must be a multiple "
                f"of gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.recompute_old_logps is False and not self.on_policy:
            raise ValueError("an off-policy step needs recomputed old log-probs (recompute_old_logps None or True)")

    @property
    def num_generations(self) -> int:
        return self.sampling.num_generations

    @property
    def temperature(self) -> float:
        """Temperature of every log-prob (greedy sampling records log-probs at 1, like the sampler)."""
        return self.logprob_temperature or self.sampling.temperature or 1.0

    @property
    def on_policy(self) -> bool:
        """Every micro-batch runs at the parameters it was sampled with: old = stop_gradient(current), the ratio is
        exactly 1. TRL's rule: gradient_accumulation_steps a multiple of steps_per_generation x num_iterations
        (one optimizer step holds whole generation batches)."""
        return self.gradient_accumulation_steps % self.micro_per_generation == 0

    @property
    def recompute(self) -> bool:
        """Whether ``finish`` recomputes the old log-probs with a training forward (TRL's rule: off-policy, or the
        sampler/trainer correction, which TRL applies to vLLM's samples). On policy without dropout the update's
        forward runs at the sampling parameters and stands in for it: the ratio is exactly 1 and the
        sampler/trainer gap is measured there, at no extra cost."""
        if self.given_logps:
            return True
        if self.recompute_old_logps is not None:
            return self.recompute_old_logps
        return not self.on_policy or self.dropout_seed is not None or self.importance_sampling is not None

    @property
    def micro_per_generation(self) -> int:
        """Micro-batch calls per generation batch (TRL's ``generate_every``): steps_per_generation x
        num_iterations."""
        return self.num_iterations * self.steps_per_generation

    @property
    def updates_per_generation(self) -> int:
        """Optimizer steps of a whole generation batch's default program (``UpdatePlan`` (0, micro_per_generation));
        rounded down where they do not divide."""
        return self.micro_per_generation // self.gradient_accumulation_steps

    @property
    def carries(self) -> bool:
        """Whether an optimizer step can span two generation batches (``TrainState.grad_acc`` then holds it)."""
        return self.micro_per_generation % self.gradient_accumulation_steps != 0

    def default_plan(self) -> UpdatePlan:
        return UpdatePlan(0, self.micro_per_generation)


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
    entropy_grad: bool = False,
    with_aux_loss: bool = False,
    routes: Routes | None = None,
    with_routing: bool = False,
) -> Array | tuple[Array, ...]:
    """Per-token log-probs of the completions under ``params``: ``[N, C]`` float32 (and entropy ``[N, C]``; and with
    ``with_aux_loss`` a mixture of experts' load-balancing loss ``[]``, transformers' ``aux_loss`` of the N
    ``[prompt; completion]`` rows; and with ``with_routing`` the routers' own choices for the completion tokens
    ``[N, C, L, K]``, as ``Routes.completion``; in that order, last). ``routes``: recorded experts to replay
    (``transformer.Routes``, rows as the prompts and completions).

    prompt_ids/mask ``[N, P]`` (one prompt per completion) or ``[B, P]`` with ``N = B*G`` (prompt ``r // G`` for
    completion ``r``); completion ids/mask ``[N, C]``. Each distinct prompt row runs through the model once and its
    G completions attend to its keys (``CausalLM.completion_hidden_states``; the same numbers as one forward over
    ``[prompt; completion]``, without repeating the prompt G times). The vocabulary projection runs in chunks of
    ``chunk`` positions (``per_token_logps_from_hidden``). With LoRA, ``params`` is ``lora.merge_params(base,
    adapters)``; ``dropout_key`` applies the adapters' dropout (training forwards), and ``frozen_unembed`` (the
    head gets no gradient) computes the log-probs' gradient in the forward pass (``per_token_logps_from_hidden``).
    ``entropy_grad``: the entropy carries a gradient (an entropy bonus in the loss).
    """
    model = nnx.merge(graphdef, params)
    if completion_ids.shape[0] % prompt_ids.shape[0]:
        raise ValueError(f"{completion_ids.shape[0]} completions do not split into {prompt_ids.shape[0]} prompts")
    hidden, aux, chosen = model.completion_states(prompt_ids, prompt_mask,
                                                  model_inputs(completion_ids, completion_mask), completion_mask,
                                                  dropout_key, routes, with_routing=True)
    out = per_token_logps_from_hidden(
        hidden, model.unembed, completion_ids, temperature, chunk_size=chunk, with_entropy=with_entropy,
        frozen_unembed=frozen_unembed, entropy_grad=entropy_grad,
    )
    if (with_aux_loss or with_routing) and aux is None:
        raise ValueError("with_aux_loss / with_routing: the model has no routed layers")
    extra = (aux,) * with_aux_loss + (chosen,) * with_routing
    if not extra:
        return out
    return (*out, *extra) if with_entropy else (out, *extra)


def model_inputs(completion_ids: Array, completion_mask: Array) -> Array:
    """The completion ids a forward reads: 0 outside the mask, as transformers' callers feed padding (TRL's
    ``forward``: ``masked_fill(ids, ~mask, 0)``). Only the outputs at padding positions depend on it."""
    return jnp.where(completion_mask > 0, completion_ids, jnp.zeros_like(completion_ids))


def head_scores(
    graphdef: nnx.GraphDef, params: nnx.State, prompt_ids: Array, prompt_mask: Array, completion_ids: Array,
    completion_mask: Array, dropout_key: Array | None = None,
) -> Array:
    """A value / reward model's head from each prompt's last token through every completion token:
    ``RewardModel.completion_scores`` ``[N, C + 1]`` float32 (entry t < C: the value before completion token t;
    entry n_r: the score of the row's n_r real tokens). Prompts ``[N, P]`` or shared ``[B, P]``."""
    model = nnx.merge(graphdef, params)
    return model.completion_scores(prompt_ids, prompt_mask, model_inputs(completion_ids, completion_mask),
                                   completion_mask, dropout_key)


def last_scores(heads: Array, completion_mask: Array) -> Array:
    """``head_scores`` read where a reward model scores a row: after its first n completion tokens, n the index of
    its first masked position (C when none; TRL's ``first_true_indices(response == pad)``): entry n, the prompt's
    last token for n = 0. ``[N, C + 1], [N, C] -> [N, 1]``. Heads ``[[1, 2, 3]]``, mask ``[[1, 0]]`` -> ``[[2]]``;
    mask ``[[0, 1]]`` -> ``[[1]]``."""
    c = completion_mask.shape[1]
    n = jnp.min(jnp.where(completion_mask > 0, c, jnp.arange(c)[None, :]), axis=1)
    return jnp.take_along_axis(heads, n[:, None], axis=1)


def completion_stats(lengths: Array, is_truncated: Array) -> dict[str, Array]:
    """TRL's ``completions/*`` metrics from the EOS-cut lengths ``[N]`` (the terminated lengths: 0 when no
    completion terminated, as TRL). Example: lengths [2, 5], truncated [False, True] -> mean 3.5, min 2, max 5,
    clipped_ratio 0.5, mean/min/max_terminated_length 2."""
    lengths = lengths.astype(jnp.float32)
    term = ~is_truncated
    n_term = jnp.sum(term.astype(jnp.float32))
    return {
        "completions/mean_length": jnp.mean(lengths),
        "completions/min_length": jnp.min(lengths),
        "completions/max_length": jnp.max(lengths),
        "completions/clipped_ratio": jnp.mean(is_truncated.astype(jnp.float32)),
        "completions/mean_terminated_length": jnp.where(n_term > 0, jnp.sum(lengths * term) / n_term, 0.0),
        "completions/min_terminated_length": jnp.where(n_term > 0, jnp.min(jnp.where(term, lengths, jnp.inf)), 0.0),
        "completions/max_terminated_length": jnp.where(n_term > 0, jnp.max(jnp.where(term, lengths, -jnp.inf)), 0.0),
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

    routes = rollout.routes
    return rollout.replace(
        completion_ids=cut(rollout.completion_ids), completion_mask=cut(rollout.completion_mask),
        old_logps=cut(rollout.old_logps), ref_logps=cut(rollout.ref_logps), sampler_logps=cut(rollout.sampler_logps),
        values=cut(rollout.values), tool_mask=cut(rollout.tool_mask),
        routes=None if routes is None else routes.replace(completion=cut(routes.completion)),
    )


def route_inputs(rollout: Rollout) -> dict[str, Array]:
    """A rollout's routes as batch entries (``Step.micro_batches`` splits them with the prompts and completions):
    ``prompt_routes`` [B, P, L, K], ``routes`` [N, C, L, K]; none without routes."""
    if rollout.routes is None:
        return {}
    return {"prompt_routes": rollout.routes.prompt, "routes": rollout.routes.completion}


def batch_routes(mb: dict[str, Array]) -> Routes | None:
    """A micro-batch's routes to replay (``route_inputs``), None without them."""
    return Routes(prompt=mb["prompt_routes"], completion=mb["routes"]) if "routes" in mb else None


def routing_mismatch(recorded: Array, chosen: Array, mask: Array) -> dict[str, Array]:
    """``sampling/routing_mismatch``: the fraction of the sampler's routing decisions (completion token x routed
    layer x slot, over the tokens of ``mask`` it recorded) whose expert the training forward's router would not
    choose itself (``moe.route_mismatch``; with routing replay what replay overrides, without it where the two
    routed differently). recorded ``[N, C, L, K]`` (-1: none: a dense layer, the never-fed last token), chosen
    ``[N, C, L, K]``, mask ``[N, C]`` -> a scalar, 0 without decisions. Example: one token, 1 layer, K 2, recorded
    [1, 3], chosen [1, 2] -> 0.5."""
    per_layer = jnp.broadcast_to(mask[..., None], recorded.shape[:-1])  # [N, C, L]
    mismatched, decisions = moe.route_mismatch(recorded.astype(jnp.int32), chosen, per_layer)
    return {"sampling/routing_mismatch": mismatched / jnp.maximum(decisions, 1.0)}


def policy_params(state: TrainState) -> nnx.State:
    """The whole policy's parameters: ``state.params``, or with LoRA the frozen base merged with the adapters."""
    return state.params if state.frozen is None else nnx.merge_state(state.frozen, state.params)


def sync_reference(params: nnx.State, ref_params: nnx.State, alpha: float) -> nnx.State:
    """TR-DPO reference update: ``ref <- alpha * policy + (1 - alpha) * ref`` (leafwise)."""
    return jax.tree.map(lambda p, r: (alpha * p + (1.0 - alpha) * r).astype(r.dtype), params, ref_params)


def reduce_metric(name: str, values: Array) -> Array:
    """Per-micro-batch values of metric ``name`` -> one: the min of minima (``*_min``, ``*/min``), the max of
    maxima, else the mean."""
    if name.endswith(("_min", "/min")):
        return jnp.min(values)
    if name.endswith(("_max", "/max")):
        return jnp.max(values)
    return jnp.mean(values)


# ----------------------------------------------------------------------------------------------- the step


class Step:
    """The traced functions of a training step, over static context only (graphdefs, the optax transform, the
    ``StepConfig`` with its algorithm, the meshes). ``rloo_jax.programs.Programs`` jits them.

    LoRA: ``graphdef`` is the model with adapters, ``ref_graphdef`` the same model without them; the state trains
    the adapters (``params``) on a ``frozen`` base. The reference is then the base with ``ref_graphdef`` (new
    adapters: no copy), or the base with a frozen copy of the starting adapters (``ref_params``: given adapters).
    ``mesh``: the training mesh (None: one device); ``rollout_mesh``: the sampler's own layout over the same devices
    (None: the training mesh). ``grad_shardings``: the parameters' shardings, which each micro-batch's gradients
    are reduce-scattered to (set by ``Programs`` on a mesh).

    ``value_graphdef``: a value model (``RewardModel``: a backbone with a scalar head) whose per-token estimates
    the algorithm reads (``needs_values``): at sampling parameters in ``finish``, with their gradient in the loss;
    the state then trains ``(params, value_params)`` with one optimizer. ``reward_graphdef``: a reward model scored
    on the token ids in ``finish`` (frozen, ``state.reward_params``), its score the first column of the rewards.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        optimizer: Any,  # an optax transformation, or `optimizer.Scheduled` (its horizon a program argument)
        cfg: StepConfig,
        mesh: jax.sharding.Mesh | None = None,
        ref_graphdef: nnx.GraphDef | None = None,
        rollout_mesh: jax.sharding.Mesh | None = None,
        value_graphdef: nnx.GraphDef | None = None,
        reward_graphdef: nnx.GraphDef | None = None,
    ) -> None:
        if cfg.algorithm.needs_values and value_graphdef is None:
            raise ValueError(f"{type(cfg.algorithm).__name__} needs a value model: pass value_graphdef")
        self.graphdef = graphdef
        self.value_graphdef = value_graphdef
        self.reward_graphdef = reward_graphdef
        self.ref_graphdef = graphdef if ref_graphdef is None else ref_graphdef
        self.optimizer = optimizer
        self.cfg = cfg
        self.algorithm = cfg.algorithm
        self.mesh = mesh
        self.rollout_mesh = mesh if rollout_mesh is None else rollout_mesh
        self.grad_shardings: Any = None

    # -- state --------------------------------------------------------------------------------------------------
    def new_state(self, params: nnx.State, ref_params: nnx.State | None, frozen: nnx.State | None,
                  value_params: nnx.State | None = None, reward_params: nnx.State | None = None) -> TrainState:
        state = TrainState(params, None, ref_params, jnp.zeros((), jnp.int32), frozen, self.algorithm.init_state(),
                           value_params, reward_params)
        if self.cfg.carries:  # an optimizer step can span two generation batches: its partial sum is state
            state = state.replace(grad_acc=self.new_accumulator(state.trained))
        return state.replace(opt_state=self.optimizer.init(state.trained))

    @property
    def device_rewards(self) -> int:
        """Reward columns scored on the device (``Rollout.scores``), ahead of the host's reward functions."""
        return 0 if self.reward_graphdef is None else 1

    def keeps_reference(self, frozen: nnx.State | None, ref_params: nnx.State | None = None) -> bool:
        """Whether the state holds a reference copy: the algorithm needs reference log-probs, and either there is
        no frozen base (full fine-tuning: a copy of the policy) or, with LoRA, one is given (of the starting
        adapters; without it the base with the adapters off is the reference)."""
        return self.algorithm.needs_reference and (frozen is None or ref_params is not None)

    def reference(self, state: TrainState) -> tuple[nnx.GraphDef, nnx.State]:
        """The reference policy's (graphdef, parameters): the frozen copy; with LoRA the base with the adapters
        off, or the base with the frozen copy of the starting adapters."""
        if state.frozen is None:
            return self.graphdef, state.ref_params
        if state.ref_params is None:
            return self.ref_graphdef, state.frozen
        return self.graphdef, nnx.merge_state(state.frozen, state.ref_params)

    def _rows(self, x: Array, axis: int = 0) -> Array:
        """Keep a batch dimension split over data x fsdp after reshapes/repeats (no-op without a mesh)."""
        return x if self.mesh is None else constrain_batch(x, self.mesh, axis)

    # -- rollout ------------------------------------------------------------------------------------------------
    # rollout = finish(sample(...), max_new_tokens) in one program. The trainer calls the two apart: after
    # sampling it reads the longest completion and finishes (reference pass) and updates at the smallest
    # completion width that holds it (``completion_width``), which skips the padding of early-ending batches.
    def rollout(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array) -> Rollout:
        return self.finish(state, self.sample(state, prompt_ids, prompt_mask, key), self.cfg.sampling.max_new_tokens)

    def sample(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array,
               sampling: SamplingConfig | None = None) -> Rollout:
        """Sample the completions: the rollout without reference log-probs, ``max_new_tokens`` wide. ``sampling``:
        other sampler options (evaluation: num_generations_eval), default the step's."""
        sc = self.cfg.sampling if sampling is None else sampling
        gen = generate_fn(self.graphdef, policy_params(state), prompt_ids, prompt_mask, key, sc, self.rollout_mesh)
        prompt_ids, prompt_mask = _left_align(prompt_ids, prompt_mask)
        # TRL's mask/truncation rule (a pad id as last token counts as terminated)
        mask, truncated = completion_mask(gen.completion_ids, sc.eos_token_ids or (-1,), sc.pad_token_id)
        if self.cfg.pad_is_padding:
            mask = mask * (gen.completion_ids != sc.pad_token_id).astype(mask.dtype)
        if self.algorithm.mask_truncated_completions:
            mask = mask * (~truncated)[:, None].astype(mask.dtype)
        return Rollout(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=gen.completion_ids,
            completion_mask=mask,
            is_truncated=truncated,
            old_logps=gen.logps * mask,
            ref_logps=None,
            routes=gen.routes if self.cfg.routes is not None else None,
        )

    # -- multi-turn rollout (rloo_jax.turns): the host runs the tools between these ---------------------------------
    def start_turns(self, state: TrainState, prompt_ids: Array, prompt_mask: Array, key: Array, pause_at: int,
                    sampling: SamplingConfig | None = None) -> Turns:
        """Every row's first turn (``turns.start_turns``): prompts prefilled once, rows decoded until ``pause_at``
        are paused at an EOS or none runs. ``sampling``: other sampler options (evaluation)."""
        sc = self.cfg.sampling if sampling is None else sampling
        return start_turns(self.graphdef, policy_params(state), prompt_ids, prompt_mask, key, sc, pause_at,
                           self.rollout_mesh)

    def resume_turns(self, state: TrainState, t: Turns, suffix: Array, suffix_len: Array, finish: Array, key: Array,
                     pause_at: int, sampling: SamplingConfig | None = None) -> Turns:
        """The next turns (``turns.resume_turns``): finished rows done, the others' new tokens prefilled, decoding
        on."""
        sc = self.cfg.sampling if sampling is None else sampling
        return resume_turns(self.graphdef, policy_params(state), t, suffix, suffix_len, finish, key, sc, pause_at,
                            self.rollout_mesh)

    def close_turns(self, t: Turns, sampling: SamplingConfig | None = None) -> Rollout:
        """The conversations as a sampled ``Rollout`` (``max_new_tokens`` wide): every real token in the completion
        mask (TRL's attention mask; zero rows for truncated ones with mask_truncated_completions), the model's in
        ``tool_mask``, the sampler's log-probs on those."""
        out = turns_completions(t, self.cfg.sampling if sampling is None else sampling)
        mask, truncated = out["completion_mask"], out["is_truncated"]
        if self.algorithm.mask_truncated_completions:
            mask = mask * (~truncated)[:, None].astype(mask.dtype)
        return Rollout(prompt_ids=t.prompt_ids, prompt_mask=t.prompt_mask, completion_ids=out["completion_ids"],
                       completion_mask=mask, is_truncated=truncated, old_logps=out["logps"] * mask, ref_logps=None,
                       tool_mask=out["tool_mask"])

    def longest(self, completion_ids: Array) -> Array:
        """[] int32: the longest EOS-cut completion (what the length metrics count)."""
        sc = self.cfg.sampling
        eos_mask, _ = completion_mask(completion_ids, sc.eos_token_ids or (-1,), sc.pad_token_id)
        return jnp.max(jnp.sum(eos_mask, axis=1))

    def finish(self, state: TrainState, rollout: Rollout, width: int) -> Rollout:
        """The rollout cut to ``width`` completion positions (``truncate``), with the reference log-probs when the
        algorithm needs them and, when ``cfg.recompute``, the old log-probs from a training forward at the sampling
        parameters (no dropout; the sampler's kept as ``sampler_logps``); with a value model its estimates
        (``values``), with a device reward model its scores (``scores``). All run in the update's micro-batches:
        these passes never hold more activations than a training step."""
        cfg = self.cfg
        rollout = truncate(rollout, width)
        needs_ref = self.algorithm.needs_reference
        with_values = self.value_graphdef is not None
        with_scores = self.reward_graphdef is not None
        if not (needs_ref or cfg.recompute or with_values or with_scores):
            return rollout
        mask = rollout.completion_mask  # what the forwards attend to; their log-probs count on the loss mask
        kept = rollout.loss_mask
        micro = self.micro_batches(
            rollout.prompt_ids, rollout.prompt_mask,
            {"completion_ids": rollout.completion_ids, "mask": mask, **route_inputs(rollout)},
        )
        passes = {"ref": self.reference(state)} if needs_ref else {}
        if cfg.recompute:  # the policy exactly as it sampled (same parameters; training forward, no dropout)
            passes["old"] = (self.graphdef, policy_params(state))

        def forward(i: Array) -> dict[str, Array]:
            mb = jax.tree.map(lambda x: self._rows(x[i]), micro)
            inputs = (mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["mask"])
            out = {name: completion_logps(graphdef, params, *inputs, cfg.temperature, cfg.logprob_chunk,
                                          routes=self._replayed(mb))
                   for name, (graphdef, params) in passes.items()}
            if with_values:  # the value before each completion token
                out["values"] = head_scores(self.value_graphdef, state.value_params, *inputs)[:, :-1]
            if with_scores:  # prompt + completion scored at its last real token
                out["scores"] = last_scores(head_scores(self.reward_graphdef, state.reward_params, *inputs), mb["mask"])
            return out

        out = _map(forward, cfg.steps_per_generation)
        rows = lambda x: x.reshape(mask.shape[0], *x.shape[2:])  # noqa: E731 - [spg, n, ...] -> [N, ...]
        if "ref" in out:
            rollout = rollout.replace(ref_logps=rows(out["ref"]) * kept)
        if "old" in out:
            rollout = rollout.replace(old_logps=rows(out["old"]) * kept, sampler_logps=rollout.old_logps)
        if "values" in out:
            rollout = rollout.replace(values=rows(out["values"]))
        if "scores" in out:
            rollout = rollout.replace(scores=rows(out["scores"]))
        return rollout

    def device_scores(self, state: TrainState, rollout: Rollout) -> Array:
        """The device reward model's scores of a sampled rollout, ``[N, R]`` (evaluation: one forward, no other
        pass; prompts shared by their completions)."""
        if self.reward_graphdef is None:
            return jnp.zeros((rollout.completion_ids.shape[0], 0), jnp.float32)
        heads = head_scores(self.reward_graphdef, state.reward_params, rollout.prompt_ids, rollout.prompt_mask,
                            rollout.completion_ids, rollout.completion_mask)
        return last_scores(heads, rollout.completion_mask)

    # -- scoring ------------------------------------------------------------------------------------------------
    def score(self, rollout: Rollout, rewards_per_func: Array, reward_weights: Array
              ) -> tuple[dict[str, Array], dict[str, Array]]:
        """The algorithm's per-row targets (``{"advantages": [N], ...}``; with the sampler/trainer correction also
        ``is_weights``) and the generation batch's metrics (rewards, completion lengths, tokens; the sampler/trainer
        gap where the old log-probs were recomputed). ``rewards_per_func [N, F]``: the host's reward functions;
        device reward models' scores (``rollout.scores``) come first, ``reward_weights`` covering both."""
        cfg = self.cfg
        if rollout.scores is not None:
            rewards_per_func = jnp.concatenate([rollout.scores, rewards_per_func.astype(jnp.float32)], axis=1)
        kept = rollout.loss_mask
        targets, metrics = self.algorithm.score(ScoreInputs(
            rewards_per_func=rewards_per_func, reward_weights=reward_weights, mask=kept,
            is_truncated=rollout.is_truncated, old_logps=rollout.old_logps, ref_logps=rollout.ref_logps,
            values=rollout.values, completion_ids=rollout.completion_ids, num_generations=cfg.num_generations,
        ))
        if rollout.tool_mask is not None:  # the model's tokens (TRL: the tool mask's sum), before mask_truncated
            lengths = jnp.sum(rollout.tool_mask, axis=1)
        else:
            eos_mask, _ = completion_mask(rollout.completion_ids, cfg.sampling.eos_token_ids or (-1,),
                                          cfg.sampling.pad_token_id)
            lengths = jnp.sum(eos_mask, axis=1)
        metrics.update(completion_stats(lengths, rollout.is_truncated))
        n_prompt_tokens = jnp.sum(rollout.prompt_mask) * cfg.num_generations
        metrics["num_tokens"] = (n_prompt_tokens + jnp.sum(lengths)).astype(jnp.float32)
        if rollout.sampler_logps is not None:  # the training forward at the sampling parameters vs the sampler
            metrics.update(sampling_logp_difference(rollout.old_logps, rollout.sampler_logps, kept))
            if cfg.importance_sampling is not None:
                weights, is_metrics = self._is_weights(rollout.old_logps, rollout.sampler_logps, kept)
                targets = dict(targets, is_weights=weights)
                metrics.update(is_metrics)
        return targets, metrics

    def _is_weights(self, trained: Array, sampled: Array, mask: Array) -> tuple[Array, dict[str, Array]]:
        s = self.cfg.importance_sampling
        return importance_sampling_weights(trained, sampled, mask, s.mode, s.clip_min, s.clip_max)

    # -- update -------------------------------------------------------------------------------------------------
    def _replayed(self, mb: dict[str, Array]) -> Routes | None:
        """The routes a micro-batch's forwards replay: its recorded ones with ``routing_replay``, else none."""
        return batch_routes(mb) if self.cfg.routing_replay else None

    def loss(
        self, params: nnx.State, frozen: nnx.State | None, mb: dict[str, Array], key: Array | None,
        algo_state: Any, num_items: Array, value_params: nnx.State | None = None,
    ) -> tuple[Array, tuple[dict[str, Array], dict[str, Array]]]:
        """One micro-batch: the training forward (log-probs and entropy; with a value model its estimates), then
        the algorithm's loss."""
        cfg, algo = self.cfg, self.algorithm
        whole = params if frozen is None else nnx.merge_state(frozen, params)  # gradients reach `params` only
        with_aux = cfg.router_aux_loss_coef != 0.0
        with_routing = "routes" in mb  # the sampler's routes: its routers' choices against the update's own
        logps, entropy, *extra = completion_logps(
            self.graphdef, whole, mb["prompt_ids"], mb["prompt_mask"], mb["completion_ids"], mb["mask"],
            cfg.temperature, cfg.logprob_chunk, with_entropy=True, dropout_key=key,
            frozen_unembed=frozen is not None,  # LoRA: the head is part of the frozen base
            entropy_grad=algo.entropy_grad, with_aux_loss=with_aux, routes=self._replayed(mb),
            with_routing=with_routing,
        )
        aux, chosen = extra[:with_aux], extra[with_aux:]
        values = None
        if value_params is not None:
            values = head_scores(self.value_graphdef, value_params, mb["prompt_ids"], mb["prompt_mask"],
                                 mb["completion_ids"], mb["mask"])[:, :-1]
        mask = loss_mask(mb["mask"], mb.get("tool_mask")).astype(jnp.float32)  # the forward attends to mb["mask"]
        # on policy the ratio is exactly 1 (TRL: old = current.detach()), unless the sampler/trainer correction
        # recomputed the old log-probs, which TRL then uses (its vLLM path)
        fixed_old = not cfg.on_policy or (cfg.recompute and cfg.importance_sampling is not None)
        old = mb["old_logps"] if fixed_old else jax.lax.stop_gradient(logps)
        metrics: dict[str, Array] = {}
        if with_routing:
            metrics.update(routing_mismatch(mb["routes"], chosen[0], mask))
        is_weights = mb.get("is_weights")
        if not cfg.recompute:  # on policy, no dropout: this forward is the trainer's side of the sampler gap
            trained, sampled = jax.lax.stop_gradient(logps), mb["old_logps"]
            metrics.update(sampling_logp_difference(trained, sampled, mask))
            if cfg.importance_sampling is not None:
                is_weights, is_metrics = self._is_weights(trained, sampled, mask)
                metrics.update(is_metrics)
        targets = {k: v for k, v in mb.items() if k not in _BATCH_KEYS}
        loss, algo_metrics, stats = algo.loss(LossInputs(
            logps=logps, entropy=entropy, old_logps=old, mask=mask, advantages=mb["advantages"],
            ref_logps=mb.get("ref_logps"),
            sampler_logps=mb.get("sampler_logps") if cfg.importance_sampling is not None or cfg.given_logps else None,
            is_weights=is_weights, targets=targets, values=values, num_items=num_items, algo_state=algo_state,
        ))
        metrics.update(algo_metrics)
        metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), mask)
        if with_aux:  # TRL: loss + coef * aux_loss / gas per micro-batch; the step's gradient here is their mean
            loss = loss + cfg.router_aux_loss_coef * aux[0]
            metrics["aux_loss"] = jax.lax.stop_gradient(aux[0])
        return loss, (metrics, stats)

    def _trained_loss(
        self, trained: Any, frozen: nnx.State | None, mb: dict[str, Array], key: Array | None, algo_state: Any,
        num_items: Array,
    ) -> tuple[Array, tuple[dict[str, Array], dict[str, Array]]]:
        """``loss`` as a function of what the optimizer steps (``TrainState.trained``)."""
        params, value_params = trained if self.value_graphdef is not None else (trained, None)
        return self.loss(params, frozen, mb, key, algo_state, num_items, value_params)

    def update(
        self, state: TrainState, rollout: Rollout, rewards_per_func: Array, reward_weights: Array,
        order: Array | None = None, plan: UpdatePlan | None = None, horizon: Any = (),
    ) -> tuple[TrainState, dict[str, dict[str, Array]]]:
        """Score the generation batch, then the optimizer steps over its micro-batches.

        ``order`` (``cfg.row_order``): ``[updates_per_generation * gradient_accumulation_steps, n]`` int32, the rows
        of each micro-batch in the order they run (e.g. a shuffle per PPO epoch); None: the generation batch cut
        into ``steps_per_generation`` micro-batches in order (repeated ``num_iterations`` times).

        ``plan`` (static; None: ``cfg.default_plan()``, every micro-batch, none carried): the micro-batches to run
        and those of an optimizer step an earlier generation batch began (``UpdatePlan``; their gradients in
        ``state.grad_acc``). Micro-batch k of the generation (k < plan.micro_batches) is its micro-batch ``k % spg`` and
        belongs to optimizer step ``(plan.carried + k) // gas`` of the program; the step's gradient is the mean of
        its ``gas`` micro-batches' (carried ones included); the micro-batches after the last complete step are
        summed into the returned ``grad_acc``. ``horizon``: the learning-rate schedule's (``optimizer.Scheduled``;
        () for a plain optax transformation), data rather than a constant of the program.

        Returns the new state and the metrics as the algorithm logs them (``algorithm.summarize`` of: ``generation``
        (scalars, once per generation batch: rewards, lengths, tokens, the sampler gap), ``micro`` (per micro-batch,
        what the loss logs: ``[U, M]`` for the default plan, else ``[plan.micro_batches]`` in order) and ``update``
        (``[S]``: per optimizer step completed, ``loss`` (the mean of its micro-batch losses) and ``grad_norm``
        (pre-clip) and what the algorithm's state logs))."""
        cfg = self.cfg
        plan = cfg.default_plan() if plan is None else plan
        optimizer = transformation_at(self.optimizer, horizon)
        targets, gen_metrics = self.score(rollout, rewards_per_func, reward_weights)
        spg, gas = cfg.steps_per_generation, cfg.gradient_accumulation_steps
        batch = {"completion_ids": rollout.completion_ids, "mask": rollout.completion_mask,
                 "old_logps": rollout.old_logps, **targets}
        if rollout.sampler_logps is not None:
            batch["sampler_logps"] = rollout.sampler_logps
        if rollout.ref_logps is not None:
            batch["ref_logps"] = rollout.ref_logps
        if rollout.tool_mask is not None:
            batch["tool_mask"] = rollout.tool_mask
        batch.update(route_inputs(rollout))
        # token-sum losses (dapo, cispo, vespo) divide by the generation batch's tokens per micro-batch step
        num_items = jnp.maximum(jnp.sum(rollout.loss_mask).astype(jnp.float32), 1.0) / spg
        if order is None:
            micro = self.micro_batches(rollout.prompt_ids, rollout.prompt_mask, batch)

            def micro_batch(k: Array) -> dict[str, Array]:  # call k of the generation: its micro-batch k % spg
                return jax.tree.map(lambda x: self._rows(x[k % spg]), micro)
        else:
            rows = self.per_completion(rollout.prompt_ids, rollout.prompt_mask, batch)

            def micro_batch(k: Array) -> dict[str, Array]:
                return jax.tree.map(lambda x: self._rows(x[order[k]]), rows)

        grad_fn = jax.value_and_grad(self._trained_loss, has_aux=True)

        def micro_grads(trained: Any, algo_state: Any, k: Array) -> tuple[Any, dict, dict]:
            mb = micro_batch(k)
            key = None
            if cfg.dropout_seed is not None:  # a fresh mask per update and micro-batch, reproducible on resume
                c = plan.carried + k  # (step, call within it mod max(spg, gas)): distinct in a step
                i = c % max(spg, gas) if order is None else k
                key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.dropout_seed), state.step + c // gas),
                                         i)
            (loss, (m, stats)), grads = grad_fn(trained, state.frozen, mb, key, algo_state, num_items)
            if self.grad_shardings is not None:  # gradients reduce-scattered to the params' layout (FSDP)
                grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
            return grads, dict(m, loss=loss), stats

        def optimizer_step(carry: tuple, grads: Any, stats: dict, losses: Array) -> tuple[tuple, dict[str, Any]]:
            """One optimizer step from its micro-batches' mean gradient, summed statistics and losses' mean."""
            trained, opt_state, algo_state = carry
            grad_norm = optax.global_norm(grads)
            updates, opt_state = optimizer.update(grads, opt_state, trained)
            trained = optax.apply_updates(trained, updates)
            # the algorithm's state moves once per optimizer step, from its micro-batches' summed statistics
            algo_state, step_metrics = self.algorithm.next_state(algo_state, stats)
            # TRL logs an optimizer step's loss: the mean of its micro-batches'
            return (trained, opt_state, algo_state), dict(step_metrics, loss=losses / gas, grad_norm=grad_norm)

        def one_update(carry: tuple, u: Array) -> tuple[tuple, dict[str, Any]]:
            trained, opt_state, algo_state = carry
            if gas == 1:  # no zeros + add + divide over every parameter
                grads, m, stats = micro_grads(trained, algo_state, u)
                m, stats = jax.tree.map(lambda x: x[None], (m, stats))
            else:

                def accumulate(grads_sum: Any, j: Array) -> tuple[Any, tuple[dict, dict]]:
                    grads, m, stats = micro_grads(trained, algo_state, u * gas + j)
                    return jax.tree.map(jnp.add, grads_sum, grads), (m, stats)

                grads, (m, stats) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, trained), jnp.arange(gas))
                grads = jax.tree.map(lambda x: x / gas, grads)
            carry, step_metrics = optimizer_step(carry, grads, jax.tree.map(jnp.sum, stats), jnp.sum(m.pop("loss")))
            return carry, {"micro": m, "update": step_metrics}

        carry = (state.trained, state.opt_state, state.algo_state)
        grad_acc = state.grad_acc
        if plan == cfg.default_plan() and not cfg.carries:  # whole optimizer steps (today's common case)
            carry, ms = _scan(one_update, carry, cfg.updates_per_generation)
            micro_metrics, update_metrics = ms["micro"], ms["update"]
            steps = cfg.updates_per_generation
        else:
            carry, micro_metrics, update_metrics, grad_acc = self._planned(
                carry, grad_acc, plan, micro_grads, optimizer_step)
            steps = plan.steps(gas)
        trained, opt_state, algo_state = carry
        # the on-policy sampler/trainer gap, measured in the micro-batches: one value for the generation batch
        for name in [n for n in micro_metrics if n.startswith("sampling/")]:
            gen_metrics[name] = reduce_metric(name, micro_metrics.pop(name))
        params, value_params = trained if state.value_params is not None else (trained, None)
        new_state = state.replace(params=params, value_params=value_params, opt_state=opt_state,
                                  algo_state=algo_state, step=state.step + steps, grad_acc=grad_acc)
        return new_state, self.algorithm.summarize({"generation": gen_metrics, "micro": micro_metrics,
                                                    "update": update_metrics})

    def new_accumulator(self, trained: Any) -> Accumulator:
        """An empty ``Accumulator`` for ``trained``: float32 zeros, the algorithm's zero statistics."""
        init_stats = getattr(self.algorithm, "init_stats", dict)  # an algorithm without statistics: none
        return Accumulator(grads=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trained),
                           stats=init_stats() or None, loss=jnp.zeros((), jnp.float32))

    def _planned(self, carry: tuple, acc: Accumulator | None, plan: UpdatePlan, micro_grads: Callable,
                 optimizer_step: Callable) -> tuple[tuple, dict, dict, Accumulator | None]:
        """``update`` under an ``UpdatePlan``, in three static segments: the head (the micro-batches completing the
        carried step), the whole steps (a scan), the tail (summed into the returned accumulator). Returns (carry,
        micro metrics ``[plan.micro_batches]``, update metrics ``[plan.steps]``, accumulator)."""
        gas = self.cfg.gradient_accumulation_steps
        if plan.carried and acc is None:
            raise ValueError(f"{plan} carries micro-batches but the state has no grad_acc (StepConfig.carries)")
        if plan.carried_out(gas) and acc is None:
            raise ValueError(f"{plan} leaves micro-batches for the next generation but the state has no grad_acc")
        empty = self.new_accumulator(carry[0])

        def accumulate(carry: tuple, acc: Accumulator, ks: Array) -> tuple[Accumulator, dict]:
            """``acc`` plus micro-batches ``ks`` (gradients in float32), at the carry's parameters."""
            trained, _, algo_state = carry

            def one(acc: Accumulator, k: Array) -> tuple[Accumulator, dict]:
                grads, m, stats = micro_grads(trained, algo_state, k)
                summed = None if acc.stats is None else jax.tree.map(jnp.add, acc.stats, stats)
                acc = Accumulator(grads=jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc.grads, grads),
                                  stats=summed, loss=acc.loss + m.pop("loss"))
                return acc, m

            return jax.lax.scan(one, acc, ks)

        def step(carry: tuple, acc: Accumulator) -> tuple[tuple, dict]:
            grads = jax.tree.map(lambda a, p: (a / gas).astype(p.dtype), acc.grads, carry[0])
            return optimizer_step(carry, grads, {} if acc.stats is None else acc.stats, acc.loss)

        micro, updates = [], []
        k = 0
        if plan.carried:  # the head: complete the step an earlier generation began (if this one gets that far)
            head = min(plan.micro_batches, gas - plan.carried)
            acc, m = accumulate(carry, acc, jnp.arange(head))
            micro.append(m)
            k = head
            if plan.carried + head == gas:
                carry, u = step(carry, acc)
                updates.append(jax.tree.map(lambda x: x[None], u))
                acc = empty
        whole = (plan.micro_batches - k) // gas
        if whole:

            def one_step(carry: tuple, u: Array) -> tuple[tuple, tuple[dict, dict]]:
                acc, m = accumulate(carry, empty, k + u * gas + jnp.arange(gas))
                carry, metrics = step(carry, acc)
                return carry, (m, metrics)

            carry, (m, u) = _scan(one_step, carry, whole)
            micro.append(jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), m))
            updates.append(u)
            k += whole * gas
        if plan.micro_batches > k:  # the tail: summed for the next generation's program
            acc, m = accumulate(carry, acc if plan.carried else empty, k + jnp.arange(plan.micro_batches - k))
            micro.append(m)
        if not updates:  # no step completes: the update metrics' names, with no values
            shapes = jax.eval_shape(step, carry, empty)[1]
            updates.append(jax.tree.map(lambda x: jnp.zeros((0, *x.shape), x.dtype), shapes))
        cat = lambda parts: jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)  # noqa: E731
        out_acc = None if acc is None and not plan.carried_out(gas) else (acc if plan.carried_out(gas) else empty)
        return carry, cat(micro), cat(updates), out_acc

    def per_completion(self, prompt_ids: Array, prompt_mask: Array, batch: dict[str, Array]) -> dict[str, Array]:
        """The generation batch row by row (``[N, ...]``), each completion with its own copy of its prompt, for
        micro-batches of any rows (``update(order=...)``)."""
        g = self.cfg.num_generations
        prompts = {k: self._rows(jnp.repeat(v, g, 0)) for k, v in _prompt_entries(prompt_ids, prompt_mask, batch)}
        return dict(batch, **prompts)

    def micro_batches(self, prompt_ids: Array, prompt_mask: Array, batch: dict[str, Array]) -> dict[str, Array]:
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
        batch = dict(batch, **{k: v if share else self._rows(jnp.repeat(v, g, 0))
                               for k, v in _prompt_entries(prompt_ids, prompt_mask, batch)})
        return jax.tree.map(lambda x: self._rows(x.reshape(spg, x.shape[0] // spg, *x.shape[1:]), axis=1), batch)

    def sync_reference(self, state: TrainState, alpha: float) -> TrainState:
        if state.frozen is not None:  # as TRL: its reference is the base, or a frozen copy of the given adapters
            raise ValueError("with LoRA the reference is not synced (TRL refuses sync_ref_model with PEFT)")
        return state.replace(ref_params=sync_reference(state.params, state.ref_params, alpha))


# what a micro-batch holds besides the algorithm's extra targets
_BATCH_KEYS = ("completion_ids", "mask", "old_logps", "prompt_ids", "prompt_mask", "advantages", "is_weights",
               "sampler_logps", "ref_logps", "tool_mask", "routes", "prompt_routes")


def _prompt_entries(prompt_ids: Array, prompt_mask: Array, batch: dict[str, Array]) -> list[tuple[str, Array]]:
    """The batch entries with a row per prompt: its ids, mask and (routing replay) routes."""
    out = [("prompt_ids", prompt_ids), ("prompt_mask", prompt_mask)]
    return out + ([("prompt_routes", batch["prompt_routes"])] if "prompt_routes" in batch else [])


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


def micro_batch_order(rng: np.random.RandomState, rows: int, epochs: int, micro_rows: int) -> np.ndarray:
    """The rows of each micro-batch of one generation batch, in the order the update runs them: a fresh
    permutation of the `rows` rows per epoch (`rng.permutation`, TRL 1.12 PPO's `np.random.permutation`), cut into
    consecutive micro-batches of `micro_rows` -> [epochs * rows / micro_rows, micro_rows] int32. TRL's mini-batches
    are consecutive slices of the permutation and its micro-batches consecutive slices of those, so this is its
    order. Example: rows 4, epochs 1, micro 2, permutation [3, 0, 2, 1] -> [[3, 0], [2, 1]]."""
    return np.concatenate([rng.permutation(rows).reshape(-1, micro_rows) for _ in range(epochs)]).astype(np.int32)


def router_aux_loss_coef(option: float | None, model: Any) -> float:
    """TRL 1.16's rule for the load-balancing loss weight: the option, else the policy's config's
    `router_aux_loss_coef` (a mixture of experts; 0.0 for a dense model); a non-zero option on a dense model is a
    ConfigError. `model`: the policy's `ModelConfig` (None: unknown, dense). Example: (None, Qwen3-MoE with 0.001)
    -> 0.001; (0.0, it) -> 0.0 (off); (0.01, a dense model) -> ConfigError."""
    moe = model is not None and model.is_moe
    if option and not moe:
        raise ConfigError(f"router_aux_loss_coef is set to {option} but the policy is not a mixture-of-experts "
                          "model, so there is no auxiliary loss to weight")
    if option is None:
        return float(model.router_aux_loss_coef) if moe else 0.0
    return float(option) if moe else 0.0


def recorded_routes(model: Any, multi_turn: bool) -> tuple[int, int] | None:
    """``StepConfig.routes``: (L, K) of a mixture-of-experts policy (`model`: its ``ModelConfig``), whose sampler
    records them (replayed with routing replay, measured against without); None for a dense policy or for
    multi-turn rollouts (whose sampler does not return routes)."""
    if multi_turn or model is None or not model.is_moe:
        return None
    return model.num_layers, model.num_experts_per_tok


def replayed_routes(replay: bool, model: Any, multi_turn: bool) -> tuple[int, int] | None:
    """The (L, K) routes the forwards replay: `recorded_routes` with routing replay on, else None."""
    return recorded_routes(model, multi_turn) if replay else None


def step_config(cfg: Any, sampling: SamplingConfig, tokenizer: Any = None, model: Any = None) -> StepConfig:
    """The step's static options from the run config: the sampler's (`sampling`), the algorithm the config names
    (`cfg.make_algorithm`, with the policy's `tokenizer`), the batching
    and the algorithm's own (`cfg.step_options()`: where the old log-probs come from, the sampler/trainer
    correction, PPO's log-prob temperature and row order; the load-balancing loss weight, resolved against the
    policy's `ModelConfig` `model` by `router_aux_loss_coef`)."""
    options = cfg.step_options()
    if "router_aux_loss_coef" in options:
        options["router_aux_loss_coef"] = router_aux_loss_coef(options["router_aux_loss_coef"], model)
    if "routing_replay" in options:  # the routes are recorded either way: without replay the update measures its
        # router against them (sampling/routing_mismatch)
        options["routes"] = recorded_routes(model, options.get("multi_turn", False))
    return StepConfig(
        sampling=sampling,
        algorithm=cfg.make_algorithm(tokenizer),
        num_iterations=cfg.resolved_num_iterations,
        steps_per_generation=cfg.resolved_steps_per_generation,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        dropout_seed=cfg.seed if cfg.use_peft and cfg.lora_dropout > 0 else None,
        **options,
    )
