"""kvpress side of scripts/peer_kvpress.py. Runs inside the peer environment (.peers/kvpress: kvpress,
torch, transformers, gguf) and imports nothing from kvfast: token ids come in as JSON, token ids go out as
JSON lines.

    python scripts/peer_kvpress_worker.py prepare --gguf FILE --out DIR   # HF folder from the GGUF, once
    python scripts/peer_kvpress_worker.py run JOB.json RESULTS.jsonl      # every (sample, method) of a job

A method is {"key", "press" (a kvpress class name, null = no compression), "ratio", "params"}. Query-agnostic
and raw, as kvpress's pipeline does it minus the chat template: the context alone goes through
`model.model(input_ids=..., past_key_values=DynamicCache())` under the press, then the question is fed at
positions S..S+Q-1 and the answer decoded greedily (KVPressTextGenerationPipeline.generate_answer).

Scorer presses (everything but KVzip) compress each layer in a forward hook from that layer's keys, values
and hidden states; the prefill itself is never changed by a press (the hook runs after the layer's attention).
So by default one prefill serves them all: one hook per layer calls every press's own `compress` on the
same arguments BasePress.forward_hook would pass and keeps each result in that press's cache (press_prefill
in the job: each press gets its own prefill under `with press(model):`, to check that both give the same
tokens).
KVzip always runs under its own context manager (its reconstruction passes run after the yield).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

# copies of the tokenizer for KVzipPress's repeat prompt, which it builds from the chat template of
# model.config.name_or_path: "raw" has no template (suffix "\n"); "chat" has a template that puts nothing
# before the context (kvpress would otherwise take the real template's system prompt for a prefix of the raw
# context) and the model's end of user turn + assistant header after it
KVZIP_TOKENIZERS = {"raw": "kvzip-raw-tokenizer", "chat": "kvzip-chat-tokenizer"}
MARK = "\x00KVFAST\x00"


def ids_hash(context: list[int], question: list[int]) -> str:
    return hashlib.sha256(json.dumps([context, question]).encode()).hexdigest()[:16]


def prepare(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # the GGUF tokenizer saves with a tokenizer_config (CodeLlamaTokenizer) that reloads into a tokenizer that
    # maps spaces to <|endoftext|>; its tokenizer.json is right, so the copies are built from that alone
    wrapped = tok.apply_chat_template([{"role": "user", "content": MARK}], add_generation_prompt=True,
                                      tokenize=False)
    suffix = wrapped.split(MARK, 1)[1]
    base = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    probe = "\n\nRepeat the part of the previous context exactly, starting with the pass key 12345."
    for name, template in (("chat", "{{ messages[0]['content'] }}{{ " + json.dumps(suffix) + " }}"),
                           ("raw", None)):
        base.chat_template = template
        base.save_pretrained(out / KVZIP_TOKENIZERS[name])
        again = AutoTokenizer.from_pretrained(str(out / KVZIP_TOKENIZERS[name]))
        if again.encode(probe, add_special_tokens=False) != base.encode(probe, add_special_tokens=False):
            raise ValueError(f"the {name} tokenizer copy does not reload as saved")
    info = {"gguf": gguf.name, "gguf_bytes": gguf.stat().st_size, "transformers": transformers.__version__,
            "chat_suffix": suffix}
    (out / "kvfast-peer.json").write_text(json.dumps(info, indent=1))


# ---- one sample -------------------------------------------------------------------------------------------
def make_press(method: dict):
    import kvpress

    cls = getattr(kvpress, method["press"])
    return cls(compression_ratio=method["ratio"], **method["params"])


def press_fields(press) -> dict:
    return {f.name: getattr(press, f.name) for f in dataclasses.fields(press) if not f.name.startswith("_")}


def kept_per_head(model, cache) -> float:
    """Context KV pairs kept per KV head, mean over layers (KVzip masks instead of removing)."""
    layers = model.model.layers
    H = model.config.num_key_value_heads
    total = 0.0
    for i, layer in enumerate(layers):
        n = cache.layers[i].keys.shape[2]
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        total += n - (len(masked[0]) / H if masked is not None else 0)
    return total / len(layers)


def clear_masks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def answer(model, cache, S: int, question, n: int, stop: set[int]) -> list[int]:
    """kvpress's generate_answer: the question at positions S.., then greedy tokens until a stop id."""
    import torch

    Q = question.shape[1]
    pos = torch.arange(S, S + Q, device=question.device).unsqueeze(0)
    out = model(input_ids=question, past_key_values=cache, position_ids=pos, logits_to_keep=1)
    token = out.logits[0, -1].argmax()
    ids = [int(token)]
    for i in range(n - 1):
        if ids[-1] in stop:
            break
        out = model(input_ids=token.view(1, 1), past_key_values=cache, position_ids=pos[:, -1:] + 1 + i)
        token = out.logits[0, -1].argmax()
        ids.append(int(token))
    return ids


