"""How each coding agent is pointed at duo non-interactively, with every kind of vendor traffic turned off."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from duo.bench.agents import AGENT_CONTEXT
from duo.bench.live.npm import installed

TASK = "create hello.py that prints hello"
API_KEY = "sk-duo-test"  # duo-target runs without --api-key: any key is accepted; the clients insist on one
OPENCODE_OUTPUT = 8192  # opencode's bound on an answer, in tokens (Qwen Code asks for 8000)
# How long a client waits for a slow target's first event (a long prompt read on a CPU core): the README's setting.
SLOW_TARGET_MS = 1_800_000
OPENCODE_TIMEOUTS = ("timeout", "headerTimeout", "chunkTimeout")  # its provider's options, in milliseconds


@dataclass(frozen=True)
class Agent:
    name: str
    package: str
    version: str
    binary: str
    model_path: str  # the path of its model calls
    # Read-only tools of its default set, in order of preference, that the proxy may force the first call to
    # (arguments are sampled from the schema by a random model: never a shell or a write tool).
    harmless_tools: tuple[str, ...]
    # How a connection beyond 127.0.0.1 is caught: "proxy", HTTP(S)_PROXY pointed at a trap (with NO_PROXY=127.0.0.1,
    # for a client that honours it), or "node", a guard preloaded into a client that runs on Node.
    guard: str
    # The flags that let it edit files in its working folder. Run non-interactively, each agent refuses by default
    # every write (Codex's exec sandbox is read-only, Claude Code's -p and Qwen Code's default approval mode deny an
    # edit that no one is there to approve): TASK needs them; the tool set stays the default one.
    edit_flags: tuple[str, ...]

    def executable(self) -> Path:
        return installed(self.package, self.version, self.binary)

    def command(self, home: Path, proxy_url: str, may_edit: bool = False) -> tuple[list[str], dict[str, str]]:
        """The command line and the environment variables (beyond HOME) that run TASK against `proxy_url`,
        allowed to edit files in its folder with `may_edit`."""
        argv, variables = CONFIGURE[self.name](self, home, proxy_url)
        # TASK stays last: each takes it as its trailing positional argument.
        return (argv[:-1] + list(self.edit_flags) + argv[-1:] if may_edit else argv), variables


def codex(agent: Agent, home: Path, proxy_url: str) -> tuple[list[str], dict[str, str]]:
    # codex-rs config (docs/config.md): a provider speaking the Responses API; analytics, feedback, OpenTelemetry
    # export and the update check off. No auth.json: a provider without env_key sends no key.
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(f"""\
model = "duo"
model_provider = "duo"
check_for_update_on_startup = false

[model_providers.duo]
name = "duo"
base_url = "{proxy_url}/v1"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"

