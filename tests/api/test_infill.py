"""Fill-in-the-middle: /infill and /v1/completions' suffix, replayed as editors send them (llama.vscode, llama.vim
with its warm-ups), speculated; the FIM prompt's layout and budgets; the code-completion stop rules; llama.cpp's
infill sampler, exact under verification."""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import CONTEXT_SIZE
from duo.api.openai.bodies import CompletionBody
from duo.api.serving.infill import FimInput, FimStops, NoFim, fim_tokens
from duo.api.serving.stop import StopMatcher
from duo.llama.model import Model
from duo.models.catalog import CATALOG, DEFAULT_DRAFT, DEFAULT_TARGET
from duo.net import wire
from duo.sampling.distributions import SparseDist, distribution
from duo.sampling.ops.infill import InfillVocab, infill, infill_vocab
from duo.sampling.params import SamplingParams
from duo.sampling.verification import verify_stochastic
from helpers.http import post
from helpers.infill import CHUNKS, PREFIX, SUFFIX, TIMINGS
from helpers.stats import ALPHA, chi_square_pvalue, first_token_trials, probs_to_logits
from helpers.tiny_models import write_tiny_model


def text_tokens(model: Model, text: str) -> list[int]:
    return model.tokenize(text, add_special=False, parse_special=False)


# --- the prompt ------------------------------------------------------------------------------------------------


def test_the_prompt_is_llama_servers_repository_layout_of_the_models_fim_tokens(target_model):
    token = target_model.special_token
    def text(value: str) -> list[int]:
        return text_tokens(target_model, value)

    expected = ([token("fim_rep"), *text("myproject\n"),
                 token("fim_sep"), *text(CHUNKS[0][0] + "\n"), *text(CHUNKS[0][1]),
                 token("fim_sep"), *text("filename\n"),
                 token("fim_pre"), *text(PREFIX), *text("x = "), token("fim_suf"), *text(SUFFIX), token("fim_mid")])
    assert fim_tokens(target_model, FimInput(PREFIX, SUFFIX, CHUNKS, "x = "), 8192, 64) == expected
    assert target_model.detokenize([token("fim_pre"), token("fim_suf"), token("fim_mid")], special=True) == \
        b"<|fim_prefix|><|fim_suffix|><|fim_middle|>"


def test_the_prompt_keeps_the_prefixs_end_and_the_suffixs_start_within_llama_servers_budgets(target_model):
    long_prefix, long_suffix = "a = 1\n" * 400, "b = 2\n" * 400
    tokens = fim_tokens(target_model, FimInput(long_prefix, long_suffix, CHUNKS), 512, 16)
    token = target_model.special_token
    pre, suf = tokens.index(token("fim_pre")), tokens.index(token("fim_suf"))
    prefix, suffix = tokens[pre + 1:suf], tokens[suf + 1:-1]
    # A batch of at most half the context (256 of 512): the prefix keeps its last 3/4, the suffix its first 1/4 less
    # the prompt and two tokens; the chunks get what is left, and the answer's room stays free.
    assert prefix == text_tokens(target_model, long_prefix)[-192:]
    assert suffix == text_tokens(target_model, long_suffix)[:64 - 2]
    assert 0 < pre and len(tokens) <= 512 - 16


def test_a_model_without_fim_tokens_says_infill_is_not_supported(tmp_path, tiny_target):
    plain = write_tiny_model(tmp_path / "no-fim.gguf", seed=0, base=tiny_target,
                             tokenizer_edits={151659: "<|no_pre|>", 151660: "<|no_mid|>", 151661: "<|no_suf|>"})
    model = Model(plain, device="cpu", threads=1)
    try:
        with pytest.raises(NoFim, match="prefix, suffix, middle"):
            fim_tokens(model, FimInput(PREFIX, SUFFIX), 4096, 16)
    finally:
        model.close()


# --- the stop rules --------------------------------------------------------------------------------------------


def fed(stops: FimStops, pieces: list[str]) -> tuple[str, bool]:
    """All the text `stops` lets out of `pieces`, and whether a rule stopped it (then flush is not called)."""
    shown = []
    for piece in pieces:
        text, stopped = stops.feed(piece)
        shown.append(text)
        if stopped:
            return "".join(shown), True
    return "".join(shown) + stops.flush(), False


