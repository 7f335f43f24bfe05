"""duo-target's process: listen for clients at once, load the model in the background, then serve and link the draft."""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

from grpc_health.v1 import health

from duo.admission import Admission
from duo.completion import Completions
from duo.hub import CATALOG
from duo.link import DraftLink
from duo.metrics import Metrics
from duo.model import Model, ModelError
from duo.openai_api import create_app, http_server
from duo.runtime import ModelWorker, listen_socket, run_server
from duo.server import client_server, set_serving
from duo.target import SpecSettings, Target
from duo.tls import channel_credentials, check_pair, server_credentials

log = logging.getLogger("duo.target")


def check_client_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag that is wrong."""
    if args.parallel < 1 or args.queue_size < 0:
        raise ValueError("--parallel must be >= 1 and --queue-size >= 0")
    check_pair(args.tls_cert, args.tls_key, "--tls-cert/--tls-key")
    check_pair(args.peer_tls_cert, args.peer_tls_key, "--peer-tls-cert/--peer-tls-key")
    if args.peer_tls_cert and not args.peer_tls_ca:
        raise ValueError("--peer-tls-cert needs --peer-tls-ca (the CA that signed the draft's certificate)")


def served_names(path: Path, name_or_path: str) -> list[str]:
    """The model file's stem, and the catalog name it was started with when that differs."""
    names = [path.stem]
    if name_or_path in CATALOG and name_or_path != path.stem:
        names.append(name_or_path)
    return names


def load_model(path: Path, args: argparse.Namespace) -> Model:
    """Load, check and warm up the model (runs on the model thread, off the event loop)."""
    model = Model(path, device=args.device, n_gpu_layers=args.gpu_layers, threads=args.threads)
    if args.peer and not model.can_rollback:
        raise ModelError(f"{path.name} is a recurrent/hybrid model; speculation needs rollback")
    model.warm_up()
    model.vocab()  # the draft link's handshake sends it: built here rather than on the event loop
    return model


async def serve(args: argparse.Namespace, path: Path, settings: SpecSettings) -> None:
    """Listen at once (health NOT_SERVING, requests UNAVAILABLE / 503), load the model in the
    background, then report SERVING and keep the draft linked until stopped."""
    api_key = args.api_key or os.environ.get("DUO_API_KEY") or None
    metrics = Metrics()
    completions = Completions(Admission(args.parallel, args.queue_size), metrics, served_names(path, args.model))
    health_servicer = health.aio.HealthServicer()
    await set_serving(health_servicer, False)
    server = client_server(completions, health_servicer, api_key)
    http = None
    if args.http:
        app = create_app(completions, metrics, api_key)
        http = (http_server(app, tls_cert=args.tls_cert, tls_key=args.tls_key, debug=args.log_level == "DEBUG"),
                listen_socket(args.http))
    peer_credentials = (channel_credentials(args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key, "--peer-tls")
                        if args.peer_tls_ca else None)

    async def load_then_link() -> None:
        worker = ModelWorker()
        began = time.monotonic()
        model = await worker.run(load_model, path, args)
        link = DraftLink(args.peer, model.path.name, model.vocab(), peer_credentials) if args.peer else None
        target = Target(model, worker, link, n_ctx=args.ctx_size, settings=settings)
        target.observers.append(metrics)
        completions.ready(target, min(args.ctx_size, model.n_ctx_train))
        admission = completions.admission
        metrics.watch(draft_connected=lambda: float(completions.draft_connected),
                      draft_len=lambda: target.policy.draft_len if target.policy else settings.draft_max,
                      running=lambda: admission.running, waiting=lambda: admission.waiting)
        log.info("model loaded in %.1f s: serving %s, %s", time.monotonic() - began, path.name,
                 f"drafts from {args.peer}" if link else "alone (no --peer)")
        await set_serving(health_servicer, True)
        if link:
            await link.run()

    endpoints = [f"gRPC on {args.listen}"] + ([f"HTTP on {args.http}"] if args.http else [])
    security = " over TLS" if args.tls_cert else ""
    await run_server(server, args.listen,
                     f"duo-target listening for clients{security} ({', '.join(endpoints)}); loading {path.name}",
                     credentials=server_credentials(args.tls_cert, args.tls_key) if args.tls_cert else None,
                     http=http, background=load_then_link)
