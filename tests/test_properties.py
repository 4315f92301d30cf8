"""Property-based tests (hypothesis) on every loader of outside input: a profile, a plan, a bundle manifest,
a calibration JSONL file and a model's config.json. Whatever the bytes, a loader either returns a value the
rest of the tool can use or raises SpecdecError (one line at the CLI); nothing else escapes. The schedule
translations between engines have their own round-trip properties in test_export.py."""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec_tune import SpecdecError
from specdec_tune.autotune.plan_schema import load_plan
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.exporters.bundle import read_manifest
from specdec_tune.pipeline.bundle_checks import validate_bundle
from specdec_tune.pipeline.export import export
from specdec_tune.profiles.calibration import load_calibration
from specdec_tune.profiles.models.llama import ModelConfig
from specdec_tune.profiles.schema import load_profile
from specdec_tune.records import sha256_file
from specdec_tune.settings import ExportSettings

PROFILE = Path(__file__).parent / "data" / "demo_profile.json"
sys.path.insert(0, str(Path(__file__).parent))
import mutations as enumerated  # noqa: E402

FIXTURES = dict(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)

json_values = st.recursive(
    # no subnormals: a library loaded earlier in the test process may flush them to zero (FTZ)
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _paths(doc, prefix=(), limit=3):
    """Every place in a JSON document (lists: their first `limit` items)."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k), limit)
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:limit]):
            yield from _paths(v, (*prefix, i), limit)


@st.composite
def mutations(draw, doc, places):
    """The document with up to three places replaced by any JSON value or removed."""
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(places))
        parent = doc
        try:
            for key in path[:-1]:
                parent = parent[key]
            if draw(st.booleans()):
                parent[path[-1]] = draw(json_values)
            elif isinstance(parent, dict):
                parent.pop(path[-1], None)
            else:
                del parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed this place
    return doc


def _loads_or_refuses(load, *args):
    try:
        return load(*args)
    except SpecdecError as e:
        assert str(e) and "\n" not in str(e)
        return None


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    search(load_profile(PROFILE), sha256_file(PROFILE), SearchSettings(seed=0, trials=40, out_dir=d / "plan"))
    export(ExportSettings(plan=d / "plan" / "plan.json", profile=PROFILE, out=d / "bundle", skip_measure=True))
    return d


PROFILE_DOC = json.loads(PROFILE.read_text())
PROFILE_PLACES = [p for p in _paths(PROFILE_DOC) if p]


@settings(max_examples=60, **FIXTURES)
@given(doc=mutations(PROFILE_DOC, PROFILE_PLACES))
def test_any_mutated_profile_loads_or_is_refused(tmp_path, doc):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    _loads_or_refuses(load_profile, path)


@settings(max_examples=40, **FIXTURES)
@given(data=st.data())
def test_any_mutated_plan_is_refused_or_exports(demo, tmp_path, data):
    """load_plan's schema check is what export relies on: a plan it accepts exports without a crash."""
    plan = json.loads((demo / "plan" / "plan.json").read_text())
    doc = data.draw(mutations(plan, [p for p in _paths(plan) if p and p[0] != "profile"]))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    if _loads_or_refuses(load_plan, path) is not None:
        out = tmp_path / "bundle"
        _loads_or_refuses(export, ExportSettings(plan=path, profile=PROFILE, out=out, skip_measure=True))


@settings(max_examples=60, **FIXTURES)
@given(data=st.data())
def test_any_mutated_manifest_is_refused_or_validates(demo, tmp_path_factory, data):
    import shutil

    bundle = tmp_path_factory.mktemp("b") / "bundle"
    shutil.copytree(demo / "bundle", bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    doc = data.draw(mutations(manifest, [p for p in _paths(manifest, limit=50) if p]))
    (bundle / "manifest.json").write_text(json.dumps(doc))
    if _loads_or_refuses(read_manifest, bundle) is not None:
        _loads_or_refuses(validate_bundle, bundle, None)


jsonl_lines = st.lists(
    st.one_of(
        st.text(max_size=30),
        json_values.map(json.dumps),
        st.fixed_dictionaries({"domain": st.text(max_size=8), "prompt": st.text(max_size=40)}).map(json.dumps),
        st.fixed_dictionaries({"domain": json_values, "prompt": json_values}).map(json.dumps),
        st.fixed_dictionaries(
            {
                "domain": st.text(max_size=8),
                "messages": st.lists(
                    st.fixed_dictionaries(
                        {
                            "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), json_values),
                            "content": st.one_of(st.text(max_size=20), json_values),
                        }
                    ),
                    max_size=4,
                ),
            }
        ).map(json.dumps),
    ),
    max_size=6,
)


@settings(max_examples=150, **FIXTURES)
@given(lines=jsonl_lines)
def test_any_calibration_file_loads_or_is_refused(tmp_path, lines):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines))
    loaded = _loads_or_refuses(load_calibration, str(path))
    if loaded is not None:
        assert loaded.prompts and all(
            isinstance(p.text, str) and p.text.strip() and isinstance(p.domain, str) for p in loaded.prompts
        )


