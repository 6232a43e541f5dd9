"""Host-side rewards: Python reward functions, built-ins and reward models -> `rewards_per_func [N, F]`.

TRL 1.16's convention: `f(prompts=, completions=, completion_ids=, trainer_state=, log_extra=, log_metric=,
**columns) -> list[float | None]`, plain or `async def`, called with keyword arguments; `columns` are the
dataset's other columns, repeated per completion; `trainer_state`, `log_extra` and `log_metric` come from the
trainer (`rloo_jax.train`: the step counters, extra rollout columns, extra scalar metrics). Conversational
prompts get completions as `[{"role": "assistant", "content": text}]`. `None`, NaN and inf become NaN
("unscorable", see `rloo.combine_rewards`), with a warning once per function.
"""

import asyncio
import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import logging
import math
import os
import re
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rloo_jax.errors import ConfigError, RewardError

logger = logging.getLogger("rloo_jax")


@dataclasses.dataclass
class RewardFunction:
    """A reward callable with the name used in metrics (`rewards/<name>/mean`)."""

    name: str
    fn: Callable[..., Any]
    warned_unscorable: bool = False

    @property
    def is_async(self) -> bool:
        call = type(self.fn).__call__ if not inspect.isfunction(self.fn) else None
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(call)

    def digest(self) -> str | None:
        """A short hash of the function's source (an object's: its class's), recorded in each checkpoint so that a
        resume under an edited reward says so; None where Python has no source (a builtin, a C extension)."""
        target = self.fn if inspect.isfunction(self.fn) or inspect.ismethod(self.fn) else type(self.fn)
        try:
            source = inspect.getsource(target)
        except (OSError, TypeError):
            return None
        return hashlib.sha256(source.encode()).hexdigest()[:16]


@dataclasses.dataclass
class TrainerState:
    """transformers' `TrainerState`, field for field: what a reward function gets as `trainer_state`, what callbacks
    get as `state` and what `trainer.state` is (where training stands, e.g. for a weight ramped by
    `global_step / max_steps`; `log_history`). Kept here so the product never imports transformers' trainer
    modules (which import torch). Updated by the trainer before each generation's rewards and at each step end."""

    global_step: int = 0  # optimizer steps done
    max_steps: int = 0
    epoch: float = 0.0  # fractional epochs of the prompt set done
    num_train_epochs: float = 0.0
    logging_steps: int | float = 0  # the run's: ratios (floats in (0, 1)) resolved to steps once it starts
    eval_steps: int | float | None = None
    save_steps: int | float = 0
    train_batch_size: int = 0  # completions per device per micro-step (per_device_train_batch_size)
    is_world_process_zero: bool = True
    log_history: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # logged records, this process's run
    # transformers' other TrainerState fields, for callbacks that read them
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = dataclasses.field(default_factory=dict)


class RewardLogs:
    """TRL's `log_extra(column, values)` and `log_metric(name, value)` for reward functions: extra columns of the
    rollout records (one value per completion of this process) and scalar metrics (averaged per generation, then
    over the logging window, as TRL does). The trainer takes them after every generation's rewards."""

    def __init__(self) -> None:
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}

    def log_extra(self, column: str, values: Sequence[Any]) -> None:
        self.extra.setdefault(column, []).extend(values)

    def log_metric(self, name: str, value: float) -> None:
        self.metrics.setdefault(name, []).append(float(value))

    def context(self, state: TrainerState) -> dict[str, Any]:
        """The keyword arguments TRL passes every reward function besides the per-completion ones."""
        return {"trainer_state": state, "log_extra": self.log_extra, "log_metric": self.log_metric}

    def take(self) -> tuple[dict[str, list[Any]], dict[str, tuple[float, int]]]:
        """(extra columns, {metric: (sum, count)}) logged since the last call; clears them."""
        extra, metrics = self.extra, {k: (sum(v), len(v)) for k, v in self.metrics.items()}
        self.extra, self.metrics = {}, {}
        return extra, metrics


