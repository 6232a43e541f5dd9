"""The training loop, for any algorithm (what `RLOOTrainer.train()`, `GRPOTrainer.train()`, `PPOTrainer.train()` and
`python -m rloo_jax.train` run): `train(cfg, given)`.

Four phases, each a function: `setup` (multi-process start, the run assembled by `rloo_jax.build.assemble` as
compile-only assembles it, its fresh state; nothing written yet, so a bad invocation leaves an existing output_dir
untouched) -> `resume` (the newest checkpoint, the records after it dropped, outputs opened) -> `loop` (for each
generation batch, `train_step`: prompts, sample (jitted), the reference pass (jitted) while the host decodes and
rewards, update (jitted); then metrics, records, evaluation, checkpoint, reference sync) -> `finish` (the final
Hugging Face export). What differs between algorithms reaches the loop as values: the programs' algorithm, the
config's hooks (a step is an optimizer step, or a generation batch for PPO: `per_generation`).

With more than one device the step runs on a (data, fsdp, tensor) mesh (`rloo_jax.mesh`). Every process runs this
same loop on the same global batch indices; it encodes, decodes and rewards only its own rows (`Placement`), the
step sees global arrays, and only process 0 writes logs, records, config.yaml and final/ (checkpoints are written by
all processes together through orbax).
"""

import dataclasses
import fractions
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from rloo_jax import logwindow, numerics, outputs
from rloo_jax import resume as resumed
from rloo_jax.backend import enable_compilation_cache, start_distributed
from rloo_jax.build import Prepared, assemble
from rloo_jax.callbacks import CallbackHandler
from rloo_jax.checkpoint import Checkpointer, NonFiniteError, nonfinite_leaves
from rloo_jax.completions import Scored, decode, decode_and_score, encode_rows, print_completions, score_conversations
from rloo_jax.config import TrainConfig, absolute_paths, with_absolute_paths
from rloo_jax.config import replace as replace_config
from rloo_jax.conversations import conversation_record, run_conversations
from rloo_jax.data import PromptIterator, prompt_texts
from rloo_jax.errors import ConfigError
from rloo_jax.evaluation import eval_prefix, evaluate, external_batch
from rloo_jax.external import score_external
from rloo_jax.given import Given
from rloo_jax.metrics import (
    JsonlWriter,
    Sinks,
    TokenRecords,
    check_report_to,
    console_line,
    drop_records_after,
    json_safe,
    logprob_series,
    rename_reward_metrics,
    rollout_records,
    weighted_rewards,
)
from rloo_jax.models import export as write
from rloo_jax.optimizer import skipped_updates
from rloo_jax.placement import Placement
from rloo_jax.programs import Programs
from rloo_jax.resume import check_layout, layout, rng_json, rng_state
from rloo_jax.rewards import RewardLogs, TrainerState, place_reward_models
from rloo_jax.step import UpdatePlan, completion_width, micro_batch_order, plan_update
from rloo_jax.timing import ReadyTime, phase_timings

logger = logging.getLogger("rloo_jax")


fold_in = jax.jit(jax.random.fold_in)  # the per-step key: one dispatch instead of eager ops (~1 ms a step)


def compile_quietly(s: "Session", prompt_shape: tuple[int, int], num_rewards: int, width: int,
                    plan: UpdatePlan | None = None) -> threading.Thread:
    """`Programs.compile_update` in a background thread (started; `train` joins it whatever happens): a failure
    there is left to the real call, which compiles again and raises it with its own message."""
    thread = threading.Thread(target=_compile_update, args=(s.programs, prompt_shape, num_rewards, width, plan),
                              daemon=True)
    thread.start()
    s.compiling.append(thread)
    return thread


def _compile_update(programs: Programs, prompt_shape: tuple[int, int], num_rewards: int, width: int,
                    plan: UpdatePlan | None) -> None:
    try:
        programs.compile_update(prompt_shape, num_rewards, width, plan)
    except Exception:  # noqa: BLE001 -- reported by the update call itself
        logging.getLogger(__name__).debug("ahead-of-time compile of update failed", exc_info=True)


def crossed(previous: int, current: int, every: int | fractions.Fraction | None) -> bool:
    """True when a multiple of `every` lies in (previous, current] (a step may advance by several updates); for a
    fractional `every` (an epoch of 16/3 steps), when some ceil(e x every) does."""
    return bool(every) and current // every > previous // every


def for_this_machine(cfg: TrainConfig) -> TrainConfig:
    """`cfg` validated for the devices and processes JAX sees now (a copy when they differ from cfg's)."""
    if (cfg.device_count, cfg.process_count) == (jax.device_count(), jax.process_count()):
        return cfg
    return replace_config(cfg, device_count=jax.device_count(), process_count=jax.process_count())


