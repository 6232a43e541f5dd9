"""`python -m rloo_jax.train [rloo|grpo|ppo] [--config FILE.yaml] [--name value ...]`: the command line.

The first word names the algorithm (RLOO by default, or the `algorithm:` a config file records); the options are
TRL's (`rloo_jax.config`). A training run is the algorithm's trainer (`rloo_jax.trainers`: `RLOOTrainer`,
`GRPOTrainer`, `PPOTrainer`) on the config read from YAML and the command line; `--compile_only` compiles the run's
programs for a TPU slice instead (`rloo_jax.aot`). Errors in the configuration, the data or the model print one line
and exit 2.
"""

import difflib
import logging
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import datasets
import jax

from rloo_jax import aot, numerics
from rloo_jax.algorithms import CONFIGS, DEFAULT
from rloo_jax.backend import cpu_compile_flags, skip_absent_tpu, start_distributed
from rloo_jax.checkpoint import NonFiniteError
from rloo_jax.config import (
    TrainConfig,
    coerce,
    format_help,
    from_dict,
    load_yaml,
    parse_argv,
    read_yaml,
)
from rloo_jax.errors import ConfigError, DataError, RewardError, command_line
from rloo_jax.models import ModelLoadError
from rloo_jax.options import check_processes
from rloo_jax.rewards import format_reward_error
from rloo_jax.trainers import TRAINERS

logger = logging.getLogger("rloo_jax")