# ------------------------------------------------------------------------------------------------ resolving
def resolve_reward_funcs(
    sources: Sequence[str],
    builtins: dict[str, Callable[..., Any]] | None = None,
    load_reward_model: Callable[[str], Callable[..., Any]] | None = None,
) -> list[RewardFunction]:
    """Turn `reward_funcs` entries (then reward-model paths) into named callables, in order.

    An entry is a built-in name (a key of `builtins`), `module:function` / `path/to/file.py:function` (or TRL's
    dotted `package.module.function`), a reward model (a local folder or a hub id `org/name`), loaded with
    `load_reward_model(path)`, or already a callable (the Python API). Raises `ConfigError` naming the entry that
    cannot be resolved.
    """
    builtins = builtins or {}
    out: list[RewardFunction] = []
    for spec in sources:
        if callable(spec):
            fn, name = spec, callable_name(spec)
        elif spec in builtins:
            fn, name = builtins[spec], spec
        elif ":" in spec and not os.path.isdir(spec):
            fn = import_function(spec)
            name = getattr(fn, "__name__", None) or spec.rsplit(":", 1)[1]
        elif os.path.isdir(spec) or re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
            if load_reward_model is None:
                raise ConfigError(f"reward {spec!r} looks like a reward model, but no model loader was given")
            fn, name = load_reward_model(spec), spec.rstrip("/").split("/")[-1]
        elif re.fullmatch(r"[A-Za-z_][\w.]*\.[A-Za-z_]\w*", spec):  # TRL's `package.module.function`
            module, attr = spec.rsplit(".", 1)
            fn, name = import_function(f"{module}:{attr}"), attr
        else:
            known = ", ".join(sorted(builtins)) or "none"
            raise ConfigError(
                f"reward function {spec!r} is not a built-in ({known}), not `module:function`, and "
                "not a reward-model folder; fix --reward_funcs"
            )
        out.append(RewardFunction(name, fn))
    seen: dict[str, int] = {}
    for r in out:  # unique metric names: a second `foo` becomes `foo_2`
        seen[r.name] = seen.get(r.name, 0) + 1
        if seen[r.name] > 1:
            r.name = f"{r.name}_{seen[r.name]}"
    return out


def callable_name(fn: Any) -> str:
    """A reward callable's metric name, as TRL's `get_callable_name`: the function's name, a partial's function,
    or the class name of a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def warn_missing_extras(funcs: Sequence[RewardFunction]) -> None:
    """The `accuracy` reward without math-verify compares answers by their last \\boxed{}, #### or number: say
    so once, at the start, with the command that installs it."""
    if any(f.fn is accuracy_reward for f in funcs) and importlib.util.find_spec("math_verify") is None:
        logger.warning(
            "note: math-verify is not installed, so the accuracy reward compares the last \\boxed{}, #### or number "
            "of each answer as text or numbers (no symbolic equivalence): pip install 'rloo_jax[math]'"
        )


def import_function(spec: str) -> Callable[..., Any]:
    """`package.module:function` or `path/to/file.py:function` -> the function (ConfigError if missing)."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ConfigError(f"reward function {spec!r}: no such file {module_name}")
            mod_spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - ImportError, SyntaxError, errors at import time
        raise ConfigError(
            f"reward function {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e})"
        ) from e
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ConfigError(f"reward function {spec!r}: module {module_name!r} has no callable {attr!r}")
    return fn


# ------------------------------------------------------------------------------------------------ scoring
def repeat_per_generation(values: Sequence[Any], num_generations: int) -> list[Any]:
    """[a, b] with G=2 -> [a, a, b, b] (rows are prompt-major)."""
    return [v for v in values for _ in range(num_generations)]


def compute_rewards(
    funcs: Sequence[RewardFunction],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: dict[str, Sequence[Any]],
    context: dict[str, Any] | None = None,
) -> np.ndarray:
    """Call every reward function on N completions -> `[N, F]` float32, NaN where unscorable.

    `prompts`, `completion_ids` and each column have one entry per completion; `context` holds the keyword
    arguments that are not per completion (TRL's `trainer_state`, `log_extra`, `log_metric`). Async functions
    run concurrently. A function that raises or returns the wrong number of values stops the run with a
    `RewardError` naming it (and, for an exception, the first sample that fails on its own).
    """
    n = len(completions)
    rows = {
        "prompts": list(prompts),
        "completions": list(completions),
        "completion_ids": [list(c) for c in completion_ids],
        **{k: list(v) for k, v in columns.items() if k not in ("prompt", "completion", "completion_ids")},
    }
    kwargs = {**rows, **(context or {})}
    out = np.zeros((n, len(funcs)), np.float32)
    pending: list[tuple[int, RewardFunction]] = []
    for i, func in enumerate(funcs):
        if func.is_async:
            pending.append((i, func))
        else:
            out[:, i] = _to_rewards(func, _call(func, kwargs), n)
    if pending:

        async def gather() -> list[Any]:
            return await asyncio.gather(*(_acall(f, kwargs) for _, f in pending))

        for (i, func), values in zip(pending, asyncio.run(gather()), strict=True):
            out[:, i] = _to_rewards(func, values, n)
    unscorable = np.isnan(out).all(axis=1)
    if funcs and unscorable.any():  # TRL's warning, with its wording (code matching on it keeps working)
        row = int(np.argmax(unscorable))
        shown = {k: v[row] for k, v in rows.items() if k not in ("completion_ids",)}
        logger.warning("All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at "
                       "least one reward function returns a valid reward.", shown)
    return out


