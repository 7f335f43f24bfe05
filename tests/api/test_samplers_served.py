"""llama.cpp's other samplers with the tiny models: greedy under DRY is the target's own greedy output with DRY, with a
right draft in process and through a served pair, and llama-server bodies with them on are answered with drafts."""

from __future__ import annotations

import numpy as np

from duo.sampling import rows as pipeline
from duo.sampling.ops.dry import Dry
from duo.sampling.ops.penalties import Penalties
from helpers.greedy import leaves_transformed_greedy_path_only_at_a_near_tie
from helpers.http import post
from helpers.penalties import answer
from helpers.scripted import ScriptedDraft

PROMPT_TEXT = "Once upon a time"
DRY_ON = Dry(multiplier=3.0, base=1.75, allowed_length=1)


def dry_after(dry: Dry, prompt: list[int]):
    """The transform greedy.py walks the target's path with: DRY after the prompt and the answer's tokens before."""
    def transform(row: np.ndarray, output: list[int]) -> np.ndarray:
        dry.apply(row, np.asarray(prompt + list(output), dtype=np.int64))
        return row

    return transform


def right_draft(prompt: list[int], alone: list[int]) -> ScriptedDraft:
    return ScriptedDraft(lambda committed: alone[len(committed) - len(prompt):][:8])


def test_greedy_output_under_dry_is_the_targets_own_and_a_right_draft_only_speeds_it(target_model):
    prompt = target_model.tokenize(PROMPT_TEXT)
    penalties = Penalties(dry=DRY_ON).for_vocab(target_model)
    plain, _ = answer(target_model, prompt, Penalties())
    alone, _ = answer(target_model, prompt, penalties)
    assert alone != plain  # DRY changes what the target says
    tokens, records = answer(target_model, prompt, penalties, right_draft(prompt, alone))
    assert leaves_transformed_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 24,
                                                             dry_after(penalties.dry, prompt))
    assert sum(r.n_accepted for r in records) > len(alone) / 2


def test_a_verifier_whose_dry_ignores_the_drafts_before_each_row_is_caught(target_model, monkeypatch):
    """Mutation: DRY applied after the committed tokens alone (every row as the first) leaves the path."""
    prompt = target_model.tokenize(PROMPT_TEXT)
    penalties = Penalties(dry=DRY_ON).for_vocab(target_model)
    alone, _ = answer(target_model, prompt, penalties)

    def blind(p, rows, committed, drafts, counted):
        for row in rows:
            p.dry.apply(row, np.asarray(committed, dtype=np.int64))

    monkeypatch.setattr(pipeline, "penalize_rows", blind)
    tokens, _ = answer(target_model, prompt, penalties, right_draft(prompt, alone))
    assert not leaves_transformed_greedy_path_only_at_a_near_tie(target_model, prompt, tokens, 24,
                                                                 dry_after(penalties.dry, prompt))


def test_greedy_under_dry_through_a_served_pair_is_the_targets_own(served_sync, target_model):
    body = {"prompt": PROMPT_TEXT, "n_predict": 24, "temperature": 0, "dry_multiplier": DRY_ON.multiplier,
            "dry_base": DRY_ON.base, "dry_allowed_length": DRY_ON.allowed_length}
    answered = post(served_sync, "/completion", body).json()
    prompt = target_model.tokenize(PROMPT_TEXT)
    dry = Penalties(dry=DRY_ON).for_vocab(target_model).dry
    assert leaves_transformed_greedy_path_only_at_a_near_tie(target_model, prompt, answered["tokens"], 24,
                                                             dry_after(dry, prompt))
    plain = post(served_sync, "/completion", {**body, "dry_multiplier": 0}).json()
    assert plain["tokens"] != answered["tokens"] and answered["timings"]["draft_n_accepted"] > 0


def sillytavern_body(**settings) -> dict:
    """A llama.cpp text completion as SillyTavern sends it (its sampler fields, those duo ignores among them)."""
    return {"prompt": "Seraphina's Persona: a guardian of the forest glade.\nUser: Where am I?\nSeraphina:",
            "n_predict": 48, "max_tokens": 48, "temperature": 0.7, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "typical_p": 1, "tfs_z": 1, "repeat_penalty": 1.1, "repeat_last_n": 64, "mirostat": 0,
            "mirostat_tau": 5, "mirostat_eta": 0.1, "dry_multiplier": 0, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": -1, "dry_sequence_breakers": "[\"\\n\", \":\", \"\\\"\", \"*\"]",
            "xtc_probability": 0, "xtc_threshold": 0.1, "stop": ["\nUser:"], "seed": 7, "cache_prompt": True,
            **settings}


def test_a_sillytavern_body_with_dry_xtc_and_typical_on_is_served_with_drafts_accepted(served_sync):
    # No prompt cache: both read the prompt in the same batches, so the seed replays the text bit for bit (a cached
    # prompt rounds the first row's logits differently: a near-tie may fall the other way).
    body = sillytavern_body(dry_multiplier=0.8, xtc_probability=0.5, xtc_threshold=0.1, typical_p=0.9,
                            cache_prompt=False)
    response = post(served_sync, "/completion", body)
    assert response.status_code == 200, response.text
    answered = response.json()
    assert answered["content"] and answered["timings"]["draft_n_accepted"] > 0
    assert post(served_sync, "/completion", body).json()["content"] == answered["content"]  # seeded: coupled


def test_mirostat_and_dynatemp_bodies_are_served_with_drafts_accepted(served_sync):
    for settings in ({"mirostat": 2, "mirostat_tau": 4.0}, {"mirostat": 1}, {"dynatemp_range": 0.5},
                     {"top_n_sigma": 1.5, "min_keep": 2}):
        response = post(served_sync, "/completion", sillytavern_body(**settings))
        assert response.status_code == 200, (settings, response.text)
        assert response.json()["timings"]["draft_n_accepted"] > 0, settings


def test_sampler_fields_out_of_range_are_refused_by_name(served_sync):
    for field, value in (("mirostat", 3), ("typical_p", 1.5), ("xtc_probability", -0.1), ("dry_sequence_breakers", []),
                         ("dry_sequence_breakers", "not json"), ("dry_penalty_last_n", -2)):
        response = post(served_sync, "/completion", sillytavern_body(**{field: value}))
        assert response.status_code == 400 and field in response.text, (field, response.text)
