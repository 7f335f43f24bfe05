"""The draft's loop: a session per target generation and the rounds that draft for every session in
one batched decode (drafter.py, batch.py, session.py), the branches it drafts in spare time
(branches.py), what each round is worth (value.py), its Prometheus metrics (metrics.py), and its gRPC
service: a stream per target (service.py), whether the target dialed it or it dialed the target (joining.py,
duo-draft --join).

May import only the shared modules at the top of duo; never duo.target (the two processes share the
wire protocol, not each other's code), duo.api, duo.cli or duo.bench.
"""
