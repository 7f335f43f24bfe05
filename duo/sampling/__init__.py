"""Sampling: a row's distribution (distributions), the lossless verification of drafted chains (verification, with
coupled's shared-noise race), the request's settings (params), the one row pipeline both sides run (rows) and, in ops,
each transform a request can ask for.
It imports numpy only: the floor under everything else in duo (its vocabulary needs come in as Protocols)."""