# ------------------------------------------------------------------------------------------------ the config
def config_class(argv: Sequence[str], base: dict[str, Any] | None = None) -> tuple[type[TrainConfig], list[str]]:
    """The algorithm a command line asks for, and the rest of it: `[rloo|grpo|ppo] [--config FILE] [--name value
    ...]`. The first word names it; else the `--config` file's `algorithm:` key (config.yaml records it); else
    `base`'s; else `DEFAULT`. A word and a file that disagree are an error."""
    argv = list(argv)
    named = None
    if argv and not argv[0].startswith("-"):
        named = argv.pop(0)
        if named not in CONFIGS:
            near = difflib.get_close_matches(named, list(CONFIGS), n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ConfigError(f"unknown algorithm {named!r}{hint}: the first word names one of {', '.join(CONFIGS)}")
    path = next((a.partition("=")[2] or (argv[i + 1] if i + 1 < len(argv) else "")
                 for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    recorded = load_yaml(path).get("algorithm") if path else (base or {}).get("algorithm")
    if recorded is not None and str(recorded) not in CONFIGS:
        raise ConfigError(f"{path or 'the config'}: algorithm {recorded!r} is not one of {', '.join(CONFIGS)}")
    if named and recorded and named != recorded:
        raise ConfigError(f"the command line names {named} but {path} is a {recorded} config (algorithm: {recorded});"
                          " drop one of them")
    return CONFIGS[named or recorded or DEFAULT], argv


def _raw_values(argv: Sequence[str], base: dict[str, Any] | None) -> tuple[type[TrainConfig], dict[str, Any]]:
    cls, argv = config_class(argv, base)
    config_path, overrides = parse_argv(argv, cls)
    values = {k: v for k, v in (base or {}).items() if k != "algorithm"}
    if config_path is not None:
        values.update(read_yaml(config_path, cls))
    values.update(overrides)
    return cls, values


def load_config(
    argv: Sequence[str], base: dict[str, Any] | None = None, device_count: int = 1, process_count: int = 1
) -> TrainConfig:
    """The validated config of the algorithm `argv` names (`config_class`): `base` values, then the `--config`
    YAML file, then command-line overrides; batch sizes and mesh checked for `device_count` devices in
    `process_count` processes. Its errors name command-line flags (the options came as flags or YAML keys)."""
    with command_line():
        cls, values = _raw_values(argv, base)
        return from_dict(values, cls, device_count, process_count)


def config_from_dict(values: dict[str, Any], device_count: int = 1, process_count: int = 1,
                     cls: type[TrainConfig] | None = None) -> TrainConfig:
    """A validated config from {name: raw value} (`rloo_jax.config.from_dict`); `cls`: the config class (default:
    the `algorithm` value's, else `DEFAULT`'s)."""
    if cls is None:
        recorded = values.get("algorithm")
        if recorded is not None and str(recorded) not in CONFIGS:
            raise ConfigError(f"algorithm {recorded!r} is not one of {', '.join(CONFIGS)}")
        cls = CONFIGS[str(recorded or DEFAULT)]
    return from_dict(values, cls, device_count, process_count)


def compile_only_slice(argv: Sequence[str]) -> str | None:
    """The `--topology` of a `--compile_only` run (from `--config` and the command line), else None: read before
    the rest of the config is validated, because the batch and mesh checks count the slice's chips."""
    _, values = _raw_values(argv, None)
    if not coerce(values.get("compile_only", False), bool, "compile_only"):
        return None
    return coerce(values.get("topology"), str | None, "topology")


def full_determinism_option(argv: Sequence[str]) -> bool:
    """`--full_determinism` from `--config` and the command line, before the rest of the config is validated:
    XLA reads its flags when the JAX backend starts, which happens before the config can be checked."""
    return coerce(_raw_values(argv, None)[1].get("full_determinism", False), bool, "full_determinism")


def distributed_options(argv: Sequence[str]) -> tuple[str | None, int | None, int | None]:
    """(coordinator_address, num_processes, process_id) from `--config` and the command line, before the rest
    of the config is validated: the multi-process runtime must start first (the device count depends on it)."""
    _, values = _raw_values(argv, None)
    address = coerce(values.get("coordinator_address"), str | None, "coordinator_address")
    count, index = (coerce(values.get(name), int | None, name) for name in ("num_processes", "process_id"))
    check_processes(count, index)
    return address, count, index


def build_config(argv: Sequence[str], device_count: int = 1, process_count: int = 1) -> TrainConfig:
    """The run config, checked for `device_count` devices in `process_count` processes; with neither --config nor
    --model_name_or_path, the built-in demo is the base."""
    cls, rest = config_class(argv)
    config_path, overrides = parse_argv(rest, cls)
    if config_path is None and "model_name_or_path" not in overrides:
        if process_count == 1 or jax.process_index() == 0:
            print("No --config and no --model_name_or_path: running the built-in demo (configs/default.yaml)")
        return load_config(argv, cls.DEMO, device_count, process_count)
    return load_config(argv, None, device_count, process_count)


def compile_only(argv: Sequence[str], topology: str) -> int:
    """`--compile_only`: build the run for the slice's chips, compile its programs, print and write the report;
    0 when every program fits, 1 when one does not."""
    jax.config.update("jax_platforms", "cpu")  # this host only traces shapes; libtpu compiles for the slice
    from rloo_jax.tpu import parse_slice

    slc = parse_slice(topology)
    cfg = build_config(argv, slc.chips, 1)
    report = aot.compile_run(cfg, slc)
    chips = f"{slc.chips} chip{'s' * (slc.chips > 1)}"
    print(f"{slc.name}: {chips} ({slc.topology_name}), {aot.gib(slc.chip.hbm_bytes)} HBM per chip")
    for line in aot.table_lines(report):
        print(line)
    print(aot.verdict(report, lambda name: aot.advice(cfg, name)))
    print(f"report: {report.write(cfg.output_dir)}")
    return 0 if report.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Exit codes: 0 on success or after a SIGTERM (checkpoint saved); 2 on a configuration,
    data or model error (one line, nothing written); 1 when training stops on a reward-function error or on
    `max_consecutive_nonfinite` non-finite updates (the last checkpoint is left as it was), or when a
    `--compile_only` program does not fit its slice."""
    with command_line():  # its errors name flags
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        try:
            print(format_help(config_class([a for a in argv if a not in ("--help", "-h")][:1])[0]))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    # force: absl (imported by orbax) has already given the root logger its default "LEVEL:name:" handler
    logging.basicConfig(format="%(message)s", level=logging.WARNING, force=True)
    logging.getLogger("absl").setLevel(logging.ERROR)
    skip_absent_tpu()
    cpu_compile_flags()
    datasets.disable_progress_bars()  # one clean console: our progress bar and lines only
    debug = any(a in ("--debug", "--debug=true", "--debug=1") for a in argv)
    try:
        topology = compile_only_slice(argv)
        if topology is not None:
            return compile_only(argv, topology)
        if full_determinism_option(argv):
            numerics.enable_determinism()  # XLA reads its flags when the backend starts: before anything below
        # the multi-process runtime starts before anything else touches JAX; the config is then checked against
        # the devices of all processes (the mesh sizes and the global batch depend on them)
        start_distributed(*distributed_options(argv))
        cfg = build_config(argv, jax.device_count(), jax.process_count())
        debug = cfg.debug
        trainer = TRAINERS[cfg.ALGORITHM]  # the Python API; the CLI is that class on a config from argv
        trainer.from_args(cfg).train()
    except (ConfigError, DataError, ModelLoadError) as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RewardError as e:
        print(format_reward_error(e), file=sys.stderr)
        print("error: training stopped; the last checkpoint was left as it was", file=sys.stderr)
        return 1
    except NonFiniteError as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        print("error: training stopped; nothing non-finite was saved, the last checkpoint is intact", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
