"""scripts/measure_contention.py on the tiny pair: the target's verify curve timed with the draft's core idle and
again with the draft decoding there all along, and their ratio per batch size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from measure_contention import contention  # noqa: E402


def test_the_ratio_is_the_busy_step_over_the_idle_one_per_batch_size():
    assert contention({1: 0.2, 4: 0.25}, {1: 0.22, 4: 0.3}) == {1: 0.22 / 0.2, 4: 0.3 / 0.25}


def test_the_script_times_both_curves_while_the_draft_really_drafts(tiny_target, tiny_draft, tmp_path):
    out = tmp_path / "contention.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "measure_contention.py"), "--target", str(tiny_target),
                    "--draft", str(tiny_draft), "--target-core", "0", "--draft-core", "0", "--max-batch", "3",
                    "--reps", "3", "--json", str(out)], check=True, timeout=600, capture_output=True)
    result = json.loads(out.read_text())
    assert set(result["idle_s"]) == set(result["busy_s"]) == set(result["busy_over_idle"]) == {"1", "2", "3"}
    assert all(seconds > 0 for seconds in (*result["idle_s"].values(), *result["busy_s"].values()))
    for n, ratio in result["busy_over_idle"].items():
        assert abs(ratio - result["busy_s"][n] / result["idle_s"][n]) < 1e-9
    assert result["draft_tokens"] > 0 and result["draft_token_s"] > 0  # the draft decoded meanwhile
    assert result["commit"] and result["cpu"]
