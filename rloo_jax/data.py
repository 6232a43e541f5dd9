"""Prompt data: load a dataset, turn prompts into left-padded, bucketed token batches, iterate resumably.

Sources (`load_prompt_dataset`): a hub id, a local `save_to_disk` folder, a local .json/.jsonl/.parquet/.csv
file, or `tfds:<name>[/<config>][:<version>]` (a tensorflow-datasets dataset already prepared in a data
directory, the `tfds` extra). Rows need a `prompt` column: text (standard) or a list of `{"role", "content"}`
messages (conversational, rendered with the tokenizer's chat template and `add_generation_prompt=True`). Other
columns travel with the batch for the reward functions.
"""

import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
from collections.abc import Iterator, Sequence
from typing import Any

import datasets
import numpy as np

from rloo_jax.errors import DataError

logger = logging.getLogger("rloo_jax")

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}


# ------------------------------------------------------------------------------------------------- loading
def load_prompt_dataset(
    name: str, split: str, config: str | None = None, tfds_data_dir: str | None = None
) -> datasets.Dataset:
    """Load one split of a prompt dataset and check it has a non-empty `prompt` column.

    `split` may itself be a local file path (e.g. a held-out .jsonl for evaluation). A single local file has
    only the `train` split. `tfds_data_dir` is where `tfds:` datasets are prepared (None: `$TFDS_DATA_DIR`, else
    `~/tensorflow_datasets`). Raises `DataError` with the source, the split and what to fix.
    """
    if _is_local_file(split):
        ds = _load_file(split)
    elif name.startswith("tfds:"):
        ds = load_tfds(name[len("tfds:") :], split, config, tfds_data_dir)
    elif os.path.isfile(name):
        if split != "train":
            raise DataError(
                f"dataset {name} is a single file, which only has the `train` split (asked for "
                f"{split!r}); pass a file path as the split instead (e.g. --dataset_test_split "
                "test.jsonl)"
            )
        ds = _load_file(name)
    elif os.path.isdir(name):
        ds = _load_folder(name, split)
    elif name.startswith((".", "/", "~")) or os.path.splitext(name)[1] in FILE_BUILDERS:
        raise DataError(f"dataset {name}: no such file or folder")
    else:
        ds = _load_hub(name, config, split)
    check_prompt_dataset(ds, f"{name} [{split}]")
    return ds


def check_prompt_dataset(ds: datasets.Dataset, source: str) -> None:
    """Fail clearly on a dataset without a `prompt` column (or pre-tokenized `input_ids`, as TRL's PPO takes
    them) or without rows."""
    if "prompt" not in ds.column_names and "input_ids" not in ds.column_names:
        raise DataError(
            f"dataset {source} has no `prompt` column (columns: {', '.join(ds.column_names)}); "
            "rename the prompt column to `prompt` (or give token ids in an `input_ids` column)"
        )
    if len(ds) == 0:
        raise DataError(f"dataset {source} is empty")


def _is_local_file(path: str) -> bool:
    return os.path.splitext(path)[1] in FILE_BUILDERS and os.path.isfile(path)


def _load_file(path: str) -> datasets.Dataset:
    builder = FILE_BUILDERS.get(os.path.splitext(path)[1])
    if builder is None:
        raise DataError(f"dataset {path}: unsupported file type; use .json, .jsonl, .parquet or .csv")
    if os.path.getsize(path) == 0:
        raise DataError(f"dataset {path} [train] is empty; add rows with a 'prompt' column")
    try:
        return datasets.load_dataset(builder, data_files=path, split="train")
    except Exception as e:  # noqa: BLE001 - any parser error becomes one readable line
        if "corresponds to no data" in str(e):
            raise DataError(f"dataset {path} [train] is empty") from e
        raise DataError(f"cannot read dataset file {path}: {_first_line(e)}") from e


