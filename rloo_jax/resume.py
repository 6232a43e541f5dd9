"""Resuming with changed options: what the checkpoint was trained with against what the new invocation asks for.

`changes(saved, current, step, saved_total, total)` compares two run configs (`TrainConfig.to_dict()` with local
paths absolute, `rloo_jax.config.absolute_paths`) option by option with the rule table `RULES` and returns one
`Change` per changed option, saying what it does from the resumed step on; options that cannot be honoured raise
one `ConfigError` naming every such option and the value to resume with. The trainer records the config (and the
total step count) in every checkpoint's meta; checkpoints from before that fall back to output_dir/config.yaml
(`saved_config`).

The rules, in short (`RULES` has the reason for each):
- refused: what the checkpoint's arrays or its data position are made of: the model (PPO: the policy and the value
  model), the data (dataset, split,
  config, shuffling, seed), the stored dtypes (bf16, param_dtype, mu_dtype), the LoRA scale (lora_alpha,
  use_rslora), the number of reward functions (their metrics are summed in the checkpointed logging window; one
  function in place of another is honoured), beta to or from 0 (a reference model is held or not), max_grad_norm
  to or from 0 (the optimizer state's layout). scan_layers,
  use_peft, lora_r and lora_target_modules are the parameter layout, refused by the trainer's layout check.
- the schedule: a changed total (max_steps, num_train_epochs, or a batch change under num_train_epochs) or
  learning-rate option recomputes the learning-rate schedule for the new total; the note gives the lr at the
  resumed step before and after.
- everything else applies from the resumed step: the batch shape (the data continues at the same prompt), sampling,
  the algorithm's options, AdamW's hyper-parameters (its moments continue), execution (numbers equal up to float
  rounding), logging, saving and evaluation. An option this table does not know (added later) is treated so.
- not reported: where things are (output_dir, tfds_data_dir, the multi-process address and ids) and compile-only
  options.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import yaml

from rloo_jax import outputs
from rloo_jax.errors import ConfigError, assignments

Rule = Callable[[Any, Any], str | None]  # (old, new) -> why it is refused, or None when it is honoured


def refuse(reason: str) -> Rule:
    return lambda old, new: reason


def refuse_across_zero(reason: str) -> Rule:
    """Refused when one side is 0 (or unset) and the other is not; honoured between two non-zero values."""
    return lambda old, new: reason if bool(old) != bool(new) else None


DATA = "the checkpoint's data position (epoch, row) is a place in that dataset's order"
RULES: dict[str, Rule] = {
    "model_name_or_path": refuse("the checkpoint holds the weights trained from it (LoRA: adapters on it)"),
    "sft_model_path": refuse("the checkpoint holds the weights trained from it (LoRA: adapters on it)"),  # PPO
    "value_model_path": refuse("the checkpoint holds the value model trained from it"),  # PPO
    "seed": refuse("the data order and the checkpoint's data position come from it"),
    "dataset_name": refuse(DATA),
    "dataset_config": refuse(DATA),
    "dataset_train_split": refuse(DATA),
    "shuffle_dataset": refuse(DATA),
    "bf16": refuse("the frozen reference (with LoRA, the base) is kept in the compute dtype chosen at the start"),
    "param_dtype": refuse("the checkpoint stores the parameters in it"),
    "mu_dtype": refuse("the checkpoint stores AdamW's first moment in it"),
    "lora_alpha": refuse("it scales what the adapters learned: another value is another model"),
    "use_rslora": refuse("it scales what the adapters learned: another value is another model"),
    "beta": refuse_across_zero("beta 0 loads no reference model: the checkpoint holds one, or has none to restore"),
    "max_grad_norm": refuse_across_zero("clipping on or off changes the layout of the optimizer state"),
}
REWARD_SOURCES = ("reward_model_name_or_path", "reward_funcs")
REWARD_COUNT = "the checkpointed logging window sums metrics per reward function: their number cannot change"


def reward_count(config: dict[str, Any]) -> int:
    """How many reward functions a config names (reward models, then functions)."""
    return sum(len(config.get(k) or []) for k in REWARD_SOURCES)


SCHEDULE = ("learning_rate", "lr_scheduler_type", "warmup_ratio", "warmup_steps", "min_lr", "min_lr_rate")
# checked by the trainer's layout check (rloo_jax.train.check_layout), with its own message
LAYOUT = ("algorithm", "scan_layers", "use_peft", "lora_r", "lora_target_modules", "lora_target_parameters")
NOT_REPORTED = ("output_dir", "tfds_data_dir", "coordinator_address", "num_processes", "process_id", "compile_only",
                "topology", "trust_remote_code", "device_count", "process_count")
EXECUTION = ("matmul_precision", "attn_implementation", "moe_implementation", "gradient_checkpointing", "remat_policy",
             "data_parallel", "fsdp", "tensor_parallel", "expert_parallel", "rollout_mesh", "compilation_cache",
             "compilation_cache_dir", "full_determinism")
BATCH = ("per_device_train_batch_size", "num_generations", "gradient_accumulation_steps", "steps_per_generation",
         "num_iterations")


@dataclasses.dataclass(frozen=True)
class Change:
    """One option that differs from the checkpoint's run, and what the resumed run does about it."""

    option: str
    old: Any
    new: Any
    effect: str

    def line(self) -> str:
        return f"{self.option} {_show(self.old)} -> {_show(self.new)}: {self.effect}"


