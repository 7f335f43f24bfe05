"""Progress display for model pulls: tqdm bars on stderr, and byte counts in human units."""

from __future__ import annotations

import contextlib
import shutil
import sys
from dataclasses import dataclass
from typing import Callable, Iterator


def human_size(n: int | None) -> str:
    """``n`` bytes in binary units ("512 B", "1.50 GiB"); "?" when unknown."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    return f"{size:.2f} TiB"


def _tqdm(desc: str, total: int | None, leave: bool):
    from tqdm import tqdm  # imported only when a bar is drawn

    # shutil falls back to 80x24 where the terminal reports no size (tqdm
    # would draw nothing at all there)
    cols, rows = shutil.get_terminal_size((80, 24))
    return tqdm(
        desc=desc,
        total=total,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        ncols=min(cols, 120),
        nrows=rows,
        leave=leave,
    )


class DownloadBar:
    """One bar per model, counting downloaded archive bytes.  The total is
    exact for archives whose size is known and estimated (mean of the known)
    for the rest, so it settles as the download goes on.  When not enabled it
    draws nothing."""

    def __init__(self, name: str, narchives: int, enabled: bool) -> None:
        self.sizes: list[int | None] = [None] * narchives
        self.done = 0  # bytes of the archives finished so far
        self.bar = _tqdm(name, None, leave=True) if enabled and narchives else None

    def archive(self, i: int) -> ArchiveProgress:
        """What the download of archive ``i`` (the next one) reports to."""
        return ArchiveProgress(self, i, self.done)

    def archive_done(self, i: int, size: int) -> None:
        self.size(i, size)
        self.done += size
        self.set(self.done)

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


@dataclass
class ArchiveProgress:
    """One archive's view of its model's ``DownloadBar`` (see ``index.Progress``)."""

    whole: DownloadBar
    index: int
    base: int  # bytes of the archives before this one

    def size(self, total: int | None) -> None:
        self.whole.size(self.index, total)

    def at(self, have: int) -> None:
        self.whole.set(self.base + have)

    def add(self, n: int) -> None:
        self.whole.add(n)


@contextlib.contextmanager
def assembly_bar(name: str, total: int | None, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A bar for assembling the model ``name``, removed when done; yields the
    function to call with the length of each chunk written."""
    if not enabled:
        yield lambda n: None
        return
    bar = _tqdm(f"{name} (assembling)", total, leave=False)
    try:
        yield bar.update
    finally:
        bar.close()
