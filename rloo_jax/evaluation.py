"""Evaluation: the run's sampling program on the evaluation prompts (`num_generations_eval` completions each),
scored by the reward functions; reward and length statistics under TRL's `eval_` names."""

import dataclasses
from typing import Any

import jax
import numpy as np

from rloo_jax.build import Prepared
from rloo_jax.completions import decode_and_score, encode_rows, score_conversations
from rloo_jax.conversations import run_conversations
from rloo_jax.data import eval_batches
from rloo_jax.external import External, run_rollout_func, score_external
from rloo_jax.metrics import weighted_rewards
from rloo_jax.placement import Placement
from rloo_jax.programs import Programs
from rloo_jax.rewards import RewardLogs, TrainerState


def evaluate(
    prepared: Prepared, place: Placement, programs: Programs, state: Any, key: jax.Array, names: list[str],
    trainer_state: TrainerState | None = None, dataset: Any = None, prefix: str = "eval_",
) -> dict[str, float]:
    """Sample num_generations_eval completions per test prompt and report reward / length statistics (and the
    means of what the reward functions logged with log_metric; their log_extra columns are not recorded).

    The training run's sampling program with the evaluation `SamplingConfig` (on a mesh: on the sharded state, no
    parameter gather). Every process encodes, samples for and rewards its share of each evaluation batch; the
    statistics use all rows. `dataset`: the prompts (default: the run's only evaluation set); `prefix`: of every
    metric name (TRL's `eval_`, or `eval_<name>_` for one of several named sets).
    """
    cfg = prepared.cfg
    dataset = next(iter(prepared.eval_ds.values())) if dataset is None else dataset
    logs = RewardLogs()
    logged: dict[str, list[float]] = {}
    g = cfg.resolved_num_generations_eval
    sc = dataclasses.replace(programs.cfg.sampling, num_generations=g)
    per_func, lengths, truncated = [], [], []
    for i, (idx, real) in enumerate(eval_batches(len(dataset), cfg.eval_batch_size // g)):
        rows = place.rows(len(idx))
        batch_key = place.replicate(jax.random.fold_in(key, i))
        context = logs.context(trainer_state or TrainerState())
        if prepared.rollout_func is not None:  # TRL calls the rollout_func for evaluation too
            ext = external_batch(prepared, place, programs, dataset[idx[rows]], g)
            sampled, scored = ext.rollout, score_external(prepared.reward_funcs, ext, context)
        elif prepared.tool_use is not None:  # conversations, as in training (single process)
            conv = run_conversations(programs, state, dataset[idx[rows]], batch_key, prepared.tool_use,
                                     prepared.encoder, sc)
            sampled, scored = conv.rollout, score_conversations(prepared, conv, context)
        else:
            batch = encode_rows(prepared, place, dataset[idx[rows]])
            ids, mask = place.to_global(batch.prompt_ids), place.to_global(batch.prompt_mask)
            sampled = programs.sample(state, ids, mask, batch_key, sc)
            scored = decode_and_score(prepared, batch, place.local(sampled.completion_ids), g, context)
        if prepared.device_reward_model is not None:  # scored on the token ids, first (as in training)
            device = place.local(programs.device_scores(state, sampled, sc))
            scored.rewards_per_func = np.concatenate([device, scored.rewards_per_func], axis=1)
        for name, value in place.reward_logs(logs, len(scored.lengths))[1].items():
            logged.setdefault(name, []).append(value)
        keep = slice(0, real * g)  # drop the rows padding the last batch (global row order)
        per_func.append(place.gather(scored.rewards_per_func)[keep])
        lengths.append(place.gather(scored.lengths)[keep])
        truncated.append(place.gather(scored.truncated)[keep])
    per_func, lengths, truncated = np.concatenate(per_func), np.concatenate(lengths), np.concatenate(truncated)
    reward = weighted_rewards(per_func, prepared.reward_weights)
    out = {"reward": float(np.nanmean(reward)), "reward_std": float(np.nanstd(reward, ddof=1))}
    for f, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(np.nanmean(per_func[:, f]))
        out[f"rewards/{name}/std"] = float(np.nanstd(per_func[:, f], ddof=1))
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/clipped_ratio"] = float(truncated.mean())
    out.update({name: float(np.mean(values)) for name, values in logged.items()})
    return {f"{prefix}{k}": v for k, v in out.items()}


def external_batch(prepared: Prepared, place: Placement, programs: Programs, rows: dict[str, list[Any]],
                   g: int) -> External:
    """A generation batch of `rows` (G completions each) from the run's rollout_func (`rloo_jax.external`)."""
    cfg, sc = prepared.cfg, programs.cfg.sampling
    return run_rollout_func(prepared.rollout_func, rows, g, sc.max_new_tokens, cfg.max_prompt_length,
                            cfg.prompt_bucket, sc.pad_token_id, sc.eos_token_ids or (), prepared.tokenizer, place,
                            programs.cfg.algorithm.mask_truncated_completions)


def eval_prefix(name: str) -> str:
    """TRL's metric prefix of an evaluation set: `eval_`, or `eval_<name>_` for one of several named sets."""
    return f"eval_{name}_" if name else "eval_"