def test_a_line_less_indented_than_n_indent_ends_the_completion_before_its_text():
    middle = "return math.pi * radius ** 2\n\ndef"
    for pieces in ([middle], list(middle)):  # whole, and a character at a time: nothing shown is taken back
        stops = FimStops(StopMatcher([]), n_indent=4)
        # The empty line ends it (what follows its indentation is the line break), as in llama-server.
        assert fed(stops, pieces) == ("return math.pi * radius ** 2\n", True) and stops.why == "limit"
    indented = FimStops(StopMatcher([]), n_indent=4)
    assert fed(indented, ["x = 1\n    y = 2\n", "    z"]) == ("x = 1\n    y = 2\n    z", False)


def test_a_line_that_repeats_the_suffix_ends_the_completion_before_it():
    middle = "return math.pi * radius ** 2\n\n\ndef main():\n    print(circle_area(2.0))"
    for pieces in ([middle], list(middle)):
        stops = FimStops(StopMatcher([]), suffix=SUFFIX)
        text, stopped = fed(stops, pieces)
        assert text == "return math.pi * radius ** 2\n\n\n" and stopped and stops.why == "word"
    # A line that only starts like the suffix's is text like any other.
    assert fed(FimStops(StopMatcher([]), suffix=SUFFIX), ["x\ndef main_loop():\n"]) == ("x\ndef main_loop():\n", False)


def test_past_t_max_predict_ms_the_completion_ends_at_a_line_break():
    stops = FimStops(StopMatcher([]), t_max_predict_ms=1)
    assert stops.feed("a = 1") == ("a = 1", False)
    time.sleep(0.01)
    assert stops.feed(" + 2") == (" + 2", False)  # no line break yet
    assert stops.feed("\nb") == ("\nb", True) and stops.why == "limit"


def test_past_t_max_predict_ms_an_earlier_line_break_does_not_end_a_line_midway():
    stops = FimStops(StopMatcher([]), t_max_predict_ms=1)
    assert stops.feed("a\n") == ("a\n", False)
    time.sleep(0.01)
    assert stops.feed("    b = co") == ("    b = co", False)
    assert stops.feed("unt\n") == ("unt\n", True)


def test_without_penalties_in_samplers_logit_bias_still_applies_as_in_llama_cpp():
    request = CompletionBody(prompt="x", samplers=["top_k", "top_p", "infill"], top_k=40, logit_bias={"5": -100},
                             presence_penalty=1.0).to_request()
    assert request.penalties.bias == ((5, -100.0),) and request.penalties.presence == 0.0
    assert request.infill_sampler and request.params.top_k == 40 and request.params.temperature == 1.0


def test_stop_strings_still_apply_beside_the_rules():
    stops = FimStops(StopMatcher(["<END>"]), n_indent=2, suffix=SUFFIX)
    assert fed(stops, ["  a\n", "  b<E", "ND>  c"]) == ("  a\n  b", True) and stops.why == "word"


# --- the infill sampler ----------------------------------------------------------------------------------------


def vocab_of(pieces: dict[int, bytes], eog: set[int], eot: int = 99) -> InfillVocab:
    return InfillVocab(frozenset(eog), eot, lambda token: pieces.get(token, b""))


def test_the_infill_sampler_merges_prefixes_and_keeps_likely_text_as_llama_cpp_does():
    vocab = vocab_of({1: b" ret", 2: b" return", 3: b" x", 4: b" y"}, eog={9})
    ids, probs = infill(np.array([2, 1, 3, 4, 9]), np.array([0.4, 0.3, 0.15, 0.1, 0.05]), vocab)
    # " ret" merges into " return" (0.7); " x" and " y" fall under 0.2; EOG stays (3 * 0.05 * 5 < 0.95). The merged
    # mass decides who survives; the survivors are drawn at their own probabilities, renormalised (llama.cpp's dist).
    assert ids.tolist() == [2, 9] and probs == pytest.approx([0.4 / 0.45, 0.05 / 0.45])


