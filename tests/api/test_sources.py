"""The `duo_sources` stream extension: each chunk says where its text came from (the draft, the context lookup, the
grammar or the target itself), its pieces spelling exactly the chunk's text, from a step's commit to the client;
absent unless asked. And the page's files, served without the key."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.serving.metrics import Metrics
from duo.api.serving.decode import SourceAligner, runs
from duo.sampling.params import SamplingParams
from duo.sampling.verification import Verdict
from duo.target.generation import Generation
from duo.target.request import SOURCES, GenerationStats, Request, SpecSettings, Step, StepRecord
from helpers.asgi import app_client, unloaded_app
from helpers.http import sse_events, streamed
from helpers.scripted import ScriptedModel

# --- a step's sources --------------------------------------------------------------------------------------------


def test_a_steps_accepted_drafts_are_named_by_their_origin_in_verify_order_then_the_targets_own_token():
    assert Step.sources_of((2, 0, 3), 4, 5) == ("draft", "draft", "lookup", "lookup", "target")
    assert Step.sources_of((0, 2, 1), 3, 4) == ("grammar", "grammar", "lookup", "target")
    assert Step.sources_of((3, 0, 0), 0, 1) == ("target",)  # the first draft rejected: the target's token alone
    assert Step.sources_of((3, 0, 0), 3, 2) == ("draft", "draft")  # cut short (an end of generation, the limit)


def a_generation(max_tokens: int = 0) -> Generation:
    model = SimpleNamespace(is_end_of_generation=lambda token: token == 0)
    return Generation(1, Request([5, 6, 7], SamplingParams(), max_tokens=max_tokens), model,
                      SpecSettings(lookup=False))


def test_a_commit_labels_its_tokens_as_its_stats_count_them():
    generation = a_generation()
    generation.split = (2, 0, 2)  # what verify_work found: two drafts of the model's chain, then two of the lookup
    step = generation.commit(Verdict(n_accepted=3, tokens=[11, 12, 13, 14]), n_verified=4, batch_size=5)
    assert step.sources == ("draft", "draft", "lookup", "target")
    stats = generation.stats
    assert sum(source != "target" for source in step.sources) == stats.draft_tokens_accepted == 3
    assert step.sources.count("lookup") == stats.lookup_tokens_accepted == 1


def test_a_commit_cut_by_the_token_limit_labels_only_the_tokens_it_keeps():
    generation = a_generation(max_tokens=2)
    generation.split = (4, 0, 0)
    step = generation.commit(Verdict(n_accepted=4, tokens=[11, 12, 13, 14, 15]), n_verified=4, batch_size=5)
    assert step.tokens == [11, 12] and step.sources == ("draft", "draft") and step.finish_reason == "length"


# --- through the API ---------------------------------------------------------------------------------------------


@dataclass
class SourcedTarget:
    """Commits scripted steps, each with its tokens' sources."""

    steps: list[tuple[list[int], tuple[str, ...]]]
    model: object = field(default_factory=ScriptedModel)
    pool: None = None  # no drafts

    async def generate(self, request: Request, stats: GenerationStats | None = None, progress: bool = False):
        stats = stats if stats is not None else GenerationStats(prompt_tokens=len(request.prompt_tokens))
        for i, (tokens, sources) in enumerate(self.steps):
            stats.generated_tokens += len(tokens)
            stats.verify_steps += 1
            yield Step(tokens, "length" if i == len(self.steps) - 1 else None, sources=sources), stats


def served(steps, model=None) -> TestClient:
    service = Completions(Admission(1, 1), Metrics(), ["scripted"])
    service.ready(SourcedTarget(steps, model or ScriptedModel()), context_size=100)  # type: ignore[arg-type]
    return app_client(service)


def chunks(client: TestClient, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response.iter_lines(), done=True)


