"""A tiny TFDS dataset for the `tfds:` tests, prepared offline with the real tensorflow-datasets package.

`rloo_prompts`, version 1.0.0, two configs over the demo's letters task (`rloo_jax.demo`):
- `plain`: `prompt` text, `letters` text, `id` int64;
- `chat`: `prompt` a Sequence of {role, content} messages, `letters` text, `id` int64, `meta` {source, level},
  `tags` a Sequence of text.
Splits: `train` (16 rows) and `test` (4 rows), stored in order (no TFDS shuffling).

`build(data_dir, file_format)` prepares both configs with `RlooPrompts`, a builder left out of the TFDS registry
(readers find the dataset from its files, as for a bucket prepared elsewhere). array_record needs no TensorFlow;
tfrecord does. The tfrecord copy committed under `tests/data/tfds` (where TensorFlow is missing, the tests check
the message it gives) is rebuilt, with TensorFlow installed, by
`rm -r tests/data/tfds && python -m tests.tfds_data tests/data/tfds tfrecord && rm -r tests/data/tfds/downloads`.

`record_reward` is a reward function that keeps what it was called with, in `SEEN`.
"""

import sys
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from rloo_jax import demo

NAME, VERSION = "rloo_prompts", "1.0.0"
SIZES = {"train": 16, "test": 4}
SEEN: list[dict[str, Any]] = []


def features(config: str) -> Any:
    text = tfds.features.Text()
    if config == "plain":
        return tfds.features.FeaturesDict({"prompt": text, "letters": text, "id": np.int64})
    return tfds.features.FeaturesDict(
        {
            "prompt": tfds.features.Sequence({"role": text, "content": text}),
            "letters": text,
            "id": np.int64,
            "meta": {"source": text, "level": np.int32},
            "tags": tfds.features.Sequence(text),
        }
    )


def rows(config: str, split: str) -> list[dict[str, Any]]:
    """The rows as every other source gives them (what a `tfds:` load must return, in order)."""
    base = demo.make_rows(sum(SIZES.values()), seed=0)
    base = base[: SIZES["train"]] if split == "train" else base[SIZES["train"] :]
    offset = 0 if split == "train" else SIZES["train"]
    if config == "plain":
        return [{"prompt": r["prompt"], "letters": r["letters"], "id": offset + i} for i, r in enumerate(base)]
    return [
        {
            "prompt": [
                {"role": "system", "content": "spell it"},
                {"role": "user", "content": r["prompt"]},
            ],
            "letters": r["letters"],
            "id": offset + i,
            "meta": {"source": "démo", "level": i % 3},
            "tags": ["letters"] * (i % 2),
        }
        for i, r in enumerate(base)
    ]


class RlooPrompts(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """The builder (unregistered: readers find the dataset from its files, as for a prepared bucket)."""

    VERSION = tfds.core.Version(VERSION)
    BUILDER_CONFIGS = [tfds.core.BuilderConfig(name="plain"), tfds.core.BuilderConfig(name="chat")]

    def _info(self) -> Any:
        return tfds.core.DatasetInfo(builder=self, features=features(self.builder_config.name), disable_shuffling=True)

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        return {split: self._generate_examples(split) for split in SIZES}

    def _generate_examples(self, split: str) -> Any:
        yield from enumerate(rows(self.builder_config.name, split))


def build(data_dir: str, file_format: str) -> str:
    """Prepare both configs of `rloo_prompts` in `data_dir` (offline); returns `data_dir`."""
    for config in ("plain", "chat"):
        RlooPrompts(config=config, data_dir=data_dir, file_format=file_format).download_and_prepare()
    return data_dir


def record_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Reward = completion length in characters; keeps the call's arguments in `SEEN`."""
    SEEN.append({"prompts": prompts, "completions": completions, **kwargs})
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [float(len(t)) for t in texts]


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
