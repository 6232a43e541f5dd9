"""The trainers: `RLOOTrainer` and `GRPOTrainer`, TRL 1.16's Python API (`GRPOTrainer(model=..., reward_funcs=...,
args=GRPOConfig(...), train_dataset=...).train()`), and `PPOTrainer`, TRL 1.12's, all on the one training loop
(`rloo_jax.loop`); `TRAINERS`, the registry the command line picks from.

A trainer turns TRL's arguments into a run config and the objects the run uses instead of what a config names
(`rloo_jax.given`): the model as a path or hub id (a loaded `PreTrainedModel` or `PeftModel`, and loaded reward and PPO
value models, are first written once as folders under output_dir), reward functions as callables and/or strings,
datasets as objects, tokenizers, a peft `LoraConfig`. `train()` then runs `rloo_jax.loop.train`, the same loop as
`python -m rloo_jax.train` (which is this class on a config read from YAML and the command line), resuming from
`args.output_dir`.
"""

import dataclasses
import math
import os
import shutil
from typing import Any, NamedTuple

import datasets
import jax

from rloo_jax import loop as training
from rloo_jax import outputs
from rloo_jax.algorithms import GRPOConfig, PPOConfig, RLOOConfig
from rloo_jax.callbacks import CallbackHandler
from rloo_jax.checkpoint import saved_steps
from rloo_jax.config import TrainConfig, replace
from rloo_jax.errors import ConfigError
from rloo_jax.given import (
    IN_MEMORY,
    Given,
    check_model_argument,
    check_reference,
    describe,
    eval_sets,
    is_model,
    loaded_model_folder,
    loaded_policy,
    loaded_reward_model,
    loaded_value_model,
    lora_options,
    own_tokenizer,
    policy_folder,
    prompt_dataset,
    reward_tokenizers,
)
from rloo_jax.models import check_checkpoints, loaded
from rloo_jax.rewards import TrainerState, check_reward_sources


