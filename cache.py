"""KV-cache policies: the public entry point (registries, CLI flags, presets, the per-layer cache factory).

The mechanics live in the `kv/` package: kv.slots (the slot cache every policy shares), kv.scored (the base
of score-based eviction), kv.policies (decode-time eviction, one short class per paper), kv.prompt (prompt
compressors and blockwise prompt statistics), kv.params (hyper-parameters, declared once beside the class
that uses them), kv.budgets (capacities and layer schedules). Here: the registry (CLI name -> class), and
the flags, presets and validation derived from the classes' declarations. Adding a policy:
docs/adding-a-policy.md.

Two independent axes:
    --cache POLICY               what leaves the cache during decoding (one token in, one out per KV head)
    --prompt-compression NAME    which `capacity` prompt tokens each KV head keeps when the prompt is too long
                                 (default: the policy's partner, e.g. scissorhands + snapkv)
plus --cache-budget (fraction of prompt + new tokens, or slots per layer), --layer-budget
uniform|pyramid|funnel, --kv-bits 8|4 (quantized K/V storage, any policy) and each method's hyper-parameters
(defaults from its paper). `--cache-config NAME` loads cache_configs/NAME.yaml (optional presets); flags
given on the command line override it. A flag the chosen policy and compressor do not use is an error.

Use from code (generate.py, eval.py, bench.py):

    add_cache_args(parser)            # all the flags above, with --help text
    check_cache_args(args)            # fail fast, before loading a model
    make_cache = cache_factory_from_args(args, batch_size, model.args, prompt_len, max_new_tokens,
                                         dtype, device)
    # or, without argparse:
    make_cache = make_cache_factory("h2o", batch_size, model.args, prompt_len, max_new_tokens,
                                    budget=0.2, recent_window=0.5, dtype=dtype, device=device)
    model.setup_caches(make_cache)    # make_cache(layer) -> KVCache; .capacities, .describe(), ...
    print("\\n".join(format_cache_report(cache_report(model.caches))))

Per layer, a cache reports kept() (valid slots per row and KV head), tokens_seen(), physical_bytes() (its K/V
buffers: capacity slots only) and overhead_bytes() (slot positions and the policy's statistics); all are read
once, at the end, never per step. hybrid (kv.hybrid) also reports each KV head's class and budget:
head_class_report(caches) / format_head_class_report, printed by generate.py and recorded by eval.py.

Prefill once, many policies (eval): prefill attention never reads the cache, so keep each layer's post-RoPE
(q, k, v) and call `cache.prefill(q, k, v, memo=memos[layer])` on every policy's caches. `memo` is a dict per
(sample, layer) that the caches fill with their budget-independent prompt statistics (compressor scores,
H2O column sums, SnapKV window votes, ...), so trying another budget or policy on the same sample recomputes
none of them (Scissorhands' low-attention record is taken over the kept tokens, so it is memoized only for a
prompt that fits). A compressor's scores alone: `PROMPT_COMPRESSORS[name](**params).scores(q, k, memo)`
([B, H_kv, S], higher = kept).

Timing a decode step (bench): `setup_decode_benchmark(model, policy, context_len, budget=...)` installs the
caches and fills them as if `context_len` tokens had been seen (random K/V), without running a prefill.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml

from kv import policies, prompt
from kv.budgets import (
    LAYER_SCHEDULES,
    bucket_capacity,
    layer_capacities,
    parse_buckets,
    resolve_capacity,
    resolve_count,
)
from kv.expected import ExpectedAttentionCache, ExpectedAttentionPrompt
from kv.fastgen import FastGenCache
from kv.hybrid import HybridCache
from kv.kvzip import KVzipCache, KVzipPrompt
from kv.params import Param, choice, flag_help, merge_params, number, whole
from kv.pool import AdaKVCache
from kv.posshift import shifted
from kv.quant import KV_BITS, KV_FLOATS, kv_float_dtype
from kv.report import cache_report, format_cache_report, format_head_class_report, head_class_report
from kv.slots import KVCache
from kv.tiers import TIER_FLAGS, add_tier_args, check_tiers_for, resolve_tiers, tiered
from model import KVFastError, ModelArgs

# ---- the registry: every policy by CLI name (its `name`), in --help order ----------------------------------
POLICIES: dict[str, type[KVCache]] = {cls.name: cls for cls in (
    policies.FullCache, policies.WindowCache, policies.RandomCache, policies.H2OCache,
    policies.ScissorhandsCache, policies.SnapKVCache, policies.PyramidKVCache, policies.KNormCache,
    policies.TOVACache, policies.EMACache, KVzipCache, ExpectedAttentionCache, AdaKVCache, HybridCache,
    FastGenCache,
    policies.KeyDiffCache,
)}
# the prompt compressors: kv.prompt's, those that need a model pass or values, and every query-agnostic
# policy's own rule (kv.scored.ScoredCache.key_scores)
PROMPT_COMPRESSORS: dict[str, type[prompt.PromptCompressor]] = {
    **prompt.PROMPT_COMPRESSORS, KVzipPrompt.name: KVzipPrompt,
    ExpectedAttentionPrompt.name: ExpectedAttentionPrompt,
    **{cls.name: cls.prompt_compressor for cls in POLICIES.values()
       if getattr(cls, "prompt_compressor", None)}}
# every hyper-parameter, as its classes declare it, and who uses it with which default
_DECLARED = merge_params([*POLICIES.values(), *PROMPT_COMPRESSORS.values()])
PARAMS: dict[str, Param] = {name: p for name, (p, _) in _DECLARED.items()}
GLOBALS = ("cache", "prompt_compression", "cache_budget", "layer_budget", "pyramid_beta", "kv_bits",
           "kv_float", "kv_group_size", "capacity_buckets", "pos_shift", *TIER_FLAGS)

__all__ = ["CONFIG_DIR", "PARAMS", "POLICIES", "PROMPT_COMPRESSORS", "CacheFactory", "KVCache",
           "add_cache_args", "cache_factory_from_args", "cache_report", "check_cache_args", "format_cache_report",
           "format_head_class_report", "head_class_report",
           "load_preset", "make_cache_factory", "setup_decode_benchmark"]

CONFIG_DIR = Path(__file__).resolve().parent / "cache_configs"
DEFAULT_PYRAMID_BETA = 20


def _flag(name: str) -> str:
    return name.replace("_", "-")


# ---- CLI ----------------------------------------------------------------------------------------------
def add_cache_args(parser: argparse.ArgumentParser) -> None:
    """Add every cache flag. All default to None so that an explicitly given flag can be told apart."""
    g = parser.add_argument_group("KV cache")
    g.add_argument("--cache", default=None, help=f"decode-time policy: {', '.join(POLICIES)} (default full)")
    g.add_argument("--prompt-compression", default=None,
                   help=f"prompt compressor when the prompt exceeds the capacity: "
                        f"{', '.join(PROMPT_COMPRESSORS)} (default: the policy's partner)")
    g.add_argument("--cache-budget", type=float, default=None,
                   help="slots per layer: a fraction in (0, 1] of prompt + new tokens, or a number (> 1); "
                        "the average over layers with --layer-budget pyramid|funnel (default: all tokens)")
    g.add_argument("--layer-budget", default=None,
                   help=f"divide the budget across layers: {', '.join(LAYER_SCHEDULES)} (default uniform; "
                        "pyramid for pyramidkv)")
    g.add_argument("--pyramid-beta", type=float, default=None,
                   help="pyramid/funnel: the smallest layer gets about 1/beta of the average "
                        f"({DEFAULT_PYRAMID_BETA})")
    g.add_argument("--kv-bits", type=int, default=None,
                   help=f"store K/V quantized: {' or '.join(map(str, KV_BITS))} bits per value, per token and "
                        "group of channels, with an fp32 scale and zero point per group; or 16: 16-bit floats "
                        "(--kv-float) (default: the compute dtype); works with every policy")
    g.add_argument("--kv-float", default=None,
                   help=f"--kv-bits 16: {', '.join(KV_FLOATS)}. float16 as llama.cpp's default cache; bfloat16 "
                        "also runs decode attention's products in bfloat16 (fp32 sums and softmax, as a bfloat16 "
                        "model's attention), 2.5x fp32 over 4096 slots where the CPU has bfloat16 dot products "
                        "(a speculative verification's K + 1 queries); auto (default): bfloat16 with --speculate "
                        "on a CPU with AVX512-BF16 or AMX, else float16")
    g.add_argument("--kv-group-size", type=int, default=None,
                   help="--kv-bits: channels per scale / zero point; must divide the head dimension (default: "
                        "the head dimension, one group per token and head)")
    g.add_argument("--capacity-buckets", default=None,
                   help="allocate slots in a few sizes so one compiled step serves many prompt lengths: off "
                        "(default: exact), x2 / x4 (powers of 2 / 4 from 256 slots, at most the model's "
                        "length) or sizes such as 1024,4096; only room that is never evicted into is rounded "
                        "up (full, snapkv, pyramidkv, or a sequence the budget holds whole), so nothing kept "
                        "changes; an evicting budget stays exact")
    g.add_argument("--pos-shift", action="store_true", default=None,
                   help="StreamingLLM's positions: RoPE at each token's rank among the cached tokens (keys "
                        "stored before RoPE), so an evicting cache decodes past the model's maximum length")
    add_param_flags(g)
    g.add_argument("--cache-config", default=None,
                   help=f"YAML preset from cache_configs/ ({', '.join(available_presets())}); "
                        "flags override it")
    add_tier_args(parser)


def add_param_flags(group: argparse._ArgumentGroup) -> None:
    """A flag per method hyper-parameter (PARAMS), default None so that given flags can be told apart; the
    help lists every policy and compressor that uses it, with its default."""
    for p, users in _DECLARED.values():
        p.add_flag(group, flag_help(p, users))


def available_presets() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def load_preset(name: str) -> dict[str, Any]:
    """A preset = a set of flags (keys with dashes or underscores). NAME or a path to a .yaml file."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else CONFIG_DIR / f"{name}.yaml"
    if not path.exists():
        raise KVFastError(f"unknown cache preset {name!r} (available: {', '.join(available_presets())})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise KVFastError(f"cache preset {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise KVFastError(f"cache preset {path} must be a mapping of flags to values")
    preset = {str(key).replace("-", "_"): value for key, value in raw.items()}
    unknown = sorted(set(preset) - set(PARAMS) - set(GLOBALS))
    if unknown:
        raise KVFastError(f"cache preset {path.name} has unknown keys {unknown}")
    return preset


@dataclass
class CacheSpec:
    """What the user asked for: the policy, its compressor, budgets and explicitly given hyper-parameters."""

    policy: str = "full"
    prompt_compression: str | None = None
    budget: float | None = None
    layer_budget: str | None = None
    pyramid_beta: int | None = None
    params: dict[str, Any] = field(default_factory=dict)
    kv_bits: int | None = None
    kv_float: str | None = None
    kv_group_size: int | None = None
    capacity_buckets: str | None = None
    cli: set[str] = field(default_factory=set)  # keys given on the command line (they beat the preset)
    tiers: dict[str, Any] = field(default_factory=dict)  # kv.tiers flags given (warm_tokens turns them on)
    pos_shift: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CacheSpec:
        cli = {k: getattr(args, k) for k in (*GLOBALS, *PARAMS) if getattr(args, k, None) is not None}
        preset = load_preset(args.cache_config) if getattr(args, "cache_config", None) else {}
        chosen = POLICIES.get({**preset, **cli}.get("cache", "full"))
        fills = chosen is not None and chosen.window_fills_capacity
        if fills and "cache_budget" in cli and "recent_window" in preset and "recent_window" not in cli:
            # a window's capacity is n_sinks + recent window: a budget from the command line replaces it;
            # other policies keep the preset's recent window inside the new budget
            del preset["recent_window"]
        merged = {**preset, **cli}
        return cls(policy=merged.get("cache", "full"), prompt_compression=merged.get("prompt_compression"),
                   budget=merged.get("cache_budget"), layer_budget=merged.get("layer_budget"),
                   pyramid_beta=merged.get("pyramid_beta"),
                   params={k: v for k, v in merged.items() if k in PARAMS}, cli=set(cli),
                   kv_bits=merged.get("kv_bits"), kv_float=merged.get("kv_float"),
                   kv_group_size=merged.get("kv_group_size"),
                   capacity_buckets=merged.get("capacity_buckets"), tiers={k: merged[k] for k in TIER_FLAGS if k in merged},
                   pos_shift=bool(merged.get("pos_shift")))

    def resolve(self) -> tuple[type[KVCache], type | None, dict[str, Any]]:
        """Validate names, unused flags and values; return (policy class, compressor class, all
        parameters)."""
        if self.policy not in POLICIES:
            raise KVFastError(f"unknown cache policy {self.policy!r} (choose from {', '.join(POLICIES)})")
        policy = POLICIES[self.policy]
        if self.prompt_compression is not None and self.prompt_compression not in PROMPT_COMPRESSORS:
            raise KVFastError(f"unknown prompt compressor {self.prompt_compression!r} "
                              f"(choose from {', '.join(PROMPT_COMPRESSORS)})")
        name = self.prompt_compression or policy.default_prompt_compressor
        compressor = PROMPT_COMPRESSORS[name] if name else None
        used = set(policy.params) | set(compressor.params if compressor else ())
        if not policy.compresses:
            given = [k for k, v in (("prompt_compression", self.prompt_compression),
                                    ("cache_budget", self.budget), ("layer_budget", self.layer_budget))
                     if v is not None]
            if given:
                raise KVFastError(f"--{_flag(given[0])} is not used by --cache full (it never compresses)")
        if self.pyramid_beta is not None and self.schedule() == "uniform":
            raise KVFastError("--pyramid-beta is only used with --layer-budget pyramid or funnel")
        for key in self.params:
            if key not in used:
                where = "" if key in self.cli else " (set by the --cache-config preset)"
                comp = f" / --prompt-compression {name}" if compressor else ""
                raise KVFastError(f"--{_flag(key)}{where} is not used by --cache {self.policy}{comp}")
        policy.check_params(self.params)
        values = {**(compressor.params.defaults() if compressor else {}), **policy.params.defaults()}
        values.update({k: PARAMS[k].validate(v) for k, v in self.params.items()})
        if self.budget is not None:
            number("cache_budget", self.budget)
        if self.layer_budget is not None:
            choice(*LAYER_SCHEDULES)("layer_budget", self.layer_budget)
        if self.pyramid_beta is not None:
            whole(1)("pyramid_beta", self.pyramid_beta)
        if self.kv_bits is not None and self.kv_bits not in (*KV_BITS, 16):
            raise KVFastError(f"--kv-bits must be {', '.join(map(str, KV_BITS))} or 16, got {self.kv_bits}")
        if self.kv_float is not None:
            choice(*KV_FLOATS)("kv_float", self.kv_float)
            if self.kv_bits != 16:
                raise KVFastError("--kv-float is only used with --kv-bits 16")
        if self.kv_group_size is not None:
            if self.kv_bits in (None, 16):
                raise KVFastError("--kv-group-size is only used with --kv-bits 8 or 4")
            whole(1)("kv_group_size", self.kv_group_size)
        if self.capacity_buckets is not None:
            parse_buckets(str(self.capacity_buckets))
            if self.tiers or policy.shared_pool:
                what = "the tiers' recall slots" if self.tiers else f"{self.policy}'s pool (H_kv x budget)"
                raise KVFastError(f"--capacity-buckets cannot round up {what}: the slots are the budget")
        if self.tiers:
            if "warm_tokens" not in self.tiers:
                raise KVFastError(f"--{_flag(next(iter(self.tiers)))} needs --warm-tokens (it turns the tiers on)")
            check_tiers_for(policy)
        if self.pos_shift and (self.tiers or not policy.supports_pos_shift):
            why = ("recalled pages have no rank among the hot tokens" if self.tiers and policy.supports_pos_shift
                   else "it never evicts, so every rank is the position" if not policy.compresses
                   else "its statistics or per-head budgets need each token's own position")
            raise KVFastError(f"--pos-shift does not apply to --cache {self.policy}{' with tiers' * bool(self.tiers)}: {why}")
        return policy, compressor, values

    def schedule(self) -> str:
        """--layer-budget, else the one the prompt compressor implies (pyramidkv), else the policy's."""
        if self.layer_budget is not None:
            return self.layer_budget
        policy = POLICIES.get(self.policy)
        name = self.prompt_compression or getattr(policy, "default_prompt_compressor", None)
        compressor = PROMPT_COMPRESSORS.get(name or "")
        for cls in (compressor, policy):
            if cls is not None and cls.default_layer_budget != "uniform":
                return cls.default_layer_budget
        return "uniform"


def check_cache_args(args: argparse.Namespace) -> None:
    """Fail fast on bad names and flags, before a model is loaded (lengths are checked by the factory)."""
    CacheSpec.from_args(args).resolve()


def cache_factory_from_args(args: argparse.Namespace, batch_size: int, model_args: ModelArgs, prompt_len: int,
                            max_new_tokens: int, dtype: torch.dtype = torch.float32,
                            device: str | torch.device = "cpu", tokenizer: Any = None) -> CacheFactory:
    spec = CacheSpec.from_args(args)
    return CacheFactory(spec, batch_size, model_args, prompt_len, max_new_tokens, dtype, device, tokenizer)


def make_cache_factory(policy: str = "full", batch_size: int = 1, model_args: ModelArgs | None = None,
                       prompt_len: int = 0, max_new_tokens: int = 0, *, prompt_compression: str | None = None,
                       budget: float | None = None, layer_budget: str | None = None,
                       pyramid_beta: int | None = None, kv_bits: int | None = None, kv_float: str | None = None,
                       kv_group_size: int | None = None, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", tokenizer: Any = None, tiers: dict | None = None,
                       capacity_buckets: str | None = None, pos_shift: bool = False, **params: Any) -> CacheFactory:
    """make_cache(layer) for Transformer.setup_caches; params are hyper-parameters by name (n_sinks=4,
    ...); the tokenizer is for compressors that write text (KVzip's instruction)."""
    given = set(params) | ({"cache_budget"} if budget is not None else set())
    spec = CacheSpec(policy, prompt_compression, budget, layer_budget, pyramid_beta, params, kv_bits=kv_bits,
                     kv_float=kv_float, kv_group_size=kv_group_size, capacity_buckets=capacity_buckets, cli=given,
                     tiers=tiers or {}, pos_shift=pos_shift)
    model_args = model_args or ModelArgs()
    return CacheFactory(spec, batch_size, model_args, prompt_len, max_new_tokens, dtype, device, tokenizer)


class CacheFactory:
    """Resolves capacities per layer and validates them against the policy; calling it builds one layer's
    cache.

    Attributes: policy, prompt_compression, layer_budget, capacities / prompt_capacities (per layer),
    values (the resolved hyper-parameters)."""

    def __init__(self, spec: CacheSpec, batch_size: int, model_args: ModelArgs, prompt_len: int,
                 max_new_tokens: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tokenizer: Any = None):
        self.cls, self.compressor_cls, self.values = spec.resolve()
        self.tokenizer = tokenizer
        self.policy = spec.policy
        self.prompt_compression = self.compressor_cls.name if self.compressor_cls else None
        self.layer_budget = spec.schedule()
        self.batch_size, self.model_args, self.dtype, self.device = batch_size, model_args, dtype, device
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        # --kv-bits 16 stores 16-bit floats (no codes); 8 / 4 store codes
        self.kv_bits = spec.kv_bits if spec.kv_bits != 16 else None
        self.kv_dtype = kv_float_dtype(spec.kv_float or "auto", device) if spec.kv_bits == 16 else None
        self.kv_group_size = spec.kv_group_size or model_args.head_dim
        self.pos_shift = spec.pos_shift
        if self.kv_bits and model_args.head_dim % self.kv_group_size:
            raise KVFastError(f"--kv-group-size {self.kv_group_size} does not divide the head dimension "
                              f"{model_args.head_dim}")
        if self.kv_bits == 4 and model_args.head_dim % 2:
            raise KVFastError(f"--kv-bits 4 packs two channels per byte: the head dimension {model_args.head_dim} "
                              "must be even")
        beta = int(spec.pyramid_beta or DEFAULT_PYRAMID_BETA)
        total, n_layers = prompt_len + max_new_tokens, model_args.n_layers
        window_param = self.compressor_cls.window_param if self.compressor_cls else None
        window = self.values[window_param] if window_param else 0  # e.g. SnapKV's observation window
        n_sinks = self.values.get("n_sinks", self.cls.n_sinks)
        recent = self.values.get("recent_window", self.cls.recent_window)

        self.capacity_buckets = spec.capacity_buckets
        buckets = parse_buckets(str(spec.capacity_buckets or "off"))
        room = partial(bucket_capacity, buckets=buckets, limit=model_args.max_seq_len)  # allocated slots
        if not self.cls.compresses:
            self.prompt_capacities = [total] * n_layers
            self.capacities = [room(total)] * n_layers
        elif self.cls.evicts:
            if self.cls.window_fills_capacity:
                if spec.budget is not None and "recent_window" in spec.cli and "cache_budget" in spec.cli:
                    raise KVFastError("window: give --cache-budget or --recent-window, not both "
                                      "(capacity = n_sinks + recent window)")
                if spec.budget is None:
                    average = min(total, n_sinks + resolve_count(recent, total))
                else:
                    average = resolve_capacity(spec.budget, total)
                protected = n_sinks + 1  # the rest of every layer is its recent window
            else:
                average = resolve_capacity(spec.budget, total)
                protected = n_sinks + max(resolve_count(recent, average), window)
            protected = min(protected, average)
            caps = layer_capacities(self.layer_budget, average, n_layers, protected, total, beta)
            # a budget the sequence fits in never evicts: its slots may be rounded up to the bucket (at most
            # to the budget), the rest is the method's budget, exact
            if spec.budget is not None and spec.budget > 1:
                asked = int(spec.budget)
            elif spec.budget is None and self.cls.window_fills_capacity:
                asked = n_sinks + resolve_count(recent, total)
            else:  # a fraction: the sequence fits only at 1.0, which means exactly the sequence
                asked = total
            self.capacities = self.prompt_capacities = [min(c, total) if c < total else max(total, min(asked, room(total)))
                                                        for c in caps]
        else:  # append-only: the prompt gets the budget minus one slot per new token
            average = resolve_capacity(spec.budget, total)
            if average - max_new_tokens < 1:
                raise KVFastError(f"--cache-budget gives {average} slots but {self.policy} keeps every new "
                                  f"token: it needs more than --max-new-tokens ({max_new_tokens})")
            caps = layer_capacities(self.layer_budget, average - max_new_tokens, n_layers,
                                    min(n_sinks + window, average - max_new_tokens), prompt_len, beta)
            self.prompt_capacities = [min(c, prompt_len) if prompt_len else c for c in caps]
            self.capacities = [room(c + max_new_tokens) for c in self.prompt_capacities]
        self.tiers, self.recall_slots = None, 0
        if spec.tiers:  # the recall slots come out of each layer's budget: the policy manages the rest
            t = spec.tiers
            self.tiers = resolve_tiers(t, total=total, hot_budget=min(self.capacities), kv_bits=self.kv_bits)
            self.recall_slots = self.tiers.recall_slots
            self.prompt_capacities = [min(p, c - self.recall_slots - (0 if self.cls.evicts else max_new_tokens))
                                      for p, c in zip(self.prompt_capacities, self.capacities)]
        self.layer_values = [self._layer_values(layer, n_sinks, recent, window) for layer in range(n_layers)]

    def _layer_values(self, layer: int, n_sinks: int, recent: float, window: int) -> dict[str, Any]:
        """The policy's hyper-parameters for one layer, windows resolved to tokens, checked against
        capacity."""
        cap, prompt_cap = self.capacities[layer] - self.recall_slots, self.prompt_capacities[layer]
        values = {k: v for k, v in self.values.items() if k in self.cls.params}
        total = self.prompt_len + self.max_new_tokens
        evicting = self.cls.evicts and total > cap
        if "recent_window" in values:
            window_rest = max(cap - n_sinks, 1 if not evicting else 0)  # window: all that is not a sink
            fills = self.cls.window_fills_capacity
            values["recent_window"] = window_rest if fills else resolve_count(recent, cap)
            recent = values["recent_window"]
        where = f" (layer {layer})" if len(set(self.capacities)) > 1 else ""
        compresses = self.compressor_cls is not None and self.prompt_len > prompt_cap
        if self.cls.shared_pool and (evicting or compresses):
            self._check_pool(cap, n_sinks, recent, window if compresses else 0, where)
        if evicting and (cap < n_sinks + recent or recent < 1):
            raise KVFastError(f"--cache-budget gives {cap} slots{where}, fewer than {self.policy} needs: "
                              f"n_sinks ({n_sinks}) + recent_window ({max(recent, 1)})")
        if compresses and prompt_cap < n_sinks + max(window, recent - 1):
            kept = f"n_sinks ({n_sinks}) + " + (f"obs_window ({window})" if window >= recent - 1 else
                                                 f"recent_window - 1 ({recent - 1})")
            raise KVFastError(f"--cache-budget leaves {prompt_cap} prompt slots{where}, fewer than the "
                              f"{kept} that {self.prompt_compression} prompt compression always keeps")
        if "drop_interval" in values:
            values["drop_interval"] = self._drop_interval(n_sinks)
        return values

    def _check_pool(self, cap: int, n_sinks: int, recent: int, window: int, where: str) -> None:
        """A pool policy needs, per KV head, the prompt's protected tokens (n_sinks + window) and, while
        decoding, its sinks and recent window with one slot to evict from (n_sinks + recent_window): the
        per-head floor; the pool (H_kv x --cache-budget) must hold it for every head."""
        heads = self.model_args.n_kv_heads
        floor = n_sinks + max(window, recent)
        if cap < floor:
            parts = (f"n_sinks ({n_sinks}) + max(obs_window ({window}), recent_window ({recent}))" if window
                     else f"n_sinks ({n_sinks}) + recent_window ({recent})")
            raise KVFastError(f"--cache-budget gives {cap} slots per KV head{where}, a pool of "
                              f"{cap * heads}, below {self.policy}'s per-head floor {floor} = {parts} x {heads} "
                              f"KV heads = {floor * heads}")

    def _drop_interval(self, n_sinks: int) -> int:
        """One re-ranking interval m for all layers (decode.Decoder reads layer 0's): a queue of m slots
        that stay evictable until the next refresh: at most C - n_sinks - (recent_window - 1) per layer.
        A fraction (the default 0.5) is clamped to that; a number of steps that exceeds it is an error."""
        managed = [c - self.recall_slots for c in self.capacities]
        smallest = min(managed)
        value = self.values["drop_interval"]
        m = resolve_count(value, smallest)
        recent = self.values["recent_window"]
        room = min(c - n_sinks - (resolve_count(recent, c) - 1) for c in managed)
        if value < 1:
            m = max(1, min(m, room))
        elif self.cls.evicts and self.prompt_len + self.max_new_tokens > smallest and m > room:
            raise KVFastError(f"--drop-interval {m} is larger than the budget allows: at most {room} slots "
                              f"are evictable between refreshes (capacity {smallest} - n_sinks - recent "
                              "window + 1)")
        return min(m, smallest)

    def __call__(self, layer: int) -> KVCache:
        compressor = None
        if self.compressor_cls is not None:
            params = {k: v for k, v in self.values.items() if k in self.compressor_cls.params}
            compressor = self.compressor_cls(layer=layer, model_args=self.model_args, **params)
            if self.tokenizer is not None:
                compressor.bind(self.tokenizer)
        a = self.model_args
        cls, tiers = (tiered(self.cls), {"tiers": self.tiers}) if self.tiers else (self.cls, {})
        cls = shifted(cls) if self.pos_shift else cls  # streaming positions, composed like tiers
        cache = cls(self.batch_size, a.n_kv_heads, a.head_dim, self.capacities[layer],
                    n_groups=a.n_heads // a.n_kv_heads, prompt_capacity=self.prompt_capacities[layer],
                    compressor=compressor, layer=layer, dtype=self.dtype, device=self.device,
                    kv_bits=self.kv_bits, kv_group_size=self.kv_group_size if self.kv_bits else None,
                    kv_dtype=self.kv_dtype, model_args=a, **tiers, **self.layer_values[layer])
        if self.tokenizer is not None:
            cache.bind(self.tokenizer)
        return cache

    def describe(self) -> str:
        caps = sorted(set(self.capacities))
        cap = str(caps[0]) if len(caps) == 1 else f"{caps[0]}..{caps[-1]} ({self.layer_budget})"
        # a None default means "not set" (hybrid's static_threshold / static_share): left out
        params = ", ".join(f"{_flag(k)} {v}" for k, v in sorted(self.layer_values[0].items())
                           if v is not None)
        comp = f" + {self.prompt_compression} prompt compression" if self.prompt_compression else ""
        quant = (f"; K/V stored as {self.kv_bits}-bit codes, fp32 scale + zero point per {self.kv_group_size} "
                 "channels" if self.kv_bits else f"; K/V stored as {str(self.kv_dtype)[6:]}" if self.kv_dtype else "")
        pool = (f"; slots per KV head on average, one pool of {self.model_args.n_kv_heads} x that per layer "
                "shared by the KV heads" if self.cls.shared_pool else "")
        t = self.tiers
        tiers = (f"; tiers: {t.recall_slots} of the slots hold recalled pages (recall every {t.recall_interval} "
                 f"positions, up to {t.recall_installs} new pages each), warm store {t.warm_pages} pages x {t.page_size} tokens at {t.warm_bits} bits per "
                 "row and KV head" if t else "")
        if self.capacity_buckets not in (None, "off"):
            cap += f" (allocated in --capacity-buckets {self.capacity_buckets})"
        shift = "; positions = ranks among the cached tokens (--pos-shift)" if self.pos_shift else ""
        return (f"cache: {self.policy}{comp}, capacity per layer {cap} slots{pool}"
                + (f"; {params}" * bool(params)) + quant + tiers + shift)


def setup_decode_benchmark(model: torch.nn.Module, policy: str, context_len: int, max_new_tokens: int = 1,
                           batch_size: int = 1, seed: int = 0, **kwargs: Any) -> CacheFactory:
    """Install `policy` caches on `model` as if `context_len` tokens had been processed (random K/V,
    statistics plausible), so a decode step at that context can be timed without a prefill. kwargs:
    make_cache_factory's (budget=..., layer_budget=..., hyper-parameters). The next decode position is
    `context_len`."""
    p = next(model.parameters())
    factory = make_cache_factory(policy, batch_size, model.args, context_len, max_new_tokens, dtype=p.dtype,
                                 device=p.device, **kwargs)
    model.setup_caches(factory)
    generator = torch.Generator().manual_seed(seed)
    for c in model.caches:
        c.fill_synthetic(context_len, generator)
    return factory
