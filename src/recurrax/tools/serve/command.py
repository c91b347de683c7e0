"""`recurrax serve MODEL_DIR`: the command line: options, loading, warm-up, uvicorn.

    recurrax serve MODEL_DIR --host 127.0.0.1 --port 8000
    recurrax serve MODEL_DIR --slots 32 --max-queue 512 --max-model-len 8192

It prints `ready on http://HOST:PORT` on stderr once the model is compiled for the first
requests and the socket listens. SIGINT or SIGTERM: it stops accepting connections, lets
running requests finish for `--shutdown-timeout` seconds, cancels the rest, and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time

from ..options import positive_float, positive_int


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="recurrax serve", description=(
        "an OpenAI-compatible HTTP server for a checkpoint directory (/v1/models, /v1/completions, "
        "/v1/chat/completions), requests batched continuously into one pool of cache slots"))
    parser.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json, model.safetensors, "
                        "tokenizer.json; tokenizer_config.json's chat template for chat)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free one)")
    parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL_DIR's last part)")
    parser.add_argument("--slots", type=positive_int, default=16,
                        help="sequences decoded together in one step (default 16)")
    parser.add_argument("--max-queue", type=positive_int, default=256,
                        help="requests that may wait for a slot; more are refused with 429 (default 256)")
    parser.add_argument("--max-model-len", type=positive_int, default=4096,
                        help="most tokens of a prompt and its completion (default 4096)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=512,
                        help="prompt tokens prefilled together in one step, at most (a longer prompt goes alone); "
                             "the packed lengths up to it compile at start-up (default 512)")
    parser.add_argument("--shutdown-timeout", type=positive_float, default=30.0,
                        help="seconds running requests get to finish at SIGINT/SIGTERM (default 30)")
    parser.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level (default warning)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from ..._extras import require

    try:
        uvicorn = require("uvicorn", "serve", "recurrax serve")
        require("starlette", "serve", "recurrax serve")
    except ImportError as error:
        print(f"recurrax serve: {error}", file=sys.stderr)
        return 1
    from recurrax.nn.pretrained import cache_capacity, from_pretrained, load_tokenizer

    from .app import create_app
    from .engine import Engine

    start = time.perf_counter()
    try:
        tokenizer = load_tokenizer(args.model)
        model = from_pretrained(args.model)
    except (OSError, ValueError, TypeError) as error:
        print(f"recurrax serve: {error}", file=sys.stderr)
        return 1
    engine = Engine(model, tokenizer, slots=args.slots, capacity=cache_capacity(model, args.max_model_len),
                    max_queue=args.max_queue, prefill_tokens=args.prefill_tokens)
    engine.warm_up()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    print(f"loaded and compiled {args.model} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    app = create_app(engine, model_name=name, max_model_len=args.max_model_len)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = _server_exiting_cleanly(uvicorn)(config)
    _announce_when_ready(server, args.host)
    server.run()
    return 0


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


def _announce_when_ready(server, host: str) -> None:
    """Print `ready on http://HOST:PORT` (the bound port: --port 0 picks one) at startup."""
    startup = server.startup

    async def announced(sockets=None):
        await startup(sockets=sockets)
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else None
        print(f"ready on http://{host}:{port}", file=sys.stderr, flush=True)

    server.startup = announced