def evaluate_all(s: "Session", progress: Any = None) -> dict[str, float]:
    """Every evaluation set at the current state (one key per step: the same completions on every resume), logged
    to every sink and `log_history` (process 0), the console, and the callbacks' on_log / on_evaluate."""
    metrics: dict[str, float] = {}
    for name, dataset in s.prepared.eval_ds.items():
        key = jax.random.fold_in(s.eval_key, s.step)
        metrics.update(evaluate(s.prepared, s.place, s.programs, s.state, key, s.names,
                                s.trainer_state, dataset, eval_prefix(name)))
    s.last_logged.update(metrics)
    if s.place.is_main:
        s.sinks.log(s.step, metrics)
        s.trainer_state.log_history.append({"step": s.step, **metrics})
        print_line = progress.console.print if progress is not None else print
        for name in s.prepared.eval_ds:
            p = eval_prefix(name)
            print_line(f"eval step {s.step}{' ' + name if name else ''}: reward {metrics[p + 'reward']:.3f} "
                       f"(len {metrics[p + 'completions/mean_length']:.1f})")
    s.callbacks.call("on_log", s.cfg, s.trainer_state, logs=dict(metrics))
    s.callbacks.call("on_evaluate", s.cfg, s.trainer_state, metrics=dict(metrics))
    return metrics


# ------------------------------------------------------------------------------------------------ the loop
class StopRequest:
    """SIGTERM (preemption) handling: the first signal only sets a flag (the loop finishes its step, saves a
    checkpoint and returns); the previous handler is put back, so a second signal acts at once."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: Any = None

    def __enter__(self) -> "StopRequest":
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no handler, SIGTERM keeps its default action
            self._previous = None
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal = signal.Signals(signum).name
        signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


# ------------------------------------------------------------------------------------------------ the phases
@dataclasses.dataclass
class Session:
    """A run between its phases: what was built (fixed) and where the loop stands (changes every step)."""

    cfg: TrainConfig
    prepared: Prepared
    place: Placement
    programs: Programs
    graphdef: Any
    iterator: PromptIterator
    total_steps: int
    lr_at: Callable[[int], float]  # the learning rate of an optimizer step
    weights: jax.Array  # [F] reward weights (replicated on a mesh)
    names: list[str]  # reward function names, for metrics
    eval_key: jax.Array
    paths: dict[str, str]
    state: Any  # TrainState
    base_key: jax.Array
    order_rng: np.random.RandomState | None = None  # the micro-batch shuffles (StepConfig.row_order: PPO epochs)
    step: int = 0  # steps done (optimizer updates; PPO: updates over a generation batch, as TRL counts them)
    num_tokens: int = 0  # host counters, carried in the checkpoint's meta
    truncated_prompts: int = 0
    saved: int | None = None  # the step of the newest checkpoint
    carried: int = 0  # micro-batches of an optimizer step begun in the last generation batch (state.grad_acc)
    pending: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # that step's metric values so far
    stopped_by: str | None = None  # the signal that stopped the loop
    window: logwindow.LogWindow = dataclasses.field(default_factory=logwindow.LogWindow)
    trainer_state: TrainerState = dataclasses.field(default_factory=TrainerState)  # reward functions' view
    reward_logs: RewardLogs = dataclasses.field(default_factory=RewardLogs)  # their log_extra / log_metric
    last_logged: dict[str, float] = dataclasses.field(default_factory=dict)  # what `train` returns
    callbacks: CallbackHandler = dataclasses.field(default_factory=CallbackHandler)  # transformers-style callbacks
    loss_sum: float = 0.0  # the losses of this session's optimizer steps (TRL's train_loss)
    ckpt: Checkpointer | None = None
    sinks: Sinks | None = None
    rollouts: JsonlWriter | None = None
    # the update's ahead-of-time compiles (`compile_quietly`); a step that fails before joining one (a reward error)
    # leaves it in XLA, where the interpreter's exit would kill it mid-compile and abort the process
    compiling: list[threading.Thread] = dataclasses.field(default_factory=list)

    @property
    def save_every(self) -> int | fractions.Fraction:
        """Steps between checkpoints: save_steps (a ratio already resolved to steps by `build.prepare`), or with
        save_strategy epoch an epoch's steps, fractional where a step spans two epochs (epoch e ends in step
        ceil(e x them), where `crossed` finds it)."""
        return self.prepared.steps_per_epoch if self.cfg.save_strategy == "epoch" else self.cfg.save_steps

    @property
    def eval_every(self) -> int | fractions.Fraction | None:
        """Steps between evaluations: eval_steps (None: none but at the end), or an epoch's (eval_strategy epoch)."""
        return self.prepared.steps_per_epoch if self.cfg.eval_strategy == "epoch" else self.cfg.eval_steps


@dataclasses.dataclass
class StepOutcome:
    """One generation batch after its update(s): what logging and the rollout records read."""

    idx: np.ndarray  # [B] the prompts' row indices
    rollout: Any  # Rollout (device)
    scored: Scored
    rewards: jax.Array  # [N, F]
    extra: dict[str, list[Any]]  # log_extra columns, N values each
    timings: dict[str, float]  # timing/sample|reference|reward|update, seconds
    end: float  # when the update's results were read (time.perf_counter): the end of the step's wall time
    consecutive_skips: int  # updates skipped for non-finite values: in a row, and in all
    skipped: int
    metrics: dict[str, Any]  # Step.update's, on the host: generation scalars, micro [U, M] (or [micro]), update [U]
    steps: int = 1  # the optimizer steps it completed (the share of its wall time each step's record shows)
    conversations: Any = None  # tool calling: the batch's `Conversations` (turns, tool calls, messages)


