"""Peer check against kvpress: the same method, the same samples, the same kept count, both implementations.

    .venv/bin/python scripts/peer_kvpress.py --task niah_multikey --lengths 2048 --samples 30 \\
        --ratios 0.5 0.75 --presses snapkv streaming tova knorm kvzip expected_attention \\
        --out results/peer_kvpress
    .venv/bin/python scripts/peer_kvpress.py --limit 2 --presses snapkv knorm          # smoke run

kvpress (0.5.5, with torch 2.13.0 and transformers 5.2) lives in its own environment, .peers/kvpress, created
on first use; the project's .venv is never touched. The model is the default checkpoint's GGUF, loaded once by
transformers (gguf_file=) and saved as an fp32 HF folder (checkpoints/<name>-hf/) that later runs reuse; its
weights are those of our converted checkpoint.

Samples are eval.py's (evals.tasks.make_prompts with our tokenizer, eval.py's default seed, depths, haystack and
raw framing), so both sides get identical token ids; the kvpress side receives the ids as JSON
(scripts/peer_kvpress_worker.py) and returns token ids, which are decoded and scored here like eval.py does.
Query-agnostic on both sides: the context is compressed without the question, then the question is read at
positions S..S+Q-1 and the answer decoded greedily (ANSWER_TOKENS[task] tokens, stopping at EOS).

- kvpress: `compression_ratio` r removes S - int(S (1 - r)) context tokens per KV head (ScorerPress.compress);
  no chat template, no pipeline (it would add one): the press compresses the context prefill of
  `model.model`, and the question and answer are appended to the DynamicCache uncompressed.
- kvfast: the append-only `snapkv` policy with `prompt_compression=<method>` and a budget of
  int(S (1 - r)) + Q + --answer-room slots for max_new = Q + --answer-room, so exactly int(S (1 - r)) context
  tokens stay per KV head and the question and answer are appended without eviction. One recorded prefill per
  batch (evals.caches.Evaluator), then per method: fill, feed the question, greedy decode.
- `full` (no compression) runs on both sides first: it checks that the two implementations of the model agree.

Each press's parameters are set to kvpress's defaults and kvfast's compressor is set to match them (SnapKV:
window 64, kernel 5, average pooling); the known differences that remain are listed per method in peer.md and
docs/results.md. Output in --out: peer.json (settings, every sample on both sides: ids hash, prediction,
score, kept tokens, seconds) and peer.md (a table per length). Reruns compute only what is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # kvfast's modules when run as a script

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see eval.py: spinning OpenMP threads stall on 2 cores

from cli import ArgumentParser
from evals import tasks
from model import KVFastError
from scripts.peer_env import ensure_peer_env as ensure_peer_env_with
from scripts.peer_env import one_line, worker_env
from scripts.peer_kvpress_methods import COMMON_DIFFERENCES, METHODS, Method
from scripts.peer_kvpress_tables import SIDES, format_tables
from scripts.peer_kvpress_worker import KVZIP_TOKENIZERS, ids_hash

WORKER = Path(__file__).resolve().parent / "peer_kvpress_worker.py"
KVPRESS_REQUIREMENTS = ("kvpress==0.5.5", "torch==2.13.0", "gguf==0.19.0")
DEFAULT_GGUF = ROOT / "checkpoints" / ".downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct-hf"
DEFAULT_ENV = ROOT / ".peers" / "kvpress"
OUR_POLICY = "snapkv"  # append-only: the question and the answer are never evicted, as in kvpress


# ---- arguments ---------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_multikey",
                   help=f"retrieval task: {', '.join(tasks.RETRIEVAL_TASKS)}")
    p.add_argument("--lengths", nargs="+", type=int, default=[2048], help="prompt lengths in tokens")
    p.add_argument("--samples", type=int, default=30, help="samples per length")
    p.add_argument("--limit", type=int, default=None, help="at most N samples per length (smoke runs)")
    p.add_argument("--ratios", nargs="+", type=float, default=[0.5, 0.75],
                   help="kvpress compression ratios: the fraction of context tokens removed, in (0, 1)")
    p.add_argument("--presses", nargs="+", default=list(METHODS),
                   help=f"methods to compare: {', '.join(METHODS)} (full always runs first)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "peer_kvpress", help="output folder")
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES,
                   help="which implementations to run")
    p.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints" / "SmolLM2-135M-Instruct",
                   help="kvfast checkpoint (the default model is prepared on first use)")
    p.add_argument("--gguf", type=Path, default=DEFAULT_GGUF,
                   help="GGUF file transformers loads the model from")
    p.add_argument("--hf-model", type=Path, default=DEFAULT_HF,
                   help="HF folder saved from --gguf on first use and reused")
    p.add_argument("--peer-env", type=Path, default=DEFAULT_ENV,
                   help="virtual environment for kvpress (created on first use)")
    p.add_argument("--seed", type=int, default=0, help="seed of the task generator (eval.py's default)")
    p.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9],
                   help="needle depths, cycled over the samples (eval.py's default)")
    p.add_argument("--haystack", default="jargon", help="niah haystack (eval.py's default)")
    p.add_argument("--answer-room", type=int, default=64,
                   help="kvfast: new tokens the caches are sized for beyond the question (eval.py's default)")
    p.add_argument("--batch-size", type=int, default=4, help="kvfast: samples per recorded prefill")
    p.add_argument("--kvzip-suffix", default="chat", choices=["chat", "raw"],
                   help="KVzip's repeat prompt on the kvpress side: after the instruction, the model's chat "
                        "end-of-turn + assistant header (as kvfast's kvzip with a chat tokenizer) or \\n")
    p.add_argument("--press-prefill", action="store_true",
                   help="kvpress: prefill the context once per press under `with press(model):` (slower) "
                        "instead of once per sample with every press's compress() in one hook")
    p.add_argument("--threads", type=int, default=None, help="torch threads on both sides (default: torch's)")
    p.add_argument("--device", default="cpu", help="torch device for both sides")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both models' compute dtype (kvfast's caches and transformers' weights and cache)")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompts in the model's chat template (eval.py --chat): the context opens the "
                        "user turn, the question closes it and the assistant header follows")
    p.add_argument("--overwrite", action="store_true",
                   help="drop the results in --out (another configuration, or to recompute everything)")
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    if args.task not in tasks.RETRIEVAL_TASKS:
        raise KVFastError(f"unknown task {args.task!r} (choose from {', '.join(tasks.RETRIEVAL_TASKS)})")
    for name in args.presses:
        if name not in METHODS:
            raise KVFastError(f"unknown press {name!r} (choose from {', '.join(METHODS)})")
    args.presses = list(dict.fromkeys(args.presses))
    for r in args.ratios:
        if not 0 < r < 1:  # also rejects NaN
            raise KVFastError(f"--ratios: {r:g} is not in (0, 1) (the fraction of context tokens removed; "
                              "0 is the full row, which always runs)")
    args.ratios = sorted(set(args.ratios))
    if min(args.lengths) < 128:
        raise KVFastError(f"--lengths must be at least 128 tokens, got {min(args.lengths)}")
    args.lengths = sorted(set(args.lengths))
    for name in ("samples", "answer_room", "batch_size"):
        if getattr(args, name) <= 0:
            raise KVFastError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    for name in ("limit", "threads"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise KVFastError(f"--{name} must be > 0, got {getattr(args, name)}")
    if any(not 0 <= d <= 1 for d in args.depths):
        raise KVFastError("--depths must lie in [0, 1]")
    args.n = min(args.samples, args.limit or args.samples)


# ---- budgets -----------------------------------------------------------------------------------------------
def kept_tokens(context_len: int, ratio: float) -> int:
    """Context tokens each KV head keeps at kvpress's compression_ratio (kvpress.utils.compute_n_kept)."""
    return max(1, int(context_len * (1 - ratio)))


