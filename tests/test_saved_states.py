"""Generation that keeps its states between calls and compiles a bounded set of shapes:
`DecodePool`'s saved states and chunked prefill, `GenerationSession` (a chat's turns).

Reference: each next token is the argmax of one parallel forward (no cache) over the whole
sequence so far, of a float64 model (its rounding, ~1e-15, cannot flip an argmax of random
logits). What a call costs is counted in tokens fed to prefills (`prefilled_tokens`) and in
compiled programs, never timed."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recurrax.nn import LanguageModel
from recurrax.nn.pretrained import CausalLM, DecodePool, GenerationSession, Sampling
from recurrax.generation import _generate

VOCAB = 32


@functools.lru_cache(maxsize=None)
def model_of(name: str):
    """A float64 recurrent model (GLA, short convolution) or a hybrid with softmax attention."""
    if name == "gla":
        return LanguageModel(VOCAB, 16, 2, 2, mixer="gla", mlp_ratio=2,
                             mixer_options=dict(num_kv_heads=1, conv_size=3), dtype=jnp.float64,
                             param_dtype=jnp.float64, rngs=nnx.Rngs(5))
    return CausalLM(HYBRID, dtype=jnp.float64, rngs=nnx.Rngs(1))


HYBRID = dict(model_type="gla", vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_heads=2,
              use_short_conv=True, attn=dict(layers=[1], num_heads=2, num_kv_heads=1))
"""fla's GLA with short convolutions, its second layer softmax attention."""


@functools.lru_cache(maxsize=None)
def forward_of(model):
    return jax.jit(lambda tokens: model(tokens))


def greedy_reference(model, prompt, n, repetition_penalty=None):
    """`n` greedy tokens, each the argmax of a parallel forward over everything so far (with a
    penalty: `transformers`' rule in numpy on the tokens so far)."""
    row, forward = list(prompt), forward_of(model)
    for _ in range(n):
        padded = np.zeros(max(64, 1 << len(row).bit_length()), np.int32)  # causal: the padding is not seen
        padded[: len(row)] = row
        last = np.asarray(forward(jnp.asarray(padded[None])))[0, len(row) - 1]
        if repetition_penalty is not None:
            seen = np.isin(np.arange(VOCAB), row)
            last = np.where(seen, np.where(last > 0, last / repetition_penalty, last * repetition_penalty), last)
        row.append(int(np.argmax(last)))
    return row[len(prompt):]


def session_turn(session, prompt, n, **options):
    before = session.prefilled_tokens
    tokens = [token for _, token in session.generate_tokens(prompt, n, stop_tokens=(), **options)]
    return tokens, session.prefilled_tokens - before


# turn 2 of the hybrid needs more attention positions than turn 1's pool holds (16): a pool of
# twice the capacity, prefilled whole; turn 3 fits it and continues
PREFILLED = {"gla": [7, 5, 3, 29], "hybrid": [7, 16, 3, 29]}


@pytest.mark.parametrize("name", ["gla", "hybrid"])
def test_a_turn_that_extends_the_conversation_prefills_only_its_new_tokens(name):
    """Each turn's prompt is the conversation so far (prompt and reply) and new tokens: it
    feeds its new tokens only (the last reply token too: it was sampled, not fed) and its
    tokens equal a whole parallel forward's; a prompt that changes an earlier token (a
    template that rewrote earlier text) is prefilled whole, and is right too."""
    model = model_of(name)
    session = GenerationSession(model, prefill_chunk=64)
    prompt, fed = [3, 1, 4, 1, 5, 9, 2], []
    for turn, new in enumerate([[], [6, 5, 3, 5], [8, 9]]):
        prompt = prompt + new
        tokens, cost = session_turn(session, prompt, 5)
        assert tokens == greedy_reference(model, prompt, 5), turn
        fed.append(cost)
        prompt = prompt + tokens
    rewritten = [7] + prompt[1:] + [2]
    tokens, cost = session_turn(session, rewritten, 5)
    assert tokens == greedy_reference(model, rewritten, 5)
    assert fed + [cost] == PREFILLED[name] and PREFILLED[name][-1] == len(rewritten)


