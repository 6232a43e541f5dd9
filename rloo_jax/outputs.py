"""Where a run's files go: a local folder or a cloud URL (`gs://`, `s3://`, `az://`), through one layer.

Checkpoints go through orbax, which takes the same `etils.epath` paths (its arrays through tensorstore's own gcs /
s3 drivers). Everything else a run writes -- metrics.jsonl, rollouts.jsonl, config.yaml, tensorboard/,
compile_report.json, the Hugging Face exports final/ and final_merged/ -- goes through this module, which opens
URLs with `etils.epath` (fsspec underneath: gcsfs for `gs://`, s3fs for `s3://`).

Object stores have no append and no rename, so a growing log is kept in a local staging file and uploaded whole:
metrics.jsonl and rollouts.jsonl (`AppendFile`) before every checkpoint save, at the end of the run and at most
`SYNC_SECONDS` apart in between (60, or the RLOO_JAX_SYNC_SECONDS environment variable); TensorBoard's event files
(`StagedDir`) before every checkpoint save and at the end. Every record of a step is written before its checkpoint
is saved, so a kill loses only records after the newest checkpoint, which a resume drops and writes again anyway
(`drop_records_after`): nothing is lost or doubled. An object upload is atomic: a reader sees the old or the new
file, never half of one. Exports are written to a local temporary folder and uploaded file by file (`staged_dir`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from etils import epath

# the most seconds between two uploads of a growing log (metrics, rollouts); RLOO_JAX_SYNC_SECONDS=0 uploads at every
# write (to watch a run live from the bucket, at one upload of the whole file per logged step)
SYNC_SECONDS = float(os.environ.get("RLOO_JAX_SYNC_SECONDS", "60"))
_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")


def is_remote(path: str | os.PathLike) -> bool:
    """A URL other than `file://` (e.g. `gs://bucket/run`); local paths, `~/x` and `file:///x` are not."""
    m = _URL.match(os.fspath(path))
    return bool(m) and m.group(1).lower() != "file"


# a Hugging Face hub repo id: `name` or `namespace/name`, each part letters, digits, "-", "_", "." (starting and
# ending with a letter or digit; the name at most 96 characters), with no "--" or ".." (huggingface_hub's rule)
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9](?:[\w.-]*[A-Za-z0-9])?/)?[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9])?$")


def is_local_path(name: str) -> bool:
    """Whether a model or dataset source `name` means a local path, not a hub repo id.

    Local: it exists (file or folder, ~ expanded); or it cannot be a hub id (it starts with /, ./, ../, ~ or
    ".", has two or more "/", a backslash, a space, "--" or "..", ...: `_HUB_ID`); or it is `first/rest` with
    `first` an existing local folder (`outputs/run1` next to an `outputs/` folder). Anything else is a hub id.
    A local path that does not exist is then an error naming it, never a hub download.
    "Qwen/Qwen2.5-0.5B" -> False (unless ./Qwen/ exists); "./model", "~/m", "/data/x", "runs/a/b" -> True.
    """
    if os.path.exists(os.path.expanduser(name)) or not _HUB_ID.match(name) or "--" in name or ".." in name:
        return True
    first = name.split("/")[0]
    return "/" in name and os.path.isdir(first)


def resolve(path: str | os.PathLike) -> epath.Path:
    """The path as an `epath.Path`: a URL as given; a local path (or `file://` URL) made absolute with ~ expanded."""
    text = os.fspath(path)
    if is_remote(text):
        return epath.Path(text)
    text = text.removeprefix("file://")
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


def join(base: str | os.PathLike, *parts: str) -> str:
    """`base/part/...` as a string (a URL stays a URL; a local path is made absolute)."""
    return os.fspath(resolve(base).joinpath(*parts))


def exists(path: str | os.PathLike) -> bool:
    return resolve(path).exists()


def makedirs(path: str | os.PathLike) -> None:
    """Create the folder and its parents (on object stores folders are implicit: a no-op there)."""
    resolve(path).mkdir(parents=True, exist_ok=True)


def read_text(path: str | os.PathLike) -> str:
    """The file's text, decoded as UTF-8 with its line endings as written (no newline translation: a JSONL
    reader splits on "\\n" alone, never on the \\r, U+2028, ... that `str.splitlines` also splits on)."""
    return resolve(path).read_bytes().decode("utf-8")


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace the file's content. Local files go through a temporary file and `os.replace`, remote ones are one
    upload: either way a reader (or a kill) sees the old or the new content, never a mix."""
    target = resolve(path)
    if is_remote(target):
        target.write_bytes(text.encode("utf-8"))
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{target}.tmp"
    with open(tmp, "w", encoding="utf-8", newline="") as f:  # written as given: no "\n" translation
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def upload_file(local: str | os.PathLike, remote: str | os.PathLike) -> None:
    """Copy a local file to `remote` (any path `resolve` takes), streamed in 1 MiB chunks."""
    with open(local, "rb") as src, resolve(remote).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def upload_tree(local: str | os.PathLike, remote: str | os.PathLike) -> None:
    """Copy every file under the local folder `local` to the same relative path under `remote`."""
    root = Path(local)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        upload_file(file, join(remote, *file.relative_to(root).parts))