def our_budget(context_len: int, question_len: int, ratio: float, answer_room: int) -> tuple[int, int, int]:
    """kvfast's (budget in slots, max_new_tokens, kept context tokens) for the append-only policy: the caches
    are sized for the question and the answer room on top of the kept context, so nothing is ever evicted."""
    kept = kept_tokens(context_len, ratio)
    max_new = question_len + answer_room
    return kept + max_new, max_new, kept


def record_key(side: str, task: str, length: int, index: int, method: str, ratio: float | None) -> str:
    return f"{side}|{task}|{length}|{index}|{method}|{ratio}"


# ---- results file ------------------------------------------------------------------------------------------
class Store:
    def __init__(self, out: Path, config: dict[str, Any], overwrite: bool):
        self.path = out / "peer.json"
        self.config = config
        self.records: dict[str, dict] = {}
        self.skipped: dict[str, str] = {}
        self.checks: dict[str, Any] = {}  # facts about this run's kvfast side the report compares against
        if self.path.exists() and not overwrite:
            try:
                saved = json.loads(self.path.read_text())
            except (OSError, json.JSONDecodeError) as e:
                raise KVFastError(f"cannot read {self.path}: {e} (use --overwrite)") from None
            if saved.get("config") != config:
                differ = sorted(k for k in set(config) | set(saved.get("config", {}))
                                if saved.get("config", {}).get(k) != config.get(k))
                raise KVFastError(f"{self.path} holds results of another configuration (differs in "
                                  f"{differ}); use --overwrite or another --out")
            self.records = {r["key"]: r for r in saved.get("records", [])}

    def done(self, key: str) -> bool:
        return key in self.records

    def add(self, record: dict) -> None:
        self.records[record["key"]] = record

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        data = {"config": self.config, "skipped": self.skipped, "checks": self.checks,
                "records": list(self.records.values())}
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)