LLAMA = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


@settings(max_examples=300, **FIXTURES)
@given(
    doc=mutations(LLAMA, [p for p in _paths(LLAMA) if p]),
    extra=st.dictionaries(
        st.sampled_from(
            ["head_dim", "rope_scaling", "attention_bias", "eos_token_id", "num_key_value_heads", "hidden_act"]
        ),
        json_values,
        max_size=2,
    ),
)
def test_any_model_config_is_read_or_refused(doc, extra):
    config = _loads_or_refuses(ModelConfig.from_hf, doc | extra)
    if config is not None:
        assert config.num_heads % config.num_kv_heads == 0 and config.head_dim > 0 and config.vocab_size > 0


# ---------------------------------------------------------------------------- every field, enumerated


def _run_cases(outcomes, *args, cases: list) -> list[str]:
    """`outcomes(*args, batch)` over every case, the cases dealt over the machine's cores (each a process of its
    own)."""
    workers = max(1, min(4, os.cpu_count() or 1))
    batches = [cases[i::workers] for i in range(workers)]
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=enumerated.worker_setup
    ) as pool:
        results = list(pool.map(outcomes, *([a] * workers for a in args), batches))
    return [r for batch in results for r in batch]


def test_every_plan_field_broken_alone_is_refused_in_one_line_or_exports(demo):
    """Each place of plan.json (of a list, its first item) set, one at a time, to null, to the wrong type or out of
    range (the three in turn from place to place): load_plan (or export's own input checks) refuses it in one line, or
    it exports. Enumerated, so that every run of a commit gives the same verdict (the random draws above cover
    combinations)."""
    plan = json.loads((demo / "plan" / "plan.json").read_text())
    cases = enumerated.cases(plan)
    outcomes = _run_cases(enumerated.plan_outcomes, plan, str(PROFILE), cases=cases)
    assert [o for o in outcomes if o.startswith("crash")] == []
    assert (
        outcomes.count("refused") > len(cases) // 3 and outcomes.count("exported") > len(cases) // 10
    )  # both ends exercised
    assert len(cases) > 200 and {how for _, how, _ in cases} == {"null", "wrong type", "out of range"}


def test_every_profile_field_broken_alone_is_refused_in_one_line_or_searched_and_exported():
    """The same for profile.json: load_profile (or the search that reads it first) refuses it in one line, or it is
    searched and its plan exports."""
    profile = json.loads(PROFILE.read_text())
    cases = enumerated.cases(profile)
    outcomes = _run_cases(enumerated.profile_outcomes, profile, cases=cases)
    assert [o for o in outcomes if o.startswith("crash")] == []
    assert outcomes.count("refused") > len(cases) // 2 and outcomes.count("exported") >= 10
    assert len(cases) > 170 and {how for _, how, _ in cases} == {"null", "wrong type", "out of range"}


def test_the_enumeration_reports_a_crash(monkeypatch):
    """The harness itself: a refusal is one line, and anything else the loader or exporter raises is reported, not
    swallowed."""
    plan = json.loads(PROFILE.read_text())  # a profile is not a plan: refused in one line
    assert enumerated.plan_outcomes(plan, str(PROFILE), [(("schema_version",), "wrong type", 2)]) == ["refused"]
    assert enumerated.profile_outcomes({"schema_version": 3}, [(("schema_version",), "null", None)]) == ["refused"]

    def crash(path):
        raise KeyError("planted")

    monkeypatch.setattr("specdec_tune.autotune.plan_schema.load_plan", crash)
    assert enumerated.plan_outcomes(plan, str(PROFILE), [(("tool_version",), "null", None)]) == [
        "crash: ('tool_version',) null: KeyError: 'planted'"
    ]
