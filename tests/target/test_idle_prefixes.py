"""The target parks idle requests' prefixes in host memory while others run (duo.llama.parking, --cache-ram), and
a conversation's next turn finds its prefix there: read by no one else's tokens meanwhile, reused whole after."""

from __future__ import annotations

import asyncio

from duo.llama.worker import ModelWorker
from duo.sampling.params import SamplingParams
from duo.target.request import Request, SpecSettings
from duo.target.target import Target
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.prompts import SYSTEM

FIRST = SYSTEM + [7985, 264, 1140]
SECOND = [1986, 374, 264, 1273, 315] * 6
NEXT_TURN = [151645, 198, 151644, 872, 198, 3838]


def greedy(prompt: list[int], max_tokens: int = 16, cache_prompt: bool = True) -> Request:
    return Request(prompt, SamplingParams(), max_tokens=max_tokens, cache_prompt=cache_prompt)


async def answer(target: Target, request: Request) -> tuple[list[int], int, list[list[int]]]:
    """The request's tokens, its cached prompt tokens, and what every sequence held at its first step."""
    tokens, held, stats = [], [], None
    async for step, stats in target.generate(request):
        if not tokens:
            context = (await target.batcher()).context
            held = [list(context.held(seq)) for seq in range(context.n_seq)]
        tokens.extend(step.tokens)
    return tokens, stats.cached_prompt_tokens, held


def conversation(target: Target, second_private: bool = False):
    """FIRST, then SECOND (another conversation), then FIRST's next turn; each one's answer."""
    async def turns():
        try:
            one = await answer(target, greedy(FIRST))
            two = await answer(target, greedy(SECOND, cache_prompt=not second_private))
            follow_up = FIRST + one[0] + NEXT_TURN
            three = await answer(target, greedy(follow_up))
            parking = (await target.batcher()).parking
            return one, two, three, follow_up, parking
        finally:
            await target.close()

    return asyncio.run(turns())


def test_another_conversation_runs_with_the_idle_one_parked_and_its_next_turn_is_restored_whole(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)
    one, two, three, follow_up, parking = conversation(target)

    # While SECOND ran, the cache held its tokens alone: FIRST's (prompt and answer) waited in host memory.
    assert sorted(map(len, two[2])) == [0, len(SECOND)]
    assert parking.restored == 1 and two[1] == 0
    # Its next turn starts from all of it (the answer's last token, committed, was never decoded) and answers as a
    # fresh target does; SECOND is parked in turn.
    assert three[1] == len(FIRST) + len(one[0]) - 1
    assert [entry.tokens[:len(SECOND)] for entry in parking.entries] == [SECOND]
    for prompt, (got, _, _) in zip((FIRST, SECOND, follow_up), (one, two, three)):
        assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, got, 16)


def test_with_cache_ram_0_the_idle_prefix_stays_in_the_cache(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2, cache_ram=0)
    one, two, three, _, parking = conversation(target)
    assert parking is None
    assert sorted(map(len, two[2])) == [len(SECOND), len(FIRST) + len(one[0]) - 1]
    assert three[1] == len(FIRST) + len(one[0]) - 1


def test_a_private_requests_tokens_are_cleared_never_parked(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=2)
    _, _, _, _, parking = conversation(target, second_private=True)
    assert all(entry.tokens[:len(SECOND)] != SECOND for entry in parking.entries)


def test_with_one_sequence_another_conversation_parks_the_first_and_its_next_turn_is_restored(target_model):
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(), parallel=1)
    one, two, three, follow_up, parking = conversation(target)
    assert two[1] == 0 and three[1] == len(FIRST) + len(one[0]) - 1 and parking.restored == 1
    assert leaves_greedy_path_only_at_a_near_tie(target_model, follow_up, three[0], 16)
