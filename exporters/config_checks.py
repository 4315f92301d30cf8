"""An engine's config against what it must hold: its versioned JSON Schema (schemas/), the engine's cross-field rules
at the targeted version, and, given the written files and what they should run, the engine's own code where it runs
here (native_checks.py). The record says which of them ran."""

from __future__ import annotations

from pathlib import Path

import jsonschema

from specdec_tune.exporters.engines import Engine, load_schema
from specdec_tune.exporters.native_checks import EngineMissing, Facts


def check_document(
    engine: Engine, document: dict | None, version: str, folder: Path | None = None, facts: Facts | None = None
) -> dict:
    """One engine's config: its JSON Schema and its rules at `version`, and, given the written files' folder and what
    they should run, the engine's own code where it runs here (engine_checks.py); the record says which ran."""
    if document is None:
        return {"engine": engine.name, "checked_with": "nothing to check (no config for this plan)", "errors": []}
    errors = [
        f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
        for e in jsonschema.Draft202012Validator(load_schema(engine)).iter_errors(document)
    ]
    errors += engine.rules(document, version)
    record = {
        "engine": engine.name,
        "checked_with": f"JSON Schema {engine.schema} + the cross-field rules of {engine.name} {version}",
    }
    if engine.native_check is not None and folder is not None and facts is not None:
        try:
            native = engine.native_check(document, folder, facts)
        except EngineMissing as e:
            record["engine_code"] = f"not run: {e}"
        else:
            record["engine_code"] = native["checked_with"]
            errors += native["errors"]
            record |= {"engine_notes": native["notes"]} if native.get("notes") else {}
    return record | {"errors": errors}
