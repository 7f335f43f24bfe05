"""A listener on 127.0.0.1 that HTTP(S)_PROXY points at: every connection an agent tries beyond 127.0.0.1 lands
here, is recorded by its request line (CONNECT host:443 ...) and refused."""

from __future__ import annotations

import socket
import threading

from duo.net.listening import free_port


class ProxyTrap:
    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.attempts: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.thread = threading.Thread(target=self.serve, name="proxy-trap", daemon=True)

    def __enter__(self) -> ProxyTrap:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.listener.close()
        self.thread.join(5)

    def serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return  # closed by __exit__
            with connection:
                connection.settimeout(5)
                try:
                    self.attempts.append(connection.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace"))
                    connection.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                except OSError as error:
                    self.attempts.append(f"(unread: {error})")