@contextlib.contextmanager
def staged_dir(path: str | os.PathLike) -> Iterator[Path]:
    """A local folder to write `path`'s files into: `path` itself when local (created), else a temporary folder
    that is uploaded to `path` when the block ends without an error (then deleted, error or not)."""
    if not is_remote(path):
        local = Path(os.fspath(resolve(path)))
        local.mkdir(parents=True, exist_ok=True)
        yield local
        return
    tmp = Path(tempfile.mkdtemp(prefix="rloo_jax_export_"))
    try:
        yield tmp
        upload_tree(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class StagedDir:
    """A folder that a library writes with plain file I/O (TensorBoard's event files): `local` is the folder
    itself for a local path; for a URL a temporary folder whose new or grown files `sync()` uploads."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(resolve(path))
        self.remote = is_remote(path)
        self.local = tempfile.mkdtemp(prefix="rloo_jax_staged_") if self.remote else self.path
        os.makedirs(self.local, exist_ok=True)
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) when uploaded

    def sync(self) -> None:
        if not self.remote:
            return
        for file in sorted(p for p in Path(self.local).rglob("*") if p.is_file()):
            stat, rel = file.stat(), file.relative_to(self.local).as_posix()
            if self._uploaded.get(rel) != (stat.st_size, stat.st_mtime_ns):
                upload_file(file, join(self.path, *rel.split("/")))
                self._uploaded[rel] = (stat.st_size, stat.st_mtime_ns)

    def close(self) -> None:
        self.sync()
        if self.remote:
            shutil.rmtree(self.local, ignore_errors=True)


class AppendFile:
    """A text file opened for appending, flushed after every write. Local: the file itself. Remote: a local staging
    copy (the remote file's content first) that `sync()` uploads whole; `write` syncs when `SYNC_SECONDS` have passed
    since the last upload, `close` syncs."""

    def __init__(self, path: str | os.PathLike, sync_seconds: float = SYNC_SECONDS) -> None:
        self.path = os.fspath(resolve(path))
        self.remote = is_remote(path)
        self.sync_seconds = sync_seconds
        self._last_sync = time.monotonic()
        if self.remote:
            fd, self._local = tempfile.mkstemp(prefix="rloo_jax_", suffix=".jsonl")
            os.close(fd)
            target = resolve(self.path)
            if target.exists():
                with target.open("rb") as src, open(self._local, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        else:
            self._local = self.path
            os.makedirs(os.path.dirname(self._local), exist_ok=True)
        # newline="": the text is written as given (no "\n" -> os.linesep translation)
        self._file = open(self._local, "a", encoding="utf-8", newline="")  # noqa: SIM115 - closed by close()
        self._dirty = False

    def write(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        self._dirty = True
        if self.remote and time.monotonic() - self._last_sync >= self.sync_seconds:
            self.sync()

    def sync(self) -> None:
        """Upload the staging copy (remote only; a no-op when nothing was written since the last upload)."""
        self._last_sync = time.monotonic()
        if self.remote and self._dirty:
            upload_file(self._local, self.path)
            self._dirty = False

    def close(self) -> None:
        if self._file.closed:
            return
        self._file.close()
        self.sync()
        if self.remote:
            os.remove(self._local)
