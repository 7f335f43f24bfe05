"""Headless Chromium driven from Python over the Chrome DevTools Protocol on a pipe (--remote-debugging-pipe): no
driver, no package, no port. Chromium reads commands on its file descriptor 3 and writes answers and events on 4,
each a JSON message ended by a NUL byte."""

from __future__ import annotations

import base64
import fcntl
import itertools
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
WIDTH, HEIGHT = 1280, 900


class BrowserError(Exception):
    """A command Chromium refused, or a script on the page that threw."""


def _as_fds_3_and_4(commands: int, answers: int):
    """For the child, before it runs Chromium: its ends of the pipes as descriptors 3 and 4 (moved out of the way
    first, in case either already is 3 or 4)."""
    def move() -> None:
        high_commands = fcntl.fcntl(commands, fcntl.F_DUPFD, 10)
        high_answers = fcntl.fcntl(answers, fcntl.F_DUPFD, 10)
        os.dup2(high_commands, 3)
        os.dup2(high_answers, 4)

    return move


class Browser:
    """One headless Chromium and one page (tab) in it."""

    def __init__(self, profile: Path, flags: tuple[str, ...] = ()) -> None:
        assert CHROMIUM, "no Chromium"
        commands_read, commands_write = os.pipe()
        answers_read, answers_write = os.pipe()
        self.process = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-extensions", f"--window-size={WIDTH},{HEIGHT}", f"--user-data-dir={profile}", *flags, "about:blank"],
            preexec_fn=_as_fds_3_and_4(commands_read, answers_write), pass_fds=(3, 4),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(answers_write)
        self._commands = commands_write
        self._answers = answers_read
        self._ids = itertools.count(1)
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.on_page("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                     mobile=False)

    def _read(self) -> None:
        buffer = b""
        while chunk := os.read(self._answers, 1 << 16):
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                with self._lock:
                    waiting = self._replies.pop(message.get("id"), None)  # events have no id: not waited for
                if waiting is not None:
                    waiting.put(message)

    def call(self, method: str, session: str | None = None, timeout: float = 60, **params: Any) -> dict[str, Any]:
        """A command's result (to the browser, or to the page's `session`)."""
        command_id = next(self._ids)
        reply: queue.Queue[dict[str, Any]] = queue.Queue(1)
        with self._lock:
            self._replies[command_id] = reply
        message = {"id": command_id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        try:
            answer = reply.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer within {timeout} s") from None
        if "error" in answer:
            raise BrowserError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def on_page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.call(method, session=self.session, **params)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression on the page (awaited where it is a promise)."""
        result = self.on_page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """Poll `expression` until it is truthy; its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise BrowserError(f"still false after {timeout} s: {expression}")

    def open(self, url: str) -> None:
        self.on_page("Page.enable")
        self.on_page("Page.navigate", url=url)
        self.wait_for(f"location.href.startsWith({json.dumps(url)}) && document.readyState === 'complete'")

    def click(self, selector: str) -> None:
        """A real mouse click (pressed and released) at the middle of the element."""
        x, y = self.evaluate(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
            e.scrollIntoView({{block: "center"}}); const r = e.getBoundingClientRect();
            return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
        self.on_page("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.on_page("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, selector: str, text: str) -> None:
        """Type `text` into a field, in place of what it holds (as a user who selected it all first)."""
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.focus(); e.select(); }})()")
        self.on_page("Input.insertText", text=text)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.on_page("Page.captureScreenshot", format="png")["data"]))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (BrowserError, OSError):
            pass  # it may be gone already: it is stopped below either way
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        self._reader.join(10)  # Chromium is gone: its end of the pipe is closed, and the reader has read it all
        os.close(self._commands)
        os.close(self._answers)
