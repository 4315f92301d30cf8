"""Training text read from the Python installation itself: package descriptions, documentation and standard-library
source.

Draft heads learn the target's next-token distribution; the text only has to look like what the target is asked to
continue (prose, instructions, code), and nothing may be downloaded. Three kinds, interleaved so a short budget still
sees all of them:

  prose  every installed distribution's METADATA (its README) and the *.md / *.rst / *.txt files shipped in packages
  code   the standard library's *.py modules

Files are visited in an order fixed by a hash of their path (not by package name), each contributes at most
`max_chunks_per_file` windows of `chunk_tokens` tokens, and the whole selection is fingerprinted by its token ids.
"""

from __future__ import annotations

import hashlib
import site
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MIN_CHARS = 400  # shorter files are mostly licences, stubs and changelog fragments
SKIP_NAMES = (
    "license",
    "licence",
    "copying",
    "notice",
    "authors",
    "record",
    "top_level",
    "entry_points",
    "requirements",
)


def _ordered(paths: list[Path]) -> list[Path]:
    return sorted(paths, key=lambda p: hashlib.sha256(str(p.relative_to(p.anchor)).encode()).hexdigest())


def text_files() -> dict[str, list[Path]]:
    """{kind: files} for this interpreter's site-packages and standard library."""
    roots = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
    prose: list[Path] = []
    for root in roots:
        prose += root.glob("*.dist-info/METADATA")
        for ext in ("md", "rst", "txt"):
            prose += (p for p in root.rglob(f"*.{ext}") if ".dist-info" not in str(p))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [p for p in stdlib.glob("*.py") if not p.name.startswith("_")] + list(stdlib.glob("*/[!_]*.py"))
    keep = lambda p: p.is_file() and not any(s in p.name.lower() for s in SKIP_NAMES)  # noqa: E731
    return {
        "prose": _ordered([p for p in prose if keep(p)]),
        "code": _ordered([p for p in code if keep(p) and "test" not in str(p.parent.name)]),
    }


def _windows(tokenizer, path: Path, chunk_tokens: int, max_chunks: int) -> Iterator[list[int]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return
    if len(text) < MIN_CHARS:
        return
    ids = tokenizer(text[: chunk_tokens * max_chunks * 8], add_special_tokens=False)["input_ids"]
    for start in range(0, min(len(ids), chunk_tokens * max_chunks), chunk_tokens):
        window = ids[start : start + chunk_tokens]
        if len(window) >= chunk_tokens // 4:
            yield window


def package_text(
    tokenizer, total_tokens: int, chunk_tokens: int = 512, max_chunks_per_file: int = 4, prose_share: float = 0.7
) -> list[list[int]]:
    """About `total_tokens` tokens as windows of at most `chunk_tokens`, `prose_share` of them prose, the rest code."""
    files = text_files()
    want = {"prose": int(total_tokens * prose_share), "code": total_tokens - int(total_tokens * prose_share)}
    out: list[list[int]] = []
    for kind, paths in files.items():
        got = 0
        for path in paths:
            for window in _windows(tokenizer, path, chunk_tokens, max_chunks_per_file):
                if got >= want[kind]:
                    break
                out.append(window)
                got += len(window)
            if got >= want[kind]:
                break
    return out


__all__ = ["package_text", "text_files"]
