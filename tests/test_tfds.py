"""`tfds:` datasets with the real tensorflow-datasets package: names, rows, errors, and two training steps.

Datasets are prepared offline into temporary data directories by `tests/tfds_data.py`. array_record is built
and read without TensorFlow, so it runs everywhere; tfrecord is built and read through TensorFlow, which the
test extra leaves out (1.3 GB installed): where TensorFlow is missing, the committed tfrecord copy under
`tests/data/tfds` checks the one-line message instead.
"""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from rloo_jax import data, demo
from rloo_jax.cli import main
from rloo_jax.data import (
    TfdsName,
    load_prompt_dataset,
    load_tfds,
    parse_tfds_name,
    resolve_tfds_data_dir,
    tfds_layout,
    tfds_rows_to_dataset,
    tfds_split_names,
    tfds_to_python,
)
from rloo_jax.errors import DataError
from rloo_jax.metrics import read_jsonl
from tests import tfds_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMITTED = os.path.join(ROOT, "tests", "data", "tfds")  # tfrecord, built by `python -m tests.tfds_data`
HAS_TF = importlib.util.find_spec("tensorflow") is not None
NEEDS_TF = pytest.mark.skipif(not HAS_TF, reason="tfrecord is read through TensorFlow, which the test extra omits")
FORMATS = ["array_record", pytest.param("tfrecord", marks=NEEDS_TF)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """{file format: data directory holding rloo_prompts/{plain,chat}/1.0.0}, built on first use."""
    built = {}

    def get(file_format):
        if file_format not in built:
            built[file_format] = tfds_data.build(str(tmp_path_factory.mktemp(file_format)), file_format)
        return built[file_format]

    return get


# ------------------------------------------------------------------------------------------------ names
def test_names_data_dirs_and_split_names():
    assert parse_tfds_name("mnist") == TfdsName("mnist")
    assert parse_tfds_name("glue/sst2:2.0.0") == TfdsName("glue", "sst2", "2.0.0")
    assert parse_tfds_name("my_ds:1.0.0") == TfdsName("my_ds", None, "1.0.0")
    assert parse_tfds_name("glue", "sst2") == TfdsName("glue", "sst2") == parse_tfds_name("glue/sst2", "sst2")
    assert str(TfdsName("glue", "sst2", "2.0.0")) == "glue/sst2:2.0.0" and str(TfdsName("mnist")) == "mnist"
    for bad in ("", "a/b/c", "mnist:1.0", "mnist:latest", "my ds"):
        with pytest.raises(DataError, match=r"tfds:<name>\[/<config>\]\[:<version>\]"):
            parse_tfds_name(bad)
    with pytest.raises(DataError, match="names config 'cola' but dataset_config is 'sst2'"):
        parse_tfds_name("glue/cola", "sst2")

    assert resolve_tfds_data_dir("gs://bucket/tfds") == "gs://bucket/tfds"  # URLs pass through
    assert resolve_tfds_data_dir("~/d") == os.path.expanduser("~/d")
    assert resolve_tfds_data_dir(None, {"TFDS_DATA_DIR": "/data/tfds"}) == "/data/tfds"
    assert resolve_tfds_data_dir("/x", {"TFDS_DATA_DIR": "/data/tfds"}) == "/x"
    assert resolve_tfds_data_dir(None, {}) == os.path.expanduser("~/tensorflow_datasets")
    assert tfds_split_names("train[:10%]+test") == ["train", "test"] and tfds_split_names("train") == ["train"]


# ------------------------------------------------------------------------------------------------ rows
def test_rows_become_what_every_other_source_gives():
    layout = tfds_layout(tfds_data.features("chat"))
    assert layout == {
        "prompt": [{"role": None, "content": None}],
        "letters": None,
        "id": None,
        "meta": {"source": None, "level": None},
        "tags": None,
    }
    assert tfds_layout(tfds_data.features("plain")) == {"prompt": None, "letters": None, "id": None}
    # what tfds.as_numpy gives (arrays) and what the data source gives (lists) both come out the same
    for stacked in (
        {"role": np.array([b"system", b"user"], dtype=object), "content": np.array([b"be nice", b"h\xc3\xa9"])},
        {"role": [b"system", b"user"], "content": [b"be nice", b"h\xc3\xa9"]},
    ):
        assert tfds_to_python(stacked, layout["prompt"]) == [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": "hé"},
        ]
    assert tfds_to_python({"role": np.array([], dtype=object), "content": np.array([], dtype=object)}, [{}]) == []
    # a sequence of sequences of dicts
    assert tfds_to_python({"a": [[1, 2], [3]]}, [[{"a": None}]]) == [[{"a": 1}, {"a": 2}], [{"a": 3}]]
    assert tfds_to_python(np.int64(7)) == 7 and tfds_to_python(np.float32(0.5)) == 0.5
    assert tfds_to_python(np.bool_(True)) is True and tfds_to_python(b"\xff\x00") == b"\xff\x00"
    assert tfds_to_python({"id": np.int32(3), "x": np.array([[1, 2]])}) == {"id": 3, "x": [[1, 2]]}
    ds = tfds_rows_to_dataset(
        [{"prompt": stacked, "letters": b"abc", "id": np.int64(1), "meta": {"source": b"s", "level": np.int32(2)},
          "tags": np.array([b"t"])}],
        layout,
    )
    assert ds[0] == {
        "prompt": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hé"}],
        "letters": "abc",
        "id": 1,
        "meta": {"source": "s", "level": 2},
        "tags": ["t"],
    }


@pytest.mark.parametrize("file_format", FORMATS)
def test_prepared_splits_read_back_exactly_with_tfds_slicing(prepared, file_format):
    data_dir = prepared(file_format)
    for config in ("plain", "chat"):
        for split in ("train", "test"):
            ds = load_prompt_dataset(f"tfds:rloo_prompts/{config}", split, tfds_data_dir=data_dir)
            assert ds.to_list() == tfds_data.rows(config, split)
    train, test = tfds_data.rows("chat", "train"), tfds_data.rows("chat", "test")
    assert load_tfds("rloo_prompts/chat:1.0.0", "train[:25%]", None, data_dir).to_list() == train[:4]
    assert load_tfds("rloo_prompts", "train[4:6]+test[-1:]", "chat", data_dir).to_list() == train[4:6] + test[-1:]
    with pytest.raises(DataError, match=r"dataset tfds:rloo_prompts/plain \[train\[3:3\]\] is empty"):
        load_prompt_dataset("tfds:rloo_prompts/plain", "train[3:3]", tfds_data_dir=data_dir)


def test_array_record_is_read_without_tensorflow(prepared):
    """Read in a fresh process, so it holds even where TensorFlow is installed (and would be imported if used)."""
    code = (
        "import sys; from rloo_jax.data import load_tfds; "
        f"ds = load_tfds('rloo_prompts/chat', 'train', None, {prepared('array_record')!r}); "
        "print(len(ds), 'tensorflow' in sys.modules)"
    )
    if not HAS_TF:  # nothing could import it; the subprocess would only cost time
        assert load_tfds("rloo_prompts/chat", "train", None, prepared("array_record")).num_rows == 16
        return
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split()[-2:] == ["16", "False"], r.stderr[-2000:]


class RlooPromptsRegistered(tfds_data.RlooPrompts):
    """The same dataset with its builder in the TFDS registry, as catalog datasets (`tfds build mnist`) are."""


def test_registered_builders_read_from_their_code_path_once_prepared_as_the_error_says(tmp_path):
    with pytest.raises(DataError, match="is not prepared") as e:
        load_tfds("rloo_prompts_registered/chat", "test", None, str(tmp_path))
    command = re.search(r'python -c "(.*?)"', str(e.value))[1]
    exec(command, {})  # what the message tells a user to run (offline here: this builder downloads nothing)
    ds = load_tfds("rloo_prompts_registered/chat", "test", None, str(tmp_path))
    assert ds.to_list() == tfds_data.rows("chat", "test")
    with pytest.raises(DataError, match=r"cannot open tfds dataset rloo_prompts_registered/nope in .*: .*nope"):
        load_tfds("rloo_prompts_registered/nope", "test", None, str(tmp_path))  # its code has no such config
    assert "rloo_prompts_registered-test.array_record-00000-of-00001" in os.listdir(
        tmp_path / "rloo_prompts_registered" / "chat" / "1.0.0"
    )


# ------------------------------------------------------------------------------------------------ errors
def test_errors_name_the_dataset_the_directory_and_the_fix(prepared, tmp_path, monkeypatch):
    data_dir, empty = prepared("array_record"), str(tmp_path / "empty")
    with pytest.raises(DataError) as e:
        load_tfds("rloo_prompts/chat", "train", None, empty)
    assert str(e.value) == (
        f"tfds dataset rloo_prompts/chat is not prepared in {empty}; `tfds:` datasets are never downloaded: prepare "
        'it on a machine with network (python -c "import tensorflow_datasets as tfds; '
        f"tfds.builder('rloo_prompts/chat', data_dir='{empty}', file_format='array_record').download_and_prepare()\") "
        "or point tfds_data_dir at the folder that holds it"
    )
    assert not os.path.exists(empty)  # nothing was created, let alone downloaded
    with pytest.raises(DataError, match=r"rloo_prompts/chat:2\.0\.0 is not prepared in .* \(found there: "
                       r"rloo_prompts/chat/1\.0\.0, rloo_prompts/plain/1\.0\.0\)"):
        load_tfds("rloo_prompts/chat:2.0.0", "train", None, data_dir)
    with pytest.raises(DataError, match="rloo_prompts/nope is not prepared"):
        load_tfds("rloo_prompts/nope", "train", None, data_dir)
    with pytest.raises(DataError, match=r"not prepared in .*tfds.builder\('mnist', data_dir="):
        load_tfds("mnist", "train", None, empty)  # a catalog dataset: its code is there, its data is not
    with pytest.raises(DataError, match=r"has no split 'validation' \(splits: train, test\); set dataset_train"):
        load_tfds("rloo_prompts/plain", "train[:5]+validation", None, data_dir)
    with pytest.raises(DataError, match=r"cannot read split 'train\[:x\]' .*slice as TFDS does: train, train\[:10%\]"):
        load_tfds("rloo_prompts/plain", "train[:x]", None, data_dir)
    monkeypatch.setattr(data, "_importable", lambda module: False)
    with pytest.raises(DataError, match=r"gs://b/tfds: reading a gs:// bucket needs gcsfs .*rloo_jax\[tfds\]"):
        load_tfds("rloo_prompts/plain", "train", None, "gs://b/tfds")


@pytest.mark.skipif(HAS_TF, reason="checks the message shown where TensorFlow is missing")
def test_tfrecord_without_tensorflow_says_how_to_read_it():
    with pytest.raises(DataError) as e:
        load_tfds("rloo_prompts/plain", "train", None, COMMITTED)
    assert str(e.value) == (
        f"tfds dataset rloo_prompts/plain in {COMMITTED} is prepared as tfrecord, which is read through TensorFlow: "
        "pip install 'rloo_jax[tfds-tfrecord]' (or prepare it again as array_record, which is read without "
        "TensorFlow)"
    )


@NEEDS_TF
def test_committed_tfrecord_copy_matches_the_builder():
    for config in ("plain", "chat"):
        for split in ("train", "test"):
            ds = load_tfds(f"rloo_prompts/{config}", split, None, COMMITTED)
            assert ds.to_list() == tfds_data.rows(config, split)


# ------------------------------------------------------------------------------------------------ training
@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return demo.prepare_model(tmp_path_factory.mktemp("policy") / "policy", seed=0)


@pytest.mark.parametrize("file_format", FORMATS)
@pytest.mark.parametrize("config", ["plain", "chat"])
def test_cli_trains_two_steps_on_a_tfds_dataset(prepared, policy, tmp_path, file_format, config, capsys):
    out = tmp_path / "run"
    tfds_data.SEEN.clear()
    args = [
        "--model_name_or_path", policy,
        "--dataset_name", f"tfds:rloo_prompts/{config}",
        "--tfds_data_dir", prepared(file_format),
        "--dataset_train_split", "train[:50%]",
        "--reward_funcs", "tests.tfds_data:record_reward",
        "--per_device_train_batch_size", "8",
        "--num_generations", "4",
        "--max_completion_length", "4",
        "--beta", "0",
        "--max_steps", "2",
        "--logging_steps", "1",
        "--eval_steps", "None",
        "--output_dir", str(out),
        "--compilation_cache", "false",
    ]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if "reward" in r] == [1, 2]
    expected = tfds_data.rows(config, "train")[:8]
    assert len(tfds_data.SEEN) == 2
    for call in tfds_data.SEEN:  # 2 prompts x 4 completions per step, each column one value per completion
        assert len(call["prompts"]) == 8 and len(call["letters"]) == 8 and len(call["id"]) == 8
        for prompt, letters, row_id in zip(call["prompts"], call["letters"], call["id"], strict=True):
            row = expected[row_id]
            assert prompt == row["prompt"] and letters == row["letters"]
        if config == "chat":  # conversational: messages in, the completion as one assistant message
            assert isinstance(call["prompts"][0], list) and call["prompts"][0][0] == {"role": "system",
                                                                                       "content": "spell it"}
            assert call["completions"][0][0]["role"] == "assistant"
            assert [m == expected[i]["meta"] for m, i in zip(call["meta"], call["id"], strict=True)] == [True] * 8
            assert [t == expected[i]["tags"] for t, i in zip(call["tags"], call["id"], strict=True)] == [True] * 8
        else:
            assert isinstance(call["prompts"][0], str) and isinstance(call["completions"][0], str)


def test_cli_missing_tfds_dataset_exits_2_with_one_line(policy, tmp_path, capsys):
    args = [
        "--model_name_or_path", policy,
        "--dataset_name", "tfds:glue/sst2",
        "--tfds_data_dir", str(tmp_path / "tfds"),
        "--reward_funcs", "tests.tfds_data:record_reward",
        "--output_dir", str(tmp_path / "run"),
        "--compilation_cache", "false",
    ]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert re.match(r"error: tfds dataset glue/sst2 is not prepared in \S+tfds; .*tfds.builder\('glue/sst2', ", err)
