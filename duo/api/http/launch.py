"""What duo-target's launch line (llama-server's flags among duo's) sets for the HTTP API beyond the routes."""

from __future__ import annotations

from dataclasses import dataclass, field

from duo.api.serving.defaults import ServerDefaults


@dataclass(frozen=True)
class LaunchSettings:
    """llama-server's -a/--alias and --tags (listed by /v1/models: `aliases` sorted, as its std::set holds them),
    its sampling defaults (--temp, --seed, -n, ...), --no-slots (GET /slots then answers 501, as there) and
    --metrics (without it GET /metrics answers 501, as there: the server's load and counts are not shown to anyone
    who can reach the port unless asked for)."""

    aliases: tuple[str, ...] = ()
    tags: tuple[str, ...] = ()
    defaults: ServerDefaults = field(default_factory=ServerDefaults)
    slots: bool = True
    metrics: bool = False