# ---- the kvpress environment -------------------------------------------------------------------------------
def ensure_peer_env(env: Path) -> Path:
    """The peer environment's python, creating the environment and installing kvpress on first use."""
    return ensure_peer_env_with(env, KVPRESS_REQUIREMENTS, "import kvpress, gguf, transformers")


def hf_model_ready(folder: Path) -> bool:
    need = ["config.json", "model.safetensors", "kvfast-peer.json",
            *(f"{d}/tokenizer_config.json" for d in KVZIP_TOKENIZERS.values())]
    return all((folder / f).exists() for f in need)


def ensure_hf_model(python: Path, gguf: Path, folder: Path, out: Path) -> None:
    if hf_model_ready(folder):
        return
    if not gguf.is_file():
        raise KVFastError(f"GGUF file not found: {gguf} (scripts/prepare.py downloads the default one)")
    print(f"saving {gguf.name} as an HF folder {folder} (first use, 1-3 min)...", flush=True)
    log = out / "kvpress_prepare.log"
    with log.open("w") as f:
        cmd = [str(python), str(WORKER), "prepare", "--gguf", str(gguf), "--out", str(folder)]
        done = subprocess.run(cmd, check=False, stdout=f, stderr=subprocess.STDOUT, env=worker_env(None))
    if done.returncode != 0 or not hf_model_ready(folder):
        raise KVFastError(f"cannot save the HF model from {gguf.name}: {one_line(log.read_text())} "
                          f"(log: {log})")


# ---- kvfast side -------------------------------------------------------------------------------------------
class Unavailable(Exception):
    """A method kvfast does not have (yet): its rows show the kvpress side only."""


def our_params(method: Method) -> tuple[dict[str, Any], list[str]]:
    """The hyper-parameters kvfast's policy + compressor accept, and the ones it does not have."""
    import cache as kvcache

    if method.compressor not in kvcache.PROMPT_COMPRESSORS:
        raise Unavailable(f"kvfast has no prompt compressor {method.compressor!r} (yet)")
    compressor = kvcache.PROMPT_COMPRESSORS[method.compressor]
    used = set(kvcache.POLICIES[OUR_POLICY].params) | set(compressor.params)
    kept = {k: v for k, v in method.ours.items() if k in used and k in kvcache.PARAMS}
    return kept, sorted(set(method.ours) - set(kept))


def our_factory(ev: Any, name: str, ratio: float | None, B: int, S: int, Q: int, answer_room: int):
    import cache as kvcache

    p = next(ev.model.parameters())
    if ratio is None:
        return kvcache.make_cache_factory("full", B, ev.model.args, S, Q + answer_room, dtype=p.dtype,
                                          device=p.device)
    method = METHODS[name]
    params, _ = our_params(method)
    budget, max_new, _ = our_budget(S, Q, ratio, answer_room)
    return kvcache.make_cache_factory(OUR_POLICY, B, ev.model.args, S, max_new,
                                      prompt_compression=method.compressor, budget=budget, dtype=p.dtype,
                                      device=p.device, tokenizer=ev.tok, **params)


