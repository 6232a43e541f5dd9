"""Models handed over as torch objects, as TRL takes them: a transformers `PreTrainedModel` (the policy, or a
`*ForSequenceClassification` reward model) or a peft `PeftModel` (LoRA on a causal LM).

Their state dict is converted in memory through the same weight tables as a folder's safetensors (`hf.weight_table`,
`hf.adapter_table`): `StateDictReader` gives `hf._fill` / `hf.fill_adapters` the tensors a `TensorReader` gives them,
and the config is `model.config.to_dict()`. torch is never imported: every object touched is one the user passed
(torch is then already their import), reached by duck typing (`state_dict`, `detach().cpu().numpy()`).

`save_loaded` then writes the converted model once as a Hugging Face folder (our `save_pretrained` + the tokenizer
+ generation_config.json; a PeftModel: its base, and its adapters as a PEFT adapter folder naming that base), so
that everything that reads a run's `model_name_or_path` (resume, `final/` export, `python -m rloo_jax.export`, the
CLI on the recorded config.yaml) reads it as any folder. A fingerprint of the state dict and config
(`loaded_from.json`) lets a second construction with the same object (a resume) skip the write, and refuses
another model in its place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from rloo_jax.errors import ConfigError
from rloo_jax.models.config import ModelConfig, ModelLoadError, lora_spec
from rloo_jax.models.hf import (
    _IGNORED,
    ADAPTER_CONFIG,
    _fill,
    config_of,
    fill_adapters,
    save_adapter,
    save_pretrained,
)
from rloo_jax.models.transformer import CausalLM, RewardModel

TIED_HEADS = ("lm_head.weight", "embed_out.weight")  # the LM head a tied model's folder leaves out
MARKER = "loaded_from.json"  # in a folder written from a loaded model: its class and fingerprint
# torch dtype -> (the Flax storage dtype that holds it exactly, the dtype the folder is written in)
_DTYPES = {"torch.float32": ("float32", "float32"), "torch.bfloat16": ("bfloat16", "bfloat16"),
           "torch.float16": ("float32", "float16")}
# peft LoraConfig fields that change what we would compute (plain LoRA leaves each None, False, empty or "none")
_PEFT_PLAIN = ("use_dora", "bias", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform",
               "fan_in_fan_out", "lora_bias", "trainable_token_indices", "layer_replication")


# ------------------------------------------------------------------------------------------------ recognising
def is_torch_module(obj: Any) -> bool:
    """A torch `nn.Module` (duck-typed: `state_dict` and `named_parameters`)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "named_parameters", None))


def is_peft_model(obj: Any) -> bool:
    """A peft `PeftModel` (it has `peft_config` and `get_base_model`)."""
    return is_torch_module(obj) and isinstance(getattr(obj, "peft_config", None), dict) and \
        callable(getattr(obj, "get_base_model", None))


def is_pretrained_model(obj: Any) -> bool:
    """A transformers `PreTrainedModel` (a torch module with a `config.to_dict()` and `save_pretrained`)."""
    return is_torch_module(obj) and callable(getattr(getattr(obj, "config", None), "to_dict", None)) and \
        callable(getattr(obj, "save_pretrained", None))


# ------------------------------------------------------------------------------------------------ reading
def to_numpy(tensor: Any) -> np.ndarray:
    """A torch tensor as a numpy array of the same values: bf16 through float32 (exact: bf16 is float32's top half)
    into ml_dtypes' bfloat16; the others as `numpy()` gives them."""
    t = tensor.detach().cpu()
    if str(t.dtype) == "torch.bfloat16":
        return t.float().numpy().astype(ml_dtypes.bfloat16)
    return t.numpy()


class StateDictReader:
    """`hf.TensorReader`'s interface (names, shape, get) over an in-memory `{name: torch tensor}`."""

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def names(self) -> set[str]:
        return set(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in self.tensors[name].shape)

    def get(self, name: str) -> np.ndarray:
        return to_numpy(self.tensors[name])


