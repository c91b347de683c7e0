"""The engine: one thread owns the model and a `DecodePool`; requests wait in a bounded
queue and join the pool between decode steps.

| name      | meaning                                                                  |
|-----------|--------------------------------------------------------------------------|
| P         | slots of the pool (`--slots`): sequences decoded in one compiled step    |
| waiting   | submitted requests not yet in a slot, at most `--max-queue`              |
| running   | slot → the request decoded in it                                         |

    loop:
      release the slots of cancelled requests (a client went away)
      admit: waiting requests, in order, while there are free slots and their prompts fit
             `--prefill-tokens` together (the first always) → packed prefills of 64, 128,
             256, … tokens (compiled at start-up up to `--prefill-tokens`; a longer prompt
             is prefilled in chunks of the longest); each gets its first token. A prompt
             that extends a kept state (the pool keeps 2 × P: each request's state after its
             prompt and after its output, least recently used dropped) prefills only the
             tokens after it: a chat's next turn costs its new tokens
      step:  every running request advances up to `--tokens-per-call` tokens in one compiled
             call (a request that ends within it stops advancing there)
      each token → its request's text (stop ids, stop strings, max_tokens); a finished
             request frees its slot at once

Each request's updates (`Update`: new text, then the finish reason and token counts) go to
its `deliver` callback from the engine thread; the server passes one that hands them to the
event loop. `close` stops the loop; requests still waiting or running end with
finish_reason "abort".
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .. import DecodePool, Sampling, TextPieces, end_of_sequence_ids
from .._generate import TOKENS_PER_CALL

from .requests import Job


@dataclass
class Update:
    """New text of a request; `finish_reason` ("stop", "length", "abort", "error") on its last."""

    text: str
    finish_reason: str | None = None
    completion_tokens: int = 0
    error: str | None = None


@dataclass(eq=False)
class Request:
    """A submitted `Job`, with its text so far and where its updates go."""

    job: Job
    deliver: Callable[[Update], None]
    text: TextPieces | None = None
    tokens: int = 0
    cancelled: bool = False
    slot: int | None = field(default=None)


class QueueFull(Exception):
    """The waiting queue holds `--max-queue` requests already."""


class Engine:
    """The model's one thread: a `DecodePool` of `slots` slots and a queue of at most
    `max_queue` waiting requests (see the module notes).

    **Arguments:** `model` (a `CachedLanguageModel`), `tokenizer`, `slots`, `capacity` (the
    pool's attention capacity), `max_queue`, `prefill_tokens`, `tokens_per_call` (the pool's).
    """

    def __init__(self, model, tokenizer, *, slots: int, capacity: int, max_queue: int, prefill_tokens: int = 512,
                 tokens_per_call: int = TOKENS_PER_CALL):
        self.tokenizer, self.vocab_size = tokenizer, model.vocab_size
        self.slots, self.max_queue, self.prefill_tokens = slots, max_queue, prefill_tokens
        self.stop_tokens = end_of_sequence_ids(model, tokenizer)
        self._pool = DecodePool(model, slots, capacity, saved_states=2 * slots,
                                prefill_chunk=packed_lengths(prefill_tokens)[-1], tokens_per_call=tokens_per_call)
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}
        self._changed = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="recurrax-serve-engine", daemon=True)

    def warm_up(self) -> None:
        """Compile the decode step and every packed prefill length up to `prefill_tokens`
        (before serving: no request waits for a compilation unless its prompt is longer)."""
        for length in packed_lengths(self.prefill_tokens):
            (slot, _), = self._pool.admit([[0]], [Sampling()], stop_tokens=[self.stop_tokens], packed_length=length)
            self._pool.step()
            self._pool.release(slot)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job, deliver: Callable[[Update], None]) -> Request:
        """Queue `job`; `QueueFull` when `max_queue` requests wait already."""
        request = Request(job, deliver)
        with self._changed:
            if self._closing:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting already (--max-queue {self.max_queue})")
            self._waiting.append(request)
            self._changed.notify()
        return request

    def cancel(self, request: Request) -> None:
        """Stop `request` (its client went away): its slot is freed before the next step."""
        with self._changed:
            request.cancelled = True
            self._changed.notify()

    def stats(self) -> dict:
        """Slots, running and waiting requests (a snapshot)."""
        with self._changed:
            return {"slots": self.slots, "running": len(self._running), "waiting": len(self._waiting),
                    "prefilled_tokens": self._pool.prefilled_tokens}

    def close(self) -> None:
        """Stop the loop; what still waits or runs ends with finish_reason "abort"."""
        with self._changed:
            self._closing = True
            self._changed.notify()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not (self._closing or self._waiting or self._running):
                    self._changed.wait()
                if self._closing:
                    break
                for slot in [s for s, r in self._running.items() if r.cancelled]:
                    self._free(slot)
                while self._waiting and self._waiting[0].cancelled:
                    self._waiting.popleft()
                admitted = self._next_admitted(len(self._pool.free_slots()))
            try:
                self._advance(admitted)
            except Exception as error:  # a failed compiled call: those requests end, the loop goes on
                for request in admitted + list(self._running.values()):
                    request.deliver(Update("", "error", request.tokens, error=f"{type(error).__name__}: {error}"))
                with self._changed:
                    for slot in list(self._running):
                        self._free(slot)
        with self._changed:
            ending = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for request in ending:
            request.deliver(Update("", "abort", request.tokens))

    def _next_admitted(self, free: int) -> list[Request]:
        """The waiting requests (the lock is held) that fit `free` slots and, together, the
        prefill budget (the first always fits)."""
        admitted, total = [], 0
        while self._waiting and len(admitted) < free:
            request = self._waiting[0]
            if not request.cancelled:
                if admitted and total + len(request.job.prompt_ids) > self.prefill_tokens:
                    break
                admitted.append(request)
                total += len(request.job.prompt_ids)
            self._waiting.popleft()
        return admitted

    def _advance(self, admitted: list[Request]) -> None:
        """Admit `admitted`, then one decode call (up to `tokens_per_call` tokens per request);
        every token reaches its request, in order (one that a stop string ended gets no more)."""
        if admitted:
            for request in admitted:
                request.text = TextPieces(self.tokenizer, request.job.prompt_ids, self.stop_tokens, request.job.stop)
            first = self._pool.admit([r.job.prompt_ids for r in admitted], [r.job.sampling for r in admitted],
                                     stop_tokens=[self.stop_tokens] * len(admitted),
                                     max_new_tokens=[r.job.max_tokens for r in admitted])
            with self._changed:
                for request, (slot, _) in zip(admitted, first):
                    request.slot = slot
                    self._running[slot] = request
            for slot, token in first:
                self._receive(slot, token)
        for slot, token in self._pool.step():
            self._receive(slot, token)

    def _receive(self, slot: int, token: int) -> None:
        request = self._running.get(slot)
        if request is None:
            return
        request.tokens += 1
        text = request.text.push(token)
        if request.text.finish_reason is None and request.tokens >= request.job.max_tokens:
            text += request.text.finish()
        if request.text.finish_reason is None:
            if text:
                request.deliver(Update(text))
            return
        with self._changed:
            self._free(slot)
        request.deliver(Update(text, request.text.finish_reason, request.tokens))

    def _free(self, slot: int) -> None:
        """Release `slot` (the lock is held)."""
        self._running.pop(slot, None)
        self._pool.release(slot)


def packed_lengths(most: int) -> list[int]:
    """The packed prefill lengths the engine uses up to `most`: 64, 128, 256, … (powers of
    two: few compilations), the last one ≥ `most`."""
    lengths = [64]
    while lengths[-1] < most:
        lengths.append(2 * lengths[-1])
    return lengths
