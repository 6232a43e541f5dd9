"""`python -m rloo_jax.train [--config FILE.yaml] [--name value ...]`: the RLOO training loop.

Top to bottom: multi-process start -> config -> tokenizer, policy, frozen reference -> optimizer -> `RLOOStep` ->
resume -> for each generation: prompts, rollout (jitted), decode, rewards (host), update (jitted), metrics, records,
checkpoint, eval, reference sync -> final Hugging Face export. Everything is validated and loaded before the first
file is written, so a bad invocation leaves an existing output_dir untouched.

With more than one device the step runs on a (data, fsdp, tensor) mesh (`rloo_jax.mesh`). Every process runs this
same loop on the same global batch indices; it encodes, decodes and rewards only its own rows (`Placement`), the
step sees global arrays, and only process 0 writes logs, records, config.yaml and final/ (checkpoints are written by
all processes together through orbax).
"""

import dataclasses
import importlib.util
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from rloo_jax import demo
from rloo_jax.checkpoint import Checkpointer, NonFiniteError, nonfinite_leaves
from rloo_jax.config import RLOOConfig, distributed_options, format_help, load_config, parse_argv
from rloo_jax.data import (
    PromptBatch,
    PromptEncoder,
    PromptIterator,
    eval_batches,
    is_conversational,
    load_prompt_dataset,
)
from rloo_jax.errors import ConfigError, DataError, RewardError
from rloo_jax.mesh import (
    host_local_batch_to_global,
    initialize_distributed,
    local_rows,
    make_mesh,
    process_slice,
    replicate,
)
from rloo_jax.metrics import (
    JsonlWriter,
    Sinks,
    WindowMean,
    check_report_to,
    console_line,
    drop_records_after,
    json_safe,
    rename_reward_metrics,
    rollout_records,
    weighted_rewards,
)
from rloo_jax.models import ModelLoadError, load_causal_lm, load_tokenizer, save_pretrained
from rloo_jax.models.hf import resolve_checkpoint
from rloo_jax.rewards import (
    RewardFunction,
    builtin_rewards,
    compute_rewards,
    format_reward_error,
    load_reward_model_scorer,
    repeat_per_generation,
    resolve_reward_funcs,
)
from rloo_jax.rloo import RLOOOptions
from rloo_jax.sampling import SamplingConfig, generate
from rloo_jax.step import RLOOStep, StepConfig

logger = logging.getLogger("rloo_jax")
CACHE_ROOT = os.environ.get("RLOO_JAX_CACHE", os.path.join("~", ".cache", "rloo_jax"))


# ------------------------------------------------------------------------------------------------ pure helpers
def lr_schedule(kind: str, learning_rate: float, warmup_steps: int, total_steps: int) -> Callable[[Any], Any]:
    """transformers' schedules, counted in optimizer steps (step 0 = the first update).

    Warmup: lr * s / W for s < W. Then linear: lr * (T - s) / (T - W); cosine: lr * (1 + cos(pi * progress)) / 2;
    constant(_with_warmup): lr. E.g. linear, lr 1, W 2, T 6: [0, 0.5, 1, 0.75, 0.5, 0.25].
    """

    def schedule(step: Any) -> Any:
        s = jnp.asarray(step, jnp.float32)
        warm = s / max(1, warmup_steps)
        progress = (s - warmup_steps) / max(1, total_steps - warmup_steps)
        if kind == "linear":
            after = jnp.maximum(0.0, 1.0 - progress)
        elif kind == "cosine":
            after = jnp.maximum(0.0, 0.5 * (1.0 + jnp.cos(jnp.pi * jnp.clip(progress, 0.0, 1.0))))
        elif kind in ("constant", "constant_with_warmup"):
            after = jnp.ones_like(s)
        else:
            raise ConfigError(f"lr_scheduler_type {kind!r} is not supported")
        if kind == "constant":
            return learning_rate * after
        return learning_rate * jnp.where(s < warmup_steps, warm, after)

    return schedule