class TrainOutput(NamedTuple):
    """transformers' `TrainOutput`: what `train()` returns."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class _OnlineTrainer:
    """TRL's online-trainer constructor, for any algorithm (`CONFIG`: its config class).

    Args:
      model: the policy: a local Hugging Face folder or a hub id (`demo`: the built-in tiny model); a PEFT adapter
        folder (its adapters trained from their values, its LoRA options taken, as TRL takes a PeftModel); or a
        loaded transformers `PreTrainedModel` (a causal LM) or peft `PeftModel` (plain LoRA on one), converted in
        memory and written once to `<output_dir>/base_model/` (a PeftModel's adapters to
        `<output_dir>/base_model/adapter/`), which config.yaml then names: resume, final/ and
        `python -m rloo_jax.export` read it as any folder. Its tokenizer: processing_class, else
        `model.config._name_or_path`'s, as TRL.
      reward_funcs: one or a list of: a callable called with TRL's keyword arguments (prompts, completions,
        completion_ids, trainer_state, log_extra, log_metric and the dataset's other columns) returning one float or
        None per completion, sync or async; a reward model's folder or hub id, or a loaded `PreTrainedModel`
        (`*ForSequenceClassification`, num_labels 1: written once to `<output_dir>/reward_model_<i>/`, i its place
        in this list, and named so in config.yaml; its tokenizer: reward_processing_classes[i], else its
        `config._name_or_path`'s, as TRL); a built-in name (`accuracy`, `format`, `soft_overlong` or TRL's names);
        `module:function` or `package.module.function`. Scored in this order (reward_weights follow it).
      args: the algorithm's config (`RLOOConfig`, `GRPOConfig`; they also take TRL's option names; see the README's
        migration table). None: `<Config>(output_dir="<model name>-<ALGORITHM>")`, as TRL.
      train_dataset / eval_dataset: a `datasets.Dataset`, an `IterableDataset` (read in stream order, up to the
        prompts max_steps needs; max_steps must be set, as in TRL) or a list of dicts, with a `prompt` column (text
        or chat messages). None: `args.dataset_name` is loaded, as the CLI does. eval_dataset is used every
        `args.eval_steps`.
      processing_class: the policy's tokenizer (None: the model folder's). Its padding side is set to left and a
        missing pad token to eos, as TRL does.
      reward_processing_classes: one tokenizer per reward function (or one for a single reward model); None
        entries, and entries of callables, mean the reward model's own.
      peft_config: a peft `LoraConfig` (r, lora_alpha, lora_dropout, target_modules, target_parameters,
        use_rslora), or a dict with those names or ours (lora_r, lora_alpha, lora_dropout, lora_target_modules,
        lora_target_parameters, use_rslora): trains LoRA
        adapters on the frozen base. Not with a PeftModel or an adapter folder (ConfigError, as TRL refuses it).
      rollout_func: TRL 1.16 GRPOTrainer's custom generation, `rollout_func(prompts, trainer) -> dict` (also taken
        by RLOOTrainer): called on the host with each generation batch's prompts (every prompt num_generations times,
        consecutively; an evaluation batch's num_generations_eval times) and this trainer, in the place of the
        sampler; returns `prompt_ids`, `completion_ids`, `logprobs` (one list per completion), optional `env_mask`
        (1: the model's tokens, 0: external ones, out of the loss) and other keys passed to the reward functions
        (`rloo_jax.external`). The completions of one prompt must share its prompt_ids. Not with tools or
        environment_factory, nor on several processes.
      callbacks, optimizers, quantization_config: TRL's torch hooks, refused unless None (the step is one jitted
        program; the optimizer is optax AdamW from args; no quantised base yet).
    """

    _resumes_on_rerun = False  # the command line's rule (`resuming_on_rerun`); the Python API: transformers'

    CONFIG: type[TrainConfig] = RLOOConfig

    def __init__(
        self,
        model: Any,
        reward_funcs: Any,
        args: TrainConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        environment_factory: Any = None,
        rollout_func: Any = None,
    ) -> None:
        given_model = None if isinstance(model, str | os.PathLike) else loaded_policy(model)
        if quantization_config:
            raise ConfigError("quantization_config is not supported: set load_in_4bit / load_in_8bit in args "
                              "(QLoRA)" if hasattr(args, "load_in_4bit") else "quantization_config is not supported")
        if any(o is not None for o in optimizers):
            raise ConfigError("optimizers is not supported: the optimizer is optax AdamW configured by args "
                              "(learning_rate, lr_scheduler_type, warmup_steps, weight_decay, adam_*)")
        cls = self.CONFIG
        if args is None:  # TRL: "<the model's name>-RLOO"
            name = os.fspath(model) if given_model is None else (loaded.name_or_path(model) or type(model).__name__)
            args = cls(output_dir=f"{os.path.basename(name.rstrip('/'))}-{cls.ALGORITHM.upper()}")
        if not isinstance(args, cls):
            raise ConfigError(f"{type(self).__name__} takes a {cls.__name__} as args (got a {type(args).__name__})")
        if rollout_func is not None:  # before anything is written
            check_rollout_func(rollout_func, tools or getattr(args, "tools", None),
                               environment_factory or getattr(args, "environment_factory", None),
                               max(jax.process_count(), getattr(args, "num_processes", None) or 1))
        funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
        tokenizers = reward_tokenizers(reward_processing_classes, len(funcs))
        # loaded models: converted and written under output_dir once, then named by their folders like any other
        funcs = [loaded_reward_model(f, i, args.output_dir, (tokenizers or [None] * len(funcs))[i])
                 if loaded.is_torch_module(f) else f for i, f in enumerate(funcs)]
        model, lora_given = policy_folder(model, args, processing_class, peft_config)
        check_checkpoints(model, funcs)  # an unsupported architecture fails here, before anything is loaded
        check_reward_sources(args, funcs)  # so does an unknown reward name
        overrides: dict[str, Any] = {"model_name_or_path": model, **lora_options(peft_config), **lora_given}
        if funcs != args.reward_sources:  # given here, not named by args (the CLI passes args' own)
            overrides.update(reward_funcs=[describe(f) for f in funcs], reward_model_name_or_path=None)
        tools = list(tools) if isinstance(tools, list | tuple) else ([tools] if tools else [])
        if tools:  # the callables run; config.yaml names them (module:qualname)
            overrides["tools"] = [describe(t) for t in tools]
        if environment_factory:
            overrides["environment_factory"] = ({str(k): describe(f) for k, f in environment_factory.items()}
                                                if isinstance(environment_factory, dict)
                                                else describe(environment_factory))
        if train_dataset is None and environment_factory and not args.dataset_name:
            refuse_epoch_strategies(args, "the environment owns the data (its rows are placeholders)")
            train_dataset = environment_rows(args, environment_factory)
        if train_dataset is not None:
            overrides["dataset_name"] = IN_MEMORY
            if isinstance(train_dataset, datasets.IterableDataset):
                # a stream is read in order, as TRL reads it; TRL also forces one data loader worker (args show it)
                overrides.update(shuffle_dataset=False, dataloader_num_workers=0)
        elif not args.dataset_name:
            raise ConfigError("`train_dataset` is required (or set args.dataset_name to a dataset to load)")
        # checked again for this machine's devices, as the run will use them
        self.args = replace(args, device_count=jax.device_count(), process_count=jax.process_count(),
                                        **overrides)
        if isinstance(train_dataset, datasets.IterableDataset):
            refuse_epoch_strategies(self.args, "an IterableDataset has none")
        if self.args.evaluates and eval_dataset is None and train_dataset is not None:
            raise ConfigError(f"{evaluation_option(self.args)} but no eval_dataset was given; pass one, or "
                              "eval_steps=None (eval_strategy='steps')")
        self.model_name_or_path = model
        self._reward_sources = funcs
        self._tokenizer = processing_class
        self._reward_tokenizers = tokenizers
        self._loaded: dict[str, Any] = {}
        self.train_dataset = None if train_dataset is None else prompt_dataset(
            train_dataset, "train_dataset", self.args, stream_rows=prompts_needed(self.args))
        self.eval_dataset = eval_dataset  # as given, as transformers' Trainer keeps it
        self.callback_handler = CallbackHandler(callbacks)
        sets = None if eval_dataset is None else eval_sets(eval_dataset, self.args)
        self.given = Given(processing_class, self.train_dataset, sets, funcs, tokenizers,
                           self.callback_handler.callbacks, tools or None, environment_factory or None,
                           None if rollout_func is None else self._bound_rollout_func(rollout_func))
        self.state = TrainerState(max_steps=self.args.max_steps, num_train_epochs=self.args.num_train_epochs,
                                  logging_steps=self.args.logging_steps, eval_steps=self.args.eval_steps,
                                  save_steps=self.args.save_steps,
                                  train_batch_size=self.args.per_device_train_batch_size)
        self.result: training.TrainResult | None = None
        self.callback_handler.call("on_init_end", self.args, self.state)

    def _bound_rollout_func(self, rollout_func: Any) -> Any:
        """TRL's call: `rollout_func(prompts, trainer)`, the trainer being this object."""
        def bound(prompts: list[Any]) -> Any:
            return rollout_func(prompts, self)

        return bound

    def train(self, resume_from_checkpoint: Any = None) -> TrainOutput:
        """Train and export final/, as transformers' Trainer: a fresh run, unless `resume_from_checkpoint` is True
        (the newest checkpoint in args.output_dir) or names that checkpoint (`check_resume`). Returns transformers'
        `TrainOutput(global_step, training_loss, metrics)` (also when a resumed run was already complete: no step
        run, loss 0); `trainer.state.log_history` ends with the end-of-training record, as transformers'."""
        if not self._resumes_on_rerun:
            check_resume(self.args.output_dir, resume_from_checkpoint)
        self.result = training.train(self.args, self.given)
        self.state = self.result.state  # global_step, epoch, log_history, ... (TRL's trainer.state)
        self._loaded.pop("model", None)  # the trained policy is read from final/ on the next access
        summary = self.result.summary
        metrics = {k: v for k, v in summary.items() if k != "step"}
        return TrainOutput(self.result.step, float(summary.get("train_loss", 0.0)), metrics)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
                 ) -> dict[str, float]:
        """Sample and score the evaluation set(s) (`eval_dataset`, else the trainer's) with the newest checkpoint
        of args.output_dir (the initial policy before any), as the training loop evaluates; the metrics are logged
        and returned under TRL's names: `eval_reward`, ..., or `eval_<name>_reward` for a dict of named sets.
        Unlike TRL's, no `eval_loss` (TRL's: the training loss on the evaluation completions at importance ratio
        1, i.e. minus the advantages' token mean plus beta x KL): not computed here."""
        sets = self.given.eval_dataset if eval_dataset is None else eval_sets(eval_dataset, self.args)
        if metric_key_prefix != "eval":
            raise ConfigError("evaluate: metric_key_prefix must be 'eval' (TRL's names); name sets with a dict")
        given = dataclasses.replace(self.given, eval_dataset=sets)
        return training.evaluate_run(self.args, given)

    # -- what TRL users read from a trainer ---------------------------------------------------------------------
    @property
    def processing_class(self) -> Any:
        """The policy's tokenizer (the one given, else the model folder's), left padding and a pad token set."""
        if "tokenizer" not in self._loaded:
            from rloo_jax.models import load_tokenizer
            from rloo_jax.models.hf import given_tokenizer

            tok = self._tokenizer
            self._loaded["tokenizer"] = given_tokenizer(tok) if tok is not None else \
                load_tokenizer(self._model_dir(), padding_side="left")
        return self._loaded["tokenizer"]

    @property
    def model(self) -> Any:
        """The policy as a Flax `CausalLM`: the trained one (final/) after `train()`, else the initial one."""
        if "model" not in self._loaded:
            from rloo_jax.models import load_causal_lm

            final = os.path.join(os.path.abspath(self.args.output_dir), "final")
            trained = self.result is not None and os.path.isfile(os.path.join(final, "config.json"))
            self._loaded["model"] = load_causal_lm(final if trained else self._model_dir())
        return self._loaded["model"]

    @property
    def ref_model(self) -> Any:
        """The reference policy (a Flax `CausalLM`: the initial model), None without one (beta 0) or with LoRA
        (the base with its adapters off, or with a frozen copy of given starting adapters, is the reference), as
        TRL."""
        if not self.args.uses_reference or self.args.use_peft:
            return None
        if "ref_model" not in self._loaded:
            from rloo_jax.models import load_causal_lm

            self._loaded["ref_model"] = load_causal_lm(self._model_dir())
        return self._loaded["ref_model"]

    @property
    def reward_funcs(self) -> list[Any]:
        """The reward functions in scoring order: callables as given, reward models loaded (Flax `RewardModel`s),
        built-in and `module:function` names resolved to their functions."""
        if "reward_funcs" not in self._loaded:
            from rloo_jax.models import load_reward_model
            from rloo_jax.models.hf import resolve_checkpoint
            from rloo_jax.rewards import builtin_rewards, resolve_reward_funcs

            cfg = self.args
            builtins = builtin_rewards(cfg.format_reward_pattern, cfg.max_completion_length,
                                       cfg.resolved_soft_overlong_cache)
            resolved = resolve_reward_funcs(self._reward_sources, builtins,
                                            lambda p: load_reward_model(str(resolve_checkpoint(p))))
            self._loaded["reward_funcs"] = [f.fn for f in resolved]
        return self._loaded["reward_funcs"]

    @property
    def reward_processing_classes(self) -> list[Any]:
        """One entry per reward function: a reward model's tokenizer (the one given, else its folder's), None for
        a callable, as TRL."""
        from rloo_jax.models import load_tokenizer

        given = self._reward_tokenizers or [None] * len(self._reward_sources)
        return [tok if tok is not None else (load_tokenizer(src) if isinstance(src, str) and is_model(src) else None)
                for src, tok in zip(self._reward_sources, given, strict=True)]

    def _model_dir(self) -> str:
        from rloo_jax import demo
        from rloo_jax.models.hf import resolve_checkpoint

        if self.model_name_or_path == "demo":
            return demo.model_folder(self.args.seed)
        return str(resolve_checkpoint(self.model_name_or_path))

    # -- callbacks ----------------------------------------------------------------------------------------------
    def add_callback(self, callback: Any) -> None:
        """A transformers `TrainerCallback` (instance or class), called at the loop's events."""
        self.callback_handler.add(callback)

    def pop_callback(self, callback: Any) -> Any:
        return self.callback_handler.pop(callback)

    def remove_callback(self, callback: Any) -> None:
        self.callback_handler.pop(callback)

    @classmethod
    def from_args(cls, args: TrainConfig) -> "_OnlineTrainer":
        """The trainer of a config read from YAML and the command line (`python -m rloo_jax.train`), which resumes
        from output_dir's newest checkpoint on a rerun."""
        return cls(args.model_name_or_path, args.reward_sources, args=args).resuming_on_rerun()

    def resuming_on_rerun(self) -> "_OnlineTrainer":
        """This trainer, its train() continuing output_dir's newest checkpoint when there is one, else starting:
        the command line's rule (what `kill -9` and rerun relies on), not transformers'."""
        self._resumes_on_rerun = True
        return self

    def save_model(self, output_dir: str | None = None) -> str:
        """The trained policy (final/: a Hugging Face folder, or with LoRA a PEFT adapter folder), copied to
        `output_dir` when that is another folder; returns where it is."""
        final = os.path.join(os.path.abspath(self.args.output_dir), "final")
        if not os.path.isdir(final):
            raise ConfigError(f"no trained policy in {final} yet: call train() first")
        if output_dir is None or os.path.abspath(output_dir) == final:
            return final
        shutil.copytree(final, output_dir, dirs_exist_ok=True)
        return output_dir