def _show(value: Any) -> str:
    return json.dumps(value) if isinstance(value, str | list | dict) else str(value).lower() if isinstance(
        value, bool) or value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _cli(value: Any) -> str:
    """A value as the command line takes it: lists comma-separated, booleans lowercase."""
    if isinstance(value, list):
        return ",".join(_cli(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """A config dict as JSON would hold it (tuples as lists, NaN/inf as null, objects as their repr): the form a
    checkpoint's meta keeps, so a fresh config and a saved one compare equal when they are."""
    from rloo_jax.metrics import json_safe

    return json.loads(json.dumps(json_safe(config), default=repr))


def learning_rate_at(config: dict[str, Any], step: int, total: int) -> float:
    """The learning rate of optimizer step `step` under `config`'s schedule over `total` steps
    (`rloo_jax.optimizer.learning_rate_at`, warmup as `rloo_jax.optimizer.warmup_steps`)."""
    from rloo_jax.optimizer import learning_rate_at as rate
    from rloo_jax.optimizer import min_lr_rate, warmup_steps

    warmup = warmup_steps(SimpleNamespace(warmup_steps=config.get("warmup_steps", 0),
                                          warmup_ratio=config.get("warmup_ratio", 0.0)), total)
    floor = min_lr_rate(SimpleNamespace(learning_rate=config["learning_rate"], min_lr=config.get("min_lr"),
                                        min_lr_rate=config.get("min_lr_rate")))
    return rate(config["lr_scheduler_type"], config["learning_rate"], step, warmup, total, floor)


def changes(saved: dict[str, Any], current: dict[str, Any], step: int, saved_total: int | None, total: int
            ) -> list[Change]:
    """The options of `current` that differ from `saved` (both `normalized` config dicts), each with what it does
    from `step` on; `saved_total` / `total`: the run's optimizer steps then and now (None: not recorded). Raises
    one ConfigError naming every option `RULES` refuses. E.g. max_steps 300 -> 600 with a constant lr ->
    [Change("max_steps", 300, 600, "the run now ends at step 600 (was 300); the learning rate stays 0.001 ...")].
    """
    saved, current = normalized(saved), normalized(current)
    differ = [k for k in current if k in saved and saved[k] != current[k] and k not in NOT_REPORTED + LAYOUT]
    refused = [(k, why) for k in differ if k in RULES and (why := RULES[k](saved[k], current[k])) is not None]
    if reward_count(saved) != reward_count(current):  # another reward function in place of one is honoured
        refused += [(k, REWARD_COUNT) for k in REWARD_SOURCES if k in differ]
    if refused:
        listed = "; ".join(f"{k} {_show(saved[k])} -> {_show(current[k])} ({why})" for k, why in refused)
        again = assignments({k: saved[k] for k, _ in refused}, _cli)
        raise ConfigError(f"cannot resume checkpoint {step} with {listed}; resume with {again}, or start a new "
                          "output_dir (export this checkpoint with python -m rloo_jax.export to train it further)")
    out = []
    schedule_changed = [k for k in differ if k in SCHEDULE]
    total_changed = saved_total is not None and saved_total != total
    if schedule_changed or total_changed:
        before = learning_rate_at(saved, step, saved_total or total)
        after = learning_rate_at(current, step, total)
        lr = f"the learning rate at step {step} goes from {before:.3g} to {after:.3g}" if before != after else \
            f"the learning rate at step {step} stays {after:.3g}"
        recomputed = f"the learning-rate schedule is recomputed for {total} steps; {lr}"
    for k in differ:
        if k in SCHEDULE:
            effect = recomputed
        elif k in ("max_steps", "num_train_epochs"):
            ends = f"the run now ends at step {total} (was {saved_total})" if total_changed else \
                "the total step count is unchanged"
            effect = f"{ends}; {recomputed}" if total_changed else ends
        elif k in BATCH:
            effect = "applies from this step: the data continues at the same prompt with the new batch shape " \
                "(the programs compile again)"
        elif k in REWARD_SOURCES:
            effect = "the reward changes from this step (logged rewards before and after measure different things)"
        elif k in EXECUTION:
            effect = "execution only, from this step (the same numbers up to float rounding)"
        else:
            effect = "applies from this step"
        out.append(Change(k, saved[k], current[k], effect))
    if total_changed and not any(c.option in ("max_steps", "num_train_epochs") for c in out):
        out.append(Change("total steps", saved_total, total, f"the run now ends at step {total} (a batch option "
                                                              f"changed the steps per epoch); {recomputed}"))
    return out


def reward_changes(saved: dict[str, str | None] | None, current: dict[str, str | None]) -> list[Change]:
    """The reward functions whose source differs from the checkpoint's run (`RewardFunction.digest`, by name; a
    name added or removed is a reward_funcs change, reported by `changes`). saved None: an older checkpoint."""
    return [Change(f"reward function {name!r}", saved[name], digest, "its source (hashed) was edited since the "
                   "checkpoint's run; rewards from this step come from the new code")
            for name, digest in current.items()
            if saved and saved.get(name) and digest and saved[name] != digest]


HISTORY = "# resumed at step "  # config.yaml's history lines: what the steps before each resume used


def history(previous: str | None, found: list[Change], step: int) -> str:
    """config.yaml's leading comment: the earlier resumes' lines of `previous` (the file being replaced), then one
    per option `found` changed at this resume (`step`), so the file (the options the steps from here use) also
    says what earlier steps ran with: the old value up to that step (since the line before on the same option).
    E.g. "# resumed at step 2: max_steps 2 -> 4"."""
    kept = [line for line in (previous or "").splitlines() if line.startswith(HISTORY)]
    kept += [f"{HISTORY}{step}: {c.option} {_show(c.old)} -> {_show(c.new)}" for c in found]
    return "".join(line + "\n" for line in kept)


def saved_config(meta: dict[str, Any], output_dir: str) -> dict[str, Any] | None:
    """The config a checkpoint was trained with: its meta's `config`, else (older checkpoints) output_dir's
    config.yaml, else None (nothing to compare)."""
    if meta.get("config") is not None:
        return meta["config"]
    path = outputs.join(output_dir, "config.yaml")
    if not outputs.exists(path):
        return None
    try:
        values = yaml.safe_load(outputs.read_text(path))
    except yaml.YAMLError:
        return None
    from rloo_jax.config import absolute_paths

    return absolute_paths(values) if isinstance(values, dict) else None  # older files: paths as typed


def describe(found: list[Change], step: int) -> list[str]:
    """The lines a resumed run prints about its changed options (none when nothing changed)."""
    if not found:
        return []
    return [f"Changed since checkpoint {step}:"] + [f"  {c.line()}" for c in found]


def rng_json(state: tuple) -> list[Any]:
    """`RandomState.get_state()` as JSON (the checkpoint's meta)."""
    name, keys, pos, has_gauss, cached = state
    return [name, np.asarray(keys).tolist(), int(pos), int(has_gauss), float(cached)]


def rng_state(saved: list[Any]) -> tuple:
    """`rng_json`'s list back to a `RandomState.set_state` tuple."""
    name, keys, pos, has_gauss, cached = saved
    return name, np.asarray(keys, np.uint32), int(pos), int(has_gauss), float(cached)


def layout(cfg: Any, scan_layers: bool) -> dict[str, Any]:
    """What a checkpoint's state is shaped by: the algorithm, the block layout (`scan_layers`) and the adapters
    (None: full fine-tuning)."""
    lora = cfg.use_peft and {"r": cfg.lora_r, "target_modules": cfg.lora_target_modules}
    if lora and cfg.lora_target_parameters:  # only when set: earlier checkpoints' layouts stay equal
        lora["target_parameters"] = cfg.lora_target_parameters
    return {"algorithm": cfg.ALGORITHM, "scan_layers": scan_layers, "lora": lora or None}


def check_layout(meta: dict[str, Any], current: dict[str, Any], step: int) -> None:
    """A checkpoint restores onto the parameter layout it was written with (stacked blocks or a list of them;
    adapters or the whole model) by the algorithm that wrote it; checkpoints from before the layout was recorded
    hold a list, no adapters, and RLOO's state."""
    from rloo_jax.algorithms import DEFAULT

    algorithm = meta.get("layout", {}).get("algorithm", DEFAULT)
    if algorithm != current["algorithm"]:
        raise ConfigError(f"checkpoint {step} was written by a {algorithm} run; resume it with `python -m "
                          f"rloo_jax.train {algorithm}` (and its config), or start this {current['algorithm']} run "
                          "in a new output_dir")
    saved = meta.get("layout", {}).get("scan_layers", False)
    if saved != current["scan_layers"]:
        raise ConfigError(
            f"checkpoint {step} holds the {'stacked' if saved else 'per-layer'} parameter layout of scan_layers="
            f"{str(saved).lower()}; resume with --scan_layers {str(saved).lower()} (the numbers are the same)"
        )
    lora = meta.get("layout", {}).get("lora")
    if lora != current["lora"]:
        held = "full fine-tuning" if lora is None else f"LoRA adapters (lora_r {lora['r']}, lora_target_modules " \
            f"{lora['target_modules']}, lora_target_parameters {lora.get('target_parameters')})"
        raise ConfigError(f"checkpoint {step} holds {held}; resume with the same use_peft / lora_r / "
                          "lora_target_modules / lora_target_parameters, or start a new output_dir")
