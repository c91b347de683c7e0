"""`recurrax serve` as users run it: one real server subprocess on 127.0.0.1 (a free port),
on a tiny checkpoint built here, queried with the official `openai` client. Its answers
are compared with the offline Python API (`generate_text` with the same prompt and settings):
completions and chats, streamed and not, greedy and seeded sampling; many concurrent streams
(none lost, none mixed up); a client that goes away frees its slot; a full queue is a 429,
an invalid request a 400 in OpenAI's error JSON; SIGTERM lets a running stream finish and
exits 0.

One client cannot take it down: the server runs with small limits (`LIMITS`), and each way
of abusing it (a body too large or too slow, headers never finished, a prompt too long to
tokenize, too many stop strings, a chat template that raises, spins or grows, JSON Python
cannot read, lone surrogates, unknown routes) gets a 4xx in OpenAI's error JSON, or a closed
connection, and `/health` answers afterwards. Start-up failures are one line, no traceback."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from _tiny_checkpoint import CHATML, write_checkpoint, write_tokenizer  # noqa: E402
from recurrax.nn.pretrained import GenerationSession, from_pretrained, generate_text, load_tokenizer  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
SLOTS, MAX_QUEUE, MAX_MODEL_LEN = 8, 64, 1 << 17
"""The server's pool and queue: 64 concurrent requests fit in the queue alone (however many
the engine has admitted when the last one comes). The tiny GLA model's cache does not grow
with the length, so the length is long: a greedy stream of `MAX_MODEL_LEN - 8` tokens on "x"
(which never ends early) runs for minutes on a CPU, and a test that needs a stream still
running cannot race its end (a 200-token stream ends in 0.15 s: one that did made
`test_a_client_that_goes_away_frees_its_slot` fail)."""
LONG_STREAM = {"prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0, "stream": True}
MAX_BODY_BYTES, MAX_PROMPT_TOKENS, MAX_STOP_STRINGS, MAX_STOP_LENGTH = 1 << 20, 4096, 4, 32
HEADER_TIMEOUT_S, BODY_TIMEOUT_S, TEMPLATE_TIMEOUT_S, TEMPLATE_MEMORY_MIB = 3, 5, 2, 256
LIMITS = ["--max-body-bytes", str(MAX_BODY_BYTES), "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
          "--max-stop-strings", str(MAX_STOP_STRINGS), "--max-stop-length", str(MAX_STOP_LENGTH),
          "--header-timeout", str(HEADER_TIMEOUT_S), "--body-timeout", str(BODY_TIMEOUT_S),
          "--template-timeout", str(TEMPLATE_TIMEOUT_S), "--template-memory", str(TEMPLATE_MEMORY_MIB)]
"""Small limits, so that each is reached quickly; the other tests stay inside them (the
longest body, "é" × MAX_MODEL_LEN, is 0.8 MB as escaped JSON)."""
SPIN, GROW = "spin for hours", "grow to 600 MB"
GUARDED_CHATML = (
    "{% if messages[-1]['content'] == '" + SPIN + "' %}{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}{% endif %}"
    "{% if messages[-1]['content'] == '" + GROW + "' %}{% set big = 'x' * (600000000 * messages | length) %}"
    "{{ big[:1] }}{% endif %}"
    "{% for message in messages | rejectattr('role', 'equalto', 'system') %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}" + CHATML)
"""ChatML behind the checks real templates make (roles alternate after an optional system
message: `raise_exception` otherwise), and two messages a template takes too long or too
much memory on: 10¹⁰ loop steps (hours), a 600 MB string (over
TEMPLATE_MEMORY_MIB; its size depends on the messages, or Jinja would fold it into a
constant when the template compiles). Any other conversation renders as ChatML."""
WORDS = ["Once upon a time", "The state stays", "你好，世界", "Emoji 🙂 travel", "tiny recurrent model", "é ß ñ"]


class Server:
    """A `recurrax serve` process on `directory`, listening on `listen` (a free TCP port, or
    `["--uds", PATH]`)."""

    def __init__(self, directory: str, listen: tuple[str, ...] = ("--port", "0")):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
                   JAX_PLATFORMS="cpu")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "recurrax.tools.cli", "serve", directory, *listen, "--slots", str(SLOTS),
             "--max-queue", str(MAX_QUEUE), "--max-model-len", str(MAX_MODEL_LEN), "--prefill-tokens", "64",
             "--shutdown-timeout", "60", *LIMITS],
            stderr=subprocess.PIPE, text=True, env=env)
        self.log: list[str] = []
        ready = threading.Event()

        def read():
            for line in self.process.stderr:
                self.log.append(line)
                if line.startswith("ready on "):
                    self.url = line.split()[-1]
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        self.ready = ready
        self.model = os.path.basename(directory)

    def wait_ready(self) -> None:
        if not self.ready.wait(600):
            self.process.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))

    def client(self, asynchronous: bool = False):
        kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        if self.url.startswith("unix:"):  # the openai client over httpx's unix-socket transport
            transport = (httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport)(uds=self.url[5:])
            http = (httpx.AsyncClient if asynchronous else httpx.Client)(transport=transport)
            return kind(base_url="http://localhost/v1", api_key="none", max_retries=0, timeout=300, http_client=http)
        return kind(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.process.pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_served"))
    write_checkpoint(path)
    write_tokenizer(path, chat_template=GUARDED_CHATML)
    return path


@pytest.fixture(scope="module")
def launched(directory):
    """The server process, starting (it compiles while `offline` compiles here)."""
    server = Server(directory)
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(60)


@pytest.fixture(scope="module")
def offline(directory, launched):
    """`offline(prompt, max_tokens, **options)`: the Python API's text for a prompt string or ids,
    decoded one step per compiled call (the server decodes 8 per call: its texts must equal these)."""
    model, tokenizer = from_pretrained(directory), load_tokenizer(directory)

    def offline(prompt, max_tokens, **options):
        session = GenerationSession(model, tokens_per_call=1)
        return generate_text(model, tokenizer, prompt, max_tokens, session=session, **options)

    offline("x", 2)  # compiled while the server starts
    return offline


@pytest.fixture(scope="module")
def server(launched, offline):
    launched.wait_ready()
    return launched


@pytest.fixture(scope="module")
def tokenizer(directory):
    return load_tokenizer(directory)


def idle(health: dict) -> bool:
    """/health of a server with nothing running or waiting (its other counts aside)."""
    return {k: health[k] for k in ("status", "slots", "running", "waiting")} == dict(
        status="ok", slots=SLOTS, running=0, waiting=0)


def chat_ids(directory, messages):
    return load_tokenizer(directory).apply_chat_template(messages, tokenize=True)


def test_models_lists_the_served_model(server):
    assert [m.id for m in server.client().models.list().data] == [server.model]
    assert idle(server.health())


def test_completion_equals_offline_greedy(server, offline, tokenizer):
    answer = server.client().completions.create(model=server.model, prompt="Once upon a time", max_tokens=24,
                                                temperature=0)
    assert answer.choices[0].text == offline("Once upon a time", 24)
    assert answer.choices[0].finish_reason == "length"
    prompt_tokens = len(tokenizer.encode("Once upon a time"))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == (
        prompt_tokens, 24, prompt_tokens + 24)


def test_streamed_completion_with_usage_and_a_stop_string(server, offline, tokenizer):
    full = offline("The state stays", 40)
    stop = full[10:13]  # a string the greedy text contains: it stops there
    chunks = list(server.client().completions.create(model=server.model, prompt="The state stays", max_tokens=40,
                                                     temperature=0, stop=[stop], stream=True,
                                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline("The state stays", 40, stop=[stop]) == full[:full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(tokenizer.encode("The state stays"))
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_offline_streamed_and_not(server, offline, directory):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi! 你好"}]
    ids = chat_ids(directory, messages)
    expected = offline(ids, 20)
    whole = server.client().chat.completions.create(model=server.model, messages=messages, max_tokens=20,
                                                    temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    chunks = list(server.client().chat.completions.create(model=server.model, messages=messages,
                                                          max_completion_tokens=20, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_a_unix_socket_serves_chats_streamed_and_not_and_is_removed_at_exit(directory, offline):
    """`--uds PATH`: the server announces the socket, the openai client reaches it through
    httpx's unix-socket transport (chat completions, streamed and not, equal to the offline
    text), and SIGTERM ends it with status 0 and the socket's file gone."""
    import tempfile

    path = os.path.join(tempfile.mkdtemp(prefix="rx-"), "serve.sock")  # AF_UNIX paths: at most 107 bytes
    server = Server(directory, ("--uds", path))
    try:
        server.wait_ready()
        assert server.url == f"unix:{path}" and os.path.exists(path)
        messages = [{"role": "user", "content": "Once upon a time"}]
        expected = offline(chat_ids(directory, messages), 16)
        client = server.client()
        whole = client.chat.completions.create(model=server.model, messages=messages, max_tokens=16, temperature=0)
        assert whole.choices[0].message.content == expected
        chunks = list(client.chat.completions.create(model=server.model, messages=messages, max_tokens=16,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        assert not os.path.exists(path)
    finally:
        if server.process.poll() is None:
            server.process.kill()
            server.process.wait(60)


def test_uds_with_host_or_port_or_a_missing_directory_says_what_is_wrong(directory, tmp_path, capsys):
    """`--uds` with `--host`/`--port` is a usage error naming them; a socket path whose
    directory does not exist, or a file there that is not a socket, is one line naming it."""
    from recurrax.tools.serve import parse_args

    for given in (["--port", "8000"], ["--host", "127.0.0.1"]):
        with pytest.raises(SystemExit):
            parse_args([directory, "--uds", str(tmp_path / "s.sock"), *given])
        assert f"drop {given[0]}" in capsys.readouterr().err
    missing = tmp_path / "no-such-directory"
    assert f"directory {missing} does not exist" in start_up_failure(capsys, [directory, "--uds", str(missing / "s")])
    (tmp_path / "file").write_text("")
    assert "not a socket" in start_up_failure(capsys, [directory, "--uds", str(tmp_path / "file")])
    assert (tmp_path / "file").exists()


def test_a_chats_next_turn_prefills_only_what_follows_the_kept_conversation(server, offline, directory):
    """Turn 2 sends turn 1's messages, its reply and a new message: the engine continues a
    state it kept (after turn 1's prompt, or after its reply where the reply's text encodes to
    the tokens generated), so it prefills at most the tokens after turn 1's prompt (/health's
    count); the reply equals the offline one for the whole conversation."""
    turn = [{"role": "user", "content": "Once upon a time"}]
    client = server.client()
    first = client.chat.completions.create(model=server.model, messages=turn, max_tokens=8, temperature=0)
    turn += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "The state stays"}]
    ids, before = chat_ids(directory, turn), server.health()["prefilled_tokens"]
    second = client.chat.completions.create(model=server.model, messages=turn, max_tokens=8, temperature=0)
    fed = server.health()["prefilled_tokens"] - before
    assert second.choices[0].message.content == offline(ids, 8)
    assert 0 < fed <= len(ids) - len(chat_ids(directory, turn[:1]))


