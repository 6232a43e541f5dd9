"""TRL 1.12's PPO loop re-written as plain functions, to test ours against (never imported by the package): its batch
size arithmetic, the shuffles it draws, its mini-batch and accumulation order, its statistics tables, its learning
rate and its logged dict. The math the trainer runs is `rloo_jax.algorithms.ppo`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rloo_jax.algorithms.ppo import PPORollout, first_true_indices, rollout_metrics, table_metrics
from rloo_jax.errors import ConfigError

Array = jax.Array


def forward_inputs(query_responses: Array, pad_token_id: int) -> tuple[Array, Array, Array]:
    """The inputs TRL's ``forward`` / ``get_reward`` give every model: ``(input_ids, attention_mask, position_ids)``.

    ``attention_mask = ids != pad`` (every pad token, wherever it is -- including an EOS when pad == eos),
    ``position_ids = cumsum(mask) - mask`` (left padding does not shift positions), pad ids replaced by 0.
    ``[[0, 5, 6, 0]]`` with pad 0 -> ids ``[[0, 5, 6, 0]]``, mask ``[[0, 1, 1, 0]]``, positions ``[[0, 0, 1, 2]]``.

    Args:
      query_responses: ``[B, P + L]`` int.
    """
    mask = query_responses != pad_token_id
    m = mask.astype(jnp.int32)
    position_ids = jnp.cumsum(m, axis=1) - m
    input_ids = jnp.where(mask, query_responses, 0)
    return input_ids, mask, position_ids


def reward_positions(postprocessed_responses: Array, pad_token_id: int, context_length: int) -> Array:
    """Where ``get_reward`` reads the reward (and TRL's scores): the last token before the first pad of the response.

    ``first_true_indices(response == pad) - 1 + context_length``, an index into ``query + response`` (``[B]``
    int32). A response with no pad is read at its last token; one that starts with pad at the last query token.
    ``[[7, 1, 0, 0]]``, pad 0, P 3 -> ``[4]``.
    """
    return first_true_indices(postprocessed_responses == pad_token_id) - 1 + context_length


def gather_scores(reward_logits: Array, positions: Array) -> Array:
    """``reward_logits[b, positions[b], 0]``: the reward model's score per row. ``[B, T, 1], [B] -> [B]``."""
    return jnp.take_along_axis(reward_logits[..., 0], positions[:, None].astype(jnp.int32), axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class PPOBatchSizes:
    """TRL 1.12's derived batch sizes (``PPOTrainer.__init__``, ppo_trainer.py 458-480), with its names."""

    world_size: int
    local_batch_size: int  # rows per process per update: per_device_train_batch_size * gradient_accumulation_steps
    micro_batch_size: int  # per_device_train_batch_size * world_size
    batch_size: int  # local_batch_size * world_size: episodes per update
    mini_batch_size: int  # batch_size / num_mini_batches
    local_mini_batch_size: int  # local_batch_size / num_mini_batches
    total_episodes: int
    num_total_batches: int  # updates: ceil(total_episodes / batch_size)


def ppo_batch_sizes(
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    num_mini_batches: int,
    train_dataset_len: int,
    *,
    total_episodes: int | None = None,
    num_train_epochs: float = 3.0,
    world_size: int = 1,
    whiten_rewards: bool = False,
) -> PPOBatchSizes:
    """TRL's size arithmetic and its checks. ``total_episodes=None`` -> ``int(num_train_epochs * dataset_len)``.

    ``ppo_batch_sizes(2, 4, 2, 16, total_episodes=16)`` -> local_batch_size 8, local_mini_batch_size 4,
    num_total_batches 2. Raises ``ConfigError`` where TRL raises (inexact divisions; whitening with fewer than 8
    rows per mini-batch, TRL's assert).
    """
    if total_episodes is None:
        total_episodes = int(num_train_epochs * train_dataset_len)
    local_batch_size = per_device_train_batch_size * gradient_accumulation_steps
    batch_size = local_batch_size * world_size
    for name, total in (("batch_size", batch_size), ("local_batch_size", local_batch_size)):
        if total % num_mini_batches:
            raise ConfigError(
                f"`{name}` ({total} = per_device_train_batch_size x gradient_accumulation_steps"
                f"{' x world_size' if name == 'batch_size' else ''}) must be a multiple of num_mini_batches "
                f"({num_mini_batches})"
            )
    local_mini_batch_size = local_batch_size // num_mini_batches
    if whiten_rewards and local_mini_batch_size < 8:
        raise ConfigError(
            f"whiten_rewards needs at least 8 rows per mini-batch per process, got local_mini_batch_size "
            f"{local_mini_batch_size} (raise per_device_train_batch_size x gradient_accumulation_steps / "
            "num_mini_batches)"
        )
    return PPOBatchSizes(
        world_size=world_size, local_batch_size=local_batch_size,
        micro_batch_size=per_device_train_batch_size * world_size, batch_size=batch_size,
        mini_batch_size=batch_size // num_mini_batches, local_mini_batch_size=local_mini_batch_size,
        total_episodes=total_episodes, num_total_batches=math.ceil(total_episodes / batch_size),
    )


def numpy_permutations(seed: int, local_batch_size: int, num_ppo_epochs: int, num_updates: int) -> np.ndarray:
    """The shuffles TRL draws after ``np.random.seed(seed)``: ``[num_updates, num_ppo_epochs, local_batch_size]``.

    TRL calls ``np.random.permutation(local_batch_size)`` (NumPy's *global* RNG, which TRL never seeds) once per
    PPO epoch, updates in order; nothing else in its loop draws from that RNG, so a seeded run replays this stream.
    """
    rng = np.random.RandomState(seed)
    return np.stack(
        [np.stack([rng.permutation(local_batch_size) for _ in range(num_ppo_epochs)]) for _ in range(num_updates)]
    )


def minibatch_plan(
    permutation: Sequence[int] | np.ndarray, local_mini_batch_size: int, per_device_train_batch_size: int
) -> list[tuple[int, int, np.ndarray]]:
    """One PPO epoch's micro-batches in TRL's order: ``[(minibatch_idx, gradient_accumulation_idx, rows), ...]``.

    Mini-batches are consecutive ``local_mini_batch_size`` slices of the permutation; each is cut into
    ``per_device_train_batch_size`` slices (the last may be shorter; a mini-batch smaller than that is one
    micro-batch). ``(minibatch_idx, gradient_accumulation_idx)`` index TRL's statistics tables.
    Permutation ``[3, 0, 2, 1]``, mini 2, micro 1 -> ``(0, 0, [3]), (0, 1, [0]), (1, 0, [2]), (1, 1, [1])``.
    """
    perm = np.asarray(permutation)
    plan = []
    for m, start in enumerate(range(0, len(perm), local_mini_batch_size)):
        mini = perm[start : start + local_mini_batch_size]
        for a, micro in enumerate(range(0, local_mini_batch_size, per_device_train_batch_size)):
            plan.append((m, a, mini[micro : micro + per_device_train_batch_size]))
    return plan


def accumulation_sync_plan(
    num_micro_batches: int, gradient_accumulation_steps: int, step: int, end_of_dataloader: bool
) -> tuple[list[bool], int]:
    """Which micro-batches of an update end with a real optimizer step, as accelerate's ``accumulate`` decides.

    TRL calls ``optimizer.step()`` / ``zero_grad()`` after every micro-batch; accelerate turns them into no-ops
    unless ``sync_gradients``: with ``end_of_dataloader`` (the update that drew the last prompt batch of a pass over
    the dataset) every micro-batch syncs and the counter resets to 0; otherwise ``step += 1`` and it syncs when
    ``step % gradient_accumulation_steps == 0``. The counter runs on across mini-batches, epochs and updates.

    Returns:
      ``(syncs, step)``: one bool per micro-batch, and the counter to pass to the next update.
      ``(8, 4, 0, False) -> ([F, F, F, T, F, F, F, T], 8)``; ``(3, 4, 8, True) -> ([T, T, T], 0)``.
    """
    syncs = []
    for _ in range(num_micro_batches):
        if end_of_dataloader:
            step = 0
            syncs.append(True)
        else:
            step += 1
            syncs.append(step % gradient_accumulation_steps == 0)
    return syncs, step


def micro_stats_table(
    stats: Sequence[dict[str, Array]],
    positions: Sequence[tuple[int, int, int]],
    num_ppo_epochs: int,
    num_mini_batches: int,
    gradient_accumulation_steps: int,
) -> dict[str, Array]:
    """TRL's ``*_stats`` tables: ``[E, M, A]`` per statistic, each micro-batch's value at ``(epoch, mini, ga)``.

    Entries no micro-batch writes stay 0 -- and are averaged in: with ``num_mini_batches > 1`` a mini-batch holds only
    ``ceil(A / M)`` micro-batches, so the logged ``*_avg`` values are diluted by zeros (TRL 1.12 does this).
    """
    shape = (num_ppo_epochs, num_mini_batches, gradient_accumulation_steps)
    tables = {}
    for name in stats[0]:
        table = jnp.zeros(shape, jnp.float32)
        for s, (e, m, a) in zip(stats, positions, strict=True):
            table = table.at[e, m, a].set(s[name])
        tables[name] = table
    return tables


def linear_lr(update: int, learning_rate: float, num_total_batches: int, num_warmup_steps: int = 0) -> float:
    """The ``lr`` TRL logs at update ``update`` (1-based) with the default linear schedule (transformers'
    ``get_linear_schedule_with_warmup``; TRL steps it once per update, after logging).

    ``s = update - 1``: ``s / warmup`` while ``s < warmup``, else ``max(0, (N - s) / (N - warmup))``, times the rate.
    ``linear_lr(2, 3e-3, 2)`` -> ``1.5e-3``.
    """
    s = update - 1
    if s < num_warmup_steps:
        return learning_rate * s / max(1, num_warmup_steps)
    return learning_rate * max(0.0, (num_total_batches - s) / max(1, num_total_batches - num_warmup_steps))


def update_metrics(
    rollout: PPORollout,
    stats: dict[str, Array],
    *,
    eos_token_id: int,
    lr: float,
    episode: int,
) -> dict[str, Array]:
    """The dict TRL logs once per update (``ppo_trainer.py`` 881-907; ``eps``, a speed, left out).

    - ``objective/kl``: ``mean_b sum_t kl``; ``objective/entropy``: ``mean_b sum_t -logprobs`` over
      ``~padding_mask`` (rollout log-probs); ``objective/non_score_reward``: ``mean_b sum_t non_score_reward``;
      ``objective/scores``: ``mean(scores)`` (after the EOS penalty); ``objective/rlhf_reward``: their sum.
    - ``policy/approxkl_avg``, ``policy/clipfrac_avg``, ``loss/policy_avg``, ``loss/value_avg``,
      ``val/clipfrac_avg``, ``policy/entropy_avg``, ``val/ratio``: means of the ``[E, M, A]`` tables (zeros
      included, ``micro_stats_table``); ``val/ratio_var``: the ratio table's unbiased variance (ddof 1).
    - ``val/num_eos_tokens``: every ``eos_token_id`` in the *generated* responses (not truncated, all of them).
    - ``lr`` (``linear_lr``) and ``episode`` (``update * batch_size``) as given. TRL's log also adds ``epoch``
      (``episode / len(train_dataset)``) and ``step`` (the update number).

    With several processes TRL averages each scalar over processes (``gather_for_metrics(x).mean()``) and takes the
    tables' mean/var over all processes' entries; this is the one-process case.
    """
    return {
        **rollout_metrics(rollout, eos_token_id),
        **table_metrics(stats),
        "lr": jnp.asarray(lr, jnp.float32),
        "episode": jnp.asarray(episode, jnp.int32),
    }
