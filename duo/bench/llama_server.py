"""The bench's llama.cpp peers: llama-server, alone and with its own speculative decoding, pinned like duo.

llama-server is built by scripts/llama_build.py from the llama.cpp that the pinned llama-cpp-python
vendors: the same ggml, the same compiler flags, so what differs from duo is the design, not the kernels.

Modes (each a user's choice of llama.cpp on the same machine):
  llama-server           the target alone on the target's cores
  llama-server-all       the target alone on all cores
  llama-server-spec      speculative decoding (--spec-type draft-simple): the target's threads on the
                         target's cores, the draft's on the draft's cores (the two-device split duo
                         makes); run once per --spec-n-max, labelled llama-server-spec-n8 etc.
  llama-server-spec-all  both models time-sharing all cores (what one box would run)
  llama-server-ngram-mod, llama-server-ngram-simple
                         the context's repeats as drafts (--spec-type ngram-mod / ngram-simple), no draft model
  llama-server-ngram-mod-spec
                         ngram-mod, then the draft model where it finds nothing (--spec-type ngram-mod,draft-simple),
                         pinned as llama-server-spec

Requests are duo's: the same chat prompts, temperature and token count, streamed from
/v1/chat/completions with the prompt cache off (cache_prompt: false) and plain temperature sampling
(top-k, top-p and min-p off, as duo's requests). The client measures time to first token and the
whole request as it does for duo; llama-server's last chunk reports the tokens predicted and, for
speculative modes, the draft tokens it verified and accepted (timings.draft_n / draft_n_accepted).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from duo.bench.structured import response_format, split
from duo.bench.cluster import ROOT, Message, released_together
from duo.bench.report import Run, Variant

PEER_MODES = ("llama-server", "llama-server-fa-off", "llama-server-all", "llama-server-spec", "llama-server-spec-all",
              "llama-server-ngram-mod", "llama-server-ngram-simple", "llama-server-ngram-mod-spec")
# llama-server alone with flash attention off (-fa off): its default (auto) turns it on for a CPU, where llama.cpp's
# kernel reads prompts at half the pace at 4k tokens of context (scripts/bench-results/epyc-context-f16.json) and duo
# turns it off; this is llama-server at its best on a CPU, beside its defaults.
FLASH_OFF = "llama-server-fa-off"
# The n-gram modes: the context's repeats as drafts (llama.cpp's --spec-type ngram-*, its own defaults), alone on the
# target's cores, or ngram-mod first and the draft model where it finds nothing (llama.cpp tries the types in order).
NGRAM_TYPES = {"llama-server-ngram-mod": "ngram-mod", "llama-server-ngram-simple": "ngram-simple",
               "llama-server-ngram-mod-spec": "ngram-mod,draft-simple"}
SPEC_PINNED = "llama-server-spec"  # expanded into one variant per --spec-n-max
CONTEXT = 4096  # per slot, as the bench's own prompts need (the agents' prompts get duo.bench.agents.AGENT_CONTEXT)


def expand_modes(modes: list[str], n_maxes: list[int]) -> list[str]:
    """The modes to run, llama-server-spec once per draft length: llama-server-spec-n4, -n8, ..."""
    return [expanded for mode in modes
            for expanded in ([f"{SPEC_PINNED}-n{n}" for n in n_maxes] if mode == SPEC_PINNED else [mode])]


def is_peer(mode: str) -> bool:
    return mode in PEER_MODES or mode.startswith(f"{SPEC_PINNED}-n")


def cpu_mask(cores: set[int]) -> str:
    """llama.cpp's --cpu-mask: a hex bit mask of the cores."""
    return hex(sum(1 << core for core in cores))


def server_args(mode: str, models: tuple[Path, Path], cores: tuple[set[int], set[int]], port: int,
                parallel: int, context: int = CONTEXT) -> tuple[list[str], set[int]]:
    """llama-server's arguments for `mode` with `context` tokens per slot, and the cores its process may run on.
    Pinned modes pin each model's threads strictly (one thread per core, as duo's processes run)."""
    (target, draft), (target_cores, draft_cores) = models, cores
    all_cores = set(os.sched_getaffinity(0))
    spread = mode.endswith("-all")
    main_cores = all_cores if spread else target_cores
    args = ["--model", str(target), "--host", "127.0.0.1", "--port", str(port), "--parallel", str(parallel),
            "--ctx-size", str(context * parallel), "--threads", str(len(main_cores)),
            "--threads-batch", str(len(main_cores))]
    if not spread:
        mask = cpu_mask(main_cores)
        args += ["--cpu-mask", mask, "--cpu-strict", "1", "--cpu-mask-batch", mask, "--cpu-strict-batch", "1"]
    with_draft = mode.startswith(SPEC_PINNED) or mode.endswith("-spec")
    if mode in NGRAM_TYPES:
        args += ["--spec-type", NGRAM_TYPES[mode]]
    if mode == FLASH_OFF:
        args += ["--flash-attn", "off"]
    if with_draft:
        spec_cores = all_cores if spread else draft_cores
        args += ["--spec-draft-model", str(draft), *([] if mode in NGRAM_TYPES else ["--spec-type", "draft-simple"]),
                 "--spec-draft-threads", str(len(spec_cores)), "--spec-draft-threads-batch", str(len(spec_cores))]
        if not spread:
            mask = cpu_mask(draft_cores)
            args += ["--spec-draft-cpu-mask", mask, "--spec-draft-cpu-strict", "1",
                     "--spec-draft-cpu-mask-batch", mask, "--spec-draft-cpu-strict-batch", "1"]
        n_max = mode.rpartition("-n")[2]
        if n_max.isdigit():
            args += ["--spec-draft-n-max", n_max]
    return args, all_cores if spread else target_cores | (draft_cores if with_draft else set())


