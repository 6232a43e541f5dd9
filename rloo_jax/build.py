"""The assembly: everything a run holds, built once from its config, for the training loop and for compile-only
alike (what one would otherwise glue together twice and see drift apart).

    run = assemble(cfg)                                                  # the loop (`rloo_jax.loop.setup`)
    run = assemble(cfg, slice_devices, abstract=True, device_bytes=hbm)   # compile-only (`rloo_jax.aot`)
    state = run.init_state()            # or run.abstract_state(): ShapeDtypeStructs with their shardings
    programs = run.compile_set()        # exactly the programs the loop runs, ready to lower

`prepare` loads what the config names (the policy's tokenizer and model, the data, the reward functions, PPO's value
and reward models), or with `abstract` builds them from `config.json` alone (parameters as shapes, no dataset);
`assemble` resolves the config for the platform and adds the models by role (`rloo_jax.policy`), the optimizer
over the run's steps, the meshes and the programs (`rloo_jax.programs`).
"""

import contextlib
import dataclasses
import fractions
import logging
import math
import os
from typing import Any

import jax
from flax import nnx

from rloo_jax import demo, numerics, outputs
from rloo_jax.config import TrainConfig
from rloo_jax.data import PromptEncoder, load_prompt_dataset
from rloo_jax.errors import ConfigError, DataError
from rloo_jax.given import Given
from rloo_jax.mesh import host_memory, make_mesh, reshaped, rollout_mesh_shape
from rloo_jax.models import hf
from rloo_jax.optimizer import Scheduled, make_optimizer
from rloo_jax.policy import Policy, policy
from rloo_jax.programs import Program, Programs, Shapes, reward_model_program
from rloo_jax.rewards import RewardFunction, reward_functions
from rloo_jax.sampling import sampling_config
from rloo_jax.step import TrainState, completion_widths, run_plans, step_config
from rloo_jax.tools import ToolUse, make_tool_use
from rloo_jax.turns import suffix_buckets

logger = logging.getLogger("rloo_jax")


# ------------------------------------------------------------------------------------------------ the run
@dataclasses.dataclass
class Prepared:
    """What the loop needs, all loaded and validated before anything is written (`abstract`: shapes only)."""

    cfg: TrainConfig  # resolved for `platform` (rloo_jax.numerics)
    platform: str  # what the programs are compiled for: "cpu", "gpu", "tpu"
    options: dict[str, Any]  # the models' dtypes and execution options (`numerics.model_options`)
    tokenizer: Any
    model: Any
    train_ds: Any
    eval_ds: dict[str, Any]  # evaluation sets by name ("": the one set); empty: no evaluation
    encoder: PromptEncoder
    reward_funcs: list[RewardFunction]
    eos_ids: tuple[int, ...]
    reward_models: list[str] = dataclasses.field(default_factory=list)  # their folders (compile-only)
    model_dir: str = ""  # the policy's local folder (a LoRA adapter names it as its base unless given a hub id)
    adapter_dir: str | None = None  # the policy is this PEFT adapter folder on model_dir (its starting adapters)
    value_model: Any = None  # a RewardModel trained as the value model (PPO), loaded or abstract; else None
    device_reward_model: Any = None  # a RewardModel scored on the token ids on the device (PPO); else None
    device_reward_names: list[str] = dataclasses.field(default_factory=list)  # its name in the metrics
    tool_use: ToolUse | None = None  # tool calling: rollouts are conversations (rloo_jax.conversations)
    reward_weights: list[float] = dataclasses.field(default_factory=list)  # every reward's, environments' last
    description: str = ""  # the resolved numerics, starred where the platform chose them (`numerics.describe`)
    total_steps: int | None = None  # the run's steps; None: not known (compile-only without max_steps: no dataset)
    # optimizer steps per pass over the training prompts (`TrainConfig.steps_per_epoch`); None: no dataset read
    steps_per_epoch: fractions.Fraction | None = None
    # TRL's rollout_func bound to the trainer (`rloo_jax.external`): the generation batches come from it; else None
    rollout_func: Any = None

    def __post_init__(self) -> None:
        if not self.reward_weights:
            self.reward_weights = list(self.cfg.resolved_reward_weights)


