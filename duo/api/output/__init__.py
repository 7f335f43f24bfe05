"""The model's text as answers show it: deltas of content, reasoning and tool calls (deltas, events), the calls read out
of the template's markup as it streams (calls, scanning), and log-probabilities (logprobs)."""
