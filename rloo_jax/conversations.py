"""The host side of a multi-turn rollout (tool calling, environments), TRL 1.16's tool loop on a sampler that keeps
each row's KV cache: `run_conversations` starts every row's first turn (`Programs.start_turns`), then, while rows
stop, parses each stopped turn (`tools.parse_turn`), runs every rollout's tool calls at once (`tools.ToolRunner`),
builds the tool messages and the token ids they add (`tools.tool_suffix_ids`: TRL's token concatenation), drops a
result that would not fit (TRL's rollback) and resumes the rows (`Programs.resume_turns`: only the new tokens are
prefilled); finally the conversations as a sampled `Rollout` with its tool mask (`Programs.close_turns`) and what
the rewards, metrics and records read.

TRL's semantics, kept exactly: a turn's tool calls run when the turn parses to tool calls and the rollout has made
fewer than max_tool_calling_iterations rounds (a completion truncated at max_completion_length is parsed too: its
calls run and are counted, and its results are dropped as overlong); the results come back in TRL's order (sync and
failed calls, then async ones), str() of the value or `{'error': ...}`; max_completion_length counts every completion
token; `tools/call_frequency` = calls / completions, `tools/failure_frequency` = failed / calls.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import time
from typing import Any

import jax
import numpy as np

from rloo_jax.data import PromptBatch
from rloo_jax.errors import DataError
from rloo_jax.programs import Programs
from rloo_jax.rewards import repeat_per_generation
from rloo_jax.sampling import SamplingConfig
from rloo_jax.step import Rollout, TrainState
from rloo_jax.tools import Call, Result, ToolUse, parse_turn, tool_suffix_ids, toolbox
from rloo_jax.turns import PAUSED, RUNNING, suffix_bucket, suffix_buckets


@dataclasses.dataclass
class Conversations:
    """A generation batch of conversations: the sampled rollout (device) and, per completion (N, prompt-major), what
    the reward functions, the metrics and rollouts.jsonl read."""

    rollout: Rollout  # sampled: completion ids / mask (every real token), tool_mask (the model's), sampler log-probs
    batch: PromptBatch  # the B prompts as encoded (an environment's observation appended), their columns
    completions: list[list[dict[str, Any]]]  # TRL's: the assistant turns and tool messages of each completion
    completion_ids: list[list[int]]  # every completion token, the model's and the tools'
    environments: list[Any] | None  # one environment per completion (environment_factory), else None
    turns: np.ndarray  # [N] assistant turns of each completion
    calls: list[list[dict[str, Any]]]  # each completion's tool calls: name, arguments, result, failed, error, seconds
    tool_calls: int = 0  # calls made (TRL's count: every call of every executed round)
    tool_failures: int = 0
    malformed: int = 0  # turns whose text did not parse (TRL: plain text, not counted)
    tool_seconds: float = 0.0  # host wall time waiting for the tools
    prefilled: int = 0  # tokens prefilled: the prompts (once each) and the tool results' new tokens
    width: int = 0  # the longest completion (what the reference pass and the update must keep)

    def metrics(self) -> dict[str, float]:
        """TRL's `tools/call_frequency` and `tools/failure_frequency`, and ours: malformed turns per completion,
        turns per completion, prefilled tokens per completion (`tools/*`) and the tools' seconds (`timing/tools`)."""
        n = len(self.completion_ids)
        return {
            "tools/call_frequency": self.tool_calls / n,
            "tools/failure_frequency": self.tool_failures / self.tool_calls if self.tool_calls else 0.0,
            "tools/malformed_frequency": self.malformed / n,
            "tools/turns_mean": float(np.mean(self.turns)),
            "tools/turns_max": float(np.max(self.turns)),
            "timing/tools": self.tool_seconds,
        }

    def reward_columns(self) -> dict[str, list[Any]]:
        """The columns the reward functions get per completion (the dataset's, repeated per generation)."""
        g = len(self.completion_ids) // len(self.batch)
        return {k: repeat_per_generation(v, g) for k, v in self.batch.columns.items()}


def _observed_prompts(prompts: list[Any], observations: list[Any], g: int) -> list[Any]:
    """Each prompt with its environments' `reset` observation appended to the last message's content (TRL); the G
    rollouts of a prompt share one prompt here (prefilled once), so their observations must agree."""
    out = []
    for b, prompt in enumerate(prompts):
        group = observations[b * g:(b + 1) * g]
        if any(o != group[0] for o in group):
            raise DataError(f"the environments of prompt {b} returned different observations from reset() for its "
                            f"{g} rollouts; rollouts of one prompt share its prefilled tokens here, so reset(**row) "
                            "must be deterministic in the row")
        obs = group[0]
        if obs is None:
            out.append(prompt)
            continue
        if not isinstance(obs, str):
            raise DataError(f"an environment's reset() returned {type(obs).__name__}; return a string or None")
        last = prompt[-1]
        out.append(prompt[:-1] + [{**last, "content": last["content"] + obs}])
    return out


