"""`python -m rloo_jax.train [--config FILE.yaml] [--name value ...]`: the RLOO training loop.

Four phases, each a function: `setup` (multi-process start, config, everything built by `rloo_jax.build`, the
step and its state; nothing written yet, so a bad invocation leaves an existing output_dir untouched) -> `resume`
(the newest checkpoint, the records after it dropped, outputs opened) -> `loop` (for each generation: prompts,
rollout (jitted), decode, rewards (host), update (jitted), metrics, records, evaluation, checkpoint, reference sync)
-> `finish` (the final Hugging Face export). `--compile_only` stops after building and compiles instead
(`rloo_jax.aot`).

With more than one device the step runs on a (data, fsdp, tensor) mesh (`rloo_jax.mesh`). Every process runs this
same loop on the same global batch indices; it encodes, decodes and rewards only its own rows (`Placement`), the
step sees global arrays, and only process 0 writes logs, records, config.yaml and final/ (checkpoints are written by
all processes together through orbax).
"""

import dataclasses
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rloo_jax import aot, demo
from rloo_jax.build import (
    CACHE_ROOT,
    Run,
    eos_token_ids,
    lr_schedule,
    make_optimizer,
    policy,
    prepare,
    rollout_mesh_shape,
    sampling_config,
    step_config,
)
from rloo_jax.checkpoint import Checkpointer, NonFiniteError, nonfinite_leaves
from rloo_jax.config import (
    RLOOConfig,
    compile_only_slice,
    distributed_options,
    format_help,
    load_config,
    parse_argv,
)
from rloo_jax.data import PromptBatch, PromptIterator, eval_batches, is_conversational
from rloo_jax.errors import ConfigError, DataError, RewardError
from rloo_jax.lora import merge_adapters
from rloo_jax.mesh import (
    host_local_batch_to_global,
    initialize_distributed,
    local_rows,
    make_mesh,
    process_slice,
    replicate,
    reshaped,
)
from rloo_jax.metrics import (
    JsonlWriter,
    Sinks,
    WindowMean,
    console_line,
    drop_records_after,
    json_safe,
    rename_reward_metrics,
    rollout_records,
    weighted_rewards,
)
from rloo_jax.models import ModelLoadError, save_adapter, save_pretrained
from rloo_jax.rewards import compute_rewards, format_reward_error, repeat_per_generation
from rloo_jax.rloo import RLOOOptions
from rloo_jax.sampling import generate
from rloo_jax.step import RLOOStep, StepConfig, completion_width, policy_params

logger = logging.getLogger("rloo_jax")
__all__ = ["CACHE_ROOT", "eos_token_ids", "lr_schedule", "main", "make_optimizer", "train"]  # re-exported: old paths


# ------------------------------------------------------------------------------------------------ pure helpers
fold_in = jax.jit(jax.random.fold_in)  # the per-step key: one dispatch instead of eager ops (~1 ms a step)


def cpu_compile_flags(environ: dict[str, str] = os.environ) -> None:
    """On a CPU-only install, add ``--xla_llvm_disable_expensive_passes=true`` to XLA_FLAGS (unless set).

    XLA:CPU runs the matmuls in library kernels (YNNPACK/Eigen), so LLVM's expensive passes buy no measured step
    time but cost ~15% of the first step's compile (BENCHMARKS.md). Accelerator installs are left alone: there
    LLVM emits the GPU kernels. Must run before the first JAX computation (XLA reads its flags once).
    """
    flags = environ.get("XLA_FLAGS", "")
    accelerators = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "jax_rocm60_plugin", "libtpu")
    on_cpu = environ.get("JAX_PLATFORMS", "").strip() == "cpu" or not any(
        importlib.util.find_spec(name) for name in accelerators
    )
    if on_cpu and "xla_llvm_disable_expensive_passes" not in flags:
        environ["XLA_FLAGS"] = f"{flags} --xla_llvm_disable_expensive_passes=true".strip()


def compile_quietly(
    step_fn: RLOOStep, state: Any, prompt_shape: tuple[int, int], weights: jax.Array, width: int
) -> threading.Thread:
    """`RLOOStep.compile_update` in a background thread (started): a failure there is left to the real call,
    which compiles again and raises it with its own message."""
    thread = threading.Thread(target=_compile_update, args=(step_fn, state, prompt_shape, weights, width),
                              daemon=True)
    thread.start()
    return thread


