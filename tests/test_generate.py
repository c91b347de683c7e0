"""Several decode steps per compiled call (`tokens_per_call`): the tokens are those of one step
per call, for greedy and sampled decoding, a repetition penalty, stop tokens met within a call,
budgets that are no multiple of it, continuous batching and saved states.

Reference: one step per call (`tokens_per_call=1`, each token sampled with the key of its
(seed, prompt, count), independent of the calls), and for greedy decoding a parallel forward
over everything so far (`test_saved_states.greedy_reference`). The models are float64 (the
test_saved_states ones): an argmax or a draw cannot flip on a rounding difference between the
two compiled programs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from recurrax.generation import _generate
from recurrax.nn.pretrained import DecodePool, GenerationSession, Sampling, generate, generate_tokens
from test_saved_states import VOCAB, greedy_reference, model_of

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2], [3, 8, 4, 6, 2, 6]]
SAMPLED = dict(temperature=0.9, top_k=12, top_p=0.9, seed=7)


def by_prompt(events, count):
    """The tokens of each prompt, from `(prompt index, token)` events."""
    out = [[] for _ in range(count)]
    for i, token in events:
        out[i].append(token)
    return out


@pytest.mark.parametrize("name", ["gla", "hybrid"])
@pytest.mark.parametrize("options", [{}, SAMPLED, dict(SAMPLED, repetition_penalty=1.6), dict(repetition_penalty=1.6)],
                         ids=["greedy", "sampled", "sampled-penalty", "greedy-penalty"])
def test_several_tokens_per_call_give_the_tokens_of_one_per_call(name, options):
    """Five prompts through two slots (continuous batching: a slot freed within a call takes
    the next prompt after it), 11 new tokens (no multiple of 4 or 8); greedy decoding also
    equals a parallel forward."""
    model = model_of(name)
    one = generate(model, PROMPTS, 11, num_slots=2, stop_tokens=(), tokens_per_call=1, **options)
    assert all(len(tokens) == 11 for tokens in one)
    for k in (4, 8):
        assert generate(model, PROMPTS, 11, num_slots=2, stop_tokens=(), tokens_per_call=k, **options) == one, k
    if "temperature" not in options:
        penalty = options.get("repetition_penalty")
        assert one == [greedy_reference(model, p, 11, repetition_penalty=penalty) for p in PROMPTS]


def stops_within_a_call(model, options, k):
    """Stop ids that end some of PROMPTS' outputs (one step per call, 11 tokens, no stops),
    one at least after a count that is no multiple of `k` (within a call)."""
    free = generate(model, PROMPTS, 11, num_slots=2, stop_tokens=(), tokens_per_call=1, **options)
    stops = {free[0][2], free[2][5]}
    ended = [min((j for j, t in enumerate(tokens) if t in stops), default=None) for tokens in free]
    assert any(j is not None and (j + 1) % k for j in ended)  # within a call
    return stops


@pytest.mark.parametrize("name", ["gla", "hybrid"])
@pytest.mark.parametrize("options", [{}, dict(SAMPLED, repetition_penalty=1.6)], ids=["greedy", "sampled-penalty"])
def test_stop_tokens_met_within_a_call_end_the_sequence_there(name, options):
    """A sequence whose stop id comes within a call gets no token after it (the event stream
    has none: each prompt's tokens equal one step per call's), its slot going to the next
    prompt."""
    model = model_of(name)
    stops = stops_within_a_call(model, options, 4)
    one = generate(model, PROMPTS, 11, num_slots=2, stop_tokens=stops, tokens_per_call=1, **options)
    assert any(len(tokens) < 11 for tokens in one) and all(t not in stops for out in one for t in out[:-1])
    events = list(generate_tokens(model, PROMPTS, 11, num_slots=2, stop_tokens=stops, tokens_per_call=4, **options))
    assert by_prompt(events, len(PROMPTS)) == one


@pytest.mark.parametrize("name", ["gla", "hybrid"])
@pytest.mark.parametrize("ending", ["stop", "budget"])
def test_a_turn_after_one_that_ended_within_a_call_continues_from_the_right_state(name, ending):
    """A session whose first turn ends within a call (a stop id after 3 to 8 tokens, or a
    budget of 6, with 8 per call): its kept state holds the conversation up to that turn's last token,
    nothing after it, so the next turn (prompt, reply, new tokens) prefills its new tokens only
    and its tokens equal one step per call's and a parallel forward's. A slot that kept
    advancing within the call would hold tokens after the stop: the next turn would continue
    from a wrong state."""
    model = model_of(name)
    prompt = PROMPTS[3]
    free = greedy_reference(model, prompt, 11)
    stop = next(j for j in range(2, 8) if free[j] not in free[:j])  # within the first call (tokens 1-8)
    # a stop: 27 tokens at most (room for a second turn of 7); a budget: 6 (room for 3 more)
    stops, n, more = ((free[stop],), 27, 7) if ending == "stop" else ((), 6, 3)
    turns = {}
    for k in (1, 8):
        session = GenerationSession(model, tokens_per_call=k)
        first = [t for _, t in session.generate_tokens(prompt, n, stop_tokens=stops)]
        assert first == free[: stop + 1 if stops else n]
        if name == "hybrid":  # each kept state has consumed exactly its key's tokens
            saved = session._pool._saved
            assert {key: int(saved.store.positions[row]) for key, row in saved._keys.items()} == {
                key: len(key) for key in saved._keys}
        follow = prompt + first + [6, 5]
        before = session.prefilled_tokens
        second = [t for _, t in session.generate_tokens(follow, more, stop_tokens=())]
        assert session.prefilled_tokens - before == 3  # the last reply token and the two new ones
        assert second == greedy_reference(model, follow, more)
        turns[k] = first, second
    assert turns[8] == turns[1]


def test_a_pool_stops_each_slot_at_its_own_stop_ids_and_budget():
    """`DecodePool.step` with 4 tokens per call: each slot's tokens, in the order of one step
    per call (step by step, slots in order), none after the slot's stop id or budget; a slot
    that ended gives no more tokens and the next call computes only for live ones."""
    model = model_of("hybrid")
    prompts = [[3, 1, 4], [9, 2, 6, 5]]
    free = [greedy_reference(model, p, 9) for p in prompts]
    limits = dict(stop_tokens=[{free[0][2]}, ()], max_new_tokens=[9, 6])
    ones, fours = DecodePool(model, 2, 32, tokens_per_call=1), DecodePool(model, 2, 32, tokens_per_call=4)
    streams = []
    for pool in (ones, fours):
        first = pool.admit(prompts, [Sampling()] * 2, **limits)
        events = list(first)
        for calls in iter(pool.step, []):
            events += calls
        streams.append(events)
    expected = [free[0][: free[0].index(free[0][2]) + 1], free[1][:6]]
    assert [[t for s, t in streams[1] if s == slot] for slot in (0, 1)] == expected
    assert streams[1] == streams[0]
    assert fours.step() == [] and not fours._live.any()


def test_tokens_per_call_is_checked():
    model = model_of("gla")
    with pytest.raises(ValueError, match="tokens_per_call must be ≥ 1"):
        generate(model, PROMPTS, 3, tokens_per_call=0)
    with pytest.raises(TypeError, match="tokens_per_call must be an integer"):
        DecodePool(model, 2, 1, tokens_per_call=2.0)
    with pytest.raises(TypeError, match="tokens_per_call must be an integer"):
        GenerationSession(model, tokens_per_call=None)


def conditionals_over(text: str, types: set[str]) -> list[tuple[str, bool]]:
    """`(index, constant)` of each `stablehlo.case` of the lowered module `text` that returns
    an array of one of `types` (e.g. `tensor<2x2x8x8xf64>`); `constant` where its index is a
    `stablehlo.constant` or a case on one (how JAX picks a platform's branch; XLA folds it)."""
    constants = set(re.findall(r"(%[\w#]+) = stablehlo\.constant", text))
    opened, found = [], []
    for line in text.splitlines():
        case = re.search(r"(%[\w#]+)(?::\d+)? = \"stablehlo\.case\"\((%[\w#]+)\)", line)
        if case:
            opened.append(case.groups())
        closing = re.match(r"\s*\}\) : \(tensor<i32>\) -> (.*)", line)
        if closing and opened:
            name, index = opened.pop()
            if index in constants:
                constants.add(name)
            if any(t in closing.group(1) for t in types):
                found.append((index, index in constants))
    return found


def test_a_tpu_step_selects_frozen_rows_without_a_conditional_over_the_cache():
    """With several tokens per call the rows not live keep their caches by a `where` per array,
    which XLA fuses into the state's update on a TPU (the state written in place). Behind a
    `lax.cond` on every row being live, as on a CPU, the conditional's outputs cannot share
    the decode loop's buffers, so XLA copied every state each step (GLA-340M at batch 8: 24
    copies of 4.2 MB a step). The step lowered for a TPU (no chip needed) has no conditional
    on a computed index returning a cache's array; lowered for a CPU, it has that cond."""
    model = model_of("gla")
    pool = DecodePool(model, 2, 1, tokens_per_call=4)
    rows = lambda dtype, value: jnp.full(2, value, dtype)  # noqa: E731
    args = (pool._params, pool._pool, rows(jnp.int32, 0), rows(jnp.int32, 1), rows(bool, True),
            pool._settings.arrays(), jnp.full((2, 1), -1, jnp.int32), rows(jnp.int32, 100), None)
    types = {f"tensor<{'x'.join(map(str, x.shape))}xf64>" for x in jax.tree.leaves(pool._pool) if x.ndim == 4}
    assert types  # the recurrent states
    computed = {}
    for platform in ("tpu", "cpu"):
        exported = jax.export.export(_generate._step, platforms=[platform])(
            *args, **pool._static, tokens_per_call=4)
        found = conditionals_over(exported.mlir_module(), types)
        computed[platform] = [index for index, constant in found if not constant]
    assert computed == {"tpu": [], "cpu": [computed["cpu"][0]]}, computed
