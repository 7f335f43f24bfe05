"""duo-draft: its command line and start-up: load the draft model, serve targets over gRPC (duo.draft.service) that dial
in, and join targets that wait for drafts (--join, duo.draft.joining)."""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import grpc

from duo.net import wire
from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.constraint import build_tokenizer_in_background
from duo.draft.drafter import KV_CELLS_PER_CONTEXT, SESSION_CELLS, Drafter
from duo.draft.joining import Joiner, join_all
from duo.draft.metrics import DraftMetrics
from duo.draft.service import DraftServicer, SessionLimits
from duo.draft.window import DEFAULT_SINK, DEFAULT_WINDOW, MIN_WINDOW, Window
from duo.llama.backends import gpu_layers_for
from duo.llama.model import MAX_SEQUENCES, Model, ModelError
from duo.llama.parking import DEFAULT_LIMIT_MIB
from duo.models.hub import (CATALOG, CPU_DRAFT, DEFAULT_DRAFT, HubError, default_draft, is_present, pull,
                            resolve_model)
from duo.cli.process import (add_process_arguments, check_can_listen, flash_attention, freeze_startup_heap, host_port,
                             is_loopback, metrics_server, model_options, run_async, run_server, setup_logging)
from duo.llama.worker import ModelWorker
from duo.net.listening import HttpServer
from duo.net.options import grpc_server_options
from duo.net.tls import channel_credentials, check_pair, server_credentials
from duo.net.wire import MAX_BRANCHES

log = logging.getLogger("duo.draft")

DEFAULT_LISTEN = "127.0.0.1:7070"  # where duo-draft listens for targets when it joins none


def session_context(args: argparse.Namespace, model: Model) -> int:
    """Positions a session may reach: --ctx-size, or where it is 0 (the default) the model's training context, as
    llama-server sizes its context: a draft must hold the prompts its targets serve (agents send 6-18k tokens)."""
    return min(args.ctx_size or model.n_ctx_train, model.n_ctx_train)


def describe_placement(model: Model, drafter: Drafter, args: argparse.Namespace) -> str:
    """The model, where it runs, and what it holds, for the start-up line."""
    window = drafter.window
    reach = (f"a window of the last {window.size} tokens after the first {window.sink} per session"
             if window.size else f"context {drafter.n_ctx} per session")
    return (f"{model.path.name} ({model.placement()}; {reach}, up to "
            f"{args.max_sessions} sessions in {drafter.cells} KV cells)")


def draft_model(args: argparse.Namespace) -> Path:
    """--model's file, or where none is named the catalog draft for the device it will run on (its Q4_0 copy on a
    CPU, made from the published draft on first use), logged with why."""
    if args.model is not None:
        return resolve_model(args.model)
    path, why = default_draft_path(on_gpu=gpu_layers_for(args.device, args.gpu_layers) != 0)
    log.info("drafting with %s: %s", path.name, why)
    return path