def _compile_update(step_fn: RLOOStep, state: Any, prompt_shape: tuple[int, int], weights: jax.Array,
                    width: int) -> None:
    try:
        step_fn.compile_update(state, prompt_shape, weights, width)
    except Exception:  # noqa: BLE001 -- reported by the update call itself
        logging.getLogger(__name__).debug("ahead-of-time compile of update failed", exc_info=True)


def skipped_updates(opt_state: Any) -> tuple[int, int]:
    """(consecutive, total) updates skipped for non-finite loss/gradients, read from `make_optimizer`'s state."""
    consecutive, total = jax.device_get((opt_state.notfinite_count, opt_state.total_notfinite))
    return int(consecutive), int(total)


def completion_lengths(completion_ids: np.ndarray, eos_token_ids: Sequence[int]) -> np.ndarray:
    """EOS-cut lengths [N]: up to and including the first EOS, else C. [[5, 1, 0], [5, 6, 7]], eos 1 -> [2, 3]."""
    is_eos = np.isin(completion_ids, list(eos_token_ids))
    first = np.where(is_eos.any(axis=1), is_eos.argmax(axis=1) + 1, completion_ids.shape[1])
    return first.astype(np.int32)


def crossed(previous: int, current: int, every: int | None) -> bool:
    """True when a multiple of `every` lies in (previous, current] (a step may advance by several updates)."""
    return bool(every) and current // every > previous // every


# ------------------------------------------------------------------------------------------------ setup
def build_config(argv: Sequence[str], device_count: int = 1, process_count: int = 1) -> RLOOConfig:
    """The run config, checked for `device_count` devices in `process_count` processes; with neither --config nor
    --model_name_or_path, the built-in demo is the base."""
    config_path, overrides = parse_argv(argv)
    if config_path is None and "model_name_or_path" not in overrides:
        if process_count == 1 or jax.process_index() == 0:
            logger.warning("no --config and no --model_name_or_path: running the built-in demo (configs/default.yaml)")
        return load_config(argv, demo.DEFAULT_CONFIG, device_count, process_count)
    return load_config(argv, None, device_count, process_count)


def start_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """Join a multi-process run (explicit options, JAX_* variables, or a detected SLURM / Open MPI / TPU-pod
    launch; nothing on a plain single host). Must run before any other JAX work."""
    try:
        initialize_distributed(coordinator_address, num_processes, process_id)
    except ValueError as e:
        raise ConfigError(f"{e}; pass all of --coordinator_address, --num_processes and --process_id") from None


def for_this_machine(cfg: RLOOConfig) -> RLOOConfig:
    """`cfg` validated for the devices and processes JAX sees now (a copy when they differ from cfg's)."""
    if (cfg.device_count, cfg.process_count) == (jax.device_count(), jax.process_count()):
        return cfg
    return dataclasses.replace(cfg, device_count=jax.device_count(), process_count=jax.process_count())


def enable_compilation_cache(cfg: RLOOConfig) -> None:
    if cfg.compilation_cache:
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cfg.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)




