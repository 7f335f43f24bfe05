"""The serving core every protocol's route stands on, in the order a request meets it: read (read: the body's JSON and
its bounds; bodies, sampler_fields: the generation fields every protocol's body holds; request: the neutral
CompletionRequest), prepare (prepare, chat_tokens, infill), admit (admit), generate (generate, choices) and decode
(decode, stop); and the target's Prometheus metrics (metrics)."""
