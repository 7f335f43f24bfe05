"""A duo-target started with llama-server's launch line serves as that line says: its sampling defaults for the
fields a request leaves out (a request's own field wins), its chat template file, its aliases and tags in /v1/models
(the first alias the model's id, carried by answers without `model`), /slots off, and a line for each flag it
ignores."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from conftest import CONTEXT_SIZE
from duo.net.listening import free_port
from helpers.http import greedy_text, post
from helpers.processes import start

PROMPT = "def fibonacci(n):"
SERVER_LIMIT = 5  # the launch line's -n
# A template no model carries, so that a prompt rendered by it can only come from --chat-template-file.
TEMPLATE = ("{% for message in messages %}[{{ message.role }}] {{ message.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")


@pytest.fixture(scope="module")
def launched(tiny_target: Path, process_logs: Path, tmp_path_factory: pytest.TempPathFactory):
    """duo-target started as a llama-server launch line starts it (greedy by --temp 0; HTTP on --host and --port)."""
    template = tmp_path_factory.mktemp("templates") / "bracketed.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    process = start("duo.cli.target", ["-m", str(tiny_target), "-c", str(CONTEXT_SIZE), "--temp", "0", "--seed", "42",
                                       "-n", str(SERVER_LIMIT), "-a", "zeta,alpha", "--tags", "small,chat",
                                       "--no-slots", "--chat-template-file", str(template), "-ub", "512", "--mlock",
                                       "-np", "2", "--no-kv-unified",
                                       "--host", "127.0.0.1", "--port", str(port)], process_logs)
    process.http_url = f"http://127.0.0.1:{port}"
    yield process
    process.stop()


def test_a_request_without_a_token_limit_gets_the_servers_n_predict_and_one_with_it_keeps_its_own(launched):
    left_out = post(launched, "/completion", {"prompt": PROMPT, "ignore_eos": True}).json()
    assert left_out["tokens_predicted"] == SERVER_LIMIT
    own = post(launched, "/completion", {"prompt": PROMPT, "n_predict": SERVER_LIMIT + 3, "ignore_eos": True}).json()
    assert own["tokens_predicted"] == SERVER_LIMIT + 3
    chat = post(launched, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == SERVER_LIMIT
    openai = post(launched, "/v1/completions", {"prompt": PROMPT, "ignore_eos": True}).json()
    assert openai["usage"]["completion_tokens"] == SERVER_LIMIT  # -n, not the 16 of OpenAI's default


def test_a_request_without_a_temperature_samples_at_the_servers_and_one_with_it_keeps_its_own(launched):
    greedy = greedy_text(launched, PROMPT, 24)
    for _ in range(2):
        body = post(launched, "/completion", {"prompt": PROMPT, "n_predict": 24, "ignore_eos": True}).json()
        assert body["content"] == greedy  # --temp 0: greedy, whatever the seed
    own = [post(launched, "/completion", {"prompt": PROMPT, "n_predict": 24, "ignore_eos": True, "temperature": 1.5,
                                          "seed": seed}).json()["content"] for seed in (1, 2, 3)]
    assert any(text != greedy for text in own)


def test_the_launch_lines_flags_replace_llama_servers_sampling_defaults_one_by_one(launched):
    params = httpx.get(f"{launched.http_url}/props").json()["default_generation_settings"]["params"]
    assert params["temperature"] == 0 and params["seed"] == 42  # --temp 0 --seed 42
    assert (params["top_k"], params["top_p"], params["min_p"]) == pytest.approx((40, 0.95, 0.05))  # llama-server's


def test_the_server_defaults_reach_every_protocol(launched):
    messages = [{"role": "user", "content": "hi"}]
    greedy = post(launched, "/v1/chat/completions", {"messages": messages, "max_tokens": 16,
                                                     "temperature": 0}).json()["choices"][0]["message"]["content"]
    anthropic = post(launched, "/v1/messages", {"messages": messages, "max_tokens": 16}).json()
    assert anthropic["content"][0]["text"] == greedy  # no temperature sent: the server's 0
    responses = post(launched, "/v1/responses", {"input": messages, "max_output_tokens": 16}).json()
    assert responses["output"][-1]["content"][0]["text"] == greedy


def test_ctx_size_with_no_kv_unified_is_the_total_shared_by_the_parallel_requests(launched):
    props = httpx.get(f"{launched.http_url}/props").json()
    assert props["total_slots"] == 2 and props["default_generation_settings"]["n_ctx"] == CONTEXT_SIZE // 2


def test_the_chat_template_file_renders_the_prompt(launched):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    rendered = post(launched, "/apply-template", {"messages": messages}).json()["prompt"]
    assert rendered == "[system] Be brief.\n[user] hi\n[assistant] "


def test_models_lists_one_model_named_by_its_first_alias_with_its_aliases_and_tags(launched):
    for path in ("/v1/models", "/models"):
        listed = httpx.get(f"{launched.http_url}{path}").json()["data"]
        assert [card["id"] for card in listed] == ["alpha"]
        assert listed[0]["aliases"] == ["alpha", "zeta"] and listed[0]["tags"] == ["chat", "small"]
    answer = post(launched, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert answer["model"] == "alpha"
    named = post(launched, "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]})
    assert named.json()["model"] == "gpt-4o"


def test_no_slots_turns_the_slots_endpoint_off_as_llama_server(launched):
    response = httpx.get(f"{launched.http_url}/slots")
    assert response.status_code == 501
    assert "slots endpoint" in response.json()["error"]["message"]


def test_the_log_says_which_of_llama_servers_flags_duo_ignores(launched):
    log = launched.log()
    assert "duo-target ignores llama-server's -ub: performance only" in log
    assert "duo-target ignores llama-server's --mlock: performance only" in log