def check_resume(output_dir: str, resume_from_checkpoint: Any) -> None:
    """transformers' rule in the Python API (the CLI resumes on a rerun, what `kill -9` and rerun relies on): None
    or False start a fresh run, refused (ConfigError) where `output_dir` holds an earlier run's checkpoints, which
    the run would otherwise continue or mix with; True continues the newest, refused where there is none; a path
    must name that newest checkpoint (`<output_dir>/checkpoints/<step>`) or `output_dir`: a run continues from its
    newest state only, what it logged after an older one is its own history."""
    steps = saved_steps(output_dir)
    newest = outputs.join(output_dir, "checkpoints", str(steps[-1])) if steps else None
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        if steps:
            raise ConfigError(f"args.output_dir {output_dir} holds the checkpoints of an earlier run (newest: step "
                              f"{steps[-1]}): continue it with train(resume_from_checkpoint=True), or start over "
                              "in another output_dir")
    elif resume_from_checkpoint is True:
        if not steps:
            raise ConfigError(f"resume_from_checkpoint=True, but args.output_dir {output_dir} holds no complete "
                              "checkpoint: call train() to start the run")
    elif not steps or os.fspath(outputs.resolve(os.fspath(resume_from_checkpoint))) not in (
            os.fspath(outputs.resolve(output_dir)), os.fspath(outputs.resolve(newest))):
        raise ConfigError(f"resume_from_checkpoint={os.fspath(resume_from_checkpoint)!r}: a run continues from the "
                          f"newest checkpoint of its args.output_dir ({newest or 'none yet'}); pass True or that path")


