"""Real clients' request bodies, each built as the client's own source builds it (the file quoted above it), replayed
against duo-target with its draft attached: each is answered with what the client reads, and drafts were accepted.

Native answers show it in timings.draft_n_accepted, OpenAI ones in duo_stats.draft_tokens_accepted; where a client's
response_fields cut both out, the target's own counter (/metrics) shows it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers.processes import Process
from helpers.http import scrape
from helpers.infill import CHUNKS, PREFIX, SUFFIX, TIMINGS

ACCEPTED = ("duo:spec_decode_num_accepted_tokens_total", ())


def post(process: Process, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{process.http_url}{path}", json=body, timeout=120)


def accepted_while(process: Process, send) -> tuple[object, float]:
    """What `send()` returns, and the draft tokens the target accepted meanwhile (the tests here run one at a time)."""
    before = scrape(process).get(ACCEPTED, 0.0)
    answer = send()
    return answer, scrape(process).get(ACCEPTED, 0.0) - before


def sse_data(text: str) -> list[str]:
    """The payloads of a server-sent-event stream's `data:` lines, as the clients below split them."""
    return [line[5:].strip() for line in text.splitlines() if line.strip().startswith("data:")]


def timings_read_by_llama_vscode(answer: dict) -> None:
    """What llama.vscode's status bar reads of an /infill answer (src/statusbar.ts)."""
    assert isinstance(answer["content"], str) and isinstance(answer["tokens_cached"], int)
    for name in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
                 "predicted_per_second"):
        assert isinstance(answer["timings"][name], (int, float)), name


# --- llama.vscode (ggml-org/llama.vscode) ------------------------------------------------------------------------

# package.json: "llama-vscode.ai_model" defaults to "google/gemini-2.5-flash" (sent as `model` by every request
# below), n_predict 128, max_parallel_completions 3 (n_cmpl), t_max_prompt_ms 500, t_max_predict_ms 500.
VSCODE_MODEL = "google/gemini-2.5-flash"
# src/extra-context.ts: a ring chunk is {text, time: Date.now(), filename}.
VSCODE_CHUNKS = [{"text": text, "time": 1767225600123, "filename": f"/home/dev/project/{name}"}
                 for name, text in CHUNKS]


