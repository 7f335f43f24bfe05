"""scripts/measure_shared_reads.py on the tiny target: two prompts sharing a prefix, a moment apart; one finds the
shared prefix the other read (followed while it was read, or cached after)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_times_two_prompts_sharing_a_prefix_and_the_second_finds_it(tiny_target, tmp_path):
    out = tmp_path / "shared.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "measure_shared_reads.py"), "--model", str(tiny_target),
                    "--shared", "1200", "--own", "100", "--stagger", "0.2", "--settle", "0", "--core", "0",
                    "--servers", "duo", "--logs", str(tmp_path), "--json", str(out)],
                   check=True, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    [row] = result["rows"]
    # One read the shared part, the other found it (on a loaded core the later-sent one may be read first).
    assert row["server"] == "duo" and min(row["first_cached"], row["second_cached"]) == 0
    assert max(row["first_cached"], row["second_cached"]) >= 1024
    assert 0 < row["first_s"] <= row["both_s"] and 0 < row["second_s"] <= row["both_s"]
    assert result["shared"] == 1200 and result["commit"]