def check_pieces(chunk: dict, text: str) -> list[list[str]]:
    """The chunk's sources: pieces that spell its text, each of a known source."""
    pieces = chunk["duo"]["sources"]
    assert "".join(piece for piece, _ in pieces) == text
    assert all(source in SOURCES and piece for piece, source in pieces)
    return pieces


# ScriptedModel's tokens: 1 and 2 split the UTF-8 bytes of "日"; 3 " the", 4 " end", 5 ".", 6 "\n".
STEPS = [([3, 4], ("draft", "target")), ([5, 1], ("lookup", "draft")), ([2, 3], ("target", "draft")),
         ([6], ("target",))]


def test_every_completion_chunk_says_where_each_character_came_from_a_split_character_from_its_last_token():
    found = chunks(served(STEPS), "/v1/completions", {"prompt": "hi", "duo_sources": True})
    pieces = [piece for chunk in found for piece in check_pieces(chunk, chunk["choices"][0]["text"])]
    assert runs("".join(p for p, _ in pieces), [s for p, source in pieces for s in [source] * len(p)]) == [
        [" the", "draft"], [" end", "target"], [".", "lookup"], ["日", "target"], [" the", "draft"], ["\n", "target"]]
    assert [step for chunk in found for step in chunk["duo"]["steps"]] == [list(sources) for _, sources in STEPS]


def test_text_held_back_for_a_stop_string_keeps_its_sources_until_it_is_released():
    found = chunks(served(STEPS), "/v1/completions", {"prompt": "hi", "duo_sources": True, "stop": [" end!"]})
    texts = [chunk["choices"][0]["text"] for chunk in found]
    assert texts[0] == " the"  # " end" is held back: it may begin the stop string
    pieces = [piece for chunk in found for piece in check_pieces(chunk, chunk["choices"][0]["text"])]
    assert pieces[:3] == [[" the", "draft"], [" end", "target"], [".", "lookup"]]


def test_without_the_field_no_chunk_carries_the_extension():
    found = chunks(served(STEPS), "/v1/completions", {"prompt": "hi"})
    assert found and not any("duo" in chunk for chunk in found)


def test_chat_chunks_spell_their_content_and_their_reasoning_in_sources(target_model):
    pieces = ["<think>", " plan", "</think>", "Hello", " world", "!"]
    tokens = [target_model.tokenize(piece, add_special=False, parse_special=True) for piece in pieces]
    steps = [(tokens[0] + tokens[1], ("target",) * len(tokens[0]) + ("draft",) * len(tokens[1])),
             (tokens[2] + tokens[3], ("target",) * len(tokens[2]) + ("lookup",) * len(tokens[3])),
             (tokens[4] + tokens[5], ("draft",) * len(tokens[4]) + ("target",) * len(tokens[5]))]
    client = served(steps, target_model)
    body = {"messages": [{"role": "user", "content": "hi"}], "duo_sources": True}
    found = [chunk for chunk in chunks(client, "/v1/chat/completions", body) if chunk["choices"]]
    said = {"content": [], "reasoning_content": []}
    for chunk in found[1:]:  # after the opening chunk (the role), every chunk carries the extension
        delta = chunk["choices"][0]["delta"]
        kind = "reasoning_content" if "reasoning_content" in delta else "content"
        said[kind] += check_pieces(chunk, delta.get(kind, ""))
    assert "duo" not in found[0]
    assert said["reasoning_content"] == [["plan", "draft"]]  # the reasoning is stripped of its space and tags
    assert said["content"] == [["Hello", "lookup"], [" world", "draft"], ["!", "target"]]
    plain = chunks(client, "/v1/chat/completions", {**body, "duo_sources": False})
    assert not any("duo" in chunk for chunk in plain)


def test_text_the_answer_writes_itself_takes_the_source_of_the_text_that_follows():
    aligner = SourceAligner()
    aligner.feed("ab", ["draft", "target"])
    assert aligner.runs("<think>") == [["<think>", "draft"]]  # not the model's: deepseek-legacy puts it back
    assert aligner.runs("ab") == [["a", "draft"], ["b", "target"]]


