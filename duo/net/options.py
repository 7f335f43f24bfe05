"""gRPC's options for duo's servers and channels: message sizes, keepalive, one process a port."""

from __future__ import annotations

# The vocabulary in the handshake is a few MB; chains and commits are tiny.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Pings every 10 s find a peer that vanished without closing its socket (power loss, cable).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def grpc_server_options() -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Ping every client too: one that vanished (a frozen process, a dead host) would otherwise hold
        # its running place and sessions until TCP gives up, which can take hours. A peer that does not
        # answer within the timeout is dropped, which cancels its calls.
        *_keepalive_options(),
        # Keep pinging while a stream sends nothing (grpc stops after 2 pings without data by default):
        # a stalled stream is exactly when a vanished peer must be found.
        ("grpc.http2.max_pings_without_data", 0),
        # Ping, and accept the client's pings, also between calls instead of answering GOAWAY.
        ("grpc.keepalive_permit_without_calls", 1),
        # Clients ping every KEEPALIVE_TIME_MS (duo.target.pool.link and duo generate do), through calls that send
        # nothing for minutes (a long prefill, a wait in the queue): allow pings half as far apart, and count
        # only faster ones as strikes. (grpc's name for GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS:
        # an unknown name is ignored silently, and grpc's default, one ping in 5 minutes, cut every client.)
        ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS // 2),
        ("grpc.http2.max_ping_strikes", 0),
        # grpc sets SO_REUSEPORT by default: a second process on the same port would then share it
        # silently (and take half the connections) instead of failing to start.
        ("grpc.so_reuseport", 0),
    ]


# Clients' calls at once on duo-target's gRPC port (beyond: RESOURCE_EXHAUSTED); generations are bounded
# further by --parallel and --queue-size. Their messages are capped like HTTP bodies.
MAX_CLIENT_RPCS = 256
MAX_CLIENT_MESSAGE_BYTES = 16 * 1024 * 1024


def client_server_options() -> list[tuple[str, int]]:
    """grpc_server_options for the clients' port: a client's messages are capped like an HTTP body, and a
    client that pings too often is cut off (grpc's ping-flood protection, which the draft link disables
    for its own peer)."""
    capped = {"grpc.max_receive_message_length": MAX_CLIENT_MESSAGE_BYTES,
              "grpc.max_send_message_length": MAX_CLIENT_MESSAGE_BYTES}
    return [(name, capped.get(name, value)) for name, value in grpc_server_options()
            if name != "grpc.http2.max_ping_strikes"]


def _keepalive_options() -> list[tuple[str, int]]:
    return [
        ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        # What grpc core really waits for a ping's answer: it no longer enforces keepalive_timeout_ms
        # (grpc/grpc#39239), and this wait defaults to a minute.
        ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ]


def grpc_channel_options(max_receive_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        *_keepalive_options(),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnection is ours (duo.target.pool.link backs off itself); keep grpc's own backoff short.
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]
