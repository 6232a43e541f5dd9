"""Prompt data: every source format, conversational prompts, left truncation, bucketing, iteration + resume."""

import json
import sys

import datasets
import numpy as np
import pytest

from rloo_jax import demo
from rloo_jax.data import (
    PromptEncoder,
    PromptIterator,
    check_prompt_dataset,
    encode_prompts,
    eval_batches,
    is_conversational,
    left_pad,
    load_prompt_dataset,
    tfds_rows_to_dataset,
    truncate_left,
)
from rloo_jax.errors import DataError

ROWS = [
    {"prompt": "abc:", "letters": "abc"},
    {"prompt": "def:", "letters": "def"},
    {"prompt": "ace:", "letters": "ace"},
]


@pytest.fixture(scope="module")
def tok():
    return demo.build_tokenizer()


@pytest.mark.parametrize("ext", ["json", "jsonl", "parquet", "csv"])
def test_local_file_formats(tmp_path, ext):
    path = tmp_path / f"p.{ext}"
    df = datasets.Dataset.from_list(ROWS)
    {
        "json": lambda: path.write_text(json.dumps(ROWS)),
        "jsonl": lambda: df.to_json(str(path)),
        "parquet": lambda: df.to_parquet(str(path)),
        "csv": lambda: df.to_csv(str(path), index=False),
    }[ext]()
    ds = load_prompt_dataset(str(path), "train")
    assert ds["prompt"] == ["abc:", "def:", "ace:"] and ds["letters"] == ["abc", "def", "ace"]


def test_save_to_disk_and_split_folders(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:1])})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert len(load_prompt_dataset(str(tmp_path / "dd"), "train")) == 3
    assert load_prompt_dataset(str(tmp_path / "dd"), "test")["prompt"] == ["abc:"]
    with pytest.raises(DataError, match="has no split 'validation' .splits: train, test"):
        load_prompt_dataset(str(tmp_path / "dd"), "validation")
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert len(load_prompt_dataset(str(tmp_path / "single"), "train")) == 3
    folder = demo.prepare_dataset(tmp_path / "demo", seed=0, num_train=10, num_test=4)
    assert len(load_prompt_dataset(folder, "train")) == 10 and len(load_prompt_dataset(folder, "test")) == 4


def test_split_may_be_a_file_and_single_files_have_only_train(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
    datasets.Dataset.from_list(ROWS).to_json(str(train))
    datasets.Dataset.from_list(ROWS[:2]).to_json(str(test))
    assert len(load_prompt_dataset(str(train), str(test))) == 2
    with pytest.raises(DataError, match="only has the `train` split"):
        load_prompt_dataset(str(train), "test")


def test_data_errors(tmp_path):
    with pytest.raises(DataError, match="no such file or folder"):
        load_prompt_dataset(str(tmp_path / "missing.jsonl"), "train")
    (tmp_path / "noprompt.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(DataError, match="has no `prompt` column .columns: question"):
        load_prompt_dataset(str(tmp_path / "noprompt.jsonl"), "train")
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    with pytest.raises(DataError, match="is empty"):
        load_prompt_dataset(str(tmp_path / "empty.csv"), "train")
    with pytest.raises(DataError, match=r"dataset x \[train\] is empty"):
        check_prompt_dataset(datasets.Dataset.from_dict({"prompt": []}), "x [train]")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(DataError, match="cannot read dataset file"):
        load_prompt_dataset(str(tmp_path / "broken.json"), "train")
    with pytest.raises(DataError, match="cannot load dataset 'nobody/nothing'"):
        load_prompt_dataset("nobody/nothing", "train")  # the hub is offline in tests


def test_tfds_needs_the_extra_and_rows_become_plain_values(monkeypatch):
    """The real tensorflow-datasets paths are tested in test_tfds.py."""
    monkeypatch.setitem(sys.modules, "tensorflow_datasets", None)
    with pytest.raises(DataError, match=r"the `tfds` extra: pip install 'rloo_jax\[tfds\]'"):
        load_prompt_dataset("tfds:glue/sst2", "train")
    rows = [{"prompt": b"1+1?", "answer": np.bytes_(b"2"), "id": np.int64(7), "tags": np.array([b"a", b"b"])}]
    assert tfds_rows_to_dataset(rows)[0] == {"prompt": "1+1?", "answer": "2", "id": 7, "tags": ["a", "b"]}


def test_standard_and_conversational_encoding(tok):
    assert encode_prompts(["ab", "c"], tok) == [[5, 6], [7]]
    chat = [[{"role": "user", "content": "ab"}]]
    assert is_conversational(chat[0]) and not is_conversational("ab")
    # <|user|> a b <|assistant|>
    assert encode_prompts(chat, tok) == [[3, 5, 6, 4]]
    tok2 = demo.build_tokenizer()
    tok2.chat_template = "{% if flag %}x{% endif %}{{ messages[0]['content'] }}"
    assert encode_prompts(chat, tok2, {"flag": True}) == [[28, 5, 6]]
    tok2.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        encode_prompts(chat, tok2)


def test_truncate_left_and_left_pad():
    assert truncate_left([1, 2, 3, 4], 2) == [3, 4] and truncate_left([1, 2], 5) == [1, 2]
    assert truncate_left([1, 2, 3], None) == [1, 2, 3]
    ids, mask = left_pad([[5, 6, 7], [8]], 0, 4)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 8]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])
    assert left_pad([[1] * 5], 0, 4)[0].shape == (1, 8) and left_pad([[1] * 8], 0, 4)[0].shape == (1, 8)
    assert ids.dtype == np.int32 and mask.dtype == np.int32