def llama_server_binary() -> Path:
    """The cached llama-server, built on first use (scripts/llama_build.py says how long it took)."""
    sys.path.insert(0, str(ROOT / "scripts"))  # a set-up script, run before duo is installed
    from llama_build import ensure_server

    return ensure_server(os.environ.get("CMAKE_ARGS"))


@dataclass
class PeerServer:
    """One llama-server process serving a mode."""

    variant: Variant
    port: int
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(30)


def start_peer(binary: Path, variant: Variant, models: tuple[Path, Path], cores: tuple[set[int], set[int]],
               port: int, parallel: int, log: Path, context: int = CONTEXT) -> PeerServer:
    args, allowed = server_args(variant.mode, models, cores, port, parallel, context)
    with open(log, "wb") as out:
        process = subprocess.Popen([str(binary), *args], stdout=out, stderr=subprocess.STDOUT,
                                   preexec_fn=lambda: os.sched_setaffinity(0, allowed))
    return PeerServer(variant, port, process)


def wait_peer_ready(server: PeerServer, timeout: float = 300) -> None:
    """Until /health answers 200 (the models are loaded); SystemExit if the process exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.variant.label}: llama-server exited ({server.process.returncode}); see its log")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{server.variant.label}: llama-server not ready after {timeout}s")


@dataclass
class PeerAnswer:
    """One streamed chat completion, as the client saw it and as llama-server's last chunk reported it."""

    tokens: int
    seconds: float  # from send to the last chunk
    ttft: float  # from send to the first token's chunk
    draft_n: int
    draft_accepted: int
    sent_s: float = 0.0
    text: str = ""  # the answer (a later turn of the conversation carries it)


def chat_request(prompt: str, temperature: float, max_tokens: int, history: Sequence[Message] = ()) -> dict:
    """llama-server's request for `prompt` asked after `history`, the same conversation duo's chat_request sends."""
    messages = [{"role": role, "content": content} for role, content in history]
    messages.append({"role": "user", "content": split(prompt)[0]})
    return {"messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "cache_prompt": False,
            "stream_options": {"include_usage": True}, **response_format(prompt)}


def read_stream(lines: Iterable[bytes],
                clock: Callable[[], float] = time.perf_counter) -> tuple[float | None, dict, str, str]:
    """(when the first token's chunk arrived, the last chunk's timings, the answer's text, its finish reason) from a
    server-sent event stream."""
    first, timings, text, finish = None, {}, [], ""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        content = "".join(choice.get("delta", {}).get("content") or "" for choice in chunk.get("choices", []))
        if first is None and content:
            first = clock()
        text.append(content)
        timings = chunk.get("timings", timings)
        finish = next((c["finish_reason"] for c in chunk.get("choices", []) if c.get("finish_reason")), finish)
    return first, timings, "".join(text), finish


def answer_tokens(timings: dict, finish: str) -> int:
    """The answer's tokens as duo counts them: llama-server's predicted_n counts the end-of-generation token that
    ended an answer (finish "stop"; the bench sends no stop strings), duo's never does. Seen on Spec-Bench's short
    answers: the same greedy 17-token translation was 17 for duo, 18 for llama-server (6% of its tok/s)."""
    return int(timings.get("predicted_n", 0)) - (finish == "stop")


def peer_generate(address: str, prompt: str, temperature: float, max_tokens: int,
                  history: Sequence[Message] = ()) -> PeerAnswer:
    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=3600)
    began = time.perf_counter()
    body = json.dumps(chat_request(prompt, temperature, max_tokens, history))
    connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise SystemExit(f"llama-server at {address} answered {response.status}: {response.read()[:500]!r}")
    first, timings, text, finish = read_stream(response)
    ended = time.perf_counter()
    connection.close()
    return PeerAnswer(answer_tokens(timings, finish), ended - began, (first or ended) - began,
                      int(timings.get("draft_n", 0)), int(timings.get("draft_n_accepted", 0)), text=text)


def peer_generate_together(address: str, prompts: list[str], temperature: float, max_tokens: int) -> list[PeerAnswer]:
    """Each prompt by its own client, released together (as bench_cluster.generate_together for duo)."""
    answers = []
    for sent_s, answer in released_together(lambda prompt: peer_generate(address, prompt, temperature, max_tokens),
                                            prompts):
        answer.sent_s = sent_s
        answers.append(answer)
    return answers


def run_from_answer(variant: Variant, prompt: str, temperature: float, rep: int, answer: PeerAnswer, *,
                    concurrency: int = 1, batch: int = 0) -> Run:
    """A Run for a llama-server answer: its verify steps and rejections are not reported (0), its draft
    tokens verified and accepted are; verification names its sampler (greedy at T=0)."""
    return Run(variant.mode, variant.link_delay_ms, prompt, temperature, rep, answer.tokens, answer.seconds,
               answer.ttft, 0, answer.draft_n, answer.draft_n, answer.draft_accepted, 0, [], 0, 0, 0.0,
               "greedy" if temperature == 0 else "llama.cpp", 0, concurrency, batch, answer.sent_s)