def test_seeded_sampling_equals_offline(server, offline):
    """Temperature, top_p, top_k (extra body) and seed reach the request's slot: the text is
    the offline sampler's with the same settings."""
    answer = server.client().completions.create(model=server.model, prompt="tiny recurrent model", max_tokens=24,
                                                temperature=0.8, top_p=0.9, seed=11, extra_body={"top_k": 40})
    assert answer.choices[0].text == offline("tiny recurrent model", 24, temperature=0.8, top_p=0.9, top_k=40,
                                             seed=11)


def test_requests_sampled_differently_side_by_side_equal_offline(server, offline):
    """Sent together, they decode in the same steps; each slot keeps its own settings."""
    settings = [dict(temperature=0), dict(temperature=0.8, seed=1), dict(temperature=1.2, seed=2, top_k=5),
                dict(temperature=1.0, seed=3, top_p=0.5)]

    async def together():
        client = server.client(asynchronous=True)
        try:
            return await asyncio.gather(*(
                client.completions.create(model=server.model, prompt="Once upon a time", max_tokens=24,
                                          extra_body={"top_k": s["top_k"]} if "top_k" in s else None,
                                          **{k: v for k, v in s.items() if k != "top_k"})
                for s in settings))
        finally:
            await client.close()

    for answer, options in zip(asyncio.run(together()), settings):
        assert answer.choices[0].text == offline("Once upon a time", 24, **options), options