def shared_prefill(model, context, presses: dict):
    """One context prefill; every scorer press compresses each layer from the same hook arguments.

    Returns the full cache and {key: compressed cache}."""
    from kvpress.presses.base_press import is_prefilling
    from kvpress.utils import extract_keys_and_values
    from transformers import DynamicCache

    caches = {key: DynamicCache() for key in presses}
    for press in presses.values():
        press.post_init_from_model(model)
    lm = model.model

    def hook(module, inputs, kwargs, output):
        hidden = kwargs["hidden_states"]
        if not is_prefilling(kwargs["cache_position"], hidden.shape[1]):
            return output
        keys, values = extract_keys_and_values(kwargs["past_key_values"], module.layer_idx)
        for key, press in presses.items():
            k, v = press.compress(module, hidden, keys, values, output[1], kwargs)
            caches[key].update(k, v, module.layer_idx)
        return output

    hooks = []
    try:
        for layer in lm.layers:
            layer.self_attn.rotary_emb = lm.rotary_emb  # as BasePress.__call__ does
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        full = DynamicCache()
        lm(input_ids=context, past_key_values=full)
    finally:
        for h in hooks:
            h.remove()
    return full, caches


def own_prefill(model, context, press, tokenizer: Path | None):
    """`with press(model):` around the context prefill, as kvpress's pipeline does (KVzip: its repeat prompt
    built from the chat template of `tokenizer` when given, see KVZIP_TOKENIZERS)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    saved = model.config.name_or_path
    if tokenizer is not None:
        model.config.name_or_path = str(tokenizer)
    try:
        with press(model):
            model.model(input_ids=context, past_key_values=cache)
    finally:
        model.config.name_or_path = saved
    return cache


def spy_repeat(press, seen: dict) -> None:
    """Record the ids KVzipPress puts before the first chunk it repeats (instruction + suffix) and its prefix
    length, so the main side can compare them with kvfast's repeat prompt."""
    prepare = press.prepare

    def wrapped(*args, **kwargs):
        pairs = prepare(*args, **kwargs)
        chunk, repeat = pairs[0]
        seen["kvzip_repeat_ids"] = repeat[0, : repeat.shape[1] - chunk.shape[1]].tolist()
        seen["kvzip_prefix_length"] = press.prefix_length
        return pairs

    press.prepare = wrapped


def run_sample(model, sample: dict, job: dict, emit) -> None:
    import torch

    device = job["device"]
    context = torch.tensor([sample["context"]], device=device)
    question = torch.tensor([sample["question"]], device=device)
    S = context.shape[1]
    n, stop = job["answer_tokens"], set(job["stop_ids"])
    digest = ids_hash(sample["context"], sample["question"])
    kvzip_tok = Path(job["model"]) / job["kvzip_tokenizer"]
    methods = [m for m in job["methods"] if m["key"] in sample["todo"]]
    separate = [m for m in methods if m["press"] and (job.get("press_prefill") or m["press"] == "KVzipPress")]
    shared = [m for m in methods if m not in separate]

    def finish(m: dict, cache, t0: float, prefill_s: float, press, extra: dict | None = None) -> None:
        kept = kept_per_head(model, cache)
        t1 = time.perf_counter()
        tokens = answer(model, cache, S, question, n, stop)
        clear_masks(model)
        emit({"uid": sample["uid"], "key": m["key"], "ids_hash": digest, "tokens": tokens,
              "kept": round(kept, 2),
              "prefill_s": round(prefill_s, 4), "decode_s": round(time.perf_counter() - t1, 4),
              "time_s": round(time.perf_counter() - t0, 4),
              "press_params": press_fields(press) if press is not None else None, **(extra or {})})

    with torch.inference_mode():
        if shared:
            t0 = time.perf_counter()
            presses = {m["key"]: make_press(m) for m in shared if m["press"]}
            full, caches = shared_prefill(model, context, presses)
            prefill_s = time.perf_counter() - t0
            share = prefill_s / len(shared)  # the prefill's cost, split over the methods it served
            for m in shared:
                cache = caches[m["key"]] if m["press"] else full
                finish(m, cache, time.perf_counter() - share, share, presses.get(m["key"]))
            del full, caches
        for m in separate:
            press = make_press(m)
            seen: dict = {}
            if m["press"] == "KVzipPress":
                spy_repeat(press, seen)
            t0 = time.perf_counter()
            cache = own_prefill(model, context, press, kvzip_tok if m["press"] == "KVzipPress" else None)
            finish(m, cache, t0, time.perf_counter() - t0, press, seen)


def run(job_path: Path, out_path: Path) -> None:
    import kvpress  # noqa: F401  (patches the attention functions for KVzip's masked keys)
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    job = json.loads(job_path.read_text())
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=getattr(torch, job.get("dtype", "float32")),
                                                 attn_implementation="sdpa")
    model.to(job["device"]).eval()
    versions = {"kvpress": _version("kvpress"), "transformers": transformers.__version__,
                "torch": torch.__version__, "threads": torch.get_num_threads()}
    with out_path.open("a") as f:
        def emit(record: dict) -> None:
            f.write(json.dumps({**record, "versions": versions}) + "\n")
            f.flush()

        for i, sample in enumerate(job["samples"]):
            t0 = time.perf_counter()
            run_sample(model, sample, job, emit)
            print(f"kvpress: {sample['uid']} ({i + 1}/{len(job['samples'])}) {len(sample['todo'])} methods "
                  f"in {time.perf_counter() - t0:.1f} s", flush=True)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="save the GGUF model as an fp32 HF folder")
    prep.add_argument("--gguf", type=Path, required=True)
    prep.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run", help="run a job file, appending one JSON line per (sample, method)")
    r.add_argument("job", type=Path)
    r.add_argument("results", type=Path)
    args = p.parse_args(argv)
    if args.command == "prepare":
        prepare(args.gguf, args.out)
    else:
        run(args.job, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
