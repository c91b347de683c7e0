"""`recurrax serve MODEL_DIR`: the command line: options, loading, warm-up, uvicorn.

    recurrax serve MODEL_DIR --host 127.0.0.1 --port 8000
    recurrax serve MODEL_DIR --uds /tmp/recurrax.sock     # a unix socket: machines that allow no TCP
    recurrax serve MODEL_DIR --slots 32 --max-queue 512 --max-model-len 8192

It prints `ready on http://HOST:PORT` (with `--uds`: `ready on unix:PATH`) on stderr once the
model is compiled for the first requests and the socket listens; a unix socket's file is
removed when the server exits. What cannot start (a missing extra, a directory that is not
a checkpoint, a chat template that does not compile, a port in use) is one line on stderr and
exit status 1.

One client cannot take the server down: every request is bounded (`--max-body-bytes`,
`--max-prompt-tokens`, `--max-stop-strings`, `--max-stop-length`), and so is every wait
(`--header-timeout`, `--body-timeout`, `--idle-timeout`) and the chat template
(`--template-timeout`, `--template-memory`: it renders in a worker process); parsing,
rendering and tokenizing run off the event loop. SIGINT or SIGTERM: it stops accepting connections, lets
running requests finish for `--shutdown-timeout` seconds, cancels the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import stat
import sys
import threading
import time

from ..options import add_compilation_cache_option, positive_float, positive_int, start_compilation_cache

SERVE_MODULES = ("starlette", "uvicorn", "flax", "safetensors", "tokenizers", "jinja2")
"""What `recurrax serve` imports, all from the `serve` extra."""


def port(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {value}")
    return value


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="recurrax serve", description=(
        "an OpenAI-compatible HTTP server for a checkpoint directory (/v1/models, /v1/completions, "
        "/v1/chat/completions), requests batched continuously into one pool of cache slots"))
    parser.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json, model.safetensors, "
                        "tokenizer.json; tokenizer_config.json's chat template for chat)")
    parser.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument("--uds", metavar="PATH", help="listen on a unix-domain socket at PATH instead of TCP (a "
                        "machine that allows no TCP; clients connect through it, e.g. httpx's "
                        "HTTPTransport(uds=PATH)); its file is removed at exit")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL_DIR's last part)")
    parser.add_argument("--slots", type=positive_int, default=16,
                        help="sequences decoded together in one step (default 16)")
    parser.add_argument("--max-queue", type=positive_int, default=256,
                        help="requests that may wait for a slot; more are refused with 429 (default 256)")
    parser.add_argument("--max-model-len", type=positive_int, default=4096,
                        help="most tokens of a prompt and its completion (default 4096)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=512,
                        help="prompt tokens prefilled together in one step, at most (a longer prompt goes in "
                             "pieces of that size); the packed lengths up to it compile at start-up (default 512)")
    limits = parser.add_argument_group("limits", "what one client may take; a request beyond them is a 4xx in "
                                       "OpenAI's error JSON, a connection beyond them is closed")
    limits.add_argument("--max-body-bytes", type=positive_int, default=8 << 20,
                        help="bytes of a request body (default 8388608: 8 MiB); more is a 413")
    limits.add_argument("--max-prompt-tokens", type=positive_int,
                        help="tokens of a prompt (default: --max-model-len - 1); a text prompt longer than this "
                             "many of the vocabulary's longest tokens is refused before it is tokenized")
    limits.add_argument("--max-stop-strings", type=positive_int, default=16,
                        help="stop strings of a request (default 16; each generated token is checked against each)")
    limits.add_argument("--max-stop-length", type=positive_int, default=64,
                        help="characters of a stop string (default 64)")
    limits.add_argument("--header-timeout", type=positive_float, default=10.0,
                        help="seconds a client has to send a request's headers; then the connection is closed "
                             "(default 10)")
    limits.add_argument("--body-timeout", type=positive_float, default=30.0,
                        help="seconds a client has to send a request's body; then a 408 (default 30)")
    limits.add_argument("--idle-timeout", type=positive_float, default=5.0,
                        help="seconds a kept-alive connection may wait for its next request (default 5)")
    limits.add_argument("--template-timeout", type=positive_float, default=5.0,
                        help="seconds the chat template may take on one request's messages; then a 400 "
                             "(default 5)")
    limits.add_argument("--template-memory", type=positive_int, default=1024,
                        help="MiB the chat template may allocate on one request's messages; then a 400 "
                             "(default 1024)")
    parser.add_argument("--shutdown-timeout", type=positive_float, default=30.0,
                        help="seconds running requests get to finish at SIGINT/SIGTERM (default 30)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default warning)")
    add_compilation_cache_option(parser)
    args = parser.parse_args(argv)
    if args.uds is not None and (args.host is not None or args.port is not None):
        given = " and ".join(f"--{name}" for name in ("host", "port") if getattr(args, name) is not None)
        parser.error(f"--uds listens on a unix socket, not TCP: drop {given}, or drop --uds to listen on TCP")
    if args.uds is None:
        args.host = "127.0.0.1" if args.host is None else args.host
        args.port = 8000 if args.port is None else args.port
    if args.max_prompt_tokens is None:
        args.max_prompt_tokens = args.max_model_len - 1
    if not 1 <= args.max_prompt_tokens < args.max_model_len:
        parser.error(f"--max-prompt-tokens must be below --max-model-len ({args.max_model_len}): a completion needs "
                     "room for at least one token")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start_compilation_cache(args)
    try:
        return serve(args)
    except StartError as error:
        print(f"recurrax serve: {error}", file=sys.stderr)
        return 1


class StartError(Exception):
    """What keeps the server from starting, said in one line."""


def serve(args: argparse.Namespace) -> int:
    """Load, compile, listen and serve until SIGINT/SIGTERM (see the module notes)."""
    from ..._extras import require

    try:
        for module in SERVE_MODULES:
            require(module, "serve", "recurrax serve")
    except ImportError as error:
        raise StartError(error) from None
    import uvicorn
    from recurrax.nn.pretrained import cache_capacity, from_pretrained, load_tokenizer

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
                        max_queue=args.max_queue, prefill_tokens=args.prefill_tokens)
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
