"""`recurrax serve MODEL_DIR`: the command line (its options and limits) over
`recurrax.generation.serve`, which loads, warms up and runs the server.

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
import sys

from .options import add_compilation_cache_option, positive_float, positive_int, start_compilation_cache


LIMITS = (
    ("--max-body-bytes", positive_int, 8 << 20, "bytes of a request body (default 8388608: 8 MiB); more is a 413"),
    ("--max-prompt-tokens", positive_int, None, "tokens of a prompt (default: --max-model-len - 1); a text prompt "
     "longer than this many of the vocabulary's longest tokens is refused before it is tokenized"),
    ("--max-stop-strings", positive_int, 16,
     "stop strings of a request (default 16; each generated token is checked against each)"),
    ("--max-stop-length", positive_int, 64, "characters of a stop string (default 64)"),
    ("--header-timeout", positive_float, 10.0,
     "seconds a client has to send a request's headers; then the connection is closed (default 10)"),
    ("--body-timeout", positive_float, 30.0, "seconds a client has to send a request's body; then a 408 (default 30)"),
    ("--idle-timeout", positive_float, 5.0,
     "seconds a kept-alive connection may wait for its next request (default 5)"),
    ("--template-timeout", positive_float, 5.0,
     "seconds the chat template may take on one request's messages; then a 400 (default 5)"),
    ("--template-memory", positive_int, 1024,
     "MiB the chat template may allocate on one request's messages; then a 400 (default 1024)"),
)
"""What one client may take: (option, type, default, help)."""


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
    parser.add_argument("--tokens-per-call", type=positive_int,
                        help="decode steps per compiled call: the host's cost of a call is shared by that many "
                             "tokens per request, and a stream receives them together; the tokens do not depend "
                             "on it (default: generate's, 8)")
    limits = parser.add_argument_group("limits", "what one client may take; a request beyond them is a 4xx in "
                                       "OpenAI's error JSON, a connection beyond them is closed")
    for flag, kind, default, text in LIMITS:
        limits.add_argument(flag, type=kind, default=default, help=text)
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
    from recurrax.generation.serve import StartError, serve

    try:
        return serve(args)
    except StartError as error:
        print(f"recurrax serve: {error}", file=sys.stderr)
        return 1
