"""duo-target: its command line, and its process: listen for clients at once, load the model in the background,
then serve and link the draft."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from grpc_health.v1 import health

from duo.api.serving.admit import Admission
from duo.api.serving.generate import Completions
from duo.api.grpc import client_server, set_serving
from duo.api.http import create_app, http_server
from duo.api.serving.metrics import Metrics
from duo.llama.backends import on_native_abort
from duo.constraint import build_tokenizer_in_background, tokenizer_for
from duo.llama.model import MAX_SEQUENCES, N_BATCH, Model, ModelError
from duo.llama.parking import DEFAULT_LIMIT_MIB
from duo.models.hub import DEFAULT_TARGET, HubError, resolve_model
from duo.cli.process import (add_process_arguments, check_can_listen, flash_attention, freeze_startup_heap, metrics_server,
                             model_options, run_async, run_server, setup_logging)
from duo.llama.worker import ModelWorker
from duo.net.listening import listen_socket
from duo.net.timeouts import WRITE_TIMEOUT_S
from duo.sampling.verification import COUPLED, RESIDUAL
from duo.target.target import Target
from duo.cli.target_drafts import add_draft_arguments, check_draft_flags, describe_drafts, serve_drafts, wants_drafts
from duo.cli.llama_flags import add_llama_server_arguments, flags_table, ignored_lines, refusal
from duo.cli.llama_launch import (context_per_request, cors_origins, http_addresses, launch_settings, served_names,
                                  template_options)
from duo.target.request import SpecSettings
from duo.net.tls import check_pair, server_credentials

log = logging.getLogger("duo.target")

# How long the process lives on after losing an RPC server, for its clients to hear why.
LOST_RPC_GRACE_S = 1.0
# On SIGTERM, what the requests in flight get to finish (below the 30 s a container manager waits).
SHUTDOWN_GRACE_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    defaults = SpecSettings()
    parser = argparse.ArgumentParser(
        prog="duo-target", description="Generate with the target model, verifying in batches the chain tokens "
                                       "that duo-draft streams; serve clients over gRPC (and OpenAI-compatible HTTP).",
        epilog=flags_table(), formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)  # a llama-server flag duo lacks must never be read as a duo flag it begins
    add_process_arguments(parser, model=DEFAULT_TARGET, listen="127.0.0.1:7071", serves="clients (gRPC and HTTP)", per="request")
    spec = parser.add_argument_group(
        "speculation", "By default the draft length is chosen adaptively every step from measured costs and "
                       "acceptance; --draft-max, --max-ahead or --sync fix it and turn the adaptive policy off.")
    spec.add_argument("--draft-max", type=int, default=None, metavar="N",
                      help="verify up to N draft tokens in every batch; fixes the draft length and turns the adaptive "
                           f"policy off (default: adaptive, up to {defaults.draft_max})")
    spec.add_argument("--draft-min", type=int, default=defaults.draft_min, metavar="N",
                      help="verify no draft tokens while fewer than N are pending")
    spec.add_argument("--draft-p-min", type=float, default=defaults.draft_p_min, metavar="P",
                      help="the draft proposes nothing, until the next commit, where its most probable token has "
                           "less probability than P (a rule that never looks at the token drawn: sampling stays exact)")
    spec.add_argument("--max-ahead", type=int, default=None, metavar="N",
                      help="let the draft run at most N tokens ahead of the committed ones; turns the adaptive "
                           "policy off (default: steered adaptively; 2 x --draft-max when that is given)")
    spec.add_argument("--sync", type=int, default=0, metavar="K",
                      help="for comparison only: llama.cpp's classic synchronous loop (draft K tokens, then verify "
                           "them, the two models taking turns) instead of duo's; turns the adaptive policy off")
    spec.add_argument("--no-lookup", dest="lookup", action="store_false",
                      help="propose no free drafts from the context: by default, where the text repeats an earlier "
                           "2-4 token n-gram of the prompt or the output, what followed it is verified too (after "
                           "the draft's chain, or alone without a draft), with its acceptance learnt apart")
    spec.add_argument("--unseeded", choices=[RESIDUAL, COUPLED], default=defaults.unseeded,
                      help="how sampled requests without a seed are verified: residual rejection sampling (the "
                           "draft sends each token's q; the best acceptance measured, see README) or coupled "
                           "sampling with a seed the target draws. Requests with a seed are always coupled: the "
                           "seed alone decides their text, with or without a draft (default: %(default)s)")
    clients = parser.add_argument_group("clients")
    clients.add_argument("--http", default=None, metavar="[HOST:]PORT",
                         help="also serve the HTTP API (OpenAI's chat, completions and responses, Anthropic's "
                              "messages, llama-server's native endpoints, /v1/models, /health, /metrics) here; HOST "
                              "defaults to 127.0.0.1")
    clients.add_argument("--alias", action="append", default=[], metavar="NAMES",
                         help="the model's names, comma-separated (repeatable; llama-server's -a): /v1/models lists "
                              "the first in sorted order as its id, with all of them as its aliases; a request may "
                              "name any model, as llama-server serving one model answers whatever `model` says")
    clients.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                         help="answer browsers' cross-origin requests only from this origin, e.g. "
                              "http://localhost:3000 (repeatable; requests from other origins are refused with a "
                              "403; default: any origin is echoed, as llama-server does; preflights never need the "
                              "API key)")
    clients.add_argument("--parallel", type=int, default=4, metavar="N",
                         help="generations running at once, every one's step decoded in one batched model call "
                              "(one context of --ctx-size x N cells, each generation up to --ctx-size tokens)")
    clients.add_argument("--batch-size", type=int, default=N_BATCH, metavar="N",
                         help="the most tokens one model call decodes (llama-server's -b): a prompt is read N tokens "
                              "a call, as llama-server reads it, and a verify step holds at most N "
                              "(default: %(default)d)")
    clients.add_argument("--queue-size", type=int, default=64, metavar="M",
                         help="requests waiting for a turn (first come, first served); more are refused with "
                              "HTTP 503 / RESOURCE_EXHAUSTED")
    clients.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S, metavar="SECONDS",
                         help="on SIGTERM or SIGINT, refuse new requests (503 / UNAVAILABLE, health NOT_SERVING) and "
                              "let running ones finish for this long; the rest then end with an error of their "
                              "API's shape (default: %(default)g)")
    clients.add_argument("--write-timeout", type=float, default=WRITE_TIMEOUT_S, metavar="SECONDS",
                         help="drop a streaming client that takes no data for this long (it stopped reading), "
                              "freeing its place (default: %(default)g)")
    clients.add_argument("--api-key", default=None, metavar="KEY",
                         help="require `Authorization: Bearer KEY` (HTTP; also `X-Api-Key: KEY` or the bare key) or "
                              "the metadata `authorization: Bearer KEY` (gRPC) on every client call; health checks, "
                              "reflection, /v1/models and /metrics stay open "
                              "(default: $DUO_API_KEY, else no key). Visible to every user of this machine in "
                              "its process list: prefer --api-key-file or $DUO_API_KEY")
    # "" for --metrics alone: on the HTTP port only (falsy: no server of its own); None: off.
    clients.add_argument("--metrics", nargs="?", default=None, const="", metavar="[HOST:]PORT",
                         help="serve Prometheus metrics (duo's, and llama-server's llamacpp:*) at /metrics on the "
                              "HTTP port, as llama-server's --metrics (without it /metrics answers 501, as there); "
                              "with [HOST:]PORT also at http://HOST:PORT/metrics (HOST: 127.0.0.1 unless given), as "
                              "duo-draft --metrics does")
    clients.add_argument("--no-prompt-cache", action="store_true",
                         help="share no prompt prefix between requests (by default a request starts from the "
                              "longest prefix of its prompt that the cache holds, whoever sent it; usage reports "
                              "it as cached_tokens); one request opts out with cache_prompt: false")
    clients.add_argument("--cache-ram", type=int, default=DEFAULT_LIMIT_MIB, metavar="MIB",
                         help="host memory where idle requests' prefixes wait for their conversation's next turn, "
                              "out of the KV cache, whose every cell the running requests' tokens read whoever holds "
                              f"it (llama-server's -cram; default {DEFAULT_LIMIT_MIB}, -1: no limit, 0: they stay "
                              "in the cache)")
    clients.add_argument("--api-key-file", default=None, metavar="FILE",
                         help="read the API key from the first line of FILE (kept out of the process list)")
    add_draft_arguments(parser)
    add_llama_server_arguments(parser)
    return parser


def settings_from(args: argparse.Namespace) -> SpecSettings:
    """Adaptive unless --draft-max, --max-ahead or --sync fixes the speculation."""
    defaults = SpecSettings()
    if (args.draft_max or 0) < 0 or args.draft_min < 0 or not 0 <= args.draft_p_min <= 1:
        raise ValueError("--draft-max and --draft-min must be >= 0 and --draft-p-min between 0 and 1")
    if args.sync < 0:
        raise ValueError("--sync must be >= 0")
    if args.batch_size < 1:
        raise ValueError("--batch-size must be >= 1")
    for flag, value in (("--draft-max", args.draft_max), ("--sync", args.sync)):
        if value is not None and value + 1 > args.batch_size:
            raise ValueError(f"{flag} {value} is too large: a verify step decodes {flag} + 1 tokens in one call of "
                             f"at most --batch-size {args.batch_size}; use {flag} {args.batch_size - 1} or less")
    if args.sync:
        return SpecSettings(draft_max=args.sync, draft_min=args.draft_min, draft_p_min=args.draft_p_min,
                            max_ahead=args.sync, adaptive=False, sync=args.sync, unseeded=args.unseeded,
                            lookup=args.lookup)
    adaptive = args.draft_max is None and args.max_ahead is None
    draft_max = defaults.draft_max if args.draft_max is None else args.draft_max
    max_ahead = args.max_ahead if args.max_ahead is not None else (
        2 if adaptive else 2 * draft_max)
    return SpecSettings(draft_max=draft_max, draft_min=args.draft_min, draft_p_min=args.draft_p_min,
                        max_ahead=max(1, max_ahead), adaptive=adaptive, unseeded=args.unseeded, lookup=args.lookup)


def api_key_from(args: argparse.Namespace) -> str | None:
    """The clients' key: --api-key, else the first line of --api-key-file, else $DUO_API_KEY, else none."""
    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {error.strerror or error}") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--api-key-file: {args.api_key_file} holds no key on its first line")
        return lines[0].strip()
    return args.api_key or os.environ.get("DUO_API_KEY") or None


