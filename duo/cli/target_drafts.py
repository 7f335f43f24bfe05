"""duo-target's drafts: the ones it dials (--peer, repeatable) and the ones that dial in (--draft-listen, for
duo-draft --join), all in one pool (duo.target.pool)."""

from __future__ import annotations

import argparse
import logging

import grpc

from duo.net._proto import duo_pb2_grpc as pb_grpc
from duo.llama.model import Model
from duo.cli.process import cannot_listen, check_can_listen, host_port, is_loopback
from duo.target.pool.link import DraftLink
from duo.target.pool.connection import DraftObserver
from duo.target.pool.joined import PoolService, parse_allow, pool_server
from duo.target.request import SpecSettings
from duo.target.target import Target
from duo.net.tls import channel_credentials, check_pair, server_credentials

log = logging.getLogger("duo.target")

# The opt-out of guarding --draft-listen, named for what it gives away.
ANY_HOST_FLAG = "--draft-listen-any-host-reads-prompts"


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    drafts = parser.add_argument_group(
        "drafts", "Any number of duo-draft processes serve one target: each session drafts on the one it adds the "
                  "most to (measured pace, acceptance, latency), moves when a faster one joins, and goes on with "
                  "another at once when its draft is lost.")
    drafts.add_argument("--peer", action="append", default=[], metavar="HOST:PORT",
                        help="a duo-draft to dial (repeatable: several drafts); without any, and without "
                             "--draft-listen, the target decodes alone")
    drafts.add_argument("--peer-tls-ca", default=None, metavar="PEM",
                        help="connect to every --peer over TLS, trusting the CA in this PEM file")
    drafts.add_argument("--peer-tls-cert", default=None, metavar="PEM",
                        help="present this PEM certificate to the drafts (for drafts started with --tls-ca)")
    drafts.add_argument("--peer-tls-key", default=None, metavar="PEM", help="the PEM private key of --peer-tls-cert")
    drafts.add_argument("--draft-listen", default=None, metavar="HOST:PORT",
                        help="listen for drafts that dial in (duo-draft --join THIS_MACHINE:PORT): a laptop or a GPU "
                             "box behind NAT. A joined draft reads every prompt and output of this target, so on an "
                             "address other machines reach, say who may join: --draft-tls-ca, --draft-allow, or "
                             f"{ANY_HOST_FLAG}")
    drafts.add_argument("--draft-tls-cert", default=None, metavar="PEM",
                        help="serve --draft-listen over TLS with this PEM certificate")
    drafts.add_argument("--draft-tls-key", default=None, metavar="PEM", help="the PEM private key of --draft-tls-cert")
    drafts.add_argument("--draft-tls-ca", default=None, metavar="PEM",
                        help="mutual TLS on --draft-listen: only drafts presenting a certificate this CA signed join")
    drafts.add_argument("--draft-allow", action="append", default=[], metavar="NETWORK",
                        help="only drafts from this address or network join (repeatable; e.g. 10.0.0.0/8, "
                             "192.168.1.7)")
    drafts.add_argument(ANY_HOST_FLAG, action="store_true",
                        help="let ANY host that reaches --draft-listen join, without mutual TLS or --draft-allow: it "
                             "reads every prompt and output of this target and proposes its tokens (for a network "
                             "where every host is trusted)")


