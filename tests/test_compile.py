"""Compilation: the warm-up compiles every function once in a few steps, whatever the sample's length, and
the measured sample compiles nothing; --compile-cache round-trips and never breaks a run; --compile-mode."""

import copy
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
from cache_testing import (
    block_regions,
    generate_tokens,
    recorded_graphs,
    single_thread_fixture,
    small_factory,
    tiny_model,
)
from torch._dynamo.utils import counters

import cache as kvcache
import compilecache
import decode
import generate
import kernels
import memory
from compilecache import guard_free
from decode import Decoder
from kv.budgets import DYNAMIC_CAPACITY_CONFIG
from model import KVFastError

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)

PROMPT_LEN, N_NEW = 24, 48  # positions 24..71: expected_attention's refresh (every 64) runs once, at 64


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # each test compiles the step afresh (new model, new cache buffers)
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("policy, override", [
    ("full", {}), ("h2o", {}), ("scissorhands", {}),  # scissorhands: refresh every drop_interval = 4 steps
    ("expected_attention", {"refresh_interval": 64}),  # its default interval: the warm-up must not wait for it
])
def test_warm_up_compiles_everything_and_the_sample_nothing(policy, override):
    model = tiny_model()
    prompt = torch.randint(0, 64, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    model.setup_caches(small_factory(policy, 2, model.args, PROMPT_LEN, N_NEW, **override))
    eager = generate_tokens(model, prompt, N_NEW)
    decoder = decode.Decoder(model, compile=True, scope="step")
    has_refresh = decoder.refresh_interval() is not None
    compiles_refresh = has_refresh and model.caches[0].compile_refresh  # scissorhands' runs eagerly
    before = graphs()
    steps, refreshes = decoder.warm_up(prompt)
    assert (steps, refreshes) == (decode.WARMUP_STEPS, decode.WARMUP_STEPS if compiles_refresh else 0)
    assert graphs() - before == 1 + compiles_refresh  # the step, and the refresh where the policy compiles one
    warm, recompiles = graphs(), sum(counters["recompiles"].values())
    compiled = generate_tokens(model, prompt, N_NEW, decoder)
    assert graphs() == warm and sum(counters["recompiles"].values()) == recompiles, "the sample compiled"
    assert torch.equal(compiled, eager)  # the warm-up's throwaway state did not leak into the sample
    assert len(set(eager[0].tolist())) > 5


@pytest.mark.parametrize("probe", [False, True])
def test_configuring_compiled_decoding_trusts_the_cpus_vector_flags_unless_told_to_probe(probe, monkeypatch):
    from torch._inductor import config

    if probe:
        monkeypatch.setenv("KVFAST_PROBE_VEC_ISA", "1")
    else:
        monkeypatch.delenv("KVFAST_PROBE_VEC_ISA", raising=False)
    with config.patch({"cpp.vec_isa_ok": None}):  # restored afterwards: other tests compile with it set
        decode.configure_torch(compile=False)  # eager: nothing set
        decode.Decoder(tiny_model(), compile=True)  # building a Decoder sets nothing either
        assert config.cpp.vec_isa_ok is None
        decode.configure_torch(compile=True)
        aten_runs_avx = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        assert config.cpp.vec_isa_ok is (True if aten_runs_avx and not probe else None)


def test_a_compiled_decoder_without_the_torch_settings_is_a_one_line_error():
    """The settings are process-wide, so configure_torch sets them, never a Decoder; one missing is named."""
    from torch._inductor import config

    static = {k: not v for k, v in DYNAMIC_CAPACITY_CONFIG.items()}
    with config.patch(emulate_precision_casts=False), torch._dynamo.config.patch(specialize_float=False, **static):
        decode.Decoder(tiny_model())  # eager: needs none
        for kwargs in ({"compile": True}, {"compile_prefill": True}):
            with pytest.raises(KVFastError, match=r"call decode\.configure_torch\(compile=True\) once"):
                decode.Decoder(tiny_model(), **kwargs)
        decode.configure_torch(compile=True)
        decode.Decoder(tiny_model(), compile=True)
        with pytest.raises(KVFastError, match=r"configure_torch\(compile=True, dynamic_capacity=True\)"):
            decode.Decoder(tiny_model(), compile=True, dynamic_capacity=True)
        decode.configure_torch(compile=True, dynamic_capacity=True)
        assert decode.Decoder(tiny_model(), compile=True, dynamic_capacity=True).dynamic_capacity


def test_default_scope_is_block_on_cpu_and_step_on_cuda():
    assert decode.Decoder(tiny_model(), compile=True).scope == "block"
    assert decode.Decoder(tiny_model()).scope is None  # eager: nothing compiled
    assert (decode.default_compile_scope("cpu"), decode.default_compile_scope("cuda:0")) == ("block", "step")


@pytest.mark.parametrize("policy, tiers", [("h2o", None), ("scissorhands", None), ("expected_attention", None),
                                           ("h2o", {"warm_tokens": 1.0, "page_size": 4, "recall_slots": 4})])
def test_block_scope_compiles_one_block_for_every_layer(policy, tiers):
    """--compile-scope block: one graph per step in which the TransformerBlock is one nested region, traced and
    compiled once for all layers (plus a graph for a compiled refresh: expected_attention's, not scissorhands';
    tiers: the recalling step and the flush); nothing recompiles in the sample; tokens equal eager decoding."""
    model = tiny_model(n_layers=3)
    prompt = torch.randint(0, 64, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(1))
    model.setup_caches(small_factory(policy, 2, model.args, PROMPT_LEN, N_NEW, **({"tiers": tiers} if tiers else {})))
    eager = generate_tokens(model, prompt, N_NEW)
    with recorded_graphs() as recorded:
        decoder = decode.Decoder(model, compile=True, scope="block")
        compiles_refresh = decoder.refresh_interval() is not None and model.caches[0].compile_refresh
        recompiles = sum(counters["recompiles"].values())
        decoder.warm_up(prompt)
        steps = [g for g in recorded if block_regions(g)]
        assert len(recorded) == 1 + compiles_refresh + 2 * bool(tiers)
        assert [block_regions(g) for g in steps] == [1] * (1 + bool(tiers))  # one block, not one per layer
        assert sum(counters["recompiles"].values()) == recompiles
        compiled = generate_tokens(model, prompt, N_NEW, decoder)
        assert len(recorded) == 1 + compiles_refresh + 2 * bool(tiers), "the sample compiled"
    assert sum(counters["recompiles"].values()) == recompiles
    assert torch.equal(compiled, eager)


def test_block_scope_traces_the_block_once_whatever_the_depth():
    """What makes block scope compile fast: dynamo traces the block once, so a deeper model adds one region call
    per layer to the step's graph, where step scope traces every layer's operations again."""
    prompt = torch.randint(0, 64, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    captured = {}
    for scope in ("block", "step"):
        for n_layers in (2, 4):
            torch._dynamo.reset()
            counters.clear()
            model = tiny_model(n_layers=n_layers)
            model.setup_caches(small_factory("h2o", 1, model.args, PROMPT_LEN, N_NEW))
            with recorded_graphs(inductor=False):  # what dynamo traces; Inductor's code is not the claim
                decode.Decoder(model, compile=True, scope=scope).warm_up(prompt)
            captured[scope, n_layers] = counters["stats"]["calls_captured"]
    per_layer = {scope: (captured[scope, 4] - captured[scope, 2]) / 2 for scope in ("block", "step")}
    assert per_layer["block"] <= 2, captured
    assert per_layer["step"] >= 10, captured


# ---- the CLI --------------------------------------------------------------------------------------------
def run_cli(capsys, checkpoint: Path, *argv: str) -> tuple[int, str, str]:
    code = generate.cli(["--checkpoint", str(checkpoint), "--prompt", "Hello there", "--temperature", "0",
                         "--ignore-eos", *argv])
    out, err = capsys.readouterr()
    torch._dynamo.reset()  # the next run builds a new model: compile it afresh, as a new process would
    return code, out, err


def generated_text(out: str) -> str:
    before_separator = out.split("-" * 40)[0].splitlines()
    return "\n".join(line for line in before_separator if not line.startswith("compile "))


def test_warm_up_steps_do_not_grow_with_max_new_tokens(tiny_checkpoint, capsys):
    """expected_attention refreshes every 64 steps: 80 new tokens reach a refresh the warm-up compiled."""
    lines = []
    for n in (8, 80):
        with recorded_graphs(inductor=False):  # the warm-up's steps and graphs are the claim, not Inductor's code
            code, out, err = run_cli(capsys, tiny_checkpoint, "--compile", "--compile-scope", "step",
                                     "--max-new-tokens", str(n), "--cache", "expected_attention", "--cache-budget", "16")
        assert code == 0 and "warning" not in err, err
        lines.append(re.search(r"compile time: [\d.]+ s \((\d+) graphs; (warm-up: .*)\)", out).groups())
        assert "compile mode: default, scope step" in out
    n = decode.WARMUP_STEPS
    assert lines[0] == lines[1] == ("2", f"warm-up: {n} decode steps, {n} refreshes")


def test_compile_cache_round_trip(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """The first run saves what it compiled or found in the local Inductor cache (hits are saved too); the
    second runs against an empty local cache, as on a fresh machine: it loads the file, hits the loaded
    graphs and generates the same tokens."""
    cache_file = tmp_path / "cc.bin"
    argv = ("--compile", "--compile-scope", "step", "--max-new-tokens", "6", "--compile-cache", str(cache_file))
    code, first, err = run_cli(capsys, tiny_checkpoint, *argv)
    assert code == 0 and not err, err
    assert cache_file.read_bytes().startswith(compilecache.MAGIC)
    assert re.search(r"compile cache: .*cold \(nothing loaded\), \d+ artifacts saved", first)

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-inductor-cache"))
    hits = counters["inductor"]["fxgraph_cache_hit"]
    code, second, err = run_cli(capsys, tiny_checkpoint, *argv)
    assert code == 0 and not err, err
    loaded = r"[1-9]\d* artifacts and [1-9]\d* C\+\+ kernels loaded \([1-9]\d* installed\)"
    assert re.search(rf"compile cache: .*: {loaded}, 1 Inductor graphs found", second)
    assert counters["inductor"]["fxgraph_cache_hit"] > hits
    assert generated_text(second) == generated_text(first)


def valid_header(payload: bytes, **change) -> bytes:
    import hashlib

    header = {**compilecache.environment("cpu"), "sha256": hashlib.sha256(payload).hexdigest(),
              "size": len(payload), **change}
    return compilecache.MAGIC + json.dumps(header).encode() + b"\n" + payload


def test_kernels_install_only_inside_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    kernels = [("ab/cabkey.main.so", b"lib"), ("../escape.so", b"x"), ("/abs/x.so", b"x"), ("ab/notes.txt", b"x"),
               ("ab/c/deep.so", b"x")]
    assert compilecache.install_kernels(kernels) == 1
    assert (tmp_path / "inductor" / "ab" / "cabkey.main.so").read_bytes() == b"lib"
    assert not (tmp_path / "escape.so").exists()
    assert compilecache.install_kernels(kernels) == 0  # present: left alone


@pytest.mark.parametrize("case, expected", [
    ("other_torch", "was made for torch '1.0.0'"),
    ("other_device", "was made for device"),
    ("checksum", "is corrupt (checksum mismatch)"),
    ("truncated", "is corrupt"),
    ("garbage", "is not a kvfast compile cache"),
    ("bad_payload", "artifacts cannot be read"),
])
def test_bad_compile_cache_is_one_warning_and_a_normal_run(case, expected, tiny_checkpoint, tmp_path, capsys):
    cache_file = tmp_path / "cc.bin"
    payload = b"\x00" * 8 + b"not torch artifacts"
    cache_file.write_bytes({
        "other_torch": valid_header(payload, torch="1.0.0"),
        "other_device": valid_header(payload, device="cpu elsewhere"),
        "checksum": valid_header(payload)[:-3] + b"xyz",
        "truncated": valid_header(payload)[:-5],
        "garbage": b"\x89garbage\n" * 50,
        "bad_payload": valid_header(payload),
    }[case])
    code, out, err = run_cli(capsys, tiny_checkpoint, "--compile", "--max-new-tokens", "4",
                             "--compile-cache", str(cache_file))
    assert code == 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: compile cache") and expected in lines[0], err
    assert "decode:" in out
    fixed = compilecache.CompileCache(cache_file, "cpu")
    fixed.load()  # rewritten with this run's artifacts: valid now
    assert fixed.n_loaded > 0 and not capsys.readouterr().err


@pytest.mark.parametrize("argv, expected", [
    (["--compile", "--compile-mode", "fast"], "argument --compile-mode: invalid choice: 'fast'"),
    (["--compile-mode", "default"], "--compile-mode needs --compile"),
    (["--compile", "--compile-mode", "reduce-overhead", "--device", "cpu"], "reduce-overhead needs CUDA"),
    (["--compile-cache", "x.bin"], "--compile-cache needs --compile or --compile-prefill"),
])
def test_compile_flag_errors_are_one_line(argv, expected, capsys):
    assert generate.cli(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines


def test_compile_mode_reaches_every_compiled_function(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append((fn.__name__, kw.get("mode") or
                                                                          kw.get("options"))) or fn)
    model = tiny_model()
    decoder = decode.Decoder(model, compile=True, mode="max-autotune-no-cudagraphs", scope="step")
    mode = "max-autotune-no-cudagraphs"  # the tiers' recall step and flush are compiled with it too
    # what runs once per token gets the mode as Inductor options, with the CPU step's own (a C++ wrapper)
    options = {"max_autotune": True, "coordinate_descent_tuning": True, **decode.CPU_WHOLE_STEP_OPTIONS}
    assert options["cpp_wrapper"] and not options["size_asserts"]
    assert seen == [("decode_step", options), ("decode_step_recall", options),
                    ("caches_work_refresh", mode), ("caches_work_flush", mode)]
    assert decoder.mode == "max-autotune-no-cudagraphs"
    seen.clear()
    decode.Decoder(model, compile=True, mode=mode, scope="block")
    options = {"max_autotune": True, "coordinate_descent_tuning": True, **decode.CPU_STEP_OPTIONS}
    assert "cpp_wrapper" not in options  # Inductor's C++ wrapper cannot call a nested region
    per_token = ("decode_step_run_block", "decode_step_recall_run_block", "run_layer", "logits_and_sample")
    assert sorted(seen, key=str) == sorted([(name, options) for name in per_token] +  # the layerwise step's too
                                           [(name, mode) for name in ("cache_work_refresh", "cache_work_flush")],
                                           key=str)
    assert decode.Decoder(model, compile=True).mode == "default"  # CPU; reduce-overhead on CUDA
    assert decode.step_compile_options("reduce-overhead", "cuda:0", "step") == {"mode": "reduce-overhead"}


def test_new_flags_have_help(capsys):
    with pytest.raises(SystemExit):
        generate.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--compile-mode {default,max-autotune-no-cudagraphs,reduce-overhead} torch.compile mode" in out
    assert "--compile-cache FILE load compiled code from FILE" in out


def test_block_scope_compiles_runs_that_differ_in_ints_and_floats_in_one_process():
    """Runs in one process (eval's cells, the tests) whose batch size, capacity or an eps differ: dynamo's
    automatic dynamic shapes would make those symbolic, which a nested region cannot stamp out per layer; block
    scope compiles them static, each run equal to eager."""
    torch._dynamo.reset()
    for seed, (batch, eps, policy) in enumerate([(1, 1e-5, "h2o"), (2, 1e-6, "h2o"), (2, 1e-6, "tova")]):
        model = tiny_model(seed=seed)
        for layer in model.layers:
            layer.attention_norm.eps = layer.ffn_norm.eps = eps
        model.setup_caches(small_factory(policy, batch, model.args, PROMPT_LEN + seed, N_NEW))
        prompt = torch.randint(0, 64, (batch, PROMPT_LEN + seed), generator=torch.Generator().manual_seed(seed))
        eager = generate_tokens(model, prompt, N_NEW)
        decoder = decode.Decoder(model, compile=True, scope="block")
        assert torch.equal(generate_tokens(model, prompt, N_NEW, decoder), eager), (batch, eps, policy)


def test_later_steps_skip_guards_but_new_caches_still_recompile(monkeypatch):
    """Decoder.decode runs a call's first two plain steps with dynamo's guards and afterwards calls the compiled
    code those guards chose directly (compilecache.guard_free, picked by evaluating every entry's guards on the
    third step's inputs); caches of another shape set up between calls must still be caught by the guarded steps
    (a stale graph over the old shapes would be silent wrong output), and every call equals eager decoding."""
    unguarded = []

    def spy(compiled, *args):
        code = guard_free(compiled, *args)
        assert code is not None, "no single compiled entry passes its guards"
        unguarded.append(0)

        def step(*args):
            unguarded[-1] += 1
            return code(*args)
        return step

    monkeypatch.setattr(decode, "guard_free", spy)
    model = tiny_model()
    decoder = decode.Decoder(model, compile=True)
    start = graphs()
    for prompt_len, budget in ((24, None), (40, None), (24, 20)):  # capacities 72, 88, 20
        prompt = torch.randint(0, 64, (1, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        model.setup_caches(kvcache.make_cache_factory("h2o" if budget else "full", 1, model.args, prompt_len,
                                                      N_NEW, budget=budget))
        before = len(unguarded)
        compiled = generate_tokens(model, prompt, N_NEW, decoder)
        assert unguarded[before:] == [N_NEW - 3]  # steps 3.. of the call, one lookup for the call
        assert torch.equal(compiled, generate_tokens(model, prompt, N_NEW))
    assert graphs() - start == 3  # one graph per cache shape, each compiled by a guarded step


@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_compiled_prefill_is_eager_and_one_graph_for_every_prompt_length(weights):
    """--compile-prefill: one dynamic-shape graph serves prompts on both sides of every row threshold of
    kernels.linear_path (its products are ATen's GEMMs, kernels.dynamic_rows), with eager's logits."""
    from numerics import assert_numerically_close, model_depth

    import quantize

    model = quantize.quantize_model(tiny_model(), weights, 16) if weights != "fp32" else tiny_model()
    lengths = (3, 17, 300)  # under MAX_REDUCTION_ROWS, just over it, far over
    model.setup_caches(kvcache.make_cache_factory("full", 1, model.args, max(lengths), 8))
    logits_of = decode.compiled_prompt_logits()
    counts = []
    # the last row's logits take the one-token kernels, as in a decode step: their fp32 reductions here (the
    # integer products' Q8_0 activations are tested in test_int_kernels)
    with kernels.integer_products("nowhere"), torch.inference_mode():
        for n in lengths:
            idx = torch.randint(0, model.args.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            eager = decode.prompt_logits(model, idx, None, None)
            compiled = logits_of(model, idx, None, None)
            assert_numerically_close(compiled, eager, depth=model_depth(model.args, n))
            counts.append((graphs(), sum(counters["recompiles"].values())))
        assert counts[0] == counts[-1], f"prompt lengths {lengths} compiled more than once: {counts}"
        # and the Decoder's prefill around it (its heap trim stays outside the graph)
        token = decode.Decoder(model, compile_prefill=True).prefill(model, idx, 0.0, None)
        assert token.item() == int(eager[0, -1].argmax())
        assert (graphs(), sum(counters["recompiles"].values())) == counts[0]


@pytest.mark.parametrize("policy, cls", [("adakv", "AdaKVCache"), ("hybrid", "HybridCache")])
def test_compiled_prefill_refuses_per_head_pools_in_one_line(policy, cls, tiny_checkpoint, capsys):
    """A pool's per-head token counts follow the scores: no dynamic-shape graph can hold them."""
    code, _, err = run_cli(capsys, tiny_checkpoint, "--compile-prefill", "--cache", policy, "--cache-budget", "80")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"--compile-prefill cannot compile {cls}'s prompt compression" in lines[0]


@pytest.mark.skipif(not memory.huge_pages_enabled(), reason="transparent huge pages are off on this machine")
@pytest.mark.parametrize("weights", ["fp32", "int8", "int4"])
def test_weights_move_to_huge_pages_with_their_values_and_the_caches_stay(weights):
    from test_generate import tiny_model as quantizable_model  # widths that int4's groups of 32 divide

    import quantize

    model = quantize.quantized_copy(quantizable_model(), weights)
    model.setup_caches(small_factory("full", 1, model.args, 8, 8))
    unplaced = copy.deepcopy(model)
    kernels.tile_weights([m for m in model.modules() if hasattr(m, "tiled")])  # placed as a Decoder places them
    kernels.tile_weights([m for m in unplaced.modules() if hasattr(m, "tiled")])
    weights_of = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if "kv_cache" not in n}
    before = {n: t.data_ptr() for n, t in [*model.named_parameters(), *model.named_buffers()]}

    moved = memory.weights_on_huge_pages(model, min_bytes=0)

    assert moved >= sum(t.nbytes for t in weights_of.values())
    ptrs = sorted(t.data_ptr() for t in weights_of.values())
    assert ptrs[0] % memory.HUGE_PAGE == 0 and ptrs[-1] - ptrs[0] < moved  # one 2 MB-aligned region
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert (t.data_ptr() == before[name]) == ("kv_cache" in name), name  # the caches' buffers stay
    assert memory.weights_on_huge_pages(model, min_bytes=0) == 0  # already there
    prompt = torch.randint(0, model.args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    # compiled in the CPU's default (block) scope, whose regions take the weights as inputs, and eager
    assert torch.equal(generate_tokens(model, prompt, 6, Decoder(model, compile=True)),
                       generate_tokens(unplaced, prompt, 6))
    with torch.inference_mode():
        for m in (model, unplaced):
            m.setup_caches(lambda i: None)
        assert torch.equal(model(prompt), unplaced(prompt))


@pytest.mark.skipif(not memory.huge_pages_enabled(), reason="transparent huge pages are off on this machine")
@pytest.mark.parametrize("kv", [{}, {"kv_bits": 16, "kv_float": "float16"}, {"kv_bits": 8}])
def test_cache_buffers_on_huge_pages_decode_as_torch_zeros(kv, monkeypatch):
    from test_generate import tiny_model

    model = tiny_model()
    placed = copy.deepcopy(model)
    model.setup_caches(small_factory("full", 1, model.args, 8, 8, **kv))  # tiny: torch.zeros
    monkeypatch.setattr(memory, "MIN_HUGE_PAGE_BUFFER", 0)
    monkeypatch.setattr(memory, "_slab", [None, 0, 0])
    placed.setup_caches(small_factory("full", 1, model.args, 8, 8, **kv))

    buffers = [getattr(c, n) for c in placed.caches for n in c.kv_buffers()]
    assert buffers[0].data_ptr() % memory.HUGE_PAGE == 0  # the slab's first buffer starts a 2 MB page
    spans = sorted((b.data_ptr(), b.data_ptr() + b.nbytes) for b in buffers)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))  # none overlaps another
    assert len({b.untyped_storage().data_ptr() for b in buffers}) == len(buffers)  # a storage each
    assert all(not b.any() for b in buffers)
    prompt = torch.randint(0, model.args.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(generate_tokens(placed, prompt, 6, Decoder(placed, compile=True)),
                       generate_tokens(model, prompt, 6, Decoder(model, compile=True)))


def test_small_or_unplaced_buffers_are_torch_zeros(monkeypatch):
    monkeypatch.setattr(memory, "_slab", [None, 0, 0])
    small = memory.zeros_on_huge_pages((4, 8), torch.float16)
    monkeypatch.setattr(memory, "huge_pages_enabled", lambda: False)
    big = memory.zeros_on_huge_pages((1, 2, 1024, 64), torch.float32)
    assert small.shape == (4, 8) and small.dtype == torch.float16 and not small.any()
    assert big.shape == (1, 2, 1024, 64) and big.dtype == torch.float32 and not big.any()
    assert memory._slab[0] is None  # no mapping was made
