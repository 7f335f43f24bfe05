"""Concurrent generations share the target's model: one batched call per step, each keeping its own output."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from duo.costs import StepCosts
from duo.llama.model import N_BATCH
from duo.llama.context import Part
from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.batching import MIN_PREFILL_CHUNK, StepBatcher
from duo.target.request import Request, SpecSettings
from duo.target.target import Target
from helpers.greedy import leaves_coupled_path_only_at_a_near_tie, leaves_greedy_path_only_at_a_near_tie
from helpers.processes import generate, start, wait_for_draft
from helpers.prompts import SYSTEM

PROMPTS = [[9707, 11, 1879], [785, 3974, 13876, 38835], [1986, 374, 264, 1273, 315], [151644, 872, 198, 14990],
           [2, 3, 5, 7, 11, 13], [40, 1079, 264], [8420, 594, 279, 3364], [1024, 2048]]


def run(target: Target, requests: list[Request]) -> list[list[int]]:
    """Run `requests` at once through `target`; each one's committed tokens."""
    async def one(request: Request) -> list[int]:
        tokens: list[int] = []
        async for step, _ in target.generate(request):
            tokens.extend(step.tokens)
        return tokens

    async def everything() -> list[list[int]]:
        try:
            return await asyncio.gather(*(one(request) for request in requests))
        finally:
            await target.close()

    return asyncio.run(everything())


class CallLog:
    """Wraps a context's decode_parts to record every call's parts."""

    def __init__(self, target: Target) -> None:
        self.calls: list[list[Part]] = []
        self.target = target

    async def attach(self) -> None:
        context = (await self.target.batcher()).context
        decode_parts = context.decode_parts

        def recording(parts):
            self.calls.append(list(parts))
            return decode_parts(parts)

        context.decode_parts = recording


def greedy(prompt: list[int], max_tokens: int = 24) -> Request:
    return Request(prompt, SamplingParams(), max_tokens=max_tokens)


def test_concurrent_generations_are_decoded_together_and_each_gets_its_own_output(target_model):
    requests = [greedy(prompt) for prompt in PROMPTS[:4]]
    alone = [run(Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings()), [request])[0]
             for request in requests]
    assert all(len(tokens) == 24 for tokens in alone)
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=4)
    log = CallLog(target)
    asyncio.run(log.attach())
    together = run(target, requests)
    for request, got, expected in zip(requests, together, alone):
        assert got == expected or leaves_greedy_path_only_at_a_near_tie(target_model, request.prompt_tokens, got, 24)
    # 4 x 24 tokens decoded alone would take 96 calls (and 4 prefills): together, about one per token.
    assert len(log.calls) <= 24 + 8
    assert max(len(parts) for parts in log.calls) == 4


def test_sampled_concurrent_generations_each_follow_their_own_seed(target_model):
    requests = [Request(prompt, SamplingParams(temperature=1.0), seed=i, max_tokens=16)
                for i, prompt in enumerate(PROMPTS[:4])]
    alone = [run(Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings()), [request])[0]
             for request in requests]
    together = run(Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=4),
                   requests)
    for request, got, expected in zip(requests, together, alone):  # batched: logits round apart (tests/helpers/greedy.py)
        assert got == expected or leaves_coupled_path_only_at_a_near_tie(target_model, request.prompt_tokens, got, 16,
                                                                         request.params, request.seed)


def test_a_long_prompt_is_prefilled_in_chunks_beside_the_running_generations(target_model):
    long_prompt = [(7 * i) % 5000 + 100 for i in range(200)]
    target = Target(target_model, ModelWorker(), None, n_ctx=512, settings=SpecSettings(), parallel=2)
    log = CallLog(target)
    asyncio.run(log.attach())
    # Measured costs that make a call of n tokens cost 1 + 0.5 (n - 1) steps: a chunk of 16 beside a
    # step of 1 token costs 8.5 steps alone, more than PREFILL_STALL allows, so chunks stay at the minimum.
    batcher = asyncio.run(target.batcher())
    for n in (1, 2, 8, 64, 256):
        batcher.call_costs.observe(n, 0.01 * (1 + 0.5 * (n - 1)))

    async def both() -> tuple[list[int], list[int]]:
        running: list[int] = []
        started = asyncio.Event()

        async def first() -> None:
            async for step, _ in target.generate(greedy(PROMPTS[0], 40)):
                running.extend(step.tokens)
                started.set()

        async def second() -> list[int]:
            await started.wait()
            return [token async for step, _ in target.generate(greedy(long_prompt, 4)) for token in step.tokens]

        try:
            _, tokens = await asyncio.gather(first(), second())
        finally:
            await target.close()
        return running, tokens

    running, late = asyncio.run(both())
    with_prompt = [call for call in log.calls if any(part.seq == 1 and len(part.tokens) > 1 for part in call)]
    assert len(with_prompt) >= 199 // MIN_PREFILL_CHUNK  # the prompt went in chunks, not in one call
    assert all(len(call) == 2 for call in with_prompt[:-1])  # each beside the running generation's step
    assert leaves_greedy_path_only_at_a_near_tie(target_model, long_prompt, late, 4)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[0], running, 40)
    # The verify cost table, which the policy reads, learnt nothing from the calls that carried prompt chunks.
    assert max(target.control.costs.step_seconds) < MIN_PREFILL_CHUNK


