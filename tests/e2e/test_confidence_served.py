"""Steps judged by the draft's confidence change only how many drafts a step verifies, never the answer: greedy
output of duo-target and duo-draft as real processes, the adaptive policy on, is the target's alone."""

from __future__ import annotations

import pytest

from helpers.duo_runs import PROMPTS
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import generate, start, wait_for_draft

N_TOKENS = 48


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def adaptive_duo(tiny_target, tiny_draft, log_dir):
    """The adaptive policy (no --draft-max): the draft's confidences judge each step's drafts."""
    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address], log_dir)
    wait_for_draft(target.address)
    yield target
    target.stop()
    draft.stop()


def test_greedy_output_under_confidence_judged_steps_is_the_targets_alone(adaptive_duo, target_model):
    received = 0
    for _ in range(2):  # the second round judges by what the first taught the calibration
        for prompt in PROMPTS:
            tokens, last = generate(adaptive_duo.address, prompt, max_tokens=N_TOKENS)
            assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, N_TOKENS), prompt
            received += last.stats.draft_tokens_received
    assert received > 0  # the draft took part