def test_a_repetition_penalty_sees_the_whole_conversation():
    """With a penalty, a continued turn penalises the tokens of the kept part too."""
    model = model_of("gla")
    session = GenerationSession(model)
    first, _ = session_turn(session, [3, 1, 4, 1, 5], 6, repetition_penalty=1.8)
    assert first == greedy_reference(model, [3, 1, 4, 1, 5], 6, repetition_penalty=1.8)
    prompt = [3, 1, 4, 1, 5] + first + [2, 7]
    tokens, cost = session_turn(session, prompt, 6, repetition_penalty=1.8)
    assert cost == 3 and tokens == greedy_reference(model, prompt, 6, repetition_penalty=1.8)


def drive(pool, prompts, n):
    """Admit `prompts` into `pool`, decode each to `n` tokens, release: the tokens of each."""
    first = pool.admit(prompts, [Sampling()] * len(prompts))
    out = {slot: [token] for slot, token in first}
    for _ in range(n - 1):
        for slot, token in pool.step():
            out[slot].append(token)
    for slot, _ in first:
        pool.release(slot)
    return [out[slot] for slot, _ in first]


@pytest.mark.parametrize("name", ["gla", "hybrid"])
def test_prompts_longer_than_a_prefill_chunk_are_prefilled_in_chunks(name):
    """Two prompts of 100 and 40 tokens, at most 64 a call (three calls: one prompt split
    over two, the other starting in the second call's room; with a repetition penalty, each
    row's seen tokens are its own prompt's), and one of 150 alone."""
    model = model_of(name)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, VOCAB, n)) for n in (100, 40, 150)]
    pool = DecodePool(model, 2, 160, prefill_chunk=64)
    assert drive(pool, prompts[:2], 4) == [greedy_reference(model, p, 4) for p in prompts[:2]]
    assert drive(pool, prompts[2:], 4) == [greedy_reference(model, prompts[2], 4)]
    assert pool.prefilled_tokens == 290
    penalised = DecodePool(model, 2, 160, prefill_chunk=64, repetition_penalty=1.8)
    assert drive(penalised, prompts[:2], 4) == [greedy_reference(model, p, 4, repetition_penalty=1.8)
                                                for p in prompts[:2]]


def test_saved_states_are_a_bounded_lru_keyed_by_the_tokens_consumed():
    """Three conversations through a store of four states (each sequence keeps two: after its
    prompt, after its output): the least recently used are overwritten (a conversation whose
    states are gone is prefilled whole), the others continue; a prompt equal to a key (nothing
    left to feed) is prefilled whole."""
    model = model_of("gla")
    pool = DecodePool(model, 2, 1, saved_states=4)

    def cost(prompt, n=3):
        before = pool.prefilled_tokens
        tokens, = drive(pool, [prompt], n)
        assert tokens == greedy_reference(model, prompt, n)
        return tokens, pool.prefilled_tokens - before

    a, b, c = [1, 2, 3], [4, 5, 6, 7], [8, 9]
    outputs = dict(zip("ab", drive(pool, [a, b], 3)))  # kept: a, b, a's and b's outputs
    cost(c)                                           # kept: a's and b's outputs, c, c's output
    b_next = b + outputs["b"] + [10]
    b_reply, fed = cost(b_next)                       # kept: c's output, b's output, b_next, its output
    assert fed == 2
    a_next = a + outputs["a"] + [10]
    assert cost(a_next)[1] == len(a_next)             # a's states were overwritten by c's
    key = b_next + b_reply[:-1]                       # b_next's output state's key, still kept
    assert cost(key + [11])[1] == 1 and cost(key)[1] == len(key)


