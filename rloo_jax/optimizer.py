"""The optimizer and its learning-rate schedule: optax's AdamW as transformers configures it (clipping, weight decay
on matrices only, transformers' schedules counted in optimizer steps), skipped whole on non-finite gradients.

    optimizer = make_optimizer(cfg, total_steps)   # one for the loop and compile-only (`build.assemble`)
    optimizer.rate(step, optimizer.horizon)        # the learning rate of a step (the schedule's horizon is data)
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rloo_jax.errors import ConfigError

NEVER = int(np.iinfo(np.int32).max)  # optax's counters saturate there: `count > NEVER` is never true


def lr_schedule(kind: str, learning_rate: float, warmup_steps: Any, total_steps: Any,
                min_lr_rate: float = 0.0) -> optax.Schedule:
    """transformers' schedules, counted in optimizer steps (step 0 = the first update).

    Warmup: lr * s / W for s < W. Then linear: lr * (T - s) / (T - W); cosine: lr * (1 + cos(pi * progress)) / 2;
    cosine_with_min_lr: lr * (r + (1 - r) * (1 + cos(pi * progress)) / 2), r = `min_lr_rate`;
    constant(_with_warmup): lr. progress = (s - W) / max(1, T - W), at most 1. E.g. linear, lr 1, W 2, T 6:
    [0, 0.5, 1, 0.75, 0.5, 0.25].

    `warmup_steps` and `total_steps` (the horizon) may be traced: the update program takes them as data
    (`Scheduled`), so a run resumed with another max_steps reuses its compiled update. That is why these are not
    optax's schedules, which take their horizon as Python numbers and so bake it into the program; the arithmetic
    is optax's (linear_schedule, cosine_decay_schedule, join_schedules), operation for operation.
    """
    if kind not in SCHEDULES:
        raise ConfigError(f"lr_scheduler_type {kind!r} is not supported")

    def schedule(count: Any) -> jax.Array:
        count = jnp.asarray(count, jnp.float32)
        if kind == "constant":
            return jnp.full_like(count, learning_rate)
        w, t = jnp.asarray(warmup_steps, jnp.float32), jnp.asarray(total_steps, jnp.float32)
        decay = jnp.maximum(1.0, t - w)
        after = jnp.clip(count - w, 0.0, decay)  # steps into the decay
        if kind == "linear":
            value = learning_rate * (1 - after / decay)
        elif kind == "constant_with_warmup":
            value = jnp.full_like(count, learning_rate)
        else:  # cosine, cosine_with_min_lr (min_lr_rate 0 unless with_min_lr)
            value = learning_rate * ((1 - min_lr_rate) * (0.5 * (1 + jnp.cos(jnp.pi * after / decay))) + min_lr_rate)
        warm = -learning_rate * (1 - jnp.clip(count, 0.0, w) / jnp.maximum(w, 1.0)) + learning_rate
        return jnp.where(count < w, warm, value)

    return schedule


SCHEDULES = ("linear", "cosine", "cosine_with_min_lr", "constant", "constant_with_warmup")


@functools.partial(jax.jit, static_argnames=("kind", "learning_rate", "min_lr_rate"))
def _rate(count: jax.Array, warmup: jax.Array, total: jax.Array, *, kind: str, learning_rate: float,
          min_lr_rate: float) -> jax.Array:
    return lr_schedule(kind, learning_rate, warmup, total, min_lr_rate)(count)


def learning_rate_at(kind: str, learning_rate: float, step: int, warmup_steps: int, total_steps: int,
                     min_lr_rate: float = 0.0) -> float:
    """`lr_schedule`'s rate at `step`, on the host: ONE compiled program for every step and horizon (what the loop
    logs, and what a resume's report compares), so a resumed run compiles nothing for it."""
    count, warmup, total = (np.int32(np.asarray(v)) for v in (step, warmup_steps, total_steps))
    return float(_rate(count, warmup, total, kind=kind, learning_rate=float(learning_rate),
                       min_lr_rate=float(min_lr_rate)))


