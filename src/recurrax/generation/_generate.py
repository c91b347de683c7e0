"""Generation with continuous batching: ragged prompts prefilled as one packed batch, decoding
from a pool of cache slots, a finished slot taking the next queued prompt.

| symbol | meaning                                                          |
|--------|------------------------------------------------------------------|
| P      | cache slots (sequences decoded together)                         |
| N      | tokens of one packed prefill: 64, 128, … ≤ `prefill_chunk`       |
| L      | attention capacity: longest prompt + max_new_tokens, bucketed    |

    loop:
      admit: up to (free slots) queued prompts → packed prefills (cu_seqlens) of at most
             `prefill_chunk` tokens (a longer prompt continues from its slot in the next)
             → their caches go into free slots, their first new tokens are sampled
      step:  every live slot advances `tokens_per_call` tokens in one compiled call (a loop of
             decode steps, the sampled tokens fed back on the device); a slot that meets its
             stop token or max_new_tokens within it stops there (its cache rows kept); empty
             or finished slots compute and are ignored
      a sequence ends at a stop token or after max_new_tokens; its slot is free again

Every compiled function has a fixed shape: the prefill takes P sequences (the unused ones
empty) plus one padding sequence that absorbs the padding tokens, and the decode step always
runs all P slots. Token j of prompt i is sampled with `fold_in(fold_in(key(seed), i), j)`,
so results do not depend on the number of slots or on scheduling. A prefill's length is a
power of two from 64 to `prefill_chunk` (2048): however many prompt lengths a long-lived
process sees, the prefill compiles at most 6 programs per pool shape (XLA's CPU JIT keeps
every compiled program mapped, so unbounded shapes would exhaust `vm.max_map_count`); the
attention capacity is rounded up to buckets of 8 per octave (at most 1/8 more than needed).

A `DecodePool` with `saved_states` keeps released caches keyed by the tokens they consumed;
a prompt that extends one prefills only its new tokens. `GenerationSession` keeps such a
pool between calls (a chat's turns; `recurrax generate --chat`), `recurrax serve` one for
all requests.

`DecodePool` holds the loop's state (the pool, which slot holds what, each slot's sampling
settings and seed as arrays `[P]`, so one compiled step serves slots sampled differently);
`generate` drives it with a queue of prompts, `recurrax serve` with requests as they come.
`generate_tokens` yields each `(prompt, token)` as its step samples it (`generate` collects
them; text streaming reads them). A repetition penalty carries, beside the pool, which
tokens each slot has seen (`[P, vocab]` booleans: its prompt, set at admission, and every
token it sampled); without one, nothing of it is compiled.

Any model with a cache can generate: `generate` needs only the `CachedLanguageModel`
protocol, which `recurrax.nn.LanguageModel` and `CausalLM` implement:

    model.vocab_size                                   ids are in [0, vocab_size)
    model.generation_cache(slots, capacity)            an empty cache for `slots` sequences
    model.prefill(tokens [N], cu_seqlens [S+1], cache) → (logits [S, vocab], cache)   packed; each
                                                       sequence's last token's logits
    model.decode_step(tokens [P], cache)               → (logits [P, vocab], cache)   one token each

Every array of a cache has the sequence (slot) axis first, so `generate` moves a prefilled
sequence into a slot of the pool by indexing that axis. `capacity` is the positions per
sequence that softmax-attention layers keep (longest prompt + max_new_tokens, bucketed); a
model whose cache does not depend on it ignores it. The model is a `flax.nnx.Module`; one
lacking a member is a `TypeError` naming the missing ones. An optional `eos_token_ids` (a
`CausalLM` has its checkpoint's) are the default stop tokens. Inside
`recurrax.runtime_checks()` the compiled prefill and step run their checks (token ids, cache
capacity) through `checkify` and raise what fails; attention caches then hold at least one
packed prefill (its padding sequence writes them too).

On a mesh (inside `recurrax.nn.use_mesh(mesh, rules)`, the model placed by `shard_model`),
the pool's rows are split over the mesh axis of `batch` and the heads of its states and
attention buffers over those of `heads` / `kv_heads` (where they divide); the results equal
one device's.

The caches (the pool of P slots and one prefill's P + 1 rows) are sized before anything
runs; a request whose caches exceed `max_cache_bytes` (default: the free memory of the
device, or of the host for CPU) is a `ValueError` naming `max_new_tokens`, the longest
prompt, the slot count and the bytes.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from functools import partial
from typing import Any, Collection, Iterator, NamedTuple, Protocol, Sequence, runtime_checkable

import inspect
import math
import numbers
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import checkify
from jaxtyping import Array, Float, Int

from .._core.problem import runtime_checks_enabled
from ..nn._sharding import constrain
from ..nn._tokens import check_token_ids
from ._sampling import penalize_repetitions, sample_tokens


PREFILL_CHUNK = 2048
"""`DecodePool`'s default most tokens per packed prefill."""

TOKENS_PER_CALL = 8
"""Decode steps per compiled call of `generate`, `GenerationSession` and `recurrax serve`
(`DecodePool`'s `tokens_per_call`): the host's cost of a call (dispatch, transfers, reading
the tokens back) is shared by 8 tokens per sequence; the tokens are those of one step per call."""


@runtime_checkable
class CachedLanguageModel(Protocol):
    """What `generate` needs of a model (a `flax.nnx.Module`): the vocabulary size, an empty
    cache, a packed prefill and a one-token step. `recurrax.nn.LanguageModel` and `CausalLM`
    implement it.

    A cache is any pytree whose arrays all have the sequence axis first (rows = slots).
    """

    vocab_size: int

    def generation_cache(self, slots: int, capacity: int) -> Any:
        """An empty cache for `slots` sequences; softmax-attention layers keep `capacity`
        positions per sequence (a model without them ignores it)."""
        ...

    def prefill(self, tokens: Int[Array, " N"], cu_seqlens: Int[Array, " S_plus_1"],
                cache: Any) -> tuple[Float[Array, "S vocab"], Any]:
        """Continue S packed sequences (some may be empty) from the S rows of `cache`: the
        next-token logits after each sequence's last token (an empty sequence's: any)."""
        ...

    def decode_step(self, tokens: Int[Array, " P"], cache: Any) -> tuple[Float[Array, "P vocab"], Any]:
        """Advance each of the P rows of `cache` by its one token."""
        ...