def check_draft_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag that is wrong."""
    for peer in args.peer:
        host_port(peer, "--peer")
    check_pair(args.peer_tls_cert, args.peer_tls_key, "--peer-tls-cert/--peer-tls-key")
    if args.peer_tls_cert and not args.peer_tls_ca:
        raise ValueError("--peer-tls-cert needs --peer-tls-ca (the CA that signed the draft's certificate)")
    if args.draft_listen:
        host_port(args.draft_listen, "--draft-listen", listening=True)
        check_can_listen(args.draft_listen)
    elif args.draft_tls_cert or args.draft_tls_ca or args.draft_allow or args.draft_listen_any_host_reads_prompts:
        raise ValueError(f"--draft-tls-*, --draft-allow and {ANY_HOST_FLAG} apply to --draft-listen: give it too")
    check_pair(args.draft_tls_cert, args.draft_tls_key, "--draft-tls-cert/--draft-tls-key")
    if args.draft_tls_ca and not args.draft_tls_cert:
        raise ValueError("--draft-tls-ca (mutual TLS) needs --draft-tls-cert/--draft-tls-key")
    parse_allow(args.draft_allow)
    if args.draft_listen and not args.draft_listen_any_host_reads_prompts and not _guarded(args):
        raise ValueError(_unguarded(args))


def _guarded(args: argparse.Namespace) -> bool:
    """Whether only some hosts can join --draft-listen: it listens on loopback, or asks for a client certificate
    (--draft-tls-ca), or lists the addresses it takes (--draft-allow, short of every address)."""
    host, _ = host_port(args.draft_listen, "--draft-listen", listening=True)
    every_address = any(network.prefixlen == 0 for network in parse_allow(args.draft_allow))
    return is_loopback(host) or bool(args.draft_tls_ca) or (bool(args.draft_allow) and not every_address)


def _unguarded(args: argparse.Namespace) -> str:
    """Why an unguarded --draft-listen is refused, and the three ways to go on."""
    tls = (" (--draft-tls-cert encrypts the stream, but without --draft-tls-ca any client may join)"
           if args.draft_tls_cert and not args.draft_tls_ca else "")
    allow = " (--draft-allow lists every address)" if args.draft_allow else ""
    return (f"--draft-listen {args.draft_listen} lets any host that reaches it join{tls}{allow}, and a joined draft "
            "reads every prompt and output of this target. Say who may join: --draft-tls-ca CA.pem (mutual TLS: "
            "only drafts with a certificate this CA signed), --draft-allow NETWORK (e.g. 10.0.0.0/8), a loopback "
            f"address (127.0.0.1:PORT: this machine only), or accept the risk with {ANY_HOST_FLAG}")


def who_may_join(args: argparse.Namespace) -> str:
    """Who may join --draft-listen, and over what, for the start-up log."""
    host, _ = host_port(args.draft_listen, "--draft-listen", listening=True)
    transport = ("over mutual TLS" if args.draft_tls_ca else
                 "over TLS (encrypted; a certificate is not asked for)" if args.draft_tls_cert else "in plaintext")
    rules = [f"from {', '.join(args.draft_allow)}"] if args.draft_allow else []
    rules += [f"with a certificate signed by the CA in {args.draft_tls_ca}"] if args.draft_tls_ca else []
    if rules:
        who = "only drafts " + " and ".join(rules)
    elif is_loopback(host):
        who = "only processes on this machine (a loopback address)"
    else:
        who = (f"ANY host that reaches this port ({ANY_HOST_FLAG}): it reads every prompt and output of this "
               "target")
    return f"{transport}; who may join: {who}"


def wants_drafts(args: argparse.Namespace) -> bool:
    return bool(args.peer or args.draft_listen)


def describe_drafts(args: argparse.Namespace) -> str:
    where = [f"drafts from {', '.join(args.peer)}"] if args.peer else []
    where += [f"drafts joining on {args.draft_listen}"] if args.draft_listen else []
    return " and ".join(where) or "alone (no --peer, no --draft-listen)"


async def serve_drafts(args: argparse.Namespace, target: Target, model: Model, settings: SpecSettings,
                       observer: DraftObserver) -> None:
    """Dial every --peer, listen for drafts on --draft-listen, and keep sessions placed, until cancelled."""
    pool = target.pool
    if pool is None:
        return
    pool.observers.append(observer)
    credentials = (channel_credentials(args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key, "--peer-tls")
                   if args.peer_tls_ca else None)
    for peer in args.peer:
        link = DraftLink(peer, model.path.name, model.vocab(), credentials, max_lead=settings.max_lead)
        pool.add(link, run=link.run)
    server = await _listen_for_drafts(args, target, model, settings) if args.draft_listen else None
    try:
        await pool.run()
    finally:
        if server is not None:
            await server.stop(grace=1)


async def _listen_for_drafts(args: argparse.Namespace, target: Target, model: Model,
                             settings: SpecSettings) -> grpc.aio.Server:
    server = pool_server()
    service = PoolService(target.pool, model.path.name, model.vocab(), max_lead=settings.max_lead,
                          allow=parse_allow(args.draft_allow))
    pb_grpc.add_PoolServicer_to_server(service, server)
    try:
        if args.draft_tls_cert:
            credentials = server_credentials(args.draft_tls_cert, args.draft_tls_key, args.draft_tls_ca)
            port = server.add_secure_port(args.draft_listen, credentials)
        else:
            port = server.add_insecure_port(args.draft_listen)
    except RuntimeError:  # grpc >= 1.60 raises where older versions returned 0
        port = 0
    if port == 0:
        raise SystemExit(cannot_listen(args.draft_listen, "the address is in use or not this machine's"))
    await server.start()
    log.log(logging.INFO if _guarded(args) else logging.WARNING, "listening for drafts that join on %s %s",
            args.draft_listen, who_may_join(args))
    return server
