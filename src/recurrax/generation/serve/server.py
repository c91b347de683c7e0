"""The server of `recurrax serve`: loading, warm-up, uvicorn, shutdown (`serve`).

It prints `ready on http://HOST:PORT` (with `--uds`: `ready on unix:PATH`) on stderr once the
model is compiled for the first requests and the socket listens; a unix socket's file is
removed when the server exits. What cannot start (a missing extra, a directory that is not
a checkpoint, a chat template that does not compile, a port in use) is a `StartError` whose
message is one line.

One client cannot take the server down: every request is bounded (the body's bytes, the
prompt's tokens, the stop strings), and so is every wait (headers, body, idle connections)
and the chat template (it renders in a worker process, bounded in time and memory); parsing,
rendering and tokenizing run off the event loop. SIGINT or SIGTERM: it stops accepting
connections, lets running requests finish for the shutdown timeout, cancels the rest, and
returns 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import stat
import sys
import threading
import time

SERVE_MODULES = ("starlette", "uvicorn", "flax", "safetensors", "tokenizers", "jinja2")
"""What `recurrax serve` imports, all from the `serve` extra."""


class StartError(Exception):
    """What keeps the server from starting, said in one line."""


def serve(args) -> int:
    """Load, compile, listen and serve until SIGINT/SIGTERM (see the module notes). `args`: the
    options of `recurrax serve`, as its `parse_args` gives them; a `StartError` says what
    keeps it from starting."""
    from ..._extras import require

    try:
        for module in SERVE_MODULES:
            require(module, "serve", "recurrax serve")
    except ImportError as error:
        raise StartError(error) from None
    import uvicorn
    from ...nn.pretrained import from_pretrained
    from .. import cache_capacity, load_tokenizer
    from .._generate import TOKENS_PER_CALL

    from .app import create_app
    from .engine import Engine
    from .protocol import header_timeout_protocol
    from .requests import Limits, RequestParser
    from .templates import TemplateRenderer

    start = time.perf_counter()
    listening = _bound_unix(args.uds) if args.uds is not None else _bound(args.host, args.port)
    renderer = None
    try:
        tokenizer = _loaded(args.model, load_tokenizer)
        if tokenizer.chat_template is not None:  # its worker starts (seconds) while the model loads and compiles
            renderer = TemplateRenderer(tokenizer.chat_template, tokenizer.special_tokens,
                                        timeout_s=args.template_timeout, memory_bytes=args.template_memory << 20)
            threading.Thread(target=_quietly(renderer.start), daemon=True).start()
        model = _loaded(args.model, from_pretrained)
        engine = Engine(model, tokenizer, slots=args.slots, capacity=cache_capacity(model, args.max_model_len),
                        max_queue=args.max_queue, prefill_tokens=args.prefill_tokens,
                        tokens_per_call=args.tokens_per_call or TOKENS_PER_CALL)
        engine.warm_up()
        if renderer is not None:
            _started(renderer, args.model)
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        print(f"loaded and compiled {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        parser = RequestParser(tokenizer=tokenizer, render=renderer and renderer.render, model_name=name,
                               vocab_size=engine.vocab_size, max_model_len=args.max_model_len,
                               limits=Limits(args.max_prompt_tokens, args.max_stop_strings, args.max_stop_length))
        app = create_app(engine, parser, model_name=name, max_model_len=args.max_model_len,
                         max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout)
    except BaseException:
        _close(listening, args.uds)
        if renderer is not None:
            renderer.close()
        raise
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                            timeout_keep_alive=args.idle_timeout, http=header_timeout_protocol(args.header_timeout))
    server = _server_exiting_cleanly(uvicorn)(config)
    _announce_when_ready(server, args.host, args.uds)
    _raise_open_file_limit()
    try:
        server.run(sockets=[listening])
    finally:
        _close(listening, args.uds)
        if renderer is not None:
            renderer.close()
    return 0


def _started(renderer, directory: str) -> None:
    """Wait for the chat template's worker (started in the background): a template that does
    not compile is a StartError."""
    try:
        renderer.start()
    except (ValueError, RuntimeError) as error:
        raise StartError(f"{directory}: {error}; fix chat_template in tokenizer_config.json (or "
                         "chat_template.jinja)") from None


def _quietly(function):
    """`function`, its exception left for a later call to raise again."""
    def run():
        with contextlib.suppress(Exception):
            function()
    return run


def _bound(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads (a port in use fails at once); it
    listens (connections are accepted) once uvicorn starts serving."""
    listening = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind((host, port))
    except OSError as error:
        listening.close()
        raise StartError(f"cannot listen on {host}:{port}: {error.strerror or error}; choose another --host or "
                         "--port") from None
    return listening


def _bound_unix(path: str) -> socket.socket:
    """A unix-domain socket bound at `path` (a socket file nobody listens on any more, left by
    a server that was killed, is replaced; any other file there is an error)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise StartError(f"cannot listen on unix socket {path}: its directory {directory} does not exist; create "
                         "it or choose another --uds")
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise StartError(f"cannot listen on unix socket {path}: a file that is not a socket is there; remove "
                             "it or choose another --uds")
        if _listened_on(path):
            raise StartError(f"cannot listen on unix socket {path}: another server listens on it; stop it or "
                             "choose another --uds")
        os.unlink(path)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listening.bind(path)
    except OSError as error:
        listening.close()
        raise StartError(f"cannot listen on unix socket {path}: {error.strerror or error}; choose another "
                         "--uds") from None
    return listening


def _listened_on(path: str) -> bool:
    """Whether a server accepts connections on the unix socket `path`."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def _close(listening: socket.socket, uds: str | None) -> None:
    """Close the server's socket; a unix socket's file is removed (if it is still ours)."""
    listening.close()
    if uds is not None:
        with contextlib.suppress(OSError):
            os.unlink(uds)


def _loaded(directory: str, load):
    """`load(directory)`; what fails (a missing file, a bad config, unreadable weights) is a
    StartError naming it."""
    try:
        return load(directory)
    except (OSError, ValueError, TypeError) as error:  # the library's own messages name the file
        raise StartError(error) from None
    except Exception as error:  # safetensors raises its own type
        raise StartError(f"{directory}: cannot load the checkpoint: {type(error).__name__}: {error}") from None


def _raise_open_file_limit() -> None:
    """The soft limit on open files raised to the hard one: each connection holds one."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):  # a system that refuses it keeps its limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _server_exiting_cleanly(uvicorn):
    """`uvicorn.Server` whose SIGINT/SIGTERM shut it down gracefully (a second SIGINT: at once)
    and end the command with status 0 (uvicorn's own handling raises the signal again after
    the shutdown, so the process would end killed by it)."""

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def _announce_when_ready(server, host: str | None, uds: str | None) -> None:
    """Print `ready on http://HOST:PORT` (the bound port: --port 0 picks one), or `ready on
    unix:PATH`, at startup."""
    startup = server.startup

    async def announced(sockets=None):
        await startup(sockets=sockets)
        if uds is not None:
            print(f"ready on unix:{uds}", file=sys.stderr, flush=True)
            return
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else None
        print(f"ready on http://{host}:{port}", file=sys.stderr, flush=True)

    server.startup = announced