def mixed_requests(count: int, phrases: int) -> list[tuple[str, int]]:
    """`count` prompts of 1 to `phrases` phrases with mixed max_tokens (1 to 40)."""
    return [(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(1 + i % phrases)), 1 + (i * 7) % 40)
            for i in range(count)]


async def stream_all(server, requests):
    client = server.client(asynchronous=True)

    async def one(prompt, max_tokens):
        stream = await client.completions.create(model=server.model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True, stream_options={"include_usage": True})
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        return "".join(pieces), usage

    try:
        return await asyncio.gather(*(one(p, m) for p, m in requests))
    finally:
        await client.close()


def check_concurrent(server, offline, count, phrases):
    """`count` concurrent greedy streams; each text equals the offline one."""
    requests = mixed_requests(count, phrases)
    answers = asyncio.run(stream_all(server, requests))
    assert len(answers) == count
    for (prompt, max_tokens), (text, usage) in zip(requests, answers):
        assert text == offline(prompt, max_tokens), prompt
        assert usage.completion_tokens <= max_tokens
    assert server.health()["running"] == 0


def test_concurrent_streams_are_neither_lost_nor_mixed_up(server, offline):
    """More streams than slots (some wait), short prompts (few prefill lengths to compile)."""
    check_concurrent(server, offline, SLOTS + 4, phrases=2)


