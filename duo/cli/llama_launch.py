"""What llama-server's launch flags on duo-target come to: HTTP addresses, the chat template, the model's names and
tags, the sampling defaults (duo.cli.llama_flags holds the table of flags)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
from pydantic import ValidationError

from duo.api.http.launch import LaunchSettings
from duo.api.openai.bodies import ChatBody
from duo.api.serving.defaults import ServerDefaults
from duo.cli.llama_flags import DEFAULT, LLAMA_FLAGS
from duo.llama.templates import BUILTIN_SOURCES, LLAMA_CPP_NAMES, ChatTemplate, reserved_names
from duo.models.hub import CATALOG

LLAMA_SERVER_PORT = 8080  # llama-server's --port default
LLAMA_SERVER_HOST = "127.0.0.1"

def comma_list(values: Sequence[str]) -> list[str]:
    """Names given as llama-server takes them: comma-separated, in one flag or several; stripped, once each."""
    return list(dict.fromkeys(name.strip() for value in values for name in value.split(",") if name.strip()))


def http_addresses(args: argparse.Namespace) -> list[str]:
    """Where HTTP listens: duo's --http, or llama-server's --host (comma-separated; IPv6 bare, as it takes them) and
    --port; none without either. ValueError for both, or for a UNIX socket (duo listens on TCP)."""
    if args.host is None and args.port is None:
        return [args.http] if args.http else []
    if args.http:
        raise ValueError("give --http [HOST:]PORT or llama-server's --host/--port, not both")
    hosts = [host.strip() for host in (args.host or LLAMA_SERVER_HOST).split(",") if host.strip()]
    if not hosts:
        raise ValueError("--host requires at least one address")
    for host in hosts:
        if host.endswith(".sock"):
            raise ValueError(f"--host {host}: duo-target listens on TCP addresses, not UNIX sockets")
    port = LLAMA_SERVER_PORT if args.port is None else args.port
    return [f"[{host.strip('[]')}]:{port}" if ":" in host else f"{host}:{port}" for host in hosts]


def cors_origins(args: argparse.Namespace) -> list[str] | None:
    """The origins answered: duo's --cors-origin, then llama-server's --cors-origins (comma-separated; * : any, None
    here; "localhost", its keyword: any origin on this machine, duo.api.http.gate.Cors)."""
    if args.cors_origins is None:
        return args.cors_origin
    origins = comma_list([args.cors_origins])
    return None if "*" in origins else (args.cors_origin or []) + origins


def chat_template(args: argparse.Namespace) -> str | None:
    """The Jinja chat template that replaces the model's (--chat-template, --chat-template-file), checked here;
    None: the model's own. ValueError naming the flag for what duo cannot render."""
    if args.chat_template is not None and args.chat_template_file is not None:
        raise ValueError("give --chat-template or --chat-template-file, not both")
    if args.chat_template_file is not None:
        try:
            source = Path(args.chat_template_file).read_text()
        except OSError as error:
            raise ValueError(f"--chat-template-file: cannot read {args.chat_template_file}: "
                             f"{error.strerror or error}") from None
        return _checked(source, f"--chat-template-file {args.chat_template_file}")
    name = args.chat_template
    if name is None:
        return None
    if name in BUILTIN_SOURCES:
        return BUILTIN_SOURCES[name]
    if name in LLAMA_CPP_NAMES:
        raise ValueError(f"--chat-template {name}: duo has no Jinja form of llama.cpp's built-in {name!r} template "
                         f"(it renders {', '.join(sorted(BUILTIN_SOURCES))} by name): give its Jinja source with "
                         "--chat-template-file, or leave the flag out to use the model's own template")
    return _checked(name, "--chat-template")


def template_variables(args: argparse.Namespace) -> dict[str, Any]:
    """The chat template's variables the launch line sets, under a request's own (chat_template_kwargs), as
    llama-server merges them: --chat-template-kwargs, then enable_thinking from --reasoning on/off or
    --reasoning-budget 0 (auto, the default, leaves llama-server's true). ValueError naming the flag."""
    kwargs = dict(args.chat_template_kwargs or {})
    reserved = reserved_names(kwargs)
    if reserved:
        raise ValueError(f"--chat-template-kwargs may not set {', '.join(reserved)}: the renderer gives them")
    if args.reasoning_budget not in (-1, 0):
        raise ValueError(f"--reasoning-budget {args.reasoning_budget}: duo does not bound the reasoning's tokens; "
                         "it takes -1 (unbounded, the default) or 0 (no reasoning, as --reasoning off)")
    if args.reasoning_budget == 0 or args.reasoning == "off":
        return kwargs | {"enable_thinking": False}
    return kwargs | ({"enable_thinking": True} if args.reasoning == "on" else {})


def template_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Model's chat template options the launch line sets (duo.llama.model.Model's keywords)."""
    return {"chat_template": chat_template(args), "template_variables": template_variables(args)}


def _checked(source: str, flag: str) -> str:
    """`source`, compiled as the chat renders it (loop controls, {% generation %}), or ValueError naming `flag`."""
    try:
        ChatTemplate(source, bos_token="", eos_token="")
    except jinja2.TemplateSyntaxError as error:
        raise ValueError(f"{flag}: not a Jinja template: {error.message} (line {error.lineno})") from None
    return source


def served_names(path: Path, name_or_path: str, aliases: Sequence[str] = ()) -> list[str]:
    """The model's names, its id first (what /v1/models lists and an answer without `model` carries): with aliases
    (-a/--alias, comma-separated), all of them sorted, as llama-server's std::set holds them; without, the file's
    stem, then the catalog name it was started with where that differs."""
    given = comma_list(aliases)
    if given:
        return sorted(given)
    return [path.stem] + ([name_or_path] if name_or_path in CATALOG and name_or_path != path.stem else [])


def server_defaults(args: argparse.Namespace) -> ServerDefaults:
    """The sampling defaults the launch line set (over llama-server's own: ServerDefaults), checked as a request's
    fields are; ValueError naming the flag."""
    fields = dict(args.server_defaults)
    try:
        body = ChatBody.model_validate({"messages": [], **fields})
    except ValidationError as error:
        first = error.errors()[0]
        field = str(first["loc"][0])
        raise ValueError(f"{_flag_of(field)} {fields.get(field)!r}: {first['msg']}") from None
    checked = {name: getattr(body, name) for name in fields}
    given = {name: value for name, value in checked.items() if value is not None}
    return ServerDefaults(given)


def _flag_of(field: str) -> str:
    return next(flag.names[-1] for flag in LLAMA_FLAGS if flag.kind == DEFAULT and flag.dest == field)


def launch_settings(args: argparse.Namespace) -> LaunchSettings:
    """What the HTTP app takes from the launch line."""
    return LaunchSettings(aliases=tuple(sorted(comma_list(args.alias))), tags=tuple(sorted(comma_list(args.tags))),
                          defaults=server_defaults(args), slots=args.slots, metrics=args.metrics is not None)


def context_per_request(ctx_size: int, n_ctx_train: int, parallel: int, kv_unified: bool) -> int:
    """Positions a request may reach: -c/--ctx-size, or where it is 0 the model's training context, as llama-server's
    default (-c 0); with llama-server's --no-kv-unified that is the total, each of --parallel requests reaching its
    share."""
    total = min(ctx_size or n_ctx_train, n_ctx_train)
    return total if kv_unified else total // parallel