def make_optimizer(cfg: RLOOConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """clip_by_global_norm -> AdamW (decay on matrices only, as transformers skips biases and norms)."""
    schedule = lr_schedule(
        cfg.lr_scheduler_type, cfg.learning_rate, math.ceil(cfg.warmup_ratio * total_steps), total_steps
    )
    adamw = optax.adamw(
        schedule,
        b1=cfg.adam_beta1,
        b2=cfg.adam_beta2,
        eps=cfg.adam_epsilon,
        weight_decay=cfg.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
    )
    chain = [optax.clip_by_global_norm(cfg.max_grad_norm)] if cfg.max_grad_norm > 0 else []
    # Non-finite gradients skip the whole update (params and AdamW moments kept). The consecutive-skip limit is
    # enforced on the host (`skipped_updates`), so apply_if_finite itself must never fall through and apply one.
    guarded = optax.apply_if_finite(optax.chain(*chain, adamw), max_consecutive_errors=NEVER)
    return guarded, schedule


NEVER = int(np.iinfo(np.int32).max)  # optax's counters saturate there: `count > NEVER` is never true


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


def compile_quietly(step_fn: RLOOStep, state: Any, prompt_shape: tuple[int, int], weights: jax.Array) -> None:
    """`RLOOStep.compile_update` for a background thread: a failure here is left to the real call, which
    compiles again and raises it with its own message."""
    try:
        step_fn.compile_update(state, prompt_shape, weights)
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


def eos_token_ids(model_dir: str, tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's EOS plus every id in the model's generation_config.json (Qwen/Llama-3 have several)."""
    ids = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            extra = json.load(f).get("eos_token_id")
        ids += [int(e) for e in (extra if isinstance(extra, list) else [extra]) if e is not None]
    return tuple(dict.fromkeys(ids))


def refuse_custom_code(model_dir: str) -> None:
    """A tokenizer that only loads through code shipped with the model (`auto_map` in tokenizer_config.json
    and no tokenizer.json) is refused before transformers could offer to run that code."""
    if os.path.isfile(os.path.join(model_dir, "tokenizer.json")):
        return  # loaded as a plain PreTrainedTokenizerFast: no custom code is consulted
    path = os.path.join(model_dir, "tokenizer_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            auto_map = json.load(f).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # missing or unreadable: the loader reports it
    if auto_map:
        raise ModelLoadError(
            f"the tokenizer in {model_dir} needs code shipped with the model (auto_map in tokenizer_config.json); "
            "rloo_jax never runs such code, whatever trust_remote_code says: save a fast tokenizer "
            "(tokenizer.json) in that folder"
        )


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


@dataclasses.dataclass
class Run:
    """What the loop needs, all loaded and validated before anything is written."""

    cfg: RLOOConfig
    tokenizer: Any
    model: Any
    train_ds: Any
    eval_ds: Any
    encoder: PromptEncoder
    reward_funcs: list[RewardFunction]
    eos_ids: tuple[int, ...]


def prepare(cfg: RLOOConfig) -> Run:
    """Resolve the demo, load tokenizer, policy, data and reward functions; check the first batch encodes."""
    model_path, dataset = cfg.model_name_or_path, cfg.dataset_name
    if model_path == "demo":
        model_path = demo.prepare_model(
            os.path.expanduser(os.path.join(CACHE_ROOT, f"demo/model-{cfg.seed}")), cfg.seed
        )
    if dataset == "demo":
        dataset = demo.prepare_dataset(os.path.expanduser(os.path.join(CACHE_ROOT, f"demo/data-{cfg.seed}")), cfg.seed)
    if cfg.trust_remote_code:
        logger.warning("note: trust_remote_code has no effect; rloo_jax never runs code shipped with a model")
    model_dir = str(resolve_checkpoint(model_path))
    refuse_custom_code(model_dir)
    for reward_model in cfg.reward_model_name_or_path or []:
        refuse_custom_code(str(resolve_checkpoint(reward_model)))
    tokenizer = load_tokenizer(model_dir, padding_side="left")
    model = load_causal_lm(model_dir, dtype="bfloat16" if cfg.bf16 else "float32", param_dtype="float32")
    sources = {"config": cfg.dataset_config, "tfds_data_dir": cfg.tfds_data_dir}
    train_ds = load_prompt_dataset(dataset, cfg.dataset_train_split, **sources)
    eval_ds = load_prompt_dataset(dataset, cfg.dataset_test_split, **sources) if cfg.eval_steps else None
    encoder = PromptEncoder(tokenizer, cfg.max_prompt_length, cfg.prompt_bucket, cfg.chat_template_kwargs)
    encoder(train_ds[:1])  # fails early on a missing chat template or an empty prompt
    builtins = builtin_rewards(cfg.format_reward_pattern, cfg.max_completion_length, cfg.resolved_soft_overlong_cache)
    reward_funcs = resolve_reward_funcs(
        cfg.reward_sources,
        builtins,
        lambda path: load_reward_model_scorer(
            path, "bfloat16" if cfg.bf16 else "float32", cfg.prompt_bucket, cfg.chat_template_kwargs
        ),
    )
    check_report_to(cfg.report_to)
    eos = eos_token_ids(model_dir, tokenizer)
    if not eos:
        raise ConfigError(f"the tokenizer of {model_path} has no eos_token; completions could never end")
    return Run(cfg, tokenizer, model, train_ds, eval_ds, encoder, reward_funcs, eos)


def sampling_config(cfg: RLOOConfig, run: Run, num_generations: int) -> SamplingConfig:
    return SamplingConfig(
        max_new_tokens=cfg.max_completion_length,
        num_generations=num_generations,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        top_p=cfg.top_p,
        min_p=cfg.min_p or 0.0,
        repetition_penalty=cfg.repetition_penalty,
        eos_token_ids=run.eos_ids,
        pad_token_id=int(run.tokenizer.pad_token_id),
    )


def step_config(cfg: RLOOConfig, run: Run) -> StepConfig:
    return StepConfig(
        sampling=sampling_config(cfg, run, cfg.num_generations),
        rloo=RLOOOptions(
            beta=cfg.beta,
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            normalize_advantages=cfg.normalize_advantages,
            reward_clip_range=cfg.reward_clip_range,
            mask_truncated_completions=cfg.mask_truncated_completions,
            missing_eos_penalty=cfg.missing_eos_penalty,
            kl_estimator=cfg.kl_estimator,
            token_level_kl=cfg.token_level_kl,
        ),
        num_iterations=cfg.num_iterations,
        steps_per_generation=cfg.resolved_steps_per_generation,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
    )


# ------------------------------------------------------------------------------------------------ placement
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
    model = nnx.merge(graphdef, state.params) if sampler is None else None
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


def train(cfg: RLOOConfig) -> dict[str, str]:
    """Run training; returns the output paths (also after a SIGTERM, once the checkpoint is saved)."""
    with StopRequest() as stop:
        return _train(cfg, stop)


def _train(cfg: RLOOConfig, stop: StopRequest) -> dict[str, str]:
    start_distributed(cfg.coordinator_address, cfg.num_processes, cfg.process_id)
    cfg = for_this_machine(cfg)
    enable_compilation_cache(cfg)
    run = prepare(cfg)
    place = Placement(make_mesh(*cfg.mesh_shape) if cfg.device_count > 1 else None)
    main_process = place.is_main
    iterator = PromptIterator(len(run.train_ds), cfg.prompts_per_generation, cfg.seed, cfg.shuffle_dataset)
    scfg = step_config(cfg, run)
    per_gen = scfg.updates_per_generation
    if cfg.max_steps > 0:
        total_steps = cfg.max_steps
    else:
        total_steps = math.ceil(cfg.num_train_epochs * iterator.batches_per_epoch) * per_gen
    optimizer, schedule = make_optimizer(cfg, total_steps)
    lr_at = jax.jit(schedule)  # one dispatch, not a handful of eager ops, per logged step
    lr_at(0)  # compiled here, not at the first logged step (no compile after step 1)
    graphdef, params = nnx.split(run.model)
    ref = jax.tree.map(jnp.copy, params) if cfg.beta > 0 else None  # a copy: update() donates the policy buffers
    step_fn = RLOOStep(graphdef, optimizer, scfg, mesh=place.mesh)
    state = step_fn.init_state(params, ref)  # with a mesh: placed on its shardings (FSDP / tensor parallel)
    eval_sampler = None
    if place.mesh is not None and run.eval_ds is not None:
        # evaluation samples on the sharded state through a rollout with the evaluation SamplingConfig (beta 0:
        # no reference log-probs); it shares the training state's shardings instead of initialising its own
        eval_scfg = StepConfig(sampling=sampling_config(cfg, run, cfg.resolved_num_generations_eval),
                               rloo=RLOOOptions(beta=0.0))
        eval_sampler = RLOOStep(graphdef, optimizer, eval_scfg, mesh=place.mesh)
        eval_sampler.state_shardings = step_fn.state_shardings
    base_key = jax.random.key(cfg.seed)
    eval_key = jax.random.key(cfg.seed + 1)  # evaluation never consumes training randomness
    weights = place.replicate(jnp.asarray(cfg.resolved_reward_weights, jnp.float32))
    names = [f.name for f in run.reward_funcs]

    # everything is loaded and valid: from here on, files are written
    out = os.path.abspath(cfg.output_dir)
    os.makedirs(out, exist_ok=True)
    paths = {
        "metrics": os.path.join(out, "metrics.jsonl"),
        "rollouts": os.path.join(out, "rollouts.jsonl"),
        "checkpoints": os.path.join(out, "checkpoints"),
        "final": os.path.join(out, "final"),
        "config": os.path.join(out, "config.yaml"),
    }
    ckpt = Checkpointer(paths["checkpoints"], max_to_keep=cfg.save_total_limit)  # every process: orbax is collective
    window = WindowMean()
    step, num_tokens, truncated_prompts = 0, 0, 0  # the host counters travel in the checkpoint's meta
    latest = ckpt.latest_step()
    if latest is not None:
        state, key, meta = ckpt.restore(latest, state, place.replicate(base_key))  # onto the state's shardings
        base_key = place.host_key(key)
        iterator.load_state_dict(meta["data"])
        step = int(meta["step"])
        counters = meta.get("counters", {})
        num_tokens = int(counters.get("num_tokens", 0))
        truncated_prompts = int(counters.get("num_truncated_prompts", 0))
        window.load_state_dict(meta.get("window", {}))
        if place.mesh is not None and window.total is not None:  # onto the mesh, like the metrics added to it
            window.total = place.replicate(window.total)
    sinks = rollouts = None
    if main_process:
        # records logged after the checkpoint (or, with none, by a run killed before its first one) are redone
        dropped = drop_records_after(paths["metrics"], step) + drop_records_after(paths["rollouts"], step)
        if latest is not None:
            print(
                f"Resuming from checkpoint {os.path.join(paths['checkpoints'], str(latest))} (step {step}"
                + (f"; dropped {dropped} records logged after it)" if dropped else ")")
            )
        elif dropped:
            print(
                f"No checkpoint in {paths['checkpoints']}: starting over (dropped {dropped} records of an earlier run)"
            )
        with open(paths["config"], "w", encoding="utf-8") as f:
            f.write(cfg.to_yaml())
        sinks = Sinks(out, cfg.report_to, json_safe(cfg.to_dict()))
        rollouts = JsonlWriter(paths["rollouts"])
    saved = step if latest is not None else None

    def save() -> None:
        meta = {
            "data": iterator.state_dict(),
            "step": step,
            "counters": {"num_tokens": num_tokens, "num_truncated_prompts": truncated_prompts},
            "window": window.state_dict(),
        }
        ckpt.save(step, state, place.replicate(base_key), meta)

    def stop_requested() -> bool:
        """A SIGTERM seen by any process (every process calls this at the same points, so all stop together)."""
        return place.any(stop.signal is not None) if place.multi_process else stop.signal is not None

    progress = Progress(
        TextColumn("training"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        transient=True,
        disable=not main_process,
    )
    start, compiling = step, None
    try:
        with progress:
            task = progress.add_task("train", total=total_steps, completed=step)
            while step < total_steps and not stop_requested():
                t0 = time.perf_counter()
                prev = step
                idx = next(iterator)  # the same global batch on every process; each one handles its rows
                rows = place.rows(len(idx))
                batch = encode_rows(run, place, run.train_ds[idx[rows]])
                truncated_prompts += batch.num_truncated
                key = place.replicate(fold_in(base_key, step))
                ids, mask = place.to_global(batch.prompt_ids), place.to_global(batch.prompt_mask)
                if compiling is None and step == start:  # first step: compile update while the rollout runs
                    compiling = threading.Thread(
                        target=compile_quietly, args=(step_fn, state, ids.shape, weights), daemon=True
                    )
                    compiling.start()
                rollout = step_fn.rollout(state, ids, mask, key)
                completion_ids = place.local(rollout.completion_ids)  # this process's completions
                scored = decode_and_score(run, batch, completion_ids, cfg.num_generations)
                local_tokens = int(batch.prompt_mask.sum()) * cfg.num_generations + int(scored.lengths.sum())
                num_tokens += int(place.per_process([local_tokens]).sum())
                rewards = place.to_global(scored.rewards_per_func)
                if compiling is not None and compiling.is_alive():
                    compiling.join()  # before update donates the state it reads
                state, metrics = step_fn.update(state, rollout, rewards, weights)
                step += per_gen
                window.add(metrics)
                consecutive, skipped = skipped_updates(state.opt_state)  # skipped params/moments: unchanged
                diverged = consecutive >= cfg.max_consecutive_nonfinite
                if cfg.sync_ref_model and crossed(prev, step, cfg.ref_model_sync_steps):
                    state = step_fn.sync_reference(state, cfg.ref_model_mixup_alpha)
                last = step >= total_steps
                # every record of a step is written before its checkpoint is started: a resume drops the
                # records after the checkpoint and redoes them, so none is lost or doubled
                if crossed(prev, step, cfg.logging_steps) or last or diverged:
                    logged = rename_reward_metrics(window.read(), names)
                    logged.update(
                        num_tokens=float(num_tokens),
                        skipped_steps=skipped,
                        step_time=time.perf_counter() - t0,
                        learning_rate=float(lr_at(prev + per_gen - 1)),
                        epoch=iterator.epoch + iterator.index / (iterator.batches_per_epoch * iterator.batch_size),
                        num_truncated_prompts=truncated_prompts,
                    )
                    if main_process:
                        sinks.log(step, logged)
                        progress.console.print(console_line(step, total_steps, logged), soft_wrap=True)
                    if cfg.log_completions or last:
                        adv, _ = step_fn.score(rollout, rewards, weights)
                        adv = place.gather(adv)
                        if place.multi_process:  # every process takes part in the gathers; process 0 decodes
                            all_ids = place.gather(rollout.completion_ids)
                            all_rewards = place.gather(scored.rewards_per_func)
                            if main_process:
                                prompts = list(run.train_ds[idx]["prompt"])
                                scored = decode(run, prompts, all_ids, cfg.num_generations, all_rewards)
                        if main_process:
                            records = rollout_records(
                                step, scored.prompts, scored.completions, names, scored.rewards_per_func,
                                weighted_rewards(scored.rewards_per_func, cfg.resolved_reward_weights),
                                adv, scored.lengths, scored.truncated,
                            )  # fmt: skip
                            rollouts.write(records)
                            print_completions(progress.console, records, cfg.num_completions_to_print)
                if diverged:  # logged above; nothing is evaluated or saved
                    raise NonFiniteError(
                        f"{consecutive} consecutive optimizer updates had a non-finite loss or gradients "
                        f"(step {step}, {skipped} skipped in all; max_consecutive_nonfinite = "
                        f"{cfg.max_consecutive_nonfinite}); lower --learning_rate or --max_grad_norm, check the "
                        "rewards for extreme values, or resume from an earlier checkpoint"
                    )
                if run.eval_ds is not None and (crossed(prev, step, cfg.eval_steps) or last):
                    eval_metrics = evaluate(
                        run, place, graphdef, state, jax.random.fold_in(eval_key, step), names, eval_sampler
                    )
                    if main_process:
                        sinks.log(step, eval_metrics)
                        progress.console.print(
                            f"eval step {step}: reward {eval_metrics['eval_reward']:.3f} "
                            f"(len {eval_metrics['eval_completions/mean_length']:.1f})"
                        )
                if crossed(prev, step, cfg.save_steps) or last or stop_requested():
                    save()
                    saved = step
                progress.update(task, completed=step)
            stopped = stop_requested()
            if stopped and step > 0 and saved != step:
                save()  # the signal came after this step's save decision
    finally:
        ckpt.close()  # waits for an in-flight save; a failed step never starts a new one
        if sinks is not None:
            sinks.close()
            rollouts.close()
    if stopped and step < total_steps:
        if main_process:
            where = f"checkpoint {os.path.join(paths['checkpoints'], str(step))}" if step else "no step done"
            print(
                f"Stopped by {stop.signal or 'SIGTERM'} at step {step}/{total_steps} ({where}); "
                "run the same command to resume"
            )
        return paths
    bad = nonfinite_leaves(state.params)
    if bad:
        raise NonFiniteError(f"refusing to export {paths['final']}: non-finite values in {', '.join(bad[:3])}")
    # the export needs the whole parameters on the host: gathered from every process's shards (all take part)
    host_params = state.params if place.mesh is None else place.gather_tree(state.params)
    if main_process:
        save_pretrained(nnx.merge(graphdef, host_params), paths["final"], tokenizer=run.tokenizer)
        print(f"Done: {step} optimizer steps. Outputs in {out}:")
        for name in ("metrics", "rollouts", "checkpoints", "final", "config"):
            print(f"  {name:12s} {paths[name]}")
    return paths


def print_completions(console: Any, records: list[dict[str, Any]], limit: int | None) -> None:
    """A small table of (prompt, completion, reward, advantage)."""
    table = Table("prompt", "completion", "reward", "advantage", title=f"step {records[0]['step']}")
    for r in records[: limit if limit is not None else len(records)]:
        table.add_row(str(r["prompt"])[-60:], str(r["completion"])[:80], f"{r['reward']:.3f}", f"{r['advantage']:.3f}")
    console.print(table)


# ------------------------------------------------------------------------------------------------ CLI
def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Exit codes: 0 on success or after a SIGTERM (checkpoint saved); 2 on a configuration,
    data or model error (one line, nothing written); 1 when training stops on a reward-function error or on
    `max_consecutive_nonfinite` non-finite updates (the last checkpoint is left as it was)."""
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
