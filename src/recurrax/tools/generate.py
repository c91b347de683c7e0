"""`recurrax generate MODEL_DIR`: text from a checkpoint directory, streamed to stdout.

    recurrax generate MODEL_DIR --prompt "Once upon a time"        a continuation
    recurrax generate MODEL_DIR --chat --prompt "Hi!"               one reply, through the chat template
    recurrax generate MODEL_DIR --chat                              a conversation typed at the terminal
    echo '[{"role": "user", "content": "Hi!"}]' | recurrax generate MODEL_DIR --chat

Greedy unless `--temperature` is above 0. Without `--prompt`, the prompt (or with `--chat`
the conversation: a JSON list of messages, or plain text as one user message) is read from
stdin; with `--chat` and a terminal, it is an interactive chat (an empty line or end of input
ends it). The load time and, for each reply, the time to its first token, the tokens/s
after it and the prompt tokens prefilled go to stderr.

An interactive chat keeps the model's state between turns (a `GenerationSession`): a turn
prefills only its new tokens (the end of the reply, the user's message, the template's
markup), not the whole conversation, and compiles nothing new (prefills are chunked to fixed
lengths). A checkpoint directory, chat template or missing package that fails at start-up
ends the command with one line on stderr (status 1), not a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from .options import (
    add_compilation_cache_option,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    start_compilation_cache,
)


SAMPLING = (
    ("--max-new-tokens", non_negative_int, 256, "most tokens per reply (default 256)"),
    ("--temperature", non_negative_float, 0.0, "sampling temperature; 0 (default) is greedy"),
    ("--top-p", probability, None, "nucleus sampling: keep the most likely tokens of mass p"),
    ("--top-k", positive_int, None, "keep the k most likely tokens"),
    ("--repetition-penalty", positive_float, None, "above 1 makes tokens already in the prompt or reply less likely"),
    ("--seed", int, 0, "sampling seed (default 0)"),
)
"""How each reply is sampled (`stream_text`'s arguments): (option, type, default, help)."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="recurrax generate", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL_DIR", help="checkpoint directory (config.json, model.safetensors, "
                        "tokenizer.json; tokenizer_config.json for --chat)")
    parser.add_argument("--prompt", help="the prompt (default: read from stdin)")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat "
                        "template; without --prompt, an interactive chat at a terminal")
    parser.add_argument("--system", help="a system message first (with --chat)")
    for flag, kind, default, text in SAMPLING:
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--stop", action="append", default=[], help="a string that ends the reply (repeatable)")
    add_compilation_cache_option(parser)
    args = parser.parse_args(argv)
    if args.system is not None and not args.chat:
        parser.error("--system needs --chat (it is a message of the chat template)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    start_compilation_cache(args)
    start = time.perf_counter()
    try:
        from recurrax.generation import GenerationSession, load_tokenizer
        from recurrax.nn.pretrained import from_pretrained

        tokenizer = load_tokenizer(args.model)
        model = from_pretrained(args.model)
    except startup_errors() as error:
        return _failed(error, args.model)
    print(f"loaded {args.model} in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    session = GenerationSession(model)
    try:
        if args.chat and args.prompt is None and sys.stdin.isatty():
            return _interactive(model, tokenizer, session, args)
        prompt = _prompt(tokenizer, args)
    except startup_errors() as error:
        return _failed(error, args.model)
    _reply(model, tokenizer, session, prompt, args)
    return 0


def startup_errors() -> tuple[type[BaseException], ...]:
    """What a bad checkpoint directory, chat template or missing package raises while the
    command starts: each ends it with one line on stderr, not a traceback."""
    errors: list[type[BaseException]] = [ImportError, OSError, ValueError, TypeError, KeyError]
    for module, name in (("safetensors", "SafetensorError"), ("jinja2", "TemplateError")):
        try:
            errors.append(getattr(__import__(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _failed(error: BaseException, model: str) -> int:
    """One line on stderr for `error` (with the directory and its type where the message of a
    library's own error would not say them); status 1."""
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    if not isinstance(error, (ImportError, OSError, ValueError)):
        message = f"{model}: {type(error).__name__}: {message}"
    print(f"recurrax generate: {message}", file=sys.stderr)
    return 1


def _prompt(tokenizer, args) -> str | list[int]:
    """The prompt text, or with --chat the conversation's ids through the chat template."""
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not args.chat:
        return text
    messages = _conversation(text) if args.prompt is None else [{"role": "user", "content": text}]
    from recurrax.generation._chat import with_system

    return tokenizer.apply_chat_template(with_system(messages, args.system), tokenize=True)


def _conversation(text: str) -> list[dict]:
    """stdin's conversation: a JSON list of messages (or {"messages": [...]}), else one user message."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return [{"role": "user", "content": text}]
    messages = data.get("messages") if isinstance(data, dict) else data
    if not isinstance(messages, list):
        raise ValueError("a conversation on stdin must be a JSON list of {\"role\", \"content\"} messages")
    return messages


def _interactive(model, tokenizer, session, args) -> int:
    """A chat at the terminal: each turn continues the session's state of the conversation so
    far (see `recurrax.generation._chat.Conversation`)."""
    from recurrax.generation import end_of_sequence_ids
    from recurrax.generation._chat import Conversation

    conversation = Conversation(tokenizer, args.system, end_of_sequence_ids(model, tokenizer))
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        stream = _reply(model, tokenizer, session, conversation.prompt(line), args)
        conversation.add_reply(stream)


def _reply(model, tokenizer, session, prompt, args):
    """Stream the continuation of `prompt` to stdout; its speed to stderr. Returns the
    finished `TextStream`."""
    from recurrax.generation import stream_text

    start, prefilled = time.perf_counter(), session.prefilled_tokens
    stream = stream_text(model, tokenizer, prompt, args.max_new_tokens, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                         seed=args.seed, stop=args.stop, session=session)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"{_speed(stream, start)}; {session.prefilled_tokens - prefilled} prompt tokens prefilled", file=sys.stderr)
    return stream


def _speed(stream, start: float) -> str:
    """Time to the first token (compilation included on a first call) and the decoding rate
    after the second token (the first decode step compiles)."""
    times, count = stream.token_times, len(stream.tokens)
    if not times:
        return "0 tokens"
    line = f"{count} tokens; first after {times[0] - start:.2f} s"
    if count > 2 and times[-1] > times[1]:
        line += f", then {(count - 2) / (times[-1] - times[1]):.1f} tokens/s"
    return f"{line} (stopped by {stream.finish_reason})"
