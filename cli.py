"""Plumbing every command-line entry shares (generate.py, eval.py, bench.py, quantize.py): one-line errors, the
default checkpoint, reading a prompt, loading a checkpoint with its tokenizer."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from model import KVFastError, Transformer

ROOT = Path(__file__).resolve().parent
DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "SmolLM2-135M-Instruct"


class ArgumentParser(argparse.ArgumentParser):
    """Bad flags end in one line ('error: ...') and exit code 2, like every other user error."""

    def error(self, message: str):
        raise KVFastError(message)


def run_cli(entry: Callable[[list[str] | None], object], argv: list[str] | None = None) -> int:
    """Run a CLI's main(); a user error is one line on stderr and exit code 2, never a traceback."""
    try:
        entry(argv)
    except KVFastError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def read_prompt(prompt: str) -> str:
    """The prompt itself, or with @FILE the file's text."""
    if not prompt.startswith("@"):
        return prompt
    path = Path(prompt[1:])
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KVFastError(f"cannot read prompt file {path}: {e.strerror if isinstance(e, OSError) else e}")


def resolve_checkpoint(path: Path) -> Path:
    """The default checkpoint is prepared on first use; any other is taken as given."""
    if path == DEFAULT_CHECKPOINT and not (path / "config.json").exists():
        from scripts.prepare import prepare_default  # downloads and converts: only on first use

        print("preparing the default model (first use)...", file=sys.stderr)
        return prepare_default(ROOT)
    return path


def load(checkpoint: Path, device: str, dtype: torch.dtype):
    """(model, tokenizer) of a checkpoint folder or weights file; a missing or bad tokenizer is one line."""
    from tokenizer import load_tokenizer

    model = Transformer.from_checkpoint(checkpoint, device=device, dtype=dtype)
    folder = checkpoint if checkpoint.is_dir() else checkpoint.parent
    try:
        tokenizer = load_tokenizer(folder)
    except (OSError, ValueError) as e:  # missing files, bad JSON, bad tokenizer model
        raise KVFastError(f"cannot load the tokenizer of {folder}: {e}") from None
    return model, tokenizer
