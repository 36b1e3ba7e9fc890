"""The cache contract (kv.contract.AttentionCache): every cache the model can hold derives from it and gives each
member the declared type; model.py and the attention kernel never probe a cache for what it is."""

import ast
import collections.abc
import inspect
import types
import typing
from pathlib import Path

import pytest
import torch
from cache_testing import small_factory, tiny_args, tiny_model

from cache import POLICIES
from evals.caches import MultiCache, ShadowCaches
from kv.contract import LAYOUTS, AttentionCache
from kv.kvzip import Recorder
from kv.tiers import TierSpec
from speculate import Prefill

REPO = Path(__file__).resolve().parent.parent
TIERS = {"warm_tokens": 1.0, "page_size": 4, "recall_slots": 4}


def contract_members() -> tuple[dict[str, typing.Any], list[str]]:
    """(attribute -> declared type, method names) as kv.contract declares them."""
    hints = typing.get_type_hints(AttentionCache)
    attributes = {name: hints[name] for name in AttentionCache.__annotations__}
    methods = [name for name, value in vars(AttentionCache).items()
               if inspect.isfunction(value) and not name.startswith("_")]
    return attributes, methods


def conforms(value: typing.Any, hint: typing.Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.ClassVar:
        return conforms(value, args[0])
    if hint is typing.Any:
        return True
    if hint is type(None):
        return value is None
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is collections.abc.Callable:
        return callable(value)
    return isinstance(value, origin or hint)


def variants(policy: str) -> list[tuple[str, dict]]:
    """The policy plain and with each optional capability it supports (tiers, streaming positions)."""
    cls = POLICIES[policy]
    out = [("plain", {}), ("8-bit", {"kv_bits": 8}), ("4-bit", {"kv_bits": 4, "kv_group_size": 4})]
    if cls.compresses and cls.supports_tiers:
        out.append(("tiers", {"tiers": TIERS, "layer_budget": "uniform"}))  # recall slots fit every layer
    if cls.supports_pos_shift:
        out.append(("pos-shift", {"pos_shift": True}))
    return out


CASES = [(policy, name, kw) for policy in POLICIES for name, kw in variants(policy)]


@pytest.mark.parametrize("policy,variant,kw", CASES, ids=[f"{p}-{v}" for p, v, _ in CASES])
def test_every_policy_cache_keeps_the_contract(policy, variant, kw):
    cache = small_factory(policy, 2, tiny_args(), 64, 8, kept=32, **kw)(0)
    assert isinstance(cache, AttentionCache)
    attributes, methods = contract_members()
    for name, hint in attributes.items():
        assert conforms(getattr(cache, name), hint), f"{policy} ({variant}): {name} = {getattr(cache, name)!r}"
    for name in methods:  # the model calls them positionally: the contract's parameters, in its order
        theirs = list(inspect.signature(getattr(cache, name)).parameters)
        ours = list(inspect.signature(getattr(AttentionCache, name)).parameters)[1:]
        assert theirs == ours, f"{policy} ({variant}): {name}{tuple(theirs)}, the contract says {tuple(ours)}"
    assert cache.layout in LAYOUTS and (cache.layout == "pool") == cache.shared_pool
    assert cache.pos_shift == (variant == "pos-shift")
    assert (cache.tiers is not None) == (variant == "tiers")
    assert cache.tiers is None or isinstance(cache.tiers, TierSpec)
    if cache.kv_bits and not cache.pos_shift and cache.layout == "uniform":
        assert cache.channel_blocks is not None  # codes read in place, whole-head or half-head groups
    if cache.pos_shift or cache.layout == "pool":
        assert cache.channel_blocks is None


def test_every_cache_the_model_may_hold_is_an_attention_cache():
    """eval's wrappers and the stand-ins that record a prefill too: the model reads their members directly."""
    for cls in (ShadowCaches, MultiCache, Recorder, Prefill):
        assert issubclass(cls, AttentionCache), cls.__name__
    model = tiny_model()
    with pytest.raises(TypeError, match="not a kv.contract.AttentionCache"):
        model.setup_caches(lambda i: torch.nn.Identity())
    model.setup_caches(lambda i: None)  # a plain causal forward
    assert model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 1, model.args.vocab_size)


def test_every_contract_member_has_a_default_and_a_one_line_docstring():
    tree = ast.parse((REPO / "kv" / "contract.py").read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "AttentionCache").body
    documented = set()
    for stmt, after in zip(body, body[1:] + [None]):
        if isinstance(stmt, ast.AnnAssign):
            assert stmt.value is not None, f"{ast.unparse(stmt.target)} has no default"
            assert isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant), ast.unparse(stmt.target)
            assert "\n" not in after.value.value.strip(), ast.unparse(stmt.target)
            documented.add(stmt.target.id)
        elif isinstance(stmt, ast.FunctionDef):
            doc = ast.get_docstring(stmt)
            assert doc and "\n" not in doc, stmt.name
            documented.add(stmt.name)
    attributes, methods = contract_members()
    assert documented == set(attributes) | set(methods)


def probes(path: Path, functions: set[str] | None = None) -> list[str]:
    """getattr / hasattr on anything named like a cache, and .dim() rank checks, in path (only inside the named
    functions, "Class.method" or "function", when given)."""
    tree = ast.parse(path.read_text())
    named = {f"{c.name}.{f.name}": f for c in tree.body if isinstance(c, ast.ClassDef)
             for f in c.body if isinstance(f, ast.FunctionDef)}
    named |= {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    scopes = [tree] if functions is None else [named[name] for name in functions]
    found = []
    for scope in scopes:
        for node in ast.walk(scope):
            if not isinstance(node, ast.Call):
                continue
            probe = isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            if probe and "cache" in ast.unparse(node.args[0]):
                found.append(ast.unparse(node))
            if isinstance(node.func, ast.Attribute) and node.func.attr == "dim" and functions is not None:
                found.append(ast.unparse(node))
    return found


def test_model_and_kernels_never_probe_a_cache():
    assert probes(REPO / "model.py") == []
    calls = {"Attention.forward", "Transformer.hidden", "Transformer.setup_caches"}
    assert probes(REPO / "model.py", calls) == []  # no rank checks either
    assert probes(REPO / "attention.py", {"attend"}) == []  # the layout comes from the cache