def _load_folder(path: str, split: str) -> datasets.Dataset:
    saved = any(os.path.exists(os.path.join(path, f)) for f in ("dataset_dict.json", "state.json"))
    try:
        ds = datasets.load_from_disk(path) if saved else datasets.load_dataset(path)
    except Exception as e:  # noqa: BLE001
        raise DataError(f"cannot load dataset folder {path}: {_first_line(e)}") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(
                f"dataset {path} has no split {split!r} (splits: {', '.join(ds)}); set "
                "--dataset_train_split / --dataset_test_split"
            )
        return ds[split]
    if split != "train":
        raise DataError(f"dataset {path} holds a single split, used as `train` (asked for {split!r})")
    return ds


def _load_hub(name: str, config: str | None, split: str) -> datasets.Dataset:
    try:
        return datasets.load_dataset(name, config, split=split)
    except ValueError as e:
        if "split" in str(e).lower():
            raise DataError(f"dataset {name} has no split {split!r}: {_first_line(e)}") from e
        raise DataError(f"cannot load dataset {name!r} from the Hugging Face hub: {_first_line(e)}") from e
    except Exception as e:  # noqa: BLE001 - offline, not found, gated, ...
        raise DataError(
            f"cannot load dataset {name!r} (not a local path; from the hub: {_first_line(e)}); "
            "pass a local file or folder, or check the name and the network"
        ) from e


# ---------------------------------------------------------------------------------------- tensorflow-datasets
_TFDS_NAME = re.compile(r"(?P<name>[A-Za-z]\w*)(?:/(?P<config>[^/:\s]+))?(?::(?P<version>\d+\.\d+\.\d+))?")
TFDS_RANDOM_ACCESS = "array_record"  # the prepared format read without TensorFlow (tfds.data_source)


@dataclasses.dataclass(frozen=True)
class TfdsName:
    """A prepared TFDS dataset: `glue/sst2:2.0.0` -> name `glue`, config `sst2`, version `2.0.0`."""

    name: str
    config: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        config = f"/{self.config}" if self.config else ""
        version = f":{self.version}" if self.version else ""
        return f"{self.name}{config}{version}"


def parse_tfds_name(spec: str, config: str | None = None) -> TfdsName:
    """`<name>[/<config>][:<version>]` (what follows `tfds:`) -> `TfdsName`; `config` (the dataset_config option)
    may give the config instead.

    `parse_tfds_name("glue/sst2:2.0.0")` -> TfdsName("glue", "sst2", "2.0.0"); `parse_tfds_name("glue", "sst2")`
    -> TfdsName("glue", "sst2", None). Raises `DataError` on anything else, or on two different configs.
    """
    if not spec.strip():
        raise DataError("`tfds:` needs a dataset name: tfds:<name>[/<config>][:<version>], e.g. tfds:glue/sst2")
    match = _TFDS_NAME.fullmatch(spec.strip())
    if match is None:
        raise DataError(
            f"`tfds:{spec}` is not a TFDS dataset name; write tfds:<name>[/<config>][:<version>], e.g. "
            "tfds:mnist, tfds:glue/sst2 or tfds:glue/sst2:2.0.0"
        )
    if config and match["config"] and config != match["config"]:
        raise DataError(
            f"`tfds:{spec}` names config {match['config']!r} but dataset_config is {config!r}; give the config once"
        )
    return TfdsName(match["name"], match["config"] or config or None, match["version"])


def resolve_tfds_data_dir(data_dir: str | None, environ: dict[str, str] | None = None) -> str:
    """The data directory TFDS reads: `data_dir`, else `$TFDS_DATA_DIR`, else `~/tensorflow_datasets` (TFDS's
    own default). Local paths get `~` expanded; URLs (`gs://bucket/tfds`) pass through unchanged."""
    env = os.environ if environ is None else environ
    path = data_dir or env.get("TFDS_DATA_DIR") or os.path.join("~", "tensorflow_datasets")
    return path if "://" in path else os.path.expanduser(path)


def tfds_split_names(split: str) -> list[str]:
    """The split names in a TFDS split expression: `"train[:10%]+test"` -> `["train", "test"]`."""
    return [part.split("[", 1)[0].strip() for part in split.split("+")]


