"""The one row pipeline (duo.sampling.rows): both sides transform their rows with it, in its documented order."""

from __future__ import annotations

import sys

import numpy as np

from duo.draft.batch import Work, draw_step
from duo.draft.session import DraftSession, Slot
from duo.sampling import rows
from duo.sampling.ops.dry import Dry
from duo.sampling.ops.penalties import OutputCounts, Penalties
from duo.sampling.params import SamplingParams
from helpers.penalties import PROMPT_TEXT, answer
from helpers.scripted import ScriptedDraft


def forcing_pipeline(forced: int, callers: list[str]):
    """rows.transform, then every row's logits but `forced`'s at -inf, noting the module of each caller."""
    real = rows.transform

    def transform(penalties, block, committed, drafts, counted, masks=None) -> None:
        callers.append(sys._getframe(1).f_globals["__name__"])
        real(penalties, block, committed, drafts, counted, masks)
        block[:, np.arange(block.shape[1]) != forced] = -np.inf

    return transform


def recording(name: str, steps: list[str]):
    """The pipeline's step `name`, noting in `steps` that it ran."""
    step = getattr(rows, name)

    def recorded(*args) -> None:
        steps.append(name)
        step(*args)

    return recorded


def test_the_targets_verify_and_the_drafts_draw_read_the_rows_the_one_pipeline_leaves(target_model, monkeypatch):
    """A pipeline that allows one token alone: the target says it at every position (verified drafts, recovered and
    bonus tokens alike) and the draft draws it, so both sides take their rows from rows.transform and nowhere else."""
    forced, callers = target_model.tokenize(" the", add_special=False)[0], []
    monkeypatch.setattr(rows, "transform", forcing_pipeline(forced, callers))
    prompt = target_model.tokenize(PROMPT_TEXT)
    penalties = Penalties(presence=0.5)
    tokens, records = answer(target_model, prompt, penalties, ScriptedDraft(lambda committed: [forced] * 4), n=12)
    assert tokens == [forced] * 12 and sum(r.n_accepted for r in records) > 0
    assert set(callers) == {"duo.target.batching"}

    callers.clear()
    session = DraftSession(session_id=1, chain=list(prompt), committed=len(prompt), params=SamplingParams(),
                           rng=np.random.default_rng(0), max_ahead=8, p_min=0.0, slot=Slot(0, None), n_ctx=256,
                           output_start=len(prompt), penalties=penalties)
    favourite = np.zeros(target_model.n_vocab, dtype=np.float32)
    favourite[forced + 1] = 50.0  # what the draft would draw from its own row
    step = draw_step(Work(session, prompt, epoch=0, commits=0, chain_len=len(prompt)), favourite[None])
    assert step.error is None and step.drawn[0][0] == forced
    assert callers == ["duo.draft.session"]


def test_the_penalties_run_in_the_documented_order_then_dry_then_the_grammar_mask(monkeypatch):
    """Steps 1-4 by their numbers: another order gives another logit (repeat before bias: 0.75; DRY before the
    repeat penalty: 0.5). Step 5 comes last: a mask after them leaves -inf whatever they would add."""
    committed = [5, 0, 5]  # a prompt [5], then the output [0, 5]; token 0 after it would repeat "5 0"
    penalties = Penalties(bias=((0, 1.0), (3, 100.0)), repeat=2.0, repeat_last_n=-1, presence=0.5, frequency=0.25,
                          dry=Dry(multiplier=0.5, base=2.0, allowed_length=1, restarts={}))
    block = np.zeros((1, 8))
    block[0, 0] = 2.0
    allowed = np.ones(8, dtype=bool)
    allowed[3] = False
    steps: list[str] = []
    for name in ("penalize_rows", "mask_rows"):
        monkeypatch.setattr(rows, name, recording(name, steps))
    rows.transform(penalties, block, committed, [], OutputCounts(8, [0, 5]), [allowed])
    # 1. bias 2 + 1 = 3; 2. repeat 3 / 2 = 1.5; 3. presence and one occurrence's frequency 1.5 - 0.75; 4. DRY - 0.5
    assert block[0, 0] == 0.25
    assert block[0, 3] == -np.inf  # biased +100, then masked
    assert steps == ["penalize_rows", "mask_rows"]


def test_a_request_without_transforms_leaves_its_rows_as_the_model_made_them():
    block = np.random.default_rng(0).normal(0, 1, (3, 16))
    before = block.copy()
    rows.transform(Penalties(), block, [1, 2, 3], [4, 5], None)
    assert np.array_equal(block, before)
