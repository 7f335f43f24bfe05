"""The model thread's resource helpers: whatever is cancelled when, what was made gets closed."""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from duo.api.serving.generate import MAX_BODY_BYTES
from duo.cli import draft as draft_process
from duo.cli import target as target_process
from duo.cli.process import host_port, is_loopback
from duo.llama.model import N_BATCH
from duo.llama.worker import ModelWorker
from duo.models import hub
from duo.net import reconnect
from duo.net.options import client_server_options, grpc_server_options
from duo.net.timeouts import within

WAIT_S = 5.0


class Resource:
    """Stands for a llama context: made and closed on the model thread."""

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        self.closed.set()


class Factory:
    """Makes Resources; with `hold`, each creation signals `creating` and then waits for `proceed`."""

    def __init__(self, *, hold: bool = False) -> None:
        self.made: list[Resource] = []
        self.hold = hold
        self.creating, self.proceed = threading.Event(), threading.Event()

    def __call__(self) -> Resource:
        self.creating.set()
        if self.hold:
            assert self.proceed.wait(WAIT_S)
        self.made.append(Resource())
        return self.made[-1]


async def set_soon(event: threading.Event) -> None:
    """Wait, without blocking the event loop, until another thread sets `event`."""
    assert await asyncio.to_thread(event.wait, WAIT_S)


def occupy(worker: ModelWorker) -> tuple[threading.Event, threading.Event]:
    """Another request's model call: it holds the model thread until `release` is set; `busy` once it runs."""
    busy, release = threading.Event(), threading.Event()
    worker._executor.submit(lambda: (busy.set(), release.wait(WAIT_S)))
    return busy, release


async def cancelled(task: asyncio.Task) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_resource_whose_creation_was_cancelled_midway_is_closed_once_made():
    factory = Factory(hold=True)

    async def scenario() -> None:
        worker = ModelWorker()

        task = asyncio.create_task(worker.create(factory))
        await set_soon(factory.creating)
        await cancelled(task)  # the client left while its context was being made
        factory.proceed.set()
        await worker.run(lambda: None)  # the creation has finished

    asyncio.run(scenario())
    [resource] = factory.made
    assert resource.closed.wait(WAIT_S) and resource.closes == 1


def test_a_creation_cancelled_before_its_turn_on_the_model_thread_never_runs():
    factory = Factory()

    async def scenario() -> None:
        worker = ModelWorker()
        busy, release = occupy(worker)
        await set_soon(busy)
        task = asyncio.create_task(worker.create(factory))
        await asyncio.sleep(0.05)  # the creation waits its turn
        await cancelled(task)
        release.set()
        await worker.run(lambda: None)  # everything queued before this has run

    asyncio.run(scenario())
    assert factory.made == []


def test_a_close_cancelled_while_waiting_for_the_model_thread_still_runs():
    factory = Factory()

    async def scenario() -> None:
        worker = ModelWorker()
        occupied: asyncio.Future[tuple[threading.Event, threading.Event]] = asyncio.Future()

        async def use() -> None:
            resource = await worker.create(factory)
            occupied.set_result(occupy(worker))  # the close must wait behind this call
            await worker.close(resource)

        task = asyncio.create_task(use())
        busy, release = await occupied
        await set_soon(busy)
        await asyncio.sleep(0.05)  # the task now waits for its close to get a turn
        await cancelled(task)
        release.set()

    asyncio.run(scenario())
    [resource] = factory.made
    assert resource.closed.wait(WAIT_S) and resource.closes == 1


@pytest.mark.parametrize("value, says", [
    ("http://machineA:7070", "write 'machineA:7070', not 'http://machineA:7070'"),
    ("machineA", "is not HOST:PORT"), ("machineA:0", "the port is 1-65535"), ("machineA:http", "is not HOST:PORT"),
])
def test_peer_and_listen_addresses_are_checked_with_what_to_write_instead(value, says, capsys):
    with pytest.raises(ValueError, match=re.escape(says)):
        host_port(value, "--peer")
    assert target_process.main(["--model", "absent.gguf", "--listen", "127.0.0.1:0", "--peer", value]) == 1
    err = capsys.readouterr().err
    assert says in err and "--peer" in err
    if not value.endswith(":0"):  # to listen on, port 0 is fine: the system picks one
        assert draft_process.main(["--model", "absent.gguf", "--listen", value]) == 1
        assert "--listen" in capsys.readouterr().err


def test_loopback_addresses_are_told_from_reachable_ones():
    assert host_port("[::1]:7070", "--listen") == ("::1", 7070)
    assert host_port("127.0.0.1:0", "--listen", listening=True) == ("127.0.0.1", 0)  # the system picks the port
    assert all(is_loopback(host) for host in ("127.0.0.1", "127.5.0.1", "::1", "localhost"))
    assert not any(is_loopback(host) for host in ("0.0.0.0", "::", "192.168.1.20", "machineA"))