def test_64_concurrent_streams_in_bounded_memory(server, offline):
    """64 concurrent streams of mixed lengths: each equals its offline text. Memory: the
    first round compiles whatever its prefills need; an identical second round compiles
    nothing and keeps nothing, so the server's resident memory stays put (0.1 MiB measured
    over 480 MiB). The bound, 32 MiB, is half a MiB per request of the round: it catches a
    request that leaves behind a compiled program or cache buffers of a real model's size,
    and stays clear of the allocator's noise (a leak of a few kB per request, such as its
    text, is below what RSS can show)."""
    check_concurrent(server, offline, 64, phrases=5)
    before = server.rss_bytes()
    check_concurrent(server, offline, 64, phrases=5)
    growth = server.rss_bytes() - before
    print(f"server RSS {before / 2**20:.0f} MiB, grew {growth / 2**20:.1f} MiB over 64 more streams")
    assert growth < 32 * 2**20


def wait_until(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_goes_away_frees_its_slot(server):
    """The stream could not end by itself within the wait: only the cancellation frees it."""
    body = {"model": server.model, **LONG_STREAM}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: {")
            assert server.health()["running"] == 1
    assert wait_until(lambda: server.health()["running"] == 0)


def test_a_full_queue_is_429(server):
    """Long greedy streams (their text has no end-of-sequence id: none ends) are opened one
    by one until one is refused: with 429 and OpenAI's error JSON, once the queue is full
    (between MAX_QUEUE and SLOTS + MAX_QUEUE requests in, depending on how many the engine
    had admitted), none of the accepted ones lost; when the clients go away, every slot is
    free again."""
    body = {"model": server.model, **LONG_STREAM}

    async def flood():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
            opened, refused = [], None
            for _ in range(SLOTS + MAX_QUEUE + 1):
                stream = client.stream("POST", server.url + "/v1/completions", json=body)
                response = await stream.__aenter__()
                opened.append(stream)
                if response.status_code != 200:
                    refused = response, json.loads(await response.aread())
                    break
            health = server.health()
            for stream in opened:
                await stream.__aexit__(None, None, None)
            return len(opened) - 1, health, refused

    accepted, health, (response, error) = asyncio.run(flood())
    assert MAX_QUEUE <= accepted <= SLOTS + MAX_QUEUE
    assert health["running"] + health["waiting"] == accepted and health["waiting"] <= MAX_QUEUE
    assert response.status_code == 429
    assert error["error"]["code"] == "queue_full" and "--max-queue" in error["error"]["message"]
    assert wait_until(lambda: idle(server.health()))


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "é" * MAX_MODEL_LEN}, "prompt"),
    ({"seed": -1}, "seed"),
    ({"logprobs": 2}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"prompt": [[1, 2], [3]]}, "prompt"),
    ({"prompt": [1, 300]}, "prompt"),  # the tiny model's vocabulary is 300
])
def test_invalid_requests_are_400_naming_the_parameter(server, fields, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as failure:
        client.completions.create(**{"model": server.model, "prompt": "x", **fields})
    assert failure.value.status_code == 400 and failure.value.body["param"] == param
    assert failure.value.body["type"] == "invalid_request_error"


def test_another_model_is_404_and_bad_json_400(server):
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    response = httpx.post(server.url + "/v1/chat/completions", content=b"{not json")
    assert response.status_code == 400 and "not JSON" in response.json()["error"]["message"]


def readme_section() -> str:
    readme = open(os.path.join(os.path.dirname(SRC), "README.md"), encoding="utf-8").read()
    section = readme[readme.index("## Serve it"):]
    return section[: section.index("\n## ")]


def test_readme_commands_parse_and_its_client_code_runs(server, capsys):
    """The "Serve it" section's `recurrax serve` lines use options the command has and a
    directory that exists; its Python client code runs against this server."""
    import shlex

    from recurrax.tools.serve import parse_args

    section = readme_section()
    lines = [line.split("recurrax serve ", 1)[1] for line in section.splitlines() if line.startswith("recurrax serve ")]
    assert len(lines) >= 2
    for line in lines:
        assert os.path.isdir(os.path.join(os.path.dirname(SRC), parse_args(shlex.split(line)).model))
    code = section[section.index("python - <<'EOF'\n") + len("python - <<'EOF'\n"):section.index("\nEOF\n")]
    code = code.replace("http://127.0.0.1:8000", server.url).replace('"tiny_gla"', repr(server.model))
    exec(compile(code, "README.md", "exec"), {})
    assert "completion_tokens=20" in capsys.readouterr().out


def test_a_directory_without_a_tokenizer_is_a_message(tmp_path, capsys):
    from recurrax.tools import cli

    assert cli.main(["serve", str(tmp_path), "--port", "0"]) == 1
    assert "tokenizer.json" in capsys.readouterr().err


def assert_openai_error(response, status: int, *, param=None, code=None) -> dict:
    """`response` is `status` with OpenAI's error JSON (and `param`, `code` when given)."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


def assert_serving(server) -> None:
    assert server.health()["status"] == "ok"
    answer = server.client().completions.create(model=server.model, prompt="x", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"


def test_a_body_over_the_limit_is_413_with_or_without_its_length(server):
    """Announced by Content-Length (refused before it is read) or sent in chunks (refused
    once MAX_BODY_BYTES have come): the server keeps no more than the limit."""
    body = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    assert_openai_error(httpx.post(server.url + "/v1/completions", content=body, timeout=60), 413,
                        code="request_too_large")

    def chunks():
        for start in range(0, len(body), 1 << 16):
            yield body[start:start + (1 << 16)]

    assert_openai_error(httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60), 413,
                        code="request_too_large")
    assert_serving(server)


def test_a_prompt_too_long_to_hold_is_refused_before_tokenizing(directory):
    """A text prompt longer than MAX_PROMPT_TOKENS of the vocabulary's longest tokens cannot
    fit: refused without tokenizing it (the tokenizer here fails if asked); one that might
    fit is tokenized and counted."""
    from recurrax.generation.serve.requests import Limits, RequestError, RequestParser

    real = load_tokenizer(directory)

    class Refusing:
        backend = real.backend

        def encode(self, text, add_special_tokens=True):
            raise AssertionError("tokenized a prompt that cannot fit")

    parser = RequestParser(tokenizer=Refusing(), render=None, model_name="m", vocab_size=300,
                           max_model_len=MAX_MODEL_LEN, limits=Limits(MAX_PROMPT_TOKENS))
    longest = max(map(len, real.backend.get_vocab(with_added_tokens=True)))
    with pytest.raises(RequestError) as failure:
        parser(json.dumps({"prompt": "a" * (MAX_PROMPT_TOKENS * longest + 1)}).encode(), chat=False)
    assert failure.value.param == "prompt" and failure.value.code == "context_length_exceeded"
    counting = RequestParser(tokenizer=real, render=None, model_name="m", vocab_size=300, max_model_len=MAX_MODEL_LEN,
                             limits=Limits(MAX_PROMPT_TOKENS))
    text = "a" * (MAX_PROMPT_TOKENS * longest)  # may fit by length: tokenized, and too many tokens
    assert len(real.encode(text)) > MAX_PROMPT_TOKENS
    with pytest.raises(RequestError, match="--max-prompt-tokens"):
        counting(json.dumps({"prompt": text}).encode(), chat=False)


def test_too_many_or_too_long_stop_strings_are_400(server):
    client = server.client()
    for stop in (["a"] * (MAX_STOP_STRINGS + 1), ["a" * (MAX_STOP_LENGTH + 1)]):
        with pytest.raises(openai.BadRequestError) as failure:
            client.completions.create(model=server.model, prompt="x", max_tokens=2, stop=stop)
        assert failure.value.body["param"] == "stop"
    answer = client.completions.create(model=server.model, prompt="x", max_tokens=2, temperature=0,
                                       stop=["a" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)
    assert answer.choices[0].finish_reason == "length"


def test_headers_never_finished_close_the_connection(server):
    """Connections that send nothing, or headers without their end, are closed after
    HEADER_TIMEOUT_S (each held a file descriptor until the process had none left)."""
    host, port = server.url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(20)]
    partial = [socket.create_connection((host, int(port))) for _ in range(20)]
    for connection in partial:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
    for connection in idle + partial:
        connection.settimeout(60)
        assert connection.recv(1024) == b""  # closed by the server
        connection.close()
    assert_serving(server)


def test_a_body_that_never_ends_is_408(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        connection.settimeout(60)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            piece = connection.recv(4096)
            assert piece, answer
            answer += piece
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert_serving(server)


def chat(server, messages) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=300,
                      json={"model": server.model, "messages": messages, "max_tokens": 2})


def test_a_template_that_refuses_the_messages_is_400(server):
    error = assert_openai_error(chat(server, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]),
                                400, param="messages", code="template_error")
    assert "roles must alternate" in error["message"]
    assert_serving(server)


def test_a_template_too_slow_is_stopped_and_blocks_no_one(server):
    """While the template spins on one request (for hours, were it not stopped), /health
    answers (the old server's event loop rendered it: nothing answered until the end); the
    request ends with a 400 after TEMPLATE_TIMEOUT_S and the next chats render again."""
    answers = []
    spinning = threading.Thread(target=lambda: answers.append(chat(server, [{"role": "user", "content": SPIN}])),
                                daemon=True)
    spinning.start()
    time.sleep(0.5)  # the render has begun
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"
    spinning.join(120)
    assert_openai_error(answers[0], 400, param="messages", code="template_limit")
    assert "--template-timeout" in answers[0].json()["error"]["message"]
    assert chat(server, [{"role": "user", "content": "Hi"}]).status_code == 200
    assert_serving(server)


def test_a_template_that_grows_past_its_memory_is_400(server):
    error = assert_openai_error(chat(server, [{"role": "user", "content": GROW}]), 400, param="messages",
                                code="template_limit")
    assert "--template-memory" in error["message"]
    assert chat(server, [{"role": "user", "content": "Hi"}]).status_code == 200
    assert_serving(server)


@pytest.mark.parametrize("body, status, param", [
    (b"[" * 100_000 + b"]" * 100_000, 400, None),  # deeper than Python's recursion limit
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),  # over int's 4300 digits
    (b'{"prompt": "x\\ud800"}', 400, "prompt"),  # a lone surrogate
    (b'{"prompt": "x", "stop": "\\udfff"}', 400, "stop"),
    (b'{"model": "\\ud800", "prompt": "x"}', 404, "model"),  # quoted back in the message
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages"),
    (b"\xff\xfe{", 400, None),  # not UTF-8
])
def test_json_python_cannot_read_and_lone_surrogates_are_4xx(server, body, status, param):
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    assert_openai_error(httpx.post(server.url + route, content=body, timeout=60), status, param=param)
    assert_serving(server)


def test_unknown_routes_and_methods_are_openai_errors(server):
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/completions"), 405)
    assert_serving(server)


def test_a_chat_template_that_does_not_compile_is_a_value_error():
    from recurrax.generation.serve.templates import TemplateRenderer

    renderer = TemplateRenderer("{% for %}", {}, timeout_s=30, memory_bytes=1 << 28)
    with pytest.raises(ValueError, match="does not compile"):
        renderer.start()
    renderer.close()


def start_up_failure(capsys, argv) -> str:
    """`recurrax serve argv`'s one line on stderr, the command ending with status 1."""
    from recurrax.tools import cli

    assert cli.main(["serve", *argv]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_start_up_failures_are_one_line(directory, tmp_path, capsys, monkeypatch):
    """A missing extra, a port in use, a config that is not JSON, unreadable weights: one
    line each (what is wrong, what to do) and status 1."""
    import shutil

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert "--port" in start_up_failure(capsys, [directory, "--port", str(taken.getsockname()[1])])
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    (broken / "config.json").write_text("{not json")
    assert "config.json" in start_up_failure(capsys, [str(broken), "--port", "0"])
    shutil.copy(os.path.join(directory, "config.json"), broken / "config.json")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    assert "cannot load the checkpoint" in start_up_failure(capsys, [str(broken), "--port", "0"])
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    assert "recurrax[serve]" in start_up_failure(capsys, [directory, "--port", "0"])


def test_sigterm_finishes_the_running_stream_and_exits_0(server, offline):
    """Last in the module: it stops the server."""
    stream = server.client().completions.create(model=server.model, prompt="é ß ñ", max_tokens=30, temperature=0,
                                                stream=True)
    pieces = [next(iter(stream)).choices[0].text]
    server.process.send_signal(signal.SIGTERM)
    pieces += [c.choices[0].text for c in stream]
    assert "".join(pieces) == offline("é ß ñ", 30)
    assert server.process.wait(60) == 0