def run_kvfast(ev: Any, args: argparse.Namespace, prompts: list[tasks.Prompt], combos: list[tuple[str, Any]],
               store: Store) -> None:
    import torch

    from decode import truncate_at_stop
    from evals.caches import MultiCache

    L = prompts[0].length
    answer_n = tasks.ANSWER_TOKENS.get(args.task, 16)
    for start in range(0, len(prompts), args.batch_size):
        part = prompts[start : start + args.batch_size]
        todo = [c for c in combos
                if any(not store.done(record_key("kvfast", args.task, L, p.index, *c)) for p in part)]
        if not todo:
            continue
        B = len(part)
        ctx = torch.tensor([p.context for p in part], device=ev.device)
        qst = torch.tensor([p.question for p in part], device=ev.device)
        S, Q = ctx.shape[1], qst.shape[1]
        with torch.inference_mode():
            t0 = time.perf_counter()
            kv, hidden = ev.record(ctx)
            del hidden
            prefill_s = (time.perf_counter() - t0) / B
            memos = [{} for _ in range(ev.n_layers)]
            by_method: dict[str, list[tuple[str, Any]]] = {}
            for c in todo:
                by_method.setdefault(c[0], []).append(c)
            for group in by_method.values():  # a method's ratios decode together
                t0 = time.perf_counter()
                factories = [our_factory(ev, name, r, B, S, Q, args.answer_room) for name, r in group]
                members = [[f(i) for i in range(ev.n_layers)] for f in factories]
                caches = members[0] if len(group) == 1 else [MultiCache([m[i] for m in members])
                                                             for i in range(ev.n_layers)]
                ev.install(caches)
                ev.fill(caches, kv, S, memos, ctx)  # KVzip's reconstruction scores: once per batch
                G = len(group)
                first = ev.feed(qst.repeat(G, 1), S)
                answer, _ = ev.greedy(first, S + Q, answer_n, stop=True, keep=False)
                elapsed = (time.perf_counter() - t0) / (B * G)
                for j, (name, r) in enumerate(group):
                    kept = factories[j].prompt_capacities[0] if r is not None else S
                    for row, p in enumerate(part):
                        ids = answer[j * B + row].tolist()
                        ids = truncate_at_stop(ids, ev.stop_ids) if ev.stop_ids else ids
                        pred = ev.tok.decode(ids)
                        store.add({"key": record_key("kvfast", args.task, L, p.index, name, r),
                                   "side": "kvfast", "task": args.task, "length": L, "index": p.index,
                                   "method": name, "ratio": r,
                                   "ids_hash": ids_hash(p.context, p.question), "context_tokens": S,
                                   "question_tokens": Q, "kept": kept, "tokens": ids, "prediction": pred,
                                   "answers": p.answers, "score": tasks.score(args.task, pred, p.answers),
                                   "prefill_s": round(prefill_s, 4), "time_s": round(elapsed, 4),
                                   "meta": p.meta})
            del kv
        store.save()
        print(f"kvfast: {args.task}@{L} samples {part[0].index}..{part[-1].index}: {len(todo)} methods",
              flush=True)


# ---- kvpress side ------------------------------------------------------------------------------------------
def press_methods(args: argparse.Namespace) -> list[dict[str, Any]]:
    out = [{"key": "full|None", "press": None, "ratio": None, "params": {}}]
    for name in args.presses:
        m = METHODS[name]
        for r in args.ratios:
            out.append({"key": f"{name}|{r}", "press": m.press, "ratio": r, "params": m.press_params})
    return out


def merge_kvpress(path: Path, args: argparse.Namespace, prompts: list[tasks.Prompt], tok: Any,
                  store: Store) -> int:
    """Turn the worker's JSON lines into records (decoded and scored here); returns how many were added."""
    from decode import truncate_at_stop

    if not path.exists():
        return 0
    by_uid = {p.uid: p for p in prompts}
    stop = set(getattr(tok, "stop_ids", None) or ())
    added = 0
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        p = by_uid.get(r["uid"])
        if p is None:
            continue
        if r["ids_hash"] != ids_hash(p.context, p.question):
            raise KVFastError(f"kvpress worker answered {r['uid']} for other token ids (hash mismatch)")
        name, ratio = r["key"].split("|")
        ratio = None if ratio == "None" else float(ratio)
        ids = truncate_at_stop(r["tokens"], stop) if stop else r["tokens"]
        pred = tok.decode(ids)
        store.add({"key": record_key("kvpress", args.task, p.length, p.index, name, ratio), "side": "kvpress",
                   "task": args.task, "length": p.length, "index": p.index, "method": name, "ratio": ratio,
                   "ids_hash": r["ids_hash"], "context_tokens": len(p.context),
                   "question_tokens": len(p.question),
                   "kept": r["kept"], "tokens": ids, "prediction": pred, "answers": p.answers,
                   "score": tasks.score(args.task, pred, p.answers), "prefill_s": r["prefill_s"],
                   "time_s": r["time_s"], "press_params": r["press_params"], "versions": r["versions"],
                   "meta": p.meta,
                   **{k: r[k] for k in ("kvzip_repeat_ids", "kvzip_prefix_length") if k in r}})
        added += 1
    return added


