"""What the Python API is given instead of what a config names: loaded transformers models and PeftModels (written
once as folders under output_dir, which config.yaml then names), reward functions as objects, datasets as objects
(a `prompt` column, TRL's pre-tokenized `input_ids`, streams), peft `LoraConfig`s as our LoRA options, tokenizers.
The trainers (`rloo_jax.trainers`) turn their arguments into a config and a `Given` with these."""

import dataclasses
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import datasets

from rloo_jax.data import check_prompt_dataset
from rloo_jax.errors import ConfigError, DataError
from rloo_jax.models import loaded

IN_MEMORY = "<train_dataset>"  # dataset_name recorded in config.yaml for a dataset passed as an object


def eval_sets(data: Any, cfg: Any) -> dict[str, Any]:
    """`eval_dataset` as TRL takes it: one set, or a dict / DatasetDict of named sets (metrics `eval_<name>_*`)."""
    if isinstance(data, dict | datasets.DatasetDict):
        if not data:
            raise DataError("eval_dataset is an empty dict; pass a set, or named sets")
        return {str(name): prompt_dataset(ds, f"eval_dataset[{name!r}]", cfg) for name, ds in data.items()}
    return {"": prompt_dataset(data, "eval_dataset", cfg)}


def is_model(source: str) -> bool:
    """A reward source that names a model folder or hub id (not a built-in or `module:function`)."""
    return os.path.isdir(source) or ("/" in source and ":" not in source and not source.endswith(".py"))


# ------------------------------------------------------------------------------------------------ arguments
def loaded_policy(model: Any) -> Any:
    """A `model` that is no path must be a transformers `PreTrainedModel` or a peft `PeftModel` (ConfigError
    otherwise); returned as it is."""
    if loaded.is_peft_model(model) or loaded.is_pretrained_model(model):
        return model
    kind = "a torch module that is not a transformers PreTrainedModel" if loaded.is_torch_module(model) else \
        f"type {type(model).__name__}"
    raise ConfigError(f"model must be a local folder, a hub id, a transformers PreTrainedModel or a peft PeftModel "
                      f"(got {kind}); save_pretrained a model of a supported architecture and pass its folder")


def _local_output_dir(output_dir: str, what: str) -> str:
    from rloo_jax.outputs import is_remote

    if is_remote(output_dir):
        raise ConfigError(f"{what} is written to output_dir as a Hugging Face folder, so output_dir must be local "
                          f"(got {output_dir}); or save_pretrained the model and pass its folder")
    return os.path.abspath(os.path.expanduser(output_dir))


def _loaded_tokenizer(model: Any, given: Any, what: str) -> Any:
    """The tokenizer written with a loaded model: the one given, else its `config._name_or_path`'s (TRL)."""
    if given is not None:
        return given
    from rloo_jax.models import ModelLoadError, load_tokenizer

    name = loaded.name_or_path(model)
    try:
        if not name:
            raise ModelLoadError("its config has no _name_or_path")
        return load_tokenizer(name)
    except ModelLoadError as e:
        raise ConfigError(f"no tokenizer for the loaded {what} ({e}); pass it "
                          f"({'processing_class' if what == 'model' else 'reward_processing_classes'})") from None


def loaded_model_folder(model: Any, output_dir: str, name: str, task: str, tokenizer: Any, what: str,
                        print_: str | None = None) -> tuple[str, dict[str, Any]]:
    """A loaded model written once to `<output_dir>/<name>/` (`rloo_jax.models.loaded.save_loaded`, task "causal_lm"
    | "reward"; `what` names it in errors); returns the path to train from (a PeftModel: its adapter folder) and, for
    a PeftModel, its LoRA options."""
    where = os.path.join(_local_output_dir(output_dir, what), name)
    return loaded.save_loaded(model, where, task, tokenizer, print_)


def loaded_policy_folder(model: Any, output_dir: str, tokenizer: Any) -> tuple[str, dict[str, Any]]:
    """A loaded policy written to `<output_dir>/base_model/` (once); returns the path to train from (a PeftModel:
    its adapter folder) and, for a PeftModel, its LoRA options."""
    return loaded_model_folder(model, output_dir, "base_model", "causal_lm",
                               _loaded_tokenizer(model, tokenizer, "model"), "a loaded model")