def hf_config(model: Any) -> dict[str, Any]:
    """The config dict of a loaded `PreTrainedModel`, its architecture named by its class (a model built from a
    config, not loaded, has `architectures` None)."""
    hf = model.config.to_dict()
    hf["architectures"] = [type(model).__name__]
    return hf


def storage_dtype(model: Any) -> tuple[str, str]:
    """(Flax param_dtype that holds the model's weights exactly, the dtype its folder is written in)."""
    dtype = str(next(iter(model.state_dict().values())).dtype)
    if dtype not in _DTYPES:
        raise ModelLoadError(f"a loaded model in {dtype} is not supported (float32, bfloat16 or float16)")
    return _DTYPES[dtype]


def convert(model: Any, task: str = "causal_lm", tensors: dict[str, Any] | None = None) -> CausalLM | RewardModel:
    """A loaded `PreTrainedModel` (task "causal_lm" or "reward") as our Flax model, in its own dtype, in host memory;
    `tensors`: its state dict when it is not `model.state_dict()` (a PeftModel's base with the adapters cut out).
    An unsupported architecture is the ModelLoadError a folder gets."""
    from rloo_jax.mesh import host_memory

    name = type(model).__name__
    cfg: ModelConfig = config_of(hf_config(model), f"the loaded {name}", task, param_dtype=storage_dtype(model)[0])
    with host_memory():  # converted on the host: the run shards it later, as a folder's weights
        return _fill(CausalLM if task == "causal_lm" else RewardModel, cfg, task,
                     StateDictReader(model.state_dict() if tensors is None else tensors))


def peft_parts(model: Any) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A PeftModel -> (its base `PreTrainedModel`, the base's state dict without peft's names (`base_layer.`
    dropped, adapters cut out), its adapters under PEFT's adapter-file names (`...lora_A.weight`), its LoRA config
    as a dict). One plain LoRA adapter only: ConfigError for several, DoRA, bias, modules_to_save and the other
    variants we do not compute."""
    names = list(model.peft_config)
    if len(names) != 1:
        raise ConfigError(f"the PeftModel holds {len(names)} adapters ({', '.join(names)}); pass one")
    (adapter,) = names
    pc = model.peft_config[adapter]
    kind = str(getattr(getattr(pc, "peft_type", ""), "value", getattr(pc, "peft_type", "")))
    if kind.upper() != "LORA":
        raise ConfigError(f"the PeftModel's adapter is {kind}: only LoRA is supported")
    values = pc.to_dict() if callable(getattr(pc, "to_dict", None)) else dict(vars(pc))
    plain_lora(values, "the PeftModel's LoraConfig", ConfigError)
    base = model.get_base_model()
    base_tensors, adapters = {}, {}
    tag = f".{adapter}."
    for key, value in base.state_dict().items():
        if ".lora_A." in key or ".lora_B." in key:
            if tag not in key:
                continue
            adapters["base_model.model." + key.replace(tag, ".")] = value
        elif ".lora_" in key or ".lora_magnitude_vector" in key:
            raise ConfigError(f"the PeftModel holds {key}: not a plain LoRA adapter")
        else:
            # a parameter-wrapped module (peft's target_parameters) nests one base_layer per targeted parameter
            base_tensors[re.sub(r"(\.base_layer)+\.", ".", key)] = value
    return base, base_tensors, adapters, values


def peft_lora_options(values: dict[str, Any]) -> dict[str, Any]:
    """A PeftModel's LoraConfig (as a dict) -> our LoRA options (use_peft on)."""
    targets = values.get("target_modules")
    if isinstance(targets, str) and targets != "all-linear":
        raise ModelLoadError("the PeftModel's target_modules is a regular expression: not supported; list the modules")
    # peft matches a name by its last part(s): "model.layers.0.self_attn.q_proj" targets q_proj (in every layer;
    # adapters missing from some layers are then a missing-tensor error)
    targets = [targets] if isinstance(targets, str) else sorted({t.rsplit(".", 1)[-1] for t in targets or []})
    params = sorted(values.get("target_parameters") or []) or None  # the experts' (peft's ParamWrapper)
    return {"use_peft": True, "lora_r": int(values["r"]), "lora_alpha": values["lora_alpha"],
            "lora_dropout": float(values.get("lora_dropout") or 0.0),
            "lora_target_modules": targets if targets or params else None, "use_rslora": bool(values.get("use_rslora",
                                                                                                       False)),
            "lora_target_parameters": params}


