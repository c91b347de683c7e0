"""Chat templates rendered in a worker process with a time and a memory bound.

A checkpoint's chat template is a program, and a request's messages drive it: a template's
loops over them, or its string operations, may take any time or memory. The server renders
in one worker process of its own (started from multiprocessing's fork server, so starting
another is quick and never forks the server's threads) under an address-space limit
(`RLIMIT_AS`: its size at start plus `memory_bytes`; on Linux):

    render(messages):  send them → the text or the template's own error, within `timeout_s`
    too slow           the worker is killed and replaced; the request gets a RequestError
    out of memory      the render fails with MemoryError; the worker is replaced likewise

One render runs at a time (a lock): a template renders in milliseconds, and a slow one costs
the others at most `timeout_s`. Every failure is a `RequestError` (a 400 naming `messages`).
"""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any, Mapping, Sequence

from .requests import RequestError

ANSWER_LIMIT_S = 60.0
"""How long a worker may take to start (a fresh fork server imports the library first)."""


def _serve_renders(connection, template: str, variables: dict, memory_bytes: int) -> None:
    """The worker: compile `template`, limit the address space, then render what arrives."""
    from .._chat_template import compiled_template, render_chat

    try:
        compiled_template(template)
    except Exception as error:  # a syntax error: reported at start-up
        connection.send(("error", f"{type(error).__name__}: {error}"))
        return
    _limit_address_space(memory_bytes)
    connection.send(("ready", None))
    while True:
        try:
            messages = connection.recv()
        except EOFError:  # the server went away
            return
        try:
            answer = ("ok", render_chat(template, messages, add_generation_prompt=True, **variables))
        except MemoryError:
            connection.send(("memory", None))
            return  # a fresh worker takes over: this one's heap may be fragmented
        except Exception as error:  # the template's raise_exception, or an error in its code
            answer = ("error", str(error) or type(error).__name__)
        connection.send(answer)


def _limit_address_space(memory_bytes: int) -> None:
    """This process may map `memory_bytes` more than it has now (Linux: /proc tells the size;
    elsewhere the limit is left as it is)."""
    import resource

    try:
        with open("/proc/self/statm") as statm:
            size = int(statm.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (size + memory_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (OSError, ValueError):
        pass


class TemplateRenderer:
    """`render(messages)`: the text of a conversation through `template`, in a worker
    process bounded by `timeout_s` seconds and `memory_bytes` more bytes of address space;
    `variables` (the special tokens) are visible to the template."""

    def __init__(self, template: str, variables: Mapping[str, Any], *, timeout_s: float, memory_bytes: int):
        self.template, self.variables = template, dict(variables)
        self.timeout_s, self.memory_bytes = timeout_s, memory_bytes
        self._context = multiprocessing.get_context("forkserver")
        self._context.set_forkserver_preload([__name__])
        self._lock = threading.Lock()
        self._process = self._connection = None

    def start(self) -> None:
        """Start the worker, unless it runs (the first one also starts the fork server:
        seconds). A template that does not compile is a ValueError."""
        with self._lock:
            if self._process is None:
                self._start()

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The prompt text of `messages` (add_generation_prompt); a failure is a RequestError."""
        with self._lock:
            if self._process is None:
                self._start()
            self._connection.send(list(messages))
            if not self._connection.poll(self.timeout_s):
                self._stop()
                raise RequestError(f"the chat template took longer than {self.timeout_s:g} s (--template-timeout) "
                                   "to render these messages", param="messages", code="template_limit")
            try:
                kind, value = self._connection.recv()
            except EOFError:
                kind, value = "memory", None
            if kind == "memory":
                self._stop()
                raise RequestError(f"the chat template needed more than {self.memory_bytes >> 20} MiB "
                                   "(--template-memory) to render these messages", param="messages",
                                   code="template_limit")
            if kind == "error":
                raise RequestError(f"the chat template refused these messages: {value}", param="messages",
                                   code="template_error")
            return value

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> None:
        ours, theirs = self._context.Pipe()
        process = self._context.Process(target=_serve_renders, args=(theirs, self.template, self.variables,
                                                                     self.memory_bytes), daemon=True)
        process.start()
        theirs.close()
        self._process, self._connection = process, ours
        if not ours.poll(ANSWER_LIMIT_S):
            self._stop()
            raise RuntimeError(f"the chat template worker did not start within {ANSWER_LIMIT_S:g} s")
        try:
            kind, value = ours.recv()
        except EOFError:
            kind, value = "error", "the worker ended at start"
        if kind != "ready":
            self._stop()
            raise ValueError(f"the chat template does not compile: {value}")

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.join()
            self._connection.close()
        self._process = self._connection = None
