"""Speed and memory, side by side in one run: every figure is read against a baseline measured in the same run.

    python bench.py                                 # the engine bench (HF vs our eager vs our compiled decode)
    python bench.py engine --prompt-len 512 2048    # one bench with its own flags: bench.py engine --help
    python bench.py policies --lengths 4096
    python bench.py all                             # every bench, one after another

Each subcommand takes the flags it uses; --checkpoint, --repeats and --json are every bench's. Markdown tables go
to stdout, each with the CPU it ran on; everything measured goes to --json. The earlier form
`bench.py --section X [flags]` still runs X.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

from benchmarks import (
    batch,
    contexts,
    engine,
    kv_bits,
    longctx,
    policies,
    prefill,
    quantize,
    ragged,
    speculate,
    tiers,
    tp,
)
from benchmarks import compile as compile_bench
from benchmarks.common import Bench, cpu_summary, write_json
from cli import DEFAULT_CHECKPOINT, ArgumentParser, resolve_checkpoint, run_cli
from decode import configure_torch
from model import Transformer

BENCHES: dict[str, Bench] = {  # `all` runs them in this order
    "engine": engine.BENCH, "policies": policies.BENCH, "kv-bits": kv_bits.BENCH, "quantize": quantize.BENCH,
    "prefill": prefill.BENCH, "tiers": tiers.BENCH, "speculate": speculate.BENCH, "batch": batch.BENCH,
    "ragged": ragged.BENCH, "tp": tp.BENCH, "longctx": longctx.BENCH, "compile": compile_bench.BENCH,
    "contexts": contexts.BENCH,
}
DEFAULT = "engine"


def shared_flags(suppress: bool = False) -> ArgumentParser:
    """--checkpoint, --repeats, --json: on the main parser with their defaults, and on every subcommand with none
    (suppress), so that they can be given before or after the subcommand."""
    p = ArgumentParser(add_help=False)
    g = p.add_argument_group("every bench")
    defaults = {"checkpoint": DEFAULT_CHECKPOINT, "repeats": 5, "json": Path("bench_results.json")}
    if suppress:
        defaults = dict.fromkeys(defaults, argparse.SUPPRESS)
    g.add_argument("--checkpoint", type=Path, default=defaults["checkpoint"],
                   help="checkpoint folder or weights file (the default model is prepared on first use)")
    g.add_argument("--repeats", type=int, default=defaults["repeats"],
                   help="repeats per measurement (the median is reported)")
    g.add_argument("--json", type=Path, default=defaults["json"], help="where to write all figures")
    return p


def described(flag_help: str, default: object) -> str:
    """A flag's help with its default, where it has one worth showing."""
    if default is None or default is False or default == []:
        return flag_help
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    return f"{flag_help} (default: {shown})"


def add_subcommand(subs: argparse._SubParsersAction, name: str, doc: str, flags: dict[str, tuple[dict, object, str]],
                   extras: list) -> None:
    """flags: name -> (argparse keywords, default, help)."""
    summary = doc.split("\n\n")[0].strip('"').replace("\n", " ").removeprefix(f"bench.py {name}: ")
    p = subs.add_parser(name, help=summary, description=doc,
                        parents=[shared_flags(suppress=True)], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group(f"{name} flags")
    for key, (kwargs, default, flag_help) in flags.items():
        g.add_argument("--" + key.replace("_", "-"), default=default, help=flag_help, **kwargs)
    for extra in extras:
        extra(p)


def parser() -> ArgumentParser:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       parents=[shared_flags()])
    subs = p.add_subparsers(dest="bench", metavar="SUBCOMMAND", parser_class=ArgumentParser)
    for name, bench in BENCHES.items():
        add_subcommand(subs, name, bench.doc, {k: (f.keywords(k), f.default, described(f.help, f.default))
                                               for k, f in bench.flags.items()},
                       [bench.extra_flags] if bench.extra_flags else [])
    # all: every bench's flags; one not given takes each bench's own default
    union: dict[str, tuple[dict, object, str]] = {}
    for name, bench in BENCHES.items():
        for k, f in bench.flags.items():
            kwargs, _, text = union.get(k, (f.keywords(k), None, ""))
            union[k] = (kwargs, None, f"{text}; " * bool(text) + f"{name}: {described(f.help, f.default)}")
    add_subcommand(subs, "all", "bench.py all: every bench, one after another (engine first, compile last)",
                   union, [b.extra_flags for b in BENCHES.values() if b.extra_flags])
    return p


def translate(argv: list[str]) -> list[str]:
    """The earlier `--section X` form as the subcommand X (with a hint on stderr); no subcommand: engine."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--section" or arg.startswith("--section="):
            value = arg.partition("=")[2] if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + (1 if "=" in arg else 2)]
            print(f"hint: bench.py --section {value} is now bench.py {value}", file=sys.stderr)
            return [value, *argv]
    if not any(a in BENCHES or a in ("all", "-h", "--help") for a in argv) and (not argv or argv[0][0] == "-"):
        return [DEFAULT, *argv]
    return argv


def bench_args(args: argparse.Namespace, bench: Bench) -> argparse.Namespace:
    """args for one bench: its flags that were not given (under `all`) take its defaults."""
    out = argparse.Namespace(**copy.deepcopy(vars(args)))  # a bench may change its lists; `all` runs several
    for key, flag in bench.flags.items():
        if getattr(out, key) is None:
            setattr(out, key, flag.default)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(translate(sys.argv[1:] if argv is None else argv))
    chosen = BENCHES if args.bench == "all" else {args.bench: BENCHES[args.bench]}
    runs = {name: bench_args(args, bench) for name, bench in chosen.items()}
    for name, bench in chosen.items():  # bad flags fail before the model loads
        if bench.check:
            bench.check(runs[name])
    configure_torch(compile=True)
    torch.manual_seed(0)
    checkpoint = resolve_checkpoint(args.checkpoint)
    needs_model = any(bench.needs_model for bench in chosen.values())
    model = Transformer.from_checkpoint(checkpoint) if needs_model else None
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_summary()}
    for name, bench in chosen.items():
        out[name.replace("-", "_")] = bench.run(model if bench.needs_model else None, checkpoint, runs[name])
    write_json(args.json, out)


if __name__ == "__main__":
    sys.exit(run_cli(main))