def run_kvpress(python: Path, args: argparse.Namespace, prompts: list[tasks.Prompt], tok: Any,
                store: Store) -> None:
    L = prompts[0].length
    out = args.out
    results = out / f"kvpress_{args.task}_{L}.jsonl"
    if merge_kvpress(results, args, prompts, tok, store):  # left by an interrupted run
        store.save()
    results.unlink(missing_ok=True)
    methods = press_methods(args)
    samples = []
    for p in prompts:
        todo = [m["key"] for m in methods
                if not store.done(record_key("kvpress", args.task, L, p.index, m["key"].split("|")[0],
                                             m["ratio"]))]
        if todo:
            samples.append({"uid": p.uid, "context": p.context, "question": p.question, "todo": todo})
    if not samples:
        return
    job = {"model": str(args.hf_model.resolve()), "device": args.device, "dtype": args.dtype, "threads": args.threads,
           "answer_tokens": tasks.ANSWER_TOKENS.get(args.task, 16),
           "stop_ids": sorted(getattr(tok, "stop_ids", None) or ()), "methods": methods,
           "press_prefill": args.press_prefill, "kvzip_tokenizer": KVZIP_TOKENIZERS[args.kvzip_suffix],
           "samples": samples}
    job_path = out / f"kvpress_{args.task}_{L}.job.json"
    job_path.write_text(json.dumps(job))
    log = out / "kvpress_worker.log"
    with log.open("a") as f:
        f.write(f"---- {time.strftime('%Y-%m-%d %H:%M:%S')} {job_path.name}\n")
        f.flush()
        done = subprocess.run([str(python), str(WORKER), "run", str(job_path), str(results)], stderr=f,
                              check=False, env=worker_env(args.threads))
    merge_kvpress(results, args, prompts, tok, store)
    store.save()
    if done.returncode != 0:
        raise KVFastError(f"kvpress worker failed (exit {done.returncode}): {one_line(log.read_text(), 300)} "
                          f"(log: {log}; a rerun resumes)")
    results.unlink(missing_ok=True)
    job_path.unlink(missing_ok=True)


# ---- report ------------------------------------------------------------------------------------------------
def report(store: Store, args: argparse.Namespace) -> str:
    records = list(store.records.values())
    lines = ["# Peer check: kvfast vs kvpress", "",
             (f"Query-agnostic, {'chat-template' if args.chat else 'raw'} prompts, greedy; task {args.task}, "
              f"haystack {args.haystack}, seed {args.seed}, kvfast policy "
              f"`{OUR_POLICY}` (append-only) with each method as its prompt compressor; kvpress "
              f"compression_ratio r keeps int(S (1 - r)) context tokens per KV head on both sides. "
              "agreement: fraction of samples scored the same on both sides; same tokens: identical "
              "answers; paired diff: mean of per-sample kvfast − kvpress score differences. s / sample per "
              "row: kvfast = that method's decode (its prefill is shared, counted once in the totals "
              "below); kvpress = its prefill share + decode."), ""]
    lines += format_tables(records, store.skipped, list(METHODS))
    lines += ["", "## Settings", ""]
    seen: dict[str, Any] = {}
    for r in records:
        if r["side"] == "kvpress" and r.get("press_params") and r["method"] not in seen:
            seen[r["method"]] = r["press_params"]
    for name in [m for m in METHODS if m in {r["method"] for r in records}]:
        m = METHODS[name]
        ours, missing = our_params(m) if name not in store.skipped else (m.ours, [])
        lines.append(f"- {name}: kvpress {m.press}{json.dumps(seen.get(name, m.press_params))}; kvfast "
                     f"--cache {OUR_POLICY} --prompt-compression {m.compressor} {json.dumps(ours)}"
                     + (f" (kvfast lacks {missing})" if missing else ""))
    repeat = next((r for r in records if "kvzip_repeat_ids" in r), None)
    ours = store.checks.get("kvzip_repeat_ids")
    if repeat is not None and ours is not None:
        same = "identical" if repeat["kvzip_repeat_ids"] == ours else "DIFFERENT"
        lines.append(f"- kvzip repeat prompt before the first chunk ({same}): kvpress "
                     f"{repeat['kvzip_repeat_ids']} (prefix length {repeat['kvzip_prefix_length']}), "
                     f"kvfast {ours}")
    versions = next((r["versions"] for r in records if r.get("versions")), None)
    if versions:
        lines.append(f"- kvpress side: {json.dumps(versions)}")
    lines += ["", "## Known differences", ""] + [f"- all: {d}" for d in COMMON_DIFFERENCES]
    for name in args.presses:
        lines += [f"- {name}: {d}" for d in METHODS[name].differences]
    return "\n".join(lines) + "\n"


