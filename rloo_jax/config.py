"""The run configuration every algorithm shares, and how any algorithm's configuration is read.

`TrainConfig` is composed of small option groups (`rloo_jax.options`: `ModelOptions`, `MemoryOptions`, `PeftOptions`,
`RewardOptions`, `DataOptions`, `GenerationOptions`, `OptimizationOptions`, `LoggingOptions`, `DistributedOptions`), one
flat set of TRL's names, as MaxText composes its config. Each group holds its fields (with their `--help` text), what is
derived from them, and its own `_check`; `validate()` (run by `__post_init__`) coerces every value, runs each group's
check, then the checks that span groups, and fails with one `ConfigError` naming the option and the fix. An algorithm's
config (`rloo_jax.algorithms.rloo_config`, ...) adds its own group to this base and says what differs: its name, its TRL
option table, which models it holds, its step options, its demo.

Reading, for a given config class: `from_dict` (YAML / JSON values), `parse_argv` (`--name value`), `read_yaml`, the
Python keywords of a class decorated with `takes_trl_options`; values are parsed from the annotations (`coerce`) and
TRL's own option names are decided by the class's table (`rloo_jax.trl_options`). Which class a command line names
is the command line's business (`rloo_jax.cli`).
"""

import dataclasses
import difflib
import fractions
import functools
import json
import logging
import math
import os
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import InitVar, dataclass
from typing import Any, ClassVar, Literal

import yaml

from rloo_jax import outputs
from rloo_jax.data import FILE_BUILDERS
from rloo_jax.errors import ConfigError
from rloo_jax.options import (
    DataOptions,
    DistributedOptions,
    GenerationOptions,
    LoggingOptions,
    MemoryOptions,
    ModelOptions,
    OptimizationOptions,
    PeftOptions,
    RewardOptions,
    _check,
    _require,
    resolve_interval,
)
from rloo_jax.trl_options import Decision, is_trl_only, split_options

logger = logging.getLogger("rloo_jax")