class RLOOTrainer(_OnlineTrainer):
    """RLOO with TRL 1.16's `RLOOTrainer` constructor and math (`RLOOConfig`); see `_OnlineTrainer` for the
    arguments. Beyond TRL: `tools` and `environment_factory` as `GRPOTrainer` takes them (multi-turn rollouts; the
    sequence log-probs and KL sum the model's tokens only)."""

    CONFIG = RLOOConfig


class GRPOTrainer(_OnlineTrainer):
    """GRPO with TRL 1.16's `GRPOTrainer` constructor and math (`GRPOConfig`: every `loss_type`); see
    `_OnlineTrainer` for the arguments, and:

    Args:
      tools: callables (sync or async; type hints and a Google-style docstring: their JSON schema is what the chat
        template shows) or `module:function` names: rollouts become conversations (`rloo_jax.conversations`): each
        assistant turn ends at an EOS, its tool calls run on the host (concurrently, with args.tool_timeout), their
        results are appended to the row's KV cache and decoding goes on; the loss sees the model's tokens only.
      environment_factory: a callable returning an environment (`reset(**row)`, public methods as tools, optional
        `get_reward()`), or {name: callable} picked by the rows' `environment` column (TRL's semantics).
      rollout_func: a custom generation function in the place of the sampler (TRL's; see `_OnlineTrainer`)."""

    CONFIG = GRPOConfig

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: Any = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        if (reward_funcs is None or (isinstance(reward_funcs, list | tuple) and not reward_funcs)) and \
                not environment_factory:
            raise ConfigError("No reward source provided: pass reward_funcs (callables, reward model folders or "
                              "built-in names), or an environment_factory whose environment defines get_reward")
        super().__init__(model, [] if reward_funcs is None else reward_funcs, args, train_dataset, eval_dataset,
                         processing_class, reward_processing_classes, callbacks, optimizers, quantization_config,
                         peft_config, tools, environment_factory, rollout_func)