@dataclasses.dataclass
class TrainResult:
    """What `train` returns: the metrics of the last logged step (with the last evaluation's eval_* metrics), the
    optimizer steps done, whether a SIGTERM stopped the run early, the output paths and the trainer state."""

    metrics: dict[str, float]
    step: int
    stopped: bool
    paths: dict[str, str]
    state: TrainerState  # where training stands, as reward functions saw it (with the log history)
    summary: dict[str, float] = dataclasses.field(default_factory=dict)  # transformers' end-of-training record


def setup(cfg: TrainConfig, given: Given | None = None) -> Session:
    """Build the run (`rloo_jax.build.assemble`, as compile-only does), its fresh state and the loop's own
    counters (`given`: objects of the Python API instead of what the config names); nothing is written."""
    if cfg.full_determinism:
        numerics.enable_determinism()  # warns when the backend already started (a Python session)
    start_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    cfg = for_this_machine(cfg)
    enable_compilation_cache(cfg.compilation_cache_dir if cfg.compilation_cache else None)
    check_report_to(cfg.report_to)  # the trackers importable, before the models load (compile-only reports none)
    assembly = assemble(cfg, given=given)  # the config resolved for the platform: what runs, is printed and is recorded
    if jax.process_index() == 0:
        print(assembly.prepared.description)
    cfg, prepared = assembly.cfg, assembly.prepared
    place = Placement(assembly.mesh)
    place_reward_models(prepared.reward_funcs, place.mesh)  # host reward models sharded like the policy
    iterator = PromptIterator(len(prepared.train_ds), cfg.prompts_per_generation, cfg.seed, cfg.shuffle_dataset)
    # one compiled program for every step and horizon (`optimizer.learning_rate_at`), not eager ops per logged step
    optimizer = assembly.optimizer

    def lr_at(step: int) -> float:
        return optimizer.rate(step, optimizer.horizon)

    lr_at(0)  # compiled here, not at the first logged step (no compile after step 1)
    state = assembly.init_state()  # with a mesh: placed on its shardings (FSDP / tensor parallel)
    base_key = jax.random.key(cfg.seed)
    if place.mesh is None:
        # committed to the device, like the arrays a checkpoint restores: jit lowers committed arguments with their
        # sharding, so a resumed run would otherwise trace other programs and miss the compilation cache
        state, base_key = jax.device_put((state, base_key), jax.devices()[0])
    out = cfg.output_dir  # a local folder or a URL (gs://...): every output goes through rloo_jax.outputs
    paths = {
        "metrics": outputs.join(out, "metrics.jsonl"),
        "rollouts": outputs.join(out, "rollouts.jsonl"),
        "checkpoints": outputs.join(out, "checkpoints"),
        "final": outputs.join(out, "final"),
        "final_merged": outputs.join(out, "final_merged"),
        "final_value": outputs.join(out, "final_value"),
        "config": outputs.join(out, "config.yaml"),
    }
    return Session(
        cfg=cfg, prepared=prepared, place=place, programs=assembly.programs, graphdef=assembly.policy.graphdef,
        iterator=iterator, total_steps=assembly.total_steps,
        lr_at=lr_at, weights=place.replicate(jnp.asarray(prepared.reward_weights, jnp.float32)),
        names=prepared.device_reward_names + [f.name for f in prepared.reward_funcs],
        eval_key=jax.random.key(cfg.seed + 1),  # eval: its own randomness
        paths=paths, state=state, base_key=base_key,
        callbacks=CallbackHandler(None if given is None else given.callbacks),
        # the micro-batch shuffles: NumPy's legacy generator seeded with `seed`, the stream TRL 1.12's PPO draws from
        # np.random after np.random.seed(seed) (tests/test_ppo_trainer.py seeds it so)
        order_rng=np.random.RandomState(cfg.seed) if assembly.programs.cfg.row_order else None,
        trainer_state=TrainerState(
            max_steps=assembly.total_steps, num_train_epochs=cfg.num_train_epochs, logging_steps=cfg.logging_steps,
            eval_steps=cfg.eval_steps, save_steps=cfg.save_steps, train_batch_size=cfg.per_device_train_batch_size,
            is_world_process_zero=place.is_main,
        ),
    )