def _call(func: RewardFunction, kwargs: dict[str, Any]) -> Any:
    try:
        return func.fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - user code
        raise _failure(func, kwargs, e) from e


async def _acall(func: RewardFunction, kwargs: dict[str, Any]) -> Any:
    try:
        return await func.fn(**kwargs)
    except Exception as e:  # noqa: BLE001 - user code
        raise _failure(func, kwargs, e) from e


def _failure(func: RewardFunction, kwargs: dict[str, Any], error: Exception) -> RewardError:
    """A `RewardError` naming the function, the first sample that fails alone, and the user traceback."""
    first = None
    if not func.is_async:
        n = len(kwargs["completions"])
        for j in range(n):
            try:  # per-completion arguments sliced to sample j; the context (trainer_state, ...) as it is
                func.fn(**{k: v[j : j + 1] if isinstance(v, list) and len(v) == n else v for k, v in kwargs.items()})
            except Exception:  # noqa: BLE001
                first = j
                break
    where = (
        ""
        if first is None
        else f" on sample {first} (prompt {_short(kwargs['prompts'][first])}, "
        f"completion {_short(kwargs['completions'][first])})"
    )
    err = RewardError(f"reward function {func.name!r} raised {type(error).__name__}: {error}{where}")
    err.user_traceback = "".join(traceback.format_exception(error))
    return err


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _to_rewards(func: RewardFunction, values: Any, n: int) -> np.ndarray:
    """A function's output -> float32 [n]; None/NaN/inf -> NaN (warned once per function)."""
    try:
        values = list(values)
    except TypeError:
        raise RewardError(
            f"reward function {func.name!r} returned {type(values).__name__}; it must return a "
            f"list of {n} floats (or None), one per completion"
        ) from None
    if len(values) != n:
        raise RewardError(
            f"reward function {func.name!r} returned {len(values)} rewards, but {n} were expected "
            "(one per prompt-completion pair)"
        )
    out = np.empty(n, np.float32)
    for j, v in enumerate(values):
        try:
            out[j] = np.nan if v is None else float(v)
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {func.name!r} returned {v!r} for sample {j}; rewards must be "
                "numbers or None"
            ) from None
    bad = ~np.isfinite(out)
    if bad.any():
        out[bad] = np.nan
        if not func.warned_unscorable:
            func.warned_unscorable = True
            logger.warning(
                "reward function %r returned None/NaN/inf for %d of %d completions; they count as "
                "unscorable (NaN): left out of the weighted sum (warned once)",
                func.name,
                int(bad.sum()),
                n,
            )
    return out