class PPOTrainer(_OnlineTrainer):
    """PPO with TRL 1.12's `PPOTrainer` constructor (`trl.experimental.ppo`) and math (`PPOConfig`). Its models are
    what TRL's takes (loaded transformers models) or their folders / hub ids, as for the other trainers; a loaded
    model is converted in memory and written once under `args.output_dir` (a local one), which config.yaml then
    names like any folder: `base_model/` (a PeftModel's adapters in `base_model/adapter/`), `reward_model/`,
    `value_model/` (`rloo_jax.models.loaded`; a second construction with the same objects, a resume, writes nothing).

    Args:
      args: a `PPOConfig` (TRL 1.12's option names too). None: `PPOConfig(output_dir="<model name>-PPO")`.
      processing_class: the policy's tokenizer (None: read from `args.model_name_or_path`, else the policy's folder;
        a loaded policy's: its `config._name_or_path`'s). Its pad token must differ from its EOS (TRL's masks treat
        every pad id as padding): add one, as TRL's scripts do (`tokenizer.add_special_tokens({"pad_token":
        "[PAD]"})`, or `args.pad_token`).
      model: the policy (None: `args.sft_model_path`, else `args.model_name_or_path`): a folder or hub id, a PEFT
        adapter folder, a loaded causal LM `PreTrainedModel` or a peft `PeftModel` (its adapters trained from their
        values with its LoRA options, as `RLOOTrainer` takes one; not with `peft_config`).
      ref_model: None (a frozen copy of the policy; with LoRA, the base with the adapters off), the policy's own
        folder again, or a loaded model with the policy's weights (a PeftModel policy: its base's), compared tensor
        by tensor (TRL's scripts load the policy twice); a reference with other weights is refused: only the initial
        policy is supported as the reference.
      reward_model: a sequence-classification model (one label) of the policy's tokenizer, scored on the token ids
        on the device (None: `args.reward_model_path`): a folder or hub id, or loaded (written to `reward_model/`).
      train_dataset / eval_dataset: as TRL's PPO takes them (pre-tokenized `input_ids`) or with a `prompt` column
        (text or chat messages), a `datasets.Dataset` or a list of dicts.
      value_model: a sequence-classification model (one label), or a causal LM (its backbone with a new score head),
        as a folder / hub id or loaded (written to `value_model/`, unless it holds the same model as the loaded
        reward model or policy, as when TRL's scripts load the reward and the value model from one checkpoint: that
        folder is named then) (None: `args.value_model_path`, else the reward model's).
      data_collator: None or a `DataCollatorWithPadding` (prompts are always left-padded here).
      peft_config: LoRA on the policy (as `GRPOTrainer`'s); the value model is trained whole.
      reward_funcs: (not in TRL) Python reward functions (or their names) added to the reward model's score,
        weighted by `args.reward_weights` (the reward model first); with no reward model they are the score.
      callbacks: transformers-style callbacks, as for the other trainers (one event per PPO update).
      optimizers: refused unless None, as for the other trainers.
    """

    CONFIG = PPOConfig

    def __init__(
        self,
        args: PPOConfig | None = None,
        processing_class: Any = None,
        model: Any = None,
        ref_model: Any = None,
        reward_model: Any = None,
        train_dataset: Any = None,
        value_model: Any = None,
        data_collator: Any = None,
        eval_dataset: Any = None,
        optimizers: tuple[Any, Any] = (None, None),
        callbacks: Any = None,
        peft_config: Any = None,
        reward_funcs: Any = None,
    ) -> None:
        given_policy = None if model is None or isinstance(model, str | os.PathLike) else loaded_policy(model)
        for name, value, what in (("ref_model", ref_model, "the policy's weights"),
                                  ("reward_model", reward_model, "*ForSequenceClassification, num_labels=1"),
                                  ("value_model", value_model, "*ForSequenceClassification with num_labels=1, or a "
                                                               "causal LM")):
            check_model_argument(name, value, what)
        if any(o is not None for o in optimizers):
            raise ConfigError("optimizers is not supported: the optimizer is optax AdamW configured by args "
                              "(learning_rate, lr_scheduler_type, warmup_steps, weight_decay, adam_*), over the "
                              "policy and the value model as TRL's")
        if data_collator is not None and type(data_collator).__name__ != "DataCollatorWithPadding":
            raise ConfigError(f"data_collator {type(data_collator).__name__} is not supported: prompts are "
                              "left-padded here, as TRL's DataCollatorWithPadding does; pass None")
        if args is None:
            name = "policy" if model is None else os.fspath(model) if given_policy is None else \
                loaded.name_or_path(model) or type(model).__name__
            args = self.CONFIG(output_dir=f"{os.path.basename(name.rstrip('/'))}-{self.CONFIG.ALGORITHM.upper()}",
                             **({"sft_model_path": os.fspath(model)} if model is not None and given_policy is None
                                else {}))
        if not isinstance(args, self.CONFIG):
            raise ConfigError(f"{type(self).__name__} takes a {self.CONFIG.__name__} as args (got a "
                              f"{type(args).__name__})")
        funcs = None
        if reward_funcs is not None:
            funcs = list(reward_funcs) if isinstance(reward_funcs, list | tuple) else [reward_funcs]
            for i, f in enumerate(funcs):
                if loaded.is_torch_module(f):
                    raise ConfigError(f"reward_funcs[{i}] is a {type(f).__name__}: PPO's reward_funcs are Python "
                                      "functions; pass a reward model as reward_model")
        policy = args.policy_path if model is None else model
        check_reference(ref_model, policy, args.seed)  # before anything is written
        overrides: dict[str, Any] = lora_options(peft_config)
        written: list[str] = []  # folders written from loaded models, which a loaded value model may share
        if policy is not None:
            policy, lora_given = policy_folder(policy, args, processing_class, peft_config)
            overrides.update(lora_given)
            if given_policy is not None:
                written.append(policy)
        if policy != args.policy_path:
            overrides["sft_model_path"] = policy
        if isinstance(reward_model, str | os.PathLike):
            overrides["reward_model_path"] = os.fspath(reward_model)
        elif reward_model is not None:
            overrides["reward_model_path"] = loaded_model_folder(
                reward_model, args.output_dir, "reward_model", "reward", own_tokenizer(reward_model),
                "a loaded reward model")[0]
            written.append(overrides["reward_model_path"])
        if isinstance(value_model, str | os.PathLike):
            overrides["value_model_path"] = os.fspath(value_model)
        elif value_model is not None:
            overrides["value_model_path"] = loaded_value_model(value_model, args.output_dir, written)
        if funcs is not None:
            overrides["reward_funcs"] = [describe(f) for f in funcs]
        if train_dataset is not None:
            overrides["dataset_name"] = IN_MEMORY
        elif not args.dataset_name:
            raise ConfigError("train_dataset is required (or set args.dataset_name to a dataset to load)")
        self.args = replace(args, device_count=jax.device_count(), process_count=jax.process_count(), **overrides)
        self.args.require_sources(len(self.args.reward_sources))
        if self.args.evaluates and eval_dataset is None and train_dataset is not None:
            raise ConfigError(f"{evaluation_option(self.args)} but no eval_dataset was given; pass one, or "
                              "eval_steps=None (eval_strategy='steps')")
        self.model_name_or_path = policy
        self._reward_sources = funcs or []
        self._tokenizer = processing_class
        self._reward_tokenizers = None
        self._loaded: dict[str, Any] = {}
        self.train_dataset = None if train_dataset is None else prompt_dataset(train_dataset, "train_dataset",
                                                                               self.args)
        self.eval_dataset = eval_dataset  # as given
        self.callback_handler = CallbackHandler(callbacks)
        sets = None if eval_dataset is None else eval_sets(eval_dataset, self.args)
        self.given = Given(processing_class, self.train_dataset, sets, funcs, None,
                           self.callback_handler.callbacks)
        self.state = TrainerState(max_steps=self.args.max_steps, num_train_epochs=self.args.num_train_epochs,
                                  logging_steps=self.args.logging_steps, eval_steps=self.args.eval_steps,
                                  save_steps=self.args.save_steps,
                                  train_batch_size=self.args.per_device_train_batch_size)
        self.result = None
        self.callback_handler.call("on_init_end", self.args, self.state)

    @property
    def ref_model(self) -> Any:
        """The reference policy (a Flax `CausalLM`: the initial model; PPO always keeps one), None with LoRA (the
        base with its adapters off is the reference)."""
        if self.args.use_peft:
            return None
        if "ref_model" not in self._loaded:
            from rloo_jax.models import load_causal_lm

            self._loaded["ref_model"] = load_causal_lm(self._model_dir())
        return self._loaded["ref_model"]

    @classmethod
    def from_args(cls, args: TrainConfig) -> "PPOTrainer":
        return cls(args=args).resuming_on_rerun()


