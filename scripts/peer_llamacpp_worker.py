"""Runs inside the llama.cpp peer environment (.peers/llamacpp, see scripts/peer_llamacpp.py): times prefill and
greedy decode of one GGUF with the prebuilt CPU llama.cpp of the llama-cpp-cffi wheel, through its C API.

stdin: one JSON object {"gguf", "prompt" (token ids), "new_tokens", "threads", "repeats"}; stdout: one JSON
object {"prefill_s", "tok_s", "system_info", "tokens"} (medians over the repeats; tokens: the last repeat's
greedy output). Imports nothing from kvfast and only the compiled module of the wheel: the package's
__init__ pulls in transformers and more."""

import glob
import json
import os
import statistics
import sys
import time

SO = glob.glob(sys.prefix + "/lib/python3*/site-packages/llama/_llama_cpp_cpu*.so")
sys.path.insert(0, os.path.dirname(SO[0]))
from _llama_cpp_cpu import ffi, lib


def decode(ctx, ids: list) -> None:
    arr = ffi.new("llama_token[]", ids)
    if lib.llama_decode(ctx, lib.llama_batch_get_one(arr, len(ids))) != 0:
        raise SystemExit("llama_decode failed")


def main() -> None:
    job = json.load(sys.stdin)
    prompt, new_tokens, threads = job["prompt"], job["new_tokens"], job["threads"]
    lib.llama_backend_init()
    model = lib.llama_model_load_from_file(job["gguf"].encode(), lib.llama_model_default_params())
    if model == ffi.NULL:
        raise SystemExit(f"llama.cpp cannot load {job['gguf']}")
    params = lib.llama_context_default_params()
    params.n_ctx = len(prompt) + new_tokens + 8
    params.n_batch = params.n_ubatch = 512
    params.n_threads = params.n_threads_batch = threads
    ctx = lib.llama_init_from_model(model, params)
    sampler = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(sampler, lib.llama_sampler_init_greedy())
    prefill, rate = [], []
    for _ in range(job["repeats"] + 1):  # the first run warms up
        lib.llama_kv_cache_clear(ctx)
        t0 = time.perf_counter()
        for i in range(0, len(prompt), 512):
            decode(ctx, prompt[i:i + 512])
        token = lib.llama_sampler_sample(sampler, ctx, -1)
        t1 = time.perf_counter()
        tokens = [token]
        for _ in range(new_tokens - 1):
            decode(ctx, [token])
            token = lib.llama_sampler_sample(sampler, ctx, -1)
            tokens.append(token)
        t2 = time.perf_counter()
        prefill.append(t1 - t0)
        rate.append((new_tokens - 1) / (t2 - t1))
    print(json.dumps({"prefill_s": statistics.median(prefill[1:]), "tok_s": statistics.median(rate[1:]),
                      "system_info": ffi.string(lib.llama_print_system_info()).decode().strip(),
                      "tokens": tokens}))


if __name__ == "__main__":
    main()