def plain_lora(values: dict[str, Any], where: str, error: type[Exception] = ModelLoadError) -> None:
    """`error` naming `where` when a LoRA config (a dict of peft's LoraConfig fields) asks for what we do
    not compute: DoRA, bias, modules_to_save, per-layer ranks or layers, fan_in_fan_out, ..."""
    odd = [f"{k}={values[k]!r}" for k in _PEFT_PLAIN if values.get(k) not in (None, False, {}, [], "none")]
    if odd:
        raise error(f"{where} sets {', '.join(odd)}: not supported (plain LoRA on the projections of the blocks: no "
                    "DoRA, bias, extra trained modules or per-layer ranks)")


def adapter_lora_options(folder: str | os.PathLike) -> dict[str, Any]:
    """A PEFT adapter folder's LoRA options (its adapter_config.json) as ours (use_peft on)."""
    f = Path(folder) / ADAPTER_CONFIG
    values = json.loads(f.read_text())
    plain_lora(values, str(f))
    return peft_lora_options(values)


def convert_peft(model: Any) -> tuple[CausalLM, dict[str, Any]]:
    """A PeftModel -> (our CausalLM: its base with its adapters at their current values, its LoRA options)."""
    import jax

    from rloo_jax.models.lora import with_adapters

    base, base_tensors, adapters, values = peft_parts(model)
    plain = convert(base, "causal_lm", base_tensors)
    options = peft_lora_options(values)
    spec = lora_spec(plain.config.family, options["lora_r"], options["lora_alpha"], options["lora_dropout"],
                     options["lora_target_modules"], options["use_rslora"], options["lora_target_parameters"])
    # float32 adapters (peft's own storage; exact for any source dtype); A and B overwritten with the PeftModel's
    lora = with_adapters(plain, spec, jax.random.key(0), "float32")
    return fill_adapters(lora, StateDictReader(adapters), f"the PeftModel's adapters ({type(base).__name__})"), \
        options


def strip_adapters(model: CausalLM) -> CausalLM:
    """A model with adapters as the plain model of its base (the adapters dropped, not merged)."""
    from flax import nnx

    from rloo_jax.models.lora import split_adapters

    plain = nnx.eval_shape(lambda: CausalLM(model.config.replace(lora=None), nnx.Rngs(0)))
    return nnx.merge(nnx.graphdef(plain), split_adapters(model)[2])


def tied(model: Any) -> bool:
    """A loaded model (a PeftModel: its base) whose LM head is its input embedding (`tie_word_embeddings`)."""
    base = model.get_base_model() if is_peft_model(model) else model
    return bool(getattr(base.config, "tie_word_embeddings", False))


def first_difference(a: Any, b: Any, tied_head: bool = False) -> str | None:
    """The first tensor name (in sorted order) at which two sets of weights differ, None when they are equal. `a`
    and `b`: anything with `names()` and `get(name)` (a `StateDictReader` over a loaded model's state dict, a
    folder's `hf.TensorReader`). Shapes and values are compared exactly, values as float32 (which holds float32,
    bfloat16 and float16 exactly: the same numbers stored in two dtypes are equal). A name held by one side only is
    a difference, except buffers the loaders ignore and, with `tied_head`, the LM head (a tied model's folder leaves
    it out: it is the embedding, compared under its own name). E.g. a model and a copy with one layer's q_proj
    changed: "model.layers.0.self_attn.q_proj.weight"; a float32 model and its bfloat16 folder: None exactly when
    every float32 weight is a bfloat16 number.
    """
    names_a, names_b = a.names(), b.names()
    for name in sorted(names_a | names_b):
        if name not in names_a or name not in names_b:
            if _IGNORED.search(name) or (tied_head and name in TIED_HEADS):
                continue
            return name
        x, y = np.asarray(a.get(name), np.float32), np.asarray(b.get(name), np.float32)
        if x.shape != y.shape or not np.array_equal(x, y):
            return name
    return None


