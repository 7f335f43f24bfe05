"""Structured output over HTTP and gRPC with the draft attached: the openai SDK's parse(), JSON mode, llama-server's
grammar and json_schema fields; a grammar that cannot compile is a 400 and the server goes on serving."""

from __future__ import annotations

import json

import grpc
import pytest

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.http import client, model_name, post
from helpers.structured import Address, Person

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


def test_the_sdks_parse_gets_a_nested_pydantic_model_with_drafts_accepted(served_sync):
    api = client(served_sync)
    completion = api.beta.chat.completions.parse(model=model_name(served_sync), messages=MESSAGES,
                                                  response_format=Person, max_tokens=120, temperature=0)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    stats = completion.model_extra["duo_stats"]
    assert stats["draft_connected"] and stats["draft_tokens_accepted"] > 0


def test_json_mode_answers_a_json_object_sampled_and_speculated(served_sync):
    response = post(served_sync, "/v1/chat/completions", {
        "messages": MESSAGES, "response_format": {"type": "json_object", "schema": Person.model_json_schema()},
        "max_tokens": 120, "temperature": 0.8, "seed": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    Person.model_validate_json(body["choices"][0]["message"]["content"])
    assert body["duo_stats"]["draft_tokens_accepted"] > 0 and body["duo_stats"]["verification"] == "coupled"


@pytest.mark.parametrize("field, value, check", [
    ("grammar", 'root ::= "yes" | "no" | "maybe"', lambda text: text in ("yes", "no", "maybe")),
    ("json_schema", {"type": "array", "items": {"type": "integer", "maximum": 9}, "maxItems": 3},
     lambda text: isinstance(json.loads(text), list)),
])
def test_llama_servers_grammar_and_json_schema_fields_constrain_a_completion(served_sync, field, value, check):
    response = post(served_sync, "/v1/completions", {"prompt": "Answer:", field: value, "max_tokens": 40,
                                                     "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"])


@pytest.mark.parametrize("served", ["served_alone", "served_sync"])
def test_a_grammar_writing_markup_as_text_is_a_400_saying_to_name_its_token(served, request):
    """llguidance tokenizes the text "<tool_call>" as Qwen's special token and masks every other, then refuses to
    consume that token: the forced drafts failed every request at its first step with a message about chains, and
    an answer decoded alone went on past the refusal, the token repeated to the end. Now the request ends with a
    400 that says how to write it; written as its token, the same grammar is served."""
    server = request.getfixturevalue(served)
    as_text = post(server, "/completion", {"prompt": "hi", "n_predict": 12, "temperature": 0,
                                           "grammar": 'start: "<tool_call>\\n{" /x{20}/'})
    assert as_text.status_code == 400 and "<[id]>" in as_text.json()["error"]["message"], as_text.text
    as_token = post(server, "/completion", {"prompt": "hi", "n_predict": 12, "temperature": 0,
                                            "grammar": 'start: <[151657]> "\\n{" /x{20}/'})
    assert as_token.status_code == 200, as_token.text
    assert as_token.json()["content"].startswith("<tool_call>\n{x")


def test_grpc_generate_takes_a_grammar(served_sync):
    request = pb.GenerateRequest(prompt="Answer:", max_tokens=40,
                                 grammar=pb.Grammar(kind="regex", source="(red|green|blue)!"))
    with grpc.insecure_channel(served_sync.address) as channel:
        text = "".join(r.text for r in pb_grpc.TargetStub(channel).Generate(request, timeout=60))
    assert text in ("red!", "green!", "blue!")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", ["nonsense"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     ["needs json_schema.schema"]),
    ({"grammar": "root ::= undefined-rule"}, "grammar", ["undefined-rule"]),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema", ["one of"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", ["json_schema"]),
], ids=["schema of an unknown type", "json_schema without a schema", "undefined GBNF rule", "two grammars",
        "unknown response_format"])
def test_a_grammar_that_cannot_compile_is_a_400_and_the_server_goes_on(served_sync, body, param, words):
    response = post(served_sync, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and all(word in error["message"] for word in words), error
    ok = post(served_sync, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4})
    assert ok.status_code == 200


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": MESSAGES, "lora": [{"id": 0, "scale": 1.0}]}, "lora"),
    ("/v1/completions", {"prompt": "hi", "post_sampling_probs": True, "n_probs": 2}, "post_sampling_probs"),
    ("/completion", {"prompt": "hi", "grammar": "root ::= \"a\"", "grammar_lazy": True}, "grammar_lazy"),
    ("/completion", {"prompt": "hi", "image_data": [{"data": "AAAA", "id": 1}]}, "image_data"),
], ids=["llama-server's lora", "post_sampling_probs", "a lazy grammar", "llama-server's image_data"])
def test_a_field_llama_server_reads_that_duo_cannot_honour_is_a_400_naming_it_never_dropped(served_alone, path,
                                                                                             body, param):
    response = post(served_alone, path, {"max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"]
    asks_nothing = {name: False if value is True else [] for name, value in body.items() if name == param}
    assert post(served_alone, path, {"max_tokens": 4, **body, **asks_nothing}).status_code == 200


def test_fields_that_change_nothing_are_ignored(served_alone):
    response = post(served_alone, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "name": "ada"}], "max_tokens": 4, "user": "ada",
        "store": False, "metadata": {"a": "b"}, "id_slot": 0})
    assert response.status_code == 200, response.text
    # Fields neither llama-server nor duo reads (Open WebUI copies a user's per-model options verbatim): ignored.
    response = post(served_alone, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi", "audio": {"id": "a1"}}], "max_tokens": 4,
        "reasoning_effort": "high", "num_ctx": 8192, "keep_alive": "5m", "tfs_z": 0.9})
    assert response.status_code == 200, response.text