def llama_vscode_infill(prefix: str, suffix: str, prompt: str, nindent: int) -> dict:
    # ggml-org/llama.vscode src/llama-server.ts, createRequestPayload(noPredict=false, ...), with defaultRequestParams
    # {top_k: 40, top_p: 0.99, stream: false, samplers: ["top_k", "top_p", "infill"], cache_prompt: true}.
    return {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": VSCODE_CHUNKS,
            "prompt": prompt, "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "n_indent": nindent,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 500, "model": VSCODE_MODEL}


@pytest.mark.serial  # each answer ends after 500 ms of wall time: another worker's load beside it lets no draft in
def test_llama_vscodes_ring_update_and_infill_with_its_default_model_answer_three_completions_with_drafts(
        served_sync):
    # ggml-org/llama.vscode src/llama-server.ts, updateExtraContext: createRequestPayload(noPredict=true, "", "",
    # chunks, "", model): the ring chunks sent ahead, nothing generated (no `model` in this branch).
    prep = post(served_sync, "/infill", {"id_slot": 0, "input_prefix": "", "input_suffix": "",
                                         "input_extra": VSCODE_CHUNKS, "prompt": "", "n_predict": 0, "samplers": [],
                                         "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1})
    assert prep.status_code == 200, prep.text
    accepted = []
    # t_max_predict_ms 500 ends each answer after half a second, and the tiny models sample from a flat top-40 at
    # temperature 1 and mostly stop after 3-5 tokens (40-70 ms): a draft must land in the first steps, which one
    # request in two or three lets none do, so the client's request is sent again (as llama.vscode does at the next
    # keystroke) until one is, at most six times.
    for _ in range(6):
        response = post(served_sync, "/infill", llama_vscode_infill(PREFIX, SUFFIX, "", 4))
        assert response.status_code == 200, response.text
        answers = response.json()
        # src/completion.ts, getComplFromContent: one answer ("content" in it) or a list of answers, each's content.
        assert isinstance(answers, list) and [a["index"] for a in answers] == [0, 1, 2]
        for answer in answers:
            timings_read_by_llama_vscode(answer)
        accepted.append(sum(a["timings"]["draft_n_accepted"] for a in answers))
        if accepted[-1]:
            break
    assert accepted[-1] > 0, accepted


def llama_vscode_chat(content: str) -> dict:
    # ggml-org/llama.vscode src/llama-server.ts, createChatRequestPayload(content, model) (getChatCompletion): no
    # max_tokens, so the answer runs to the model's end or the context's.
    return {"messages": [{"role": "system", "content": "You are an expert coder."},
                         {"role": "user", "content": content}],
            "stream": False, "temperature": 0.8, "model": VSCODE_MODEL}


def test_llama_vscodes_chat_with_its_default_model_answers_the_message_it_reads_with_drafts(served_sync):
    response = post(served_sync, "/v1/chat/completions", llama_vscode_chat("Explain what a closure is."))
    assert response.status_code == 200, response.text
    body = response.json()
    # src/types.ts, LlamaChatResponse: choices[0].message.content.
    assert isinstance(body["choices"][0]["message"]["content"], str) and body["choices"][0]["message"]["content"]
    assert body["model"] == VSCODE_MODEL  # echoed, as llama-server serving one model does
    assert body["duo_stats"]["draft_tokens_accepted"] > 0


VSCODE_TOOLS = [  # ggml-org/llama.vscode src/tools.ts, Tools.init: two of the tools it offers, as written there
    {"type": "function", "function": {
        "name": "run_terminal_command",
        "description": "Runs the provided command in a terminal and returns the result. For Windows uses powershell.",
        "parameters": {"type": "object", "properties": {"command": {
            "type": "string", "description": "The command to be executed in the terminal"}}, "required": ["command"]},
        "strict": True}},
    {"type": "function", "function": {
        "name": "search_source",
        "description": "Searches the code base and returns relevant code frangments from the files.",
        "parameters": {"type": "object", "properties": {"query": {
            "type": "string", "description": "The query to search the relevat code"}}, "required": ["query"]},
        "strict": True}},
]
VSCODE_AGENT_MESSAGES = [{"role": "system", "content": "You are a coding agent working in the user's project."},
                         {"role": "user", "content": "Find where the circle's area is computed."}]


def test_llama_vscodes_agent_turn_counts_its_prompt_then_streams_a_tool_turn_with_drafts(served_sync):
    """getAgentCompletion: /v1/models and /props for the limits, /apply-template and /tokenize for the exact prompt
    size, then the streamed tools request with the max_tokens those give (src/language-model-token-limits.ts)."""
    base = served_sync.http_url
    models = httpx.get(f"{base}/v1/models").json()["data"]
    assert len(models) == 1  # "models.length === 1 ? models[0]": llama.vscode takes the only model
    n_ctx = httpx.get(f"{base}/props").json()["default_generation_settings"]["n_ctx"]
    # src/llama-server.ts, applyToolsTemplate (called without tools from countToolsPromptTokens):
    template = post(served_sync, "/apply-template", {"messages": VSCODE_AGENT_MESSAGES, "model": VSCODE_MODEL})
    assert template.status_code == 200, template.text
    prompt = template.json()["prompt"]
    assert isinstance(prompt, str) and VSCODE_AGENT_MESSAGES[1]["content"] in prompt
    # src/llama-server.ts, countTextTokens:
    tokens = post(served_sync, "/tokenize", {"content": prompt, "add_special": False, "parse_special": True})
    prompt_tokens = len(tokens.json()["tokens"])
    bounded = max(1, min(n_ctx, n_ctx // 4))  # resolveBoundedMaxOutputTokens: llama.cpp's n_ctx, a quarter of it
    max_tokens = max(1, min(bounded, n_ctx - prompt_tokens - 256))  # resolveRequestMaxOutputTokens
    # src/llama-server.ts, createToolsRequestPayload(messages, model, stream=true, ...), then request.max_tokens.
    request = {"messages": VSCODE_AGENT_MESSAGES, "stream": True, "model": VSCODE_MODEL, "tools": VSCODE_TOOLS,
               "tool_choice": "auto", "max_tokens": max_tokens}
    response = post(served_sync, "/v1/chat/completions", request)
    assert response.status_code == 200, response.text
    # Parsed as getAgentCompletion's stream reader does: data lines, [DONE] ends it, choices[0].delta's content and
    # tool_calls (by index), finish_reason, usage / timings where a chunk has them.
    payloads = sse_data(response.text)
    assert payloads[-1] == "[DONE]"
    content, calls, finish, stats = "", {}, None, []
    for chunk in map(json.loads, payloads[:-1]):
        if not chunk.get("choices"):
            continue
        choice = chunk["choices"][0]
        finish = choice.get("finish_reason") or finish
        delta = choice.get("delta") or {}
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            calls.setdefault(call.get("index", 0), []).append(call)
        if "duo_stats" in chunk:
            stats.append(chunk["duo_stats"])
    assert finish in ("stop", "length", "tool_calls") and (content or calls)
    for parts in calls.values():
        assert parts[0]["function"]["name"] in {"run_terminal_command", "search_source"} and parts[0]["id"]
    assert stats and stats[-1]["draft_tokens_accepted"] > 0


# --- llama.vim (ggml-org/llama.vim) ------------------------------------------------------------------------------

# autoload/llama.vim: `if exists("g:llama_config.model_fim") && len("g:llama_config.model_fim") > 0` measures the
# string literal, so `model` is always sent: its default, "".
VIM_MODEL = ""


def llama_vim_ring(text: str) -> list[dict]:
    # ggml-org/llama.vim autoload/llama.vim, s:ring_get_extra: {text, time, filename} per chunk.
    return [{"text": text, "time": 1767225600.25, "filename": "geometry/shapes.py"}]


def llama_vim_ring_update(ring: list[dict]) -> dict:
    # ggml-org/llama.vim autoload/llama.vim, s:ring_update ("no samplers needed here").
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": ring, "prompt": "",
            "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""], "model": VIM_MODEL}


def llama_vim_fim(ring: list[dict]) -> dict:
    # ggml-org/llama.vim autoload/llama.vim, llama#fim (n_predict 128, stop_strings [], t_max_prompt_ms 500 of its
    # defaults; t_max_predict_ms 250 for a first request).
    return {"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": ring, "prompt": "",
            "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
            "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 250,
            "response_fields": ["content", *TIMINGS, "truncated", "tokens_cached"], "model": VIM_MODEL}


def ring_text(name: str) -> str:
    return "".join(f"def {name}_{i}(shape):\n    return shape.area() * {i} + {i * 3}\n\n" for i in range(12))


def test_llama_vims_ring_warm_up_reads_the_chunks_so_its_next_fim_reads_fewer_prompt_tokens(served_sync):
    cold, cold_accepted = accepted_while(served_sync, lambda: post(served_sync, "/infill",
                                                                   llama_vim_fim(llama_vim_ring(ring_text("scale")))))
    assert cold.status_code == 200, cold.text
    ring = llama_vim_ring(ring_text("rotate"))  # as long as the cold ring, in other words
    warm_up = post(served_sync, "/infill", llama_vim_ring_update(ring))
    assert warm_up.status_code == 200, warm_up.text
    warm, accepted = accepted_while(served_sync, lambda: post(served_sync, "/infill", llama_vim_fim(ring)))
    assert warm.status_code == 200, warm.text
    cold, warm = cold.json(), warm.json()
    # s:fim_render reads content, tokens_cached and the flattened timings/... fields.
    assert set(warm) == {"content", *TIMINGS, "truncated", "tokens_cached"} and isinstance(warm["content"], str)
    assert warm["tokens_cached"] > cold["tokens_cached"]  # the warm-up's ring is this prompt's prefix
    assert warm["timings/prompt_n"] < cold["timings/prompt_n"]
    assert accepted > 0 and cold_accepted > 0


def llama_vim_inst_warm_up(messages: list[dict]) -> dict:
    # ggml-org/llama.vim autoload/llama.vim, llama#inst: "while the user is providing an instruction, send a warm-up
    # request" (id_slot is the instruction's request id, 0 for the first).
    return {"id_slot": 0, "messages": messages, "samplers": [], "n_predict": 0, "stream": False,
            "cache_prompt": True, "response_fields": [""], "model": VIM_MODEL}


def llama_vim_inst_messages(instruction: str) -> list[dict]:
    # ggml-org/llama.vim autoload/llama.vim, llama#inst_build: the system prompt (the ring's chunks joined as Vim's
    # string() writes dicts), and the user's instruction ("" while it is typed).
    system = ("You are a text-editing assistant. Respond ONLY with the result of applying INSTRUCTION to SELECTION "
              "given the CONTEXT. Maintain the existing text indentation. Do not add extra code blocks. Respond only "
              "with the modified block. If the INSTRUCTION is a question, answer it directly. Do not output any "
              "extra separators. Consider the local context before (PREFIX) and after (SUFFIX) the SELECTION.\n\n"
              "--- CONTEXT     " + "-" * 40 + "\n"
              "{'text': 'def scale(shape, k):\\n    return shape * k\\n', 'time': 1767225600.25, "
              "'filename': 'geometry/shapes.py'}\n"
              "--- PREFIX      " + "-" * 40 + "\nimport math\n\n"
              "--- SELECTION   " + "-" * 40 + "\ndef circle_area(radius):\n    return 3.14 * radius * radius\n"
              "--- SUFFIX      " + "-" * 40 + "\n\n")
    return [{"role": "system", "content": system},
            {"role": "user", "content": "INSTRUCTION: " + instruction if instruction else ""}]


def test_llama_vims_instruction_warm_up_of_n_predict_zero_is_answered_and_its_instruction_streams(served_sync):
    warm_up = post(served_sync, "/v1/chat/completions", llama_vim_inst_warm_up(llama_vim_inst_messages("")))
    assert warm_up.status_code == 200, warm_up.text  # llama.vim reads nothing of it
    usage = warm_up.json()["usage"]  # but its prompt was read into the cache, as llama-server reads it
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] > 0
    # llama#inst_send: the instruction itself, streamed (no n_predict: cut here by the test's client after a few
    # chunks, as the random model would not end it soon); s:inst_on_response reads choices[0].delta.content.
    body = {"id_slot": 0, "messages": llama_vim_inst_messages("use math.pi"), "min_p": 0.1, "temperature": 0.1,
            "samplers": ["min_p", "temperature"], "stream": True, "cache_prompt": True, "model": VIM_MODEL}
    content, first = "", None
    with httpx.stream("POST", f"{served_sync.http_url}/v1/chat/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            first = first or chunk
            if chunk["choices"]:
                content += chunk["choices"][0]["delta"].get("content") or ""
            if len(content) > 40:
                break
    assert content and first["choices"][0]["delta"]["role"] == "assistant"


# --- Continue's llama.cpp provider (continuedev/continue) --------------------------------------------------------

CONTINUE_STOPS = [  # core/autocomplete/templating/AutocompleteTemplate.ts, qwenCoderFimTemplate.completionOptions
    "<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>",
    "<|file_sep|>", "<|im_start|>", "<|im_end|>",
    "/src/", "#- coding: utf-8", "```",  # core/autocomplete/templating/getStopTokens.ts, commonStops
]


def continue_completion(model: str, prompt: str, max_tokens: int) -> dict:
    # continuedev/continue core/llm/llms/LlamaCpp.ts, _streamComplete: {model: this.model, prompt, stream: true,
    # ..._convertArgs(options)}; JSON.stringify drops the options left undefined (frequency/presence penalties,
    # min_p, mirostat, top_k, top_p here). Autocomplete's temperature: 0.01 (core/autocomplete/CompletionProvider.ts);
    # maxTokens: the model's completionOptions.maxTokens (its default, 4096, is past this test's context).
    options = {"n_predict": max_tokens, "frequency_penalty": None, "presence_penalty": None, "min_p": None,
               "mirostat": None, "stop": CONTINUE_STOPS, "top_k": None, "top_p": None, "temperature": 0.01}
    return {"model": model, "prompt": prompt, "stream": True,
            **{name: value for name, value in options.items() if value is not None}}


def test_continues_llama_cpp_autocomplete_streams_content_events_with_drafts_accepted(served_sync):
    # The prompt is qwenCoderFimTemplate's: "<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>".
    prompt = f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"
    response = post(served_sync, "/completion", continue_completion("qwen2.5-coder:1.5b", prompt, 48))
    assert response.status_code == 200, response.text
    # packages/fetch/src/stream.ts, streamSse: "data:" lines parsed as JSON (an `error` in one is raised);
    # LlamaCpp.ts yields each value's `content`.
    values = [json.loads(payload) for payload in sse_data(response.text) if payload != "[DONE]"]
    assert values and not any("error" in value for value in values)
    assert all(isinstance(value["content"], str) for value in values) and "".join(v["content"] for v in values)
    last = values[-1]
    assert last["stop"] is True and last["timings"]["draft_n_accepted"] > 0


# --- LangChain's ChatOpenAI (langchain-ai/langchain, langchain_openai), through the openai SDK --------------------

# libs/partners/openai/langchain_openai/chat_models/base.py: `model_name: str = Field(default="gpt-3.5-turbo",
# alias="model")`; _default_params is {"model": model_name, "stream": streaming (False)} plus the options set;
# ChatOpenAI._get_request_payload renames max_tokens to max_completion_tokens; messages via _convert_message_to_dict
# ({"content", "role"}). stream_usage stays off for a base_url of the user's own.
LANGCHAIN_MODEL = "gpt-3.5-turbo"
LANGCHAIN_MESSAGES = [{"content": "You are a helpful assistant.", "role": "system"},
                      {"content": "Name three prime numbers.", "role": "user"}]


def langchain_client(process: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.http_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_langchains_chat_openai_default_model_is_answered_whole_and_streamed_with_drafts(served_sync):
    api = langchain_client(served_sync)
    # ChatOpenAI(base_url=..., max_tokens=32).invoke(messages)
    whole = api.chat.completions.create(model=LANGCHAIN_MODEL, stream=False, max_completion_tokens=32,
                                        messages=LANGCHAIN_MESSAGES)
    # _create_chat_result reads choices[].message (role, content, tool_calls), finish_reason, usage, model.
    message = whole.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str) and message.content
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 32
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 32 and whole.model == LANGCHAIN_MODEL
    assert whole.model_extra["duo_stats"]["draft_tokens_accepted"] > 0
    # ChatOpenAI(...).stream(messages): the same payload with stream true (_stream).
    chunks = list(api.chat.completions.create(model=LANGCHAIN_MODEL, stream=True, max_completion_tokens=32,
                                              messages=LANGCHAIN_MESSAGES))
    # _convert_chunk_to_generation_chunk reads choices[0].delta (role, content), finish_reason, model.
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["length"]
    assert finishing[0].model_extra["duo_stats"]["draft_tokens_accepted"] > 0


def test_langchains_chat_openai_on_the_responses_api_is_answered_with_drafts(served_sync):
    # ChatOpenAI(use_responses_api=True, max_tokens=32): _construct_responses_api_payload renames max_tokens to
    # max_output_tokens and turns the messages into `input`.
    response = langchain_client(served_sync).responses.create(model=LANGCHAIN_MODEL, stream=False,
                                                              max_output_tokens=32, input=LANGCHAIN_MESSAGES)
    # _construct_lc_result_from_responses_api reads output items (message → output_text), usage, status.
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.usage.output_tokens == 32 and response.usage.input_tokens > 0
    assert response.model_extra["duo_stats"]["draft_tokens_accepted"] > 0


# --- SillyTavern's text completion for llama.cpp (SillyTavern/SillyTavern) ---------------------------------------

def sillytavern_llamacpp(prompt: str, **settings) -> dict:
    """SillyTavern/SillyTavern public/scripts/textgen-settings.js (staging, 1ac6780e), getTextGenGenerationData for
    settings.type LLAMACPP at its default settings (`settings` overrides them; dynatemp off), undefined values
    dropped as JSON.stringify drops them; src/endpoints/backends/text-completions.js (/generate) forwards the whole
    body to `${api_server}/completion`. amount_gen 80 and max_context 2048 are public/script.js's defaults."""
    s = {"temp": 0.7, "top_p": 0.5, "top_k": 40, "top_a": 0, "tfs": 1, "typical_p": 1, "min_p": 0, "rep_pen": 1.2,
         "rep_pen_range": 0, "rep_pen_slope": 1, "min_length": 0, "freq_pen": 0, "presence_pen": 0, "skew": 0,
         "smoothing_factor": 0.0, "smoothing_curve": 1.0, "dry_allowed_length": 2, "dry_multiplier": 0.0,
         "dry_base": 1.75, "dry_sequence_breakers": '["\\n", ":", "\\"", "*"]', "dry_penalty_last_n": 0,
         "max_tokens_second": 0, "seed": -1, "add_bos_token": True, "ban_eos_token": False,
         "skip_special_tokens": True, "mirostat_mode": 0, "mirostat_tau": 5, "mirostat_eta": 0.1,
         "guidance_scale": 1, "negative_prompt": "", "grammar_string": "", "xtc_threshold": 0.1,
         "xtc_probability": 0,
         "samplers": ["top_k", "tfs_z", "typical_p", "top_p", "min_p", "xtc", "temperature"], **settings}
    max_tokens, max_context, stop = 80, 2048, ["\nUser:", "\nSeraphina:"]  # getStoppingStrings: "\n{{user}}:", ...
    return {
        "prompt": prompt, "max_new_tokens": max_tokens, "max_tokens": max_tokens, "temperature": s["temp"],
        "top_p": s["top_p"], "typical_p": s["typical_p"], "typical": s["typical_p"], "sampler_seed": s["seed"],
        "min_p": s["min_p"], "repetition_penalty": s["rep_pen"], "frequency_penalty": s["freq_pen"],
        "presence_penalty": s["presence_pen"], "top_k": s["top_k"], "skew": s["skew"], "min_tokens": s["min_length"],
        "add_bos_token": s["add_bos_token"], "smoothing_factor": s["smoothing_factor"],
        "smoothing_curve": s["smoothing_curve"], "dry_allowed_length": s["dry_allowed_length"],
        "dry_multiplier": s["dry_multiplier"], "dry_base": s["dry_base"],
        "dry_sequence_breakers": s["dry_sequence_breakers"], "dry_penalty_last_n": s["dry_penalty_last_n"],
        "max_tokens_second": s["max_tokens_second"], "samplers": s["samplers"], "stopping_strings": stop,
        "stop": stop, "truncation_length": max_context, "ban_eos_token": s["ban_eos_token"],
        "skip_special_tokens": s["skip_special_tokens"], "top_a": s["top_a"], "tfs": s["tfs"],
        "mirostat_mode": s["mirostat_mode"], "mirostat_tau": s["mirostat_tau"], "mirostat_eta": s["mirostat_eta"],
        "custom_token_bans": "", "banned_strings": [], "api_type": "llamacpp", "api_server": "http://127.0.0.1:8080",
        "xtc_threshold": s["xtc_threshold"], "xtc_probability": s["xtc_probability"],
        # nonAphroditeParams
        "rep_pen": s["rep_pen"], "rep_pen_range": s["rep_pen_range"], "repetition_penalty_range": s["rep_pen_range"],
        "seed": s["seed"], "guidance_scale": s["guidance_scale"], "negative_prompt": s["negative_prompt"],
        "grammar_string": s["grammar_string"], "repeat_penalty": s["rep_pen"], "tfs_z": s["tfs"],
        "repeat_last_n": s["rep_pen_range"], "n_predict": max_tokens, "num_predict": max_tokens,
        "num_ctx": max_context, "mirostat": s["mirostat_mode"], "ignore_eos": s["ban_eos_token"],
        "rep_pen_slope": s["rep_pen_slope"],
        # llamaCppParams (json_schema, empty, deleted)
        "logit_bias": [], "grammar": s["grammar_string"], "cache_prompt": True,
    }


SILLYTAVERN_PROMPT = ("Seraphina's Persona: Seraphina is a guardian of the forest glade.\n"
                      "User: Where am I?\nSeraphina:")


def test_sillytaverns_llama_cpp_text_completion_at_its_neutral_samplers_answers_content_with_drafts(served_sync):
    response = post(served_sync, "/completion", sillytavern_llamacpp(SILLYTAVERN_PROMPT))
    assert response.status_code == 200, response.text
    body = response.json()
    # public/script.js, extractMessageFromData: data.choices?.[0]?.text ?? data.content.
    assert isinstance(body["content"], str) and body["content"] and "\nUser:" not in body["content"]
    assert body["timings"]["draft_n_accepted"] > 0


def test_sillytaverns_llama_cpp_text_completion_with_dry_xtc_and_typical_on_answers_with_drafts(served_sync):
    body = sillytavern_llamacpp(SILLYTAVERN_PROMPT, dry_multiplier=0.8, xtc_probability=0.5, xtc_threshold=0.1,
                                typical_p=0.9)
    response = post(served_sync, "/completion", body)
    assert response.status_code == 200, response.text
    assert isinstance(response.json()["content"], str) and response.json()["timings"]["draft_n_accepted"] > 0


# --- Open WebUI (open-webui/open-webui) --------------------------------------------------------------------------

# src/lib/components/chat/Settings/Advanced/AdvancedParams.svelte: each per-model parameter at the value its
# "Custom" toggle sets; backend/open_webui/utils/payload.py, apply_model_params_to_body_openai, copies every one that
# is not None into the OpenAI body verbatim (those without a cast too), after remove_open_webui_params drops its own
# (stream_response, function_calling, reasoning_tags, system, ...).
OPEN_WEBUI_PARAMS = {"seed": 0, "temperature": 0.8, "reasoning_effort": "medium", "max_tokens": 32, "top_k": 40,
                     "top_p": 0.9, "min_p": 0.0, "frequency_penalty": 1.1, "presence_penalty": 0.0, "mirostat": 0,
                     "mirostat_eta": 0.1, "mirostat_tau": 5.0, "repeat_last_n": 64, "tfs_z": 1, "repeat_penalty": 1.1,
                     "use_mmap": True, "use_mlock": True, "think": True, "keep_alive": "5m", "num_keep": 24,
                     "num_ctx": 2048, "num_batch": 512, "num_thread": 2, "num_gpu": 0}


def test_open_webuis_per_model_parameters_copied_verbatim_are_answered_streamed_with_drafts(served_sync):
    # backend/open_webui/routers/openai.py, generate_chat_completion: the chat's payload (model, messages, stream)
    # with the model's params applied; max_tokens is the user's value (the toggle's is 128).
    body = {"model": "qwen2.5-coder:1.5b", "messages": [{"role": "user", "content": "Write a haiku about rain."}],
            "stream": True, **OPEN_WEBUI_PARAMS}
    response = post(served_sync, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    payloads = sse_data(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    # Open WebUI's stream handler reads choices[0].delta.content and finish_reason, and usage where sent.
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finishing = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert [c["choices"][0]["finish_reason"] for c in finishing] == ["length"]
    assert finishing[0]["duo_stats"]["draft_tokens_accepted"] > 0