# ------------------------------------------------------------------------------------------------ writing
def fingerprint(model: Any) -> str:
    """sha256 of a loaded model's class, config and every tensor (name, dtype, shape, values)."""
    h = hashlib.sha256(type(model).__name__.encode())
    config = model.get_base_model().config if is_peft_model(model) else model.config
    h.update(json.dumps(config.to_dict(), sort_keys=True, default=str).encode())
    if is_peft_model(model):
        h.update(json.dumps({k: c.to_dict() for k, c in model.peft_config.items()}, sort_keys=True,
                            default=str).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
        h.update(np.ascontiguousarray(to_numpy(tensor)).tobytes())
    return h.hexdigest()


def name_or_path(model: Any) -> str:
    """What a loaded model says it was loaded from (`config._name_or_path`; TRL's `get_config_model_id`)."""
    base = model.get_base_model() if is_peft_model(model) else model
    return str(getattr(base.config, "_name_or_path", "") or "")


def held_fingerprint(folder: str | os.PathLike) -> str | None:
    """The fingerprint `save_loaded` recorded in `folder`, None when there is none."""
    f = Path(folder) / MARKER
    return json.loads(f.read_text()).get("fingerprint") if f.is_file() else None


def save_loaded(model: Any, folder: str | os.PathLike, task: str, tokenizer: Any, print_: str | None = None
                ) -> tuple[str, dict[str, Any]]:
    """Write a loaded model as a Hugging Face folder at `folder` (task "causal_lm" | "reward"), unless it already
    holds that model (same fingerprint: a resume); returns (the path to train from, LoRA options or {}).

    A PreTrainedModel: `folder` holds it (config.json, safetensors in its dtype, generation_config.json, the
    tokenizer). A PeftModel: `folder` holds its base and `folder/adapter` its adapters (a PEFT adapter folder
    naming `folder` as its base), which is the path returned. The folder is written next to its place and renamed
    into it, so a run killed while writing leaves no half folder. A folder holding another model is a
    ModelLoadError (this output_dir was started from another model). `print_`: the model's `fingerprint` when the
    caller has it already (it reads every tensor)."""
    folder = Path(folder).absolute()
    print_ = print_ or fingerprint(model)
    peft = is_peft_model(model)
    options = peft_lora_options(peft_parts(model)[3]) if peft else {}
    path = folder / "adapter" if peft else folder
    held = held_fingerprint(folder)
    if held == print_:
        return str(path), options
    if folder.exists():
        what = "another model" if held else "files not written from a loaded model"
        raise ModelLoadError(f"{folder} holds {what}: this output_dir was started from another model; use a new "
                             "output_dir (or remove that folder to start over)")
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    source = model.get_base_model() if peft else model
    lora = convert_peft(model)[0] if peft else None
    plain = strip_adapters(lora) if peft else convert(model, task)
    save_pretrained(plain, tmp, tokenizer, dtype=storage_dtype(source)[1])
    generation = getattr(source, "generation_config", None)
    if task == "causal_lm" and callable(getattr(generation, "to_json_file", None)):
        generation.to_json_file(str(tmp / "generation_config.json"))  # its eos ids end completions, as TRL's
    if peft:  # float32: peft keeps adapters in float32 (autocast_adapter_dtype), and holds any of them exactly
        save_adapter(lora, tmp / "adapter", str(folder), tokenizer, dtype="float32")
    (tmp / MARKER).write_text(json.dumps({"class": type(model).__name__, "name_or_path": name_or_path(model),
                                          "fingerprint": print_}, indent=2) + "\n")
    os.replace(tmp, folder)
    return str(path), options


__all__ = ["StateDictReader", "adapter_lora_options", "convert", "convert_peft", "first_difference", "is_peft_model",
           "is_pretrained_model", "is_torch_module", "save_loaded"]
