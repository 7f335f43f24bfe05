"""Constrained decoding under speculation (duo.constraint): the target masks every row it verifies with the
grammar after the drafts before it, so greedy output is the target's own under the grammar and sampled output
follows the masked target distribution exactly; drafts the grammar forbids are cut before they cost a row."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from duo.constraint import Cursor, GrammarError, grammar_of
from duo.draft.batch import Work, draw_step
from duo.draft.branches import doubt_of
from duo.draft.session import DraftSession, Slot
from duo.llama.context import Part
from duo.llama.worker import ModelWorker
from duo.sampling.coupled import coupled_ranking
from duo.sampling.distributions import distribution
from duo.sampling.params import SamplingParams
from duo.target.batching import VerifyWork, _decode_and_verify, _Planned
from duo.target.request import Request, SpecSettings, StepRecord
from duo.target.target import Target
from helpers.greedy import leaves_constrained_greedy_path_only_at_a_near_tie
from helpers.scripted import ScriptedDraft
from helpers.stats import chi_square_pvalue

# Bounded: the tiny models' strings would otherwise go on with words until the token limit.
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
# A grammar with a handful of allowed first tokens, for the goodness-of-fit tests.
WORDS = ("yes", "no", "maybe", "never")
TRIALS = 3000


def cursor_for(model, kind: str, source) -> Cursor:
    return Cursor.compile(model, grammar_of(kind, source))


@pytest.mark.parametrize("kind, source, says", [
    ("json_schema", {"type": "nonsense"}, "nonsense"),
    ("json_schema", "{not json", "not a valid json schema"),
    ("json_schema", "[1, 2]", "JSON object"),
    ("gbnf", "root ::= missing", "missing"),
    ("lark", "start: missing", "missing"),
    ("regex", "a(b", "unclosed group"),
])
def test_a_grammar_that_cannot_compile_says_what_is_wrong(target_model, kind, source, says):
    with pytest.raises(GrammarError, match=f"(?i){says}"):
        cursor_for(target_model, kind, source)


def test_a_cursor_walks_a_chain_and_back_and_cuts_it_at_the_first_forbidden_token(target_model):
    cursor = cursor_for(target_model, "json_schema", PERSON)
    text = target_model.tokenize('{"name": "Ada", "age": 36}', add_special=False)
    assert cursor.valid_prefix(text) == len(text)
    broken = text[:1] + target_model.tokenize(" the", add_special=False) + text[1:]  # a key after `{"`
    assert cursor.valid_prefix(broken) == 1
    assert cursor.move_to(text[:6]) and cursor.tokens == text[:6]
    assert not cursor.move_to(broken) and cursor.tokens == broken[:1]  # stands after the allowed prefix
    assert cursor.move_to(text) and cursor.matcher.is_accepting()
    allowed = np.flatnonzero(cursor.allowed())
    assert set(allowed) <= set(target_model.end_of_generation_ids())  # a finished object: only the end
    assert cursor.move_to([]) and cursor.tokens == [] and not cursor.matcher.is_accepting()


def test_forced_text_is_proposed_and_every_other_token_masked(target_model):
    cursor = cursor_for(target_model, "regex", "The answer is (yes|no)")
    forced = cursor.forced()
    assert target_model.detokenize(forced).decode().startswith("The answer is")
    row = np.zeros(target_model.n_vocab, dtype=np.float32)
    cursor.move_to(forced)
    cursor.mask(row)
    allowed = {target_model.detokenize([t]).decode() for t in np.flatnonzero(np.isfinite(row))}
    assert allowed and all(" yes".startswith(piece) or " no".startswith(piece) for piece in allowed)


class FixedContext:
    """A model call that answers every part's rows with the same fixed logits."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row

    def decode_parts(self, parts):
        return [np.tile(self.row, (len(part.tokens), 1)) for part in parts]

    def rollback(self, n: int, seq: int = 0) -> None:
        pass


