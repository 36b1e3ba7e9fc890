"""scripts/peer_kvpress.py without kvpress: argument errors, the budget mapping (kvfast keeps exactly
kvpress's int(S (1 - r)) context tokens per KV head), the install failure line, merging the worker's lines,
the tables."""

from __future__ import annotations

import json
import subprocess

import pytest

import cache as kvcache
from evals import tasks
from model import KVFastError, ModelArgs
from scripts import peer_kvpress as peer
from scripts import peer_kvpress_tables as tables
from scripts import peer_kvpress_worker as worker


# ---- arguments ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--presses", "snapkv", "h2o"], "unknown press 'h2o'"),
    (["--ratios", "0"], "--ratios: 0 is not in (0, 1)"),
    (["--ratios", "1"], "--ratios: 1 is not in (0, 1)"),
    (["--ratios", "0.5", "nan"], "--ratios: nan is not in (0, 1)"),
    (["--lengths", "64"], "--lengths must be at least 128"),
    (["--limit", "0"], "--limit must be > 0"),
    (["--task", "ppl"], "unknown task 'ppl'"),
    (["--sides", "vllm"], "invalid choice: 'vllm'"),
])
def test_bad_arguments(argv: list[str], message: str) -> None:
    with pytest.raises(KVFastError, match=message.replace("(", r"\(").replace(")", r"\)")):
        peer.parse_args(argv)


def test_cli_error_is_one_line(capsys: pytest.CaptureFixture) -> None:
    assert peer.cli(["--presses", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: unknown press 'nope'")


def test_arguments_normalised() -> None:
    args = peer.parse_args(["--ratios", "0.75", "0.5", "0.75", "--presses", "knorm", "knorm", "--limit", "2"])
    assert args.ratios == [0.5, 0.75] and args.presses == ["knorm"] and args.n == 2


# ---- budgets -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("S, ratio, kept", [(2014, 0.5, 1007), (2014, 0.75, 503), (4061, 0.75, 1015),
                                            (1000, 0.999, 1), (3, 0.9, 1)])
def test_kept_tokens_is_kvpress_rule(S: int, ratio: float, kept: int) -> None:
    assert peer.kept_tokens(S, ratio) == kept == max(1, int(S * (1 - ratio)))


def available_methods() -> list[str]:
    out = []
    for name, m in peer.METHODS.items():
        try:
            peer.our_params(m)
        except peer.Unavailable:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("name", available_methods())
@pytest.mark.parametrize("ratio", [0.5, 0.75])
def test_budget_keeps_exactly_kvpress_count(name: str, ratio: float) -> None:
    """The factory the peer check builds keeps int(S (1 - r)) context slots in every layer and makes room for
    the question and the answer on top, so nothing is evicted after the prompt."""
    margs = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=256,
                      intermediate_size=128, max_seq_len=4096)
    S, Q, room = 2014, 34, 64
    budget, max_new, kept = peer.our_budget(S, Q, ratio, room)
    assert max_new == Q + room and budget == kept + max_new
    params, _ = peer.our_params(peer.METHODS[name])
    f = kvcache.make_cache_factory(peer.OUR_POLICY, 1, margs, S, max_new, budget=budget,
                                   prompt_compression=peer.METHODS[name].compressor, **params)
    assert f.prompt_capacities == [kept] * margs.n_layers
    assert f.capacities == [kept + max_new] * margs.n_layers
    assert not kvcache.POLICIES[peer.OUR_POLICY].evicts


def test_method_parameters_are_kvfast_flags() -> None:
    """Every kvfast parameter the peer check sets is a known method flag (a typo would be dropped)."""
    for name in available_methods():
        params, missing = peer.our_params(peer.METHODS[name])
        assert not missing, (name, missing)
        assert set(params) <= set(kvcache.PARAMS)


