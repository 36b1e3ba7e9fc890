"""Fetch the offline evaluation texts from Debian's archive into data/ (git-ignored; nothing is installed).

    python scripts/fetch_data.py            # both sources
    python scripts/fetch_data.py jargon     # just one

- jargon: the Jargon File 4.4.7 (public domain), package `jargon-text`; eval.py reads
  data/jargon-text/usr/share/doc/jargon-text/jargon.txt.gz directly.
- kjv: the King James Bible (public domain), packages `bible-kjv-text` (its compressed data file) and
  `bible-kjv` (the `bible` program that decodes it); the whole text is decoded once into data/kjv.txt,
  one chapter per paragraph, without verse numbers.

`apt-get download` fetches the .deb files without installing them and `dpkg-deb -x` unpacks them; if apt's
package lists are missing or stale, `apt-get update` runs once first (as root, like the rest of the setup).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
PACKAGES = {"jargon": ["jargon-text"], "kjv": ["bible-kjv-text", "bible-kjv"]}


def run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def download(packages: list[str], debs: Path) -> None:
    debs.mkdir(parents=True, exist_ok=True)
    missing = [p for p in packages if not list(debs.glob(f"{p}_*.deb"))]
    if not missing:
        return
    result = run(["apt-get", "download", *missing], cwd=debs)
    if result.returncode != 0:  # no package lists yet (fresh container): update once and retry
        update = run(["apt-get", "update"])
        if update.returncode != 0:
            raise RuntimeError(f"apt-get update failed: {update.stderr.strip().splitlines()[-1:]}")
        result = run(["apt-get", "download", *missing], cwd=debs)
    if result.returncode != 0:
        raise RuntimeError(f"apt-get download {' '.join(missing)} failed: {result.stderr.strip()}")


def unpack(package: str, debs: Path, data_dir: Path) -> Path:
    target = data_dir / package
    if not target.exists():
        deb = max(debs.glob(f"{package}_*.deb"))
        tmp = data_dir / f".{package}.partial"
        subprocess.run(["rm", "-rf", str(tmp)], check=True)
        result = run(["dpkg-deb", "-x", str(deb), str(tmp)])
        if result.returncode != 0:
            raise RuntimeError(f"dpkg-deb -x {deb.name} failed: {result.stderr.strip()}")
        tmp.rename(target)
    return target


def decode_kjv(data_dir: Path) -> Path:
    """Run the packaged `bible` program over Genesis 1:1 - Revelation 22:21 and keep plain chapters."""
    out = data_dir / "kjv.txt"
    if out.exists():
        return out
    program = data_dir / "bible-kjv" / "usr" / "bin" / "bible"
    text_dir = data_dir / "bible-kjv-text" / "usr" / "lib"
    result = subprocess.run([str(program), "-p", str(text_dir), "-l", "1000000", "Gen1:1-Rev22:21"],
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if result.returncode != 0 or len(result.stdout) < 1_000_000:
        raise RuntimeError(f"the bible program failed: {result.stderr.strip() or 'short output'}")
    chapters, verses = [], []
    for line in result.stdout.splitlines():
        m = re.match(r"\s+\d+ (.*)", line)
        if m:
            verses.append(m.group(1).strip())
        elif line.strip():  # a "Book N" heading starts a chapter
            if verses:
                chapters.append(" ".join(verses))
            verses = []
            chapters.append(line.strip())
    if verses:
        chapters.append(" ".join(verses))
    tmp = out.with_suffix(".partial")
    tmp.write_text("\n\n".join(chapters) + "\n")
    tmp.rename(out)
    return out


def fetch(data_dir: Path = DATA_DIR, sources: list[str] | None = None) -> None:
    sources = sources or list(PACKAGES)
    for source in sources:
        if source not in PACKAGES:
            raise ValueError(f"unknown source {source!r} (choose from {', '.join(PACKAGES)})")
        debs = data_dir / "debs"
        download(PACKAGES[source], debs)
        for package in PACKAGES[source]:
            unpack(package, debs, data_dir)
        if source == "kjv":
            decode_kjv(data_dir)


def main(argv: list[str] | None = None) -> None:
    sources = (argv if argv is not None else sys.argv[1:]) or None
    try:
        fetch(DATA_DIR, sources)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"texts ready in {DATA_DIR}")


if __name__ == "__main__":
    main()
