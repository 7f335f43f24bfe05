"""Free drafts from the context (duo.lookup): what they propose, that verifying them is lossless (greedy
equal to the target alone, sampled output target-distributed with lookup tokens in the chain), that their acceptance
is learnt apart from the draft model's, and that their memory is bounded by the context."""

from __future__ import annotations

import asyncio

import numpy as np

from duo.lookup import MAX_N, MIN_N, ContextLookup
from duo.llama.worker import ModelWorker
from duo.sampling.distributions import SparseDist, distribution
from duo.sampling.ops.penalties import Penalties
from duo.sampling.params import SamplingParams
from duo.sampling.verification import verify_stochastic
from duo.target.target import Target
from duo.target.policy import AdaptivePolicy, choose_together
from duo.target.request import Request, SpecSettings
from duo.target.switch import Switch
from helpers.generation import generated
from helpers.greedy import leaves_greedy_path_only_at_a_near_tie
from helpers.lookup import catch_ups, dense
from helpers.stats import ALPHA, P_TARGET, chi_square_pvalue, first_token_trials, probs_to_logits


def test_the_longest_earlier_n_gram_ending_the_text_proposes_what_followed_it():
    tokens = [1, 2, 3, 4, 5, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    lookup = ContextLookup(tokens)
    # [1, 2, 3] occurred at 0..2, followed by 4 5 9; [2, 3] alone last occurred before 7 8: the longer match wins.
    assert lookup.propose([], 3) == [4, 5, 9]
    assert lookup.propose([7], 2) == [8, 1]  # drafts extend the text looked up: [3, 7] was followed by 8 1
    assert lookup.propose([6, 6], 4) == []   # nothing ends like [6, 6]
    tokens += [4]  # the index follows the committed tokens as they grow
    assert lookup.propose([], 2) == [5, 9]


def test_the_most_recent_occurrence_wins_and_the_index_is_bounded_by_the_context():
    tokens = [5, 6, 1, 5, 6, 2, 5, 6]
    assert ContextLookup(tokens).propose([], 1) == [2]
    long = list(np.random.default_rng(0).integers(0, 50, 5000))
    lookup = ContextLookup(long)
    lookup.propose([], 4)
    assert len(lookup.index) <= (MAX_N - MIN_N + 1) * len(long)


def test_a_long_prompt_indexed_off_the_event_loop_leaves_its_first_proposal_nothing_to_index(monkeypatch):
    tokens = np.random.default_rng(1).integers(0, 1000, 100_000).tolist()
    lookup = ContextLookup(tokens)
    seen = catch_ups(monkeypatch)

    async def index_while_the_loop_serves() -> int:
        turns = 0

        async def serve() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        serving = asyncio.create_task(serve())
        await lookup.index_off_loop()
        serving.cancel()
        return turns

    assert asyncio.run(index_while_the_loop_serves()) > 1  # the loop went on serving its other tasks meanwhile
    assert seen == [(False, len(tokens))] and lookup.indexed == len(tokens)
    assert lookup.propose([], 8) == ContextLookup(list(tokens)).propose([], 8)  # as if indexed at the proposal
    assert seen[1] == (True, 0)


def test_the_target_indexes_a_prompt_off_the_event_loop_and_each_step_only_what_it_committed(target_model, monkeypatch):
    prompt = target_model.tokenize("def area(r):\n    return 3.14 * r * r\n\n" * 60, add_special=False)
    seen = catch_ups(monkeypatch)
    settings = SpecSettings()
    generated(Target(target_model, ModelWorker(), None, n_ctx=2048, settings=settings),
              Request(prompt, SamplingParams(), max_tokens=16))
    assert [n for on_loop, n in seen if not on_loop] == [len(prompt)]
    on_loop = [n for on_loop, n in seen if on_loop]
    assert on_loop and max(on_loop) <= settings.draft_max + 1  # a step commits at most its drafts and one more


def test_a_lookup_token_is_a_draft_with_q_one_and_verification_keeps_the_targets_distribution():
    row = probs_to_logits(P_TARGET)
    for token in (0, 5):  # a likely and an unlikely proposal
        counts, accepted = first_token_trials(verify_stochastic, row, SparseDist([token], [1.0]),
                                              SamplingParams(temperature=1.0))
        assert chi_square_pvalue(counts, np.array(P_TARGET)) > ALPHA
        assert abs(accepted / counts.sum() - P_TARGET[token]) < 0.02  # accepted with probability p(x)


def test_greedy_output_of_the_target_alone_with_lookup_is_its_own_and_takes_lookup_drafts(target_model):
    # A prompt that repeats itself, as an edit repeats the code it changes.
    prompt = target_model.tokenize("def area(r):\n    return 3.14 * r * r\n\n# the same, renamed\ndef area(",
                                   add_special=False)
    target = Target(target_model, ModelWorker(), None, n_ctx=512, settings=SpecSettings())
    tokens, stats = generated(target, Request(prompt, SamplingParams(), max_tokens=48))
    assert leaves_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 48)
    assert stats.lookup_tokens_verified > 0 and 0 < stats.lookup_tokens_accepted <= stats.lookup_tokens_verified
    assert stats.draft_tokens_accepted >= stats.lookup_tokens_accepted
    plain = Target(target_model, ModelWorker(), None, n_ctx=512, settings=SpecSettings(lookup=False))
    _, plain_stats = generated(plain, Request(prompt, SamplingParams(), max_tokens=48))
    assert plain_stats.lookup_tokens_verified == plain_stats.draft_tokens_verified == 0


