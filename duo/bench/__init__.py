"""The benchmark behind `duo bench`: duo beside its peers in one run (run.py), the processes of each
mode (cluster.py; llama-server in llama_server.py; a delayed link in delay_proxy.py), timings of the
models themselves (timing.py), the numbers, tables and charts (report.py, concurrency.py), the
pace-aware bound (pace_bound.py), the acceptance of the sampled verification modes (acceptance.py),
and the coding agents run for real (live/: `duo bench --live-agents`).

Runs duo's programs as processes from a checkout (never imports duo.cli, duo.api, duo.target or
duo.draft); may import duo.models and the shared modules at the top of duo.
"""