@dataclasses.dataclass(frozen=True)
class Placement:
    """Where batches live: the default device (`mesh` None, one device) or a mesh over every process's devices.

    Each process handles the rows `rows(n)` of a global batch of `n` (all of them with one process); `to_global`
    turns its rows into a global array sharded over the mesh, `local` reads its rows of a global array back,
    `gather` gives every process all rows (a collective: every process must call it).
    """

    mesh: Mesh | None

    @property
    def is_main(self) -> bool:
        """Process 0: the one that writes logs, records, config.yaml and final/."""
        return jax.process_index() == 0

    @property
    def multi_process(self) -> bool:
        return jax.process_count() > 1

    def rows(self, n: int) -> slice:
        return slice(0, n) if self.mesh is None else process_slice(n)

    def to_global(self, local: np.ndarray) -> jax.Array:
        return jnp.asarray(local) if self.mesh is None else host_local_batch_to_global(local, self.mesh)

    def replicate(self, value: Any) -> Any:
        return value if self.mesh is None else replicate(value, self.mesh)

    def local(self, x: jax.Array) -> np.ndarray:
        return np.asarray(x) if self.mesh is None else local_rows(x)

    def gather(self, x: Any) -> np.ndarray:
        """All rows, on every process: of a global array, or of each process's own rows concatenated in order."""
        if not self.multi_process:
            return np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    def gather_tree(self, tree: Any) -> Any:
        """A pytree of (sharded) global arrays -> the same pytree of whole numpy arrays, on every process."""
        if not self.multi_process:
            return jax.device_get(tree)
        return multihost_utils.process_allgather(tree, tiled=True)

    def per_process(self, values: Sequence[int]) -> np.ndarray:
        """[process_count, k] int32: every process's `values` ([1, k] with one process, no communication)."""
        mine = np.asarray(values, np.int32)[None]
        return self.gather(mine) if self.multi_process else mine

    def host_key(self, key: jax.Array) -> jax.Array:
        """A (replicated) global PRNG key -> the same key on this process's default device."""
        if self.mesh is None:
            return key
        return jax.random.wrap_key_data(np.asarray(jax.random.key_data(key)), impl=jax.random.key_impl(key))

    def any(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (one process: `flag`)."""
        return bool(self.per_process([int(flag)]).max())


def encode_rows(run: "Run", place: Placement, rows: dict[str, list[Any]]) -> PromptBatch:
    """Encode this process's prompt rows. With several processes, every process left-pads to the widest prompt
    batch of all processes and counts truncated prompts over all, so the global batch is exactly what one process
    encoding every row would build."""
    batch = run.encoder(rows)
    if not place.multi_process:
        return batch
    facts = place.per_process([batch.prompt_ids.shape[1], batch.num_truncated])
    pad = ((0, 0), (int(facts[:, 0].max()) - batch.prompt_ids.shape[1], 0))
    return dataclasses.replace(
        batch,
        prompt_ids=np.pad(batch.prompt_ids, pad, constant_values=prompt_pad_id(run.tokenizer)),
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
    run: Run, prompts: list[Any], completion_ids: np.ndarray, num_generations: int, rewards_per_func: np.ndarray
) -> Scored:
    """Decode completions (EOS-cut, special tokens skipped, as TRL) next to their prompts and given rewards."""
    lengths = completion_lengths(completion_ids, run.eos_ids)
    ids = [completion_ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
    texts = run.tokenizer.batch_decode(ids, skip_special_tokens=True)
    chat = is_conversational(prompts[0])
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else texts
    truncated = ~np.isin(completion_ids[np.arange(len(lengths)), lengths - 1], list(run.eos_ids))
    return Scored(repeat_per_generation(prompts, num_generations), completions, lengths, truncated, rewards_per_func)


def decode_and_score(run: Run, batch: PromptBatch, completion_ids: np.ndarray, num_generations: int) -> Scored:
    """Decode completions (special tokens skipped, as TRL) and call every reward function."""
    scored = decode(run, batch.prompts, completion_ids, num_generations, np.zeros((0, 0), np.float32))
    ids = [completion_ids[i, :n].tolist() for i, n in enumerate(scored.lengths)]
    columns = {k: repeat_per_generation(v, num_generations) for k, v in batch.columns.items()}
    scored.rewards_per_func = compute_rewards(run.reward_funcs, scored.prompts, scored.completions, ids, columns)
    return scored


def evaluate(
    run: Run, place: Placement, graphdef: Any, state: Any, key: jax.Array, names: list[str], sampler: Any = None
) -> dict[str, float]:
    """Sample num_generations_eval completions per test prompt and report reward / length statistics.

    `sampler`: None on one device (the plain `generate` on the merged policy); with a mesh, an `RLOOStep` whose
    rollout samples with the evaluation `SamplingConfig` on the sharded state (no parameter gather). Every process
    encodes, samples for and rewards its share of each evaluation batch; the statistics use all rows.
    """
    cfg = run.cfg
    g = cfg.resolved_num_generations_eval
    sc = sampling_config(cfg, run, g)
    model = nnx.merge(graphdef, policy_params(state)) if sampler is None else None
    per_func, lengths, truncated = [], [], []
    for i, (idx, real) in enumerate(eval_batches(len(run.eval_ds), cfg.eval_batch_size // g)):
        rows = place.rows(len(idx))
        batch = encode_rows(run, place, run.eval_ds[idx[rows]])
        batch_key = jax.random.fold_in(key, i)
        if sampler is None:
            completion_ids = np.asarray(
                generate(
                    model,
                    batch.prompt_ids,
                    batch.prompt_mask,
                    key=batch_key,
                    max_new_tokens=sc.max_new_tokens,
                    num_generations=g,
                    temperature=sc.temperature,
                    top_k=sc.top_k,
                    top_p=sc.top_p,
                    min_p=sc.min_p,
                    repetition_penalty=sc.repetition_penalty,
                    eos_token_ids=sc.eos_token_ids,
                    pad_token_id=sc.pad_token_id,
                    prompt_bucket=cfg.prompt_bucket,
                ).completion_ids
            )
        else:
            ids, mask = place.to_global(batch.prompt_ids), place.to_global(batch.prompt_mask)
            completion_ids = place.local(sampler.rollout(state, ids, mask, place.replicate(batch_key)).completion_ids)
        scored = decode_and_score(run, batch, completion_ids, g)
        keep = slice(0, real * g)  # drop the rows padding the last batch (global row order)
        per_func.append(place.gather(scored.rewards_per_func)[keep])
        lengths.append(place.gather(scored.lengths)[keep])
        truncated.append(place.gather(scored.truncated)[keep])
    per_func, lengths, truncated = np.concatenate(per_func), np.concatenate(lengths), np.concatenate(truncated)
    reward = weighted_rewards(per_func, cfg.resolved_reward_weights)
    out = {"reward": float(np.nanmean(reward)), "reward_std": float(np.nanstd(reward, ddof=1))}
    for f, name in enumerate(names):
        out[f"rewards/{name}/mean"] = float(np.nanmean(per_func[:, f]))
        out[f"rewards/{name}/std"] = float(np.nanstd(per_func[:, f], ddof=1))
    out["completions/mean_length"] = float(lengths.mean())
    out["completions/clipped_ratio"] = float(truncated.mean())
    return {f"eval_{k}": v for k, v in out.items()}


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

    cfg: RLOOConfig
    run: Run
    place: Placement
    step_fn: RLOOStep
    graphdef: Any
    iterator: PromptIterator
    total_steps: int
    lr_at: Any  # jitted learning-rate schedule
    weights: jax.Array  # [F] reward weights (replicated on a mesh)
    names: list[str]  # reward function names, for metrics
    eval_key: jax.Array
    eval_sampler: RLOOStep | None
    paths: dict[str, str]
    state: Any  # TrainState
    base_key: jax.Array
    step: int = 0  # optimizer updates done
    num_tokens: int = 0  # host counters, carried in the checkpoint's meta
    truncated_prompts: int = 0
    saved: int | None = None  # the step of the newest checkpoint
    stopped_by: str | None = None  # the signal that stopped the loop
    window: WindowMean = dataclasses.field(default_factory=WindowMean)
    ckpt: Checkpointer | None = None
    sinks: Sinks | None = None
    rollouts: JsonlWriter | None = None


def setup(cfg: RLOOConfig) -> Session:
    """Build the run, its step and its fresh state; nothing is written."""
    start_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    cfg = for_this_machine(cfg)
    enable_compilation_cache(cfg)
    if cfg.remat_policy == "full_offloaded" and cfg.gradient_checkpointing and jax.default_backend() == "cpu":
        # (None, the default, leaves checkpointing off on the CPU)
        raise ConfigError("remat_policy full_offloaded moves block inputs to host memory, which needs a TPU or GPU; "
                          "on CPU use --remat_policy full")
    run = prepare(cfg)
    place = Placement(make_mesh(*cfg.mesh_shape) if cfg.device_count > 1 else None)
    iterator = PromptIterator(len(run.train_ds), cfg.prompts_per_generation, cfg.seed, cfg.shuffle_dataset)
    scfg = step_config(cfg, run)
    if cfg.max_steps > 0:
        total = cfg.max_steps
    else:
        total = int(np.ceil(cfg.num_train_epochs * iterator.batches_per_epoch)) * scfg.updates_per_generation
    optimizer, schedule = make_optimizer(cfg, total)
    lr_at = jax.jit(schedule)  # one dispatch, not a handful of eager ops, per logged step
    lr_at(0)  # compiled here, not at the first logged step (no compile after step 1)
    pol = policy(cfg, run.model)  # the whole model, or with use_peft adapters on a frozen base
    graphdef = pol.graphdef
    # the sampler's own layout over the same devices (`rollout_mesh`; the training mesh where nothing is gained)
    rollout_mesh = None if place.mesh is None else reshaped(place.mesh, rollout_mesh_shape(cfg, run))
    step_fn = RLOOStep(graphdef, optimizer, scfg, mesh=place.mesh, ref_graphdef=pol.ref_graphdef,
                       rollout_mesh=rollout_mesh)
    # with a mesh: placed on its shardings (FSDP / tensor parallel)
    state = step_fn.init_state(pol.params, pol.ref_params, pol.frozen)
    eval_sampler = None
    if place.mesh is not None and run.eval_ds is not None:
        # evaluation samples on the sharded state through a rollout with the evaluation SamplingConfig (beta 0:
        # no reference log-probs); it shares the training state's shardings instead of initialising its own
        eval_scfg = StepConfig(sampling=sampling_config(cfg, run, cfg.resolved_num_generations_eval),
                               rloo=RLOOOptions(beta=0.0))
        eval_sampler = RLOOStep(graphdef, optimizer, eval_scfg, mesh=place.mesh, rollout_mesh=rollout_mesh)
        eval_sampler.state_shardings = step_fn.state_shardings
    out = os.path.abspath(cfg.output_dir)
    paths = {
        "metrics": os.path.join(out, "metrics.jsonl"),
        "rollouts": os.path.join(out, "rollouts.jsonl"),
        "checkpoints": os.path.join(out, "checkpoints"),
        "final": os.path.join(out, "final"),
        "final_merged": os.path.join(out, "final_merged"),
        "config": os.path.join(out, "config.yaml"),
    }
    return Session(
        cfg=cfg, run=run, place=place, step_fn=step_fn, graphdef=graphdef, iterator=iterator, total_steps=total,
        lr_at=lr_at, weights=place.replicate(jnp.asarray(cfg.resolved_reward_weights, jnp.float32)),
        names=[f.name for f in run.reward_funcs], eval_key=jax.random.key(cfg.seed + 1),  # eval: its own randomness
        eval_sampler=eval_sampler, paths=paths, state=state, base_key=jax.random.key(cfg.seed),
    )


def resume(s: Session) -> None:
    """Open the outputs; restore the newest checkpoint if there is one and drop the records logged after it."""
    os.makedirs(os.path.abspath(s.cfg.output_dir), exist_ok=True)
    s.ckpt = Checkpointer(s.paths["checkpoints"], max_to_keep=s.cfg.save_total_limit)  # every process: collective
    latest = s.ckpt.latest_step()
    if latest is not None:
        check_layout(s.ckpt.read_meta(latest), layout(s), latest)
        # onto its shardings; a LoRA checkpoint holds the adapters and their optimizer state, not the frozen base
        restored, key, meta = s.ckpt.restore(latest, s.state.replace(frozen=None), s.place.replicate(s.base_key))
        s.state = restored.replace(frozen=s.state.frozen)
        s.base_key = s.place.host_key(key)
        s.iterator.load_state_dict(meta["data"])
        s.step = s.saved = int(meta["step"])
        counters = meta.get("counters", {})
        s.num_tokens = int(counters.get("num_tokens", 0))
        s.truncated_prompts = int(counters.get("num_truncated_prompts", 0))
        s.window.load_state_dict(meta.get("window", {}))
        if s.place.mesh is not None and s.window.total is not None:  # onto the mesh, like the metrics added to it
            s.window.total = s.place.replicate(s.window.total)
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
    elif dropped:
        print(f"No checkpoint in {s.paths['checkpoints']}: starting over (dropped {dropped} records of an earlier run)")
    with open(s.paths["config"], "w", encoding="utf-8") as f:
        f.write(s.cfg.to_yaml())
    s.sinks = Sinks(os.path.abspath(s.cfg.output_dir), s.cfg.report_to, json_safe(s.cfg.to_dict()))
    s.rollouts = JsonlWriter(s.paths["rollouts"])


def layout(s: Session) -> dict[str, Any]:
    """What a checkpoint's state is shaped by: the block layout and the adapters (None: full fine-tuning)."""
    lora = s.cfg.use_peft and {"r": s.cfg.lora_r, "target_modules": s.cfg.lora_target_modules}
    return {"scan_layers": s.run.model.config.scan_layers, "lora": lora or None}


def check_layout(meta: dict[str, Any], current: dict[str, Any], step: int) -> None:
    """A checkpoint restores onto the parameter layout it was written with (stacked blocks or a list of them;
    adapters or the whole model); checkpoints from before the layout was recorded hold a list, no adapters."""
    saved = meta.get("layout", {}).get("scan_layers", False)
    if saved != current["scan_layers"]:
        raise ConfigError(
            f"checkpoint {step} holds the {'stacked' if saved else 'per-layer'} parameter layout of scan_layers="
            f"{str(saved).lower()}; resume with --scan_layers {str(saved).lower()} (the numbers are the same)"
        )
    lora = meta.get("layout", {}).get("lora")
    if lora != current["lora"]:
        held = "full fine-tuning" if lora is None else f"LoRA adapters (lora_r {lora['r']}, lora_target_modules " \
            f"{lora['target_modules']})"
        raise ConfigError(f"checkpoint {step} holds {held}; resume with the same use_peft / lora_r / "
                          "lora_target_modules, or start a new output_dir")


def save(s: Session) -> None:
    meta = {
        "layout": layout(s),
        "data": s.iterator.state_dict(),
        "step": s.step,
        "counters": {"num_tokens": s.num_tokens, "num_truncated_prompts": s.truncated_prompts},
        "window": s.window.state_dict(),
    }
    # the frozen base (LoRA) is not saved: resume reads it from model_name_or_path again
    s.ckpt.save(s.step, s.state.replace(frozen=None), s.place.replicate(s.base_key), meta)
    s.saved = s.step


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
    with progress:
        task = progress.add_task("train", total=s.total_steps, completed=s.step)
        while s.step < s.total_steps and not stop_requested():
            t0, prev = time.perf_counter(), s.step
            idx, batch, rollout, scored, rewards, metrics = train_step(s, first=s.step == start)
            consecutive, skipped = skipped_updates(s.state.opt_state)  # skipped params/moments: unchanged
            diverged = consecutive >= s.cfg.max_consecutive_nonfinite
            if s.cfg.sync_ref_model and crossed(prev, s.step, s.cfg.ref_model_sync_steps):
                s.state = s.step_fn.sync_reference(s.state, s.cfg.ref_model_mixup_alpha)
            last = s.step >= s.total_steps
            # every record of a step is written before its checkpoint is started: a resume drops the records
            # after the checkpoint and redoes them, so none is lost or doubled
            if crossed(prev, s.step, s.cfg.logging_steps) or last or diverged:
                log_step(s, progress, prev, t0, skipped)
                if s.cfg.log_completions or last:
                    record_rollouts(s, progress, idx, rollout, scored, rewards)
            if diverged:  # logged above; nothing is evaluated or saved
                raise NonFiniteError(
                    f"{consecutive} consecutive optimizer updates had a non-finite loss or gradients "
                    f"(step {s.step}, {skipped} skipped in all; max_consecutive_nonfinite = "
                    f"{s.cfg.max_consecutive_nonfinite}); lower --learning_rate or --max_grad_norm, check the "
                    "rewards for extreme values, or resume from an earlier checkpoint"
                )
            if s.run.eval_ds is not None and (crossed(prev, s.step, s.cfg.eval_steps) or last):
                eval_metrics = evaluate(s.run, s.place, s.graphdef, s.state, jax.random.fold_in(s.eval_key, s.step),
                                        s.names, s.eval_sampler)
                if s.place.is_main:
                    s.sinks.log(s.step, eval_metrics)
                    progress.console.print(
                        f"eval step {s.step}: reward {eval_metrics['eval_reward']:.3f} "
                        f"(len {eval_metrics['eval_completions/mean_length']:.1f})"
                    )
            if crossed(prev, s.step, s.cfg.save_steps) or last or stop_requested():
                save(s)
            progress.update(task, completed=s.step)
    stopped = stop_requested()
    if stopped and s.step > 0 and s.saved != s.step:
        save(s)  # the signal came after this step's save decision
    return stopped


def train_step(s: Session, first: bool) -> tuple:
    """One generation batch: prompts -> rollout -> decode and rewards (host) -> update(s)."""
    cfg, place = s.cfg, s.place
    idx = next(s.iterator)  # the same global batch on every process; each one handles its rows
    batch = encode_rows(s.run, place, s.run.train_ds[idx[place.rows(len(idx))]])
    s.truncated_prompts += batch.num_truncated
    key = place.replicate(fold_in(s.base_key, s.step))
    ids, mask = place.to_global(batch.prompt_ids), place.to_global(batch.prompt_mask)
    longest = cfg.max_completion_length
    one_width = completion_width(1, longest, cfg.completion_bucket) == longest
    # the first step compiles update in a thread while the rollout compiles and runs (from the start when its
    # width is known: one completion width; else once the samples tell it)
    compiling = compile_quietly(s.step_fn, s.state, ids.shape, s.weights, longest) if first and one_width else None
    rollout = s.step_fn.sample(s.state, ids, mask, key)
    if not one_width:
        longest = s.step_fn.longest(rollout)
    width = completion_width(longest, cfg.max_completion_length, cfg.completion_bucket)
    if first and compiling is None:
        compiling = compile_quietly(s.step_fn, s.state, ids.shape, s.weights, width)
    rollout = s.step_fn.finish(s.state, rollout, width)  # cut to `width`, reference log-probs
    scored = decode_and_score(s.run, batch, place.local(rollout.completion_ids), cfg.num_generations)
    local_tokens = int(batch.prompt_mask.sum()) * cfg.num_generations + int(scored.lengths.sum())
    s.num_tokens += int(place.per_process([local_tokens]).sum())
    rewards = place.to_global(scored.rewards_per_func)
    if compiling is not None:
        compiling.join()  # before update donates the state it reads
    s.state, metrics = s.step_fn.update(s.state, rollout, rewards, s.weights)
    s.step += s.step_fn.cfg.updates_per_generation
    s.window.add(metrics)
    return idx, batch, rollout, scored, rewards, metrics


def log_step(s: Session, progress: Progress, prev: int, t0: float, skipped: int) -> None:
    """The logging window's means, with the host counters, to every sink (process 0) and the console."""
    logged = rename_reward_metrics(s.window.read(), s.names)
    per_gen = s.step_fn.cfg.updates_per_generation
    it = s.iterator
    logged.update(
        num_tokens=float(s.num_tokens),
        skipped_steps=skipped,
        step_time=time.perf_counter() - t0,
        learning_rate=float(s.lr_at(prev + per_gen - 1)),
        epoch=it.epoch + it.index / (it.batches_per_epoch * it.batch_size),
        num_truncated_prompts=s.truncated_prompts,
    )
    if s.place.is_main:
        s.sinks.log(s.step, logged)
        progress.console.print(console_line(s.step, s.total_steps, logged), soft_wrap=True)


def record_rollouts(s: Session, progress: Progress, idx: np.ndarray, rollout: Any, scored: "Scored",
                    rewards: jax.Array) -> None:
    """Every completion of this step to rollouts.jsonl (process 0 gathers every process's rows) and a sample."""
    adv, _ = s.step_fn.score(rollout, rewards, s.weights)
    adv = s.place.gather(adv)
    if s.place.multi_process:  # every process takes part in the gathers; process 0 decodes
        all_ids = s.place.gather(rollout.completion_ids)
        all_rewards = s.place.gather(scored.rewards_per_func)
        if s.place.is_main:
            prompts = list(s.run.train_ds[idx]["prompt"])
            scored = decode(s.run, prompts, all_ids, s.cfg.num_generations, all_rewards)
    if s.place.is_main:
        records = rollout_records(
            s.step, scored.prompts, scored.completions, s.names, scored.rewards_per_func,
            weighted_rewards(scored.rewards_per_func, s.cfg.resolved_reward_weights),
            adv, scored.lengths, scored.truncated,
        )  # fmt: skip
        s.rollouts.write(records)
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
        print(f"Done: {s.step} optimizer steps. Outputs in {os.path.abspath(s.cfg.output_dir)}:")
        names = ("metrics", "rollouts", "checkpoints", "final") + ("final_merged",) * s.cfg.merge_adapter_on_export
        for name in (*names, "config"):
            print(f"  {name:12s} {s.paths[name]}")


def export(s: Session) -> None:
    """`final/`: the policy as a Hugging Face folder, or with LoRA a PEFT adapter folder (plus, with
    merge_adapter_on_export, `final_merged/`: the base with the adapters folded in)."""
    # the export needs the parameters on the host: gathered from every process's shards (all take part)
    gather = (lambda t: t) if s.place.mesh is None else s.place.gather_tree
    if not s.cfg.use_peft:
        host_params = gather(s.state.params)
        if s.place.is_main:
            save_pretrained(nnx.merge(s.graphdef, host_params), s.paths["final"], tokenizer=s.run.tokenizer)
        return
    adapters = gather(s.state.params)
    base = gather(s.state.frozen) if s.cfg.merge_adapter_on_export else jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), s.state.frozen)  # the adapter export reads no base
    if not s.place.is_main:
        return
    model = nnx.merge(s.graphdef, base, adapters)
    local = os.path.isdir(os.path.expanduser(s.cfg.model_name_or_path))
    name = os.path.abspath(s.run.model_dir) if local or s.cfg.model_name_or_path == "demo" else \
        s.cfg.model_name_or_path
    save_adapter(model, s.paths["final"], name, tokenizer=s.run.tokenizer)
    if s.cfg.merge_adapter_on_export:
        save_pretrained(merge_adapters(model), s.paths["final_merged"], tokenizer=s.run.tokenizer)