def check_rollout_func(rollout_func: Any, tools: Any, environment_factory: Any, processes: int) -> None:
    """rollout_func: a callable, not with tools or an environment (TRL runs its tool loop on a rollout_func's
    completions; not supported here), on one process (it runs on the host, as the tools do)."""
    if not callable(rollout_func):
        raise ConfigError(f"rollout_func must be a callable (prompts, trainer) -> dict (got a "
                          f"{type(rollout_func).__name__})")
    if tools or environment_factory:
        raise ConfigError("rollout_func with tools or environment_factory is not supported: pass one or the other "
                          "(TRL runs its tool loop on a rollout_func's completions; here the tools run in the "
                          "sampler's multi-turn rollouts only)")
    if processes > 1:
        raise ConfigError("rollout_func runs on one process here (the host calls it for the whole generation "
                          "batch); drop --num_processes or the rollout_func")


def environment_rows(cfg: TrainConfig, factory: Any) -> list[dict[str, Any]]:
    """TRL's placeholder dataset when an environment owns the data (no train_dataset): one generation batch of
    empty user prompts, cycled; each rollout's `reset()` supplies its prompt. Needs max_steps, one factory."""
    if isinstance(factory, dict):
        raise ConfigError("A `dict` `environment_factory` (multiple environments) requires a `train_dataset` with an "
                          "`environment` column to route each example to its environment.")
    if cfg.max_steps <= 0:
        raise ConfigError("When training without a `train_dataset` (the environment owns the data), `max_steps` must "
                          "be set to a positive value to define the training length.")
    machine = training.for_this_machine(cfg)
    return [{"prompt": [{"role": "user", "content": ""}]}] * machine.prompts_per_generation