def test_a_prompt_that_extends_an_earlier_prompt_but_not_its_output_continues_from_the_prompt():
    """A chat client that sends the reply back as text encoded to other tokens: the state
    after the previous prompt is kept too, so only the tokens after that prompt are fed."""
    model = model_of("gla")
    pool = DecodePool(model, 1, 1, saved_states=2)
    first = [1, 2, 3, 4]
    reply, = drive(pool, [first], 4)
    other = first + [(t + 1) % VOCAB for t in reply] + [5, 6]
    before = pool.prefilled_tokens
    assert drive(pool, [other], 3) == [greedy_reference(model, other, 3)]
    assert pool.prefilled_tokens - before == len(other) - len(first)


def mapped_regions() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_a_long_run_of_mixed_prompt_lengths_compiles_a_bounded_set_of_programs():
    """Prompts of 1 to 700 tokens, admitted one or two at a time: the prefill compiles at most
    its three lengths (64, 128, 256 tokens, chunks of ≤ 256), the step once; a second run of
    other lengths compiles nothing more and the process maps (nearly) no more memory regions
    (XLA's CPU JIT keeps every compiled program mapped)."""
    model = model_of("gla")
    pool = DecodePool(model, 2, 1, prefill_chunk=256)
    rng = np.random.default_rng(1)

    def run(admissions):
        for _ in range(admissions):
            drive(pool, [list(rng.integers(0, VOCAB, rng.integers(1, 700))) for _ in range(rng.integers(1, 3))], 2)

    admits, steps = _generate._admit._cache_size(), _generate._step._cache_size()
    run(30)
    assert _generate._admit._cache_size() - admits <= 3 and _generate._step._cache_size() - steps <= 1
    compiled, regions = _generate._admit._cache_size() + _generate._step._cache_size(), mapped_regions()
    run(30)
    assert _generate._admit._cache_size() + _generate._step._cache_size() == compiled
    assert mapped_regions() - regions < 16


@functools.lru_cache(maxsize=None)
def sensitive_model_of(name: str):
    """`model_of(name)` with every matrix 3× larger (vectors, such as norm weights, as they are)."""
    graphdef, params = nnx.split(model_of(name))
    return nnx.merge(graphdef, jax.tree.map(lambda x: 3 * x if x.ndim >= 2 else x, params))


@pytest.mark.parametrize("name", ["gla", "hybrid"])
def test_a_reused_slot_starts_from_a_zeroed_state(name):
    """Slot 0 serves a long prompt A while slot 1 serves C; A is released and the short prompt
    B takes slot 0, decoded beside C. B's tokens equal B served alone in a fresh pool and the
    parallel forward's (C's too): A's recurrent state, short-convolution buffer or attention
    cache (keys, values, its position count), left in the slot, would change them (each one
    leaked alone flips B's tokens: checked by hand against `_admit_body` skipping its reset).
    The model's matrices are 3× their initializer's: at its scale a tiny model's greedy tokens
    barely depend on its caches (the hybrid's leaked convolution buffer changed none)."""
    model = sensitive_model_of(name)
    rng = np.random.default_rng(0)
    a, b, c = (list(rng.integers(0, VOCAB, n)) for n in (90, 3, 5))
    pool = DecodePool(model, 2, 128)
    first = pool.admit([a, c], [Sampling()] * 2)
    assert [slot for slot, _ in first] == [0, 1]
    outputs = {1: [first[1][1]]}
    for _ in range(6):
        outputs[1].append(dict(pool.step())[1])
    pool.release(0)
    for _ in range(2):  # the free slot computes on in the steps
        outputs[1].append(dict(pool.step())[1])
    (slot, token), = pool.admit([b], [Sampling()])
    assert slot == 0
    outputs[0] = [token]
    for _ in range(9):
        step = dict(pool.step())
        outputs[0].append(step[0])
        outputs[1].append(step[1])
    assert outputs[0] == drive(DecodePool(model, 2, 128), [b], 10)[0] == greedy_reference(model, b, 10)
    assert outputs[1] == greedy_reference(model, c, 18)