def resume(s: Session) -> None:
    """Open the outputs; restore the newest checkpoint if there is one and drop the records logged after it."""
    outputs.makedirs(s.cfg.output_dir)
    s.ckpt = Checkpointer(s.paths["checkpoints"], max_to_keep=s.cfg.save_total_limit)  # every process: collective
    latest = s.ckpt.latest_step()
    found: list[resumed.Change] = []
    if latest is not None:
        meta = s.ckpt.read_meta(latest)
        check_layout(meta, layout(s.cfg, s.prepared.model.config.scan_layers), latest)
        saved = resumed.saved_config(meta, s.cfg.output_dir)  # changed options: noted, or refused (ConfigError)
        if saved is not None:
            found = resumed.changes(saved, recorded_config(s), latest, meta.get("total_steps"), s.total_steps)
        found += resumed.reward_changes(meta.get("reward_sources"), reward_sources(s))
        # onto its shardings; a LoRA checkpoint holds the adapters and their optimizer state, not the frozen base
        # (nor a device reward model: both are read from their checkpoints again)
        restored, key, meta = s.ckpt.restore(latest, s.state.replace(frozen=None, reward_params=None),
                                             s.place.replicate(s.base_key))
        s.state = restored.replace(frozen=s.state.frozen, reward_params=s.state.reward_params)
        if s.order_rng is not None:
            s.order_rng.set_state(rng_state(meta["order_rng"]))
        s.base_key = s.place.host_key(key)
        s.iterator.load_state_dict(meta["data"])
        s.step = s.saved = s.trainer_state.global_step = int(meta["step"])
        s.trainer_state.epoch = epoch_of(s.iterator)
        counters = meta.get("counters", {})
        s.num_tokens = int(counters.get("num_tokens", 0))
        s.truncated_prompts = int(counters.get("num_truncated_prompts", 0))
        s.window.load_state_dict(meta.get("window", {}))
        carried = meta.get("carried", {})
        s.carried = int(carried.get("micro_batches", 0))
        s.pending = logwindow.values_from_json(carried.get("pending", {}))
    if not s.place.is_main:
        return
    # records logged after the checkpoint (or, with none, by a run killed before its first one) are redone
    dropped = drop_records_after(s.paths["metrics"], s.step) + drop_records_after(s.paths["rollouts"],
                                                                                        s.step)
    if latest is not None:
        print(
            f"Resuming from checkpoint {os.path.join(s.paths['checkpoints'], str(latest))} (step {s.step}"
            + (f"; dropped {dropped} records logged after it)" if dropped else ")")
        )
        for line in resumed.describe(found, latest):
            print(line)
    elif dropped:
        print(f"No checkpoint in {s.paths['checkpoints']}: starting over (dropped {dropped} records of an earlier run)")
    # the options the steps from here use (local paths absolute), after what earlier steps used (`resume.history`)
    config = s.paths["config"]
    previous = outputs.read_text(config) if latest is not None and outputs.exists(config) else None
    outputs.write_text(config, resumed.history(previous, found, latest or 0) + with_absolute_paths(s.cfg).to_yaml())
    s.sinks = Sinks(outputs.join(s.cfg.output_dir), s.cfg.report_to, json_safe(s.cfg.to_dict()), s.cfg.run_name)
    s.rollouts = JsonlWriter(s.paths["rollouts"])


def recorded_config(s: Session) -> dict[str, Any]:
    """The run's options as its checkpoints record them (local paths absolute; JSON values)."""
    return resumed.normalized(absolute_paths(s.cfg.to_dict()))


def reward_sources(s: Session) -> dict[str, str | None]:
    """Each reward function's source digest (`RewardFunction.digest`), by name: a resume compares them."""
    return {func.name: func.digest() for func in s.prepared.reward_funcs}


def save(s: Session) -> None:
    meta = {
        "config": recorded_config(s),  # what a resume compares its options with (rloo_jax.resume)
        "reward_sources": reward_sources(s),  # and its reward functions' sources
        "total_steps": s.total_steps,
        "layout": layout(s.cfg, s.prepared.model.config.scan_layers),
        "data": s.iterator.state_dict(),
        "step": s.step,
        "counters": {"num_tokens": s.num_tokens, "num_truncated_prompts": s.truncated_prompts},
        "window": s.window.state_dict(),  # the unlogged values, log_metric's among them
        # an optimizer step begun and not completed (its gradients are in the state's grad_acc)
        "carried": {"micro_batches": s.carried, "pending": logwindow.values_to_json(s.pending)},
    }
    if s.order_rng is not None:  # the shuffles' generator, so a resumed run draws the next ones
        meta["order_rng"] = rng_json(s.order_rng.get_state())
    if s.sinks is not None:  # the records so far go up with the checkpoint (a URL output_dir: uploaded now)
        s.sinks.sync()
        s.rollouts.sync()
    # the frozen base (LoRA) and device reward models are not saved: resume reads them from their folders again
    s.ckpt.save(s.step, s.state.replace(frozen=None, reward_params=None), s.place.replicate(s.base_key), meta)
    s.saved = s.step
    s.callbacks.call("on_save", s.cfg, s.trainer_state)


