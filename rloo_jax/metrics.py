"""Host-side metric plumbing: window averages read from the device once, JSONL files, TensorBoard / W&B,
the console line and the rollout records.

Outputs other tools rely on: `metrics.jsonl` (one object per logged step: `step`, TRL's metric names,
`step_time`, `learning_rate`) and `rollouts.jsonl` (one object per completion of a recorded step).
"""

import dataclasses
import json
import math
import os
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rloo_jax import outputs
from rloo_jax.errors import ConfigError


def json_safe(value: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python, so every line is strict JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def rename_reward_metrics(metrics: dict[str, Any], names: Sequence[str], prefix: str = "") -> dict[str, Any]:
    """`rewards/<i>/mean` (function index) -> `rewards/<name>/mean`; every key gets `prefix` (e.g. `eval_`)."""
    out = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "rewards" and parts[1].isdigit():
            key = f"rewards/{names[int(parts[1])]}/{parts[2]}"
        out[prefix + key] = value
    return out


# Line separators JSON leaves unescaped (it escapes only U+0000-U+001F, '"' and '\\'): a reader that splits a JSONL
# file with str.splitlines (or the Python 2 / JavaScript line rules) would cut a record in two at them.
_UNESCAPED_SEPARATORS = {"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}


def jsonl_line(record: dict[str, Any]) -> str:
    """One JSONL line: the record as strict JSON (`json_safe`), non-ASCII text kept as UTF-8 except the three line
    separators JSON would leave raw (U+0085, U+2028, U+2029), written as escapes; ends with "\\n", the only raw
    line break in the line. {"t": "a\\u2028b"} -> '{"t": "a\\\\u2028b"}\\n' (the same string when read back)."""
    text = json.dumps(json_safe(record), ensure_ascii=False)
    for raw, escaped in _UNESCAPED_SEPARATORS.items():
        text = text.replace(raw, escaped)  # outside strings JSON has no such characters: only string content changes
    return text + "\n"


def jsonl_lines(text: str, keepends: bool = False) -> list[str]:
    """A JSONL file's lines: split on "\\n" only. Not `str.splitlines`, which also splits on \\r, \\v, \\f,
    \\x1c-\\x1e, U+0085, U+2028 and U+2029; a record holding one of those raw (files written before `jsonl_line`
    escaped them) would be cut in two and read as torn. "a\\u2028b\\nc" -> ["a\\u2028b", "c"]."""
    lines = text.split("\n")
    if keepends:
        lines = [line + "\n" for line in lines[:-1]] + [lines[-1]]
    return lines if lines[-1] else lines[:-1]


class JsonlWriter:
    """Appends one JSON object per line, flushed after each write so a crash loses nothing written; `path` local or
    a URL (`rloo_jax.outputs.AppendFile`: there `sync()` uploads what was written, `close()` too)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._file = outputs.AppendFile(path)
        self.path = self._file.path

    def write(self, records: dict[str, Any] | Iterable[dict[str, Any]]) -> None:
        records = [records] if isinstance(records, dict) else records
        self._file.write("".join(jsonl_line(r) for r in records))

    def sync(self) -> None:
        self._file.sync()

    def close(self) -> None:
        self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of a JSONL file (local or a URL), split on "\\n" alone (`jsonl_lines`)."""
    return [json.loads(line) for line in jsonl_lines(outputs.read_text(path)) if line.strip()]


def drop_records_after(path: str | os.PathLike, step: int) -> int:
    """On resume, remove records logged after the checkpoint `step` (they will be logged again), and a torn
    last line left by a process killed mid-write; returns how many records were dropped. The file is replaced
    atomically (`outputs.write_text`), so a kill during this call leaves either the old or the new file."""
    if not outputs.exists(path):
        return 0
    lines = [line for line in jsonl_lines(outputs.read_text(path), keepends=True) if line.strip()]
    keep = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # only the last line can be torn (every earlier write was flushed whole)
        if record.get("step", 0) <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        outputs.write_text(path, "".join(keep))
    return len(lines) - len(keep)


# ------------------------------------------------------------------------------------------------ extra sinks
def check_report_to(report_to: Sequence[str]) -> None:
    """Fail before training if a requested sink's package is missing, naming the extra to install."""
    extras = {"tensorboard": ("tensorboardX", "tensorboard"), "wandb": ("wandb", "wandb")}
    for sink in report_to:
        if sink in extras:
            module, extra = extras[sink]
            try:
                __import__(module)
            except ImportError:
                raise ConfigError(
                    f"report_to={sink} needs the `{module}` package: pip install 'rloo_jax[{extra}]'"
                ) from None


WANDB_RUN_ID = "wandb_run_id"  # in output_dir: the W&B run a resumed run continues


def wandb_run_id(output_dir: str) -> str:
    """The W&B run id of the run in `output_dir`: read from `output_dir/wandb_run_id`, or made and written there on
    the first start, so every restart of the run (resume) logs to the same W&B run."""
    path = outputs.join(output_dir, WANDB_RUN_ID)
    if outputs.exists(path):
        run_id = outputs.read_text(path).strip()
        if run_id:
            return run_id
    run_id = uuid.uuid4().hex[:16]
    outputs.write_text(path, run_id + "\n")
    return run_id


class Sinks:
    """metrics.jsonl plus the optional TensorBoard / W&B writers named in `report_to` (W&B: the run named
    `run_name`, with the id kept in output_dir so a resumed run continues it); `output_dir` local or a URL
    (TensorBoard's event files are then staged locally and uploaded by `sync`, `close`)."""

    def __init__(self, output_dir: str, report_to: Sequence[str], config: dict[str, Any],
                 run_name: str | None = None) -> None:
        self.jsonl = JsonlWriter(os.path.join(output_dir, "metrics.jsonl"))
        self.tensorboard = self.wandb = self._tb_dir = None
        if "tensorboard" in report_to:
            from tensorboardX import SummaryWriter

            self._tb_dir = outputs.StagedDir(os.path.join(output_dir, "tensorboard"))
            self.tensorboard = SummaryWriter(self._tb_dir.local)
        if "wandb" in report_to:
            import wandb

            # W&B's own files need a local folder; its records live on the W&B server
            local = tempfile.mkdtemp(prefix="rloo_jax_wandb_") if outputs.is_remote(output_dir) else output_dir
            self.wandb = wandb.init(dir=local, config=config, id=wandb_run_id(output_dir), name=run_name,
                                    resume="allow")

    def sync(self) -> None:
        """Upload what was logged so far (a URL output_dir; a no-op for a local one): called before checkpoints."""
        self.jsonl.sync()
        if self._tb_dir is not None:
            self._tb_dir.sync()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.jsonl.write({"step": step, **metrics})
        if self.tensorboard is not None:
            for key, value in metrics.items():
                if isinstance(value, int | float) and math.isfinite(value):
                    self.tensorboard.add_scalar(key, value, step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(json_safe(metrics), step=step)

    def close(self) -> None:
        self.jsonl.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self._tb_dir.close()
        if self.wandb is not None:
            self.wandb.finish()


# ------------------------------------------------------------------------------------------------ records
@dataclasses.dataclass(frozen=True)
class TokenRecords:
    """The token-level view of a recorded step (host arrays): what the completions were made of and what every
    model said about each sampled token."""

    completion_ids: np.ndarray  # [N, C] int, right-padded
    mask: np.ndarray  # [N, C] the loss mask (all zero for a truncated completion when mask_truncated_completions)
    logps: dict[str, np.ndarray]  # name -> [N, C] float32 per-token log-probs (`logprob_series`), 0 off the mask


def logprob_series(old_logps: Any, ref_logps: Any, sampler_logps: Any) -> dict[str, Any]:
    """A rollout's per-token log-probs by who computed them: `sampler` (the sampling pass, always), `trainer` (a
    training forward at the sampling parameters: only when the run recomputed the old log-probs, then
    `old_logps`), `reference` (beta != 0). `old_logps` is the sampler's unless `sampler_logps` is set
    (`rloo_jax.step.Rollout`)."""
    series = {"sampler": old_logps if sampler_logps is None else sampler_logps}
    if sampler_logps is not None:
        series["trainer"] = old_logps
    if ref_logps is not None:
        series["reference"] = ref_logps
    return series


def _float32_list(values: np.ndarray) -> list[float]:
    """float32 values as the shortest decimals that read back to the same float32 (`str(np.float32)`: ~10 bytes
    a value in JSON instead of the ~19 of the float64 repr)."""
    return [float(str(v)) for v in np.asarray(values, np.float32)]


def rollout_records(
    step: int,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    reward_names: Sequence[str],
    rewards_per_func: np.ndarray,
    rewards: np.ndarray,
    advantages: np.ndarray,
    lengths: np.ndarray,
    truncated: np.ndarray,
    extra: dict[str, Sequence[Any]] | None = None,
    tokens: TokenRecords | None = None,
    conversations: Sequence[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """One `rollouts.jsonl` object per completion (NaN rewards become null); `extra`: columns the reward functions
    logged with TRL's log_extra (one value per completion), under "extra" when there are any.

    `conversations` (multi-turn rollouts, `rloo_jax.conversations.conversation_record`): each completion's `turns`,
    `tool_calls` (name, arguments, result, failed, error, seconds) and `tool_mask`; its `completion` is then the list
    of messages (assistant turns and tool messages), `length` the model's tokens and `completion_ids` every token.

    `tokens`: adds `completion_ids` (the sampled ids up to and including the first EOS: `length` of them) and
    `logprobs` ({"sampler": [...], "trainer": [...], "reference": [...]}, each `length` values; null for a
    completion the loss masked whole). A record grows by 2 bytes plus the id's digits per token for the ids and
    ~12 bytes per token per log-prob series: measured on the demo (8-token completions, sampler and reference
    series), 177 -> 438 bytes a record; a 256-token completion of a 150k vocabulary with three series, ~11 KB.
    """
    records = [
        {
            "step": step,
            "prompt": prompts[i],
            "completion": completions[i],
            "rewards": {name: float(rewards_per_func[i, f]) for f, name in enumerate(reward_names)},
            "reward": float(rewards[i]),
            "advantage": float(advantages[i]),
            "length": int(lengths[i]),
            "truncated": bool(truncated[i]),
        }
        for i in range(len(completions))
    ]
    for i, record in enumerate(records if extra else []):
        record["extra"] = {column: values[i] if i < len(values) else None for column, values in extra.items()}
    for i, record in enumerate(records if conversations is not None else []):
        record.update(conversations[i])  # turns, tool_calls (each with its result), the token count, the tool mask
    for i, record in enumerate(records if tokens is not None else []):
        n = int(lengths[i]) if conversations is None else int(conversations[i]["tokens"])
        record["completion_ids"] = [int(t) for t in tokens.completion_ids[i, :n]]
        masked = not tokens.mask[i, :n].any()
        record["logprobs"] = None if masked and n else {
            name: _float32_list(values[i, :n]) for name, values in tokens.logps.items()}
    return records


def weighted_rewards(rewards_per_func: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """Host copy of `combine_rewards`: NaN-ignoring weighted sum per row; NaN when every entry is NaN."""
    r = np.asarray(rewards_per_func, np.float64)
    total = np.nansum(r * np.asarray(weights, np.float64), axis=1)
    return np.where(np.isnan(r).all(axis=1), np.nan, total).astype(np.float32)


def console_line(step: int, total: int, metrics: dict[str, float]) -> str:
    """A compact one-line summary of a logged step."""

    def get(key: str) -> float:
        return metrics.get(key, float("nan"))

    kl = f" | kl {get('kl'):.4f}" if math.isfinite(get("kl")) else ""  # no KL when beta == 0
    phases = ("sample", "reference", "reward", "update")
    timing = "" if "timing/sample" not in metrics else " (" + ", ".join(
        f"{p[:3] if p == 'reference' else p} {get(f'timing/{p}'):.2f}" for p in phases) + ")"
    if "objective/scores" in metrics:  # PPO (TRL 1.12's names)
        return (
            f"step {step}/{total} | score {get('objective/scores'):.3f} | rlhf_reward "
            f"{get('objective/rlhf_reward'):.3f} | kl {get('objective/kl'):.4f} | value loss "
            f"{get('loss/value_avg'):.4f} | len {get('completions/mean_length'):.1f} | lr {get('lr'):.2e} | "
            f"{get('step_time'):.2f} s/step{timing}"
        )
    return (
        f"step {step}/{total} | reward {get('reward'):.3f} ± {get('reward_std'):.3f}{kl} | "
        f"entropy {get('entropy'):.3f} | len {get('completions/mean_length'):.1f} | "
        f"lr {get('learning_rate'):.2e} | {get('step_time'):.2f} s/step{timing}"
    )
