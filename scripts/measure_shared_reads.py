"""Two prompts that share a long prefix, sent a moment apart, as an agent starts two sub-agents with one system prompt:
each one's time to its first token on duo-target (the later read follows the earlier one's cells,
duo.target.following) and on llama-server (each slot reads its own), one server at a time on the same core, no draft.

Per server, over /completion with token ids (one token out): request 1 is --shared tokens of code and --own more;
request 2, sent --stagger seconds later, the same --shared tokens and --own others. Each row: both requests' seconds
to their answer (from their own send), the tokens each found cached, and the seconds until both were answered.

    python scripts/measure_shared_reads.py --model ~/.cache/duo/models/qwen2.5-coder-1.5b-instruct-f16.gguf \
        --shared 2048 --own 256 --core 1 --json scripts/bench-results/shared-reads.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from measure_context import code_tokens  # noqa: E402  (scripts beside this one)
from measure_idle_prefixes import add_server_arguments, complete, parsed, serving, write_result  # noqa: E402

SERVERS = ("duo", "llama-server")


def timed(url: str, tokens: list[int], delay: float, began: float) -> dict:
    """Send `tokens` `delay` seconds after `began`: seconds to the answer from the send, and the tokens cached."""
    time.sleep(max(0.0, began + delay - time.monotonic()))
    sent = time.monotonic()
    timings = complete(url, tokens, 1)
    return {"seconds": time.monotonic() - sent, "cached": timings.get("cache_n"), "done_at": time.monotonic() - began}


def measure(server: str, model: Path, prompts: tuple[list[int], list[int]], stagger: float, core: int, logs: Path,
            settle: float) -> dict:
    context = sum(map(len, prompts)) + 64  # llama-server's slots share one cache of --ctx-size cells
    with serving(server, model, context, core, logs, settle) as url:
        began = time.monotonic()
        with ThreadPoolExecutor(2) as pool:
            first, second = pool.map(lambda i: timed(url, prompts[i], i * stagger, began), (0, 1))
    row = {"server": server, "first_s": first["seconds"], "second_s": second["seconds"],
           "first_cached": first["cached"], "second_cached": second["cached"],
           "both_s": max(first["done_at"], second["done_at"])}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_arguments(parser, SERVERS, "/tmp/duo-shared-reads")
    parser.add_argument("--shared", type=int, default=2048, help="the prompts' shared prefix, in tokens")
    parser.add_argument("--own", type=int, default=256, help="each prompt's own tokens after it")
    parser.add_argument("--stagger", type=float, default=2.0, help="seconds between the two requests")
    args, tokenizer = parsed(parser)
    shared = code_tokens(tokenizer, args.shared)
    prompts = (shared + code_tokens(tokenizer, args.own, start=args.shared + 10_000),
               shared + code_tokens(tokenizer, args.own, start=args.shared + 20_000))
    rows = [measure(server, args.model, prompts, args.stagger, args.core, args.logs, args.settle)
            for server in args.servers]
    write_result(args, {"model": args.model.name, "shared": args.shared, "own": args.own, "stagger_s": args.stagger,
                        "rows": rows})


if __name__ == "__main__":
    main()
