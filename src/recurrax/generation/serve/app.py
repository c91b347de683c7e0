"""The HTTP side: OpenAI's routes on Starlette, each request handed to the `Engine` and its
updates turned into OpenAI's JSON, or into server-sent events when it streams.

| route                        | answer                                                        |
|------------------------------|---------------------------------------------------------------|
| GET  /health                 | `{"status", "slots", "running", "waiting"}`                    |
| GET  /v1/models[/{model}]    | the one served model                                          |
| POST /v1/completions         | `text_completion` (a stream of them with `stream: true`)      |
| POST /v1/chat/completions    | `chat.completion` (`chat.completion.chunk`s when streaming)   |

A stream is `data: {chunk}` events and `data: [DONE]`; with
`stream_options.include_usage` every chunk carries `"usage": null` and a last chunk with no
choices carries the counts. Errors are OpenAI's `{"error": {"message", "type", "param",
"code"}}`, whatever goes wrong: 400 for an invalid request (its JSON, its values, its prompt's
length, the chat template's refusal or limits), 404 for another model's name or an unknown
route, 405 for a wrong method, 408 for a body slower than `body_timeout_s`, 413 for one
longer than `max_body_bytes`, 429 when the queue is full, 500 when the engine failed. The
body is read in pieces (never more than the limit is kept) and parsed, rendered through the
chat template and tokenized in a worker thread: the event loop only moves bytes. A client
that goes away cancels its request: a stream's task is cancelled by Starlette, a plain
request notices it within `DISCONNECT_POLL_S`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Engine, QueueFull, Update
from .requests import Job, RequestError, RequestParser

DISCONNECT_POLL_S = 0.5
"""How often a plain (not streaming) request checks that its client is still there."""


def create_app(engine: Engine, parser: RequestParser, *, model_name: str, max_model_len: int, max_body_bytes: int,
               body_timeout_s: float) -> Starlette:
    """The ASGI application serving `engine`'s model as `model_name`, its request bodies
    (at most `max_body_bytes`, arriving within `body_timeout_s`) read by `parser`; the
    engine runs from the application's start to its shutdown."""
    created = int(time.time())
    model_card = {"id": model_name, "object": "model", "created": created, "owned_by": "recurrax",
                  "max_model_len": max_model_len}

    async def health(request: HTTPRequest) -> Response:
        return JSONResponse({"status": "ok", **engine.stats()})

    async def models(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [model_card]})

    async def model(request: HTTPRequest) -> Response:
        if request.path_params["model"] != model_name:
            return error(RequestError(f"The model `{request.path_params['model']}` does not exist", param="model",
                                      status=404, code="model_not_found"))
        return JSONResponse(model_card)

    async def completions(request: HTTPRequest) -> Response:
        return await complete(request, chat=False)

    async def chat_completions(request: HTTPRequest) -> Response:
        return await complete(request, chat=True)

    async def complete(request: HTTPRequest, *, chat: bool) -> Response:
        try:
            body = await read_body(request, max_body_bytes, body_timeout_s)
            job = await asyncio.to_thread(parser, body, chat=chat)
        except RequestError as failure:
            return error(failure)
        loop, updates = asyncio.get_running_loop(), asyncio.Queue()

        def deliver(update: Update) -> None:  # from the engine thread
            try:
                loop.call_soon_threadsafe(updates.put_nowait, update)
            except RuntimeError:  # the loop is closed: nobody waits for it
                pass

        try:
            handle = engine.submit(job, deliver)
        except QueueFull as failure:
            return error(RequestError(f"the server is busy: {failure}; retry later", status=429,
                                      kind="rate_limit_error", code="queue_full"))
        answer = Answer(job, chat=chat, model_name=model_name)
        if job.stream:
            return StreamingResponse(stream(answer, updates, lambda: engine.cancel(handle)),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await collect(request, answer, updates, lambda: engine.cancel(handle))

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    async def http_error(request: HTTPRequest, failure: HTTPException) -> Response:
        return error(RequestError(f"{request.method} {request.url.path}: {failure.detail}", status=failure.status_code,
                                  code="not_found" if failure.status_code == 404 else None))

    async def server_error(request: HTTPRequest, failure: Exception) -> Response:
        return error(RequestError(f"the server failed: {type(failure).__name__}: {failure}", status=500,
                                  kind="server_error"))

    return Starlette(routes=[
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/models/{model:path}", model),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error})


async def read_body(request: HTTPRequest, max_bytes: int, timeout_s: float) -> bytes:
    """The request's body: a RequestError (413) as soon as it passes `max_bytes` (its
    Content-Length says so before any is read), or (408) when it takes over `timeout_s`."""
    too_large = RequestError(f"the request body is larger than this server's {max_bytes} bytes (--max-body-bytes)",
                             status=413, code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large

    async def pieces() -> bytes:
        body = bytearray()
        async for piece in request.stream():
            body += piece
            if len(body) > max_bytes:
                raise too_large
        return bytes(body)

    try:
        return await asyncio.wait_for(pieces(), timeout_s)
    except TimeoutError:
        raise RequestError(f"the request body did not arrive within {timeout_s:g} s (--body-timeout)", status=408,
                           code="request_timeout") from None


class Answer:
    """OpenAI's JSON for one request: whole, or as stream chunks."""

    def __init__(self, job: Job, *, chat: bool, model_name: str):
        self.job, self.chat = job, chat
        self.head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": model_name}

    def usage(self, completion_tokens: int) -> dict:
        prompt_tokens = len(self.job.prompt_ids)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def whole(self, text: str, last: Update) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": last.finish_reason} if self.chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": last.finish_reason})
        kind = "chat.completion" if self.chat else "text_completion"
        return {**self.head, "object": kind, "choices": [choice], "usage": self.usage(last.completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None) -> str:
        """One event; in a chat `text=None` is the first chunk (the role)."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return self.event({"choices": [choice]})

    def usage_chunk(self, completion_tokens: int) -> str:
        return self.event({"choices": [], "usage": self.usage(completion_tokens)})

    def event(self, fields: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        payload = {**self.head, "object": kind, **fields}
        if self.job.include_usage:
            payload.setdefault("usage", None)
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream(answer: Answer, updates: asyncio.Queue, cancel):
    """The server-sent events of a streamed answer; leaving early (a client gone) cancels."""
    finished = False
    try:
        if answer.chat:
            yield answer.chunk(None)
        while True:
            update = await updates.get()
            if update.finish_reason == "error":
                finished = True
                yield f"data: {json.dumps(engine_failure(update).body())}\n\n"
                break
            if update.finish_reason is None:
                yield answer.chunk(update.text)
                continue
            finished = True
            if answer.chat:
                if update.text:
                    yield answer.chunk(update.text)
                yield answer.chunk("", update.finish_reason)
            else:
                yield answer.chunk(update.text, update.finish_reason)
            if answer.job.include_usage:
                yield answer.usage_chunk(update.completion_tokens)
            break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            cancel()


async def collect(request: HTTPRequest, answer: Answer, updates: asyncio.Queue, cancel) -> Response:
    """The whole answer; the request is cancelled if its client goes away meanwhile."""
    pieces, finished = [], False
    try:
        while True:
            try:
                update = await asyncio.wait_for(updates.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)  # nobody reads it
                continue
            pieces.append(update.text)
            if update.finish_reason is not None:
                finished = True
                break
    finally:
        if not finished:
            cancel()
    if update.finish_reason == "error":
        return error(engine_failure(update))
    return JSONResponse(answer.whole("".join(pieces), update))


def engine_failure(update: Update) -> RequestError:
    return RequestError(f"generation failed: {update.error}", status=500, kind="server_error")


def error(failure: RequestError) -> Response:
    """OpenAI's error JSON, ASCII-escaped: a message quoting the request's text (a lone
    surrogate included) is always valid UTF-8."""
    return Response(json.dumps(failure.body()), status_code=failure.status, media_type="application/json")
