"""duo-draft and duo-target as two real processes on localhost, with tiny generated models."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

from duo.sampling.params import SamplingParams
from helpers.duo_runs import PROMPTS, SAMPLED_PROMPT, sample_positions, stream_and_interrupt
from helpers.exact_fit import first_two_p_values
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.processes import Process, free_port, generate, start, wait_for_draft

# Tests that need the draft to take part fix its length: on tiny models verifying is barely cheaper
# than decoding, and the adaptive policy (tested on its own in test_policy.py) may rest the draft.
FIXED = ["--draft-max", "4"]
@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def alone(tiny_target, log_dir):
    process = start("duo.cli.target", ["--model", str(tiny_target)], log_dir)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def draft(tiny_draft, log_dir):
    process = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def duo(tiny_target, draft, log_dir):
    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, *FIXED], log_dir)
    wait_for_draft(process.address)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def duo_sync(tiny_target, draft, log_dir):
    """The synchronous mode waits for the draft at each step: its generations always verify drafts."""
    process = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--sync", "4"],
                    log_dir)
    wait_for_draft(process.address)
    yield process
    process.stop()


def test_greedy_output_through_duo_equals_the_target_alone(duo, duo_sync, target_model):
    accepted = 0
    for prompt in PROMPTS:
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, generate(duo.address, prompt, max_tokens=64)[0],
                                                     64), prompt
        tokens, last = generate(duo_sync.address, prompt, max_tokens=64)
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 64), prompt
        accepted += last.stats.draft_tokens_accepted
    assert accepted > 0, "the draft took no part"


def test_sampled_tokens_through_duo_follow_the_target_distribution(duo_sync, target_model):
    """Residual rejection sampling through both processes, on a target that verifies drafts at every step
    (--sync 4): the first two tokens of 400 generations fit the target's exact distribution
    (tests/helpers/exact_fit.py; test_sampling_power.py shows the same check failing realistic verifier bugs),
    and the same requests verified and accepted drafts for a good share of their tokens."""
    n = 400
    through_duo, stats = sample_positions(duo_sync.address, n, 2)
    assert len({tuple(t) for t in through_duo}) > 20, "the samples barely vary: the test would be weak"
    assert all(len(t) == 2 for t in through_duo)
    assert {s.verification for s in stats} == {"residual"}
    accepted = sum(s.draft_tokens_accepted for s in stats)
    assert sum(s.draft_tokens_verified for s in stats) > n and accepted >= 0.3 * 2 * n, accepted
    p_values = first_two_p_values(target_model, target_model.tokenize(SAMPLED_PROMPT), through_duo,
                                  SamplingParams(temperature=1.0))
    assert min(p_values) > 1e-4, p_values


def test_killing_the_draft_mid_generation_completes_the_request_with_the_same_output(
        tiny_target, tiny_draft, target_model, log_dir):
    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, *FIXED], log_dir)
    try:
        wait_for_draft(target.address)
        tokens, received_at_kill = stream_and_interrupt(target.address, PROMPTS[0], 400, draft.kill)
        assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[0], tokens, 400)
        assert received_at_kill > 0
        # The restarted draft is found again, and serves the next generation.
        restarted = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir, port=int(draft.address.split(":")[1]))
        try:
            wait_for_draft(target.address)
            tokens, last = generate(target.address, PROMPTS[1], max_tokens=400)  # long enough for a fresh draft to join
            assert last.stats.draft_tokens_received > 0
        finally:
            restarted.stop()
    finally:
        target.stop()
        draft.stop()


def test_a_restarted_draft_rejoins_a_generation_that_is_still_running(tiny_target, tiny_draft, target_model, log_dir):
    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir)
    port = int(draft.address.split(":")[1])
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, *FIXED], log_dir)
    replacement: list[Process] = []
    try:
        wait_for_draft(target.address)
        def restart() -> None:
            draft.kill()
            replacement.append(start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir, port=port))

        from duo.net._proto import duo_pb2 as pb
        from duo.net._proto import duo_pb2_grpc as pb_grpc

        request = pb.GenerateRequest(prompt=PROMPTS[2], max_tokens=1500)
        tokens, received_after_restart, restarted_at = [], 0, None
        accepted_at_restart = accepted_after_restart = 0
        with grpc.insecure_channel(target.address) as channel:
            for response in pb_grpc.TargetStub(channel).Generate(request, timeout=120):
                tokens.extend(response.token_ids)
                if restarted_at is None and response.stats.draft_tokens_received > 0 and len(tokens) > 20:
                    restart()
                    restarted_at = response.stats.draft_tokens_received
                    accepted_at_restart = response.stats.draft_tokens_accepted
                elif restarted_at is not None:
                    received_after_restart = response.stats.draft_tokens_received - restarted_at
                    accepted_after_restart = response.stats.draft_tokens_accepted - accepted_at_restart
        assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[2], tokens, 1500)
        assert received_after_restart > 0, "the restarted draft sent nothing to the running generation"
        assert accepted_after_restart > 0, "nothing the restarted draft sent was accepted: it drafted on a wrong prefix"
    finally:
        target.stop()
        draft.stop()
        for process in replacement:
            process.stop()


def test_concurrent_generations_each_get_their_own_output(duo, target_model):
    results: dict[str, list[int]] = {}

    def work(prompt: str) -> None:
        results[prompt] = generate(duo.address, prompt, max_tokens=48)[0]

    threads = [threading.Thread(target=work, args=(p,)) for p in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt in PROMPTS:  # decoded together: their logits round differently (tests/helpers/greedy.py)
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, results[prompt], 48), prompt


def test_duo_generate_prints_json_with_text_ids_and_stats(duo, target_model):
    completed = subprocess.run(
        [sys.executable, "-m", "duo.cli.main", "generate", "--endpoint", duo.address, "--prompt", PROMPTS[0],
         "--max-tokens", "16", "--json"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    result = json.loads(completed.stdout)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[0], result["token_ids"], 16)
    assert isinstance(result["text"], str) and result["text"]
    for key in ("generated_tokens", "draft_tokens_received", "draft_tokens_accepted", "verify_steps",
                "tokens_per_second"):
        assert key in result["stats"]
    assert result["stats"]["generated_tokens"] == len(result["token_ids"]) == 16


def test_a_bad_request_gets_invalid_argument_and_the_server_keeps_serving(alone):
    with pytest.raises(grpc.RpcError) as error:
        generate(alone.address, "hello", temperature=5.0)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in error.value.details()
    tokens, _ = generate(alone.address, "hello", max_tokens=4)
    assert len(tokens) == 4


def test_the_target_decodes_alone_while_no_draft_is_listening_says_why_and_speculates_once_it_starts(
        tiny_target, tiny_draft, target_model, log_dir):
    peer_port = free_port()
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", f"127.0.0.1:{peer_port}"], log_dir)
    draft = None
    try:
        tokens, last = generate(target.address, PROMPTS[1], max_tokens=32)
        assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[1], tokens, 32)
        assert not last.stats.draft_connected
        unreachable = [line for line in target.log().splitlines() if "cannot reach draft" in line]
        assert len(unreachable) == 1  # said once, with the likely cause; again only after a minute
        assert f"127.0.0.1:{peer_port}" in unreachable[0] and "--listen 0.0.0.0:PORT" in unreachable[0]
        # One line per finished request, as llama-server prints its timings.
        done = [line for line in target.log().splitlines() if "request done (length): 32 tokens at" in line]
        assert len(done) == 1 and "first token after" in done[0]
        # No draft model's drafts: none, or only the context lookup's.
        assert "no drafts verified" in done[0] or re.search(r"accepted (\d+)/(\d+) drafts \(\1/\2 from the context[,)]",
                                                            done[0]), done[0]
        draft = start("duo.cli.draft", ["--model", str(tiny_draft)], log_dir, port=peer_port)
        wait_for_draft(target.address)
        assert "connected (model " in target.log()
        assert "only a target on this machine can reach it" in draft.log()  # it listens on loopback
    finally:
        target.stop()
        if draft is not None:
            draft.stop()


def test_greedy_output_with_the_adaptive_policy_equals_the_target_alone(tiny_target, draft, target_model, log_dir):
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address], log_dir)
    try:
        wait_for_draft(target.address)
        for prompt in PROMPTS:
            tokens = generate(target.address, prompt, max_tokens=96)[0]
            assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 96), prompt
    finally:
        target.stop()


def test_duo_generate_says_when_no_target_answers_instead_of_waiting():
    began = time.monotonic()
    completed = subprocess.run(
        [sys.executable, "-m", "duo.cli.main", "generate", "--endpoint", f"127.0.0.1:{free_port()}", "--prompt", "hi",
         "--connect-timeout", "1"], capture_output=True, text=True, timeout=60)
    assert completed.returncode == 1
    assert "cannot reach duo-target" in completed.stderr
    assert time.monotonic() - began < 30


def test_a_speculating_generation_runs_to_the_end_of_its_context_and_stops_there(tiny_target, draft, target_model,
                                                                                 log_dir):
    """Verify batches near the context's end are cut to what it has left: the generation fills the context
    exactly (drafts verified to the last step), ends with "length", and the target serves on."""
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--sync", "4",
                                          "--ctx-size", "64"], log_dir)
    try:
        wait_for_draft(target.address)
        prompt_tokens = len(target_model.tokenize(PROMPTS[0]))
        for _ in range(2):
            tokens, last = generate(target.address, PROMPTS[0], max_tokens=500)
            assert len(tokens) == 64 - prompt_tokens and last.finish_reason == "length"
            assert last.stats.draft_tokens_accepted > 0
            assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[0], tokens, len(tokens))
    finally:
        target.stop()


def test_a_port_in_use_is_one_clear_line_for_each_listener_not_a_shared_port(tiny_target, tiny_draft, draft):
    for module, model in (("duo.cli.draft", tiny_draft), ("duo.cli.target", tiny_target)):
        second = subprocess.run([sys.executable, "-m", module, "--model", str(model), "--listen", draft.address,
                                 "--threads", "1"], capture_output=True, text=True, timeout=120)
        assert second.returncode != 0, f"{module} shared the port of a running duo-draft"
        assert f"cannot listen on {draft.address}: the address is in use" in second.stderr
        assert "Traceback" not in second.stderr


def test_both_processes_serve_metrics_and_a_draft_stopped_with_sigterm_says_so_without_a_traceback(
        tiny_target, tiny_draft, log_dir):
    import httpx

    draft = start("duo.cli.draft", ["--model", str(tiny_draft), "--metrics", str(free_port())], log_dir)
    metrics_port = free_port()
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, *FIXED,
                                          "--metrics", f"127.0.0.1:{metrics_port}"], log_dir)
    try:
        wait_for_draft(target.address)
        generate(target.address, PROMPTS[0], max_tokens=8)
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
        assert "duo:spec_decode_num_draft_tokens_total" in text and "duo:spec_decode_on" in text
        draft.stop()  # SIGTERM, with the target's stream open
        log = draft.log()
        assert "stream closed as duo-draft stops; closed" in log  # ended from its side, its sessions freed
        assert " ERROR " not in log and "Traceback" not in log
    finally:
        target.stop()
        draft.stop()
