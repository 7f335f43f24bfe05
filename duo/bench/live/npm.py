"""The coding agents' npm packages, installed once per pinned version into a cache outside the repository."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CACHE = Path(os.environ.get("DUO_AGENTS_CACHE", Path.home() / ".cache" / "duo" / "agents"))


def installed(package: str, version: str, binary: str) -> Path:
    """The path of `binary` from `package@version`, installed into CACHE/<name>-<version> unless already there."""
    prefix = CACHE / f"{package.rsplit('/', 1)[-1]}-{version}"
    executable = prefix / "node_modules" / ".bin" / binary
    if executable.exists():
        return executable
    CACHE.mkdir(parents=True, exist_ok=True)
    # Installed beside the cache and renamed into place: an install cut short is never taken for a whole one.
    staging = Path(tempfile.mkdtemp(prefix=f"{prefix.name}.", dir=CACHE))
    done = subprocess.run(["npm", "install", "--prefix", str(staging), "--no-audit", "--no-fund", "--no-save",
                           f"{package}@{version}"], capture_output=True, timeout=600)
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"npm install {package}@{version} failed:\n{done.stderr.decode(errors='replace')[-2000:]}")
    try:
        staging.rename(prefix)
    except OSError:  # another run installed it meanwhile
        shutil.rmtree(staging, ignore_errors=True)
    return executable
