"""Rollouts from a user function: TRL 1.16 GRPOTrainer's `rollout_func(prompts, trainer)`, a third source of a
generation batch beside the sampler (`loop.single_turn_rollout`) and the tool loop (`rloo_jax.conversations`).

`run_rollout_func` calls the function on the host with the batch's prompts as TRL's RepeatSampler yields them (each
prompt G times, consecutively) and the trainer object, checks what it returns and builds the sampled `Rollout` the
sampler would (prompts left-padded [B, P], completions right-padded [N, C]); `score_external` decodes and scores it.

TRL's semantics, kept: the output must hold `prompt_ids`, `completion_ids` and `logprobs` (one list per completion;
ValueError naming the missing keys); `env_mask` (optional) is the tool mask (1: the model's tokens, 0: external ones:
out of the loss, out of the completion lengths); every other key goes to the reward functions per completion
(`values[i]` for a list, the value itself otherwise). Every returned token is in the completion mask (no EOS cut);
a completion is truncated when its last token is neither an EOS nor pad (with mask_truncated_completions its row
leaves the loss); completions are decoded whole (`parse_response` when the tokenizer has a response template and the
prompts are conversational). The returned log-probs are TRL's `sampling_per_token_logps`: the programs run with
`StepConfig.given_logps`, which keeps them as `sampler_logps` (the old log-probs recomputed by a training forward,
used as TRL's rule says: off policy) and gives them to the off-policy sequence mask.

Ours only: the G completions of one prompt must share its prompt_ids (the programs hold one prompt row per group);
no prompt may be longer than max_prompt_length, no completion longer than max_completion_length (DataError naming
the option to raise); single process.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rloo_jax.completions import Scored
from rloo_jax.data import PromptBatch, is_conversational, left_pad
from rloo_jax.errors import DataError
from rloo_jax.placement import Placement
from rloo_jax.rewards import compute_rewards, repeat_per_generation
from rloo_jax.step import Rollout
from rloo_jax.tools import parse_turn

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")


@dataclasses.dataclass
class External:
    """A generation batch from `rollout_func`: the sampled rollout (device, max_new_tokens wide) and what the reward
    functions read, per completion (N, prompt-major)."""

    rollout: Rollout
    batch: PromptBatch  # the B prompts, their ids as returned, their dataset columns
    completions: list[Any]  # decoded: texts, or one assistant message for conversational prompts
    completion_ids: list[list[int]]  # every returned token
    extra: dict[str, list[Any]]  # the output's other keys, one value per completion
    lengths: np.ndarray  # [N] the model's tokens (env_mask's sum, else every token)
    truncated: np.ndarray  # [N] bool: the last token is neither EOS nor pad
    width: int  # the longest completion

    def reward_columns(self) -> dict[str, list[Any]]:
        g = len(self.completion_ids) // len(self.batch)
        columns = {k: repeat_per_generation(v, g) for k, v in self.batch.columns.items()}
        columns.update(self.extra)  # TRL: inp[key] = ..., over the dataset's column of that name
        return columns


def _id_lists(output: dict[str, Any], key: str, n: int) -> list[list[Any]]:
    value = output[key]
    try:
        rows = [list(v) for v in value]
    except TypeError:
        raise DataError(f"rollout_func returned {key} as a {type(value).__name__}; return one list per completion "
                        f"({n}: prompts x num_generations)") from None
    if len(rows) != n:
        raise DataError(f"rollout_func returned {len(rows)} {key} for {n} completions; return one per prompt it was "
                        "given (the batch's prompts, num_generations copies each)")
    return rows


def run_rollout_func(
    fn: Callable[[list[Any]], dict[str, Any]], rows: dict[str, list[Any]], g: int, max_new_tokens: int,
    max_prompt_length: int | None, prompt_bucket: int, pad_id: int, stop_ids: Sequence[int], tokenizer: Any,
    place: Placement, mask_truncated: bool,
) -> External:
    """One generation batch from `fn` (TRL's `rollout_func` bound to the trainer) for dataset `rows` (B prompts, G
    completions each). Single process."""
    prompts = list(rows["prompt"])
    b, n = len(prompts), len(prompts) * g
    output = fn(copy.deepcopy(repeat_per_generation(prompts, g)))
    if not isinstance(output, dict):
        raise DataError(f"rollout_func returned a {type(output).__name__}; return a dict with "
                        f"{', '.join(REQUIRED)} (one list per completion)")
    missing = sorted(set(REQUIRED) - output.keys())
    if missing:  # TRL's error
        raise ValueError(f"rollout_func must return keys {missing} in its output dict.")
    prompt_ids = [[int(t) for t in ids] for ids in _id_lists(output, "prompt_ids", n)]
    completion_ids = [[int(t) for t in ids] for ids in _id_lists(output, "completion_ids", n)]
    logprobs = _id_lists(output, "logprobs", n)
    extra = {k: v for k, v in output.items() if k not in REQUIRED}
    env_mask = extra.pop("env_mask", None)
    env_mask = None if env_mask is None else _id_lists({"env_mask": env_mask}, "env_mask", n)
    for k, v in extra.items():
        if isinstance(v, list) and len(v) < n:
            raise DataError(f"rollout_func returned {len(v)} values of {k!r} for {n} completions; return one per "
                            "completion (or a single value that is not a list, passed to every completion)")
    extra = {k: list(v[:n]) if isinstance(v, list) else [v] * n for k, v in extra.items()}
    for i in range(n):
        if prompt_ids[i] != prompt_ids[i - i % g]:
            raise DataError(f"rollout_func returned other prompt_ids for completion {i} than for completion "
                            f"{i - i % g}, both of prompt {i // g}: the {g} completions of a prompt share its prompt "
                            "here (the programs hold one prompt row per group); return the same prompt_ids for them")
        if not prompt_ids[i]:
            raise DataError(f"rollout_func returned empty prompt_ids for completion {i}")
        if max_prompt_length is not None and len(prompt_ids[i]) > max_prompt_length:
            raise DataError(f"rollout_func returned {len(prompt_ids[i])} prompt_ids for completion {i}, more than "
                            f"max_prompt_length {max_prompt_length}; raise max_prompt_length")
        c = len(completion_ids[i])
        if not c:
            raise DataError(f"rollout_func returned no completion_ids for completion {i}; return at least one token")
        if c > max_new_tokens:
            raise DataError(f"rollout_func returned {c} completion_ids for completion {i}, more than "
                            f"max_completion_length {max_new_tokens}; raise max_completion_length")
        if len(logprobs[i]) != c:
            raise DataError(f"rollout_func returned {len(logprobs[i])} logprobs for completion {i}'s {c} "
                            "completion_ids; return one per token")
        if env_mask is not None and len(env_mask[i]) != c:
            raise DataError(f"rollout_func returned {len(env_mask[i])} env_mask values for completion {i}'s {c} "
                            "completion_ids; return one per token")
    ids, mask = left_pad([prompt_ids[k * g] for k in range(b)], pad_id, prompt_bucket)
    columns = {k: list(v) for k, v in rows.items() if k not in ("prompt", "input_ids")}
    batch = PromptBatch(prompts, columns, ids, mask, 0)

    comp = np.full((n, max_new_tokens), pad_id, np.int32)
    cmask = np.zeros((n, max_new_tokens), np.int32)
    tool_mask = np.zeros((n, max_new_tokens), np.int32)
    logps = np.zeros((n, max_new_tokens), np.float32)
    ends = set(int(t) for t in stop_ids) | {int(pad_id)}
    truncated = np.array([ids_[-1] not in ends for ids_ in completion_ids])
    for i, ids_ in enumerate(completion_ids):
        c = len(ids_)
        comp[i, :c] = ids_
        cmask[i, :c] = 1
        tool_mask[i, :c] = 1 if env_mask is None else [int(x) for x in env_mask[i]]
        logps[i, :c] = np.asarray([0.0 if x is None else x for x in logprobs[i]], np.float32)
    lengths = tool_mask.sum(axis=1).astype(np.int32)  # TRL: env_mask's sum, else every token
    if mask_truncated:
        cmask = cmask * (~truncated)[:, None].astype(np.int32)
    logps = np.where(cmask > 0, logps, 0.0).astype(np.float32)
    rollout = Rollout(
        prompt_ids=place.to_global(ids), prompt_mask=place.to_global(mask), completion_ids=place.to_global(comp),
        completion_mask=place.to_global(cmask), is_truncated=place.to_global(truncated),
        old_logps=place.to_global(logps), ref_logps=None, tool_mask=place.to_global(tool_mask),
    )
    completions = decode_completions(tokenizer, prompts[0], completion_ids, prompt_ids)
    return External(rollout, batch, completions, completion_ids, extra, lengths, truncated,
                    max(len(c) for c in completion_ids))


def decode_completions(tokenizer: Any, prompt: Any, completion_ids: list[list[int]],
                       prompt_ids: list[list[int]]) -> list[Any]:
    """TRL's decoding of rollout_func completions: whole (no EOS cut), special tokens skipped; conversational
    prompts get one assistant message each, parsed by the tokenizer's response template when it has one."""
    if not is_conversational(prompt):
        return tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    if getattr(tokenizer, "response_template", None) is not None or \
            getattr(tokenizer, "response_schema", None) is not None:
        return [[parse_turn(tokenizer, ids, prompt_ids[i], None)[0]] for i, ids in enumerate(completion_ids)]
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [[{"role": "assistant", "content": t}] for t in texts]


def score_external(reward_funcs: Any, ext: External, context: dict[str, Any] | None = None) -> Scored:
    """The rewards of a rollout_func batch: TRL's arguments (prompts, completions, every returned token id, the
    dataset's columns and the output's other keys); a `completions.Scored`."""
    g = len(ext.completion_ids) // len(ext.batch)
    prompts = repeat_per_generation(ext.batch.prompts, g)
    rewards = compute_rewards(reward_funcs, prompts, ext.completions, ext.completion_ids, ext.reward_columns(),
                              context)
    return Scored(prompts, ext.completions, ext.lengths, ext.truncated, rewards)
