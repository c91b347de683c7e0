"""`recurrax serve` as users run it: one real server subprocess on 127.0.0.1 (a free port),
on a tiny checkpoint built here, queried with the official `openai` client. Its answers
are compared with the offline Python API (`generate_text` with the same prompt and settings):
completions and chats, streamed and not, greedy and seeded sampling; many concurrent streams
(none lost, none mixed up); a client that goes away frees its slot; a full queue is a 429,
an invalid request a 400 in OpenAI's error JSON; SIGTERM lets a running stream finish and
exits 0."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from _tiny_checkpoint import write_checkpoint  # noqa: E402
from recurrax.nn.pretrained import from_pretrained, generate_text, load_tokenizer  # noqa: E402

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
SLOTS, MAX_QUEUE, MAX_MODEL_LEN = 8, 64, 1 << 17
"""The server's pool and queue: 64 concurrent requests fit in the queue alone (however many
the engine has admitted when the last one comes). The tiny GLA model's cache does not grow
with the length, so the length is long: a greedy stream of `MAX_MODEL_LEN - 8` tokens on "x"
(which never ends early) runs for minutes on a CPU, and a test that needs a stream still
running cannot race its end (a 200-token stream ends in 0.15 s: one that did made
`test_a_client_that_goes_away_frees_its_slot` fail)."""
LONG_STREAM = {"prompt": "x", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0, "stream": True}
WORDS = ["Once upon a time", "The state stays", "你好，世界", "Emoji 🙂 travel", "tiny recurrent model", "é ß ñ"]


class Server:
    def __init__(self, directory: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
                   JAX_PLATFORMS="cpu")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "recurrax.tools.cli", "serve", directory, "--port", "0", "--slots", str(SLOTS),
             "--max-queue", str(MAX_QUEUE), "--max-model-len", str(MAX_MODEL_LEN), "--prefill-tokens", "64",
             "--shutdown-timeout", "60"],
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
    """`offline(prompt, max_tokens, **options)`: the Python API's text for a prompt string or ids."""
    model, tokenizer = from_pretrained(directory), load_tokenizer(directory)
    generate_text(model, tokenizer, "x", 2)  # compiled while the server starts
    return lambda prompt, max_tokens, **options: generate_text(model, tokenizer, prompt, max_tokens, **options)


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

    from recurrax.tools.serve.command import parse_args

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


def test_sigterm_finishes_the_running_stream_and_exits_0(server, offline):
    """Last in the module: it stops the server."""
    stream = server.client().completions.create(model=server.model, prompt="é ß ñ", max_tokens=30, temperature=0,
                                                stream=True)
    pieces = [next(iter(stream)).choices[0].text]
    server.process.send_signal(signal.SIGTERM)
    pieces += [c.choices[0].text for c in stream]
    assert "".join(pieces) == offline("é ß ñ", 30)
    assert server.process.wait(60) == 0
