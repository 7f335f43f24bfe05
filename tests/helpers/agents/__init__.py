"""Real coding agents (Codex CLI, Claude Code, Qwen Code) run from npm against duo-target, through a logging proxy."""
