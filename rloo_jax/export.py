"""`python -m rloo_jax.export CHECKPOINT OUT_DIR`: a saved training step as a Hugging Face folder.

CHECKPOINT is `<output_dir>/checkpoints/<step>` (or `<output_dir>`: its newest complete step), local or a URL
(`gs://...`). The run's `<output_dir>/config.yaml` says how to rebuild the model: the policy's `config.json` from
`model_name_or_path` (no base weights are read for a full fine-tune), the LoRA settings, the parameter layout. Only
the trained parameters are read from the checkpoint (no optimizer state). The folder written is what transformers'
`save_pretrained` writes: `config.json`, the weights in the checkpoint's `dtype` (`auto`: the base model's
`config.json` dtype, e.g. bfloat16; `--dtype float32` keeps the float32 master weights), one `model.safetensors`
or past `--max_shard_size` (transformers 5's 50GB by default) shards with `model.safetensors.index.json`, and the
tokenizer. LoRA runs give a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`) or with
`--merged` the base with the adapters folded in (a QLoRA run's base quantized as in training, then dequantized:
the weights the policy used). Every folder also gets `generation_config.json`: the EOS ids the run stopped
completions at, its pad id and its sampling options (`generation_config`), so transformers' `generate()` samples as
training did. `--push_to_hub REPO` uploads OUT_DIR afterwards (needs a network).

The trainer's own `final/` and `final_merged/` are written by the same `rloo_jax.models.export.write_policy`
(`export_dtype`, `export_max_shard_size`). Exit codes: 0 done; 2 a wrong CHECKPOINT, a missing config.yaml or base
model, a bad option (one line); 1 the upload to the hub failed (the local export is complete). Nothing imports this
module but the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np
import yaml
from flax import nnx

from rloo_jax import outputs
from rloo_jax.backend import skip_absent_tpu
from rloo_jax.checkpoint import saved_steps
from rloo_jax.errors import ConfigError, command_line
from rloo_jax.models.export import (
    AUTO,
    DTYPES,
    SAMPLING_FIELDS,
    HubError,
    adapter_base_name,
    base_generation_config,
    generation_config,
    resolve_dtype,
    write_policy,
)

# ------------------------------------------------------------------------------------------------ a checkpoint
RUN_FIELDS = ("model_name_or_path", "seed", "bf16", "param_dtype", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
              "lora_target_modules", "lora_target_parameters", "use_rslora", "load_in_4bit", "load_in_8bit",
              "bnb_4bit_quant_type", "use_bnb_nested_quant", *SAMPLING_FIELDS)


@dataclasses.dataclass(frozen=True)
class Saved:
    """A complete checkpoint step and what its run's config.yaml says about the model."""

    output_dir: str
    step: int
    run: dict[str, Any]  # RUN_FIELDS (the model's shape and the run's sampling), typed as the run's config types them
    meta: dict[str, Any]  # the checkpoint's JSON meta (its parameter layout)


def find_checkpoint(path: str) -> tuple[str, int]:
    """(output_dir, step) of `<output_dir>/checkpoints/<step>` or of `<output_dir>` (its newest complete step).
    ConfigError when there is no complete checkpoint there."""
    p = outputs.resolve(path)
    if p.name.isdigit() and p.parent.name == "checkpoints":
        output_dir, step = os.fspath(p.parent.parent), int(p.name)
    elif (p / "checkpoints").exists():
        output_dir, step = os.fspath(p), None
    else:
        raise ConfigError(f"{path} is not a checkpoint: pass <output_dir>/checkpoints/<step> (or <output_dir> for its "
                          "newest step)")
    steps = saved_steps(output_dir)
    if step is None:
        if not steps:
            raise ConfigError(f"{path} has no complete checkpoint in checkpoints/")
        step = max(steps)
    elif step not in steps:
        listed = ", ".join(map(str, sorted(steps))) or "none"
        raise ConfigError(f"checkpoint {path} does not exist or is incomplete (complete steps: {listed})")
    return output_dir, step


def _manager(directory: str) -> Any:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(read_only=True)
    return ocp.CheckpointManager(outputs.resolve(directory), options=options, item_names=("state", "meta"))