[features]
plugins = false
remote_plugin = false
apps = false
""")
    # exec: non-interactive; the empty folder is no git repository.
    return [str(agent.executable()), "exec", "--skip-git-repo-check", TASK], {"CODEX_HOME": str(codex_home)}


def claude_code(agent: Agent, home: Path, proxy_url: str) -> tuple[list[str], dict[str, str]]:
    # Claude Code's documented environment: -p prints one answer and exits; the rest turn its vendor traffic off
    # (Statsig telemetry, the auto-updater, Sentry error reports, and the "nonessential" rest at once).
    # Its stream watchdog is reset by every event but ping, so a prompt read over its 5-minute default is abandoned and
    # sent again: the README's setting for a slow target (the F16 1.5B on one core read its 18.8k-token prompt in
    # over 30 minutes beside another session's cached prefix). And its requests time out after API_TIMEOUT_MS
    # (600,000 by default; streamed or not): its sub-agents' first requests (11.4k tokens, two read at once) were cut
    # at exactly 600 s, and their task with them.
    return [str(agent.executable()), "-p", TASK], {
        "ANTHROPIC_BASE_URL": proxy_url, "ANTHROPIC_API_KEY": API_KEY, "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(SLOW_TARGET_MS),
        "API_TIMEOUT_MS": str(SLOW_TARGET_MS),
        "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }


def qwen_code(agent: Agent, home: Path, proxy_url: str) -> tuple[list[str], dict[str, str]]:
    # qwen-code docs/configuration/settings.md: the OpenAI-compatible auth type, and usage statistics, telemetry
    # and the auto-update check off.
    settings = {"security": {"auth": {"selectedType": "openai"}}, "general": {"enableAutoUpdate": False},
                "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False}}
    (home / ".qwen").mkdir(parents=True, exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    return [str(agent.executable()), TASK], {
        "OPENAI_BASE_URL": f"{proxy_url}/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": "duo",
    }


def opencode(agent: Agent, home: Path, proxy_url: str) -> tuple[list[str], dict[str, str]]:
    # opencode's global config ($XDG_CONFIG_HOME/opencode/opencode.json): a provider through its bundled
    # @ai-sdk/openai-compatible, the update check and sharing off. A model it does not know has no limits: it would
    # ask for 32000 tokens at every turn and never compact the conversation; given the context the kit's servers
    # serve and an answer's bound, it compacts before the prompt outgrows it, as it does for a model it knows.
    config = home / ".config" / "opencode"
    (config / "node_modules").mkdir(parents=True, exist_ok=True)
    # Its provider gives up on a request after 5 minutes without response headers or between two streamed chunks
    # (1.18.33's headerTimeout and chunkTimeout defaults): the F16 1.5B on one core reads its 7.2k-token prompt in
    # ~4.5 minutes beside its title request (it left, and sent the turn again); given the README's 30 minutes.
    model = {"name": "duo", "limit": {"context": AGENT_CONTEXT, "output": OPENCODE_OUTPUT}}
    options = {"baseURL": f"{proxy_url}/v1", "apiKey": API_KEY, **dict.fromkeys(OPENCODE_TIMEOUTS, SLOW_TARGET_MS)}
    (config / "opencode.json").write_text(json.dumps({
        "model": "duo/duo", "autoupdate": False, "share": "disabled",
        "provider": {"duo": {"npm": "@ai-sdk/openai-compatible", "name": "duo", "options": options,
                             "models": {"duo": model}}}}))
    # At every start it installs @opencode-ai/plugin from npm into each config folder (for plugins written there),
    # with no setting to skip it, unless the folder's package.json and package-lock.json already list it beside a
    # node_modules: they do, and the folder holds no plugin that would need it.
    listed = {"dependencies": {"@opencode-ai/plugin": agent.version}}
    (config / "package.json").write_text(json.dumps(listed))
    (config / "package-lock.json").write_text(json.dumps({"packages": {"": listed}}))
    # run: non-interactive. The environment turns off the models.dev catalog fetch (the bundled copy is read) and
    # the language servers' downloads (a file it reads or edits would fetch one).
    return [str(agent.executable()), "run", TASK], {
        "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }


CONFIGURE = {"codex": codex, "claude-code": claude_code, "qwen-code": qwen_code, "opencode": opencode}

AGENTS = (
    Agent("codex", "@openai/codex", "0.171.0", "codex", "/v1/responses", ("get_goal", "view_image"), "proxy",
          ("--sandbox", "workspace-write")),
    # Claude Code's npm package is a native executable: no Node guard can be preloaded into it.
    Agent("claude-code", "@anthropic-ai/claude-code", "2.1.197", "claude", "/v1/messages",
          ("TaskList", "Read", "Glob"), "proxy", ("--permission-mode", "acceptEdits")),
    # Qwen Code sends every request through HTTPS_PROXY when it is set, 127.0.0.1 included (its OpenAI client
    # takes a ProxyAgent that reads no NO_PROXY): a trap would catch duo's traffic too.
    Agent("qwen-code", "@qwen-code/qwen-code", "0.15.10", "qwen", "/v1/chat/completions",
          ("list_directory", "glob", "read_file"), "node", ("--approval-mode", "auto-edit")),
    # opencode (a Bun executable) sends its fetches through HTTP(S)_PROXY and honours NO_PROXY. Its build agent
    # ships allowing every tool inside its working folder (permission "*": "allow"; a path outside it asks, and run
    # refuses what no one approves): TASK needs no flag, and none is given that would allow more. Its glob and grep
    # run ripgrep, downloaded from GitHub at first use where no rg is on PATH: read comes first.
    Agent("opencode", "opencode-ai", "1.18.33", "opencode", "/v1/chat/completions", ("read", "glob", "grep"), "proxy",
          ()),
)
