"""llama-server's launch flags on duo-target: the one table of those it takes, takes as sampling defaults, ignores or
refuses (llama.cpp's common/arg.cpp names and meanings), registered on its parser and printed by --help."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

TAKEN = "taken"          # sets the duo setting `dest`, with llama-server's meaning
DEFAULT = "default"      # a server-wide default of the body field `dest`: a request's own field wins
IGNORED = "ignored"      # accepted; changes no answer (performance, logging, the web UI), said once at startup
REFUSED = "refused"      # ignoring it would change answers: duo-target stops at startup, naming it


def on_off_auto(value: str) -> str:
    if value not in ("on", "off", "auto"):
        raise argparse.ArgumentTypeError(f"takes on, off or auto, not {value!r}")
    return value


def layer_count(value: str) -> int | None:
    """llama-server's -ngl: a number, or auto/all (duo's default: every layer the device takes)."""
    return None if value in ("auto", "all") else int(value)


def sampler_list(value: str) -> list[str]:
    """--samplers: names separated by semicolons, as llama-server splits them."""
    return [name for name in value.split(";") if name]


def verbose_level(value: str) -> bool:
    """-lv N: whether llama-server's answers are verbose at that level (above 9, as its server reads it)."""
    return int(value) > 9


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"is not JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


@dataclass(frozen=True)
class LlamaFlag:
    """One of llama-server's flags: its spellings, what duo-target does with it, and its value (None: a switch,
    which sets `const`)."""

    names: tuple[str, ...]
    kind: str
    meaning: str
    dest: str = ""
    value: str | None = None
    convert: Callable[[str], Any] = str
    const: Any = True
    values: int = 1  # how many values it reads (--lora-scaled FNAME SCALE: 2)
    own: bool = False  # duo-target's own flag of the same name and meaning: listed here, registered by duo


def _flag(kind: str, names: str, meaning: str, dest: str = "", value: str | None = None,
          convert: Callable[[str], Any] = str, const: Any = True, values: int = 1) -> LlamaFlag:
    return LlamaFlag(tuple(names.split()), kind, meaning, dest, value, convert, const, values)


def _default(names: str, field: str, value: str, convert: Callable[[str], Any] = float) -> LlamaFlag:
    return _flag(DEFAULT, names, field, field, value, convert)


PERFORMANCE = "performance only"
LOGGING = "logging only: duo logs with --log-level"
NO_LORA = "duo-target serves its model without LoRA adapters or control vectors"
PER_REQUEST = "send it with each request instead"