PROTOCOL = ("vocab_size", "generation_cache", "prefill", "decode_step")


def check_protocol(model) -> None:
    """A `TypeError` naming what `model` lacks of `CachedLanguageModel`."""
    missing = [name for name in PROTOCOL if not hasattr(model, name)
               or (name != "vocab_size" and not callable(getattr(model, name)))]
    if missing:
        raise TypeError(f"generate needs a model with a cache (the CachedLanguageModel protocol: "
                        f"{', '.join(PROTOCOL)}); {type(model).__name__} lacks {', '.join(missing)}")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"generate needs a flax.nnx.Module (it splits the model into graph and parameters for "
                        f"jit); {type(model).__name__} is not one")


def _keys(seeds, indices, counts):
    """One key per row: `fold_in(fold_in(key(seed), index), count)` (all `[P]`)."""
    return jax.vmap(lambda s, i, j: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), i), j))(
        seeds, indices, counts)


def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    num_slots: int | None = None,
    max_cache_bytes: int | None = None,
    tokens_per_call: int = TOKENS_PER_CALL,
) -> list[list[int]]:
    """Continue every prompt by up to `max_new_tokens` tokens.

    **Arguments:**
    - `model`: any `CachedLanguageModel`: a `CausalLM` (e.g. from `from_pretrained`), a
      `recurrax.nn.LanguageModel`, or your own model with those four members.
    - `prompts`: token-id lists (Python or NumPy integers in `[0, vocab_size)`), of any
      non-zero lengths.
    - `max_new_tokens`: most tokens generated per prompt (an integer ≥ 0).
    - `temperature`: 0 for greedy decoding, else the sampling temperature (finite, ≥ 0).
    - `top_k`, `top_p`: keep the k most likely tokens (an integer ≥ 1; more than the
      vocabulary keeps all) / the smallest set with mass ≥ p (0 < p ≤ 1).
    - `repetition_penalty`: > 1 makes the tokens of the prompt and of the output so far less
      likely (`transformers`' penalty: a positive logit divided by it, a negative one
      multiplied; greedy decoding too); None (default) or 1 for none. None compiles nothing
      for it.
    - `seed`: sampling randomness (an integer).
    - `stop_tokens`: ids that end a sequence (the stop token is included in its output);
      default (None): the model's `eos_token_ids` (a `CausalLM`'s `eos_token_id`, from
      config.json or generation_config.json), none for a model without them; `()` never stops.
    - `num_slots`: sequences decoded at once (an integer ≥ 1; default: all prompts, at most
      8); more prompts wait in a queue and take slots as sequences finish.
    - `max_cache_bytes`: the most bytes the decode caches may take (default: the device's
      free memory; the host's available memory on CPU).
    - `tokens_per_call`: decode steps per compiled call (an integer ≥ 1; default
      `TOKENS_PER_CALL`, 8): the tokens do not depend on it, the host's cost per token does
      (its dispatch and read-back are shared by that many tokens); a sequence that ends
      within a call stops there, its row computing and ignored until the call ends.

    **Returns:** the new tokens of each prompt, in the order of `prompts`.

    Every argument is checked first: a wrong type is a `TypeError`, a wrong value a
    `ValueError`, each naming the argument; nothing is coerced. A model without the protocol
    is a `TypeError` naming the methods it lacks.
    """
    prompts, events = _checked_events(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                      top_p=top_p, repetition_penalty=repetition_penalty, seed=seed,
                                      stop_tokens=stop_tokens, num_slots=num_slots, max_cache_bytes=max_cache_bytes,
                                      tokens_per_call=tokens_per_call)
    outputs = [[] for _ in prompts]
    for i, token in events:
        outputs[i].append(token)
    return outputs


def generate_tokens(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, **options) -> Iterator[tuple[int, int]]:
    """`generate` as it runs: an iterator of `(prompt index, token id)`, each token as soon as
    its step has sampled it (the tokens of one prompt in order; prompts decoded together
    interleave). The arguments (`options`: `generate`'s keyword arguments, with its defaults)
    and their checks are `generate`'s, done when this is called, not at the first `next`; the
    tokens are exactly `generate`'s. Stopping early (`close()`, or leaving a `for` loop)
    computes nothing more.
    """
    arguments = inspect.signature(generate).bind(model, prompts, max_new_tokens, **options)
    arguments.apply_defaults()
    return _checked_events(**arguments.arguments)[1]


def _checked_events(model, prompts, max_new_tokens, *, temperature, top_k, top_p, repetition_penalty, seed,
                    stop_tokens, num_slots, max_cache_bytes, tokens_per_call):
    """The checked prompts and the iterator of `(prompt index, token)` that decodes them."""
    check_protocol(model)
    prompts = _checked_prompts(prompts, model.vocab_size)
    _check_int("num_slots", num_slots, 1, optional=True)
    _check_int("tokens_per_call", tokens_per_call, 1)
    max_new_tokens, stops, sampling = _checked_options(
        model, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, seed=seed, stop_tokens=stop_tokens, max_cache_bytes=max_cache_bytes)
    if max_new_tokens == 0 or not prompts:
        return prompts, (event for event in ())  # a generator: it has close()
    P = num_slots or min(len(prompts), 8)
    longest = max(map(len, prompts))
    capacity = _checked_capacity(model, P, longest, max_new_tokens, max_cache_bytes)
    return prompts, _events(model, prompts, max_new_tokens, stops, P, capacity, sampling, repetition_penalty,
                            tokens_per_call)


