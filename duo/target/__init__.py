"""The target's loop: each step verifies in one batch whatever chain tokens the draft sent
(generation.py), batching every request's verify work and prompt chunks into model calls
(batching.py), the target's view of each session's chain (chain.py), the link to duo-draft
(link.py), how many drafts to verify (policy.py) and whether speculation pays at all (switch.py).

Knows nothing of HTTP or of clients: may import only the shared modules at the top of duo (the model
layer, sampling, the wire protocol, runtime); never duo.api, duo.cli, duo.bench or duo.draft.
"""