def policy_folder(model: Any, args: Any, tokenizer: Any, peft_config: Any) -> tuple[str, dict[str, Any]]:
    """The policy (a path, or a loaded model checked by `loaded_policy`) as the path to train from, and the LoRA
    options it brings: a loaded model is written to `<output_dir>/base_model/` (`loaded_policy_folder`); a PeftModel
    or a PEFT adapter folder brings its own (TRL trains a PeftModel's adapters from where they are, with their
    options), unless args sets use_peft (the CLI's --use_peft --lora_r ...: checked against the folder's instead,
    `policy.check_adapter_options`). Either one with a peft_config is refused, as TRL refuses it."""
    given = not isinstance(model, str | os.PathLike)
    if peft_config is not None and (loaded.is_peft_model(model) or not given and adapter_folder(model)):
        raise ConfigError("You passed a PeftModel (or a PEFT adapter folder) together with a peft_config: its "
                          "adapters are trained with their own LoRA options; pass peft_config=None, or merge "
                          "them into a base model and pass that with the new peft_config (as TRL asks)")
    lora_given: dict[str, Any] = {}
    if given:
        model, lora_given = loaded_policy_folder(model, args.output_dir, tokenizer)
    model = os.fspath(model)
    if not lora_given and adapter_folder(model) and not args.use_peft:
        lora_given = loaded.adapter_lora_options(model)
    return model, lora_given


def loaded_reward_model(model: Any, index: int, output_dir: str, tokenizer: Any) -> str:
    """A loaded reward model (reward_funcs[index]) written to `<output_dir>/reward_model_<index>/` (once); its path."""
    if not loaded.is_pretrained_model(model) or loaded.is_peft_model(model):
        raise ConfigError(f"reward_funcs[{index}] is a {type(model).__name__}: a reward model must be a transformers "
                          "PreTrainedModel (*ForSequenceClassification, num_labels=1) or its folder")
    return loaded_model_folder(model, output_dir, f"reward_model_{index}", "reward",
                               _loaded_tokenizer(model, tokenizer, "reward model"), "a loaded reward model")[0]


def check_model_argument(name: str, value: Any, what: str) -> None:
    """PPO's ref_model, reward_model and value_model: None, a folder or hub id, or a loaded transformers
    `PreTrainedModel` (`what` it must be); a ConfigError naming `name` for anything else (a PeftModel too: LoRA is
    for the policy)."""
    if value is None or isinstance(value, str | os.PathLike) or (
            loaded.is_pretrained_model(value) and not loaded.is_peft_model(value)):
        return
    kind = "a peft PeftModel (LoRA is for the policy only)" if loaded.is_peft_model(value) else \
        "a torch module that is not a transformers PreTrainedModel" if loaded.is_torch_module(value) else \
        f"a {type(value).__name__}"
    raise ConfigError(f"{name} must be a local folder, a hub id or a loaded transformers PreTrainedModel ({what}); "
                      f"got {kind}")


def _weights(source: Any, seed: int) -> tuple[Any, bool]:
    """The weights of a PPO policy or reference, to compare (`check_reference`): a loaded model's state dict (a
    PeftModel: its base's, the adapters cut out), else its folder's tensors (a PEFT adapter folder: its base's; read
    one at a time); and whether its LM head is tied (a folder's is then left out of the file)."""
    if not isinstance(source, str | os.PathLike):
        tensors = loaded.peft_parts(source)[1] if loaded.is_peft_model(source) else source.state_dict()
        return loaded.StateDictReader(tensors), loaded.tied(source)
    from rloo_jax import demo
    from rloo_jax.models.hf import TensorReader, adapter_base, resolve_checkpoint

    path = os.fspath(source)
    if path == "demo":
        path = demo.model_folder(seed)
    folder = resolve_checkpoint(path)
    base = adapter_base(folder)
    return TensorReader(resolve_checkpoint(base) if base else folder), False