@pytest.mark.parametrize("tokens_per_call", [1, 4])
def test_the_step_and_prefill_update_the_caches_in_place_and_return_only_tokens(tokens_per_call):
    """The compiled step and admission donate the pool: every cache array of the hybrid
    (recurrent states, convolution buffers, attention keys, values and positions) is an input
    aliased to an output (XLA writes the new caches into the old buffers, on a TPU as on a
    CPU); what a step sends back to the host is its `[tokens_per_call, P]` tokens (the pool,
    the pending tokens, counts and live flags stay on the device). In bfloat16, as on a TPU
    (the step keeps every cache array's dtype: a float64 model's float32 recurrent state stays
    float32, as the admission keeps it)."""
    model = CausalLM(HYBRID, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    pool = DecodePool(model, 2, 32, tokens_per_call=tokens_per_call)
    leaves = len(jax.tree.leaves(pool._pool))
    step_args = (pool._params, pool._pool, jnp.asarray(pool._pending), jnp.asarray(pool._counts),
                 jnp.asarray(pool._live), pool._settings.arrays(), *pool._limit_arrays(), None)
    static = dict(pool._static, tokens_per_call=tokens_per_call)
    lowered = _generate._step.lower(*step_args, **static)
    assert lowered.as_text().count("tf.aliasing_output") == leaves
    tokens, cache, pending, counts, live, penalty = jax.eval_shape(
        functools.partial(_generate._step_body, **static), *step_args)
    assert (tokens.shape, jnp.dtype(tokens.dtype).kind, penalty) == ((tokens_per_call, 2), "i", None)
    assert jax.tree.structure(cache) == jax.tree.structure(pool._pool)
    assert [x.dtype for x in jax.tree.leaves(cache)] == [x.dtype for x in jax.tree.leaves(pool._pool)]
    packed, cu_seqlens, target = _generate._pack([[1, 2, 3]], [0], 2)
    admitted = _generate._admit.lower(pool._params, pool._pool, packed, cu_seqlens, target, jnp.zeros(2, bool),
                                      pool._settings.arrays(), None, None, **pool._static)
    assert admitted.as_text().count("tf.aliasing_output") == leaves


def test_a_decode_step_sends_no_model_structure_or_settings_again(monkeypatch):
    """The host's share of a decode step: the compiled step's static argument (the model's graph)
    is hashed once per pool, not in every step (hashing an nnx GraphDef walks the whole model:
    most of a TPU decode step's time before), the parameters go as a flat list, and the
    slots' sampling settings are sent to the device once per change. Tokens stay those of a
    pool that sends everything every step (a fresh pool per step's settings)."""
    model = CausalLM(HYBRID, dtype=jnp.float32, rngs=nnx.Rngs(2))
    graph_type = type(nnx.split(model)[0])
    hashes = []
    original = graph_type.__hash__
    monkeypatch.setattr(graph_type, "__hash__", lambda self: hashes.append(1) or original(self))
    pool = DecodePool(model, 2, 32)
    pool.admit([[1, 2, 3], [4, 5]], [Sampling(), Sampling(temperature=0.8, seed=3)])
    before, sent = len(hashes), pool._settings.arrays()
    steps = [pool.step() for _ in range(4)]
    assert len(hashes) == before  # no graph hashed by the steps
    assert pool._settings.arrays() is sent  # nor the settings sent again
    assert all(isinstance(leaf, jax.Array) for leaf in pool._params)
    pool.release(0)
    pool.admit([[6]], [Sampling(temperature=0.5, seed=1)])
    assert pool._settings.arrays() is not sent  # a change is sent
    monkeypatch.setattr(graph_type, "__hash__", original)
    fresh = DecodePool(model, 2, 32)
    fresh.admit([[1, 2, 3], [4, 5]], [Sampling(), Sampling(temperature=0.8, seed=3)])
    assert [fresh.step() for _ in range(4)] == steps
