"""Real coding agents (Codex CLI, Claude Code, Qwen Code) run from npm against duo-target through a logging proxy:
`duo bench --live-agents` (kit.py) and tests/e2e/test_agents.py share this machinery."""
