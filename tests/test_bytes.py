"""The one byte accounting (kv.report): what a cache holds is every buffer's bytes, for plain, 16-bit, quantized,
tiered and pool caches alike; counted on the meta device it equals the real buffers; the byte budget
(eval.py --budget-unit bytes) gives the most slots that fit, and the records carry the share of full's bytes."""

from __future__ import annotations

import pytest
import torch
from cache_testing import single_thread_fixture, tiny_args
from test_eval import PROSE, run_eval

import cache as kvcache
from evals import report
from kv.report import byte_parts, bytes_of, cache_bytes, full_kv_bytes, slots_for_bytes
from kv.tiers import Tiers
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

ARGS = tiny_args(n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
CASES = {  # name: (policy, keywords)
    "plain": ("h2o", {}),
    "float16": ("snapkv", {"kv_bits": 16, "kv_float": "float16"}),
    "8-bit": ("window", {"kv_bits": 8}),
    "4-bit": ("h2o", {"kv_bits": 4, "kv_group_size": 8}),
    "tiered": ("window", {"tiers": {"warm_tokens": 1.0, "page_size": 4, "recall_slots": 8}}),
    "tiered 8-bit": ("h2o", {"kv_bits": 8, "tiers": {"warm_tokens": 0.5, "page_size": 4, "recall_slots": 8}}),
    "pool": ("adakv", {}),
    "pool 4-bit": ("kvzip", {"kv_bits": 4}),
    "tiered pool": ("hybrid", {"tiers": {"warm_tokens": 1.0, "page_size": 4, "recall_slots": 4}}),
}


def factory(policy: str, budget: float | None = 0.5, batch: int = 2, **kw) -> kvcache.CacheFactory:
    return kvcache.make_cache_factory(policy, batch, ARGS, 96, 32, budget=budget, **kw)


@pytest.mark.parametrize("case", CASES)
def test_cache_bytes_is_the_direct_sum_of_every_buffer(case):
    policy, kw = CASES[case]
    f = factory(policy, **kw)
    caches = [f(i) for i in range(ARGS.n_layers)]
    direct = sum(b.numel() * b.element_size() for c in caches for b in c.buffers())
    assert cache_bytes(caches) == direct
    for c in caches:
        parts = byte_parts(c)
        assert sum(parts.values()) == sum(b.nbytes for b in c.buffers())
        assert parts["kv"] == c.physical_bytes()  # K/V at its bits, scales and zero points included
        if isinstance(c, Tiers):
            assert parts["warm"] >= c.warm_bytes() > 0  # pages + their positions, bounds, staging, counters
        else:
            assert parts["warm"] == 0
        assert parts["positions"] >= c.slot_pos.nbytes
    assert sum(bytes_of(f).values()) == direct  # shapes on the meta device: nothing allocated, same count
    assert kvcache.cache_report(caches)["cache_bytes"] == direct


def test_formats_hold_what_their_bits_say():
    plain, half, q8, q4 = (cache_bytes([factory("window", **kw)(0)]) for kw in
                           ({}, {"kv_bits": 16, "kv_float": "bfloat16"}, {"kv_bits": 8}, {"kv_bits": 4}))
    kv = [byte_parts(factory("window", **kw)(0))["kv"] for kw in ({}, {"kv_bits": 16}, {"kv_bits": 8})]
    assert kv[0] == 2 * kv[1]  # fp32 vs 16-bit
    assert plain > half > q8 > q4
    # the full cache's K/V in the compute dtype is the reference: a full cache holds it plus its positions
    full = factory("full", None)
    held = sum(bytes_of(full).values())
    reference = full_kv_bytes(ARGS, 2, 96 + 32, torch.float32)
    assert sum(byte_parts(full(i))["kv"] for i in range(ARGS.n_layers)) == reference < held


@pytest.mark.parametrize("policy, kw, share", [("h2o", {}, 0.0), ("kvzip", {"kv_bits": 4}, 0.0),
                                               ("tova", {"kv_bits": 8}, 0.0),
                                               ("window", {"tiers": {"page_size": 4, "recall_slots": 0.5}}, 0.5)])
@pytest.mark.parametrize("fraction", [0.2, 0.4])
def test_slots_for_bytes_gives_the_most_slots_that_fit(policy, kw, share, fraction):
    tiers = kw.get("tiers")

    def make(slots, warm):
        extra = {**kw, "tiers": {**tiers, "warm_tokens": warm}} if tiers else kw
        return factory(policy, slots, batch=1, **extra)

    full = full_kv_bytes(ARGS, 1, 128, torch.float32)
    slots, warm = slots_for_bytes(make, fraction, full, 128, share, 4)
    assert (warm is not None) == bool(tiers)
    assert sum(bytes_of(make(slots, warm)).values()) <= fraction * full
    if slots < 128:  # one more slot would not fit (or the policy refuses it)
        try:
            assert sum(bytes_of(make(slots + 1, warm)).values()) > fraction * full
        except KVFastError:
            pass
    if tiers:
        assert bytes_of(make(slots, warm))["warm"] <= share * fraction * full


def test_a_budget_too_small_for_the_policy_is_one_line():
    def make(slots, warm):
        return factory("h2o", slots, batch=1, recent_window=32)

    with pytest.raises(KVFastError, match="does not fit in 0.01 of the full cache's bytes"):
        slots_for_bytes(make, 0.01, full_kv_bytes(ARGS, 1, 128, torch.float32), 128, what="h2o")


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "prose.txt"
    path.write_text("\n\n".join(PROSE * 4))
    return path


def test_eval_records_bytes_and_byte_budgets(text_file, tmp_path):
    flags = ["--tasks", "niah_single", "--lengths", "600", "--samples", "2", "--answer-room", "16", "--ppl-every", "64",
             "--policies", "window", "window+kv4", "h2o+warm", "--haystack", str(text_file)]
    slots = run_eval(text_file, tmp_path / "slots", *flags, "--budgets", "0.25")
    by = {r["policy"]: r for r in slots}
    # full's fp32 K/V plus an int64 position per slot and KV head (the tiny model's head_dim is 8)
    assert by["full"]["bytes_frac"] == pytest.approx(1 + 8 / (2 * 8 * 4), abs=1e-3)
    assert by["window+kv4"]["bytes_frac"] < by["window"]["bytes_frac"] < 0.3  # the same slots, fewer bytes
    assert by["h2o+warm"]["bytes_frac"] > by["window"]["bytes_frac"]  # the warm store is counted
    budgeted = run_eval(text_file, tmp_path / "bytes", *flags, "--budgets", "0.25", "--budget-unit", "bytes")
    by = {r["policy"]: r for r in budgeted}
    for name in ("window", "window+kv4", "h2o+warm"):
        assert 0.2 < by[name]["bytes_frac"] <= 0.25, name
    assert by["window+kv4"]["slots"] > 2 * by["window"]["slots"]  # 4-bit codes buy more tokens for the bytes
    assert by["h2o+warm"]["warm_tokens"] > 0
    table = report.summary(budgeted, {"budget_unit": "bytes"})
    assert "| policy | budget | mode | bytes % |" in table and "the most bytes a combo's caches may hold" in table


def test_bad_byte_budget_flags_are_one_line(capsys):
    import eval as ev_mod

    for flags, message in ((["--budget-unit", "bytes", "--budgets", "64"], "fraction of the full cache's bytes"),
                           (["--warm-share", "1.5"], "--warm-share"), (["--policies", "full+kv4"], "reference"),
                           (["--policies", "h2o+kv3"], "not a K/V format")):
        assert ev_mod.cli(flags) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("mode", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_steps_weight_bytes_read_one_row_of_an_untied_embedding(mode, tied):
    """The bandwidth floor's weights (benchmarks, generate.py's GB/s): a tied table is the head, read whole; an
    untied one gives a step only its token's row, so counting it whole would inflate the floor's share."""
    import quantize
    from model import ModelArgs, Transformer

    args = ModelArgs(**{**tiny_args(n_layers=2).__dict__, "dim": 64, "intermediate_size": 96, "vocab_size": 512,
                        "tie_embeddings": tied})
    model = quantize.quantized_copy(Transformer(args).eval(), mode)
    table = sum(t.numel() * t.element_size() for t in (*model.tok_embeddings.parameters(),
                                                        *model.tok_embeddings.buffers()))
    assert table >= 512 * 64  # int8 codes at least
    assert model.weight_bytes() == sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                                       if not n.startswith("rope_") and ".kv_cache." not in n)
    expected = model.weight_bytes() if tied else model.weight_bytes() - table + table // 512
    assert model.weight_bytes(step=True) == expected