def loop(s: Session, stop: "StopRequest") -> bool:
    """Train until total_steps or a stop request; returns whether it stopped early (a checkpoint is then saved)."""

    def stop_requested() -> bool:
        """A SIGTERM seen by any process (every process calls this at the same points, so all stop together)."""
        return s.place.any(stop.signal is not None) if s.place.multi_process else stop.signal is not None

    progress = Progress(
        TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), transient=True,
        disable=not s.place.is_main,
    )
    start = s.step
    control = s.callbacks.control
    with progress:
        task = progress.add_task("train", total=s.total_steps, completed=s.step)
        while s.step < s.total_steps and not stop_requested():
            t0, prev = time.perf_counter(), s.step
            plan = next_plan(s)
            gas = s.cfg.gradient_accumulation_steps
            # the optimizer steps begun here (PPO: 1)
            begun = 1 if plan is None else sum((plan.carried + k) % gas == 0 for k in range(plan.micro_batches))
            for _ in range(begun):  # the steps begun here
                control._new_step()
                s.callbacks.call("on_step_begin", s.cfg, s.trainer_state)
            out = train_step(s, t0, first=s.step == start, plan=plan)
            diverged = out.consecutive_skips >= s.cfg.max_consecutive_nonfinite
            sync = s.cfg.reference_sync  # TR-DPO: (every, alpha)
            if sync is not None and crossed(prev, s.step, sync[0]):
                s.state = s.programs.sync_reference(s.state, sync[1])
            # every record of a step is written before its checkpoint is started: a resume drops the records
            # after the checkpoint and redoes them, so none is lost or doubled
            # a record per optimizer step as TRL logs them (every logging_steps, the last step, a divergence, or
            # a callback's should_log); PPO: one record per generation batch, as TRL 1.12 logs its updates
            logged, evaluate_now, save_now = False, False, False
            last = s.step >= s.total_steps
            if per_generation(s):
                records = [{name: [float(v)] for name, v in out.metrics["generation"].items()}]  # one per batch
            else:  # each micro-batch's values with the optimizer step it accumulates into (rloo_jax.logwindow)
                records, s.pending = logwindow.planned_steps(out.metrics, plan.carried, gas, s.pending,
                                                             plan.micro_batches)
            for k, values in enumerate(records, start=prev + 1):
                s.window.add(values)
                s.loss_sum += sum(values.get("loss", []))
                s.trainer_state.global_step = k
                control.should_log = False
                s.callbacks.call("on_step_end", s.cfg, s.trainer_state)
                if control.should_training_stop:
                    s.total_steps = s.step  # a callback ends training after this generation batch
                last = s.step >= s.total_steps
                if crossed(k - 1, k, s.cfg.logging_steps) or control.should_log or (k == s.step and (last or
                                                                                                      diverged)):
                    log_step(s, progress, k, t0, out)
                    logged = True
                evaluate_now |= control.should_evaluate
                save_now |= control.should_save
            s.trainer_state.global_step = s.step
            if logged and (s.cfg.log_completions or last):
                record_rollouts(s, progress, out)
            if diverged:  # logged above; nothing is evaluated or saved
                raise NonFiniteError(
                    f"{out.consecutive_skips} consecutive optimizer updates had a non-finite loss or gradients "
                    f"(step {s.step}, {out.skipped} skipped in all; max_consecutive_nonfinite = "
                    f"{s.cfg.max_consecutive_nonfinite}); lower --learning_rate or --max_grad_norm, check the "
                    "rewards for extreme values, or resume from an earlier checkpoint"
                )
            if s.prepared.eval_ds and (crossed(prev, s.step, s.eval_every) or (last and s.cfg.evaluates)
                                  or evaluate_now):
                evaluate_all(s, progress)
            if crossed(prev, s.step, s.save_every) or last or stop_requested() or save_now:
                save(s)
            progress.update(task, completed=s.step)
    stopped = stop_requested()
    if stopped and s.step > 0 and s.saved != s.step:
        save(s)  # the signal came after this step's save decision
    return stopped


def next_plan(s: Session) -> UpdatePlan | None:
    """The next generation batch's micro-batches (`rloo_jax.step.UpdatePlan`): the optimizer step the last one
    began is completed, and the run stops exactly at total_steps (TRL); None where a step is a generation batch
    (PPO: whole generation batches)."""
    if per_generation(s):
        return None
    pc = s.programs.cfg
    return plan_update(s.carried, s.total_steps - s.step, pc.micro_per_generation, pc.gradient_accumulation_steps)


def train_step(s: Session, t0: float, first: bool, plan: UpdatePlan | None = None) -> StepOutcome:
    """One generation batch: prompts -> sample -> (reference pass on the device while the host decodes and
    rewards) -> update(s) (`plan`: which micro-batches; None: all), timed where the host waits anyway
    (`phase_timings`). With tools the sampling is a batch of conversations (`conversation_rollout`)."""
    cfg, place = s.cfg, s.place
    idx = next(s.iterator)  # the same global batch on every process; each one handles its rows
    rows = s.prepared.train_ds[idx[place.rows(len(idx))]]
    key = place.replicate(fold_in(s.base_key, s.step))
    num_rewards = len(s.names) - len(s.prepared.device_reward_names)  # the host's reward functions
    context = s.reward_logs.context(s.trainer_state)
    if s.prepared.tool_use is not None:
        batch, rollout, reference, t_sampled, scored, compiling, conv = conversation_rollout(
            s, rows, key, first, plan, num_rewards, context)
    elif s.prepared.rollout_func is not None:
        batch, rollout, reference, t_sampled, scored, compiling = external_rollout(
            s, rows, first, plan, num_rewards, context)
        conv = None
    else:
        batch, rollout, reference, t_sampled, scored, compiling = single_turn_rollout(
            s, rows, key, first, plan, num_rewards, context)
        conv = None
    s.truncated_prompts += batch.num_truncated
    extra, logged = place.reward_logs(s.reward_logs, len(scored.lengths))
    if conv is not None:
        logged.update(conv.metrics())  # tools/*, timing/tools: once per generation, as TRL logs them
    s.window.add({name: [value] for name, value in logged.items()})  # log_metric: once per generation, as TRL
    local_tokens = int(batch.prompt_mask.sum()) * cfg.num_generations + int(scored.lengths.sum())
    s.num_tokens += int(place.per_process([local_tokens]).sum())
    s.trainer_state.num_input_tokens_seen = s.num_tokens
    rewards = place.to_global(scored.rewards_per_func)
    t_rewarded = time.perf_counter()
    reference.done_by(t_rewarded)  # ready now: it ended by now (the watcher may not have had the GIL yet)
    if compiling is not None:
        compiling.join()  # before update donates the state it reads
    order = None
    if s.order_rng is not None:  # each micro-batch's rows (PPO: a shuffle per epoch), drawn on the host
        pc = s.programs.cfg
        shape = s.programs.order_shape(len(idx))
        order = place.replicate(jnp.asarray(micro_batch_order(s.order_rng, len(idx) * pc.num_generations,
                                                              pc.num_iterations, shape[1])))
    s.state, metrics = s.programs.update(s.state, rollout, rewards, s.weights, order, plan)
    gas = cfg.gradient_accumulation_steps
    s.step += cfg.steps_per_generation_batch if plan is None else plan.steps(gas)
    s.carried = 0 if plan is None else plan.carried_out(gas)
    s.trainer_state.global_step, s.trainer_state.epoch = s.step, epoch_of(s.iterator)  # what rewards see next
    consecutive, skipped = skipped_updates(s.state.opt_state)  # waits for the update; skipped ones changed nothing
    t_reference, end = reference.join(), time.perf_counter()
    timings = phase_timings(t0, t_sampled, t_rewarded, t_reference, end)
    metrics = jax.device_get(metrics)  # one transfer: every optimizer step's values
    steps = cfg.steps_per_generation_batch if plan is None else plan.steps(gas)
    return StepOutcome(idx, rollout, scored, rewards, extra, timings, end, consecutive, skipped, metrics, steps,
                       conv)