def check_client_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag that is wrong."""
    refused = refusal(args)
    if refused:
        raise ValueError(refused)
    check_can_listen(args.listen)
    http_addresses(args)
    cors_origins(args)
    template_options(args)
    launch_settings(args)
    api_key_from(args)
    check_draft_flags(args)
    if not 1 <= args.parallel <= MAX_SEQUENCES or args.queue_size < 0:
        raise ValueError(f"--parallel must be between 1 and {MAX_SEQUENCES} (llama.cpp's sequences per context) "
                         "and --queue-size >= 0")
    if args.ctx_size < 0:
        raise ValueError("--ctx-size must be >= 0 (0: the model's training context)")
    if not args.write_timeout > 0:
        raise ValueError("--write-timeout must be > 0")
    if not args.shutdown_grace >= 0:
        raise ValueError("--shutdown-grace must be >= 0")
    check_pair(args.tls_cert, args.tls_key, "--tls-cert/--tls-key")


def request_context(args: argparse.Namespace, model: Model) -> int:
    """Positions a request may reach: --ctx-size, or where it is 0 (the default) the model's training context, as
    llama-server's default (-c 0) serves a prompt as long as the model reads (agents send 6-18k tokens); with
    --no-kv-unified the share of --parallel requests in it, as llama-server's."""
    return context_per_request(args.ctx_size, model.n_ctx_train, args.parallel, args.kv_unified)