def test_the_infill_sampler_ends_where_ending_is_likely_enough_or_no_text_is():
    vocab = vocab_of({1: b"a", 2: b"b"}, eog={9, 8})
    ids, probs = infill(np.array([1, 9, 2, 8]), np.array([0.7, 0.1, 0.15, 0.05]), vocab)
    assert ids.tolist() == [9, 8] and probs == pytest.approx([2 / 3, 1 / 3])  # 3 * 0.15 * 4 > 0.85
    flat = infill(np.arange(1, 7), np.full(6, 1 / 6), vocab_of({}, eog=set(), eot=42))
    assert flat[0].tolist() == [42] and flat[1].tolist() == [1.0]  # every text token under 0.2: end of turn


def test_the_infill_sampler_falls_back_to_end_of_turn_only_where_the_row_allows_it():
    vocab = vocab_of({token: bytes([ord("a") + token]) for token in range(8)}, eog={9})  # end of turn: 99
    params = SamplingParams(temperature=1.0, top_k=6, infill=vocab)
    row = np.zeros(100, dtype=np.float32)
    row[:2], row[8:] = [0.1, 0.05], -np.inf  # six likeliest texts, each under 0.2: the fallback
    row[99] = -5.0  # allowed, outside the top k: llama.cpp's end of turn all the same
    assert distribution(row, params).ids.tolist() == [99]
    row[99] = -np.inf  # banned (logit_bias false, a grammar's mask): the likeliest text the row allows instead
    banned = distribution(row, params)
    assert banned.ids.tolist() == [0] and banned.probs.tolist() == [1.0]


def test_verification_under_the_infill_sampler_emits_the_targets_distribution():
    vocab = vocab_of({0: b"if", 1: b"if x", 2: b"for", 3: b"while", 4: b"x", 5: b"y", 6: b"z", 7: b"w"}, eog=set())
    params = SamplingParams(temperature=1.0, top_k=6, infill=vocab)
    row = probs_to_logits([0.30, 0.10, 0.28, 0.12, 0.08, 0.06, 0.04, 0.02])
    p = distribution(row, params)  # "if x" merged into "if"; the rest under 0.2
    assert p.ids.tolist() == [0, 2] and p.probs == pytest.approx([0.30 / 0.58, 0.28 / 0.58])
    q = SparseDist(range(8), [0.1, 0.3, 0.1, 0.2, 0.1, 0.1, 0.05, 0.05])
    counts, accepted = first_token_trials(verify_stochastic, row, q, params)
    expected = np.zeros(8)
    expected[p.ids] = p.probs
    assert accepted > 0 and chi_square_pvalue(counts, expected) > ALPHA


def test_the_wire_carries_the_infill_sampler_and_each_side_reads_its_own_vocabulary(target_model):
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.99, infill=infill_vocab(target_model))
    back, _ = wire.sampling_from_pb(wire.sampling_to_pb(params, None), target_model)
    assert back.infill is infill_vocab(target_model) and back.top_k == 40
    assert target_model.special_token("eot") in infill_vocab(target_model).eog
    with pytest.raises(ValueError, match="top_k from 1 to 64"):
        SamplingParams(temperature=1.0, infill=infill_vocab(target_model)).validate()


# --- editors' requests, replayed against duo-draft + duo-target ------------------------------------------------

def llama_vim_fim(n_predict: int = 32) -> dict:
    """llama.vim's FIM request (autoload/llama.vim, llama#fim), its ring chunks carrying their pick time."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX,
            "input_extra": [{"text": CHUNKS[0][1], "time": 1732560000.5, "filename": CHUNKS[0][0]}],
            "prompt": "", "n_predict": n_predict, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "stream": False, "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", *TIMINGS, "truncated", "tokens_cached"]}


def llama_vscode_fim(n_predict: int = 32) -> dict:
    """llama.vscode's FIM request (src/llama-server.ts, getLlamaCompletion)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": [{"filename": f, "text": t} for f, t in
                                                                            CHUNKS],
            "prompt": "", "n_predict": n_predict, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 2500}


