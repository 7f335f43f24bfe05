"""What an editor's warm-up saves: the time to first token of an /infill with and without a warm-up before it.

Against a running duo-target (or llama-server) at URL, for each round: an /infill cold (other files' chunks no
request has read), then a warm-up (`n_predict: 0`) of fresh chunks followed by the same /infill over them, as
llama.vim and llama.vscode send them. Prints each request's prompt tokens, cached tokens and time to first token
(timings.prompt_ms: arrival to the first token), and the medians. The chunks must fit the context's budget for
them: past it, the request keeps its last chunks within what the context leaves after its n_predict (as
llama-server's /infill does), so a warm-up (n_predict 0) and the completion keep different chunks and share no prefix.

    python scripts/measure_warm_up.py http://127.0.0.1:8000 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import uuid

import httpx

PREFIX = "def parse_config(path):\n    with open(path) as f:\n        lines = f.read().splitlines()\n"
SUFFIX = "\n    return config\n"


def ring(tag: str, chunks: int) -> list[dict[str, str]]:
    """Other files' chunks, as editors send them, made unique by `tag` so that no cache holds them yet."""
    return [{"filename": f"src/module_{tag}_{i}.py",
             "text": "".join(f"def helper_{tag}_{i}_{j}(value):\n    return value * {j} + {i}\n\n" for j in range(12))}
            for i in range(chunks)]


def infill(client: httpx.Client, url: str, extra: list[dict[str, str]], n_predict: int) -> dict:
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "    config = {}",
            "n_predict": n_predict, "temperature": 0, "cache_prompt": True,
            "samplers": ["top_k", "top_p", "infill"], "top_k": 40, "top_p": 0.99}
    response = client.post(f"{url}/infill", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="duo-target's (or llama-server's) HTTP address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunks", type=int, default=3, help="other files' chunks per request (default: 3)")
    parser.add_argument("--n-predict", type=int, default=16)
    args = parser.parse_args()
    cold_ms, warm_ms = [], []
    with httpx.Client() as client:
        for round_ in range(args.rounds):
            cold = infill(client, args.url, ring(uuid.uuid4().hex[:8], args.chunks), args.n_predict)
            extra = ring(uuid.uuid4().hex[:8], args.chunks)
            infill(client, args.url, extra, 0)  # the warm-up
            warm = infill(client, args.url, extra, args.n_predict)
            for name, answer, times in (("cold", cold, cold_ms), ("warmed", warm, warm_ms)):
                times.append(answer["timings"]["prompt_ms"])
                print(f"round {round_} {name:6}: prompt {answer['tokens_evaluated']} tokens, "
                      f"{answer['tokens_cached']} cached, first token after {times[-1]:.0f} ms")
    print(f"median time to first token: cold {statistics.median(cold_ms):.0f} ms, "
          f"after a warm-up {statistics.median(warm_ms):.0f} ms")


if __name__ == "__main__":
    main()