# ------------------------------------------------------------------------------------------------ built-ins
def completion_text(completion: Any) -> str:
    """Text of a completion: a string, or TRL's conversational `[{"role": "assistant", "content": ...}]`."""
    if isinstance(completion, str):
        return completion
    return completion[0]["content"] if completion else ""


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str) -> str | None:
    """The final answer of a solution text: the last `\\boxed{...}`, else what follows the last `####`
    (GSM8K), else the last number; None when there is none.

    "so \\boxed{\\frac{1}{2}}" -> "\\frac{1}{2}"; "... #### 1,234" -> "1,234"; "it is 7 or 8." -> "8".
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip() or None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def normalize_answer(answer: str) -> str:
    """Canonical form for comparison: numbers as a float string ("1,000.50" -> "1000.5"), else lowercased
    with spaces, `$` and a trailing period removed."""
    text = answer.strip().replace("$", "").replace(" ", "").rstrip(".").lower()
    text = re.sub(r"^\\text\{(.*)\}$", r"\1", text)
    number = text.replace(",", "")
    try:
        value = float(number)
    except ValueError:
        return text
    return repr(value) if math.isfinite(value) else text


def accuracy_reward(
    completions: list[Any], answer: list[str] | None = None, solution: list[str] | None = None, **kwargs: Any
) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference, else 0.0; None when the reference has no
    answer. The reference is the `answer` (GSM8K: "... #### 42") or `solution` column. Uses `math_verify`
    when installed (as TRL's `accuracy_reward`), else `extract_answer` + `normalize_answer`.
    """
    gold = answer if answer is not None else solution
    if gold is None:
        raise ValueError("the accuracy reward needs an `answer` or `solution` column in the dataset")
    try:
        import math_verify
    except ImportError:
        math_verify = None
    rewards: list[float | None] = []
    for completion, ref in zip(completions, gold, strict=True):
        text = completion_text(completion)
        if math_verify is not None:
            gold_parsed = math_verify.parse(str(ref))
            if not gold_parsed:
                rewards.append(None)
                continue
            rewards.append(float(math_verify.verify(gold_parsed, math_verify.parse(text))))
            continue
        ref_answer = extract_answer(str(ref))
        if ref_answer is None:
            rewards.append(None)
            continue
        pred = extract_answer(text)
        rewards.append(float(pred is not None and normalize_answer(pred) == normalize_answer(ref_answer)))
    return rewards


def make_format_reward(pattern: str) -> Callable[..., list[float]]:
    """1.0 when `re.match(pattern, text, DOTALL | MULTILINE)` succeeds (TRL's think_format_reward with its
    default pattern), else 0.0."""
    regex = re.compile(pattern, re.DOTALL | re.MULTILINE)

    def format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
        return [1.0 if regex.match(completion_text(c)) else 0.0 for c in completions]

    return format_reward


def make_soft_overlong_reward(max_completion_length: int, cache: int) -> Callable[..., list[float]]:
    """DAPO soft overlong punishment (TRL `get_soft_overlong_punishment`), with L = len(completion_ids):
    0 if L <= Lmax - Lcache; (Lmax - Lcache - L) / Lcache if L <= Lmax; else -1.
    E.g. Lmax 10, Lcache 4: L = 6 -> 0, L = 8 -> -0.5, L = 10 -> -1."""

    def soft_overlong_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= max_completion_length - cache:
                out.append(0.0)
            elif n <= max_completion_length:
                out.append((max_completion_length - cache - n) / cache)
            else:
                out.append(-1.0)
        return out

    return soft_overlong_reward


def builtin_rewards(
    format_pattern: str, max_completion_length: int, soft_overlong_cache: int
) -> dict[str, Callable[..., Any]]:
    """The built-in reward functions by name, also under TRL's names (`trl rloo --reward_funcs`); TRL's script fixes
    get_soft_overlong_punishment at 1280 / 256 tokens, here it reads max_completion_length / soft_overlong_cache."""
    found = {
        "accuracy": accuracy_reward,
        "format": make_format_reward(format_pattern),
        "soft_overlong": make_soft_overlong_reward(max_completion_length, soft_overlong_cache),
    }
    trl_names = {"accuracy_reward": "accuracy", "think_format_reward": "format",
                 "get_soft_overlong_punishment": "soft_overlong"}
    return found | {trl: found[ours] for trl, ours in trl_names.items()}


# ------------------------------------------------------------------------------------------- reward models
def reward_model_texts(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    tokenizer: Any,
    chat_template_kwargs: dict | None = None,
) -> list[str]:
    """Texts a reward model scores, as TRL builds them: `prompt + completion`, or for conversational prompts
    the chat template over `prompt + completion` messages (no generation prompt)."""
    from rloo_jax.data import is_conversational

    if prompts and is_conversational(prompts[0]):
        return [
            tokenizer.apply_chat_template(list(p) + list(c), tokenize=False, **(chat_template_kwargs or {}))
            for p, c in zip(prompts, completions, strict=True)
        ]
    return [p + c for p, c in zip(prompts, completions, strict=True)]