def check_reference(ref_model: Any, policy: Any, seed: int) -> None:
    """PPO's `ref_model` must be the initial policy, the only reference supported (with LoRA: the base with the
    adapters off): None, the policy's own path again, or, when either is a loaded model, weights equal to the
    policy's (a PeftModel: its base's) tensor by tensor (`loaded.first_difference`); a ConfigError otherwise. TRL's
    scripts load the policy twice, as `model` and `ref_model`."""
    if ref_model is None or policy is None:
        return
    if isinstance(ref_model, str | os.PathLike) and isinstance(policy, str | os.PathLike):
        if os.fspath(ref_model) == os.fspath(policy):
            return
        why = f"{os.fspath(ref_model)} is not the policy's folder {os.fspath(policy)}"
    else:
        (ref, ref_tied), (ours, our_tied) = _weights(ref_model, seed), _weights(policy, seed)
        name = loaded.first_difference(ref, ours, ref_tied or our_tied)
        if name is None:
            return
        why = f"its weights are not the policy's: {name} differs"
    raise ConfigError(f"ref_model: only the initial policy is supported as the reference ({why}); pass None (a frozen "
                      "copy of the policy; with LoRA the base with the adapters off), the policy's folder, or the "
                      "policy loaded again")


def own_tokenizer(model: Any) -> Any:
    """The tokenizer written with a loaded PPO reward or value model: its `config._name_or_path`'s when that loads,
    else none. PPO scores the policy's token ids with it: a tokenizer in its folder is checked to have the policy's
    vocabulary, and without one its vocab_size is (`models.hf.check_same_tokenizer`)."""
    from rloo_jax.models import ModelLoadError, load_tokenizer

    name = loaded.name_or_path(model)
    try:
        return load_tokenizer(name) if name else None
    except (ModelLoadError, OSError, ValueError):
        return None


def loaded_value_model(model: Any, output_dir: str, written: list[str]) -> str:
    """A loaded PPO value model as a folder: one of `written` (folders this run wrote from its loaded policy and
    reward model) when that holds the same model (the same `loaded.fingerprint`: class, config, every tensor), as
    when TRL's scripts load the reward and the value model from one checkpoint; else `<output_dir>/value_model/`,
    written once: a `*ForSequenceClassification` model as one, a causal LM as one (the run gives its backbone a new
    score head, as for a causal LM's folder)."""
    from rloo_jax.models.config import family_and_task

    print_ = loaded.fingerprint(model)
    for folder in written:
        if loaded.held_fingerprint(folder) == print_:
            return folder
    task = family_and_task(loaded.hf_config(model))[1] or "reward"
    return loaded_model_folder(model, output_dir, "value_model", task, own_tokenizer(model), "a loaded value model",
                               print_)[0]


def adapter_folder(path: str) -> bool:
    """A local PEFT adapter folder (adapter_config.json)."""
    from rloo_jax.models.hf import ADAPTER_CONFIG

    return os.path.isfile(os.path.join(os.path.expanduser(path), ADAPTER_CONFIG))


def describe(func: Any) -> str:
    """A reward for config.yaml: strings as given, callables as `module:qualname` (importable for top-level
    functions, so the recorded config can be rerun with the CLI)."""
    if isinstance(func, str):
        return func
    if not callable(func):
        raise ConfigError(f"reward_funcs entries must be callables or strings (got a {type(func).__name__})")
    inner = func.func if hasattr(func, "func") else func
    name = getattr(inner, "__qualname__", None) or type(inner).__name__
    return f"{getattr(inner, '__module__', None) or 'python'}:{name}"


def reward_tokenizers(classes: Any, count: int) -> list[Any] | None:
    """TRL's reward_processing_classes: one per reward function (a single one for a single function)."""
    if classes is None:
        return None
    classes = list(classes) if isinstance(classes, list | tuple) else [classes]
    if len(classes) != count:
        raise ConfigError(f"The number of reward processing classes ({len(classes)}) must match the number of reward "
                          f"functions ({count}); give one per function (None for callables)")
    return classes


# peft LoraConfig attribute -> our option; the values of the others that ask for nothing
LORA_FIELDS = {"r": "lora_r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout",
               "target_modules": "lora_target_modules", "use_rslora": "use_rslora",
               "target_parameters": "lora_target_parameters"}


LORA_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "use_dora": lambda v: not v,
    "modules_to_save": lambda v: not v,
    "layers_to_transform": lambda v: v is None,
    "rank_pattern": lambda v: not v,
    "alpha_pattern": lambda v: not v,
    "bias": lambda v: v in (None, "none"),
    "init_lora_weights": lambda v: v is True,
    "task_type": lambda v: v is None or str(getattr(v, "value", v)).upper() == "CAUSAL_LM",
}