def _tool_order(calls: list[dict[str, Any]], tools: dict[str, Any]) -> list[int]:
    """TRL's order of one turn's results: sync and failing calls as they come, then the async calls (gathered)."""
    def is_async(call: dict[str, Any]) -> bool:
        function = call.get("function") or {}
        tool = tools.get(function.get("name")) if call.get("type") == "function" else None
        if tool is None or not tool.is_async or not isinstance(function.get("arguments") or {}, dict):
            return False
        try:  # TRL calls the coroutine function first: a binding error is a sync failure there
            inspect.signature(tool.fn).bind(**(function.get("arguments") or {}))
        except TypeError:
            return False
        return True

    flags = [is_async(c) for c in calls]
    return [i for i, a in enumerate(flags) if not a] + [i for i, a in enumerate(flags) if a]


def run_conversations(
    programs: Programs, state: TrainState, rows: dict[str, list[Any]], key: jax.Array, use: ToolUse, encoder: Any,
    sampling: SamplingConfig | None = None,
) -> Conversations:
    """One generation batch of multi-turn rollouts from dataset `rows` (B prompts; `sampling`: other sampler options,
    e.g. evaluation's G). Single process."""
    sc = programs.cfg.sampling if sampling is None else sampling
    g, c = sc.num_generations, sc.max_new_tokens
    prompts = list(rows["prompt"])
    b = len(prompts)
    n = b * g
    environments = None
    env_names: list[Any] = [None] * n
    if use.environments is not None:
        pool = use.environments
        env_names = repeat_per_generation(list(rows["environment"]) if pool.multi else [None] * b, g)
        environments = pool.assign(env_names)
        keys = [k for k in rows if not (pool.multi and k == "environment")]
        observations = [env.reset(**{k: rows[k][i // g] for k in keys}) for i, env in enumerate(environments)]
        rows = dict(rows, prompt=_observed_prompts(prompts, observations, g))
    batch = encoder(rows)
    prompt_tokens = [list(ids[m > 0]) for ids, m in zip(batch.prompt_ids, batch.prompt_mask, strict=True)]
    boxes = [toolbox(use.standalone, None if environments is None else environments[i]) for i in range(n)]
    schemas = [use.schemas(name) for name in env_names]
    pause_at = use.pause_at(n)
    buckets = suffix_buckets(c, use.suffix_bucket)

    t = programs.start_turns(state, batch.prompt_ids, batch.prompt_mask, key, pause_at, sc)
    prefilled = int(batch.prompt_mask.sum())
    turn_start = np.zeros(n, np.int64)  # the slot where each row's current model turn began
    rounds = np.zeros(n, np.int64)  # tool rounds executed
    made = np.zeros(n, np.int64)  # tool calls made (the per-rollout limit)
    handled = np.zeros(n, bool)  # the row's last stop was processed
    messages: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    records: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    turns = np.zeros(n, np.int64)
    out = Conversations(rollout=None, batch=batch, completions=messages, completion_ids=[], environments=environments,
                        turns=turns, calls=records)
    while True:
        status, cursor, ids = (np.asarray(x) for x in jax.device_get((t.status, t.cursor, t.ids)))
        stopped = [r for r in range(n) if status[r] != RUNNING and not handled[r]]
        if not stopped and not (status == RUNNING).any():
            break
        suffix_len = np.zeros(n, np.int32)
        suffixes: dict[int, list[int]] = {}
        calls: list[tuple[int, list[dict[str, Any]]]] = []
        for r in stopped:
            handled[r] = True
            turn = ids[r, turn_start[r]:cursor[r]].tolist()
            if not turn:  # a turn with no room left (TRL: an empty post-tool completion is not appended)
                continue
            prefix = prompt_tokens[r // g] + ids[r, :turn_start[r]].tolist()
            message, malformed = parse_turn(use.tokenizer, turn, prefix, schemas[r])
            out.malformed += malformed
            messages[r].append(message)
            turns[r] += 1
            if message.get("tool_calls") and (use.max_iterations is None or rounds[r] < use.max_iterations):
                calls.append((r, message["tool_calls"]))
        t0 = time.perf_counter()
        flat: list[Call] = []
        for r, row_calls in calls:
            for k in _tool_order(row_calls, boxes[r]):
                flat.append(Call(r, row_calls[k], boxes[r], use.max_calls is None or made[r] < use.max_calls))
                made[r] += 1
        results = use.runner.run(flat)
        out.tool_seconds += time.perf_counter() - t0
        out.tool_calls += len(results)
        out.tool_failures += sum(res.failed for res in results)
        by_row: dict[int, list[tuple[Call, Result]]] = {}
        for call, res in zip(flat, results, strict=True):
            by_row.setdefault(call.row, []).append((call, res))
        for r, done_calls in by_row.items():
            tool_messages = [{"role": "tool", "name": res.name, "content": res.content} for _, res in done_calls]
            for call, res in done_calls:
                records[r].append({"turn": int(turns[r]), "name": res.name,
                                   "arguments": (call.call.get("function") or {}).get("arguments"),
                                   "result": res.content, "failed": res.failed, "error": res.error,
                                   "seconds": round(res.seconds, 6)})
            suffix = tool_suffix_ids(use.tokenizer, tool_messages, use.chat_template, use.chat_template_kwargs)
            total = len(prompt_tokens[r // g]) + int(cursor[r]) + len(suffix)
            if cursor[r] + len(suffix) > c or (use.max_model_len is not None and total >= use.max_model_len):
                for rec in records[r][-len(done_calls):]:
                    rec["dropped"] = True  # TRL's rollback: the results would not fit
                continue
            messages[r].extend(tool_messages)
            suffixes[r] = suffix
            suffix_len[r] = len(suffix)
            turn_start[r] = int(cursor[r]) + len(suffix)
            rounds[r] += 1
            handled[r] = False
        if not suffixes and not (status == RUNNING).any():
            break
        finish = np.array([status[r] == PAUSED and r not in suffixes for r in range(n)])
        width = suffix_bucket(max([len(s) for s in suffixes.values()], default=1), buckets)
        padded = np.full((n, width), sc.pad_token_id, np.int32)
        for r, s in suffixes.items():
            padded[r, :len(s)] = s
        # the new tokens (the same pass writes each resumed row's last sampled token, as a decode step would)
        prefilled += int(suffix_len.sum())
        t = programs.resume_turns(state, t, padded, suffix_len, finish, key, pause_at, sc)
    cursor = np.asarray(jax.device_get(t.cursor))
    ids = np.asarray(jax.device_get(t.ids))
    out.rollout = programs.close_turns(t, pause_at, sc)
    out.completion_ids = [ids[r, :cursor[r]].tolist() for r in range(n)]
    out.prefilled = prefilled
    out.width = int(cursor.max())
    return out


def transcript(x: Any) -> Any:
    """A prompt or completion of rollouts.jsonl as one line of text: chat messages as `role: content` joined by
    ` | `, an assistant turn's tool calls as `-> name(arg=value, ...)`, a tool message as `tool name: result`; a
    text as it is. Example: [assistant calling multiply(a=7, b=3), tool multiply `21`, assistant `The answer is
    21.`] -> "assistant: -> multiply(a=7, b=3) | tool multiply: 21 | assistant: The answer is 21."."""
    if not isinstance(x, list):
        return x
    parts = []
    for m in x:
        content = m.get("content") or ""
        if m.get("role") == "tool":
            parts.append(f"tool {m.get('name') or ''}: {content}".replace("tool : ", "tool: "))
            continue
        shown = [content] if content else []
        for call in m.get("tool_calls") or []:
            f = call.get("function", call)
            args = f.get("arguments") or {}
            args = ", ".join(f"{k}={v!r}" for k, v in args.items()) if isinstance(args, dict) else str(args)
            shown.append(f"-> {f.get('name')}({args})")
        parts.append(f"{m.get('role')}: {' '.join(shown)}")
    return " | ".join(parts)


def conversation_record(conv: Conversations, row: int, tool_mask: np.ndarray) -> dict[str, Any]:
    """One completion's conversation for rollouts.jsonl (`metrics.rollout_records`): its assistant turns, its tool
    calls with their results, its token count (the model's and the tools') and tool mask (1: the model's token)."""
    n = len(conv.completion_ids[row])
    return {"turns": int(conv.turns[row]), "tool_calls": copy.deepcopy(conv.calls[row]), "tokens": n,
            "tool_mask": [int(x) for x in tool_mask[:n]]}