def default_draft_path(on_gpu: bool) -> tuple[Path, str]:
    """The device's default draft (duo.models.catalog.default_draft) and why; a copy the published draft derives is
    made here when that is present (seconds), never downloaded (ModelNotPulledError says to pull)."""
    name, why = default_draft(on_gpu)
    source = CATALOG[name].derived_from
    if not is_present(name) and source and is_present(source):
        log.info("making %s from %s (once)", name, source)
        pull([name], progress=False)
    return resolve_model(name), why


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duo-draft", description=__doc__, allow_abbrev=False)  # no flag by its prefix
    add_process_arguments(parser, model=None, listen=DEFAULT_LISTEN, serves="targets", per="session",
                          model_default=f"the fastest for its device: {CPU_DRAFT} on a CPU, {DEFAULT_DRAFT} on a GPU")
    parser.set_defaults(listen=None)  # not given: listen_address decides, by --join
    parser.add_argument("--top-k-cap", type=int, default=10,
                        help="when sampling with residual verification, draft among at most this many tokens, whose "
                             "probabilities travel to the target (output stays exact; coupled sessions send none "
                             "and draft from the whole distribution)")
    parser.add_argument("--tls-ca", default=None, metavar="PEM",
                        help="mutual TLS: accept only targets presenting a certificate signed by this PEM CA")
    limits = SessionLimits()
    parser.add_argument("--max-sessions", type=int, default=limits.total, metavar="N",
                        help="sessions drafted at once over all targets, each up to --ctx-size positions in the "
                             "shared KV cache (--kv-cells); beyond, a target decodes alone for the new one")
    parser.add_argument("--kv-cells", type=int, default=None, metavar="N",
                        help="KV cache cells shared by all sessions, allocated at start (default: "
                             f"{KV_CELLS_PER_CONTEXT} x --ctx-size up to {SESSION_CELLS}, at least --ctx-size; with "
                             f"--window, {KV_CELLS_PER_CONTEXT} x the window and a batch); a session that finds no room "
                             "decodes alone")
    parser.add_argument("--cache-ram", type=int, default=DEFAULT_LIMIT_MIB, metavar="MIB",
                        help="host memory where closed sessions' prefixes wait for their conversation's next turn, "
                             "out of the KV cache, whose every cell the running sessions' tokens read whoever holds "
                             "it (as duo-target's; default %(default)s, -1: no limit, 0: they stay in the cache)")
    parser.add_argument("--max-sessions-per-target", type=int, default=limits.per_target, metavar="N",
                        help="sessions drafted at once for one target connection")
    parser.add_argument("--window", type=int, default=DEFAULT_WINDOW, metavar="N",
                        help="keep only a session's last N tokens (after its first --window-sink) in the draft's KV "
                             "cache, 0: all of them. Trades a little acceptance far into long prompts for a prompt "
                             "read of at most N tokens, a per-token time that stays at the short-context level, and "
                             "sessions as long as the target's context whatever --ctx-size says (the output stays "
                             "the target's: it verifies every token); a window no shorter than --ctx-size is none "
                             "(default: %(default)s)")
    parser.add_argument("--window-sink", type=int, default=DEFAULT_SINK, metavar="N",
                        help="with --window, also keep a session's first N tokens, the start of its system prompt "
                             "(default: %(default)s)")
    parser.add_argument("--max-branches", type=int, default=MAX_BRANCHES, metavar="N",
                        help="in spare time, draft up to N branches per chain: continuations for the target "
                             "committing the draft's next-best token where it was least sure (0: none)")
    parser.add_argument("--branch-len", type=int, default=0, metavar="N",
                        help="tokens drafted after a branch's assumed token (default: half the draft length "
                             "the target's policy prefers, at least 2)")
    parser.add_argument("--metrics", default=None, metavar="[HOST:]PORT",
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST: 127.0.0.1 unless given)")
    join = parser.add_argument_group("joining targets", "dial out to duo-target --draft-listen (a draft behind NAT "
                                                        "or a firewall), besides serving targets that dial --listen")
    join.add_argument("--join", action="append", default=[], metavar="TARGET:PORT",
                      help="draft for the duo-target whose --draft-listen is TARGET:PORT, joining it again whenever "
                           "the link drops (repeat to join several targets). A draft that joins listens on no port "
                           f"unless --listen is given (else on {DEFAULT_LISTEN}): several on one machine, one per "
                           "GPU, need no ports of their own")
    join.add_argument("--join-tls-ca", default=None, metavar="PEM",
                      help="join over TLS, trusting the CA in this PEM file for the targets' certificates")
    join.add_argument("--join-tls-cert", default=None, metavar="PEM",
                      help="present this PEM certificate to the targets (for a target that requires client "
                           "certificates: mutual TLS)")
    join.add_argument("--join-tls-key", default=None, metavar="PEM", help="the PEM private key of --join-tls-cert")
    return parser


def listen_address(args: argparse.Namespace) -> str | None:
    """Where duo-draft listens for targets: --listen, else DEFAULT_LISTEN; nowhere for a draft that only joins its
    targets (--join without --listen), which dials out and needs no port: two on one machine would collide."""
    if args.listen is not None:
        return args.listen
    return None if args.join else DEFAULT_LISTEN


def check_flags(args: argparse.Namespace) -> None:
    if args.listen is not None:
        check_listen(args.listen, joins=bool(args.join))
    elif args.tls_cert or args.tls_key:
        raise ValueError("--tls-cert/--tls-key serve targets that dial --listen: give --listen too (--join-tls-* "
                         "secure --join)")
    check_settings(args)


def check_listen(address: str, *, joins: bool) -> None:
    check_can_listen(address)
    host, port = host_port(address, "--listen", listening=True)
    if is_loopback(host) and not joins:  # a draft that joins its targets needs no reachable --listen
        log.warning("listening on %s: only a target on this machine can reach it; for a target on another "
                    "machine, start duo-draft with --listen 0.0.0.0:%d (or this machine's LAN address)", address, port)


