"""Dispatch: priorities, fail-closed declarations, forced names, backends."""

import pytest
from _cases import Case, assert_matches, canonical, make_inputs

from recurrax import Backend, Platform, Request, Support, kernel_registry
from recurrax.registry import KernelRegistry

FLOAT32 = frozenset({"float32"})
SHARED = Case(T=5, H=4, Hqk=2, gates=("g_head",), cu_seqlens=(0, 2, 7))


def request(**overrides):
    facts = dict(dtype="float32", gates=frozenset(), varlen=False, backend="cpu", qk_head_dim=64, v_head_dim=64, seq_len=128)
    facts.update(overrides)
    return Request(**facts)


def make_registry():
    registry = KernelRegistry()
    registry.register("slow", Platform.XLA, Backend.ANY, priority=0,
                      supports=Support(FLOAT32, frozenset({"head", "key", "value"}), varlen=True))(lambda p, **kw: "slow")
    registry.register("fast", Platform.XLA, Backend.ANY, priority=10, supports=Support(FLOAT32, frozenset({"head"})))(
        lambda p, **kw: "fast")
    registry.register("gpu", Platform.PALLAS, Backend.GPU, priority=30,
                      supports=Support(FLOAT32, frozenset({"head", "key"}), varlen=True))(lambda p, **kw: "gpu")
    registry.register("wide", Platform.XLA, Backend.ANY, priority=20,
                      supports=Support(FLOAT32, check=lambda r: None if r.qk_head_dim % 128 == 0 else "needs K % 128 == 0"))(
        lambda p, **kw: "wide")
    return registry


def test_highest_priority_supporting_implementation_wins():
    registry = make_registry()
    assert registry.get(None, request()).name == "fast"
    assert registry.get(None, request(qk_head_dim=128)).name == "wide"
    assert registry.get(None, request(gates=frozenset({"key"}))).name == "slow"
    assert registry.get(None, request(varlen=True)).name == "slow"
    assert registry.get(None, request(backend="gpu", gates=frozenset({"key"}))).name == "gpu"
    assert registry.names() == ["gpu", "wide", "fast", "slow"]


def test_fail_closed_when_nothing_supports():
    with pytest.raises(ValueError, match="no registered implementation") as info:
        make_registry().get(None, request(dtype="bfloat16"))
    assert "slow: dtype bfloat16" in str(info.value)


def test_forced_name_that_cannot_run_the_call_says_why():
    registry = make_registry()
    with pytest.raises(ValueError, match="'fast' cannot run this call: gate kinds \\['value'\\]"):
        registry.get("fast", request(gates=frozenset({"value"})))
    with pytest.raises(ValueError, match="runs on gpu, this call is on cpu"):
        registry.get("gpu", request())
    with pytest.raises(ValueError, match="K % 128"):
        registry.get("wide", request())
    with pytest.raises(ValueError, match="must be one of"):
        registry.get("nope", request())
    assert registry.get("slow", request()).fn(None) == "slow"


def test_duplicate_names_are_refused():
    registry = make_registry()
    with pytest.raises(ValueError, match="already registered"):
        registry.register("slow", Platform.XLA, Backend.ANY, supports=Support(FLOAT32))(lambda p: p)


def test_the_reference_is_registered_for_every_float_dtype_and_gate():
    impl = next(i for i in kernel_registry.implementations() if i.name == "reference")
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        assert impl.refusal(request(dtype=dtype, gates=frozenset({"head", "key", "value"}), varlen=True)) is None


def test_an_unavailable_implementation_says_why_when_forced():
    registry, request = KernelRegistry(), Request("float32", frozenset(), False, "gpu", 64, 64, 128)
    registry.register("fallback", Platform.XLA, Backend.ANY, supports=Support(frozenset({"float32"})))(lambda p, **kw: 0)
    registry.mark_unavailable("kernel", "this JAX has no such backend")
    assert registry.names() == ["fallback"] and registry.get(None, request).name == "fallback"
    with pytest.raises(ValueError, match="implementation='kernel' is not available here: this JAX has no such backend"):
        registry.get("kernel", request)
    assert ("kernel", "not available here: this JAX has no such backend") in registry.select(request).answers


def test_shared_query_key_reach_other_implementations_expanded():
    """Only `chunk` declares `shared_query_key`; `scan` gets query and key repeated to every
    value head by `Implementation.run` and must still match the reference."""
    assert kernel_registry.get("chunk", Request.of(canonical(make_inputs(SHARED))[0])).support.shared_query_key
    assert not kernel_registry.get("scan", Request.of(canonical(make_inputs(SHARED))[0])).support.shared_query_key
    assert_matches("scan", SHARED)