def read_run(output_dir: str) -> dict[str, Any]:
    """RUN_FIELDS from `<output_dir>/config.yaml`, typed as the config class of its `algorithm` types them (the rest
    of the run's options do not shape the export)."""
    from rloo_jax.algorithms import CONFIGS, DEFAULT
    from rloo_jax.config import coerce

    path = outputs.join(output_dir, "config.yaml")
    if not outputs.exists(path):
        raise ConfigError(f"{output_dir} has no config.yaml next to checkpoints/: the export rebuilds the model from "
                          "the run's config.yaml (written at every start)")
    try:
        values = yaml.safe_load(outputs.read_text(path)) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from None
    cls = CONFIGS.get(str(values.get("algorithm") or DEFAULT))
    if cls is None:
        raise ConfigError(f"{path}: algorithm {values.get('algorithm')!r} is not one of {', '.join(CONFIGS)}")
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.name in RUN_FIELDS}
    hints = typing.get_type_hints(cls)
    # the policy's checkpoint as the run's config class names it (`policy_path`: PPO's sft_model_path when set)
    values = dict(values, model_name_or_path=cls.policy_path.fget(SimpleNamespace(**{**defaults, **values})))
    return {k: coerce(values.get(k, defaults[k]), hints[k], k) for k in RUN_FIELDS}


def read_checkpoint(path: str, model_name_or_path: str | None = None) -> Saved:
    """The checkpoint at `path` and its run's settings; `model_name_or_path` overrides where the base model is."""
    output_dir, step = find_checkpoint(path)
    run = read_run(output_dir)
    if model_name_or_path:
        run["model_name_or_path"] = model_name_or_path
    import orbax.checkpoint as ocp

    meta = _manager(outputs.join(output_dir, "checkpoints")).restore(
        step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    return Saved(output_dir, step, run, dict(meta))


def quant_spec(run: dict[str, Any]) -> Any:
    """The run's quantized base (`rloo_jax.quant.QuantSpec`), or None: as `TrainConfig.quant_spec`."""
    from rloo_jax.quant import QuantSpec

    if run["load_in_4bit"]:
        return QuantSpec(run["bnb_4bit_quant_type"], run["use_bnb_nested_quant"])
    return QuantSpec("int8") if run["load_in_8bit"] else None


def model_folder(run: dict[str, Any]) -> str:
    """The base model's local folder (the demo's is rebuilt from its seed; a hub id is downloaded; a PEFT adapter
    folder's base for a run started from one)."""
    from rloo_jax import demo
    from rloo_jax.models.hf import adapter_base, resolve_checkpoint

    name = run["model_name_or_path"]
    if name == "demo":
        return demo.model_folder(run["seed"])
    folder = resolve_checkpoint(name)
    base = adapter_base(folder)
    return str(folder if base is None else resolve_checkpoint(base))


def load_policy(saved: Saved, with_base: bool = True) -> tuple[Any, str]:
    """(the policy of the checkpoint as a `CausalLM` whose arrays are host numpy arrays, its base's folder).

    Full fine-tuning: built from the base's config.json, every parameter from the checkpoint. LoRA: the adapters
    from the checkpoint on the base read from its folder (`with_base`), or on an abstract base (the adapter
    export reads no base weight); a QLoRA run's base quantized as in training (a merge then folds the adapters
    into the dequantized weights the policy used)."""
    import orbax.checkpoint as ocp

    from rloo_jax.models import abstract_model, load_causal_lm, lora_spec
    from rloo_jax.models.lora import quantize_base, split_adapters, with_adapters

    run, layout = saved.run, saved.meta.get("layout", {})
    model_dir = model_folder(run)
    compute = "bfloat16" if run["bf16"] else "float32"
    scan = bool(layout.get("scan_layers", False))
    lora = layout.get("lora")
    if bool(lora) != run["use_peft"]:
        raise ConfigError(f"checkpoint {saved.step} holds {'LoRA adapters' if lora else 'a full model'} but "
                          f"{saved.output_dir}/config.yaml says use_peft {str(run['use_peft']).lower()}")
    if lora is None:
        graphdef, params = nnx.split(abstract_model(model_dir, dtype=compute, param_dtype=run["param_dtype"],
                                                    scan_layers=scan))
        frozen = None
    else:
        # as `rloo_jax.policy.policy`: the base in the compute dtype, the adapters in param_dtype
        base = load_causal_lm(model_dir, dtype=compute, scan_layers=scan) if with_base else \
            abstract_model(model_dir, dtype=compute, scan_layers=scan)
        quant = quant_spec(run)
        if quant is not None:  # QLoRA: the base the adapters were trained on (what a merge folds them into)
            base = quantize_base(base, quant)
        spec = lora_spec(base.config.family, lora["r"], run["lora_alpha"], run["lora_dropout"],
                         lora["target_modules"], run["use_rslora"], lora.get("target_parameters"))
        # the adapters' initial values are overwritten by the checkpoint's
        graphdef, params, frozen = split_adapters(with_adapters(base, spec, jax.random.key(0), run["param_dtype"]))
    item = {"train": {"params": params}}
    restore = jax.tree.map(lambda x: ocp.RestoreArgs(restore_type=np.ndarray, dtype=x.dtype), item)
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore, partial_restore=True)
    restored = _manager(outputs.join(saved.output_dir, "checkpoints")).restore(
        saved.step, args=ocp.args.Composite(state=args)).state["train"]["params"]
    model = nnx.merge(graphdef, restored) if frozen is None else nnx.merge(graphdef, restored, frozen)
    return model, model_dir