def single_turn_rollout(s: Session, rows: dict[str, list[Any]], key: jax.Array, first: bool,
                        plan: UpdatePlan | None, num_rewards: int, context: dict[str, Any]) -> tuple:
    """Prompts encoded -> the sampler (one program) -> the reference pass dispatched at the completion width that
    holds the longest completion -> the host decodes and rewards while it runs. Returns (batch, rollout, the
    reference's ReadyTime, when sampling ended, Scored, the update's compile thread or None)."""
    cfg, place = s.cfg, s.place
    batch = encode_rows(s.prepared, place, rows)
    ids, mask = place.to_global(batch.prompt_ids), place.to_global(batch.prompt_mask)
    longest = cfg.max_completion_length
    one_width = completion_width(1, longest, cfg.completion_bucket) == longest
    # the first step compiles update in a thread while the rollout compiles and runs (from the start when its
    # width is known: one completion width; else once the samples tell it)
    compiling = compile_quietly(s, ids.shape, num_rewards, longest, plan) if first and one_width else None
    sampled = s.programs.sample(s.state, ids, mask, key)
    if not one_width:
        longest = s.programs.longest(sampled)  # waits for the sampler
    width = completion_width(longest, cfg.max_completion_length, cfg.completion_bucket)
    if first and compiling is None:
        compiling = compile_quietly(s, ids.shape, num_rewards, width, plan)
    rollout = s.programs.finish(s.state, sampled, width)  # cut to `width`, reference log-probs (dispatched)
    reference = ReadyTime(rollout.ref_logps)  # when the reference pass ends, seen from a watcher thread
    # the sampler's own completion ids: on the host as soon as sampling ends, while the reference pass runs
    completion_ids = place.local(sampled.completion_ids)
    del sampled  # its full-width arrays: freed once the reference pass has read them
    t_sampled = time.perf_counter()
    scored = decode_and_score(s.prepared, batch, completion_ids, cfg.num_generations, context)
    return batch, rollout, reference, t_sampled, scored, compiling


def conversation_rollout(s: Session, rows: dict[str, list[Any]], key: jax.Array, first: bool,
                         plan: UpdatePlan | None, num_rewards: int, context: dict[str, Any]) -> tuple:
    """Tool calling: the batch's conversations (`rloo_jax.conversations`: turns on the device, tools on the host),
    the reference pass dispatched at the width that holds the longest, then the rewards on the messages. Returns
    `single_turn_rollout`'s and the `Conversations`."""
    cfg = s.cfg
    conv = run_conversations(s.programs, s.state, rows, key, s.prepared.tool_use, s.prepared.encoder)
    batch = conv.batch
    width = completion_width(max(conv.width, 1), cfg.max_completion_length, cfg.completion_bucket)
    compiling = compile_quietly(s, batch.prompt_ids.shape, num_rewards, width, plan) if first else None
    rollout = s.programs.finish(s.state, conv.rollout, width)
    reference = ReadyTime(rollout.ref_logps)
    t_sampled = time.perf_counter()
    scored = score_conversations(s.prepared, conv, context)
    return batch, rollout, reference, t_sampled, scored, compiling, conv


def external_rollout(s: Session, rows: dict[str, list[Any]], first: bool, plan: UpdatePlan | None,
                     num_rewards: int, context: dict[str, Any]) -> tuple:
    """TRL's rollout_func (`rloo_jax.external`): the user's function builds the batch's completions on the host, the
    reference (and old) log-prob passes run at the width that holds the longest, then the rewards with the
    function's other fields. Returns `single_turn_rollout`'s."""
    cfg = s.cfg
    ext = external_batch(s.prepared, s.place, s.programs, rows, cfg.num_generations)
    batch = ext.batch
    width = completion_width(ext.width, cfg.max_completion_length, cfg.completion_bucket)
    compiling = compile_quietly(s, batch.prompt_ids.shape, num_rewards, width, plan) if first else None
    rollout = s.programs.finish(s.state, ext.rollout, width)
    reference = ReadyTime(rollout.ref_logps)
    t_sampled = time.perf_counter()
    scored = score_external(s.prepared.reward_funcs, ext, context)
    return batch, rollout, reference, t_sampled, scored, compiling