def test_prompt_encoder_counts_truncations_and_buckets(tok):
    enc = PromptEncoder(tok, max_prompt_length=3, prompt_bucket=4)
    batch = enc({"prompt": ["abcde", "ab"], "letters": ["x", "y"]})
    assert batch.num_truncated == 1 and len(batch) == 2
    np.testing.assert_array_equal(batch.prompt_ids, [[0, 7, 8, 9], [0, 0, 5, 6]])  # "cde" kept: left truncation
    np.testing.assert_array_equal(batch.prompt_mask, [[0, 1, 1, 1], [0, 0, 1, 1]])
    assert batch.columns == {"letters": ["x", "y"]} and batch.prompts == ["abcde", "ab"]
    with pytest.raises(DataError, match="zero tokens"):
        enc({"prompt": ["", "a"]})


def test_iterator_shuffles_per_epoch_deterministically_and_drops_partial_batches():
    it = PromptIterator(10, 4, seed=3)
    epoch0 = [next(it) for _ in range(2)]
    assert it.state_dict()["epoch"] == 0 and it.batches_per_epoch == 2
    epoch1 = [next(it) for _ in range(2)]
    assert it.epoch == 1
    assert len(set(np.concatenate(epoch0))) == 8  # no repeats inside an epoch; 2 rows dropped
    assert not np.array_equal(np.concatenate(epoch0), np.concatenate(epoch1))
    again = PromptIterator(10, 4, seed=3)
    np.testing.assert_array_equal(np.concatenate([next(again) for _ in range(4)]), np.concatenate(epoch0 + epoch1))
    np.testing.assert_array_equal(next(PromptIterator(10, 4, seed=3, shuffle=False)), [0, 1, 2, 3])


def test_iterator_resume_position():
    it = PromptIterator(10, 3, seed=1)
    for _ in range(4):
        next(it)
    state = it.state_dict()
    expected = [next(it) for _ in range(5)]
    resumed = PromptIterator(10, 3, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    for a, b in zip(expected, [next(resumed) for _ in range(5)], strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(DataError, match="same dataset and seed"):
        PromptIterator(11, 3, seed=1).load_state_dict(state)
    with pytest.raises(DataError, match="fewer than one generation batch"):
        PromptIterator(2, 3, seed=1)


def test_eval_batches_pad_the_last_batch():
    out = list(eval_batches(5, 2))
    assert [real for _, real in out] == [2, 2, 1]
    np.testing.assert_array_equal(out[-1][0], [4, 4])