def word_logits(model, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Logits that favour tokens the grammar forbids (the mask must matter), and the target's masked p."""
    row = rng.normal(0, 1, model.n_vocab).astype(np.float32)
    row[rng.choice(model.n_vocab, 50, replace=False)] += 6.0  # forbidden favourites
    cursor = cursor_for(model, "lark", "start: " + " | ".join(json.dumps(w) for w in WORDS))
    allowed = np.flatnonzero(cursor.allowed())
    row[allowed] += rng.normal(3.0, 1.5, allowed.size).astype(np.float32)
    return row, cursor.mask(row.copy())


def sampled_first_tokens(model, verification: str, with_mask: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """TRIALS verify steps of a one-token chain drafted inside the grammar (from a draft q unlike p), through the
    target's verify path: the counts of the first committed token, and the masked target distribution."""
    rng = np.random.default_rng(7)
    row, masked = word_logits(model, rng)
    params = SamplingParams(temperature=1.0)
    p = distribution(masked, params)
    q_row = masked.copy()
    q_row[np.isfinite(q_row)] = rng.normal(0, 2, np.count_nonzero(np.isfinite(q_row)))  # a draft that disagrees
    q = distribution(q_row, params)
    cursor = cursor_for(model, "lark", "start: " + " | ".join(json.dumps(w) for w in WORDS))
    counts = np.zeros(model.n_vocab, dtype=np.int64)
    for trial in range(TRIALS):
        seed = trial if verification == "coupled" else None
        drafted = (int(coupled_ranking(q, seed, 11)[0][0]) if seed is not None
                   else int(rng.choice(q.ids, p=q.probs)))
        masks = [cursor.allowed(), *cursor.masks_after([], [drafted])] if with_mask else None
        work = VerifyWork(seq=0, pos=10, last=1, pending=[drafted], dists=[q], limit=1, draft_min=0, policy=None,
                          params=params, rng=rng, coupled_seed=seed, masks=masks)
        part = Part(0, 10, [1, drafted], range(2))
        [verdict], _ = _decode_and_verify(FixedContext(row), [_Planned(work, None, part, [drafted], [q])])
        counts[verdict.tokens[0]] += 1
    expected = np.zeros(model.n_vocab)
    expected[p.ids] = p.probs
    return counts, expected


@pytest.mark.parametrize("verification", ["residual", "coupled"])
def test_sampled_constrained_tokens_follow_the_masked_target_distribution(target_model, verification):
    counts, expected = sampled_first_tokens(target_model, verification)
    assert chi_square_pvalue(counts, expected) > 1e-3


@pytest.mark.parametrize("verification", ["residual", "coupled"])
def test_a_verifier_that_forgets_the_mask_fails_the_fit(target_model, verification):
    counts, expected = sampled_first_tokens(target_model, verification, with_mask=False)
    with pytest.raises(AssertionError, match="never would"):
        chi_square_pvalue(counts, expected)


def constrained_answer(model, prompt: list[int], link=None, *, schema=PERSON, n: int = 40) -> tuple[list[int], list]:
    async def run() -> tuple[list[int], list[StepRecord]]:
        target = Target(model, ModelWorker(), link, n_ctx=256, settings=SpecSettings(draft_max=8, adaptive=False))
        records: list[StepRecord] = []
        target.observers.append(type("R", (), {"on_step": lambda self, r: records.append(r)})())
        grammar = grammar_of("json_schema", schema)
        request = Request(prompt, SamplingParams(), max_tokens=n, grammar=grammar,
                          constraint=Cursor.compile(model, grammar))
        tokens = [t async for step, _ in target.generate(request) for t in step.tokens]
        return tokens, records

    return asyncio.run(run())


PROMPT_TEXT = "Describe a person as JSON:"


def test_greedy_constrained_output_matches_the_schema_and_a_right_draft_changes_only_the_speed(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    alone, _ = constrained_answer(target_model, prompt)
    person = json.loads(target_model.detokenize(alone).decode())
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)

    def right(committed: list[int]) -> list[int]:
        done = len(committed) - len(prompt)
        return alone[done:done + 8]

    tokens, records = constrained_answer(target_model, prompt, ScriptedDraft(right))
    assert leaves_constrained_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 40,
                                                             cursor_for(target_model, "json_schema", PERSON))
    assert sum(r.n_accepted for r in records) > len(alone) / 2 and len(records) < len(alone) / 2


def test_a_hostile_draft_cannot_break_the_grammar_and_its_forbidden_tokens_cost_no_rows(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    alone, alone_records = constrained_answer(target_model, prompt)
    im_start = target_model.tokenize("<|im_start|>", add_special=False)  # a control token: never inside JSON

    tokens, records = constrained_answer(target_model, prompt, ScriptedDraft(lambda committed: im_start * 8))
    assert tokens == alone  # the forbidden drafts were never in a batch: every step decoded what alone did
    # ... step for step: alone verifies only what the grammar forces, and so does this one.
    assert [(r.batch_size, r.n_verified) for r in records] == [(r.batch_size, r.n_verified) for r in alone_records]
    json.loads(target_model.detokenize(tokens).decode())


def test_the_draft_draws_inside_the_grammar_on_its_chain_and_its_branches(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    session = DraftSession(session_id=1, chain=list(prompt), committed=len(prompt), params=SamplingParams(),
                           rng=np.random.default_rng(0), max_ahead=8, p_min=0.0, slot=Slot(0, 1), n_ctx=256,
                           cursor=cursor_for(target_model, "json_schema", PERSON), output_start=len(prompt))
    the = target_model.tokenize(" the", add_special=False)[0]
    favour_the = np.zeros(target_model.n_vocab, dtype=np.float32)
    favour_the[the] = 50.0  # what the unconstrained draft would draft, and the grammar forbids
    opened = target_model.tokenize('{"', add_special=False)
    for tokens, fork in [(prompt, None), (prompt + opened, len(prompt))]:
        step = draw_step(Work(session, tokens, epoch=0, commits=0, chain_len=len(tokens), fork=fork),
                         favour_the.copy()[None])
        [(token, _, _)] = step.drawn
        assert token != the and cursor_for(target_model, "json_schema", PERSON).valid_prefix(
            tokens[len(prompt):] + [token]) == len(tokens) - len(prompt) + 1
    session.cursor = None  # the mutation: a draft that is not told the grammar drafts " the"
    assert draw_step(Work(session, prompt, epoch=0, commits=0, chain_len=len(prompt)), favour_the.copy()[None]).drawn[0][0] == the


def test_where_the_grammar_allows_one_token_a_greedy_draft_has_no_branch_to_offer(target_model):
    cursor = cursor_for(target_model, "regex", "yes")
    row = cursor.mask(np.random.default_rng(1).normal(0, 1, target_model.n_vocab).astype(np.float32))
    [only] = np.flatnonzero(np.isfinite(row)) if np.count_nonzero(np.isfinite(row)) == 1 else [None]
    if only is None:  # several tokenizations of "yes" allowed: keep one, as a forced position has
        only = int(np.argmax(row))
        row[np.arange(row.size) != only] = -np.inf
    doubt = doubt_of(row, only, None, greedy=True)
    assert doubt.alternative is None  # not a forbidden token that a branch would then fail on


def test_a_drafted_chain_that_ends_the_grammar_pauses_rather_than_failing_the_session(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    answer = target_model.tokenize("yes", add_special=False)
    end = target_model.tokenize("<|im_end|>", add_special=False)
    session = DraftSession(session_id=1, chain=prompt + answer + end, committed=len(prompt), params=SamplingParams(),
                           rng=np.random.default_rng(0), max_ahead=8, p_min=0.0, slot=Slot(0, None), n_ctx=256,
                           cursor=cursor_for(target_model, "regex", "yes"), output_start=len(prompt))
    # A branch ending at the end of generation that the target took as its chain: the next work is past the end.
    step = draw_step(Work(session, session.chain, epoch=0, commits=0, chain_len=len(session.chain)),
                     np.zeros((1, target_model.n_vocab), dtype=np.float32))
    assert step.paused and step.error is None
    broken = prompt + target_model.tokenize("no", add_special=False)
    step = draw_step(Work(session, broken, epoch=0, commits=0, chain_len=len(broken)),
                     np.zeros((1, target_model.n_vocab), dtype=np.float32))
    assert "breaks its grammar" in str(step.error)  # what no target commits is still an error