def test_a_chat_stream_from_a_target_with_a_draft_marks_accepted_drafts(served_sync):
    body = {"messages": [{"role": "user", "content": "Count from one to twenty."}], "max_tokens": 48,
            "temperature": 0, "duo_sources": True, "stream_options": {"include_usage": True}}
    found = streamed(served_sync, "/v1/chat/completions", body)
    with_text = [chunk for chunk in found if chunk["choices"] and "duo" in chunk]
    labels = [source for chunk in with_text
              for _, source in check_pieces(chunk, chunk["choices"][0]["delta"].get("content", ""))]
    stats = next(chunk["duo_stats"] for chunk in found if "duo_stats" in chunk)
    steps = [step for chunk in with_text for step in chunk["duo"]["steps"]]
    assert "draft" in labels and stats["draft_tokens_accepted"] > 0
    assert sum(len(step) for step in steps) == found[-1]["usage"]["completion_tokens"] == stats["generated_tokens"]
    assert sum(source != "target" for step in steps for source in step) == stats["draft_tokens_accepted"]
    assert sum(source == "lookup" for step in steps for source in step) == stats["lookup_tokens_accepted"]
    assert len(steps) == stats["verify_steps"]


# --- the page's files and the step counters ----------------------------------------------------------------------


@pytest.mark.parametrize("path, kind", [("/", "text/html"), ("/page/page.js", "text/javascript"),
                                        ("/page/page.css", "text/css")])
def test_the_page_and_its_files_are_served_without_the_key_and_run_nothing_from_elsewhere(path, kind):
    client = TestClient(unloaded_app("k", names=["m"]))
    response = client.get(path)
    assert response.status_code == 200 and response.headers["content-type"].startswith(kind)
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert client.get("/page/other.js").status_code == 401  # only the page's own files are public
    assert client.get("/slots").status_code == 401


def test_an_installed_wheel_carries_the_pages_files():
    root = Path(__file__).resolve().parents[2]
    patterns = re.search(r'^"duo.api.page" = \[(.*)\]', (root / "pyproject.toml").read_text(), re.MULTILINE)
    assert patterns, "pyproject.toml: list the page's files as package data of duo.api.page"
    listed = re.findall(r'"([^"]+)"', patterns.group(1))
    for file in (root / "duo/api/page").iterdir():
        if file.suffix != ".py" and file.is_file():
            assert any(fnmatch(file.name, pattern) for pattern in listed), file.name


def test_the_page_puts_no_model_text_in_as_markup():
    client = TestClient(unloaded_app(names=["m"]))
    script = client.get("/page/page.js").text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script and "document.write" not in script
    assert "http://" not in script and "https://" not in script  # nothing fetched from elsewhere


def test_the_target_counts_steps_and_their_tokens_as_it_steps():
    metrics = Metrics()
    for committed in (3, 1):
        metrics.on_step(StepRecord(batch_size=4, n_verified=3, n_accepted=committed - 1, n_committed=committed,
                                   seconds=0.01))
    text = metrics.render().decode()
    assert "duo:spec_decode_num_steps_total 2.0" in text
    assert "duo:spec_decode_num_emitted_tokens_total 4.0" in text


def test_text_a_grammar_forces_is_marked_as_the_grammars(served_alone):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 40, "temperature": 0,
            "duo_sources": True,
            "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}}
    found = streamed(served_alone, "/v1/chat/completions", body)
    pieces = [piece for chunk in found if "duo" in chunk
              for piece in check_pieces(chunk, chunk["choices"][0]["delta"].get("content", ""))]
    # Without a draft no chain competes: after the object's opening, the grammar forces the first key's name.
    assert "name" in "".join(text for text, source in pieces if source == "grammar"), pieces