# ------------------------------------------------------------------------------------------------ the base config
@dataclass
class TrainConfig(DistributedOptions, LoggingOptions, OptimizationOptions, GenerationOptions, DataOptions,
                  RewardOptions, PeftOptions, MemoryOptions, ModelOptions):
    """What every run needs, whatever the algorithm: the option groups above, in that order (dataclasses collect
    the bases' fields from the last base to the first). An algorithm's config subclasses it with its own group and
    sets the class attributes and hooks below; TRL's names and defaults (bf16 is off by default on CPU). Derived
    values are properties, never stored."""

    ALGORITHM: ClassVar[str] = ""
    """The algorithm's name on the command line (`python -m rloo_jax.train grpo`) and in config.yaml."""
    TRL_RELEASE: ClassVar[str] = "1.16"
    """The TRL release whose trainer this config follows (names, defaults, math)."""
    TRL_OPTIONS: ClassVar[dict[str, Decision]] = {}
    """Every option of TRL's config and script for this algorithm that is not a field here, decided
    (`rloo_jax.trl_options`); the fields' own entries mark them supported."""
    TRL_SOURCES: ClassVar[tuple[str, ...]] = ()
    """TRL's dataclasses whose fields `TRL_OPTIONS` decides (a test walks them)."""
    ALIASES: ClassVar[dict[str, tuple[str, str]]] = {}
    """Other names of fields (older TRL releases', TRL GRPO's vLLM ones): name -> (field, what the name is, for the
    note printed when it is used)."""
    NOT_OPTIONS: ClassVar[dict[str, tuple[Any, str]]] = {}
    """Options of the other algorithms this one has no use for: name -> (the value that asks for nothing, what to
    use instead). That value is dropped (a config.yaml written before the field moved still loads); another is
    refused naming the replacement."""
    MIN_GENERATIONS: ClassVar[int] = 2
    """The fewest completions per prompt the algorithm takes (2: a baseline within each group; PPO: 1)."""
    STEPS_SPAN_GENERATIONS: ClassVar[bool] = True
    """Whether an optimizer step may span two generation batches (TRL's Trainer; not TRL 1.12's PPO)."""
    DEMO: ClassVar[dict[str, Any]] = {}
    """The built-in demo run of this algorithm (`python -m rloo_jax.train <algorithm>` with no model): the options
    over the demo task (`rloo_jax.demo`)."""

    # Facts of the machine, not options: devices of all processes and the number of processes. The trainer
    # passes jax.device_count() / jax.process_count() (after starting the multi-process runtime); the batch
    # sizes and the mesh are validated against them. Kept by `replace`, never written to YAML.
    device_count: InitVar[int] = 1
    process_count: InitVar[int] = 1

    def __post_init__(self, device_count: int, process_count: int) -> None:
        if not (isinstance(device_count, int) and isinstance(process_count, int)) or not (
            1 <= process_count <= device_count
        ):
            raise ConfigError(
                f"device_count ({device_count!r}) and process_count ({process_count!r}) must be integers with "
                "1 <= process_count <= device_count"
            )
        self.device_count = device_count
        self.process_count = process_count
        self.validate()

    # ----------------------------------------------------------------------------------------- validation
    def validate(self) -> None:
        """Check every invariant once: every value coerced to its annotation and finite, each group's `_check`
        (the base groups, then the algorithm's), then the batch arithmetic that spans groups (`_check_batches`);
        raise one `ConfigError` naming the option and the fix."""
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            setattr(self, f.name, coerce(getattr(self, f.name), hints[f.name], f.name))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, float):
                _check(math.isfinite(value), f.name, "must be a finite number", value)
        for cls in reversed(type(self).__mro__):
            own = vars(cls).get("_check")
            if own is not None:
                own(self)
        self._check_batches()

    def _check_batches(self) -> None:
        """The generation and evaluation batches hold whole prompt groups, split evenly over the processes."""
        if self.generation_batch_size % self.num_generations:
            shards, spg = self.data_shards, self.resolved_steps_per_generation
            step = self.num_generations // math.gcd(self.num_generations, shards * spg)
            if shards == 1:
                formula = (
                    f"per_device_train_batch_size * steps_per_generation = {self.per_device_train_batch_size} * {spg}"
                )
            else:
                data, fsdp, _ = self.mesh_shape
                formula = (
                    f"per_device_train_batch_size * data-parallel shards (data_parallel * fsdp = {data} * {fsdp}) * "
                    f"steps_per_generation = {self.per_device_train_batch_size} * {shards} * {spg}"
                )
            raise ConfigError(
                f"the generation batch {formula} = {self.generation_batch_size} completions must be divisible by "
                f"num_generations = {self.num_generations} (whole prompt groups); change "
                f"per_device_train_batch_size to a multiple of {step}"
            )
        if self.prompts_per_generation % self.process_count:
            raise ConfigError(
                f"the {self.prompts_per_generation} prompts of a generation batch cannot be split evenly over "
                f"{self.process_count} processes (each samples and rewards its own prompts); make "
                "per_device_train_batch_size * data_parallel * fsdp * steps_per_generation / num_generations a "
                f"multiple of {self.process_count}"
            )
        if not self.STEPS_SPAN_GENERATIONS and self.resolved_steps_per_generation % self.gradient_accumulation_steps:
            raise ConfigError(
                f"steps_per_generation ({self.resolved_steps_per_generation}) must be a multiple of "
                f"gradient_accumulation_steps ({self.gradient_accumulation_steps}): an optimizer step cannot "
                "span two generation batches"
            )
        g_eval = self.resolved_num_generations_eval
        if self.evaluates and self.eval_batch_size % g_eval:
            shards = "" if self.data_shards == 1 else f" x {self.data_shards} data-parallel shards"
            raise ConfigError(
                f"per_device_eval_batch_size ({self.per_device_eval_batch_size}){shards} must be divisible by the "
                f"evaluation num_generations ({g_eval}); change one of them"
            )
        if self.evaluates and (self.eval_batch_size // g_eval) % self.process_count:
            raise ConfigError(
                f"the {self.eval_batch_size // g_eval} prompts of an evaluation batch cannot be split evenly over "
                f"{self.process_count} processes; change per_device_eval_batch_size or num_generations_eval"
            )

    def require_sources(self, num_rewards: int | None = None) -> None:
        """What a run needs beyond valid options: a model, a dataset and at least one reward, with one weight per
        reward. `num_rewards`: the reward functions given some other way (the Python API); default: the ones
        the config names (`reward_sources`). The CLI checks this when it reads its config; the trainers once
        their arguments are in."""
        _require(
            self.policy_path,
            "model_name_or_path is required: pass --model_name_or_path "
            "PATH_OR_HUB_ID (or run with no arguments for the built-in demo)",
        )
        _require(
            self.dataset_name,
            "dataset_name is required: pass --dataset_name HUB_ID_OR_PATH (a local "
            ".jsonl with a `prompt` column works)",
        )
        count = len(self.reward_sources) if num_rewards is None else num_rewards
        if not count:
            raise ConfigError(
                "no reward: set --reward_funcs (functions `module:function` or built-in names) "
                "and/or --reward_model_name_or_path"
            )
        if self.reward_weights is not None and len(self.reward_weights) != count:
            names = f" ({', '.join(self.reward_sources)})" if num_rewards is None else ""
            raise ConfigError(
                f"Number of reward weights ({len(self.reward_weights)}) must match number of reward functions "
                f"({count}{names}); give --reward_weights one weight per function, in that order"
            )

    # ----------------------------------------------------------------------------------------- the batches
    @property
    def resolved_steps_per_generation(self) -> int:
        """Micro-batches a generation batch is cut into (TRL's default: gradient_accumulation_steps)."""
        return self.gradient_accumulation_steps

    @property
    def resolved_num_iterations(self) -> int:
        """Optimisation passes over each generation batch."""
        return 1

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation, all devices together (B*G): per-device batch x data shards x steps."""
        return self.per_device_train_batch_size * self.data_shards * self.resolved_steps_per_generation

    @property
    def eval_batch_size(self) -> int:
        """Completions per evaluation batch, all devices together: per_device_eval_batch_size x data shards."""
        return self.per_device_eval_batch_size * self.data_shards

    @property
    def prompts_per_generation(self) -> int:
        """Prompts per generation (B)."""
        return self.generation_batch_size // self.num_generations

    @property
    def micro_per_generation(self) -> int:
        """Micro-batch calls per generation batch (TRL's generate_every): steps_per_generation x num_iterations."""
        return self.resolved_steps_per_generation * self.resolved_num_iterations

    @property
    def on_policy(self) -> bool:
        """Every micro-batch's forward runs at the parameters it was sampled with (TRL's rule:
        gradient_accumulation_steps a multiple of steps_per_generation x num_iterations)."""
        return self.gradient_accumulation_steps % self.micro_per_generation == 0

    @property
    def steps_per_generation_batch(self) -> int:
        """What one generation batch advances the step counter (max_steps, save_steps, logging_steps, the learning
        rate schedule) by: its optimizer steps (TRL's Trainer), or 1 where a step is a generation batch (TRL 1.12's
        PPO counts updates). Where steps_per_generation x num_iterations is not a multiple of
        gradient_accumulation_steps a step may span two generation batches (`rloo_jax.step.UpdatePlan`): the
        whole steps a generation batch holds, at least 1 (what the timings are divided by)."""
        return max(1, self.micro_per_generation // self.gradient_accumulation_steps)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates that share one step's learning rate: 1, or where a step is a generation batch (TRL
        1.12's PPO steps its scheduler once per PPO update), the updates of a generation batch."""
        updates = max(1, self.micro_per_generation // self.gradient_accumulation_steps)
        return max(1, updates // self.steps_per_generation_batch)

    def total_steps(self, num_prompts: int) -> int:
        """Steps of the run: max_steps, else num_train_epochs passes over `num_prompts` prompts (the partial batch
        at an epoch's end dropped)."""
        if self.max_steps > 0:
            return self.max_steps
        batches = num_prompts // self.prompts_per_generation
        # the micro-batches of the run's generation batches, gradient_accumulation_steps per optimizer step
        return int(math.ceil(self.num_train_epochs * batches)) * self.micro_per_generation \
            // self.gradient_accumulation_steps

    def steps_per_epoch(self, num_prompts: int) -> fractions.Fraction:
        """Optimizer steps per pass over `num_prompts` prompts, as `total_steps` counts them: the epoch's generation
        batches (the partial one dropped) times their micro-batches, gradient_accumulation_steps per step. Not a
        whole number where the micro-batches of an epoch are not a multiple of gradient_accumulation_steps (a
        step then spans two epochs; epoch e ends in step ceil(e x this))."""
        batches = num_prompts // self.prompts_per_generation
        return fractions.Fraction(batches * self.micro_per_generation, self.gradient_accumulation_steps)

    def with_intervals(self, total_steps: int) -> "TrainConfig":
        """This config with logging_steps, save_steps and eval_steps given as ratios of the run's steps (floats in
        (0, 1)) resolved into steps over `total_steps`, as transformers' `TrainerState.compute_steps`
        (`math.ceil(max_steps * ratio)`): what the loop, the checkpoints and config.yaml then read. E.g.
        logging_steps 0.1 over 25 steps -> 3."""
        names = ("logging_steps", "save_steps", "eval_steps")
        changes = {n: resolve_interval(getattr(self, n), total_steps) for n in names
                   if isinstance(getattr(self, n), float)}
        if not changes:
            return self
        return self.replace(**changes, device_count=self.device_count, process_count=self.process_count)

    # ----------------------------------------------------------------------------------------- the algorithm's
    @property
    def uses_reference(self) -> bool:
        """Whether the run keeps a reference policy (RLOO / GRPO: beta > 0; PPO: always)."""
        return False

    @property
    def reference_copies_given_adapters(self) -> bool:
        """LoRA from given adapters (a PeftModel, a PEFT adapter folder): whether the reference is the base with a
        frozen copy of them (TRL 1.16's RLOO / GRPO: its "ref" adapter) rather than the base with the adapters off
        (TRL 1.12's PPO: `disable_adapter()`)."""
        return True

    @property
    def reference_sync(self) -> tuple[int, float] | None:
        """(every how many steps, alpha) when the reference moves towards the policy (TR-DPO); None: never."""
        return None

    @property
    def uses_value_model(self) -> bool:
        """Whether the run trains a value model (PPO)."""
        return False

    def make_algorithm(self, tokenizer: Any = None) -> Any:
        """The algorithm value the step composes (`rloo_jax.algorithms`), from this config (`tokenizer`: the
        policy's, for algorithms that need its token ids)."""
        raise NotImplementedError(f"{type(self).__name__} names no algorithm; use an algorithm's config")

    def step_options(self) -> dict[str, Any]:
        """`rloo_jax.step.StepConfig` options the algorithm sets beyond the shared ones (none here)."""
        return {}

    def prepare_tokenizer(self, tokenizer: Any) -> None:
        """Make the loaded tokenizer what the algorithm needs (nothing here); ConfigError if it cannot."""

    def sampler_stop_ids(self, tokenizer: Any, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that end a completion: the tokenizer's EOS and generation_config.json's (`eos_ids`)."""
        return eos_ids

    def report_settings(self) -> dict[str, Any]:
        """The algorithm's own settings in a compile-only report (beside the shared ones)."""
        return {}

    def memory_tips(self) -> list[str]:
        """The algorithm's own options that bring a program's memory down (compile-only advice)."""
        return []

    # ----------------------------------------------------------------------------------------- reading, writing
    def __getattr__(self, name: str) -> Any:
        """TRL's options given to this config without a field here (see `_keep_trl_only`)."""
        kept = self.__dict__.get("_trl_options", {})
        if name in kept:
            return kept[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def replace(self, **changes: Any) -> "TrainConfig":
        """`dataclasses.replace` that keeps the TRL options this config holds without fields (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON-ready values (tuples become lists), the algorithm's name first."""
        values = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}
        return {"algorithm": self.ALGORITHM, **values}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


def takes_trl_options(cls: type[TrainConfig]) -> type[TrainConfig]:
    """A config class whose Python keywords also take TRL's option names (`RLOOConfig(use_vllm=False,
    push_to_hub=False, ...)`), decided by its `TRL_OPTIONS` as the YAML and the command line are, so a TRL script's
    config line runs here; a misspelt name gets the command line's "did you mean" error. Without device_count, the
    batch sizes and mesh are checked for the devices and processes JAX sees (with several processes, call
    `jax.distributed.initialize()` first)."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        if "device_count" not in kwargs:  # built in Python: checked for the devices JAX sees (TRL: its processes)
            import jax

            kwargs.update(device_count=jax.device_count(), process_count=jax.process_count())
        machine = {k: kwargs.pop(k) for k in ("device_count", "process_count")}
        kwargs = {canonical_name(k, f"{cls.__name__}(...)", cls): v for k, v in kwargs.items()}
        ours, checks = split_options(_drop_not_options(kwargs, cls), _hints(cls), cls.TRL_OPTIONS)
        init(self, *args, **ours, **machine)
        for check in checks:
            check(self)
        _keep_trl_only(self, kwargs)

    cls.__init__ = __init__
    return cls


def _keep_trl_only(cfg: TrainConfig, values: dict[str, Any]) -> None:
    """The TRL options `cfg` took that are no field of it (accepted without effect, translated, or refused at their
    off value) stay readable as attributes, as on TRL's config (`cfg.push_to_hub`, `cfg.use_vllm`)."""
    table = type(cfg).TRL_OPTIONS
    kept = {k: v for k, v in values.items() if k in table and k not in {f.name for f in dataclasses.fields(cfg)}}
    object.__setattr__(cfg, "_trl_options", {**getattr(cfg, "_trl_options", {}), **kept})


def _drop_not_options(values: dict[str, Any], cls: type[TrainConfig]) -> dict[str, Any]:
    """`values` without the other algorithms' options `cls` has no use for (`NOT_OPTIONS`) at the value that asks for
    nothing; ConfigError naming the replacement for any other value."""
    out = {}
    for name, value in values.items():
        if name not in cls.NOT_OPTIONS:
            out[name] = value
            continue
        off, instead = cls.NOT_OPTIONS[name]
        parsed = coerce(value, type(off) if off is not None else str | None, name) if value is not None else None
        if parsed != off:
            raise ConfigError(f"{name} is not a {cls.ALGORITHM.upper()} option ({instead}); drop --{name}")
    return out


def replace(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    """`dataclasses.replace` that keeps the TRL options `cfg` holds without fields (`_keep_trl_only`); `changes`
    may set them too."""
    new = dataclasses.replace(cfg, **changes)
    object.__setattr__(new, "_trl_options", {**getattr(cfg, "_trl_options", {}), **getattr(new, "_trl_options", {})})
    return new


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type[TrainConfig]) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


# ---------------------------------------------------------------------------------------------- value parsing
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}
_NONE = {"none", "null", "~"}


def coerce(value: Any, annotation: Any, name: str) -> Any:
    """Parse `value` (a command-line string or a YAML scalar/list/dict) into `annotation`'s type.

    bool accepts true/false/1/0/yes/no; lists and tuples accept comma-separated strings; `None`/`null` gives
    None for optional fields; dicts accept YAML/JSON text.
    """
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            if len(non_none) < len(args):
                return None
            raise ConfigError(f"{name} cannot be None")
        if isinstance(value, dict) and dict in non_none:  # `str | dict`: a mapping is the mapping
            return coerce(value, dict, name)
        if non_none[:2] == [int, float]:  # `int | float` (transformers' steps or ratio): an int when whole
            number = coerce(value, float, name)
            return int(number) if number.is_integer() else number
        return coerce(value, non_none[0], name)
    if origin is Literal:
        text = str(value)
        if text not in args:
            near = difflib.get_close_matches(text, [str(a) for a in args], n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"{name}: {text!r} is not one of {', '.join(map(str, args))}{hint}")
        return text
    if origin in (list, tuple):
        items = _split_list(value, name)
        if origin is tuple:
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(coerce(v, args[0], name) for v in items)
            if len(items) != len(args):
                raise ConfigError(f"{name} needs {len(args)} comma-separated values (got {value!r})")
            return tuple(coerce(v, a, name) for v, a in zip(items, args, strict=True))
        return [coerce(v, args[0] if args else str, name) for v in items]
    if annotation is dict or origin is dict:
        if isinstance(value, str):
            try:
                value = yaml.safe_load(value) if value.strip() else {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{name}: cannot parse {value!r} as a YAML/JSON mapping ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a mapping like `{{key: value}}` (got {value!r})")
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ConfigError(f"{name} must be true/false/1/0 (got {value!r})")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be an integer (got {value!r})")
        try:
            number = float(value) if isinstance(value, str) else value
            if isinstance(number, float) and not number.is_integer():
                raise ValueError
            return int(number)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be an integer (got {value!r})") from None
    if annotation is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name} must be a number (got {value!r})")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number (got {value!r})") from None
    if annotation is str:
        if isinstance(value, list | dict):
            raise ConfigError(f"{name} must be a single value (got {value!r})")
        return str(value)
    raise TypeError(f"unsupported annotation {annotation!r} for {name}")


def _split_list(value: Any, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith(("[", "(")) and text.endswith(("]", ")")):
            text = text[1:-1]
        return [v.strip() for v in text.split(",") if v.strip()]
    return [value]



# ------------------------------------------------------------------------------------------------ sources
def field_names(cls: type[TrainConfig]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _configs() -> list[type[TrainConfig]]:
    """Every algorithm's config class defined so far (subclasses of TrainConfig with a name)."""
    found, todo = [], [TrainConfig]
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if cls.ALGORITHM:
            found.append(cls)
    return found


def canonical_name(name: str, source: str, cls: type[TrainConfig]) -> str:
    """Map an option name (or an older name of one, `cls.ALIASES`) to a field name of `cls`, a TRL option its table
    decides or another algorithm's option it drops (`NOT_OPTIONS`), or fail suggesting the nearest one."""
    name = name.replace("-", "_")
    table, fields = cls.TRL_OPTIONS, field_names(cls)
    if name in fields or name in table or name in cls.NOT_OPTIONS:  # ours, or one of TRL's (decided in its table)
        return name
    if name in cls.ALIASES:
        new, what = cls.ALIASES[name]
        logger.warning("note: `%s` is %s; using %s", name, what, new)
        return new
    near = difflib.get_close_matches(name, fields + list(cls.ALIASES), n=1, cutoff=0.6)
    hint = f"; did you mean --{near[0]}?" if near else "; see --help for the list"
    other = [c.__name__ for c in _configs() if c is not cls and name in field_names(c)]
    if other:
        hint = f" ({name} is an option of {other[0]}, not of {cls.__name__}){hint}"
    raise ConfigError(f"unknown option {name!r} in {source}{hint}")


def load_yaml(path: str) -> dict[str, Any]:
    """A YAML config file (safe loader) as a mapping; ConfigError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must be a mapping of option: value (got {type(data).__name__})")
    return data


def read_yaml(path: str, cls: type[TrainConfig]) -> dict[str, Any]:
    """Read a YAML config file (safe loader) into {field_name: raw value} (its `algorithm` key aside)."""
    data = load_yaml(path)
    return {canonical_name(str(k), path, cls): v for k, v in data.items() if k != "algorithm"}


def parse_argv(argv: Sequence[str], cls: type[TrainConfig]) -> tuple[str | None, dict[str, Any]]:
    """Split argv (without the algorithm word) into (the --config path, {field_name: raw string value}).

    Accepts `--name value` and `--name=value`; a bare boolean `--flag` means true.
    """
    config_path, overrides, i = None, {}, 0
    hints, table = _hints(cls), cls.TRL_OPTIONS
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}; options look like --name value or --name=value (the "
                              f"algorithm, one of {', '.join(c.ALGORITHM for c in _configs())}, comes first)")
        key, has_eq, value = arg[2:].partition("=")
        if not has_eq:
            name = key.replace("-", "_")
            if name not in hints and name not in table:
                name = cls.ALIASES.get(name, (name,))[0]
            takes_flag = hints.get(name) in (bool, bool | None) or is_trl_only(name, table)  # `--bf16` alone: true
            if i + 1 < len(argv) and not (takes_flag and argv[i + 1].startswith("--")):
                value, i = argv[i + 1], i + 1
            elif takes_flag:
                value = "true"
            else:
                raise ConfigError(f"option --{key} needs a value")
        i += 1
        if key == "config":
            config_path = value
        else:
            overrides[canonical_name(key, "the command line", cls)] = value
    return config_path, overrides


def from_dict(values: dict[str, Any], cls: type[TrainConfig], device_count: int = 1, process_count: int = 1
              ) -> TrainConfig:
    """A validated `cls` from {name: raw value} (its `algorithm` key aside): TRL's options decided by its table,
    values coerced to the annotated types, the sources a run needs checked (`require_sources`)."""
    values = {k: v for k, v in values.items() if k != "algorithm"}
    hints = _hints(cls)
    parsed = {canonical_name(k, "the config", cls): v for k, v in values.items()}
    parsed = _drop_not_options(parsed, cls)
    parsed, checks = split_options(parsed, hints, cls.TRL_OPTIONS)  # TRL's: refused, dropped with a note, translated
    parsed = {k: coerce(v, hints[k], k) for k, v in parsed.items()}
    trl_only = {k: v for k, v in values.items() if k in cls.TRL_OPTIONS and k not in hints}
    cfg = cls(**parsed, device_count=device_count, process_count=process_count)
    for check in checks:
        check(cfg)
    _keep_trl_only(cfg, trl_only)
    cfg.require_sources()
    return cfg


_BASE_GROUPS = ("model", "memory", "peft", "rewards", "data", "generation", "algorithm", "optimization", "logging",
                "distributed")


def format_help(cls: type[TrainConfig]) -> str:
    """`--help` text: usage, then every option of `cls` grouped (an algorithm's own sections after `algorithm`),
    with its type, default and help text."""
    name, release = cls.ALGORITHM.upper(), cls.TRL_RELEASE
    aliases = f"Other names are accepted: {', '.join(f'{k} -> {v}' for k, (v, _) in cls.ALIASES.items())} " \
        "(older TRL releases', TRL GRPO's vllm_importance_sampling_*). " if cls.ALIASES else ""
    lines = [
        f"usage: python -m rloo_jax.train [{'|'.join(c.ALGORITHM for c in _configs())}] [--config FILE.yaml] "
        "[--name value | --name=value ...]",
        "",
        f"Train a causal LM with {name} (TRL {release}'s {name} trainer math) in JAX; the first word picks the "
        "algorithm "
        "(rloo by default, or the config file's `algorithm:`), e.g. `python -m rloo_jax.train grpo --help`. Options "
        "are read from the YAML file first, then from the command line. With neither --config nor "
        "--model_name_or_path, the built-in demo (configs/default.yaml: a tiny model on a synthetic task, no "
        "network) runs.",
        f"{aliases}Every other option of TRL {release}'s {cls.__name__} and `trl {cls.ALGORITHM}` script is read "
        "without effect (named in a note) or refused with the reason (docs/trl_options.md).",
    ]
    hints = _hints(cls)
    after = _BASE_GROUPS.index("algorithm") + 0.5  # the algorithm's own sections

    def order(f: dataclasses.Field) -> float:
        group = f.metadata["group"]
        return _BASE_GROUPS.index(group) if group in _BASE_GROUPS else after

    group = None
    for f in sorted(dataclasses.fields(cls), key=order):
        if f.metadata["group"] != group:
            group = f.metadata["group"]
            lines += ["", f"{group}:"]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        lines.append(f"  --{f.name} {_type_name(hints[f.name])}  (default: {json.dumps(default)})")
        lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.upper() if "[" not in text else text


# ------------------------------------------------------------------------------------------------ local paths
PATH_OPTIONS = ("model_name_or_path", "reward_model_name_or_path", "dataset_name", "dataset_train_split",
                "dataset_test_split", "tfds_data_dir", "output_dir")


def absolute_paths(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict (`TrainConfig.to_dict()`, or a config.yaml's) with every local path it names absolute (~
    expanded), as config.yaml and checkpoints record them, so a resume or `python -m rloo_jax.export` from another
    folder finds them: model_name_or_path, reward_model_name_or_path, dataset_name, dataset_train_split /
    dataset_test_split when they are data files, tfds_data_dir and a local output_dir (`PATH_OPTIONS`). "demo", hub
    ids, `tfds:` names, URLs and paths that do not exist (the run fails on them first) stay as given.
    E.g. {"model_name_or_path": "./m"} run from /home/u -> {"model_name_or_path": "/home/u/m"}."""

    def absolute(name: Any, local: Callable[[str], bool] = outputs.is_local_path) -> Any:
        if not isinstance(name, str) or not name or name == "demo" or name.startswith("tfds:") or \
                outputs.is_remote(name) or not local(name):
            return name
        path = os.path.expanduser(name)
        return os.path.abspath(path) if os.path.exists(path) else name

    def data_file(name: str) -> bool:
        return os.path.splitext(name)[1] in FILE_BUILDERS

    out = dict(values)
    for key in ("model_name_or_path", "dataset_name"):
        out[key] = absolute(values.get(key))
    if isinstance(values.get("reward_model_name_or_path"), list):
        out["reward_model_name_or_path"] = [absolute(m) for m in values["reward_model_name_or_path"]]
    for key in ("dataset_train_split", "dataset_test_split"):
        out[key] = absolute(values.get(key), data_file)
    for key in ("tfds_data_dir", "output_dir"):
        out[key] = absolute(values.get(key), lambda _: True)
    return {k: v for k, v in out.items() if k in values}


def with_absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with its local paths absolute (`absolute_paths`)."""
    paths = absolute_paths(cfg.to_dict())
    return replace(cfg, **{k: paths[k] for k in PATH_OPTIONS if k in paths})