def _checked_options(model, max_new_tokens, *, temperature, top_k, top_p, repetition_penalty, seed, stop_tokens,
                     max_cache_bytes) -> tuple[int, set[int], Sampling]:
    """`generate`'s options checked: `(max_new_tokens, stop ids, Sampling)`."""
    _check_int("max_new_tokens", max_new_tokens, 0)
    _check_number("temperature", temperature, 0.0)
    _check_int("top_k", top_k, 1, optional=True)
    _check_number("top_p", top_p, 0.0, optional=True, high=1.0)
    _check_number("repetition_penalty", repetition_penalty, 0.0, optional=True)
    if repetition_penalty == 0:
        raise ValueError("repetition_penalty must be > 0 (1 or None for no penalty), got 0")
    _check_int("seed", seed)
    _check_int("max_cache_bytes", max_cache_bytes, 1, optional=True)
    if stop_tokens is None:
        stop_tokens = getattr(model, "eos_token_ids", ())
    stop_tokens = _checked_ids("stop_tokens", stop_tokens, model.vocab_size)
    top_k = model.vocab_size if top_k is None else min(top_k, model.vocab_size)  # fits int32
    return max_new_tokens, set(stop_tokens), Sampling(temperature=temperature, top_k=top_k, top_p=top_p or 1.0,
                                                      seed=seed)


def _checked_capacity(model, slots: int, longest: int, max_new_tokens: int, max_cache_bytes: int | None) -> int:
    """The attention capacity for prompts of up to `longest` tokens, checked to fit memory."""
    capacity = cache_capacity(model, longest + max_new_tokens)
    if runtime_checks_enabled() and capacity > 1:  # the checks see the padding sequence's positions too
        capacity = max(capacity, bucket(slots * longest, 64))
    _check_cache_bytes(model, slots, capacity, max_new_tokens, longest, max_cache_bytes)
    return capacity


def _events(model, prompts, max_new_tokens, stops, P, capacity, sampling, repetition_penalty, tokens_per_call):
    """Decode the checked `prompts` in a `DecodePool` of `P` slots, yielding `(prompt index, token)`."""
    pool = DecodePool(model, P, capacity, repetition_penalty=repetition_penalty, tokens_per_call=tokens_per_call)
    queue = deque(range(len(prompts)))
    owner: dict[int, int] = {}  # slot → prompt index
    counts = [0] * len(prompts)

    def record(slot: int, token: int) -> tuple[int, int]:
        i = owner[slot]
        counts[i] += 1
        if token in stops or counts[i] >= max_new_tokens:
            pool.release(slot)
            del owner[slot]
        return i, token

    while queue or owner:
        free = pool.free_slots()
        if queue and free:
            admitted = [queue.popleft() for _ in free[: len(queue)]]
            first = pool.admit([prompts[i] for i in admitted], [sampling._replace(index=i) for i in admitted],
                               stop_tokens=[stops] * len(admitted), max_new_tokens=[max_new_tokens] * len(admitted))
            for i, (slot, token) in zip(admitted, first):
                owner[slot] = i
                yield record(slot, token)
        for slot, token in pool.step():
            yield record(slot, token)


class GenerationSession:
    """One sequence at a time, its caches kept between calls: a call whose prompt extends the
    tokens an earlier call consumed (its prompt and its output, the last token excepted)
    prefills only the tokens after them. A chat's next turn, whose rendering starts with the
    conversation so far, costs its new tokens only; a prompt that extends none of the kept
    states (a template that rewrote earlier text, another conversation) is prefilled whole.

    The results are `generate`'s for the same prompt (the kept state is the one a prefill of
    the whole prompt computes, up to float rounding). The compiled shapes are one `DecodePool`'s
    (`prefill_chunk` bounds the prefill lengths); a model with softmax attention gets a pool of
    twice the capacity when a call needs more than the pool holds (that call is prefilled whole).

    **Arguments:**
    - `model`: a `CachedLanguageModel`.
    - `saved_states`: the most states kept (least recently used dropped first; default 2).
    - `prefill_chunk`: as `DecodePool`'s.
    - `tokens_per_call`: as `generate`'s (default 8).

    `prefilled_tokens` counts the tokens fed to prefills, all calls together.
    """

    def __init__(self, model, *, saved_states: int = 2, prefill_chunk: int = PREFILL_CHUNK,
                 tokens_per_call: int = TOKENS_PER_CALL):
        check_protocol(model)
        _check_int("saved_states", saved_states, 1)
        _check_int("tokens_per_call", tokens_per_call, 1)
        self.model, self.saved_states, self.prefill_chunk = model, saved_states, prefill_chunk
        self.tokens_per_call = tokens_per_call
        self._pool: DecodePool | None = None
        self._penalty: float | None = None
        self._prefilled_before = 0  # tokens prefilled by the pools replaced

    @property
    def prefilled_tokens(self) -> int:
        return self._prefilled_before + (self._pool.prefilled_tokens if self._pool is not None else 0)

    def generate_tokens(self, prompt: Sequence[int], max_new_tokens: int, *, temperature: float = 0.0,
                        top_k: int | None = None, top_p: float | None = None,
                        repetition_penalty: float | None = None, seed: int = 0,
                        stop_tokens: Sequence[int] | None = None,
                        max_cache_bytes: int | None = None) -> Iterator[tuple[int, int]]:
        """`generate_tokens(model, [prompt], ...)` (same arguments, checked here), continuing a
        kept state where `prompt` extends one; the state after this call is kept when its
        iterator ends or is closed."""
        prompt, = _checked_prompts([prompt], self.model.vocab_size)
        max_new_tokens, stops, sampling = _checked_options(
            self.model, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            repetition_penalty=repetition_penalty, seed=seed, stop_tokens=stop_tokens,
            max_cache_bytes=max_cache_bytes)
        if max_new_tokens == 0:
            return (event for event in ())
        pool = self._pool_for(len(prompt), max_new_tokens, repetition_penalty, max_cache_bytes)
        return self._events(pool, prompt, max_new_tokens, stops, sampling)

    def _pool_for(self, prompt_length: int, max_new_tokens: int, repetition_penalty, max_cache_bytes) -> DecodePool:
        """The kept pool, or a new one where it holds too few positions for this call or its
        repetition penalty differs."""
        pool, needed = self._pool, prompt_length + max_new_tokens
        fits = pool is not None and (pool.capacity == 1 or pool.capacity >= needed)
        if fits and self._penalty == repetition_penalty:
            return pool
        capacity = _checked_capacity(self.model, 1, prompt_length, max_new_tokens, max_cache_bytes)
        if pool is not None:
            capacity = max(capacity, 2 * pool.capacity) if capacity > 1 else capacity
            self._prefilled_before += pool.prefilled_tokens
        self._pool = DecodePool(self.model, 1, capacity, repetition_penalty=repetition_penalty,
                                saved_states=self.saved_states, prefill_chunk=self.prefill_chunk,
                                tokens_per_call=self.tokens_per_call)
        self._penalty = repetition_penalty
        return self._pool

    @staticmethod
    def _events(pool: DecodePool, prompt: list[int], max_new_tokens: int, stops: set[int], sampling: Sampling):
        (slot, token), = pool.admit([prompt], [sampling], stop_tokens=[stops], max_new_tokens=[max_new_tokens])
        try:
            yield 0, token
            for tokens in iter(pool.step, []):  # [] once the pool ended it: a stop token, its budget
                for _, token in tokens:
                    yield 0, token
        finally:
            pool.release(slot)