# ---- the peer environment ----------------------------------------------------------------------------------
def test_install_failure_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")  # exists: only pip runs

    def fake_run(cmd, **kwargs):
        assert "kvpress==0.5.5" in cmd and "torch==2.13.0" in cmd
        err = ("Looking in indexes: ...\n\nERROR: Could not find a version that satisfies the requirement "
               "kvpress==0.5.5\n")
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(peer.subprocess, "run", fake_run)
    with pytest.raises(KVFastError) as e:
        peer.ensure_peer_env(env)
    assert "\n" not in str(e.value) and "kvpress==0.5.5" in str(e.value)
    assert not (env / ".kvfast-installed").exists()
    monkeypatch.setattr(peer, "DEFAULT_ENV", env)
    assert peer.cli(["--peer-env", str(env), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot install kvpress==0.5.5 into") and err.count("\n") == 1


def test_installed_env_is_reused(tmp_path, monkeypatch) -> None:
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    (env / ".kvfast-installed").write_text("\n".join(peer.KVPRESS_REQUIREMENTS) + "\n")
    monkeypatch.setattr(peer.subprocess, "run", lambda *a, **k: pytest.fail("pip ran again"))
    assert peer.ensure_peer_env(env) == env / "bin" / "python"


# ---- merging the worker's lines ----------------------------------------------------------------------------
class Words:
    stop_ids = (0,)

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def test_merge_scores_and_checks_ids(tmp_path) -> None:
    args = peer.parse_args(["--out", str(tmp_path), "--task", "niah_single", "--limit", "1"])
    p = tasks.Prompt("niah_single", 2048, 0, [5, 6, 7], [8, 9], ["11"])
    store = peer.Store(tmp_path, {"x": 1}, overwrite=False)
    line = {"uid": p.uid, "key": "knorm|0.5", "ids_hash": worker.ids_hash(p.context, p.question),
            "tokens": [11, 12, 0, 13], "kept": 1.0, "prefill_s": 1.0, "time_s": 2.0, "press_params": {},
            "versions": {}}
    path = tmp_path / "lines.jsonl"
    path.write_text(json.dumps(line) + "\n" + '{"uid": "cut sho')  # a crash leaves half a line
    assert peer.merge_kvpress(path, args, [p], Words(), store) == 1
    r = store.records[peer.record_key("kvpress", "niah_single", 2048, 0, "knorm", 0.5)]
    assert r["prediction"] == "11 12" and r["score"] == 1.0 and r["tokens"] == [11, 12]
    path.write_text(json.dumps({**line, "ids_hash": "0" * 16}) + "\n")
    with pytest.raises(KVFastError, match="hash mismatch"):
        peer.merge_kvpress(path, args, [p], Words(), store)


def test_store_refuses_other_configuration(tmp_path) -> None:
    store = peer.Store(tmp_path, {"seed": 0}, overwrite=False)
    store.save()
    with pytest.raises(KVFastError, match=r"differs in \['seed'\]"):
        peer.Store(tmp_path, {"seed": 1}, overwrite=False)
    assert peer.Store(tmp_path, {"seed": 1}, overwrite=True).records == {}


# ---- tables ------------------------------------------------------------------------------------------------
def rec(side: str, method: str, ratio: float | None, index: int, score: float, tokens: list[int],
        time_s: float = 1.0) -> dict:
    return {"side": side, "task": "niah_multikey", "length": 2048, "index": index, "method": method,
            "ratio": ratio, "score": score, "tokens": tokens, "kept": 1007.0 if ratio else 2014.0,
            "time_s": time_s, "prefill_s": 10.0}


def test_tables() -> None:
    records = []
    for i, (a, b) in enumerate([(1, 1), (0, 1), (1, 1), (0, 0)]):  # kvfast 0.5, kvpress 0.75
        records += [rec("kvfast", "knorm", 0.5, i, a, [a]), rec("kvpress", "knorm", 0.5, i, b, [b])]
    for i in range(4):
        records += [rec("kvfast", "full", None, i, 1, [7]), rec("kvpress", "full", None, i, 1, [7])]
    records.append(rec("kvpress", "knorm", 0.75, 0, 1, [1]))  # kvpress only: no pairs
    lines = tables.format_tables(records, {"kvzip": "kvfast has no prompt compressor 'kvzip' (yet)"}, list(peer.METHODS))
    text = "\n".join(lines)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| method")]
    assert rows[0].startswith("| full | — | 2014.0 / 2014.0 | 1.000 ± 0.000 | 1.000 ± 0.000 | 4 / 4 | 1.00 "
                              "| 1.00")
    # scores 1,0,1,0 vs 1,1,1,0: mean 0.5 ± 0.289, 0.75 ± 0.25; agreement 3/4; diff mean -0.25 ± 0.25
    assert rows[1] == ("| knorm | 0.5 | 1007.0 / 1007.0 | 0.500 ± 0.289 | 0.750 ± 0.250 | 4 / 4 | 0.75 "
                       "| 0.75 | -0.250 ± 0.250 | 1.00 / 1.00 |")
    assert rows[2] == "| knorm | 0.75 | — / 1007.0 | — | 1.000 | 0 / 1 | — | — | — | — / 1.00 |"
    assert "### niah_multikey, 2048 tokens" in text
    assert "- kvfast: 12.0 s per sample over 4 samples" in text  # 10 s prefill + 2 rows x 1 s
    assert "- kvzip: kvfast side skipped" in text


def test_mean_se() -> None:
    assert tables.mean_se([1.0]) == (1.0, None)
    m, se = tables.mean_se([0.0, 1.0, 1.0, 0.0])
    assert m == 0.5 and se == pytest.approx((1 / 3) ** 0.5 / 2)
    assert tables.fmt([]) == "—" and tables.fmt([0.25]) == "0.250"


def test_worker_hash_is_order_sensitive() -> None:
    assert worker.ids_hash([1, 2], [3]) != worker.ids_hash([1], [2, 3])
    assert len(worker.ids_hash([1], [2])) == 16
