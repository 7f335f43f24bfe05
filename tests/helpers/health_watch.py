"""Times a served target's /health from a process of its own, for the hostile soaks (helpers.hostile.HealthWatch):

    cd tests && python -m helpers.health_watch http://127.0.0.1:PORT

It asks every 20 ms, each time on a new connection as a load balancer's probe does, until its standard input closes,
then prints every answer as [unix time asked, seconds taken, status] in one JSON list. A request that fails or times
out counts as taking the whole timeout, with status 0."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from urllib.parse import urlsplit

TIMEOUT_S = 10.0
INTERVAL_S = 0.02


def ask(host: str, port: int) -> tuple[float, int]:
    """Seconds /health took to answer, and its status (0 where it failed)."""
    began = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        connection.request("GET", "/health")
        response = connection.getresponse()
        response.read()
        return time.perf_counter() - began, response.status
    except OSError:
        return TIMEOUT_S, 0
    finally:
        connection.close()


def main() -> None:
    where = urlsplit(sys.argv[1])
    stopped = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stopped.set()), daemon=True).start()
    samples = []
    while not stopped.is_set():
        asked = time.time()
        took, status = ask(where.hostname, where.port)
        samples.append([asked, took, status])
        time.sleep(INTERVAL_S)
    print(json.dumps(samples), flush=True)


if __name__ == "__main__":
    main()