class Sampling(NamedTuple):
    """How one sequence picks its tokens (see `sample_tokens`): greedy at `temperature` 0;
    `top_k` (≤ the vocabulary) and `top_p` cut the distribution. Its token j is drawn with
    `fold_in(fold_in(key(seed), index), j)`: `generate` gives prompt i the index i."""

    temperature: float = 0.0
    top_k: int = 2**31 - 1
    top_p: float = 1.0
    seed: int = 0
    index: int = 0


class DecodePool:
    """`slots` cache slots decoding together, each with its own `Sampling`: the engine of
    `generate`, `GenerationSession` and `recurrax serve`.

    `admit` prefills new sequences as packed batches into free slots and returns their first
    tokens; `step` advances every live slot by up to `tokens_per_call` tokens in one compiled
    call (free slots compute and are ignored); `release` frees a slot (a finished or cancelled
    sequence). Sequences join and leave between calls (continuous batching). A slot given stop
    tokens or a budget at `admit` stops advancing on the device when it meets them, within a
    call: its cache then holds exactly the tokens it consumed. The tokens do not depend on
    `tokens_per_call`; the host's cost per token (dispatch, transfers, the read-back) falls
    with it. One step program is compiled per `tokens_per_call`.

    Bounded compilation: a packed prefill holds at most `prefill_chunk` tokens (a power of
    two); more are prefilled in several calls, a prompt split between them continuing from its
    slot's cache. Each call is padded to a power of two ≥ 64, so the compiled shapes are the
    `log2(prefill_chunk / 64) + 1` prefill lengths and one step, whatever the prompt lengths.

    Saved states (`saved_states` > 0): `admit` keeps each slot's cache after its prompt, and
    `release` after its output (every token it consumed: its prompt and its output but the
    last token, sampled and not fed), in a store of `saved_states` rows keyed by those
    tokens, the least recently used overwritten. A prompt that extends a stored key starts
    from that state and prefills only the tokens after it: a chat's next turn (the
    conversation so far, with the reply as generated; or, where the reply's text encodes to
    other tokens, the previous prompt) costs its new tokens. `prefilled_tokens` counts the
    tokens fed to prefills.

    **Arguments:**
    - `model`: a `CachedLanguageModel`.
    - `slots`: sequences decoded at once (P).
    - `capacity`: attention-cache positions per slot (1 for models without attention; see
      `generate`).
    - `repetition_penalty`: one factor for every slot, or None (nothing compiled for it).
    - `saved_states`: rows of the store of released states (0: none kept).
    - `prefill_chunk`: most tokens of one packed prefill (a power of two ≥ 64).
    - `tokens_per_call`: decode steps per `step` call (an integer ≥ 1; 1: one, no select of
      frozen rows; `generate`'s default is `TOKENS_PER_CALL`).
    """

    def __init__(self, model, slots: int, capacity: int, *, repetition_penalty: float | None = None,
                 saved_states: int = 0, prefill_chunk: int = PREFILL_CHUNK, tokens_per_call: int = 1):
        if prefill_chunk < 64 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk must be a power of two ≥ 64, got {prefill_chunk}")
        _check_int("tokens_per_call", tokens_per_call, 1)
        graphdef, params = nnx.split(model)
        structure = ModelStructure(graphdef, params)
        self._params = jax.tree.leaves(params)  # a flat list: no nnx pytree to walk in every call
        self._static = dict(structure=structure, slots=slots, capacity=capacity)
        self.tokens_per_call = tokens_per_call
        self._admit, self._step = _compiled()
        self._pool = _empty_pool(model, slots, capacity)
        self._penalty = None
        if repetition_penalty is not None and repetition_penalty != 1:
            self._penalty = (jnp.float32(repetition_penalty), jnp.zeros((slots, model.vocab_size), bool))
        self.slots, self.capacity, self.vocab_size = slots, capacity, model.vocab_size
        self.prefill_chunk = prefill_chunk
        self.occupied = np.zeros(slots, bool)
        self._pending = np.zeros(slots, np.int32)  # each slot's last sampled token (the next step's input)
        self._counts = np.zeros(slots, np.int32)   # tokens each slot has sampled
        self._live = np.zeros(slots, bool)         # occupied, not ended by a stop token or its budget
        self._budgets = np.full(slots, np.iinfo(np.int32).max, np.int32)  # most tokens each slot samples
        self._stops = [frozenset()] * slots        # each slot's stop tokens
        self._device = None  # (pending, counts, live) on the device: the last step's, or None (sent anew)
        self._limits = None  # (stops [P, S], budgets) on the device, or None (sent anew)
        self._settings = SlotSettings.empty(slots, model.vocab_size)
        self._saved = SavedStates(model, saved_states, capacity) if saved_states else None
        self._consumed: list[list[int]] = [[] for _ in range(slots)]  # tokens in each slot's cache
        self.prefilled_tokens = 0

    def free_slots(self) -> list[int]:
        """The free slots, lowest first."""
        return [int(s) for s in np.flatnonzero(~self.occupied)]

    def admit(self, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling], *,
              stop_tokens: Sequence[Collection[int]] | None = None, max_new_tokens: Sequence[int] | None = None,
              packed_length: int | None = None) -> list[tuple[int, int]]:
        """Prefill `prompts` (checked token ids, at most as many as free slots) into the lowest
        free slots; returns `(slot, first token)` for each, in order. A prompt that extends a
        saved state prefills only its tokens after it. Each packed prefill has `packed_length`
        tokens (default: its tokens, at most `prefill_chunk`, rounded up to a power of two).

        Each prompt's sequence ends (`step` gives it no more tokens and its cache stops
        advancing) after one of its `stop_tokens` or `max_new_tokens` tokens (both per prompt;
        default: none, unbounded); release its slot then."""
        targets = self.free_slots()[: len(prompts)]
        if len(targets) < len(prompts):
            raise ValueError(f"{len(prompts)} prompts for {len(targets)} free slots")
        prompts = [list(p) for p in prompts]
        stop_tokens = [frozenset()] * len(prompts) if stop_tokens is None else [frozenset(s) for s in stop_tokens]
        max_new_tokens = [np.iinfo(np.int32).max] * len(prompts) if max_new_tokens is None else max_new_tokens
        starts = self._load_saved(prompts, targets)
        for slot, options, prompt, stops, budget in zip(targets, sampling, prompts, stop_tokens, max_new_tokens):
            self._settings.set(slot, options, self.vocab_size)
            self.occupied[slot], self._counts[slot] = True, 1
            self._stops[slot], self._budgets[slot] = stops, budget
            self._consumed[slot] = prompt
        self._device = self._limits = None
        first = {}
        remaining = [prompt[start:] for prompt, start in zip(prompts, starts)]
        for rows in _chunks(remaining, [start > 0 for start in starts], packed_length or self.prefill_chunk):
            order = [i for i, _, _, _ in rows]
            parts = [part for _, part, _, _ in rows]
            tokens, cu_seqlens, target = _pack(parts, [targets[i] for i in order], self.slots, packed_length)
            continues = np.zeros(self.slots, bool)
            continues[: len(rows)] = [continued for _, _, continued, _ in rows]
            sampled, self._pool, self._penalty = self._admit(
                self._params, self._pool, tokens, cu_seqlens, target, jnp.asarray(continues),
                self._settings.arrays(), self._penalty, self._prompts_seen([prompts[i] for i in order]),
                **self._static)
            self.prefilled_tokens += sum(map(len, parts))
            sampled = np.asarray(sampled)
            first.update((i, int(sampled[row])) for row, (i, _, _, last) in enumerate(rows) if last)
        for i, slot in enumerate(targets):
            self._pending[slot] = first[i]
            self._live[slot] = not self._ended(slot, first[i])
            if self._saved is not None:
                self._saved.save(self._pool, slot, prompts[i])
        return [(slot, first[i]) for i, slot in enumerate(targets)]

    def step(self) -> list[tuple[int, int]]:
        """Advance every live slot (occupied, not ended) by up to `tokens_per_call` tokens in
        one compiled call: `(slot, token)` for each token, in the order k calls of one token
        would give them (step by step, slots in order); nothing runs when no slot is live. A
        slot stops advancing within the call after its stop token or its last token (its
        cache then holds exactly the tokens it consumed)."""
        if not self._live.any():
            return []
        if self._device is None:
            # copies: on a CPU an array made from NumPy may share its memory, which the host mirrors change
            self._device = tuple(jnp.array(x, copy=True) for x in (self._pending, self._counts, self._live))
        tokens, self._pool, *device, self._penalty = self._step(
            self._params, self._pool, *self._device, self._settings.arrays(), *self._limit_arrays(),
            self._penalty, **self._static, tokens_per_call=self.tokens_per_call)
        self._device = tuple(device)
        tokens = np.asarray(tokens)  # [tokens_per_call, P], -1 where a slot was not live
        if self.tokens_per_call == 1:  # no freeze: every occupied row consumed its pending token
            for slot in np.flatnonzero(self.occupied & ~self._live):
                self._consumed[slot].append(int(self._pending[slot]))
        out = []
        for row in tokens:
            for slot in np.flatnonzero(row >= 0):
                token = int(row[slot])
                self._consumed[slot].append(int(self._pending[slot]))
                self._pending[slot] = token
                self._counts[slot] += 1
                self._live[slot] = not self._ended(slot, token)
                out.append((int(slot), token))
        return out

    def release(self, slot: int) -> None:
        """Free `slot` (its cache is overwritten by the next sequence admitted there); with
        saved states, its cache is kept first, keyed by the tokens it consumed."""
        if self._saved is not None and self.occupied[slot]:
            self._saved.save(self._pool, slot, self._consumed[slot])
        if self._live[slot]:
            self._device = None
        self.occupied[slot] = self._live[slot] = False
        self._consumed[slot] = []

    def _ended(self, slot: int, token: int) -> bool:
        """Whether `slot`'s sequence ends with its sampled `token`."""
        return token in self._stops[slot] or self._counts[slot] >= self._budgets[slot]

    def _limit_arrays(self) -> tuple:
        """Each slot's stop tokens `[P, S]` (S a power of two, padded with -1) and budget `[P]`
        on the device, sent after each admission."""
        if self._limits is None:
            width = 1 << max(max(map(len, self._stops)) - 1, 0).bit_length()
            stops = np.full((self.slots, width), -1, np.int32)
            for slot, ids in enumerate(self._stops):
                stops[slot, : len(ids)] = sorted(ids)
            self._limits = jnp.asarray(stops), jnp.array(self._budgets, copy=True)
        return self._limits

    def _load_saved(self, prompts: list[list[int]], targets: list[int]) -> list[int]:
        """Copy the longest saved state each prompt extends into its target slot; returns the
        tokens of each prompt those states consumed (0 where none)."""
        starts = [0] * len(prompts)
        if self._saved is None:
            return starts
        into, rows = np.full(self.slots, self.slots, np.int32), np.zeros(self.slots, np.int32)
        for i, (prompt, slot) in enumerate(zip(prompts, targets)):
            row, starts[i] = self._saved.longest_prefix(prompt)
            if starts[i]:
                into[i], rows[i] = slot, row
        if any(starts):
            self._pool = _copy_rows(self._pool, self._saved.store, jnp.asarray(into), jnp.asarray(rows))
        return starts

    def _prompts_seen(self, prompts: list[list[int]]):
        """With a repetition penalty, `[P, vocab]`: the tokens of each packed row's whole
        prompt (`prompts`, in the rows' order)."""
        if self._penalty is None:
            return None
        seen = np.zeros((self.slots, self.vocab_size), bool)
        for row, prompt in enumerate(prompts):
            seen[row, prompt] = True
        return jnp.asarray(seen)