def prepare(cfg: TrainConfig, abstract: bool = False, given: Given | None = None, platform: str | None = None
            ) -> Prepared:
    """Resolve the config for the platform (`platform`; default: a TPU slice's when `abstract`, else JAX's backend:
    `numerics.for_platform`, the run's matmul precision set, the models' options), resolve the demo, load the
    tokenizer and the data (before the models: a data error costs no model load), apply the algorithm's hooks
    (its sources, its tokenizer, the run's steps), load the policy (and PPO's value and reward models) and the reward
    functions; check the first batch encodes.

    `abstract`: the policy and reward models as shapes from their `config.json` (no weights read), no dataset;
    Python reward functions are still imported (a wrong name fails here, as in training). `given`: objects
    that replace what the config names (the Python API).
    """
    platform = platform or ("tpu" if abstract else jax.default_backend())
    given_cfg, cfg = cfg, numerics.for_platform(cfg, platform)  # platform-dependent: what runs, is printed, recorded
    description = numerics.describe(given_cfg, cfg, platform)
    numerics.use_matmul_precision(cfg.matmul_precision)
    options = numerics.model_options(cfg, platform)
    if not abstract and platform == "cpu" and options["remat_policy"] == "full_offloaded":
        raise ConfigError("remat_policy full_offloaded moves block inputs to host memory, which needs a TPU or GPU; "
                          "on CPU use --remat_policy full")
    given = given or Given()
    device_paths = cfg.device_reward_paths  # scored on the token ids on the device, ahead of the functions
    sources = cfg.reward_sources[len(device_paths):] if given.reward_funcs is None else list(given.reward_funcs)
    environments_reward = getattr(cfg, "uses_tools", False) and (given.environment_factory is not None
                                                                  or cfg.environment_factory)
    if cfg.trust_remote_code:
        logger.warning("note: trust_remote_code has no effect; rloo_jax never runs code shipped with a model")
    model_path, dataset = cfg.policy_path, cfg.dataset_name
    value_path = cfg.resolved_value_model_path if cfg.uses_value_model else None
    if model_path == "demo":
        model_path = demo.model_folder(cfg.seed)
    if value_path == "demo":  # the demo policy's folder: its backbone with a new score head
        value_path = demo.model_folder(cfg.seed)
    if dataset == "demo" and not abstract:
        dataset = demo.dataset_folder(cfg.seed)
    # the folders (a hub id downloaded; no weights read for an abstract run) and the policy's tokenizer
    model_dir = str(hf.resolve_checkpoint(model_path, weights=not abstract))
    adapter_dir, tokenizer_dir = None, model_dir
    base = hf.adapter_base(model_dir)
    if base is not None:  # a PEFT adapter folder: its base is the model; its tokenizer, when it has one
        adapter_dir, model_dir = model_dir, str(hf.resolve_checkpoint(base, weights=not abstract))
        if not any(os.path.isfile(os.path.join(adapter_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer_dir = model_dir
    if given_cfg.attn_implementation is None and cfg.attn_implementation == "cudnn" and hf.has_attention_sinks(
            model_dir):  # the platform's choice, not the user's: cuDNN's attention has no sinks (GPT-OSS), eager has
        cfg = cfg.replace(attn_implementation="eager", device_count=cfg.device_count, process_count=cfg.process_count)
        description = numerics.describe(given_cfg, cfg, platform).replace(
            "attn_implementation eager*", "attn_implementation eager* (cuDNN's attention has no sinks)", 1)
        options = numerics.model_options(cfg, platform)
    checked = [tokenizer_dir]  # tokenizers that would need code shipped with them are refused (`refuse_custom_code`)
    if cfg.tokenizer_path not in (None, cfg.policy_path):  # PPO: TRL's scripts read it from model_name_or_path
        tokenizer_dir = str(hf.resolve_checkpoint(cfg.tokenizer_path, weights=False))
        checked.append(tokenizer_dir)
    reward_models = [str(hf.resolve_checkpoint(p, weights=not abstract)) for p in cfg.reward_model_paths]
    heads = [(str(hf.resolve_checkpoint(p, weights=not abstract)), p) for p in ([value_path] * bool(value_path)
                                                                                 + device_paths)]
    for folder in (*checked, *reward_models):
        hf.refuse_custom_code(folder)
    tokenizer = (hf.load_tokenizer(tokenizer_dir, padding_side="left") if given.tokenizer is None
                 else hf.given_tokenizer(given.tokenizer))
    eos = hf.eos_token_ids(model_dir, tokenizer)
    if not eos:
        raise ConfigError(f"the tokenizer of {model_path} has no eos_token; completions could never end")
    train_ds, eval_ds = None, {}
    if not abstract:  # the data before the models: a data error costs no model load
        train_ds = given.train_dataset
        if given.eval_dataset is not None:
            eval_ds = dict(given.eval_dataset) if isinstance(given.eval_dataset, dict) else {"": given.eval_dataset}
        where = {"config": cfg.dataset_config, "tfds_data_dir": cfg.tfds_data_dir}
        if train_ds is None:
            train_ds = load_prompt_dataset(local_dataset(dataset), cfg.dataset_train_split, **where)
        if cfg.evaluates and not eval_ds:
            eval_ds = {"": load_prompt_dataset(local_dataset(dataset), cfg.dataset_test_split, **where)}
    # the algorithm's needs (the entry points checked the sources already; here with the objects given)
    if sources or device_paths or not environments_reward:  # an environment's get_reward may be the only reward
        cfg.require_sources(len(device_paths) + len(sources))
    cfg.prepare_tokenizer(tokenizer)
    total = (cfg.total_steps(len(train_ds)) if train_ds is not None
             else cfg.max_steps if cfg.max_steps > 0 else None)
    if total is not None:  # logging / save / eval ratios become steps, once: what the loop and config.yaml read
        cfg = cfg.with_intervals(total)
    per_epoch = None if train_ds is None else cfg.steps_per_epoch(len(train_ds))
    if cfg.max_steps <= 0 and per_epoch is not None and per_epoch.denominator != 1:  # where TRL's count differs
        gas = cfg.gradient_accumulation_steps
        description += (f"\nnote: an epoch is {per_epoch * gas} micro-batches, not a multiple of "
                        f"gradient_accumulation_steps {gas}: TRL's Trainer ends each epoch with a short optimizer "
                        f"step ({math.ceil(cfg.num_train_epochs * math.ceil(per_epoch))} steps in all); here a step "
                        f"spans two epochs ({total} steps)")
    # on a mesh the weights wait in host memory until the train state shards them (a whole 8B model in bf16 does
    # not fit one 16 GB chip); on one device they load there directly
    with host_memory() if cfg.device_count > 1 and not abstract else contextlib.nullcontext():
        model = hf.abstract_model(model_dir, **options) if abstract else hf.load_causal_lm(model_dir, **options)
        vocab = model.config.vocab_size
        if heads and not 0 <= int(-1 if tokenizer.pad_token_id is None else tokenizer.pad_token_id) < vocab:
            raise ConfigError(f"the pad token id {tokenizer.pad_token_id} is outside the policy's vocabulary ({vocab}"
                              " embeddings); pick a pad_token the models embed")
        # PPO: the value model (trained: stored in param_dtype), then the reward model scored on the device (frozen:
        # stored in the compute dtype, as the reference)
        value_model = None if not value_path else hf.head_model(
            heads[0][0], "value model", abstract, vocab, tokenizer, cfg.param_dtype, options, seed=cfg.seed + 3)
        device_reward = [hf.head_model(folder, "reward model", abstract, vocab, tokenizer, options["dtype"], options)
                         for folder, _ in heads[bool(value_path):]]
    tool_use = None
    if getattr(cfg, "uses_tools", False):
        tool_use = make_tool_use(cfg, tokenizer, given.tools, given.environment_factory,
                                 model.config.hf_config.get("max_position_embeddings"))
    encoder = PromptEncoder(tokenizer, cfg.max_prompt_length, cfg.prompt_bucket, cfg.chat_template_kwargs,
                            None if tool_use is None else tool_use.prompt_tools,
                            None if tool_use is None else tool_use.chat_template)
    if train_ds is not None:
        encoder(train_ds[:1])  # fails early on a missing chat template or an empty prompt
    reward_funcs = reward_functions(cfg, sources, given.reward_tokenizers, options, abstract)
    weights = list(cfg.resolved_reward_weights)
    if tool_use is not None and tool_use.environments is not None:  # TRL: each get_reward a reward of weight 1
        extra = tool_use.environments.reward_functions()
        reward_funcs += [RewardFunction(name, fn) for name, fn in extra]
        weights += [1.0] * len(extra)
        if not reward_funcs and not device_paths:
            raise ConfigError("No reward source provided. Pass `reward_funcs`, or an `environment_factory` whose "
                              "environment defines a `get_reward` method.")
    return Prepared(
        cfg, platform, options, tokenizer, model, train_ds, eval_ds, encoder, reward_funcs,
        cfg.sampler_stop_ids(tokenizer, eos),
        reward_models, model_dir, adapter_dir, value_model, device_reward[0] if device_reward else None,
        [os.path.basename(os.path.normpath(str(path))) or "reward_model" for _, path in heads[bool(value_path):]],
        tool_use, weights, description, total, per_epoch, given.rollout_func,
    )


def local_dataset(name: str) -> str:
    """A dataset source as `load_prompt_dataset` takes it: a local path (`rloo_jax.outputs.is_local_path`) with ~
    expanded, DataError when it does not exist (never a hub download); a hub id or `tfds:` name as given."""
    if name.startswith("tfds:") or not outputs.is_local_path(name):
        return name
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        raise DataError(f"dataset {name}: no such file or folder ({os.path.abspath(path)}; a hub dataset id is "
                        "`name` or `namespace/name`)")
    return path


# ------------------------------------------------------------------------------------------------ the assembly
@dataclasses.dataclass
class Assembly:
    """Everything a run holds, built once from its config by `assemble`, for the loop and for compile-only alike:
    the config resolved for the platform, what `prepare` loaded (or built abstractly), the models by role (the
    policy with its reference, a value model, a reward model scored on the device), the optimizer and its schedule
    over the run's steps, the meshes, and the programs over them (`rloo_jax.programs.Programs`)."""

    cfg: TrainConfig  # resolved for `platform` (rloo_jax.numerics)
    platform: str  # what the programs are compiled for: "cpu", "gpu", "tpu"
    options: dict[str, Any]  # the models' dtypes and execution options (`numerics.model_options`)
    prepared: Prepared
    policy: Policy  # the trained parameters and the reference (a copy, or with LoRA the frozen base)
    value: tuple[nnx.GraphDef, nnx.State] | None  # a value model trained with the policy (PPO)
    reward: tuple[nnx.GraphDef, nnx.State] | None  # a reward model scored on the token ids on the device (PPO)
    optimizer: Scheduled  # AdamW; its schedule's horizon an argument of the update (`rate`: what the loop logs)
    total_steps: int | None  # None: not known (compile-only without max_steps: no dataset is read)
    mesh: jax.sharding.Mesh | None  # None: one device, plain jit
    rollout_mesh: jax.sharding.Mesh | None  # the sampler's layout over the same devices
    programs: Programs
    shapes: Shapes  # the programs' batch shapes for the widest prompts

    def init_state(self) -> TrainState:
        """The fresh train state, placed on the programs' shardings."""
        p = self.policy
        return self.programs.init_state(p.params, p.ref_params, p.frozen, *self._roles())

    def abstract_state(self) -> TrainState:
        """The train state `init_state` builds, as `ShapeDtypeStruct`s with their shardings (nothing in memory)."""
        p = self.policy
        return self.programs.abstract_state(p.params, p.ref_params, p.frozen, *self._roles())

    def _roles(self) -> tuple[nnx.State | None, nnx.State | None]:
        return (None if self.value is None else self.value[1]), (None if self.reward is None else self.reward[1])

    def compile_set(self, shapes: Shapes | None = None) -> list[Program]:
        """Exactly the programs the loop runs for `shapes` (default: the widest prompts'), each with its abstract
        inputs and shardings, ready to lower: `Programs.compile_set`, then each host reward model's forward (sharded
        like the policy, as the trainer runs it)."""
        shapes = self.shapes if shapes is None else shapes
        programs = self.programs.compile_set(shapes)
        options = self.options
        n = shapes.prompts * self.cfg.num_generations
        # prompt + completion, as the reward model's texts are padded
        width = -(-(shapes.prompt_length + self.cfg.max_completion_length) // self.cfg.prompt_bucket) * (
            self.cfg.prompt_bucket)
        for i, folder in enumerate(self.prepared.reward_models):
            model = hf.abstract_model(folder, "reward", options["dtype"],
                                      attn_implementation=options["attn_implementation"])
            programs.append(reward_model_program(f"reward_model_{i}", model, self.mesh, (n, width)))
        return programs


def check_expert_parallel(size: int, config: Any) -> None:
    """`expert_parallel` > 1 needs a policy with experts (`config`: its `ModelConfig`) whose count it divides (each
    device holds E / size whole experts): else a ConfigError naming the option."""
    if size == 1:
        return
    if not config.is_moe:
        raise ConfigError(f"expert_parallel {size}: the policy has no experts (not a mixture of experts); leave "
                          "expert_parallel at 1")
    if config.num_experts % size:
        raise ConfigError(f"expert_parallel {size} does not divide the policy's {config.num_experts} experts "
                          f"(num_experts): each device must hold whole experts; choose a divisor of "
                          f"{config.num_experts}")


def assemble(
    cfg: TrainConfig, devices: Any = None, abstract: bool = False, given: Given | None = None,
    device_bytes: int | None = None, platform: str | None = None,
) -> Assembly:
    """The run of `cfg`, built once (nothing written): the config resolved for the platform (and the run's matmul
    precision set: callers keep the session's with `numerics.kept_matmul_precision`), `prepare`d, the policy and the
    other models by role, the optimizer over the run's steps, the mesh over `devices` (default: every device JAX
    sees; one device: no mesh) and the sampler's mesh, the programs and their batch shapes. `abstract`: for
    compile-only, on a TPU slice's `devices` whose chips hold `device_bytes`: shapes from config.json, no weights,
    no dataset (`platform`: another than the TPU, for tests). The loop (`rloo_jax.loop.setup`) and compile-only
    (`rloo_jax.aot.compile_run`) both call this."""
    prepared = prepare(cfg, abstract, given, platform)
    cfg, platform = prepared.cfg, prepared.platform
    check_expert_parallel(cfg.expert_parallel, prepared.model.config)
    mesh = None if devices is None and cfg.device_count == 1 else make_mesh(*cfg.mesh_shape, devices=devices,
                                                                            expert_parallel=cfg.expert_parallel)
    rollout_mesh = None if mesh is None else reshaped(mesh, rollout_mesh_shape(cfg, prepared.model, device_bytes))
    total = prepared.total_steps
    # the updates of one step share its learning rate (PPO: the scheduler steps once per PPO update, as TRL)
    optimizer = make_optimizer(cfg, total or 1, platform, updates_per_step=cfg.updates_per_step)
    pol = policy(cfg, prepared.model, prepared.adapter_dir)
    value = None if prepared.value_model is None else nnx.split(prepared.value_model)
    reward = None if prepared.device_reward_model is None else nnx.split(prepared.device_reward_model)
    sampling = sampling_config(cfg, prepared.eos_ids, prepared.tokenizer.pad_token_id, cfg.num_generations)
    # the policy's config: a mixture of experts' load-balancing loss weight (`step.router_aux_loss_coef`)
    step = step_config(cfg, sampling, prepared.tokenizer, prepared.model.config)
    if prepared.rollout_func is not None:  # its rollouts carry a tool mask (env_mask: the lengths count it) and no
        # sampler routes to replay (a mixture of experts' forwards route for themselves)
        step = dataclasses.replace(step, multi_turn=True, given_logps=True, routes=None)
    programs = Programs(pol.graphdef, optimizer, step, mesh=mesh, ref_graphdef=pol.ref_graphdef,
                        rollout_mesh=rollout_mesh, value_graphdef=value and value[0],
                        reward_graphdef=reward and reward[0])
    # the batch shapes of every program the loop runs, for the widest prompts (max_prompt_length rounded up to
    # prompt_bucket; `dataclasses.replace(shapes, prompt_length=...)` for narrower ones): the generation batch, each
    # completion width the reference pass and the update may run at, the update plans the run's generation batches
    # take, the evaluation batch, the reference sync, a multi-turn rollout's turn widths
    scfg, g_eval, sync = programs.cfg, cfg.resolved_num_generations_eval, cfg.reference_sync
    turns = scfg.multi_turn and prepared.tool_use is not None  # the sampler's multi-turn rollouts
    shapes = Shapes(
        prompts=cfg.prompts_per_generation,
        prompt_length=cfg.compiled_prompt_length,
        widths=completion_widths(cfg.max_completion_length, cfg.completion_bucket),
        num_rewards=len(prepared.reward_weights) - len(cfg.device_reward_paths),
        plans=(None,) if scfg.algorithm.step_unit == "generation" else run_plans(
            total, scfg.micro_per_generation, cfg.gradient_accumulation_steps),
        eval_prompts=cfg.eval_batch_size // g_eval if cfg.evaluates else 0,
        eval_sampling=dataclasses.replace(scfg.sampling, num_generations=g_eval) if cfg.evaluates else None,
        sync_alpha=None if sync is None else sync[1],
        suffix_widths=suffix_buckets(cfg.max_completion_length, cfg.tool_suffix_bucket) if turns else (),
        pause_at=(cfg.tool_batch_rows or 0) if turns else 0,
    )
    return Assembly(cfg, platform, prepared.options, prepared, pol, value, reward, optimizer, total, mesh,
                    rollout_mesh, programs, shapes)
