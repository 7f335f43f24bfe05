"""`scripts/bench.py ARGS` is `duo bench ARGS` (duo/bench/run.py), run on this checkout's duo."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from duo.bench.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
