"""The host side of a generation batch: prompts encoded for the sampler (every process its own rows), completions
decoded to text (EOS-cut, special tokens skipped, as TRL) and scored by the reward functions."""

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.table import Table

from rloo_jax.build import Prepared
from rloo_jax.data import PromptBatch, is_conversational
from rloo_jax.placement import Placement
from rloo_jax.rewards import compute_rewards, repeat_per_generation


def completion_lengths(completion_ids: np.ndarray, eos_token_ids: Sequence[int]) -> np.ndarray:
    """EOS-cut lengths [N]: up to and including the first EOS, else C. [[5, 1, 0], [5, 6, 7]], eos 1 -> [2, 3]."""
    is_eos = np.isin(completion_ids, list(eos_token_ids))
    first = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, completion_ids.shape[1])
    return first.astype(np.int32)


def encode_rows(prepared: Prepared, place: Placement, rows: dict[str, list[Any]]) -> PromptBatch:
    """Encode this process's prompt rows. With several processes, every process left-pads to the widest prompt
    batch of all processes and counts truncated prompts over all, so the global batch is exactly what one process
    encoding every row would build."""
    batch = prepared.encoder(rows)
    if not place.multi_process:
        return batch
    facts = place.per_process([batch.prompt_ids.shape[1], batch.num_truncated])
    pad = ((0, 0), (int(facts[:, 0].max()) - batch.prompt_ids.shape[1], 0))
    return dataclasses.replace(
        batch,
        prompt_ids=np.pad(batch.prompt_ids, pad, constant_values=prompt_pad_id(prepared.tokenizer)),
        prompt_mask=np.pad(batch.prompt_mask, pad),
        num_truncated=int(facts[:, 1].sum()),
    )


def prompt_pad_id(tokenizer: Any) -> int:
    """The id `PromptEncoder` left-pads prompts with: pad, else eos, else 0."""
    pad = tokenizer.pad_token_id
    pad = tokenizer.eos_token_id if pad is None else pad
    return int(pad or 0)


# ------------------------------------------------------------------------------------------------ host work
@dataclasses.dataclass
class Scored:
    """A generation batch after decoding and reward computation (host side)."""

    prompts: list[Any]  # N prompts (repeated G times)
    completions: list[Any]  # N texts, or assistant messages for conversational prompts
    lengths: np.ndarray  # [N] EOS-cut lengths
    truncated: np.ndarray  # [N] bool
    rewards_per_func: np.ndarray  # [N, F] float32 with NaN


def decode(
    prepared: Prepared, prompts: list[Any], completion_ids: np.ndarray, num_generations: int,
    rewards_per_func: np.ndarray,
) -> Scored:
    """Decode completions (EOS-cut, special tokens skipped, as TRL) next to their prompts and given rewards."""
    lengths = completion_lengths(completion_ids, prepared.eos_ids)
    ids = [completion_ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
    texts = prepared.tokenizer.batch_decode(ids, skip_special_tokens=True)
    chat = is_conversational(prompts[0])
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    truncated = ~np.isin(completion_ids[np.arange(len(lengths)), lengths - 1], list(prepared.eos_ids))
    return Scored(repeat_per_generation(prompts, num_generations), completions, lengths, truncated, rewards_per_func)


def decode_and_score(prepared: Prepared, batch: PromptBatch, completion_ids: np.ndarray, num_generations: int,
                     context: dict[str, Any] | None = None) -> Scored:
    """Decode completions (special tokens skipped, as TRL) and call every reward function (`context`: TRL's
    trainer_state, log_extra and log_metric arguments)."""
    scored = decode(prepared, batch.prompts, completion_ids, num_generations, np.zeros((0, 0), np.float32))
    ids = [completion_ids[i, :n].tolist() for i, n in enumerate(scored.lengths)]
    columns = {k: repeat_per_generation(v, num_generations) for k, v in batch.columns.items()}
    scored.rewards_per_func = compute_rewards(prepared.reward_funcs, scored.prompts, scored.completions, ids, columns,
                                              context)
    return scored


def print_completions(console: Any, records: list[dict[str, Any]], limit: int | None) -> None:
    """A small table of (prompt, completion, reward, advantage)."""
    table = Table("prompt", "completion", "reward", "advantage", title=f"step {records[0]['step']}")
    for r in records[: limit if limit is not None else len(records)]:
        table.add_row(str(r["prompt"])[-60:], str(r["completion"])[:80], f"{r['reward']:.3f}", f"{r['advantage']:.3f}")
    console.print(table)


def score_conversations(prepared: Prepared, conv: Any, context: dict[str, Any] | None = None) -> Scored:
    """A batch of multi-turn rollouts (`rloo_jax.conversations.Conversations`) scored as TRL scores its tool loop's:
    the reward functions get the prompts, each completion's messages (its assistant turns and tool messages), every
    completion token id, the dataset's columns and, with environments, `environments` (one per completion). The
    lengths are the model's tokens (TRL: the tool mask's sum); truncated: the last token is neither EOS nor pad."""
    n = len(conv.completion_ids)
    g = n // len(conv.batch)
    tool_mask = np.asarray(conv.rollout.tool_mask)
    truncated = np.asarray(conv.rollout.is_truncated)
    context = dict(context or {})
    if conv.environments is not None:
        context["environments"] = conv.environments
    prompts = repeat_per_generation(conv.batch.prompts, g)
    rewards = compute_rewards(prepared.reward_funcs, prompts, conv.completions, conv.completion_ids,
                              conv.reward_columns(), context)
    return Scored(prompts, conv.completions, tool_mask.sum(axis=1).astype(np.int32), truncated, rewards)