def train(cfg: RLOOConfig) -> dict[str, str]:
    """Run training; returns the output paths (also after a SIGTERM, once the checkpoint is saved)."""
    with StopRequest() as stop:
        s = setup(cfg)
        try:
            resume(s)
            stopped = loop(s, stop)
        finally:
            if s.ckpt is not None:
                s.ckpt.close()  # waits for an in-flight save; a failed step never starts a new one
            if s.sinks is not None:
                s.sinks.close()
                s.rollouts.close()
        s.stopped_by = stop.signal
        finish(s, stopped)
    return s.paths


def print_completions(console: Any, records: list[dict[str, Any]], limit: int | None) -> None:
    """A small table of (prompt, completion, reward, advantage)."""
    table = Table("prompt", "completion", "reward", "advantage", title=f"step {records[0]['step']}")
    for r in records[: limit if limit is not None else len(records)]:
        table.add_row(str(r["prompt"])[-60:], str(r["completion"])[:80], f"{r['reward']:.3f}", f"{r['advantage']:.3f}")
    console.print(table)


# ------------------------------------------------------------------------------------------------ CLI
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
    print(f"report: {report.write(os.path.abspath(cfg.output_dir))}")
    return 0 if report.fits else 1


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Exit codes: 0 on success or after a SIGTERM (checkpoint saved); 2 on a configuration,
    data or model error (one line, nothing written); 1 when training stops on a reward-function error or on
    `max_consecutive_nonfinite` non-finite updates (the last checkpoint is left as it was), or when a
    `--compile_only` program does not fit its slice."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(format_help())
        return 0
    logging.basicConfig(format="%(message)s", level=logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)
    cpu_compile_flags()
    datasets.disable_progress_bars()  # one clean console: our progress bar and lines only
    debug = any(a in ("--debug", "--debug=true", "--debug=1") for a in argv)
    try:
        topology = compile_only_slice(argv)
        if topology is not None:
            return compile_only(argv, topology)
        # the multi-process runtime starts before anything else touches JAX; the config is then checked against
        # the devices of all processes (the mesh sizes and the global batch depend on them)
        start_distributed(*distributed_options(argv))
        cfg = build_config(argv, jax.device_count(), jax.process_count())
        debug = cfg.debug
        train(cfg)
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
