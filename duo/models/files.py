"""Model files on disk: partial files, sha256 stamps, assembly from archive members, and derived copies (F16, F32)."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import os
import sys
import tarfile
import tempfile
import time
import types
import zipfile
import zlib
from pathlib import Path
from typing import IO, BinaryIO, Callable, Iterator, Sequence

from duo.models.errors import HubError

_CHUNK = 1 << 20

#: what reading a damaged (truncated, corrupted) zip or tar archive raises
DAMAGED_ARCHIVE_ERRORS = (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error)


def partial_path(path: Path) -> Path:
    """Where ``path`` is written until it is complete (then renamed into place)."""
    return path.with_name(path.name + ".partial")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------
# stamps: a file's verified sha256, so that later runs need not rehash it


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def read_stamp(path: Path) -> dict | None:
    """The stamp of ``path`` if it still describes the file (same size and
    mtime), else None."""
    try:
        stamp = json.loads(_stamp_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if not isinstance(stamp, dict):
        return None
    if stamp.get("size") != st.st_size or stamp.get("mtime_ns") != st.st_mtime_ns:
        return None
    if not isinstance(stamp.get("sha256"), str):
        return None
    return stamp


def write_stamp(path: Path, sha256: str, **extra) -> dict:
    """Record that ``path``, as it is now, has hash ``sha256`` (plus ``extra`` fields)."""
    st = path.stat()
    stamp = {
        "name": path.name,
        "sha256": sha256,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    # written aside and renamed, so that a reader never sees half a stamp
    tmp = _stamp_path(path).with_suffix(".sha256.tmp")
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    durable_replace(tmp, _stamp_path(path))
    return stamp


def durable_replace(src: Path, dst: Path) -> None:
    """Rename ``src`` over ``dst`` so that a crash or power cut leaves either the old file or the whole
    new one: the data reaches the disk before the rename, and the rename before this returns."""
    with open(src, "rb") as f:
        os.fsync(f.fileno())
    os.replace(src, dst)
    try:
        directory = os.open(dst.parent, os.O_RDONLY)
    except OSError:
        return  # a platform whose directories cannot be opened (Windows): the rename is what it offers
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# --------------------------------------------------------------------------
# assembling


def assemble(pieces: Sequence[tuple[Path, str]], out: Path, on_bytes: Callable[[int], None],
             max_bytes: int | None = None) -> str:
    """Concatenate into ``out`` the one member of each ``(archive, glob)``
    piece, in order, calling ``on_bytes`` with each chunk's length; returns
    the sha256 of what was written. HubError as soon as more than ``max_bytes``
    came (a damaged or hostile archive must not fill the disk first)."""
    h = hashlib.sha256()
    written = 0
    with open(out, "wb") as dst:
        for archive, pattern in pieces:
            with _open_member(archive, pattern) as src:
                while chunk := src.read(_CHUNK):
                    written += len(chunk)
                    if max_bytes is not None and written > max_bytes:
                        raise HubError(f"{archive.name} holds more than the {max_bytes} bytes expected of the model")
                    h.update(chunk)
                    dst.write(chunk)
                    on_bytes(len(chunk))
    return h.hexdigest()


@contextlib.contextmanager
def _open_member(archive: Path, pattern: str) -> Iterator[BinaryIO]:
    """The one member of a zip or tar archive whose name matches ``pattern``."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            names = [n for n in zf.namelist() if not n.endswith("/") and fnmatch.fnmatchcase(n, pattern)]
            _one(names, pattern, archive)
            with zf.open(names[0]) as f:
                yield f
        return
    try:
        tf = tarfile.open(archive, "r:*")
    except tarfile.TarError as exc:
        raise HubError(f"{archive.name} is neither a zip nor a tar archive ({exc}); delete it and re-run") from None
    with tf:
        members = [m for m in tf.getmembers() if m.isfile() and fnmatch.fnmatchcase(m.name, pattern)]
        _one([m.name for m in members], pattern, archive)
        f = tf.extractfile(members[0])
        assert f is not None
        with f:
            yield f


def _one(names: list[str], pattern: str, archive: Path) -> None:
    if len(names) != 1:
        what = "no member" if not names else f"{len(names)} members ({', '.join(names[:5])})"
        raise HubError(f"{archive.name} has {what} matching {pattern!r}; expected exactly one")


# --------------------------------------------------------------------------
# deriving


def convert_ftype(src: Path, dst: Path, ftype: str) -> None:
    """Write a copy of the GGUF ``src`` to ``dst`` with its weights in llama.cpp's file type
    ``ftype`` (the name after ``LLAMA_FTYPE_``: ``MOSTLY_F16``, ``ALL_F32``), with llama.cpp's
    quantizer, dequantizing where needed.  llama.cpp's chatter goes to a temporary file and is
    shown only if it fails."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise HubError(
            f"making a {ftype} copy needs llama-cpp-python ({exc}); install it with `pip install llama-cpp-python`"
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = _ftype_constant(llama_cpp, ftype)
    # the source is already quantized (Q4_K_M): llama.cpp refuses to convert it without this
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    with _captured_stderr() as log:
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params)
    if rc != 0:
        tail = "\n".join(log.read().splitlines()[-15:])
        raise HubError(f"llama.cpp could not make a {ftype} copy of {src} (return code {rc}):\n{tail}")


def _ftype_constant(llama_cpp: types.ModuleType, ftype: str) -> int:
    """llama.cpp's number for the file type named ``ftype``."""
    try:
        return getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    except AttributeError:
        raise HubError(f"llama.cpp has no file type {ftype!r} (LLAMA_FTYPE_{ftype})") from None


@contextlib.contextmanager
def _captured_stderr() -> Iterator[IO[str]]:
    """Send file descriptor 2 (native code's stderr) to a temporary file for
    the duration; yields a file to read it back from."""
    with tempfile.TemporaryFile(mode="w+", errors="replace") as tmp:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            yield tmp
            return
        try:
            os.dup2(tmp.fileno(), 2)
            yield tmp
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