def _chunks(parts: list[list[int]], kept: list[bool], limit: int) -> Iterator[list[tuple[int, list[int], bool, bool]]]:
    """The packed prefill calls that feed `parts` (each prompt's tokens to prefill), at most
    `limit` tokens a call, in order: rows `(prompt index, tokens, continues, last)`;
    `continues` where the prompt's cache holds tokens already (`kept`: a saved state; or an
    earlier call), `last` where these are the prompt's last tokens."""
    fed = [0] * len(parts)
    pending = deque(range(len(parts)))
    while pending:
        rows, room = [], limit
        while pending and room:
            i = pending[0]
            take = parts[i][fed[i]: fed[i] + room]
            continues = kept[i] or fed[i] > 0
            fed[i] += len(take)
            room -= len(take)
            if fed[i] == len(parts[i]):
                pending.popleft()
            rows.append((i, take, continues, fed[i] == len(parts[i])))
        yield rows


class SavedStates:
    """Up to `rows` single-sequence caches (a store shaped like a pool of `rows` slots), each
    keyed by the tokens it consumed; the least recently used is overwritten first."""

    def __init__(self, model, rows: int, capacity: int):
        self.store = _empty_pool(model, rows, capacity)
        self.rows = rows
        self._keys: OrderedDict[tuple[int, ...], int] = OrderedDict()  # least recently used first

    def longest_prefix(self, prompt: list[int]) -> tuple[int, int]:
        """`(row, length)` of the longest key that is a proper prefix of `prompt` (at least one
        token is left to prefill: its logits give the first new token); `(0, 0)` if none."""
        found = max((key for key in self._keys if len(key) < len(prompt) and tuple(prompt[: len(key)]) == key),
                    key=len, default=())
        if not found:
            return 0, 0
        self._keys.move_to_end(found)
        return self._keys[found], len(found)

    def save(self, pool, slot: int, consumed: list[int]) -> None:
        """Copy `pool`'s row `slot`, which consumed `consumed`, into the store."""
        key = tuple(consumed)
        if not key:
            return
        if key in self._keys:
            row = self._keys.pop(key)
        elif len(self._keys) < self.rows:
            row = min(set(range(self.rows)) - set(self._keys.values()))
        else:
            row = self._keys.pop(next(iter(self._keys)))
        self.store = _copy_rows(self.store, pool, jnp.asarray([row], jnp.int32), jnp.asarray([slot], jnp.int32))
        self._keys[key] = row