def test_sequences_are_reused_by_later_generations(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=128, settings=SpecSettings(), parallel=2)
    expected = run(Target(target_model, ModelWorker(), None, n_ctx=128, settings=SpecSettings()), [greedy(PROMPTS[5])])

    async def in_turns() -> list[list[int]]:
        outputs = []
        for _ in range(5):  # more generations than sequences, each starting where another ended
            outputs.append([t async for step, _ in target.generate(greedy(PROMPTS[5])) for t in step.tokens])
        await target.close()
        return outputs

    for got in asyncio.run(in_turns()):  # each from cells another left: they may round apart (tests/helpers/greedy.py)
        assert got == expected[0] or leaves_greedy_path_only_at_a_near_tie(target_model, PROMPTS[5], got, 24)


def stream(target: Target, request: Request, started: asyncio.Event | None = None) -> "asyncio.Future":
    """Run `request` on `target` in a task: (its tokens, its final stats); set `started` at its first token."""
    async def one():
        tokens, stats = [], None
        async for step, stats in target.generate(request):
            tokens.extend(step.tokens)
            if started is not None:
                started.set()
        return tokens, stats

    return asyncio.ensure_future(one())


def test_later_requests_decode_only_what_follows_the_prefix_a_sequence_holds(target_model):
    """A shared system turn, then a conversation's next turn: each reuses the cache, and answers as afresh."""
    first, second = SYSTEM + [7985, 264, 1140], SYSTEM + [29016, 279, 914, 11]
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)
    log = CallLog(target)
    asyncio.run(log.attach())

    async def in_turns():
        try:
            one, stats_one = await stream(target, greedy(first))
            two, stats_two = await stream(target, greedy(second))
            follow_up = first + one + [151645, 198, 151644, 872, 198, 3838]
            three, stats_three = await stream(target, greedy(follow_up))
            return (one, two, three), (stats_one, stats_two, stats_three), follow_up
        finally:
            await target.close()

    outputs, stats, follow_up = asyncio.run(in_turns())
    # The first decodes its whole prompt (the last token in its first step's rows); the second
    # only its user turn; the follow-up finds the first request's prompt and answer (but the answer's
    # last token, committed and never decoded) on the sequence the first one left.
    assert [s.cached_prompt_tokens for s in stats] == [0, len(SYSTEM), len(first) + len(outputs[0]) - 1]
    # Prompt tokens: a prefill part's, and those a first step reads before its own rows (VerifyWork.prompt_tail).
    prompt_tokens = [sum(len(part.tokens) if not part.logits_for else part.logits_for[0] for part in call)
                     for call in log.calls]
    assert sum(prompt_tokens) == (len(first) - 1) + (len(second) - 1 - len(SYSTEM)) + (len(follow_up) - len(first) - len(outputs[0]))
    for prompt, got in zip((first, second, follow_up), outputs):
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, got, 24)


def test_a_request_arriving_while_another_runs_starts_from_that_ones_prefix_and_neither_is_disturbed(target_model):
    first, second = SYSTEM + [7985, 264, 1140], SYSTEM + [29016, 279, 914, 11]
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)

    async def overlapping():
        started = asyncio.Event()
        try:
            running = stream(target, greedy(first, 40), started)
            await started.wait()
            late = await stream(target, greedy(second))
            return await running, late
        finally:
            await target.close()

    (one, stats_one), (two, stats_two) = asyncio.run(overlapping())
    assert stats_two.cached_prompt_tokens == len(SYSTEM)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, first, one, 40)
    assert leaves_greedy_path_only_at_a_near_tie(target_model, second, two, 24)


@pytest.fixture(scope="module")
def served(tiny_target, tiny_draft, tmp_path_factory):
    """A draft and a target running 8 generations at once, and a target alone."""
    logs = tmp_path_factory.mktemp("logs")
    draft = start("duo.cli.draft", ["--model", str(tiny_draft)], logs)
    target = start("duo.cli.target", ["--model", str(tiny_target), "--peer", draft.address, "--draft-max", "4",
                                          "--parallel", "8"], logs, http=True)
    alone = start("duo.cli.target", ["--model", str(tiny_target)], logs)
    wait_for_draft(target.address)
    yield target, alone
    for process in (target, alone, draft):
        process.stop()


