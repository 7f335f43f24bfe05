"""The draft sends, with each token it drafts, its confidence: the draft model's probability of the token at
temperature 1, from one max and one exp pass over the row, the row left as it was."""

import asyncio

import numpy as np
import pytest

from duo.draft.confidence import softmax_scale
from duo.draft.drafter import Drafter
from duo.llama.worker import ModelWorker
from duo.net._proto import duo_pb2 as pb
from helpers.drafting import draft_until_idle

PROMPT = [9707, 11, 1879]


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - np.max(logits))
    return shifted / shifted.sum()


@pytest.mark.parametrize("spread", [0.5, 3.0, 20.0], ids=["flat", "typical", "peaked"])
def test_the_scale_gives_each_tokens_softmax_probability_and_leaves_the_row_unchanged(spread):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(151_936) * spread).astype(np.float32)
    logits[rng.integers(0, logits.size, 1000)] = -np.inf  # a grammar's mask weighs nothing
    row, scratch = logits.copy(), np.empty_like(logits)
    scale = softmax_scale(row, scratch)
    expected = softmax(logits)
    for token in [int(np.argmax(logits)), *rng.integers(0, logits.size, 20)]:
        assert scale.probability(row, token) == pytest.approx(expected[token], rel=1e-5, abs=1e-12)
    assert scale.top_probability == pytest.approx(expected.max(), rel=1e-5)
    assert np.array_equal(row, logits)


def drafted_chunks(draft_model, sampling: pb.SamplingParams, max_branches: int = 0) -> list[pb.DraftChunk]:
    async def run() -> list[pb.DraftChunk]:
        drafter = Drafter(draft_model, ModelWorker(), n_ctx=256, top_k_cap=10, max_branches=max_branches,
                          branch_len=2)
        session = await drafter.open(pb.OpenSession(session_id=1, committed=PROMPT, max_ahead=6, sampling=sampling))
        chunks, _ = await draft_until_idle(drafter, [session])
        await drafter.close(session)
        await drafter.stop()
        return chunks[1]

    return asyncio.run(run())


def draft_probability(draft_model, tokens: list[int], token: int) -> float:
    """The draft model's probability of `token` after `tokens`, from a fresh decode (softmax at temperature 1)."""
    context = draft_model.new_context(256)
    try:
        return float(softmax(context.decode(tokens, 0)[-1])[token])
    finally:
        context.close()


@pytest.mark.parametrize("sampling", [pb.SamplingParams(temperature=0.0), pb.SamplingParams(temperature=0.7, seed=3)],
                         ids=["greedy", "sampled at 0.7"])
def test_each_chain_token_carries_the_draft_models_probability_of_it(draft_model, sampling):
    chain = [chunk for chunk in drafted_chunks(draft_model, sampling) if chunk.epoch == 0]
    tokens = [token for chunk in chain for token in chunk.tokens]
    confidences = [confidence for chunk in chain for confidence in chunk.confidence]
    assert len(tokens) >= 4 and len(confidences) == len(tokens)
    for i, (token, confidence) in enumerate(zip(tokens, confidences)):
        # A batched decode rounds otherwise than a fresh one: a near-tie's tolerance.
        assert confidence == pytest.approx(draft_probability(draft_model, PROMPT + tokens[:i], token), abs=2e-3)


def test_a_branch_sends_a_confidence_per_token_its_assumed_one_included(draft_model):
    chunks = drafted_chunks(draft_model, pb.SamplingParams(temperature=0.0), max_branches=1)
    branch = [chunk for chunk in chunks if chunk.epoch != 0]
    assert branch and all(len(chunk.confidence) == len(chunk.tokens) for chunk in chunks)
    opening = branch[0]
    chain = [token for chunk in chunks if chunk.epoch == 0 for token in chunk.tokens]
    prefix = PROMPT + chain[:opening.start - len(PROMPT)] + [opening.tokens[0]]
    assert opening.confidence[1] == pytest.approx(draft_probability(draft_model, prefix, opening.tokens[1]), abs=2e-3)