def load_model(path: Path, args: argparse.Namespace, options: dict[str, Any]) -> Model:
    """Load, check and warm up the model (runs on the model thread, off the event loop)."""
    model = Model(path, **options)
    if wants_drafts(args) and not model.can_rollback:
        raise ModelError(f"{path.name} is a recurrent/hybrid model; speculation needs rollback")
    model.warm_up()
    model.vocab()  # the draft link's handshake sends it: built here rather than on the event loop
    build_tokenizer_in_background(model)
    return model


async def serve(args: argparse.Namespace, path: Path, settings: SpecSettings, options: dict[str, Any],
                lost: LostRpcServer | None = None) -> None:
    """Listen at once (health NOT_SERVING, requests UNAVAILABLE / 503), load the model in the
    background, then report SERVING and keep the draft linked until stopped."""
    api_key = api_key_from(args)
    metrics = Metrics()
    completions = Completions(Admission(args.parallel, args.queue_size), metrics, served_names(path, args.model, args.alias))
    health_servicer = health.aio.HealthServicer()
    await set_serving(health_servicer, False)
    server = client_server(completions, health_servicer, api_key, write_timeout=args.write_timeout)
    http = []
    addresses = http_addresses(args)
    if addresses:
        app = create_app(completions, metrics, api_key, write_timeout=args.write_timeout,
                         cors_origins=cors_origins(args), launch=launch_settings(args))
        http.extend((http_server(app, tls_cert=args.tls_cert, tls_key=args.tls_key, debug=args.log_level == "DEBUG"),
                     listen_socket(address)) for address in addresses)  # llama-server's --host a,b: one each
    if args.metrics:
        http.append(metrics_server(metrics.registry, args.metrics))

    async def load_then_link() -> None:
        worker = ModelWorker()
        began = time.monotonic()
        model = await worker.run(load_model, path, args, options)
        if lost:
            lost.loop, lost.worker = asyncio.get_running_loop(), worker
        n_ctx = request_context(args, model)
        target = Target(model, worker, drafts=wants_drafts(args), n_ctx=n_ctx, settings=settings, parallel=args.parallel,
                        prompt_cache=not args.no_prompt_cache, flash_attn=flash_attention(args),
                        n_batch=args.batch_size, cache_ram=args.cache_ram)
        target.observers.append(metrics)
        target.call_observers.append(metrics)
        await target.batcher()  # the shared context: a size that does not fit fails here, not at a request
        # The grammar vocabulary's last step (llguidance's, ~0.6 s for 152k tokens) holds the GIL throughout: paid
        # before serving, not as a pause of every request in the first seconds of serving.
        await asyncio.to_thread(tokenizer_for, model)
        completions.ready(target, n_ctx)
        freeze_startup_heap()  # before serving, while a pause costs nobody a wait
        admission = completions.admission
        metrics.watch(draft_state=lambda: completions.draft_state,
                      draft_len=lambda: target.control.draft_len,
                      spec_on=lambda: float(target.control.any_speculating()),
                      spec_gain=lambda: target.control.best_gain() or 0.0,
                      running=lambda: admission.running, waiting=lambda: admission.waiting)
        log.info("model loaded in %.1f s: serving %s (%s; context %d per request, %d at once), %s",
                 time.monotonic() - began, path.name, model.placement(), n_ctx, args.parallel,
                 describe_drafts(args))
        metrics.watch_drafts(completions.drafts)
        await set_serving(health_servicer, True)
        await serve_drafts(args, target, model, settings, metrics)

    endpoints = ([f"gRPC on {args.listen}"] + [f"HTTP on {address}" for address in addresses]
                 + ([f"metrics on {args.metrics}"] if args.metrics else []))
    security = " over TLS" if args.tls_cert else ""
    async def drain() -> None:
        log.info("stopping: no new requests; %d running and %d waiting get up to %g s to finish",
                 completions.admission.running, completions.admission.waiting, args.shutdown_grace)
        await set_serving(health_servicer, False)
        await completions.drain(args.shutdown_grace)

    await run_server(server, args.listen,
                     f"duo-target listening for clients{security} ({', '.join(endpoints)}); loading {path.name}",
                     credentials=server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None,
                     http=http, background=load_then_link, draining=drain)


