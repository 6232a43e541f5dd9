"""A trained policy as a Hugging Face folder: transformers' `save_pretrained` layout (or a PEFT adapter folder, or
the base with the adapters merged), in the chosen dtype, sharded past a size, with the `generation_config.json` of
the run's sampling. The trainer's `final/` and the `python -m rloo_jax.export` command line both write through
`write_policy`."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from rloo_jax import outputs

AUTO = "auto"


DTYPES = ("auto", "bfloat16", "float16", "float32")


def checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype a Hugging Face `config.json` says its weights are in (`dtype`, or transformers 4's
    `torch_dtype`), as an export dtype; float32 when it names none (or one we do not write)."""
    name = str(hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in DTYPES[1:] else "float32"


def resolve_dtype(choice: str, hf_config: dict[str, Any]) -> str:
    """`auto` -> the base checkpoint's dtype (`checkpoint_dtype`); anything else as given."""
    return checkpoint_dtype(hf_config) if choice == AUTO else choice


def adapter_base_name(model_name_or_path: str, model_dir: str) -> str:
    """What a PEFT adapter names as its base: the folder (absolute) for a local model or the demo, else the hub id."""
    local = os.path.isdir(os.path.expanduser(model_name_or_path))
    return os.path.abspath(model_dir) if local or model_name_or_path == "demo" else model_name_or_path


GENERATION_CONFIG = "generation_config.json"


# the run's sampling options (config.yaml names) that generation_config.json carries
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_completion_length")


def generation_config(
    eos_token_ids: Sequence[int], pad_token_id: int | None, sampling: dict[str, Any], base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """`generation_config.json` for a trained policy: what transformers' `generate()` defaults to when it loads the
    folder, set to what the run sampled with. `base`: the base model's file, whose other fields (bos_token_id, ...)
    are kept; its sampling fields are replaced.

    eos_token_id is the list of every id that ended a completion in training (the tokenizer's EOS and the base's
    generation_config ones, `rloo_jax.models.hf.eos_token_ids`); pad_token_id the id completions were padded with;
    max_new_tokens = max_completion_length. temperature 0 (greedy) -> do_sample false and no sampling fields;
    else do_sample true, temperature, top_k (0: off, in transformers too), top_p, repetition_penalty, and min_p when
    set. E.g. eos [1, 7], pad 0, temperature 0.7 (other options off) -> {"eos_token_id": [1, 7], "pad_token_id": 0,
    "do_sample": true, "temperature": 0.7, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
    "max_new_tokens": ...}.
    """
    out = {k: v for k, v in (base or {}).items() if k not in ("transformers_version", "min_p", "max_length")}
    out.update(eos_token_id=[int(i) for i in eos_token_ids], pad_token_id=None if pad_token_id is None
               else int(pad_token_id), max_new_tokens=int(sampling["max_completion_length"]))
    temperature = float(sampling["temperature"])
    if temperature == 0.0:  # greedy (rloo_jax.sampling): transformers' default decoding, no sampling knobs
        for key in ("temperature", "top_k", "top_p", "typical_p"):
            out.pop(key, None)
        out.update(do_sample=False, repetition_penalty=float(sampling["repetition_penalty"]))
        return out
    out.update(do_sample=True, temperature=temperature, top_k=int(sampling["top_k"] or 0),
               top_p=float(sampling["top_p"]), repetition_penalty=float(sampling["repetition_penalty"]))
    if sampling.get("min_p"):
        out["min_p"] = float(sampling["min_p"])
    return out


def base_generation_config(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The base model folder's generation_config.json as a dict (None when it has none)."""
    path = os.path.join(model_dir, GENERATION_CONFIG)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_policy(
    model: Any, out_dir: str, *, dtype: str, max_shard_size: int | str, tokenizer: Any = None,
    base_name: str | None = None, merged: bool = False, push_to_hub: str | None = None,
    generation: dict[str, Any] | None = None,
) -> None:
    """`model` as a Hugging Face folder at `out_dir` (local or a URL): a full model with `save_pretrained`; a model
    with adapters as a PEFT adapter folder naming `base_name` as its base, or with `merged` the base with the
    adapters folded in. `generation`: written as generation_config.json (`generation_config`). `push_to_hub`:
    then upload the folder to that hub repo (`HubError` if that fails)."""
    from rloo_jax.models.hf import save_adapter, save_pretrained
    from rloo_jax.models.lora import merge_adapters

    with outputs.staged_dir(out_dir) as local:
        if model.config.lora is None or merged:
            save_pretrained(merge_adapters(model), local, tokenizer=tokenizer, dtype=dtype,
                            max_shard_size=max_shard_size)
        else:
            save_adapter(model, local, base_name, tokenizer=tokenizer, dtype=dtype)
        if generation is not None:
            (local / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        if push_to_hub:
            upload_to_hub(local, push_to_hub)


class HubError(RuntimeError):
    """The upload to the Hugging Face hub failed (no network, no token, no access)."""


def upload_to_hub(folder: str | os.PathLike, repo_id: str) -> None:
    """Create the model repo if needed and upload `folder` to it (huggingface_hub; the token from `hf auth login` or
    HF_TOKEN)."""
    from huggingface_hub import HfApi

    try:
        api = HfApi()
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), repo_type="model",
                          commit_message="Upload model exported by rloo_jax")
    except Exception as e:  # noqa: BLE001 - offline, auth, permissions: one message
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"--push_to_hub {repo_id}: the upload failed ({reason})") from e