def test_llama_vims_fim_request_is_answered_with_the_fields_it_reads_and_drafts_accepted(served_sync):
    answers = [post(served_sync, "/infill", llama_vim_fim()) for _ in range(3)]
    assert all(a.status_code == 200 for a in answers), answers[0].text
    bodies = [a.json() for a in answers]
    assert set(bodies[0]) == {"content", *TIMINGS, "truncated", "tokens_cached"}  # response_fields, flattened
    assert all(isinstance(b["content"], str) and b["truncated"] is False for b in bodies)
    assert all(0 < b["timings/predicted_n"] <= 32 for b in bodies)
    assert bodies[-1]["tokens_cached"] > 0  # the same prompt again: its cells are reused
    full = post(served_sync, "/infill", {**llama_vim_fim(), "response_fields": None}).json()
    assert full["timings"]["draft_n_accepted"] > 0 and full["timings"]["draft_n"] >= full["timings"]["draft_n_accepted"]


def test_llama_vims_warm_ups_answer_without_generating_or_with_one_greedy_token(served_sync):
    ring = [{"text": "x = 1\n", "time": 1.0, "filename": "a.py"}]
    warm = post(served_sync, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "",
                                         "n_predict": 0, "t_max_prompt_ms": 1, "t_max_predict_ms": 1})
    assert warm.status_code == 200 and warm.json()["content"] == "" and warm.json()["tokens_predicted"] == 0
    one = post(served_sync, "/infill", {"input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "",
                                        "n_predict": 1, "temperature": 0.0, "stream": False,
                                        "samplers": ["temperature"], "cache_prompt": True, "t_max_prompt_ms": 1,
                                        "t_max_predict_ms": 1})
    assert one.status_code == 200 and one.json()["tokens_predicted"] == 1


def test_llama_vscodes_fim_request_is_speculated_and_answers_content_and_timings(served_sync):
    body = post(served_sync, "/infill", llama_vscode_fim()).json()
    assert isinstance(body["content"], str) and body["stop"] is True and body["stop_type"] in ("eos", "limit", "word")
    assert body["timings"]["draft_n"] > 0 and body["tokens_evaluated"] > 0


def test_greedy_infill_is_the_targets_own_greedy_completion_of_the_fim_prompt(served_sync, target_model):
    fim = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "", "n_predict": 24, "temperature": 0}
    infilled = post(served_sync, "/infill", fim).json()
    tokens = fim_tokens(target_model, FimInput(PREFIX, SUFFIX), CONTEXT_SIZE, 24)
    plain = post(served_sync, "/completion", {"prompt": tokens, "n_predict": 24, "temperature": 0}).json()
    assert infilled["tokens"] == plain["tokens"] and infilled["tokens_evaluated"] == len(tokens)
    assert infilled["timings"]["draft_n"] > 0
    # OpenAI's suffix builds the same prompt (no extra chunks, no cursor-line prompt).
    openai = post(served_sync, "/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24,
                                                   "temperature": 0}).json()
    assert openai["choices"][0]["text"] == infilled["content"] and openai["usage"]["prompt_tokens"] == len(tokens)


def test_infill_refuses_what_it_cannot_honour_by_name(served_alone):
    untruncated = post(served_alone, "/infill", {"input_prefix": "x", "samplers": ["infill"], "n_predict": 4})
    assert untruncated.status_code == 400 and "top_k" in untruncated.json()["error"]["message"]
    tokens_and_suffix = post(served_alone, "/v1/completions", {"prompt": [1, 2, 3], "suffix": "x"})
    assert tokens_and_suffix.status_code == 400 and tokens_and_suffix.json()["error"]["param"] == "suffix"
    server_option = post(served_alone, "/infill", {"input_prefix": "x", "spm_infill": True, "n_predict": 2})
    assert server_option.status_code == 200  # llama-server's --spm-infill is no request field: ignored, as there


def test_the_catalog_says_which_models_fill_in_the_middle_and_copies_keep_it():
    assert CATALOG[DEFAULT_TARGET].fim and CATALOG[DEFAULT_DRAFT].fim  # Qwen2.5-Coder: what editors use
    assert not CATALOG["smollm2-135m-instruct"].fim
    assert all(spec.fim == CATALOG[spec.derived_from].fim for spec in CATALOG.values() if spec.derived_from)