def per_generation(s: Session) -> bool:
    """Whether a step is one generation batch, logged as one record (PPO: TRL 1.12 logs once per update)."""
    return s.programs.cfg.algorithm.step_unit == "generation"


def epoch_of(it: PromptIterator) -> float:
    """Epochs of the prompt set done, fractional (TRL's `epoch`)."""
    return it.epoch + it.index / (it.batches_per_epoch * it.batch_size)


def log_step(s: Session, progress: Progress, step: int, t0: float, out: StepOutcome) -> None:
    """The record of step `step`: the logging window's means (`rloo_jax.logwindow`, TRL's semantics), with the
    host counters, the learning rate that step used and its share of the generation batch's wall time
    (`step_time` and the phases that partition it, divided among the batch's steps), to every sink (process 0) and
    the console. Where a step is a generation batch (PPO), TRL 1.12's `lr` and `episode` (completions so far)."""
    logged = rename_reward_metrics(s.window.read(), s.names)
    per_gen = max(1, out.steps)
    rate = {"learning_rate": float(s.lr_at(step - 1))}
    if per_generation(s):
        rate = {"lr": rate["learning_rate"], "episode": step * s.cfg.generation_batch_size}
    logged.update(
        num_tokens=float(s.num_tokens),
        skipped_steps=out.skipped,
        **rate,
        epoch=epoch_of(s.iterator),
        num_truncated_prompts=s.truncated_prompts,
        **{name: seconds / per_gen for name, seconds in out.timings.items()},
        step_time=(out.end - t0) / per_gen,
    )
    s.last_logged = dict(logged)
    if s.place.is_main:
        s.sinks.log(step, logged)
        s.trainer_state.log_history.append({"step": step, **logged})
        shown = {k: float("nan") if v is None else v for k, v in logged.items()}
        progress.console.print(console_line(step, s.total_steps, shown), soft_wrap=True)
    s.callbacks.call("on_log", s.cfg, s.trainer_state, logs=dict(logged))


def record_rollouts(s: Session, progress: Progress, out: StepOutcome) -> None:
    """Every completion of this step to rollouts.jsonl (process 0 gathers every process's rows) and a sample."""
    scored = out.scored
    targets, _ = s.programs.score(out.rollout, out.rewards, s.weights)
    adv = s.programs.step.algorithm.record_advantages(s.place.gather(targets["advantages"]),
                                                      s.place.gather(out.rollout.completion_mask))
    device = s.place.gather(out.rollout.scores) if out.rollout.scores is not None else None
    r = out.rollout  # its token ids and every model's per-token log-probs, recorded beside the text
    tokens = TokenRecords(s.place.gather(r.completion_ids), s.place.gather(r.completion_mask), {
        name: s.place.gather(x) for name, x in logprob_series(r.old_logps, r.ref_logps, r.sampler_logps).items()})
    if s.place.multi_process:  # every process takes part in the gathers; process 0 decodes
        all_ids = tokens.completion_ids
        all_rewards = s.place.gather(scored.rewards_per_func)
        if s.place.is_main:
            prompts = prompt_texts(s.prepared.train_ds[out.idx], s.prepared.tokenizer)
            scored = decode(s.prepared, prompts, all_ids, s.cfg.num_generations, all_rewards)
    if device is not None:  # the device reward models' scores first, as the rewards' columns and weights
        scored = dataclasses.replace(scored, rewards_per_func=np.concatenate([device, scored.rewards_per_func], 1))
    if s.place.is_main:
        conv = out.conversations
        tool_mask = None if conv is None else np.asarray(out.rollout.tool_mask)
        records = rollout_records(
            s.step, scored.prompts, scored.completions, s.names, scored.rewards_per_func,
            weighted_rewards(scored.rewards_per_func, s.prepared.reward_weights),
            adv, scored.lengths, scored.truncated, out.extra, tokens,
            None if conv is None else [conversation_record(conv, r, tool_mask[r]) for r in range(len(tool_mask))],
        )  # fmt: skip
        s.rollouts.write(records)
        if s.cfg.log_completions:  # the last step's rows are written, not printed, without it
            print_completions(progress.console, records, s.cfg.num_completions_to_print)


def finish(s: Session, stopped: bool) -> None:
    """The trained policy as a Hugging Face folder (process 0), or, after a stop request, where to resume."""
    if stopped and s.step < s.total_steps:
        if s.place.is_main:
            where = f"checkpoint {os.path.join(s.paths['checkpoints'], str(s.step))}" if s.step else "no step done"
            print(
                f"Stopped by {s.stopped_by or 'SIGTERM'} at step {s.step}/{s.total_steps} ({where}); "
                "run the same command to resume"
            )
        return
    bad = nonfinite_leaves(s.state.params)
    if bad:
        raise NonFiniteError(f"refusing to export {s.paths['final']}: non-finite values in {', '.join(bad[:3])}")
    export(s)
    if s.place.is_main:
        print(f"Done: {s.step} optimizer steps. Outputs in {outputs.join(s.cfg.output_dir)}:")
        names = ("metrics", "rollouts", "checkpoints", "final") + ("final_merged",) * s.cfg.merge_adapter_on_export \
            + ("final_value",) * (s.state.value_params is not None)
        for name in (*names, "config"):
            print(f"  {name:12s} {s.paths[name]}")