@partial(jax.jit, donate_argnums=0)
def _copy_rows(into, source, into_rows, source_rows):
    """`into` with its rows `into_rows` set to `source`'s rows `source_rows` (an out-of-range
    row of `into_rows` is skipped)."""
    return constrain_cache(jax.tree.map(
        lambda a, b: a.at[into_rows].set(jnp.take(b, source_rows, axis=0, mode="clip"), mode="drop"), into, source))


class SlotSettings:
    """Each slot's `Sampling`, as host arrays `[P]` (the compiled calls' arguments)."""

    def __init__(self, temperature, top_k, top_p, seed, index):
        self.temperature, self.top_k, self.top_p, self.seed, self.index = temperature, top_k, top_p, seed, index
        self._arrays = None

    @classmethod
    def empty(cls, slots: int, vocab_size: int) -> SlotSettings:
        seed_dtype = np.asarray(jnp.asarray(0)).dtype  # a Python int's: int64 under x64, else int32
        return cls(np.zeros(slots, np.float32), np.full(slots, vocab_size, np.int32), np.ones(slots, np.float32),
                   np.zeros(slots, seed_dtype), np.zeros(slots, np.int32))

    def set(self, slot: int, sampling: Sampling, vocab_size: int) -> None:
        self.temperature[slot], self.top_p[slot] = sampling.temperature, sampling.top_p
        self.top_k[slot] = min(sampling.top_k, vocab_size)
        self.seed[slot], self.index[slot] = sampling.seed, sampling.index
        self._arrays = None

    def arrays(self) -> tuple:
        """The settings on the device, sent once after each change (not in every step)."""
        if self._arrays is None:
            self._arrays = tuple(jnp.array(x, copy=True) for x in (self.temperature, self.top_k, self.top_p,
                                                                   self.seed, self.index))
        return self._arrays


class ModelStructure:
    """A model's graph and its parameters' tree structure, the compiled calls' static argument:
    `model(leaves)` is the model with those parameters. Hashed once: an nnx `GraphDef`'s hash
    walks the whole model (2–3 ms for a 24-layer model on a CPU core, in every decode step
    when it was hashed per call), and a pool's own structure compares equal by identity."""

    def __init__(self, graphdef, params):
        self.graphdef, self.treedef = graphdef, jax.tree.structure(params)
        self._hash = hash((graphdef, self.treedef))

    def model(self, leaves):
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, ModelStructure) and self._hash == other._hash
                                 and self.treedef == other.treedef and self.graphdef == other.graphdef)


STATIC = ("structure", "slots", "capacity")
"""Both compiled functions (`_admit`, `_step`; inside `recurrax.runtime_checks()` their
checkified versions) donate the pool (the caller rebinds it to the result): the new
caches reuse its buffers instead of fresh allocations each step (2.7× less CPU time per step
for mamba2-130m at 64 slots)."""