# ---- main --------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    python = None
    if "kvpress" in args.sides:  # install first: a failure costs seconds, not a kvfast run
        python = ensure_peer_env(args.peer_env)
        ensure_hf_model(python, args.gguf, args.hf_model, args.out)

    import torch

    from cli import load, resolve_checkpoint
    from decode import DEFAULT_PREFILL_CHUNK
    from evals.caches import Evaluator

    if args.threads:
        torch.set_num_threads(args.threads)
    checkpoint = resolve_checkpoint(args.checkpoint)
    model, tok = load(checkpoint, args.device, getattr(torch, args.dtype))
    config = {"task": args.task, "seed": args.seed, "depths": args.depths, "haystack": args.haystack,
              "answer_room": args.answer_room, "checkpoint": checkpoint.name, "hf_model": args.hf_model.name,
              "kvzip_suffix": args.kvzip_suffix, "dtype": args.dtype, "chat": args.chat, "kvfast_policy": OUR_POLICY,
              "methods": {k: [m.press, m.press_params, m.compressor, m.ours] for k, m in METHODS.items()}}
    store = Store(args.out, config, args.overwrite)
    ev = Evaluator(model, tok, argparse.Namespace(compile=False, compile_scope="step", params={},
                                                  prefill_chunk=DEFAULT_PREFILL_CHUNK))
    framing = tasks.Framing.make(tok, args.chat)
    sentences = None
    if args.task != "passkey":
        sentences = tasks.haystack_units(tok, args.haystack)
    prompts = {L: tasks.make_prompts(args.task, tok, framing, L, args.n, args.seed, args.depths, sentences)
               for L in args.lengths}
    combos: list[tuple[str, Any]] = [("full", None)]
    for name in args.presses:
        try:
            our_params(METHODS[name])
        except Unavailable as e:
            store.skipped[name] = str(e)
            continue
        combos += [(name, r) for r in args.ratios]
    if "kvzip" in args.presses and "kvzip" not in store.skipped:
        try:
            from kv.kvzip import RepeatPrompt

            repeat = RepeatPrompt.from_tokenizer(tok)
            store.checks["kvzip_repeat_ids"] = repeat.first + repeat.suffix
        except (ImportError, AttributeError):  # kvfast's KVzip changed shape: the report just omits the check
            pass
    for ps in prompts.values():  # every budget must be valid before any work
        S, Q = len(ps[0].context), len(ps[0].question)
        for name, r in combos:
            our_factory(ev, name, r, 1, S, Q, args.answer_room)
        if S + Q + args.answer_room > model.args.max_seq_len:
            raise KVFastError(f"length + --answer-room exceeds the model's maximum of "
                              f"{model.args.max_seq_len}")
    t_start = time.perf_counter()
    for ps in prompts.values():
        if "kvfast" in args.sides:
            run_kvfast(ev, args, ps, combos, store)
        if python is not None:
            run_kvpress(python, args, ps, tok, store)
        (args.out / "peer.md").write_text(report(store, args))
    store.save()
    (args.out / "peer.md").write_text(report(store, args))
    print(f"wrote {args.out / 'peer.json'}, {args.out / 'peer.md'} ({time.perf_counter() - t_start:.0f} s)")
    return args.out


def cli(argv: list[str] | None = None) -> int:
    from cli import run_cli

    return run_cli(main, argv)


if __name__ == "__main__":
    sys.exit(cli())