def export(s: Session) -> None:
    """`final/`: the policy as a Hugging Face folder, or with LoRA a PEFT adapter folder (plus, with
    merge_adapter_on_export, `final_merged/`: the base with the adapters folded in); written by `rloo_jax.export`
    (the `python -m rloo_jax.export` code) in export_dtype, sharded past export_max_shard_size."""
    # the export needs the parameters on the host: gathered from every process's shards (all take part)
    gather = (lambda t: t) if s.place.mesh is None else s.place.gather_tree
    value = None if s.state.value_params is None else gather(s.state.value_params)
    if not s.cfg.use_peft:
        host_params = gather(s.state.params)
        model = nnx.merge(s.graphdef, host_params) if s.place.is_main else None
    else:
        adapters = gather(s.state.params)
        base = gather(s.state.frozen) if s.cfg.merge_adapter_on_export else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s.state.frozen)  # the adapter export reads no base
        model = nnx.merge(s.graphdef, base, adapters) if s.place.is_main else None
    if not s.place.is_main:
        return
    options = {"dtype": write.resolve_dtype(s.cfg.export_dtype, s.prepared.model.config.hf_config),
               "max_shard_size": s.cfg.export_max_shard_size, "tokenizer": s.prepared.tokenizer,
               "generation": write.generation_config(s.prepared.eos_ids, s.prepared.tokenizer.pad_token_id,
                                                     s.cfg.to_dict(),
                                                     write.base_generation_config(s.prepared.model_dir))}
    write.write_policy(model, s.paths["final"], **options,
                       base_name=write.adapter_base_name(s.cfg.policy_path, s.prepared.model_dir))
    if s.cfg.use_peft and s.cfg.merge_adapter_on_export:
        write.write_policy(model, s.paths["final_merged"], **options, merged=True)
    if value is not None:  # the trained value model, a sequence-classification folder (PPO)
        write.write_policy(nnx.merge(s.programs.step.value_graphdef, value), s.paths["final_value"],
                           **{**options, "generation": None})  # a sequence classifier: nothing to generate


def train(cfg: TrainConfig, given: Given | None = None) -> TrainResult:
    """Prepared training (resuming from output_dir's newest checkpoint); returns the last logged metrics and the output
    paths (also after a SIGTERM, once the checkpoint is saved). `given`: the Python API's objects (RLOOTrainer)."""
    with StopRequest() as stop, numerics.kept_matmul_precision():  # the run's precision, not the session's
        s = setup(cfg, given)
        try:
            resume(s)
            started, first_step = time.perf_counter(), s.step
            s.callbacks.call("on_train_begin", s.cfg, s.trainer_state)
            stopped = loop(s, stop)
            summary = train_summary(s, time.perf_counter() - started, s.step - first_step)
            if not stopped:
                s.trainer_state.log_history.append(summary)
                s.callbacks.call("on_log", s.cfg, s.trainer_state, logs=dict(summary))
            s.callbacks.call("on_train_end", s.cfg, s.trainer_state)
        finally:
            for thread in s.compiling:  # a failed step's compile ends here, not at the interpreter's exit
                thread.join()
            if s.ckpt is not None:
                s.ckpt.close()  # waits for an in-flight save; a failed step never starts a new one
            if s.sinks is not None:
                s.sinks.close()
                s.rollouts.close()
        s.stopped_by = stop.signal
        finish(s, stopped)
    return TrainResult(s.last_logged, s.step, stopped, s.paths, s.trainer_state, summary)


def train_summary(s: "Session", seconds: float, steps: int) -> dict[str, float]:
    """transformers' end-of-training record: runtime and throughput of this session's `steps`, `train_loss` (the
    sum of this session's step losses over all steps done, resumed ones included, as the Trainer divides),
    `total_flos` (not counted: 0), `epoch` and `step`."""
    samples = steps * s.cfg.per_device_train_batch_size * s.cfg.data_shards * s.cfg.gradient_accumulation_steps
    seconds = max(seconds, 1e-9)
    return {"train_runtime": round(seconds, 4), "train_samples_per_second": round(samples / seconds, 3),
            "train_steps_per_second": round(steps / seconds, 3), "total_flos": 0.0,
            "train_loss": s.loss_sum / max(s.step, 0.001), "epoch": epoch_of(s.iterator), "step": s.step}


def evaluate_run(cfg: TrainConfig, given: Given | None = None) -> dict[str, float]:
    """`trainer.evaluate()`: the run's evaluation sets sampled and scored at the newest checkpoint in output_dir (the
    initial policy without one), logged as a training run's evaluations are."""
    with numerics.kept_matmul_precision():
        s = setup(cfg, given)
        if not s.prepared.eval_ds:
            raise ConfigError("evaluate() needs an evaluation set: pass eval_dataset, or set args.eval_steps (or "
                              "eval_strategy='epoch') to evaluate on dataset_test_split")
        try:
            resume(s)
            return evaluate_all(s)
        finally:
            if s.ckpt is not None:
                s.ckpt.close()
            if s.sinks is not None:
                s.sinks.close()
                s.rollouts.close()


