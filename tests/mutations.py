"""Every place of a JSON record set, one at a time, to null, to a value of the wrong type or to an out-of-range value,
and what the tool then does with it: refuse it in one line, or carry it through to a bundle. A module of its own so
that worker processes (tests/test_properties.py runs the cases on every core) can import it."""

from __future__ import annotations

import copy
import json
import os
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

from specdec_tune import SpecdecError

Place = tuple  # the keys and list indices that lead to a value


def places(doc, prefix: Place = ()) -> Iterator[Place]:
    """Every place in a JSON document; of a list, its first item's (the others have the same record type)."""
    if prefix:
        yield prefix
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from places(value, (*prefix, key))
    elif isinstance(doc, list) and doc:
        yield from places(doc[0], (*prefix, 0))


def broken_values(value) -> Iterator[tuple[str, object]]:
    """(how, value): null; a value of another type (a string, or a number where a string was); out of range (a negative
    number, an empty string, list or object; a boolean has no range)."""
    yield "null", None
    yield "wrong type", 7 if isinstance(value, str) else "x"
    if value is not None and not isinstance(value, bool):
        yield "out of range", {int: -1, float: -1.5, str: "", list: [], dict: {}}[type(value)]


def cases(doc) -> list[tuple[Place, str, object]]:
    """Every place, broken one way: the ways taken in turn from place to place (so each way reaches about a third of
    the places, and every place is broken)."""
    out = []
    for i, place in enumerate(places(doc)):
        ways = list(broken_values(_at(doc, place)))
        out.append((place, *ways[i % len(ways)]))
    return out


def _at(doc, place: Place):
    for key in place:
        doc = doc[key]
    return doc


def broken(doc, place: Place, value) -> dict:
    out = copy.deepcopy(doc)
    _at(out, place[:-1])[place[-1]] = value
    return out


def worker_setup() -> None:
    """A worker only exports: Triton compiles the kernels natively there (in the interpreter the test process runs them
    in, each export starts a compiler process of its own). Its searches decide over 20 draws of the cost model, not
    200: what is tested is that a broken field is refused or exported, not which D wins."""
    from specdec_tune.autotune import cost_model

    os.environ.pop("TRITON_INTERPRET", None)
    cost_model.DRAWS = 20


def _one_line(e: SpecdecError) -> str:
    return "refused" if str(e) and "\n" not in str(e) else f"crash: a refusal of more than one line: {e!r}"


def plan_outcomes(plan: dict, profile: str, batch: list[tuple[Place, str, object]]) -> list[str]:
    """For each case: "refused" (load_plan, or export's own input checks, in one line), "exported" (a bundle with
    --configs-only and --no-onnx), or "crash: ..." with the traceback's last line."""
    from specdec_tune.autotune.plan_schema import load_plan
    from specdec_tune.pipeline.export import export
    from specdec_tune.settings import ExportSettings

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        for place, how, value in batch:
            path.write_text(json.dumps(broken(plan, place, value)))
            try:
                load_plan(path)
                export(
                    ExportSettings(
                        plan=path,
                        profile=Path(profile),
                        out=Path(tmp) / "bundle",
                        skip_measure=True,
                        onnx_drafter=False,
                    )
                )
                out.append("exported")
            except SpecdecError as e:
                out.append(_one_line(e))
            except Exception:  # noqa: BLE001 - what the test exists to find
                out.append(f"crash: {place} {how}: {traceback.format_exc().strip().splitlines()[-1]}")
    return out


def profile_outcomes(profile: dict, batch: list[tuple[Place, str, object]]) -> list[str]:
    """For each case: "refused" (load_profile, or the search that reads it first, in one line), "exported" (searched
    with a few trials, then a bundle with --configs-only and --no-onnx), or "crash: ...".

    A profile may be whole and still lack what a plan needs (a budget that skipped a drafter's draft cells): the search
    refuses that, naming it, which is the first place the profile is read for a plan."""
    from specdec_tune.autotune.search import search
    from specdec_tune.pipeline.export import export
    from specdec_tune.profiles.schema import load_profile
    from specdec_tune.records import sha256_file
    from specdec_tune.settings import ExportSettings, SearchSettings

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        for place, how, value in batch:
            path.write_text(json.dumps(broken(profile, place, value)))
            try:
                search(
                    load_profile(path),
                    sha256_file(path),
                    SearchSettings(seed=0, trials=5, out_dir=Path(tmp), storage="memory"),
                )
                export(
                    ExportSettings(
                        plan=Path(tmp) / "plan.json",
                        profile=path,
                        out=Path(tmp) / "bundle",
                        skip_measure=True,
                        onnx_drafter=False,
                    )
                )
                out.append("exported")
            except SpecdecError as e:
                out.append(_one_line(e))
            except Exception:  # noqa: BLE001 - what the test exists to find
                out.append(f"crash: {place} {how}: {traceback.format_exc().strip().splitlines()[-1]}")
    return out