def right_pad(
    token_lists: Sequence[Sequence[int]], pad_token_id: int, bucket: int, width: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to the longest row rounded up to a multiple of `bucket` (or to `width`, when given and wider)
    -> (ids, mask) int32 [N, T]."""
    width = max(padded_width(token_lists, bucket), width or 0)
    ids = np.full((len(token_lists), width), pad_token_id, np.int32)
    mask = np.zeros((len(token_lists), width), np.int32)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = tokens
        mask[i, : len(tokens)] = 1
    return ids, mask


def padded_width(token_lists: Sequence[Sequence[int]], bucket: int) -> int:
    """The longest row rounded up to a multiple of `bucket` (at least one bucket): lengths [3, 6], bucket 4 -> 8."""
    longest = max((len(t) for t in token_lists), default=1)
    return max(1, -(-longest // bucket)) * bucket


class RewardModelScorer:
    """A reward model as a reward function: re-tokenizes `prompt + completion` text with the reward model's
    own tokenizer (no special tokens added, as TRL), right-pads to a bucketed length (one compile per
    bucket) and runs `score_fn(ids [N, T], mask [N, T]) -> [N]` (a jitted model call)."""

    def __init__(
        self,
        score_fn: Callable[[Any, Any], Any],
        tokenizer: Any,
        bucket: int = 64,
        max_length: int | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> None:
        self.score_fn, self.tokenizer, self.bucket = score_fn, tokenizer, bucket
        self.max_length, self.chat_template_kwargs = max_length, chat_template_kwargs

    def __call__(self, prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
        texts = reward_model_texts(prompts, completions, self.tokenizer, self.chat_template_kwargs)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        if self.max_length is not None:
            ids = [t[-self.max_length :] for t in ids]  # keep the end: the last token is the one scored
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        width = padded_width(ids, self.bucket)
        if hasattr(self.score_fn, "common_width"):  # several processes score one global batch: one width for all
            width = self.score_fn.common_width(width)
        input_ids, mask = right_pad(ids, int(pad or 0), self.bucket, width)
        return np.asarray(self.score_fn(input_ids, mask), np.float32).tolist()


def load_reward_model_scorer(
    path: str, dtype: str = "float32", bucket: int = 64, chat_template_kwargs: dict | None = None,
    tokenizer: Any = None, attn_implementation: str | None = None,
) -> RewardModelScorer:
    """Load a reward model (into host memory) and its tokenizer (rloo_jax.models; `tokenizer` given: that one,
    right-padded, as TRL's reward_processing_classes; `attn_implementation` as the policy's) and wrap them as a
    reward function; its weights go to the devices at the first call, or sharded by `place_reward_models(funcs,
    mesh)`."""
    from rloo_jax.mesh import host_memory
    from rloo_jax.models import load_reward_model, load_tokenizer

    with host_memory():
        model = load_reward_model(path, dtype=dtype, attn_implementation=attn_implementation)
    if tokenizer is not None:
        tokenizer.padding_side = "right"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
    return RewardModelScorer(
        RewardModelCall(model),
        load_tokenizer(path, padding_side="right") if tokenizer is None else tokenizer,
        bucket=bucket,
        chat_template_kwargs=chat_template_kwargs,
    )


class RewardModelCall:
    """A reward model as `(ids [N, T], mask [N, T]) -> scores [N]` (numpy in and out), jitted on the default device,
    or after `place(mesh)` sharded like the policy: the rule table of `rloo_jax.mesh` (fsdp splits `embed`, tensor
    splits heads / mlp / vocab; rows over data x fsdp), so a reward model fits wherever a policy of its size does.
    Multi-process: each process passes its own rows (as many as every other process) and gets their scores back;
    every process must call it at the same point (a collective)."""

    def __init__(self, model: Any) -> None:
        from flax import nnx

        self.graphdef, self._params = nnx.split(model)  # host arrays until `place`
        self.mesh: Any = None
        self._placed: Any = None
        self._shardings: Any = None
        self._jits: dict[Any, Callable[..., Any]] = {}

    def place(self, mesh: Any = None) -> None:
        """Move the weights onto `mesh` by the rule table (None: the default device); the host copy is dropped."""
        import jax

        from rloo_jax.mesh import param_shardings, shard_params

        if self._placed is not None:
            raise RuntimeError("the reward model is already placed")
        self.mesh = mesh
        if mesh is None:
            self._placed = jax.device_put(self._params, jax.local_devices()[0])
        else:
            self._shardings = param_shardings(self._params, mesh)
            self._placed = shard_params(self._params, self._shardings)
        self._params = None

    def common_width(self, width: int) -> int:
        """The widest padded batch of all processes (they pad to one width: one global array)."""
        import jax

        if self.mesh is None or jax.process_count() == 1:
            return width
        from jax.experimental import multihost_utils

        return int(np.max(multihost_utils.process_allgather(np.int32(width))))

    def __call__(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        import jax

        if self._placed is None:
            self.place(None)
        if self.mesh is None:
            if None not in self._jits:
                self._jits[None] = reward_model_jit(self.graphdef)
            return np.asarray(self._jits[None](self._placed, ids, mask))
        from rloo_jax.mesh import batch_sharding, host_local_batch_to_global, local_rows

        shape = (ids.shape[0] * jax.process_count(), ids.shape[1])
        if shape not in self._jits:
            self._jits[shape] = reward_model_jit(self.graphdef, self.mesh, self._shardings, shape)
        rows = batch_sharding(self.mesh, shape)
        out = self._jits[shape](self._placed, host_local_batch_to_global(ids, self.mesh, rows),
                                host_local_batch_to_global(mask, self.mesh, rows))
        return local_rows(out)


def reward_model_jit(graphdef: Any, mesh: Any = None, shardings: Any = None,
                     shape: tuple[int, int] | None = None) -> Callable[..., Any]:
    """`jax.jit` of `(params, ids, mask) -> scores`: plain, or on `mesh` for global batches of `shape` [N, T] with
    the weights on `shardings` (`rloo_jax.mesh.param_shardings`), rows split over data x fsdp
    (`batch_sharding(mesh, shape)`) and the model's activation constraints in force. Compile-only lowers this same
    function (`rloo_jax.aot`)."""
    import jax
    from flax import nnx

    def forward(params: Any, ids: Any, mask: Any) -> Any:
        return nnx.merge(graphdef, params)(ids, mask)

    if mesh is None:
        return jax.jit(forward)
    from rloo_jax.mesh import batch_sharding

    def on_mesh(params: Any, ids: Any, mask: Any) -> Any:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return forward(params, ids, mask)

    rows = batch_sharding(mesh, shape)
    return jax.jit(on_mesh, in_shardings=(shardings, rows, rows), out_shardings=batch_sharding(mesh, shape[:1]))


def place_reward_models(funcs: Sequence[RewardFunction], mesh: Any) -> None:
    """Shard every reward model among `funcs` over `mesh` like the policy (None: one device)."""
    for func in funcs:
        scorer = func.fn
        if isinstance(scorer, RewardModelScorer) and isinstance(scorer.score_fn, RewardModelCall):
            scorer.score_fn.place(mesh)


def format_reward_error(error: RewardError) -> str:
    """The user's traceback (if any), then the one-line message."""
    tb = getattr(error, "user_traceback", "")
    return f"{tb}{error}" if tb else str(error)


def run_builtins(cfg: Any) -> dict[str, Callable[..., Any]]:
    """The built-in rewards as the run config (`cfg`: its reward options) sets them."""
    return builtin_rewards(cfg.format_reward_pattern, cfg.max_completion_length, cfg.resolved_soft_overlong_cache)


def check_reward_sources(cfg: Any, sources: list[Any]) -> None:
    """Resolve `sources` as the run will (`resolve_reward_funcs`: built-in names, functions imported), loading no
    reward model: an unknown name or a function that cannot be imported fails where the sources are given (a
    trainer's constructor, as TRL's), not once `train()` has loaded the policy."""
    builtins = run_builtins(cfg)
    resolve_reward_funcs(sources, builtins, lambda path: lambda **kwargs: None)


def reward_functions(cfg: Any, sources: list[Any], tokenizers: list[Any] | None, options: dict[str, Any],
                     abstract: bool) -> list[RewardFunction]:
    """The host's reward functions of `sources` (callables, names, reward model folders with their `tokenizers`), as
    the run config (`cfg`: its reward options) asks:
    `rloo_jax.rewards.resolve_reward_funcs`, reward models as scorers in the compute dtype (never called in
    compile-only mode: no weights are read)."""
    builtins = run_builtins(cfg)
    by_source = {s: t for s, t in zip(sources, tokenizers or [], strict=False) if isinstance(s, str) and t is not None}

    def scorer(path: str) -> Any:
        if abstract:
            return lambda **kwargs: None  # compiled, never called, in compile-only mode
        return load_reward_model_scorer(path, options["dtype"], cfg.prompt_bucket, cfg.chat_template_kwargs,
                                        tokenizer=by_source.get(path),
                                        attn_implementation=options["attn_implementation"])

    funcs = resolve_reward_funcs(sources, builtins, scorer)
    if not abstract:
        warn_missing_extras(funcs)
    return funcs