def check_settings(args: argparse.Namespace) -> None:
    if not check_pair(args.tls_cert, args.tls_key, "--tls-cert/--tls-key") and args.tls_ca:
        raise ValueError("--tls-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)")
    if not 1 <= args.top_k_cap <= wire.MAX_DIST_IDS:
        raise ValueError(f"--top-k-cap must be between 1 and {wire.MAX_DIST_IDS} (the ids a target accepts per "
                         "distribution)")
    if args.max_sessions < 1 or args.max_sessions_per_target < 1:
        raise ValueError("--max-sessions and --max-sessions-per-target must be at least 1")
    if not 0 <= args.max_branches <= MAX_BRANCHES or args.branch_len < 0:
        raise ValueError(f"--max-branches must be between 0 and {MAX_BRANCHES} and --branch-len >= 0")
    per_session = 2 if args.max_branches else 1  # a session's chain sequence, and its branches'
    if args.max_sessions * per_session > MAX_SEQUENCES:
        raise ValueError(f"--max-sessions {args.max_sessions} needs {args.max_sessions * per_session} sequences "
                         f"({per_session} per session), beyond llama.cpp's {MAX_SEQUENCES} per context")
    if not (args.window == 0 or args.window >= MIN_WINDOW) or args.window_sink < 0:
        raise ValueError(f"--window must be 0 (the whole session) or at least {MIN_WINDOW}, and --window-sink >= 0")
    if args.ctx_size < 0:
        raise ValueError("--ctx-size must be >= 0 (0: the model's training context)")
    if args.kv_cells is not None and args.ctx_size and args.kv_cells < args.ctx_size:
        raise ValueError(f"--kv-cells {args.kv_cells} is less than --ctx-size {args.ctx_size}: no session could "
                         "reach its context")


def join_credentials(args: argparse.Namespace) -> grpc.ChannelCredentials | None:
    """The TLS of --join (None: plaintext), its flags checked and its files read at start-up."""
    for address in args.join:
        host_port(address, "--join")
    check_pair(args.join_tls_cert, args.join_tls_key, "--join-tls-cert/--join-tls-key")
    if args.join_tls_cert and not args.join_tls_ca:
        raise ValueError("--join-tls-cert needs --join-tls-ca (the CA that signed the targets' certificates)")
    if args.join_tls_ca and not args.join:
        raise ValueError("--join-tls-ca secures --join: give the targets to join")
    return (channel_credentials(args.join_tls_ca, args.join_tls_cert, args.join_tls_key, "--join-tls")
            if args.join_tls_ca else None)


async def serve(args: argparse.Namespace, model: Model, metrics: DraftMetrics,
                http: tuple[HttpServer, socket.socket] | None, join: grpc.ChannelCredentials | None) -> None:
    """Serve targets on --listen and join the --join targets (over TLS with `join`), until SIGINT/SIGTERM."""
    drafter = Drafter(model, ModelWorker(), session_context(args, model), args.top_k_cap, observer=metrics,
                      max_branches=args.max_branches, branch_len=args.branch_len, max_sessions=args.max_sessions,
                      cells=args.kv_cells, flash_attn=flash_attention(args),
                      window=Window(args.window, args.window_sink if args.window else 0), cache_ram=args.cache_ram)
    try:
        await drafter.start()  # the shared KV cache, allocated once for all sessions
    except ModelError as error:
        raise SystemExit(f"duo-draft: {error}; try a smaller --kv-cells") from error
    limits = SessionLimits(total=args.max_sessions, per_target=args.max_sessions_per_target)
    server = grpc.aio.server(options=grpc_server_options())
    servicer = DraftServicer(drafter, limits, metrics)
    pb_grpc.add_DraftServicer_to_server(servicer, server)
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
    security = " over mutual TLS" if args.tls_ca else " over TLS" if args.tls_cert else ""
    endpoints = ((f"on {args.listen}" if args.listen else "to the targets it joins (no --listen: no port of its own)")
                 + (f", metrics on {args.metrics}" if args.metrics else ""))
    joining = [Joiner(servicer, address, join) for address in args.join]
    if joining:
        security += f"; joining {', '.join(args.join)}" + (" over TLS" if args.join_tls_ca else "")
    banner = f"duo-draft serving {describe_placement(model, drafter, args)} {endpoints}{security}"
    try:
        await run_server(server, args.listen, banner, credentials=credentials, http=[http] if http else [],
                         stopping=servicer.stop, draining=servicer.drain, background=(lambda: join_all(joining)) if joining else None)
    finally:
        await drafter.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.listen = listen_address(args)
    setup_logging(args.log_level)
    metrics = DraftMetrics()
    try:
        check_flags(args)
        join = join_credentials(args)
        http = metrics_server(metrics.registry, args.metrics) if args.metrics else None
        model = Model(draft_model(args), **model_options(args))
    except (HubError, ModelError, ValueError) as error:
        print(f"duo-draft: {error}", file=sys.stderr)
        return 1
    if not model.can_rollback:
        print(f"duo-draft: {model.path.name} is a recurrent/hybrid model; drafting needs rollback", file=sys.stderr)
        return 1
    build_tokenizer_in_background(model)
    model.warm_up()
    freeze_startup_heap()
    return run_async(serve(args, model, metrics, http, join))


if __name__ == "__main__":
    sys.exit(main())