# ------------------------------------------------------------------------------------------------ the CLI
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see python -m rloo_jax.export --help)")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = _Parser(prog="python -m rloo_jax.export", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="<output_dir>/checkpoints/<step>, or <output_dir> for its newest step "
                                      "(local or gs://...)")
    p.add_argument("out_dir", help="the Hugging Face folder to write (local or gs://...)")
    p.add_argument("--dtype", choices=DTYPES, default=AUTO,
                   help="weights dtype; auto (default): the base model's config.json dtype, e.g. bfloat16")
    p.add_argument("--max_shard_size", default="50GB",
                   help="largest weights file before sharding with an index (default 50GB, as transformers 5)")
    p.add_argument("--merged", action="store_true", help="LoRA runs: write the base with the adapters folded in "
                                                         "instead of a PEFT adapter folder")
    p.add_argument("--model_name_or_path", default=None,
                   help="where the base model is now, if not where the run's config.yaml says")
    p.add_argument("--push_to_hub", metavar="REPO", default=None,
                   help="then upload OUT_DIR to this hub model repo (needs a network and a token)")
    return p.parse_args(list(argv))


def parse_size(size: str) -> int:
    """"5GB" -> 5 * 10**9 bytes (huggingface_hub's rule, as transformers); ConfigError when unreadable."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        return parse_size_to_int(size) if not str(size).isdigit() else int(size)
    except ValueError:
        raise ConfigError(f"max_shard_size {size!r}: expected a size such as 5GB, 500MB or a number of bytes") from None


def export(args: argparse.Namespace) -> str:
    """Run the export of `parse_args`' arguments; returns what was written, in words."""
    from rloo_jax.models import ModelLoadError, load_tokenizer
    from rloo_jax.models.hf import eos_token_ids

    max_shard = parse_size(args.max_shard_size)
    saved = read_checkpoint(args.checkpoint, args.model_name_or_path)
    if args.merged and not saved.run["use_peft"]:
        raise ConfigError("--merged folds LoRA adapters into their base, but this run trained the whole model; "
                          "drop --merged")
    try:
        with jax.default_device(jax.local_devices(backend="cpu")[0]):  # host memory, never an accelerator's
            model, model_dir = load_policy(saved, with_base=args.merged or not saved.run["use_peft"])
            dtype = resolve_dtype(args.dtype, model.config.hf_config)
            tokenizer = load_tokenizer(model_dir, padding_side="left")
            generation = generation_config(eos_token_ids(model_dir, tokenizer), tokenizer.pad_token_id, saved.run,
                                           base_generation_config(model_dir))
            write_policy(model, args.out_dir, dtype=dtype, max_shard_size=max_shard, tokenizer=tokenizer,
                         base_name=adapter_base_name(saved.run["model_name_or_path"], model_dir),
                         merged=args.merged, push_to_hub=args.push_to_hub, generation=generation)
    except ModelLoadError as e:
        raise ConfigError(f"the base model of {saved.output_dir}: {e}; pass --model_name_or_path where it is "
                          "now") from None
    kind = "merged model" if args.merged else "PEFT adapter" if saved.run["use_peft"] else "model"
    pushed = f", uploaded to {args.push_to_hub}" if args.push_to_hub else ""
    return f"step {saved.step} of {saved.output_dir} -> {args.out_dir} ({kind}, {dtype}{pushed})"


def main(argv: Sequence[str] | None = None) -> int:
    """Exit codes: 0 done; 2 a bad checkpoint path, config.yaml, base model or option; 1 the hub upload failed."""
    with command_line():  # its errors name flags
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(format="%(message)s", level=logging.WARNING, force=True)  # absl set a default one first
    logging.getLogger("absl").setLevel(logging.ERROR)
    skip_absent_tpu()  # no libtpu start-up errors on a machine without a TPU
    try:
        print(f"Exported {export(parse_args(argv))}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except HubError as e:
        print(f"error: {e}; the export itself is complete: upload it later with `hf upload REPO OUT_DIR`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
