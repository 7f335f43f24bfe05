"""What clients of duo-target see: the OpenAI-compatible HTTP API (http.py, its request bodies in
bodies.py), the gRPC service for clients (grpc.py), and what both transports share: admission of
requests (admission.py), checking them and turning committed tokens into text (completion.py), chat
templates (chat.py), stop strings (stop.py) and the target's Prometheus metrics (metrics.py).

May import the target's loop (duo.target), duo.models and the shared modules at the top of duo; never
duo.cli, duo.bench or duo.draft.
"""