# Every llama-server flag duo-target knows, in one place: --help prints it, the parser reads it.
LLAMA_FLAGS: tuple[LlamaFlag, ...] = (
    *(LlamaFlag((name,), TAKEN, meaning, own=True) for name, meaning in (
        ("--model", "duo's own flag: a GGUF path or a catalog name"), ("--threads", "duo's own flag"),
        ("--ctx-size", "duo's own flag: per request (see -c)"), ("--parallel", "duo's own flag"),
        ("--gpu-layers", "duo's own flag"), ("--flash-attn", "duo's own flag"), ("--rpc", "duo's own flag"),
        ("--tensor-split", "duo's own flag"), ("--api-key", "duo's own flag (one key)"),
        ("--api-key-file", "duo's own flag"), ("--alias", "duo's own flag: as -a"),
        ("--metrics", "duo's own flag: alone, /metrics on the HTTP port (501 without it, as llama-server)"),
        ("--draft-max", "duo's own flag"), ("--draft-min", "duo's own flag"), ("--draft-p-min", "duo's own flag"),
        ("--batch-size", "duo's own flag: a prompt is read this many tokens a call"),
        ("--cache-ram", "duo's own flag: MiB of host memory for idle requests' prefixes (as -cram)"))),
    _flag(TAKEN, "-m", "--model", "model", "FNAME"),
    _flag(TAKEN, "-c", "--ctx-size: per request; the total shared by -np requests with --no-kv-unified", "ctx_size",
          "N", int),
    _flag(TAKEN, "-np", "--parallel", "parallel", "N", int),
    _flag(TAKEN, "-b", "--batch-size", "batch_size", "N", int),
    _flag(TAKEN, "-t", "--threads", "threads", "N", int),
    _flag(TAKEN, "-ngl --n-gpu-layers", "--gpu-layers (auto, all: every layer)", "gpu_layers", "N", layer_count),
    _flag(TAKEN, "-fa", "--flash-attn", "flash_attn", "on|off|auto", on_off_auto),
    _flag(TAKEN, "-ts", "--tensor-split", "tensor_split", "N0,N1,..."),
    _flag(TAKEN, "-a", "--alias: names, comma-separated; /v1/models lists the first (sorted) as the model's id",
          "alias", "NAMES"),
    _flag(TAKEN, "--tags", "tags /v1/models lists, comma-separated (informational)", "tags", "TAGS"),
    _flag(TAKEN, "--host", "where HTTP listens: addresses, comma-separated (default 127.0.0.1; as --http)", "host",
          "HOST"),
    _flag(TAKEN, "--port", "the HTTP port of --host (default 8080)", "port", "PORT", int),
    _flag(TAKEN, "--ssl-cert-file", "--tls-cert (HTTP and gRPC)", "tls_cert", "FNAME"),
    _flag(TAKEN, "--ssl-key-file", "--tls-key", "tls_key", "FNAME"),
    _flag(TAKEN, "--cors-origins", "--cors-origin, comma-separated (* any origin; localhost: any origin on this "
          "machine)", "cors_origins", "ORIGINS"),
    _flag(TAKEN, "--chat-template", "a Jinja chat template in place of the model's, or a name of llama.cpp's "
          "built-in ones duo renders (chatml, llama3, command-r, phi3, gemma, ...; the others refused by name)",
          "chat_template", "JINJA_TEMPLATE"),
    _flag(TAKEN, "--chat-template-file", "the Jinja chat template in FNAME in place of the model's",
          "chat_template_file", "FNAME"),
    _flag(TAKEN, "--jinja", "duo always renders chat templates with Jinja", "jinja"),
    _flag(TAKEN, "--chat-template-kwargs", "the template's variables (JSON object); a request's chat_template_kwargs "
          "override them one by one", "chat_template_kwargs", "JSON", json_object),
    _flag(TAKEN, "-rea --reasoning", "the template's enable_thinking: off renders it false (a thinking model's "
          "generation prompt closes its think block), on and auto (the default) true; a request's "
          "chat_template_kwargs.enable_thinking wins", "reasoning", "on|off|auto", on_off_auto),
    _flag(TAKEN, "--reasoning-budget", "-1 (unbounded, the default) or 0 (as --reasoning off); duo refuses "
          "other budgets, naming the flag", "reasoning_budget", "N", int),
    _flag(TAKEN, "--slots", "GET /slots answers (the default)", "slots"),
    _flag(TAKEN, "--no-slots", "GET /slots answers 501", "slots", const=False),
    _flag(TAKEN, "-kvu --kv-unified", "each request may reach the whole -c (duo's default)", "kv_unified"),
    _flag(TAKEN, "-no-kvu --no-kv-unified", "-c is the total, each of -np requests reaches -c / -np", "kv_unified",
          const=False),
    _flag(TAKEN, "--cache-prompt", "requests share prompt prefixes (the default)", "no_prompt_cache", const=False),
    _flag(TAKEN, "--no-cache-prompt", "--no-prompt-cache", "no_prompt_cache"),
    _flag(TAKEN, "-cram", "--cache-ram: MiB of host memory where idle requests' prefixes wait for their next turn, out "
          "of the KV cache whose every cell the running requests' tokens read (default 8192, -1 no limit, 0 none)",
          "cache_ram", "N", int),
    _flag(TAKEN, "--no-cache-idle-slots", "--cache-ram 0: idle requests' prefixes stay in the KV cache", "cache_ram",
          const=0),
    _flag(IGNORED, "--cache-idle-slots", "duo parks idle requests' prefixes by default (--cache-ram)"),
    _flag(TAKEN, "--draft --draft-n --spec-draft-n-max", "--draft-max", "draft_max", "N", int),
    _flag(TAKEN, "--draft-n-min --spec-draft-n-min", "--draft-min", "draft_min", "N", int),
    _flag(TAKEN, "--spec-draft-p-min", "--draft-p-min", "draft_p_min", "P", float),
    _default("--temp --temperature", "temperature", "N"),
    _default("--top-k", "top_k", "N", int),
    _default("--top-p", "top_p", "N"),
    _default("--min-p", "min_p", "N"),
    _default("--top-nsigma --top-n-sigma", "top_n_sigma", "N"),
    _default("--xtc-probability", "xtc_probability", "N"),
    _default("--xtc-threshold", "xtc_threshold", "N"),
    _default("--typical --typical-p", "typical_p", "N"),
    _default("--repeat-last-n", "repeat_last_n", "N", int),
    _default("--repeat-penalty", "repeat_penalty", "N"),
    _default("--presence-penalty", "presence_penalty", "N"),
    _default("--frequency-penalty", "frequency_penalty", "N"),
    _default("--dry-multiplier", "dry_multiplier", "N"),
    _default("--dry-base", "dry_base", "N"),
    _default("--dry-allowed-length", "dry_allowed_length", "N", int),
    _default("--dry-penalty-last-n", "dry_penalty_last_n", "N", int),
    _default("--dynatemp-range", "dynatemp_range", "N"),
    _default("--dynatemp-exp", "dynatemp_exponent", "N"),
    _default("--mirostat", "mirostat", "N", int),
    _default("--mirostat-lr", "mirostat_eta", "N"),
    _default("--mirostat-ent", "mirostat_tau", "N"),
    _default("-s --seed", "seed", "SEED", int),
    _default("-n --predict --n-predict", "n_predict", "N", int),
    _default("--samplers", "samplers", "SAMPLERS", sampler_list),
    _default("--sampler-seq --sampling-seq", "samplers", "SEQUENCE", str),
    _flag(DEFAULT, "--ignore-eos", "ignore_eos", "ignore_eos"),
    _default("--reasoning-format", "reasoning_format", "FORMAT", str),
    *(_flag(IGNORED, names, PERFORMANCE, value=value) for names, value in (
        ("-tb --threads-batch", "N"), ("-C --cpu-mask", "M"), ("-Cr --cpu-range", "lo-hi"), ("--cpu-strict", "0|1"),
        ("--prio", "N"), ("--poll", "0...100"), ("-Cb --cpu-mask-batch", "M"), ("-Crb --cpu-range-batch", "lo-hi"),
        ("--cpu-strict-batch", "0|1"), ("--prio-batch", "N"), ("--poll-batch", "0|1"),
        ("-ub --ubatch-size", "N"), ("-dt --defrag-thold", "N"), ("--numa", "TYPE"), ("-mg --main-gpu", "INDEX"),
        ("-sm --split-mode", "MODE"), ("--threads-http", "N"), ("--cache-reuse", "N"),
        ("-ctxcp --ctx-checkpoints --swa-checkpoints", "N"), ("-fit --fit", "on|off"),
        ("-to --timeout", "N"), ("-ot --override-tensor", "PATTERN=BUFFER"), ("-lcs --lookup-cache-static", "FNAME"),
        ("-lcd --lookup-cache-dynamic", "FNAME"), ("--sleep-idle-seconds", "N"), ("-sps --slot-prompt-similarity",
                                                                                 "N"))),
    *(_flag(IGNORED, names, PERFORMANCE) for names in (
        "--mlock", "--no-mmap", "--mmap", "-kvo --kv-offload", "-nkvo --no-kv-offload", "--repack", "-nr --no-repack",
        "--no-host", "-cb --cont-batching", "-nocb --no-cont-batching", "--check-tensors", "--warmup", "--no-warmup",
        "--swa-full", "--reuse-port")),
    # llama-server's verbose answers (its verbosity above 9: -v sets the most) carry their native answer as __verbose
    _flag(DEFAULT, "-v --verbose --log-verbose", "verbose", "verbose"),
    _default("-lv --verbosity --log-verbosity", "verbose", "N", verbose_level),
    *(_flag(IGNORED, names, LOGGING) for names in ("--log-disable", "--log-prefix", "--log-timestamps", "--perf",
                                                   "--no-perf")),
    *(_flag(IGNORED, names, LOGGING, value=value) for names, value in (
        ("--log-file", "FNAME"), ("--log-colors", "on|off|auto"))),
    _flag(IGNORED, "--ui --webui --no-ui --no-webui", "duo serves its chat page at / either way"),
    _flag(IGNORED, "--props", "POST /props is not served; GET /props is"),
    _flag(IGNORED, "--no-context-shift", "duo never shifts the context (llama-server's default)"),
    _flag(IGNORED, "--no-mmproj --offline", "duo reads text and local files only"),
    _flag(IGNORED, "--no-skip-chat-parsing", "duo parses the chat answer (llama-server's default)"),
    _flag(IGNORED, "--prefill-assistant", "duo continues a final assistant message (llama-server's default)"),
    *(_flag(IGNORED, names, "duo's chat page at / is its own", value=value) for names, value in (
        ("--path", "PATH"), ("--ui-config --webui-config", "JSON"), ("--ui-config-file --webui-config-file", "FNAME"))),
    _flag(REFUSED, "--lora", NO_LORA, value="FNAME"),
    _flag(REFUSED, "--lora-scaled", NO_LORA, value="FNAME SCALE", values=2),
    _flag(REFUSED, "--lora-init-without-apply", NO_LORA),
    _flag(REFUSED, "--control-vector", NO_LORA, value="FNAME"),
    _flag(REFUSED, "--control-vector-scaled", NO_LORA, value="FNAME SCALE", values=2),
    _flag(REFUSED, "--control-vector-layer-range", NO_LORA, value="START END", values=2),
    _flag(REFUSED, "--no-prefill-assistant", "duo always continues a final assistant message (llama-server's "
          "default): end the chat with the user's message to have it answered"),
    _flag(REFUSED, "--embedding --embeddings", "duo-target generates text; it serves no embeddings"),
    _flag(REFUSED, "--rerank --reranking", "duo-target generates text; it serves no reranking"),
    _flag(REFUSED, "--pooling", "duo-target serves no embeddings", value="TYPE"),
    _flag(REFUSED, "-mm --mmproj -mmu --mmproj-url", "duo-target reads text only", value="FNAME"),
    _flag(REFUSED, "-ctk --cache-type-k -ctv --cache-type-v", "duo keeps the KV cache in F16; a quantized cache "
          "gives other logits", value="TYPE"),
    _flag(REFUSED, "--rope-scaling", "duo runs the model's RoPE as its GGUF sets it", value="TYPE"),
    *(_flag(REFUSED, names, "duo runs the model's RoPE as its GGUF sets it", value="N") for names in (
        "--rope-scale", "--rope-freq-base", "--rope-freq-scale", "--yarn-orig-ctx", "--yarn-ext-factor",
        "--yarn-attn-factor", "--yarn-beta-slow", "--yarn-beta-fast")),
    _flag(REFUSED, "--override-kv", "duo reads the model's metadata as its GGUF holds it", value="KEY=TYPE:VALUE"),
    _flag(REFUSED, "--context-shift", "duo never shifts the context: a prompt past it is an error"),
    _flag(REFUSED, "--no-jinja", "duo renders chat templates with Jinja only; leave the flag out"),
    _flag(REFUSED, "-md --model-draft -hfd --hf-repo-draft", "duo's draft runs in its own process: start "
          "duo-draft --model FNAME and give --peer HOST:PORT", value="FNAME"),
    _flag(REFUSED, "--spec-type", "duo speculates with duo-draft and n-gram lookup (--no-lookup turns it off)",
          value="TYPE"),
    _flag(REFUSED, "--grammar --grammar-file -j --json-schema -jf --json-schema-file -l --logit-bias",
          f"no server-wide grammar, schema or bias in duo: {PER_REQUEST}", value="VALUE"),
    _flag(REFUSED, "--dry-sequence-breaker", f"dry_sequence_breakers: {PER_REQUEST}", value="STRING"),
    _flag(REFUSED, "--slot-save-path", "duo saves no slots", value="PATH"),
    _flag(REFUSED, "--models-dir --models-preset --models-max", "duo-target serves one model (no router mode)",
          value="VALUE"),
    _flag(REFUSED, "--api-prefix", "duo serves its routes at llama-server's default paths", value="PREFIX"),
    _flag(REFUSED, "--media-path", "duo-target reads text only", value="PATH"),
    _flag(REFUSED, "--tools --tools-runtime --mcp-servers-config --mcp-servers-json", "duo runs no server-side "
          "tools: the client runs them", value="VALUE"),
    _flag(REFUSED, "--skip-chat-parsing", "duo always parses the answer's reasoning and tool calls"),
    _flag(REFUSED, "-hf --hf-repo -hff --hf-file -mu --model-url", "duo downloads no model at start: --model takes "
          "a path or a name `duo models pull` fetched", value="REPO"),
    _flag(REFUSED, "--keep", "duo never shifts the context, so keeps no tokens through a shift", value="N"),
)