def test_the_log_level_is_taken_in_any_case_and_a_wrong_one_is_a_usage_error(capsys):
    assert target_process.build_parser().parse_args(["--model", "m", "--log-level", "debug"]).log_level == "DEBUG"
    with pytest.raises(SystemExit) as exit:
        target_process.build_parser().parse_args(["--model", "m", "--log-level", "loud"])
    assert exit.value.code == 2 and "invalid choice: 'LOUD'" in capsys.readouterr().err


def test_each_process_defaults_to_its_roles_catalog_model_and_names_the_pull_that_fetches_it(tmp_path, monkeypatch,
                                                                                          capsys):
    monkeypatch.setenv("DUO_HOME", str(tmp_path))  # nothing pulled here
    assert target_process.main(["--listen", "127.0.0.1:0"]) == 1
    assert f"run `duo models pull {hub.DEFAULT_TARGET}`" in capsys.readouterr().err
    assert draft_process.main(["--listen", "127.0.0.1:0", "--device", "cpu"]) == 1  # on a CPU: the Q4_0 copy
    assert f"run `duo models pull {hub.CPU_DRAFT}`" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--draft-max", "--sync"])
def test_a_verify_batch_larger_than_one_model_call_is_refused_at_start(flag, capsys):
    assert target_process.main(["--model", "absent.gguf", "--listen", "127.0.0.1:0", flag, str(N_BATCH)]) == 1
    assert f"{flag} {N_BATCH} is too large" in capsys.readouterr().err
    settings = target_process.settings_from(target_process.build_parser().parse_args([flag, str(N_BATCH - 1)]))
    assert settings.draft_max == N_BATCH - 1


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    def key(*flags: str) -> str | None:
        return target_process.api_key_from(target_process.build_parser().parse_args(list(flags)))

    monkeypatch.delenv("DUO_API_KEY", raising=False)
    assert key() is None
    monkeypatch.setenv("DUO_API_KEY", "from-env")
    assert key() == "from-env"
    (tmp_path / "key").write_text("from-file\nignored\n")
    assert key("--api-key-file", str(tmp_path / "key")) == "from-file" and key("--api-key", "flag") == "flag"
    (tmp_path / "empty").write_text("\n")
    for flags, says in ((["--api-key-file", str(tmp_path / "empty")], "holds no key"),
                        (["--api-key-file", str(tmp_path / "absent")], "cannot read"),
                        (["--api-key", "k", "--api-key-file", str(tmp_path / "key")], "not both")):
        with pytest.raises(ValueError, match=says):
            key(*flags)


def test_the_clients_grpc_port_caps_messages_like_http_and_keeps_grpcs_ping_flood_protection():
    options = dict(client_server_options())
    assert options["grpc.max_receive_message_length"] == MAX_BODY_BYTES
    assert "grpc.http2.max_ping_strikes" not in options  # grpc's default: a ping flood closes the connection
    assert dict(grpc_server_options())["grpc.http2.max_ping_strikes"] == 0  # the draft link's own peer pings freely
    assert options["grpc.so_reuseport"] == 0



def test_within_never_swallows_a_cancellation_that_meets_the_awaited_result():
    """CPython gh-86296: asyncio.wait_for (up to 3.11) returns the awaited result to a task cancelled in the turn
    the result came, and the task goes on as if never cancelled: the link's writer then waited forever on its next
    event, and so did everything that cancelled it (seen as a 300 s hang of the suite)."""

    async def scenario() -> tuple[bool, bool]:
        awaited = asyncio.get_running_loop().create_future()
        went_on = asyncio.Event()

        async def waiter() -> None:
            await within(awaited, 10.0)
            went_on.set()
            await asyncio.Event().wait()  # like the writer's next outbox.get()

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the waiter now waits
        awaited.set_result(None)
        task.cancel()  # in the same turn
        await asyncio.wait({task}, timeout=2)
        return task.cancelled(), went_on.is_set()

    assert asyncio.run(scenario()) == (True, False)


def test_within_times_out_and_cancels_what_it_awaited():
    async def scenario() -> asyncio.Task:
        slow = asyncio.create_task(asyncio.sleep(10))
        with pytest.raises(asyncio.TimeoutError):
            await within(slow, 0.01)
        return slow

    assert asyncio.run(scenario()).cancelled()
    assert asyncio.run(within(asyncio.sleep(0, "done"), 1.0)) == "done"


def test_an_unreachable_peer_is_reported_at_once_then_once_a_minute_and_afresh_after_it_was_reached(monkeypatch):
    now = [10.0]

    async def run() -> list:
        monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: now[0])
        report, seen = reconnect.Unreachable(), []
        for step in (0.0, 5.0, reconnect.UNREACHABLE_LOG_EVERY_S, 1.0):
            now[0] += step
            seen.append(report.seconds_to_log())
        report.reached()
        now[0] += 1.0
        seen.append(report.seconds_to_log())
        return seen

    assert asyncio.run(run()) == [0.0, None, 65.0, None, 0.0]