class LostRpcServer:
    """What duo-target does when llama.cpp aborts because an RPC server holding some of the target's
    layers is gone (or answered wrongly): the layers went with it, so no request can go on. It tells
    the running requests' clients why, says it in the log, and lets the process end."""

    def __init__(self, servers: list[str]) -> None:
        self.servers = servers
        self.loop: asyncio.AbstractEventLoop | None = None  # set once the model runs
        self.worker: ModelWorker | None = None

    def on_abort(self, message: str) -> None:
        """Runs on the llama.cpp thread that is about to abort the process."""
        servers = ", ".join(self.servers)
        log.critical("llama.cpp stopped (%s): the target's layers live on the RPC servers %s, and one of them is "
                     "gone or answered wrongly. duo-target exits; restart it once every server runs.",
                     message.strip(), servers)
        if self.loop is not None and self.worker is not None:
            self.loop.call_soon_threadsafe(self.worker.break_down, f"the target lost one of its RPC servers "
                                           f"({servers}) and is exiting; retry once it runs again")
            time.sleep(LOST_RPC_GRACE_S)  # the clients' error responses go out meanwhile
        logging.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        settings = settings_from(args)
        check_client_flags(args)
        options = model_options(args) | template_options(args)
        for line in ignored_lines(args):
            log.info(line)
        lost = LostRpcServer(options["rpc"]) if options["rpc"] else None
        if lost:
            on_native_abort(lost.on_abort)
        return run_async(serve(args, resolve_model(args.model), settings, options, lost))
    except (HubError, ModelError, ValueError) as error:
        print(f"duo-target: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