def lora_options(peft_config: Any) -> dict[str, Any]:
    """peft's `LoraConfig` (or a dict with its names or ours) -> our LoRA options (use_peft on); None -> {}."""
    if peft_config is None:
        return {}
    if isinstance(peft_config, dict):
        values = dict(peft_config)
    else:
        kind = str(getattr(getattr(peft_config, "peft_type", "LORA"), "value", getattr(peft_config, "peft_type", "")))
        if kind.upper() != "LORA":
            raise ConfigError(f"peft_config: only LoRA is supported (got {type(peft_config).__name__})")
        values = {k: getattr(peft_config, k) for k in (*LORA_FIELDS, *LORA_UNSUPPORTED) if hasattr(peft_config, k)}
    for name, ok in LORA_UNSUPPORTED.items():
        if name in values and not ok(values[name]):
            raise ConfigError(f"peft_config: {name}={values[name]!r} is not supported (LoRA on the projections of "
                              "the blocks, A as peft initialises it, B zero; no DoRA, bias or extra modules)")
    ours = {"use_peft": True}
    for key, value in values.items():
        name = LORA_FIELDS.get(key, key)
        if name in LORA_FIELDS.values():
            ours[name] = sorted(value) if isinstance(value, set) else value
        elif key not in LORA_UNSUPPORTED and key not in ("use_peft",):
            raise ConfigError(f"peft_config: unknown LoRA option {key!r}; use r, lora_alpha, lora_dropout, "
                              "target_modules, target_parameters, use_rslora")
    if not ours.get("lora_target_parameters", True):  # peft's None / []: no expert adapters, the option's default
        del ours["lora_target_parameters"]
    if isinstance(ours.get("lora_target_modules"), str) and ours["lora_target_modules"] != "all-linear":
        raise ConfigError("peft_config: target_modules as a regular expression is not supported; list the modules")
    if isinstance(ours.get("lora_target_modules"), str):
        ours["lora_target_modules"] = [ours["lora_target_modules"]]
    return ours


def prompt_dataset(data: Any, name: str, cfg: Any, stream_rows: int | None = None) -> datasets.Dataset:
    """A `datasets.Dataset` with a `prompt` column from a Dataset, an IterableDataset (its first `stream_rows`
    rows; all of an evaluation set) or a list of dicts."""
    if isinstance(data, datasets.DatasetDict | datasets.IterableDatasetDict | dict):
        raise DataError(f"{name} must be one split (a Dataset), not a {type(data).__name__}; pick a split, e.g. "
                        "ds['train']")
    if isinstance(data, datasets.IterableDataset):
        if name == "train_dataset" and stream_rows is None:
            raise ConfigError("an IterableDataset has no length: set args.max_steps (as TRL requires)")
        data = datasets.Dataset.from_list(list(itertools.islice(iter(data), stream_rows)))
    elif isinstance(data, Sequence) and not isinstance(data, datasets.Dataset | str):
        if not all(isinstance(row, dict) for row in data):
            raise DataError(f"{name}: a list must hold one dict per row, with a `prompt` key")
        data = datasets.Dataset.from_list(list(data))
    if not isinstance(data, datasets.Dataset):
        raise DataError(f"{name} must be a datasets.Dataset, an IterableDataset or a list of dicts (got a "
                        f"{type(data).__name__})")
    check_prompt_dataset(data, name)
    return data


@dataclasses.dataclass
class Given:
    """Objects the Python API (`rloo_jax.RLOOTrainer`) passes instead of what the config names; None: load what
    the config names."""

    tokenizer: Any = None  # the policy's tokenizer (TRL's processing_class)
    train_dataset: Any = None  # datasets.Dataset with a `prompt` column
    eval_dataset: Any = None  # one set, or {name: set} (TRL's metric prefixes eval_<name>_)
    reward_funcs: list[Any] | None = None  # callables and/or reward_funcs strings, in scoring order
    reward_tokenizers: list[Any] | None = None  # one per reward_funcs entry (None: a reward model's own)
    callbacks: list[Any] | None = None  # transformers-style callbacks (rloo_jax.callbacks)
    tools: list[Any] | None = None  # tool callables (TRL's `tools`), in the place of the config's names
    environment_factory: Any = None  # TRL's `environment_factory` (a callable or {name: callable})
    rollout_func: Callable[[list[Any]], dict[str, Any]] | None = None  # TRL's rollout_func bound to the trainer
