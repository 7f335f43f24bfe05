"""The programs people run, each its command line and start-up: `duo-target` (target.py), `duo-draft`
(draft.py) and `duo` (main.py, with `duo generate` in generate.py and `duo demo` in demo.py).

The top floor: a program wires the floors below it together (the target's loop to its client API, the
draft's loop to its gRPC service, the models to both), so it may import any duo module; no duo module
imports it.
"""