def _admit_body(params, pool, tokens, cu_seqlens, targets, continues, settings, penalty=None, seen=None, *,
                structure, slots, capacity):
    """Prefill the packed prompts, each from its target slot's cache where `continues`, else
    from an empty one; put their caches into their target slots, sample their first tokens with
    their target slots' settings. With a `penalty` (factor, seen), the slots' seen tokens
    become `seen` (their whole prompts') and their first tokens."""
    net = structure.model(params)
    empty = net.generation_cache(slots + 1, capacity)
    start = jax.tree.map(lambda e, p: e.at[:slots].set(jnp.where(
        continues.reshape(-1, *(1,) * (e.ndim - 1)), jnp.take(p, targets, axis=0, mode="clip"), e[:slots])),
        empty, pool)
    logits, fresh = net.prefill(tokens, cu_seqlens, start)
    last = logits[:slots]  # [P, vocab]
    pool = jax.tree.map(lambda p, f: p.at[targets].set(f[:slots], mode="drop"), pool, fresh)
    rows = tuple(jnp.take(x, targets, mode="clip") for x in settings)  # each packed row's slot's settings
    if penalty is None:
        return _sample(last, rows, jnp.zeros_like(targets)), constrain_cache(pool), None
    factor, slot_seen = penalty
    first = _sample(penalize_repetitions(last, seen, factor), rows, jnp.zeros_like(targets))
    slot_seen = slot_seen.at[targets].set(seen.at[jnp.arange(slots), first].set(True), mode="drop")
    return first, constrain_cache(pool), (factor, slot_seen)


def _step_body(params, pool, pending, counts, live, settings, stops, budgets, penalty=None, *, structure, slots,
               capacity, tokens_per_call):
    """Up to `tokens_per_call` decode steps of every slot (a `lax.while_loop` that ends early
    once no slot is live): each live slot feeds its pending token, samples the next with key
    count `counts` (marking it seen), and stays live while that token is not one of its
    `stops` (`[P, S]`, padded with -1) and `counts` < `budgets`. A slot not live computes and
    is kept: its cache rows, pending token, count and seen tokens stay as they were (one step
    per call needs no such select: the host calls it for live slots only, and the other rows'
    results are ignored).

    Returns `(tokens [tokens_per_call, P]` (-1 where a slot was not live), pool, pending,
    counts, live, penalty)`."""
    net = structure.model(params)
    freeze = tokens_per_call > 1

    def one(carry):
        pool, pending, counts, live, penalty = carry
        logits, stepped = net.decode_step(pending, pool)
        if penalty is not None:
            logits = penalize_repetitions(logits, penalty[1], penalty[0])
        sampled = _sample(logits, settings, counts)
        stepped = jax.tree.map(lambda new, old: new.astype(old.dtype), stepped, pool)  # as `_admit` keeps them
        if freeze:
            stepped = _kept_frozen(stepped, pool, live)
        if penalty is not None:
            marked = jnp.where(live, sampled, penalty[1].shape[1])  # out of range: dropped
            penalty = (penalty[0], penalty[1].at[jnp.arange(slots), marked].set(True, mode="drop"))
        counts = jnp.where(live, counts + 1, counts)
        stopped = jnp.any(sampled[:, None] == stops, axis=1) | (counts >= budgets)
        token = jnp.where(live, sampled, -1)
        carry = (constrain_cache(stepped), jnp.where(live, sampled, pending), counts, live & ~stopped, penalty)
        return carry, token

    carry = (pool, pending, counts, live, penalty)
    if not freeze:
        carry, token = one(carry)
        return token[None], *carry

    def next_step(loop):
        j, tokens, carry = loop
        carry, token = one(carry)
        return j + 1, tokens.at[j].set(token), carry

    tokens = jnp.full((tokens_per_call, slots), -1, jnp.int32)
    _, tokens, carry = jax.lax.while_loop(lambda loop: (loop[0] < tokens_per_call) & jnp.any(loop[2][3]),
                                          next_step, (0, tokens, carry))
    return tokens, *carry


def _kept_frozen(stepped, pool, live):
    """`stepped` (a cache after a decode step) where a row is `live`, else `pool`'s row (a frozen
    row keeps its cache): a `where` per array, which XLA fuses into the state's update on a TPU,
    so that the update writes the cache in place. On a CPU the `where` runs behind a `lax.cond`
    on a row being frozen (most steps none: no pass over the caches; Qwen3.5-shaped tiny, batch 8:
    1.65 vs 2.3 ms a token); on a TPU that cond cost a copy of every state each step (its output
    cannot share the loop's buffers): GLA-340M at batch 8, 24 copies of 4.2 MB a step."""

    def select():
        return jax.tree.map(lambda new, old: jnp.where(live.reshape(-1, *(1,) * (new.ndim - 1)), new, old),
                            stepped, pool)

    return jax.lax.platform_dependent(cpu=lambda: jax.lax.cond(jnp.all(live), lambda: stepped, select),
                                      default=select)


STEP_STATIC = (*STATIC, "tokens_per_call")

_admit = jax.jit(_admit_body, static_argnames=STATIC, donate_argnames=("pool", "penalty"))
_step = jax.jit(_step_body, static_argnames=STEP_STATIC, donate_argnames=("pool", "penalty"))


def _checkified(body, pool_position: int, static: tuple[str, ...]):
    """`body` compiled with its `checkify.check`s functionalised: returns `(error, outputs)`."""

    def run(*args, **static_values):
        return checkify.checkify(partial(body, **static_values))(*args)

    return jax.jit(run, static_argnames=static, donate_argnums=(pool_position,))


_admit_checked = _checkified(_admit_body, 1, STATIC)
_step_checked = _checkified(_step_body, 1, STEP_STATIC)


def _compiled():
    """(admit, step): inside `recurrax.runtime_checks()` the versions whose checks (token ids,
    cache capacity) run and are thrown as errors; else the plain ones (no check at all)."""
    if not runtime_checks_enabled():
        return _admit, _step
    return _throwing(_admit_checked), _throwing(_step_checked)


def _throwing(checked):
    def call(*args, **static):
        error, outputs = checked(*args, **static)
        error.throw()
        return outputs

    return call


def _empty_pool(model, slots: int, capacity: int):
    """`model.generation_cache(slots, capacity)`, laid out by `constrain_cache` (compiled once
    per model structure, slots and capacity, as `_admit` and `_step`)."""
    graphdef, params = nnx.split(model)
    return _empty_pool_compiled(jax.tree.leaves(params), structure=ModelStructure(graphdef, params), slots=slots,
                                capacity=capacity)


