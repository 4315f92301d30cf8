"""Writing and reading the JSON records between stages: atomic, versioned, never executing content."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from specdec_tune import SpecdecError


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write via a temp file in the same folder and rename: readers see the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, record: Any) -> None:
    atomic_write_bytes(path, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file, turning every failure into one line naming the file."""
    path = Path(path)
    if not path.exists():
        raise SpecdecError(f"{what} not found: {path}", "check the path, or run the stage that writes it")
    if not path.is_file():
        raise SpecdecError(f"{what} is not a file: {path}", "pass the JSON file itself")
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SpecdecError(f"cannot read {what} {path}: {e}", "check its permissions") from None
    except json.JSONDecodeError as e:
        raise SpecdecError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno})", "re-create it") from None


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()
