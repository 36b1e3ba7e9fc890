"""Cache configuration from the command line: presets, flag validation (bad configs fail fast with one line),
and the figures generate.py prints per run."""

import argparse

import pytest
import torch
from cache_testing import single_thread_fixture, tiny_args, tiny_model

import cache as kvcache
import generate

_one_thread = pytest.fixture(autouse=True)(single_thread_fixture)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # about 60 tokens with the tiny tokenizer


def run(capsys, checkpoint, *argv):
    code = generate.cli(["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--max-new-tokens", "12",
                         "--temperature", "0", "--ignore-eos", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("argv, expected", [
    (["--cache", "nosuch"], "unknown cache policy 'nosuch'"),
    (["--cache-config", "nosuch"], "unknown cache preset 'nosuch'"),
    (["--cache", "h2o", "--prompt-compression", "nosuch"], "unknown prompt compressor 'nosuch'"),
    (["--cache", "knorm", "--gqa-reduce", "max"], "--gqa-reduce is not used by --cache knorm"),
    (["--cache", "h2o", "--history-window", "5"], "--history-window is not used by --cache h2o"),
    (["--cache-config", "h2o", "--obs-window", "5"], "--obs-window is not used by --cache h2o"),
    (["--cache-config", "scissorhands", "--cache", "h2o"], "--history-window (set by the --cache-config"),
    (["--cache-budget", "0.5"], "--cache-budget is not used by --cache full"),
    (["--cache", "h2o", "--pyramid-beta", "10"], "--pyramid-beta is only used with --layer-budget pyramid"),
    (["--cache", "h2o", "--layer-budget", "wedge"], "--layer-budget must be one of uniform, pyramid, funnel"),
    (["--cache", "snapkv", "--pool", "min"], "--pool must be one of max, avg"),
    (["--cache", "snapkv", "--pool-kernel", "4"], "--pool-kernel must be odd"),
    (["--cache", "h2o", "--recent-window", "2.5"], "--recent-window of 1 or more is a number of tokens"),
    (["--cache", "h2o", "--cache-budget", "-3"], "--cache-budget must be > 0"),
    (["--cache", "scissorhands", "--cache-budget", "9"], "needs: n_sinks (0) + recent_window (10)"),
    (["--cache", "window", "--cache-budget", "4"], "window needs: n_sinks (4) + recent_window (1)"),
    (["--cache", "h2o", "--n-sinks", "4", "--recent-window", "8", "--cache-budget", "11"],
     "h2o needs: n_sinks (4) + recent_window (8)"),
    (["--cache", "snapkv", "--cache-budget", "40"], "the n_sinks (0) + obs_window (32) that snapkv prompt"),
    (["--cache", "scissorhands", "--cache-budget", "30"], "obs_window (32) that snapkv prompt compression"),
    (["--cache", "snapkv", "--cache-budget", "10"], "it needs more than --max-new-tokens (12)"),
    (["--cache", "scissorhands", "--cache-budget", "40", "--obs-window", "8", "--drop-interval", "35"],
     "--drop-interval 35 is larger than the budget allows: at most 31 slots"),
    (["--cache", "window", "--cache-budget", "30", "--recent-window", "20"],
     "give --cache-budget or --recent-window, not both"),
    (["--kv-bits", "3"], "--kv-bits must be 8, 4 or 16, got 3"),
    (["--kv-group-size", "16"], "--kv-group-size is only used with --kv-bits 8 or 4"),
    (["--kv-bits", "16", "--kv-group-size", "16"], "--kv-group-size is only used with --kv-bits 8 or 4"),
    (["--kv-float", "bfloat16"], "--kv-float is only used with --kv-bits 16"),
    (["--kv-bits", "16", "--kv-float", "fp8"], "--kv-float must be one of auto, float16, bfloat16, got 'fp8'"),
    (["--cache", "h2o", "--kv-bits", "8", "--kv-group-size", "12"],
     "--kv-group-size 12 does not divide the head dimension 32"),
])
def test_bad_configs_fail_with_one_line(argv, expected, tiny_checkpoint, capsys):
    code, out, err = run(capsys, tiny_checkpoint, *argv)
    assert code == 2, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], err


@pytest.mark.parametrize("preset", kvcache.available_presets())
def test_every_preset_runs(preset, tiny_checkpoint, capsys):
    code, out, err = run(capsys, tiny_checkpoint, "--cache-config", preset)
    assert code == 0, err
    assert f"cache: {preset}" in out and "compression ratio" in out


@pytest.mark.parametrize("preset", kvcache.available_presets())
def test_every_preset_loads_and_names_only_known_parameters(preset):
    """Presets are optional (a policy's defaults are declared in its class): each one there names a registered
    policy and only parameters that the policy or its prompt compressor declares."""
    values = kvcache.load_preset(preset)
    assert values["cache"] in kvcache.POLICIES
    assert set(values) <= set(kvcache.PARAMS) | set(kvcache.GLOBALS)
    resolved = kvcache.CacheSpec.from_args(namespace(cache_config=preset)).resolve()[2]
    given = {k: v for k, v in values.items() if k in kvcache.PARAMS}
    assert {k: resolved[k] for k in given} == given


def test_a_policy_without_a_preset_runs(tiny_checkpoint, capsys):
    code, out, err = run(capsys, tiny_checkpoint, "--cache", "keydiff", "--cache-budget", "0.5")
    assert code == 0, err
    assert "cache: keydiff + keydiff prompt compression" in out and "compression ratio" in out


def test_flags_override_the_preset_and_the_report_adds_up(tiny_checkpoint, capsys):
    code, out, err = run(capsys, tiny_checkpoint, "--cache-config", "scissorhands", "--cache-budget", "24",
                         "--recent-window", "4", "--obs-window", "4", "--history-window", "16",
                         "--drop-interval", "6", "--batch-size", "2")
    assert code == 0, err
    assert ("cache: scissorhands + snapkv prompt compression, capacity per layer 24 slots; drop-interval 6, "
            "gqa-reduce mean, history-window 16, n-sinks 0, recent-window 4") in out
    report = next(line for line in out.splitlines() if line.startswith("cache: scissorhands, capacity"))
    seen = int(report.split("tokens seen ")[1].split(",")[0])
    assert "kept 24.0" in report and f"evicted {seen - 24:.1f}" in report


def test_preset_files_are_validated(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("cache: h2o\nrecent-window: 0.25\ncache_budget: 0.3\n")
    args = argparse.Namespace(cache_config=str(good), cache=None, prompt_compression=None, cache_budget=None,
                              layer_budget=None, pyramid_beta=None, **{k: None for k in kvcache.PARAMS})
    factory = kvcache.cache_factory_from_args(args, 1, tiny_args(), 80, 20)
    assert factory.capacities == [30, 30] and factory.layer_values[0]["recent_window"] == 7
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: h2o\nrecnt_window: 3\n")
    with pytest.raises(kvcache.KVFastError, match="unknown keys"):
        kvcache.load_preset(str(bad))


def namespace(**given) -> argparse.Namespace:
    """Parsed arguments with only `given` set, the rest None (not given)."""
    names = ("cache_config", *kvcache.GLOBALS, *kvcache.PARAMS)
    return argparse.Namespace(**{k: given.get(k) for k in names})


def test_a_command_line_budget_replaces_the_presets_window_only_for_window(tmp_path):
    preset = tmp_path / "narrow.yaml"
    preset.write_text("cache: h2o\nrecent_window: 0.25\ncache_budget: 0.5\n")  # h2o's default is 0.5
    args = namespace(cache_config=str(preset), cache_budget=40)
    assert kvcache.CacheSpec.from_args(args).params["recent_window"] == 0.25
    factory = kvcache.cache_factory_from_args(args, 1, tiny_args(), 100, 20)
    assert factory.capacities == [40, 40] and factory.layer_values[0]["recent_window"] == 10
    # window: capacity = n_sinks + recent window, so the budget sets the window (no "give one, not both")
    args = namespace(cache_config="window", cache_budget=40)
    assert "recent_window" not in kvcache.CacheSpec.from_args(args).params
    factory = kvcache.cache_factory_from_args(args, 1, tiny_args(), 100, 20)
    assert factory.capacities == [40, 40] and factory.layer_values[0]["recent_window"] == 36
    # the policy that counts is the one finally chosen: the h2o preset switched to window on the command line
    args = namespace(cache_config=str(preset), cache="window", cache_budget=40, prompt_compression="window")
    assert "recent_window" not in kvcache.CacheSpec.from_args(args).params


def test_help_lists_every_flag():
    parser = argparse.ArgumentParser()
    kvcache.add_cache_args(parser)
    text = parser.format_help()
    for flag in ("--cache", "--prompt-compression", "--cache-budget", "--layer-budget", "--pyramid-beta",
                 "--cache-config", "--kv-bits", "--kv-group-size", *(f"--{name.replace('_', '-')}" for name in kvcache.PARAMS)):
        assert flag in text


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_report_counts_buffers(kv_bits):
    model = tiny_model()
    factory = kvcache.make_cache_factory("h2o", 2, model.args, 40, 10, budget=16, kv_bits=kv_bits)
    model.setup_caches(factory)
    with torch.inference_mode():
        model(torch.randint(0, 64, (2, 40)))
        for t in range(40, 49):
            model(torch.randint(0, 64, (2, 1)), torch.tensor([t]))
    r = kvcache.cache_report(model.caches)
    a = model.args
    # fp32 K/V, or packed 4-bit codes + an fp32 scale and zero point (one group per token and head)
    per_slot = a.head_dim * 4 if kv_bits is None else a.head_dim // 2 + 2 * 4
    assert (r["seen"], r["kept"], r["evicted"]) == (49, 16, 33)
    assert r["kv_bytes"] == a.n_layers * 2 * 2 * a.n_kv_heads * 16 * per_slot
    assert r["full_kv_bytes"] == a.n_layers * 2 * 2 * a.n_kv_heads * 49 * a.head_dim * 4  # fp32, every token
    assert r["compression_ratio"] == pytest.approx(49 * a.head_dim * 4 / (16 * per_slot))


def test_default_drop_interval_fits_the_budget():
    """The default m = 0.5 B is clamped to what is evictable; an explicit number of steps is checked instead."""
    factory = kvcache.make_cache_factory("scissorhands", 1, tiny_args(), 100, 50, budget=12, obs_window=4)
    assert factory.layer_values[0]["drop_interval"] == 12 - 10 + 1
    factory = kvcache.make_cache_factory("scissorhands", 1, tiny_args(), 100, 50, budget=200)
    assert factory.layer_values[0]["drop_interval"] == 75  # half of the 150 slots that suffice here