@partial(jax.jit, static_argnames=STATIC)
def _empty_pool_compiled(params, *, structure, slots, capacity):
    return constrain_cache(structure.model(params).generation_cache(slots, capacity))


CACHE_AXES = {
    "state": ("batch", "heads", None, None),           # a recurrent state [R, H, K, V]
    "normalizer": ("batch", "heads", None),             # [R, H, K]
    "keys": ("batch", None, "kv_heads", "head_dim"),    # an attention buffer [R, L, Hkv, D]
    "values": ("batch", None, "kv_heads", "head_dim"),
}
"""Logical axes of the cache arrays, by their field name; any other array: rows (`batch`) first."""


def constrain_cache(cache):
    """Every array of `cache` constrained to the current mesh and rules (`recurrax.nn.use_mesh`):
    rows over `batch`, a recurrent state's heads over `heads`, an attention buffer's over
    `kv_heads`; unchanged outside a mesh."""

    def one(path, x):
        names = CACHE_AXES.get(getattr(path[-1], "name", None) if path else None)
        return constrain(x, *(names if names and len(names) == x.ndim else ("batch",) + (None,) * (x.ndim - 1)))

    return jax.tree_util.tree_map_with_path(one, cache)


def _sample(logits, settings, counts):
    """Each row's token with its settings (`SlotSettings.arrays`) and its count of tokens so far."""
    temperature, top_k, top_p, seeds, indices = settings
    return sample_tokens(logits, _keys(seeds, indices, counts), temperature=temperature, top_k=top_k, top_p=top_p)


def bucket(n: int, smallest: int) -> int:
    """`n` rounded up to one of 8 sizes per octave (at most 1/8 more), at least `smallest`."""
    if n <= smallest:
        return smallest
    step = 1 << max((n - 1).bit_length() - 4, 0)
    return -(-n // step) * step


def cache_capacity(model, needed: int) -> int:
    """The attention-cache capacity (a `DecodePool`'s `capacity`) for sequences of up to
    `needed` tokens (prompt and output): `needed` bucketed (fewer recompilations), or 1 for
    models whose cache shapes do not depend on it (no softmax-attention layer)."""
    shapes = [jax.tree.map(lambda x: x.shape, jax.eval_shape(lambda: model.generation_cache(1, c))) for c in (16, 32)]
    if shapes[0] == shapes[1]:
        return 1
    return bucket(needed, 16)


def cache_bytes(model, rows: int, capacity: int) -> int:
    """Bytes of `model.generation_cache(rows, capacity)`, from shapes only."""
    shapes = jax.eval_shape(lambda: model.generation_cache(rows, capacity))
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def available_bytes() -> int:
    """Free memory of the default device; on CPU the host's available memory."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_cache_bytes(model, slots: int, capacity: int, max_new_tokens: int, longest: int, limit: int | None):
    """Refuse a request whose caches (the pool and one prefill's) would not fit."""
    needed = cache_bytes(model, slots, capacity) + cache_bytes(model, slots + 1, capacity)
    limit = available_bytes() if limit is None else limit
    if needed > limit:
        raise ValueError(
            f"generate's caches would need {needed:,} bytes (max_new_tokens={max_new_tokens}, longest prompt "
            f"{longest} tokens, num_slots={slots}: {capacity:,} positions per slot), more than the "
            f"{limit:,} bytes available (max_cache_bytes); lower max_new_tokens, the prompt lengths or num_slots")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _check_int(name: str, value, low: int | None = None, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value):
        raise TypeError(f"{name} must be an integer{' or None' if optional else ''}, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be ≥ {low}, got {value}")


def _check_number(name: str, value, low: float, *, optional: bool = False, high: float | None = None) -> None:
    """A finite real number ≥ `low` (> `low` when `high` is given, then also ≤ `high`)."""
    if value is None and optional:
        return
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a real number{' or None' if optional else ''}, got {value!r}")
    if high is None and not (math.isfinite(value) and value >= low):
        raise ValueError(f"{name} must be a finite number ≥ {low}, got {value}")
    if high is not None and not (math.isfinite(value) and low < value <= high):
        raise ValueError(f"{name} must be a finite number in ({low}, {high}], got {value}")


def _checked_ids(name: str, ids, vocab_size: int) -> list[int]:
    """`ids` as a list of Python ints, each an integer in `[0, vocab_size)`."""
    if isinstance(ids, (str, bytes, bytearray)) or not hasattr(ids, "__iter__"):
        raise TypeError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}")
    ids = list(ids)
    for position, token in enumerate(ids):
        if not _is_int(token):
            raise TypeError(f"{name}[{position}] must be an integer token id, got {token!r}")
    check_token_ids(np.asarray(ids, np.int64).reshape(-1), vocab_size, name)
    return [int(t) for t in ids]


def _checked_prompts(prompts, vocab_size: int) -> list[list[int]]:
    if isinstance(prompts, (str, bytes, bytearray)) or not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a sequence of token-id sequences, got {type(prompts).__name__}")
    checked = [_checked_ids(f"prompts[{i}]", prompt, vocab_size) for i, prompt in enumerate(prompts)]
    if any(len(p) == 0 for p in checked):
        raise ValueError(f"every prompt needs at least one token; prompts[{[len(p) for p in checked].index(0)}] "
                         "is empty")
    return checked


def _pack(prompts: list[list[int]], slots: list[int], P: int, length: int | None = None):
    """Packed tokens `[N]` (N = `length`, or the total rounded up to a power of two ≥ 64),
    `cu_seqlens [P + 2]` (prompts, empty sequences, one padding sequence) and target slots
    `[P]` (P = dropped)."""
    lengths = [len(p) for p in prompts] + [0] * (P - len(prompts))
    total = sum(lengths)
    N = max(64, 1 << (total - 1).bit_length()) if length is None else length
    if N < total:
        raise ValueError(f"packed_length {N} is less than the prompts' {total} tokens")
    tokens = np.zeros(N, np.int32)
    tokens[:total] = np.concatenate([np.asarray(p, np.int32) for p in prompts])
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths), [N]]).astype(np.int32)
    target = np.full(P, P, np.int32)
    target[: len(slots)] = slots
    return jnp.asarray(tokens), jnp.asarray(cu_seqlens), jnp.asarray(target)