class _Record(argparse.Action):
    """Keeps a flag duo ignores or refuses, with its spelling, in the namespace list `dest`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest, None) or []), option_string])


class _SetDefault(argparse.Action):
    """Keeps a sampling default, under its body field (its dest less DEFAULT_PREFIX), in the namespace dict
    `server_defaults`; a switch keeps its const."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        fields = dict(getattr(namespace, "server_defaults", None) or {})
        fields[self.dest.removeprefix(DEFAULT_PREFIX)] = self.const if values == [] else values
        namespace.server_defaults = fields


DEFAULT_PREFIX = "default_"


def add_llama_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Register LLAMA_FLAGS on `parser` (hidden from the options list: --help prints them as one table)."""
    parser.set_defaults(ignored_flags=[], refused_flags=[], server_defaults={}, tags=[], host=None, port=None,
                        chat_template=None, chat_template_file=None, jinja=True, slots=True, kv_unified=True,
                        cors_origins=None, chat_template_kwargs=None, reasoning="auto", reasoning_budget=-1)
    for flag in LLAMA_FLAGS:
        if flag.own:
            continue
        if flag.kind in (IGNORED, REFUSED):
            parser.add_argument(*flag.names, dest=f"{flag.kind}_flags", action=_Record,
                                nargs=flag.values if flag.value else 0, help=argparse.SUPPRESS)
        elif flag.kind == DEFAULT:
            parser.add_argument(*flag.names, dest=DEFAULT_PREFIX + flag.dest, action=_SetDefault,
                                nargs=None if flag.value else 0, type=flag.convert if flag.value else None,
                                const=flag.const, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        elif flag.value:
            parser.add_argument(*flag.names, dest=flag.dest, type=flag.convert, default=argparse.SUPPRESS,
                                action="append" if flag.dest in ("alias", "tags") else "store",
                                help=argparse.SUPPRESS)
        else:
            parser.add_argument(*flag.names, dest=flag.dest, action="store_const", const=flag.const,
                                default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def flags_table(flags: Sequence[LlamaFlag] = LLAMA_FLAGS) -> str:
    """The table --help prints: each of llama-server's flags and what duo-target does with it."""
    sections = ((TAKEN, "taken, with llama-server's meaning"),
                (DEFAULT, "taken as server-wide sampling defaults: a request that leaves the field out gets "
                          "it, its own field wins"),
                (IGNORED, "accepted and ignored (they change no answer; a startup line says so)"),
                (REFUSED, "refused at startup (ignoring them would change answers)"))
    lines = ["llama-server's flags (its names and meanings, as in llama.cpp's common/arg.cpp):"]
    for kind, title in sections:
        lines.append(f"  {title}:")
        for flag in (flag for flag in flags if flag.kind == kind):
            spelled = ", ".join(flag.names) + (f" {flag.value}" if flag.value else "")
            lines.append(f"    {spelled:<44} {flag.meaning}")
    return "\n".join(lines)


def refusal(args: argparse.Namespace) -> str | None:
    """The startup error naming the first refused flag given, with why and what to do; None where none is."""
    for spelled in args.refused_flags:
        flag = next(flag for flag in LLAMA_FLAGS if spelled in flag.names)
        return f"{spelled}: {flag.meaning} (llama-server's flag, refused: ignoring it would change answers)"
    return None


def ignored_lines(args: argparse.Namespace) -> list[str]:
    """One startup line per ignored flag given, saying that duo ignores it and why."""
    lines = []
    for spelled in dict.fromkeys(args.ignored_flags):
        flag = next(flag for flag in LLAMA_FLAGS if spelled in flag.names)
        lines.append(f"duo-target ignores llama-server's {spelled}: {flag.meaning}")
    return lines
