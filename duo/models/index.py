"""A PEP 503 "simple" index client: find a package version's archive, download it resumably and verify it."""

from __future__ import annotations

import http.client
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Mapping, Protocol, Sequence

from duo.models.errors import ArchiveChecksumError, HubError, IndexUnreachableError, PackageNotFoundError
from duo.models.files import partial_path, sha256_file

DEFAULT_INDEX_URL = "https://pypi.org/simple"
#: seconds to wait on any single network operation (connect or read)
HTTP_TIMEOUT = float(os.environ.get("DUO_HTTP_TIMEOUT") or 60)
#: how many times one archive download may resume by itself after the
#: connection drops mid-transfer (each retry must have made progress)
MAX_RESUMES = 20
_CHUNK = 1 << 20
_USER_AGENT = "duo-hub/0.1 (python-urllib)"


@dataclass(frozen=True)
class ArchiveLink:
    """One archive on the index: where to get it, its file name, and the sha256 the index gives (if any)."""

    url: str  # without fragment
    filename: str
    sha256: str | None


class Progress(Protocol):
    """What ``download`` reports to: the archive's total size once known, the
    bytes already on disk, and each chunk as it arrives."""

    def size(self, total: int | None) -> None: ...

    def at(self, have: int) -> None: ...

    def add(self, n: int) -> None: ...


def resolve_index_url(index_url: str | None) -> str:
    """``index_url``, else ``$DUO_INDEX_URL``, else PyPI; without a trailing slash."""
    return (index_url or os.environ.get("DUO_INDEX_URL") or DEFAULT_INDEX_URL).rstrip("/")


# --------------------------------------------------------------------------
# finding an archive


def find_archive(package: str, version: str, index: str) -> ArchiveLink:
    """The wheel (else the sdist) of exactly ``package==version`` on the simple index at ``index``."""
    page = f"{index}/{_normalize(package)}/"
    final_url, html = _read_page(page, package, index)
    files = _files_on(html, final_url)
    chosen = _pick(files, package, version)
    if chosen is None:
        versions = sorted({_version_of(f) for f, _ in files} - {None})
        raise PackageNotFoundError(
            f"package {package!r} has no version {version} (wheel or sdist) on {page}; "
            f"versions there: {', '.join(versions) or 'none'}"
        )
    filename, url = chosen
    # the file name becomes a path under downloads/: nothing that could leave it
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+!-]*", filename):
        raise HubError(f"refusing odd archive file name {filename!r} from {page}")
    base, _, fragment = url.partition("#")
    return ArchiveLink(base, filename, _sha256_in(fragment))


def _read_page(page: str, package: str, index: str) -> tuple[str, str]:
    """The URL ``page`` was finally served from (after redirects) and its HTML."""
    try:
        with _open(page, {"Accept": "text/html"}) as resp:
            final_url = resp.geturl() or page
            charset = resp.headers.get_content_charset() or "utf-8"
            return final_url, resp.read().decode(charset, errors="replace")
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 404:
            raise PackageNotFoundError(
                f"package {package!r} was not found on the index {index} ({page}: HTTP 404). "
                "Check DUO_INDEX_URL points to a PyPI mirror that has it"
            ) from None
        raise _unreachable(page, f"HTTP {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(page, _reason(exc)) from None


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


def _files_on(html: str, page_url: str) -> list[tuple[str, str]]:
    """``(filename, absolute url)`` of every link on an index page; hrefs may
    be relative to the page, as on many mirrors."""
    parser = _AnchorParser()
    parser.feed(html)
    parser.close()
    files = []
    for href, text in parser.anchors:
        url = urllib.parse.urljoin(page_url, href)
        path = urllib.parse.urlsplit(url).path
        filename = urllib.parse.unquote(path.rsplit("/", 1)[-1]) or text
        files.append((filename, url))
    return files


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pick(files: Sequence[tuple[str, str]], package: str, version: str) -> tuple[str, str] | None:
    """The pure-Python wheel (else the sdist) of exactly ``version`` among
    ``(filename, href)`` pairs."""
    want = _normalize(package)
    wheel = sdist = None
    for filename, href in files:
        if filename.endswith(".whl"):
            bits = filename[: -len(".whl")].split("-")
            if len(bits) not in (5, 6):
                continue
            dist, wheel_version, py, abi, plat = bits[0], bits[1], bits[-3], bits[-2], bits[-1]
            if (
                _normalize(dist) == want
                and wheel_version == version
                and "py3" in py.split(".")
                and abi == "none"
                and plat == "any"
            ):
                wheel = wheel or (filename, href)
        elif filename.endswith(".tar.gz"):
            dist, _, sdist_version = filename[: -len(".tar.gz")].rpartition("-")
            if _normalize(dist) == want and sdist_version == version:
                sdist = sdist or (filename, href)
    return wheel or sdist


def _version_of(filename: str) -> str | None:
    if filename.endswith(".whl"):
        bits = filename.split("-")
        return bits[1] if len(bits) >= 5 else None
    if filename.endswith(".tar.gz"):
        return filename[: -len(".tar.gz")].rpartition("-")[2] or None
    return None


def _sha256_in(fragment: str) -> str | None:
    """The ``sha256=<hex>`` of a link's URL fragment, if it has a well-formed one."""
    sha = None
    for item in fragment.split("&"):
        key, _, value = item.partition("=")
        if key == "sha256" and re.fullmatch(r"[0-9a-fA-F]{64}", value):
            sha = value.lower()
    return sha


# --------------------------------------------------------------------------
# talking HTTP


def _open(url: str, headers: Mapping[str, str] | None = None):
    req = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT, **(headers or {})})
    return urllib.request.urlopen(req, timeout=HTTP_TIMEOUT)