def test_lookup_acceptance_is_learnt_apart_from_the_models_and_pays_while_the_draft_rests():
    policy = AdaptivePolicy(8)
    model_before = [rate.value for rate in policy.acceptance.rates]
    policy.free_from = 2  # two chain drafts, then free ones
    policy.observe_acceptance(6, 6)  # all accepted
    reached = policy.free.rates[0].weight
    policy.observe_acceptance(6, 1)  # the chain's second rejected: the free ones were never reached
    assert policy.free.rates[0].value > model_before[0] and policy.free.rates[0].weight == reached
    assert policy.acceptance.rates[1].value < policy.acceptance.rates[0].value
    assert policy.acceptance.rates[2].value == model_before[2]  # the free drafts' positions are not the model's
    resting = AdaptivePolicy(8, switch=Switch(speculating=False))
    for _ in range(20):  # a lookup that is always right
        resting.free_from = 0
        resting.observe_acceptance(8, 8)
    resting.free_from = 0
    assert choose_together([resting], [8], resting.costs)[0] > 0  # verified though the draft rests
    resting.free_from = None  # a model chain only: resting verifies none of it
    assert choose_together([resting], [8], resting.costs)[0] == 0


def test_sampled_output_with_lookup_tokens_in_the_chain_is_the_targets_distribution(target_model):
    # The target alone with its lookup, every free draft verified (fixed k), sampled and residual-verified: the
    # first token must follow p(. | prompt) and, where it is the lookup's first token, the second p(. | prompt + it),
    # which the lookup's second draft (q = 1) meets first. A logit_bias makes the guesses likely (the tiny model's
    # weights are random), so that both are accepted often and rejected often.
    text = "def area(r):\n    return 3.14 * r * r\n\n# the same, renamed\ndef area(r):\n    return"
    prompt = target_model.tokenize(text, add_special=False)
    params = SamplingParams(temperature=1.0, top_k=8)
    guesses = ContextLookup(list(prompt)).propose([], 2)
    context = target_model.new_context(256)
    rows = [context.decode(prompt, 0)[-1], context.decode(guesses[:1], len(prompt))[-1]]
    context.close()
    # Each guess's logit raised to half a logit below its row's best: likely, never certain.
    penalties = Penalties(bias=tuple((token, float(row.max() - row[token] - 0.5)) for token, row in zip(guesses, rows)))
    p_first, p_second = (dense(distribution(penalties.apply(row.copy(), []), params), target_model.n_vocab)
                         for row in rows)
    target = Target(target_model, ModelWorker(), None, n_ctx=256, settings=SpecSettings(adaptive=False, draft_max=4))

    async def trials(n: int):
        firsts, seconds, verified = [], [], 0
        for _ in range(n):
            tokens = []
            async for step, stats in target.generate(Request(prompt, params, max_tokens=2, penalties=penalties)):
                tokens += step.tokens
            firsts.append(tokens[0])
            if tokens[0] == guesses[0]:
                seconds.append(tokens[1])
            verified += stats.lookup_tokens_verified
        return firsts, seconds, verified

    firsts, seconds, verified = asyncio.run(trials(800))
    assert verified >= 800  # the lookup's tokens were in every chain
    assert chi_square_pvalue(np.bincount(firsts, minlength=target_model.n_vocab), p_first) > ALPHA
    assert 0.1 < len(seconds) / len(firsts) < 0.9  # the first guess both accepted and rejected, often
    assert chi_square_pvalue(np.bincount(seconds, minlength=target_model.n_vocab), p_second) > ALPHA