def evaluation_option(cfg: TrainConfig) -> str:
    """What asks `cfg` to evaluate, as a ConfigError names it."""
    return "args.eval_strategy is 'epoch'" if cfg.eval_strategy == "epoch" else "args.eval_steps is set"


def refuse_epoch_strategies(cfg: TrainConfig, why: str) -> None:
    """ConfigError when save_strategy or eval_strategy is `epoch` but the training data has no epochs (`why`): the
    run is max_steps long, so an interval in steps (or a ratio of max_steps) is what applies."""
    for strategy, steps in (("save_strategy", "save_steps"), ("eval_strategy", "eval_steps")):
        if getattr(cfg, strategy) == "epoch":
            raise ConfigError(f"args.{strategy}='epoch' needs the length of an epoch, and {why}: the run is max_steps "
                              f"long; use {strategy}='steps' with {steps}=N steps or a ratio of max_steps (e.g. "
                              f"{steps}=0.25)")


def prompts_needed(cfg: TrainConfig) -> int | None:
    """Prompts a run of max_steps reads (generations x prompts per generation on this machine's devices); None
    when max_steps is not set."""
    if cfg.max_steps <= 0:
        return None
    cfg = training.for_this_machine(cfg)
    # max_steps x gradient_accumulation_steps micro-batches, steps_per_generation x num_iterations per generation
    micro = cfg.micro_per_generation
    return math.ceil(cfg.max_steps * cfg.gradient_accumulation_steps / micro) * cfg.prompts_per_generation


# The trainer of each algorithm (the Python API; the command line runs it on a config read from argv): one line each.
# The configs' registry is `rloo_jax.algorithms.CONFIGS`.
TRAINERS: dict[str, type[_OnlineTrainer]] = {cls.CONFIG.ALGORITHM: cls for cls in (
    RLOOTrainer,
    GRPOTrainer,
    PPOTrainer,
)}

__all__ = ["TRAINERS", "GRPOTrainer", "PPOTrainer", "RLOOTrainer"]
