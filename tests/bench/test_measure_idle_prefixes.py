"""scripts/measure_idle_prefixes.py on the tiny target: each server's reads, and the idle conversation's next turn
found whole in its cache (restored from host memory where parked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_reads_a_prompt_beside_an_idle_one_and_the_idle_ones_next_turn_is_cached(tiny_target, tmp_path):
    out = tmp_path / "idle.json"
    ran = subprocess.run([sys.executable, str(ROOT / "scripts" / "measure_idle_prefixes.py"), "--model",
                          str(tiny_target), "--first", "600", "--second", "200", "--decode", "4", "--settle", "0",
                          "--core", "0", "--servers", "duo", "duo-cache-ram-0", "--logs", str(tmp_path), "--json",
                          str(out)], timeout=600, capture_output=True, text=True)
    logs = "".join(f"\n--- {log.name} ---\n{log.read_text()[-3000:]}" for log in sorted(tmp_path.glob("*.log")))
    assert ran.returncode == 0, f"{ran.stderr[-3000:]}{logs}"
    result = json.loads(out.read_text())
    assert [row["server"] for row in result["rows"]] == ["duo", "duo-cache-ram-0"]
    for row in result["rows"]:
        assert row["a_next_cached"] == 600 and row["b_read_s"] > 0 and row["b_decode_tok_s"] > 0
    assert result["first"] == 600 and result["commit"]