def min_lr_rate(cfg: Any) -> float:
    """cosine_with_min_lr's floor as a fraction of learning_rate: min_lr / learning_rate, or min_lr_rate (0 unset)."""
    min_lr, rate = getattr(cfg, "min_lr", None), getattr(cfg, "min_lr_rate", None)
    return min_lr / cfg.learning_rate if min_lr is not None else (rate or 0.0)


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only (as transformers skips biases and norms): `kernel`, `embedding` and LoRA's
    A and B leaves (the experts' too, as transformers decays peft's). By name, not by rank: a stacked block's norm
    scale [L, D] is 2-D but no matrix."""
    matrices = {"kernel", "embedding", "lora_a", "lora_b", "qkv_lora_a", "gate_up_lora_a", "experts_gate_up_lora_a",
                "experts_gate_lora_b", "experts_up_lora_b", "experts_down_lora_a", "experts_down_lora_b"}

    def is_matrix(path: tuple, _: Any) -> bool:
        return bool({getattr(k, "key", getattr(k, "name", None)) for k in path} & matrices)

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def warmup_steps(cfg: Any, total_steps: int) -> int:
    """Warmup in optimizer steps: warmup_steps >= 1 as is, a fraction in [0, 1) (warmup_steps or warmup_ratio)
    of `total_steps` rounded up (transformers' rule). warmup_steps 0.1 of 25 steps -> 3."""
    if cfg.warmup_steps >= 1:
        return int(cfg.warmup_steps)
    return math.ceil((cfg.warmup_steps or cfg.warmup_ratio) * total_steps)


@dataclasses.dataclass(frozen=True)
class Scheduled:
    """An optax transformation whose learning-rate horizon is data: `at(horizon)` builds it inside a program from
    the horizon (warmup and total steps, int32 scalars) the program takes as an argument, so changing max_steps
    changes the program's inputs, not the program (a resumed run finds its update in the compilation cache).
    `init` / `update` use the run's own `horizon` (outside a program: tests, tools). `rate(count, horizon)`: the
    learning rate of optimizer step `count` (what the loop logs). The state does not depend on the horizon."""

    build: Callable[[Any], optax.GradientTransformation]
    horizon: tuple[np.int32, np.int32]  # (warmup steps, total steps)
    rate: Callable[[Any, Any], float]

    def at(self, horizon: Any) -> optax.GradientTransformation:
        return self.build(horizon)

    def init(self, params: Any) -> Any:
        return self.build(self.horizon).init(params)

    def update(self, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return self.build(self.horizon).update(updates, state, params)


def horizon_of(optimizer: Any) -> tuple:
    """The horizon a program passes to `transformation_at`: a `Scheduled`'s, () for a plain optax transformation."""
    return optimizer.horizon if isinstance(optimizer, Scheduled) else ()


def transformation_at(optimizer: Any, horizon: Any) -> optax.GradientTransformation:
    """`optimizer` inside a program, at the horizon the program was given (a plain optax transformation as is)."""
    return optimizer.at(horizon) if isinstance(optimizer, Scheduled) else optimizer


def make_optimizer(cfg: Any, total_steps: int, platform: str | None = None, updates_per_step: int = 1) -> Scheduled:
    """clip_by_global_norm -> AdamW (first moment in `mu_dtype`; decay on matrices only), skipped whole on
    non-finite gradients: `skip_if_not_finite` for an accelerator, `optax.apply_if_finite` on CPU (the same state
    and numbers; XLA:CPU does not fuse the selects into AdamW's loops: 126 against 81 ms per update of a 26M-parameter
    model, BENCHMARKS.md Session 6). `platform`: the backend the program is compiled for (default: JAX's).

    The schedule is counted in the run's steps over the horizon (warmup_steps(cfg, total_steps), total_steps);
    `updates_per_step` optimizer updates share one step's rate (TRL 1.12's PPO steps its scheduler once per PPO
    update, whatever the optimizer steps in it)."""
    floor = min_lr_rate(cfg)
    horizon = (np.int32(warmup_steps(cfg, total_steps)), np.int32(total_steps))  # host values: no device here
    lr_schedule(cfg.lr_scheduler_type, cfg.learning_rate, 0, 1)  # an unknown kind fails here, not in a program

    def rate(count: Any, horizon: Any) -> float:
        return learning_rate_at(cfg.lr_scheduler_type, cfg.learning_rate, count, *horizon, floor)

    def build(horizon: Any) -> optax.GradientTransformation:
        schedule = lr_schedule(cfg.lr_scheduler_type, cfg.learning_rate, *horizon, floor)
        adamw = optax.adamw(
            lambda count: schedule(count // updates_per_step),
            b1=cfg.adam_beta1,
            b2=cfg.adam_beta2,
            eps=cfg.adam_epsilon,
            mu_dtype=cfg.mu_dtype,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
        chain = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
        # Non-finite gradients skip the whole update (params and AdamW moments kept). The consecutive-skip limit
        # is enforced on the host (`skipped_updates`).
        inner = optax.chain(*chain, adamw)
        if (platform or jax.default_backend()) == "cpu":
            return optax.apply_if_finite(inner, max_consecutive_errors=NEVER)
        return skip_if_not_finite(inner)

    return Scheduled(build, horizon, rate)


def skip_if_not_finite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """`optax.apply_if_finite(inner, max_consecutive_errors=<never>)` as elementwise selects: the update is always
    computed, then every leaf of the updates (0) and of the optimizer state (its old value) is kept where any
    gradient is not finite. The same state (`optax.ApplyIfFiniteState`, read by `train.skipped_updates`) and the
    same numbers. Without apply_if_finite's `lax.cond` XLA fuses each leaf's moments, update and parameter into one
    kernel that writes them in place (the donated state); the cond made it hold new and old copies of the moments
    and the updates apart (Llama-3.1-8B full fine-tuning on a v5e-16, BENCHMARKS.md Session 5). On CPU, where XLA
    does not fuse the selects, `make_optimizer` takes apply_if_finite."""
    inner = optax.with_extra_args_support(inner)

    def init(params: Any) -> optax.ApplyIfFiniteState:
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params),
        )

    def update(updates: Any, state: optax.ApplyIfFiniteState, params: Any = None, **extra: Any) -> tuple:
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(updates)]))
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_inner, state.inner_state)
        bump = optax.safe_int32_increment
        return new_updates, optax.ApplyIfFiniteState(
            notfinite_count=jnp.where(finite, jnp.zeros([], jnp.int32), bump(state.notfinite_count)),
            last_finite=finite,
            total_notfinite=jnp.where(finite, state.total_notfinite, bump(state.total_notfinite)),
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def skipped_updates(opt_state: Any) -> tuple[int, int]:
    """(consecutive, total) updates skipped for non-finite loss/gradients, read from `make_optimizer`'s state."""
    consecutive, total = jax.device_get((opt_state.notfinite_count, opt_state.total_notfinite))
    return int(consecutive), int(total)