def _unreachable(url: str, reason: object) -> IndexUnreachableError:
    return IndexUnreachableError(
        f"cannot reach {url} : {reason}. Check your network, or set DUO_INDEX_URL to a PyPI mirror"
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError) and not isinstance(exc, urllib.error.HTTPError):
        return str(exc.reason)
    return str(exc) or type(exc).__name__


# --------------------------------------------------------------------------
# downloading


class _Interrupted(Exception):
    """The transfer stopped early, after ``received`` bytes reached the file."""

    def __init__(self, reason: str, received: int) -> None:
        super().__init__(reason)
        self.received = received


class _BadRange(Exception):
    """The server answered a resume request with a range that does not start where the file ends."""

    def __init__(self, content_range: str | None) -> None:
        super().__init__(content_range)
        self.content_range = content_range


def download(link: ArchiveLink, dest: Path, progress: Progress, model: str) -> None:
    """Download ``link`` to ``dest`` via ``dest.partial``, resuming a partial
    file left by an earlier run with a Range request, and verify its sha256.
    ``model`` (what is being pulled) is named in the error messages."""
    partial = partial_path(dest)
    resumes = 0
    while True:
        try:
            _transfer(link, partial, progress, model)
            break
        except _BadRange as exc:
            if resumes >= MAX_RESUMES:
                raise HubError(
                    f"download of {link.filename} failed: the server answered a resume request with "
                    f"an unexpected range ({exc.content_range!r}). "
                    f"Delete {partial} and re-run `duo models pull {model}`"
                ) from None
            partial.unlink(missing_ok=True)  # an unusable range: start over
        except _Interrupted as exc:
            if exc.received == 0 or resumes >= MAX_RESUMES:
                raise HubError(
                    f"download of {link.filename} was interrupted: {exc}. "
                    f"Re-run `duo models pull {model}` to resume it"
                ) from None
        resumes += 1
    _verify(link, partial, model)
    os.replace(partial, dest)


def _transfer(link: ArchiveLink, partial: Path, progress: Progress, model: str) -> None:
    """One request for what ``partial`` still lacks, appended to it (or
    written afresh where the server will not resume)."""
    have = partial.stat().st_size if partial.exists() else 0
    try:
        resp = _open(link.url, {"Range": f"bytes={have}-"} if have else {})
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416 and have:
            # Nothing left to send: the partial file is already whole (or
            # bogus, which the checksum will tell).
            progress.size(have)
            progress.at(have)
            return
        raise HubError(
            f"download of {link.filename} failed: HTTP {exc.code} {exc.reason} ({link.url}). "
            f"Re-run `duo models pull {model}` to try again"
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
        raise _unreachable(link.url, _reason(exc)) from None
    with resp:
        length = resp.headers.get("Content-Length")
        length = int(length) if length and length.isdigit() else None
        have = _resume_point(resp, have, length, progress)
        progress.at(have)
        _receive(resp, partial, "ab" if have else "wb", length, progress)


def _resume_point(resp: http.client.HTTPResponse, have: int, length: int | None, progress: Progress) -> int:
    """How much of ``partial`` the response continues: ``have`` when it is the
    asked-for range, 0 when it is the whole file; tells ``progress`` the total."""
    if not (have and resp.status == 206):
        # A fresh download, or a server that ignored Range (200): start over.
        progress.size(length)
        return 0
    m = re.match(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)", resp.headers.get("Content-Range", ""))
    if not (m and int(m.group(1)) == have):
        raise _BadRange(resp.headers.get("Content-Range"))
    total = int(m.group(2)) if m.group(2) != "*" else None
    progress.size(total if total is not None else (have + length if length is not None else None))
    return have


def _receive(
    resp: http.client.HTTPResponse, partial: Path, mode: str, length: int | None, progress: Progress
) -> None:
    """Copy the response body into ``partial``; raises ``_Interrupted`` if it ends short."""
    received = 0
    with open(partial, mode) as out:
        while True:
            try:
                chunk = resp.read(_CHUNK)
            except (OSError, http.client.HTTPException) as exc:
                raise _Interrupted(_reason(exc), received) from None
            if not chunk:
                break
            out.write(chunk)
            received += len(chunk)
            progress.add(len(chunk))
    if length is not None and received < length:
        raise _Interrupted(f"connection closed after {received} of {length} bytes", received)


def _verify(link: ArchiveLink, partial: Path, model: str) -> None:
    """Delete ``partial`` and raise if it does not match the index's sha256."""
    if link.sha256 is None:
        return
    got = sha256_file(partial)
    if got != link.sha256:
        partial.unlink(missing_ok=True)
        raise ArchiveChecksumError(
            f"checksum mismatch for downloaded archive {link.filename}: expected sha256 "
            f"{link.sha256}, got {got}. The bad file was deleted; re-run `duo models pull {model}` "
            "to download it again"
        )