def tfds_prepare_hint(ref: TfdsName, data_dir: str) -> str:
    """The command that prepares `ref` in `data_dir` as array_record (read without TensorFlow). It is TFDS's Python
    API: the `tfds build` command of tensorflow-datasets 4.9.10 also imports TensorFlow and apache-beam."""
    code = (
        f"import tensorflow_datasets as tfds; tfds.builder('{ref}', data_dir='{data_dir}', "
        f"file_format='{TFDS_RANDOM_ACCESS}').download_and_prepare()"
    )
    return f'python -c "{code}"'


def load_tfds(spec: str, split: str, config: str | None = None, data_dir: str | None = None) -> datasets.Dataset:
    """One split (TFDS slicing: `train`, `train[:10%]`, `train[10:20]+test`) of a TFDS dataset prepared in
    `data_dir`, as a `datasets.Dataset` with the same row shapes as every other source.

    Never downloads or prepares anything, and never asks the public TFDS bucket: a dataset that is not prepared
    there fails at once with the command that prepares it. Prepared as array_record, the split is read without
    TensorFlow (`as_data_source`); in any other format through `tfds.load` (which needs TensorFlow).
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError(
            "dataset `tfds:` sources need tensorflow-datasets, the `tfds` extra: pip install 'rloo_jax[tfds]'"
        ) from None
    ref = parse_tfds_name(spec, config)
    data_dir = resolve_tfds_data_dir(data_dir)
    if data_dir.startswith("gs://") and not _importable("tensorflow") and not _importable("gcsfs"):
        raise DataError(
            f"tfds data directory {data_dir}: reading a gs:// bucket needs gcsfs (in the `tfds` extra: pip install "
            "'rloo_jax[tfds]') or TensorFlow"
        )
    builder = _tfds_builder(tfds, ref, data_dir)
    info = builder.info
    missing = [name for name in tfds_split_names(split) if name not in info.splits]
    if missing:
        raise DataError(
            f"tfds dataset {ref} in {data_dir} has no split {missing[0]!r} (splits: {', '.join(info.splits)}); set "
            "--dataset_train_split / --dataset_test_split"
        )
    try:
        num_rows = info.splits[split].num_examples
    except (KeyError, ValueError) as e:
        raise DataError(
            f"tfds dataset {ref}: cannot read split {split!r} ({_first_line(e)}); slice as TFDS does: train, "
            "train[:10%], train[10:20], train[:50%]+test"
        ) from None
    if num_rows == 0:
        return datasets.Dataset.from_dict({key: [] for key in info.features.keys()})
    formats = {f.value for f in info.available_file_formats()}
    if TFDS_RANDOM_ACCESS not in formats and not _importable("tensorflow"):
        raise DataError(
            f"tfds dataset {ref} in {data_dir} is prepared as {', '.join(sorted(formats)) or 'an unknown format'}, "
            "which is read through TensorFlow: pip install 'rloo_jax[tfds-tfrecord]' (or prepare it again as "
            "array_record, which is read without TensorFlow)"
        )
    with _tfds_read_errors(ref, split, data_dir):
        if TFDS_RANDOM_ACCESS in formats:
            source = builder.as_data_source(split=split, file_format=TFDS_RANDOM_ACCESS)
            rows = source.__getitems__(list(range(len(source))))
        else:
            loaded = tfds.load(str(ref), split=split, data_dir=data_dir, download=False, try_gcs=False)
            rows = list(tfds.as_numpy(loaded))
    if len(rows) != num_rows:
        raise DataError(
            f"tfds dataset {ref} in {data_dir}: TFDS returned {len(rows)} rows for split {split!r}, whose "
            f"dataset_info.json counts {num_rows}; check the installed tensorflow-datasets version"
        )
    return tfds_rows_to_dataset(rows, tfds_layout(info.features))


def _tfds_builder(tfds: Any, ref: TfdsName, data_dir: str) -> Any:
    """The builder of a dataset prepared in `data_dir`, or a `DataError` naming the dataset, the directory and the
    command that prepares it (never a download, never the public GCS bucket)."""
    not_prepared = (
        f"tfds dataset {ref} is not prepared in {data_dir}{_tfds_found(data_dir, ref.name)}; `tfds:` datasets "
        f"are never downloaded: prepare it on a machine with network ({tfds_prepare_hint(ref, data_dir)}) or "
        "point --tfds_data_dir at the folder that holds it"
    )
    try:
        builder = tfds.builder(str(ref), data_dir=data_dir, try_gcs=False)
    except Exception as e:  # noqa: BLE001 - DatasetNotFoundError, an unknown config or version, an unreadable dir
        if isinstance(e, ImportError):
            raise DataError(f"tfds dataset {ref}: {_first_line(e)}") from e
        if type(e).__name__ == "DatasetNotFoundError":
            raise DataError(not_prepared) from e
        raise DataError(f"cannot open tfds dataset {ref} in {data_dir}: {_first_line(e)}") from e
    if not builder.is_prepared():
        raise DataError(not_prepared)
    return builder


def _tfds_found(data_dir: str, name: str) -> str:
    """`" (found there: glue/sst2/1.0.0, ...)"`: the prepared variants of `name` under `data_dir` (for messages)."""
    try:
        from etils import epath

        root = epath.Path(data_dir)
        found = sorted(
            str(p.parent.relative_to(root))
            for pattern in (f"{name}/*/dataset_info.json", f"{name}/*/*/dataset_info.json")
            for p in root.glob(pattern)
        )
    except Exception:  # noqa: BLE001 - only a hint; the main message stands without it
        return ""
    return f" (found there: {', '.join(found)})" if found else ""


@contextlib.contextmanager
def _tfds_read_errors(ref: TfdsName, split: str, data_dir: str) -> Iterator[None]:
    """Any failure while TFDS reads becomes one `DataError` line naming the dataset, the split and the directory."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        raise DataError(f"cannot read tfds dataset {ref} split {split!r} from {data_dir}: {_first_line(e)}") from e


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tfds_layout(features: Any) -> Any:
    """Where TFDS stacks a sequence of dicts into a dict of lists, read from a dataset's features.

    A `FeaturesDict` gives `{key: layout}`; a `Sequence` of dicts gives `[layout of one element]` (its values come
    as `{"role": [r0, r1], "content": [c0, c1]}` and are turned back into `[{"role": r0, "content": c0}, ...]`);
    anything else gives None. `{"prompt": Sequence({"role": Text(), "content": Text()}), "answer": Text()}`
    -> `{"prompt": [{"role": None, "content": None}], "answer": None}`.
    """
    import tensorflow_datasets as tfds

    if isinstance(features, tfds.features.FeaturesDict):
        return {key: tfds_layout(feature) for key, feature in features.items()}
    if isinstance(features, tfds.features.Sequence):
        inner = tfds_layout(features.feature)
        return None if inner is None else [inner]
    return None