TEXT_PROMPTS = ["def fibonacci(n):", "Once upon a time", "import numpy as np\n", "The capital of France is",
                "for i in range(10):", "SELECT * FROM", "<|im_start|>user\nhello<|im_end|>\n", "1, 2, 3, 4,"]


def test_eight_concurrent_streams_through_duo_each_equal_the_target_alone(served, target_model):
    target, alone = served
    expected = [generate(alone.address, prompt, max_tokens=40)[0] for prompt in TEXT_PROMPTS]
    results: list[list[int]] = [[] for _ in TEXT_PROMPTS]

    def work(i: int) -> None:
        results[i], _ = generate(target.address, TEXT_PROMPTS[i], max_tokens=40)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(TEXT_PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt, got, alone_tokens in zip(TEXT_PROMPTS, results, expected):
        assert got == alone_tokens or leaves_greedy_path_only_at_a_near_tie(target_model, prompt, got, 40), prompt
    metrics = httpx.get(f"{target.http_url}/metrics").text
    count = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("duo:iteration_requests_count")))
    total = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith("duo:iteration_requests_sum")))
    assert total / count > 1.5, "the streams' steps were not decoded together"


def test_the_shared_context_times_decoding_alone_for_the_switch_and_leaves_its_first_sequence_empty(target_model):
    """The switch's first reference for one request, so that the first request needs no measuring rest."""
    async def run_it() -> tuple[dict[int, float], int]:
        target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)
        batcher = await target.batcher()
        try:
            return dict(target.control.switch.rest_rates), len(batcher.context.held(0))
        finally:
            await target.close()

    rates, held = asyncio.run(run_it())
    assert list(rates) == [1] and rates[1] > 0 and held == 0


class RolledBackWhileRead(list):
    """A free sequence's tokens that the model thread rolls back (a request that left during a call) just after
    join() first reads some of them by position."""

    def __init__(self, tokens: list[int], keep: int) -> None:
        super().__init__(tokens)
        self.keep = keep
        self.rolled_back = False

    def __getitem__(self, index):
        got = super().__getitem__(index)
        if not self.rolled_back:
            self.rolled_back = True
            del self[self.keep:]
        return got


class HeldOnly:
    """A context as join() sees it: its sequences' tokens."""

    def __init__(self, held: list[list[int]]) -> None:
        self.n_seq = len(held)
        self._held = held

    def held(self, seq: int) -> list[int]:
        return self._held[seq]


def test_joining_while_the_model_thread_rolls_a_free_sequence_back_picks_by_what_it_held():
    prompt = list(range(1, 11))
    # Sequence 0 shares 5 tokens with the prompt, then differs; it loses its tail to a rollback midway through join's
    # reading. Sequence 1 holds a few tokens of another conversation.
    rolling = RolledBackWhileRead(prompt[:5] + [99] * 5, keep=3)
    batcher = StepBatcher(ModelWorker(), HeldOnly([rolling, [50, 51, 52, 53]]), StepCosts())
    assert batcher.join(prompt) == 1  # it would lose 4 tokens of sequence 1, 5 of sequence 0 as it was


def test_a_request_reads_its_prompts_end_and_draws_its_first_token_in_one_call(target_model):
    """No call of its own for the first token after the prompt (a whole T(1) more before it, as llama-server
    does not); a long prompt is read as llama-server reads it, n_batch tokens a call, and only what is left over
    whole chunks rides with the first token."""
    target = Target(target_model, ModelWorker(), None, n_ctx=2048, settings=SpecSettings(lookup=False))
    log = CallLog(target)
    asyncio.run(log.attach())
    short = SYSTEM + [7985, 264, 1140]
    long = (SYSTEM + [7985, 264, 1140] * 500)[:1200]

    async def both():
        try:
            return await stream(target, greedy(short, 8)), await stream(target, greedy(long, 8))
        finally:
            await target.close()

    (short_out, short_stats), (long_out, _) = asyncio.run(both())
    [first] = log.calls[0]
    assert list(first.tokens) == short and list(first.logits_for) == [len(short) - 1]
    assert short_stats.batch_sizes[len(short):] == []  # its first step counts its own row, not the prompt's
    long_calls = [call[0] for call in log.calls[1:] if any(len(part.tokens) > 1 for part in call)]
    *chunks, end = long_calls
    assert len(chunks) == 2 and all(not chunk.logits_for and len(chunk.tokens) == N_BATCH for chunk in chunks)
    # (from what the short one's sequence holds: the shared prefix is not read again)
    assert end.logits_for and chunks[0].pos + 2 * N_BATCH + len(end.tokens) == len(long)
    for prompt, got in ((short, short_out), (long, long_out)):
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, got, 8)
