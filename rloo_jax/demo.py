"""The built-in default task: what `python -m rloo_jax.train` runs with no arguments, with no network.

A character-level tokenizer built in code, a tiny random-init Qwen2-shaped policy (saved as a normal Hugging
Face folder, so the usual `load_causal_lm` path loads it) and a synthetic prompt set. The task: each prompt names
three letters of `POOL` in order (e.g. `ace:`), and the answer is those letters, then EOS (`ace`). The reward
(`echo_reward`) credits the answer's correct leading characters and the stop right after it. A random model scores
~0.01; in 300 steps (~40 s on 2 CPU cores) RLOO takes it to ~0.95, where almost every completion is its prompt's
answer (measured: 253 of the last step's 256; `tests/test_train.py` checks it).

`letters_reward` (the fraction of completion characters among the prompt's letters) is the earlier demo reward,
kept for tests and examples: its best answer is any one allowed letter, and the policy learned exactly that (one
or two letters for every prompt), which is why the default task is `echo_reward`'s.
"""

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

# where the demo's model and data are written (once per seed): $RLOO_JAX_CACHE, else ~/.cache/rloo_jax
CACHE_ROOT = os.environ.get("RLOO_JAX_CACHE", os.path.join("~", ".cache", "rloo_jax"))

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>"]
CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789 :,.!?\n-"
POOL = "abcdef"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# The default run (configs/default.yaml holds the same values; a test keeps them equal). 32 prompts x 8 completions
# per step: with 8 prompts a step (64 completions) the policy settled on partial answers for some prompts before it
# found the rest (measured: 32/128 exact answers at step 300, against 253/256 with 32 prompts).
DEFAULT_CONFIG: dict[str, Any] = {
    "model_name_or_path": "demo",
    "dataset_name": "demo",
    "reward_funcs": ["rloo_jax.demo:echo_reward"],
    "output_dir": "outputs/demo",
    "seed": 0,
    "max_steps": 300,
    "learning_rate": 1e-3,
    "lr_scheduler_type": "constant",
    "max_grad_norm": 1.0,
    "per_device_train_batch_size": 256,
    "num_generations": 8,
    "max_prompt_length": 16,
    "prompt_bucket": 8,
    "max_completion_length": 6,
    "temperature": 1.0,
    "beta": 0.02,
    "logging_steps": 10,
    "save_steps": 100,
    "save_total_limit": 2,
    "eval_steps": 100,
    "per_device_eval_batch_size": 32,
    "num_generations_eval": 4,
    "log_completions": False,
    "num_completions_to_print": 4,
}


# Qwen2-shaped, ~77k parameters.
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": len(SPECIAL_TOKENS) + len(CHARACTERS),
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "initializer_range": 0.2,
    "bos_token_id": None,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def build_tokenizer(characters: str = CHARACTERS) -> Any:
    """A lowercasing character-level fast tokenizer: one id per character of `characters` after the special
    tokens (pad 0, eos 1)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(characters))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIAL_TOKENS[3:],
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Bumped whenever MODEL_CONFIG changes, so a cached folder of an older demo model is never reused. v2: embeddings
# and weights drawn at initializer_range 0.2 (was 0.02): with 0.02-scale tied embeddings the head's logits stay
# within about +-1.3 whatever the blocks compute, so training only the blocks (LoRA) could not move the reward.
MODEL_VERSION = 2


def model_folder(seed: int) -> str:
    """The demo policy of `seed`, written under CACHE_ROOT on first use: its folder."""
    return prepare_model(model_dir(CACHE_ROOT, seed), seed)


def dataset_folder(seed: int) -> str:
    """The demo prompts of `seed` (train and test splits), written under CACHE_ROOT on first use: their folder."""
    return prepare_dataset(os.path.expanduser(os.path.join(CACHE_ROOT, f"demo/data-{seed}")), seed)


def model_dir(cache_root: str, seed: int) -> str:
    """Where the demo policy of `seed` is cached under `cache_root`."""
    return os.path.expanduser(os.path.join(cache_root, f"demo/model-v{MODEL_VERSION}-{seed}"))


def prepare_model(directory: str | os.PathLike, seed: int, config: dict[str, Any] | None = None) -> str:
    """Write the random-init demo policy (`config`: another shape of it, e.g. examples/grpo_moe.py's mixture of
    experts; default MODEL_CONFIG) + tokenizer to `directory` (once) and return its path."""
    from rloo_jax.models import init_causal_lm, save_pretrained

    path = Path(directory)
    if not (path / "model.safetensors").is_file():
        # write elsewhere, then rename: concurrent runs never see a half-written folder
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        save_pretrained(init_causal_lm(config or MODEL_CONFIG, seed=seed), tmp, tokenizer=build_tokenizer())
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def make_rows(num_rows: int, seed: int) -> list[dict[str, str]]:
    """Prompts `<three sorted letters of POOL>:` with the letters in a `letters` column."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_rows):
        letters = "".join(sorted(rng.sample(POOL, 3)))
        rows.append({"prompt": f"{letters}:", "letters": letters})
    return rows


def prepare_dataset(directory: str | os.PathLike, seed: int, num_train: int = 512, num_test: int = 64,
                    rows: Callable[[int, int], list[dict[str, Any]]] = make_rows) -> str:
    """Write `train.jsonl` (`rows(num_train, seed)`) and `test.jsonl` (`rows(num_test, seed + 1)`) to `directory`
    (once) and return the folder (splits by name)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in (("train", num_train, seed), ("test", num_test, seed + 1)):
        file = path / f"{split}.jsonl"
        if not file.is_file():
            tmp = file.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows(n, split_seed)))
            tmp.rename(file)
    return str(path)


def letters_reward(completions: list[Any], letters: list[str], **kwargs: Any) -> list[float]:
    """Fraction of completion characters that are among the prompt's letters (0.0 for an empty completion).

    letters "ace": "aacx" -> 0.75, "" -> 0.0.
    """
    out = []
    for completion, allowed in zip(completions, letters, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        out.append(sum(ch in allowed for ch in text) / len(text) if text else 0.0)
    return out


def echo_reward(completions: list[Any], letters: list[str], **kwargs: Any) -> list[float]:
    """(k + stop) / (len(letters) + 1): k = how many leading characters of the completion are the prompt's letters
    in order, stop = 1 when the completion is exactly those letters (it ended with EOS right after them).

    letters "ace": "ace" -> 1.0, "acex" -> 0.75, "ac" -> 0.5, "a" -> 0.25, "xce" -> 0.0, "" -> 0.0.

    Credit for a correct prefix gives the policy a way to learn the answer left to right; the stop is only worth
    something after the whole answer. (A reward that divided by the completion's length paid a lone correct first
    letter as much as the stop: the policy learned to stop early and never found the rest.)
    """
    out = []
    for completion, answer in zip(completions, letters, strict=True):
        text = completion if isinstance(completion, str) else completion[0]["content"]
        k = 0
        while k < min(len(text), len(answer)) and text[k] == answer[k]:
            k += 1
        out.append((k + (text == answer)) / (len(answer) + 1))
    return out

