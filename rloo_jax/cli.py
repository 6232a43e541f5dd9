"""`python -m rloo_jax.train [rloo|grpo|ppo] [--config FILE.yaml] [--name value ...]`: the command line.

The first word names the algorithm (RLOO by default, or the `algorithm:` a config file records); the options are
TRL's (`rloo_jax.config`). A training run is the algorithm's trainer (`rloo_jax.trainers`: `RLOOTrainer`,
`GRPOTrainer`, `PPOTrainer`) on the config read from YAML and the command line; `--compile_only` compiles the run's
programs for a TPU slice instead (`rloo_jax.aot`). Errors in the configuration, the data or the model print one line
and exit 2.
"""

import logging
import sys
import traceback
from collections.abc import Sequence

import datasets
import jax

from rloo_jax import aot, demo, numerics
from rloo_jax.backend import cpu_compile_flags, skip_absent_tpu, start_distributed
from rloo_jax.checkpoint import NonFiniteError
from rloo_jax.config import (
    TrainConfig,
    compile_only_slice,
    config_class,
    distributed_options,
    format_help,
    full_determinism_option,
    load_config,
    parse_argv,
)
from rloo_jax.errors import ConfigError, DataError, RewardError
from rloo_jax.models import ModelLoadError
from rloo_jax.rewards import format_reward_error
from rloo_jax.trainers import GRPOTrainer, PPOTrainer, RLOOTrainer

logger = logging.getLogger("rloo_jax")
TRAINERS = {"rloo": RLOOTrainer, "grpo": GRPOTrainer, "ppo": PPOTrainer}


def build_config(argv: Sequence[str], device_count: int = 1, process_count: int = 1) -> TrainConfig:
    """The run config, checked for `device_count` devices in `process_count` processes; with neither --config nor
    --model_name_or_path, the built-in demo is the base."""
    cls, rest = config_class(argv)
    config_path, overrides = parse_argv(rest, cls)
    if config_path is None and "model_name_or_path" not in overrides:
        if process_count == 1 or jax.process_index() == 0:
            print("No --config and no --model_name_or_path: running the built-in demo (configs/default.yaml)")
        return load_config(argv, demo.default_config(cls.ALGORITHM), device_count, process_count)
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
