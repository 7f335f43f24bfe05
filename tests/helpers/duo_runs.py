"""The prompts and sampled runs of a served duo (target and draft) that several end-to-end tests share."""

from __future__ import annotations

import threading

import grpc

from duo.net._proto import duo_pb2 as pb
from duo.net._proto import duo_pb2_grpc as pb_grpc
from helpers.processes import generate


SAMPLED_PROMPT = "Once upon a time"  # the sampling tests' prompt


PROMPTS = ["def fibonacci(n):", "Once upon a time", "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"]


def sample_positions(address: str, n: int, n_tokens: int, *, seeded: bool = False,
                     **truncation: float) -> tuple[list[list[int]], list[pb.Stats]]:
    """n generations of SAMPLED_PROMPT at temperature 1, run 4 at a time: their token ids and stats.
    Unseeded, the target verifies by residual rejection sampling (its default --unseeded); seeded
    (seeds 0..n-1), by coupled sampling."""
    results: list[list[int]] = [[] for _ in range(n)]
    stats: list[pb.Stats] = [pb.Stats() for _ in range(n)]

    def work(offset: int) -> None:
        for i in range(offset, n, 4):
            results[i], last = generate(address, SAMPLED_PROMPT, max_tokens=n_tokens, temperature=1.0,
                                        seed=i if seeded else None, **truncation)
            stats[i] = last.stats

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, stats


def stream_and_interrupt(address: str, prompt: str, max_tokens: int, interrupt, temperature: float = 0.0,
                         seed: int | None = None, with_draft: bool = True) -> tuple[list[int], int]:
    """Stream a generation (greedy by default), calling `interrupt` once 10% of it has arrived (with draft
    help, unless `with_draft` is False); the tokens, and the draft tokens received by then."""
    request = pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens,
                                 sampling=pb.SamplingParams(temperature=temperature, seed=seed))
    tokens, received_at_interrupt = [], 0
    with grpc.insecure_channel(address) as channel:
        for response in pb_grpc.TargetStub(channel).Generate(request, timeout=120):
            tokens.extend(response.token_ids)
            if (interrupt is not None and len(tokens) >= max_tokens // 10
                    and (response.stats.draft_tokens_received or not with_draft)):
                received_at_interrupt = response.stats.draft_tokens_received
                interrupt()
                interrupt = None
    return tokens, received_at_interrupt