def tfds_to_python(value: Any, layout: Any = None) -> Any:
    """One TFDS (numpy) value -> plain Python, as the other sources give it: text bytes decoded as UTF-8 (other
    bytes kept), numpy scalars and arrays to Python values and lists, sequences of dicts restacked (`layout`, from
    `tfds_layout`).

    `tfds_to_python({"role": [b"user"], "content": np.array([b"hi"])}, [{"role": None, "content": None}])`
    -> `[{"role": "user", "content": "hi"}]`; `tfds_to_python(np.int64(7))` -> `7`.
    """
    if isinstance(layout, list):
        if isinstance(value, dict):
            length = len(next(iter(value.values()))) if value else 0
            value = [{key: column[i] for key, column in value.items()} for i in range(length)]
        return [tfds_to_python(item, layout[0]) for item in value]
    if isinstance(value, dict):
        layout = layout if isinstance(layout, dict) else {}
        return {key: tfds_to_python(item, layout.get(key)) for key, item in value.items()}
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return value
    if isinstance(value, np.ndarray):
        return [tfds_to_python(x) for x in value.tolist()] if value.ndim else tfds_to_python(value.item())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list | tuple):
        return [tfds_to_python(x) for x in value]
    return value


def tfds_rows_to_dataset(rows: Sequence[dict[str, Any]], layout: dict[str, Any] | None = None) -> datasets.Dataset:
    """TFDS numpy rows -> a `datasets.Dataset` (each value through `tfds_to_python`, with `layout` from
    `tfds_layout(info.features)` so that sequences of dicts, e.g. chat messages, arrive as lists of dicts)."""
    layout = layout or {}
    return datasets.Dataset.from_list([{k: tfds_to_python(v, layout.get(k)) for k, v in row.items()} for row in rows])


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# ------------------------------------------------------------------------------------------------ tokenizing
def is_conversational(prompt: Any) -> bool:
    """True for a list of chat messages (dicts with `role` and `content`), as in TRL."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict) and "role" in prompt[0]


def encode_prompts(
    prompts: Sequence[Any], tokenizer: Any, chat_template_kwargs: dict | None = None,
    tools: Sequence[Sequence[Any]] | None = None, chat_template: str | None = None,
) -> list[list[int]]:
    """Token ids of each prompt, as TRL 1.16 builds them.

    Text prompts: `tokenizer(text)` (with the tokenizer's special tokens). Conversational prompts:
    `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` with `chat_template_kwargs`; with tool
    calling, each prompt rendered with its tools (`tools`: one list per prompt, the callables whose schemas the
    template shows) and `chat_template` (TRL's training template where the tokenizer's is not prefix-preserving).
    """
    if tools is not None and is_conversational(prompts[0]):
        kw = dict(chat_template_kwargs or {}, chat_template=chat_template, add_generation_prompt=True, tokenize=True,
                  return_dict=True)
        if all(t is tools[0] for t in tools):  # one batched call, as TRL renders a batch with one tool list
            return [list(map(int, r)) for r in tokenizer.apply_chat_template(
                list(prompts), tools=list(tools[0]) or None, **kw)["input_ids"]]
        return [list(map(int, tokenizer.apply_chat_template([p], tools=list(t) or None, **kw)["input_ids"][0]))
                for p, t in zip(prompts, tools, strict=True)]
    if is_conversational(prompts[0]):
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                "the prompts are chat messages but the tokenizer has no chat template; use a "
                "tokenizer with a `chat_template` or plain-text prompts"
            )
        out = tokenizer.apply_chat_template(
            list(prompts),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **(chat_template_kwargs or {}),
        )
        ids = out["input_ids"]
    else:
        ids = tokenizer(list(prompts))["input_ids"]
    return [list(map(int, row)) for row in ids]


def truncate_left(ids: Sequence[int], max_length: int | None) -> list[int]:
    """Keep the last `max_length` tokens (the end of a prompt is what the completion continues)."""
    return list(ids) if max_length is None or len(ids) <= max_length else list(ids[len(ids) - max_length :])


def left_pad(
    token_lists: Sequence[Sequence[int]], pad_token_id: int, bucket: int
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad to P = the longest row rounded up to a multiple of `bucket` (at least one bucket).

    [[5, 6, 7], [8]] with bucket 4 -> ids [[0, 5, 6, 7], [0, 0, 0, 8]], mask [[0, 1, 1, 1], [0, 0, 0, 1]].
    """
    longest = max((len(t) for t in token_lists), default=1)
    width = max(1, -(-longest // bucket)) * bucket
    ids = np.full((len(token_lists), width), pad_token_id, np.int32)
    mask = np.zeros((len(token_lists), width), np.int32)
    for i, tokens in enumerate(token_lists):
        if len(tokens):
            ids[i, width - len(tokens) :] = tokens
            mask[i, width - len(tokens) :] = 1
    return ids, mask


@dataclasses.dataclass
class PromptBatch:
    """B prompts ready for the sampler, with the dataset columns the reward functions receive."""

    prompts: list[Any]  # B raw prompts (text or message lists)
    columns: dict[str, list[Any]]  # every other dataset column, B values each
    prompt_ids: np.ndarray  # [B, P] int32, left-padded
    prompt_mask: np.ndarray  # [B, P] int32
    num_truncated: int  # prompts shortened to max_prompt_length

    def __len__(self) -> int:
        return len(self.prompts)


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
    """Rows -> `PromptBatch`: encode, truncate from the left, left-pad to a bucket multiple."""

    tokenizer: Any
    max_prompt_length: int | None
    prompt_bucket: int
    chat_template_kwargs: dict | None = None
    tools: Any = None  # tool calling: the callables every prompt shows, or {environment name: callables}
    chat_template: str | None = None  # tool calling: TRL's training template replacing the tokenizer's

    def tools_of(self, rows: dict[str, list[Any]], n: int) -> list[Any] | None:
        """Each row's tools (a dict of environments: its `environment` column picks), or None without tools."""
        if self.tools is None:
            return None
        if isinstance(self.tools, dict):
            names = rows.get("environment", [None] * n) if None not in self.tools else [None] * n
            return [self.tools[name] for name in names]
        return [self.tools] * n

    def __call__(self, rows: dict[str, list[Any]]) -> PromptBatch:
        if "prompt" in rows:
            prompts = list(rows["prompt"])
            encoded = encode_prompts(prompts, self.tokenizer, self.chat_template_kwargs,
                                     self.tools_of(rows, len(prompts)), self.chat_template)
        else:  # pre-tokenized (TRL's PPO datasets): the ids as they are, their text for the reward functions
            encoded = [list(map(int, ids)) for ids in rows["input_ids"]]
            prompts = prompt_texts(rows, self.tokenizer)
        if min(len(t) for t in encoded) == 0:
            raise DataError("a prompt encodes to zero tokens; remove empty prompts from the dataset")
        truncated = [truncate_left(t, self.max_prompt_length) for t in encoded]
        num_truncated = sum(len(a) != len(b) for a, b in zip(encoded, truncated, strict=True))
        pad = self.tokenizer.pad_token_id
        pad = self.tokenizer.eos_token_id if pad is None else pad
        ids, mask = left_pad(truncated, int(pad or 0), self.prompt_bucket)
        columns = {k: list(v) for k, v in rows.items() if k not in ("prompt", "input_ids")}
        return PromptBatch(prompts, columns, ids, mask, num_truncated)


def prompt_texts(rows: dict[str, list[Any]], tokenizer: Any) -> list[Any]:
    """The rows' prompts: the `prompt` column, or the text of pre-tokenized `input_ids` (special tokens skipped)."""
    if "prompt" in rows:
        return list(rows["prompt"])
    return tokenizer.batch_decode([list(map(int, ids)) for ids in rows["input_ids"]], skip_special_tokens=True)


# ------------------------------------------------------------------------------------------------ iteration
class PromptIterator:
    """Endless batches of row indices: a fresh permutation per epoch from (seed, epoch); the last partial
    batch of an epoch is dropped so every batch has the same shape.

    The position (epoch, index) is the whole state: `load_state_dict(state_dict())` resumes exactly.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True) -> None:
        if num_rows < batch_size:
            raise DataError(
                f"the dataset has {num_rows} prompts, fewer than one generation batch of "
                f"{batch_size} prompts; use more prompts or lower per_device_train_batch_size"
            )
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, shuffle
        self.epoch, self.index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def order(self, epoch: int) -> np.ndarray:
        """The row order of an epoch (deterministic in (seed, epoch))."""
        if not self.shuffle:
            return np.arange(self.num_rows)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        if self.index + self.batch_size > self.num_rows:
            self.epoch, self.index = self.epoch + 1, 0
        batch = self.order(self.epoch)[self.index : self.index + self.batch_size]
        self.index += self.batch_size
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows or state["seed"] != self.seed:
            raise DataError(
                f"the checkpoint's data position is for {state['num_rows']} prompts with seed "
                f"{state['seed']}, but this run has {self.num_rows} prompts with seed "
                f"{self.seed}; "
                "resume with the same dataset and seed (or use a new output_dir)"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])


def eval_batches(num_rows: int, batch_size: int) -> Iterator[tuple[np.ndarray, int]]:
    """(indices, number of real rows) over a split in order; the last batch is padded by repeating its
    last row so every batch has the same shape (callers drop the padded rows' results)."""
    for start in range(0, num_rows, batch_size):
        idx = np.arange(start, min(start + batch_size, num_rows))
        real = len(idx)
        yield np.concatenate([idx, np.full(batch_size - real, idx[-1])]), real
