"""search: the Optuna study against the exhaustive optimum, determinism, shared storage, bad input."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.search import SearchSettings, search
from specdec_tune.autotune.space import Candidate, Space, non_dominated
from specdec_tune.autotune.study import open_storage, run_study
from specdec_tune.cli import main
from specdec_tune.profiles.schema import load_profile

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"


@pytest.fixture(scope="module")
def profile():
    return load_profile(PROFILE_PATH)


@pytest.mark.parametrize("seed", [0, 1])
def test_study_reaches_the_exhaustive_optimum_on_a_sliver_of_the_space(profile, tmp_path, seed):
    plan = search(profile, "h", SearchSettings(trials=300, seed=seed, out_dir=tmp_path)).to_json()
    study = plan["study"]
    assert study["gap_pct"] <= 1.0
    # the sampler alone, before the per-bucket polish, is within 1% too
    assert study["best_sampled_value"] >= 0.99 * study["exhaustive_value"]
    assert study["trials"] <= 0.25 * study["space_size"]
    # a real schedule: speculation at batch 1, none at 16, not one D everywhere
    ds = [b["draft_len"] for b in plan["buckets"]]
    assert ds[0] >= 1 and ds[-1] == 0 and len(set(ds)) > 1
    assert ds[0] == max(ds)  # TensorRT-LLM: the smallest key carries max_draft_len
    assert all(b["predicted"]["speedup"]["source"] in ("measured", "interpolated", "modeled") for b in plan["buckets"])


def test_exhaustive_is_exact_on_a_small_space(profile):
    """Check the decomposition against brute force over every schedule of three buckets."""
    import itertools

    cost = CostModel(profile)
    space = Space(cost, SearchSettings(mechanisms=("ngram",)))
    space.buckets = space.buckets[:3]
    best, value = space.exhaustive()
    brute = max(
        space.score(Candidate("ngram", "none", "free", 4, space.repair(list(s))))
        for s in itertools.product(range(cost.max_draft_len + 1), repeat=3)
    )
    assert value == pytest.approx(brute)


def test_same_profile_and_seed_give_the_same_plan(profile, tmp_path):
    a = search(profile, "h", SearchSettings(trials=60, seed=3, out_dir=tmp_path / "a")).to_json()
    b = search(profile, "h", SearchSettings(trials=60, seed=3, out_dir=tmp_path / "b")).to_json()
    strip = lambda p: {k: v for k, v in p.items() if k not in ("created_at", "study")}  # noqa: E731
    assert strip(a) == strip(b)
    # rerunning into the same folder reuses the finished study: no new trials, same plan
    again = search(profile, "h", SearchSettings(trials=60, seed=3, out_dir=tmp_path / "a")).to_json()
    assert again["study"]["trials"] == 60 and strip(again) == strip(a)


def _worker(storage: str, name: str) -> None:
    profile = load_profile(PROFILE_PATH)
    settings = SearchSettings(seed=0, study_name=name, trials=300)
    run_study(Space(CostModel(profile), settings), storage, settings, n_trials=25)


def _two_workers_fill_one_study(storage: str, name: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_worker, args=(storage, name)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(180)
        assert w.exitcode == 0
    import optuna

    study = optuna.load_study(study_name=name, storage=open_storage(storage))
    numbers = [t.number for t in study.trials]
    # 50 sampled + the enqueued no-speculation starts (each worker enqueues them on an empty study; both may)
    assert (
        sorted(numbers) == list(range(len(numbers))) and 50 <= len(numbers) <= 50 + 2 * 3
    )  # none lost, none duplicated
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert len({t._trial_id for t in study.trials}) == len(numbers)


def test_two_workers_fill_one_journal_study(tmp_path):
    _two_workers_fill_one_study(f"journal:{tmp_path / 'study.journal'}", "shared")


@pytest.fixture(scope="module")
def postgres_url():
    """A throwaway PostgreSQL server on loopback (initdb + pg_ctl), where the binaries and driver exist.

    CI sets SPECDEC_TUNE_REQUIRE_POSTGRES=1, which turns a missing server into a failure instead of a skip.
    """
    import os
    import shutil
    import socket
    import subprocess
    import tempfile

    required = os.environ.get("SPECDEC_TUNE_REQUIRE_POSTGRES") == "1"
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    missing = "PostgreSQL server binaries (initdb, pg_ctl)" if not (initdb and pg_ctl) else None
    try:
        import psycopg2  # noqa: F401
    except ImportError:
        missing = missing or "the psycopg2 driver"
    if missing:
        (pytest.fail if required else pytest.skip)(f"no {missing} here")
    root = Path(tempfile.mkdtemp(prefix="specdec-pg-", dir="/tmp"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # the server refuses to run as root
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.run(
        [*as_user, initdb, "-D", str(root / "db"), "-A", "trust", "-U", "postgres"], check=True, capture_output=True
    )
    subprocess.run(
        [
            *as_user,
            pg_ctl,
            "-D",
            str(root / "db"),
            "-l",
            str(root / "log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(root / "db"), "-m", "immediate", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_fill_one_postgresql_study(postgres_url):
    _two_workers_fill_one_study(postgres_url, "shared-pg")


def test_search_runs_on_a_postgresql_storage(profile, tmp_path, postgres_url):
    plan = search(profile, "h", SearchSettings(trials=60, seed=0, out_dir=tmp_path, storage=postgres_url)).to_json()
    assert plan["study"]["storage"].startswith("postgresql") and plan["study"]["trials"] == 60
    assert not (tmp_path / "study.journal").exists()


def test_unreachable_storage_is_one_line(capsys, tmp_path):
    code = main(
        [
            "search",
            "--profile",
            str(PROFILE_PATH),
            "--out",
            str(tmp_path),
            "--storage",
            "postgresql+psycopg2://u@127.0.0.1:1/x",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and "cannot open the study storage" in err and err.count("\n") == 1
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("objective", ["throughput", "per-user"])
def test_cap_objectives_reach_the_exhaustive_optimum(profile, tmp_path, objective):
    floors = {"throughput": dict(min_user_tokens_per_s=50.0), "per-user": dict(min_tokens_per_s=300.0)}[objective]
    plan = search(profile, "h", SearchSettings(objective=objective, seed=0, out_dir=tmp_path, **floors)).to_json()
    assert plan["study"]["gap_pct"] <= 1.0 and plan["study"]["trials"] <= 0.5 * plan["study"]["space_size"]
    at_cap = plan["buckets"][-1]
    assert (
        at_cap["batch"] == plan["max_batch"]
        and [b["batch"] for b in plan["buckets"]] == [1, 2, 4, 8, 16][: len(plan["buckets"])]
    )
    cost = CostModel(profile)
    # the floor holds at the cap, and no larger cap meets it: that is the throughput-at-a-floor answer
    pred = at_cap["predicted"]
    if objective == "throughput":
        assert pred["per_user_tokens_per_s"]["value"] >= 50.0
        larger = [B for B in profile.workload.batch_buckets if B > plan["max_batch"]]
        assert all(
            max(cost.predict(B, D, m).per_user_tokens_per_s.value for m in cost.mechanisms for D in range(16)) < 50.0
            for B in larger
        )
    else:  # the reverse: the most per-user rate that still gives 300 tokens/s per device
        assert pred["tokens_per_s"]["value"] >= 300.0
        smaller = [B for B in profile.workload.batch_buckets if B < plan["max_batch"]]
        assert all(
            max(cost.predict(B, D, m).tokens_per_s.value for m in cost.mechanisms for D in range(16)) < 300.0
            for B in smaller
        )


def test_pareto_front_is_exact_and_the_study_covers_it(profile, tmp_path):
    plan = search(profile, "h", SearchSettings(objective="pareto", seed=1, out_dir=tmp_path)).to_json()
    exact = [(p["tokens_per_s"]["value"], p["per_user_tokens_per_s"]["value"]) for p in plan["pareto"]["exact"]]
    # brute force: every operating point is on the front or dominated by a point of it
    cost = CostModel(profile)
    every = [cost.predict(B, D, m) for B in profile.workload.batch_buckets for m in cost.mechanisms for D in range(16)]
    for p in every:
        t, u = p.tokens_per_s.value, p.per_user_tokens_per_s.value
        assert any(et >= t - 1e-9 and eu >= u - 1e-9 for et, eu in exact)
    assert non_dominated(exact) == exact and len(exact) >= 3
    # NSGA-II on half the operating points finds most of the front and comes close to the rest; the plan
    # takes its point from the front polished at the caps the study reached, which is exact
    assert plan["pareto"]["study_found"] >= len(exact) // 2 and plan["pareto"]["study_worst_gap_pct"] <= 5.0
    chosen = (
        plan["buckets"][-1]["predicted"]["tokens_per_s"]["value"],
        plan["buckets"][-1]["predicted"]["per_user_tokens_per_s"]["value"],
    )
    assert chosen in exact
    assert plan["study"]["trials"] <= 0.5 * plan["study"]["space_size"]


def test_tile_policy_is_searched_where_the_tile_makes_a_difference(profile, tmp_path):
    cost = CostModel(profile)
    cpu = Space(cost, SearchSettings())
    assert cpu.group == 3 and cpu.tile_rows == 1 and cpu.policies == ["free"]  # CPU: no tile, the policy is neutral
    tiled = Space(cost, SearchSettings(tile_rows=16))
    assert tiled.allowed("ngram", "aligned") == [0, 15] and tiled.policies == [
        "free",
        "aligned",
    ]  # 3 x 16 rows = 3 tiles
    assert tiled.tiles(15) == {"query_rows_per_kv_head": 48, "tiles": 3, "fill": 1.0}
    plan = search(profile, "h", SearchSettings(tile_rows=16, seed=0, out_dir=tmp_path)).to_json()
    assert plan["tile"]["policies_searched"] == ["free", "aligned"] and plan["tile"]["rows"] == 16
    allowed = {"free": set(range(16)), "aligned": {0, 15}}[plan["tile"]["policy"]]
    assert {b["draft_len"] for b in plan["buckets"]} <= allowed
    assert "tile(s) of 16" in plan["buckets"][0]["rationale"]["text"]


def test_mtp_draft_length_is_a_multiple_of_its_layers(profile, tmp_path):
    drafters = [d.model_copy(update={"draft_len_multiple": 3}) if d.name == "suffix" else d for d in profile.drafters]
    mtp_like = profile.model_copy(update={"drafters": drafters})
    space = Space(CostModel(mtp_like), SearchSettings(mechanisms=("suffix",)))
    assert space.allowed("suffix", "free") == [0, 3, 6, 9, 12, 15]
    plan = search(mtp_like, "h", SearchSettings(mechanisms=("suffix",), seed=0, trials=200, out_dir=tmp_path)).to_json()
    assert all(b["draft_len"] % 3 == 0 for b in plan["buckets"]) and max(b["draft_len"] for b in plan["buckets"]) > 0


def test_a_block_drafter_is_searched_within_its_block(profile, tmp_path):
    """A DFlash-like drafter profiled up to its block (D ≤ 2 of the workload's 15): the search never plans beyond it,
    though the same drafter would go longer when its block allowed."""
    acceptance = [
        a.model_copy(
            update={
                "max_draft_len": 2,
                "tokens_per_forward": a.tokens_per_forward[:3],
                "mean_al_vllm": a.mean_al_vllm[:3],
            }
        )
        if a.mechanism == "suffix"
        else a
        for a in profile.acceptance
    ]
    draft = [p for p in profile.draft if p.mechanism != "suffix" or p.draft_len <= 2]
    drafters = [d.model_copy(update={"max_draft_len": 2}) if d.name == "suffix" else d for d in profile.drafters]
    blocked = profile.model_copy(update={"acceptance": acceptance, "draft": draft, "drafters": drafters})
    cost = CostModel(blocked)
    assert cost.draft_len_limit("suffix") == 2 and cost.draft_len_limit("ngram") == 15
    assert Space(cost, SearchSettings(mechanisms=("suffix",))).allowed("suffix", "free") == [0, 1, 2]
    plan = search(blocked, "h", SearchSettings(mechanisms=("suffix",), seed=0, trials=200, out_dir=tmp_path)).to_json()
    assert max(b["draft_len"] for b in plan["buckets"]) <= 2 < plan_max(profile, tmp_path)


def plan_max(profile, tmp_path) -> int:
    full = search(
        profile, "h", SearchSettings(mechanisms=("suffix",), seed=0, trials=200, out_dir=tmp_path / "full")
    ).to_json()
    return max(b["draft_len"] for b in full["buckets"])


def test_rationale_names_a_guideline_and_the_runner_up(profile, tmp_path):
    plan = search(profile, "h", SearchSettings(seed=0, trials=100, out_dir=tmp_path)).to_json()
    for b in plan["buckets"]:
        why = b["rationale"]
        assert why["guideline"] in (1, 2, 3, 4, 5, "schedule", "memory") and why["text"]
        # the runner-up is never better than the choice by more than the tie tolerance (ties go to the shorter draft)
        assert why["next_best"]["loss_pct"] >= -100 * plan["study"]["tie_tolerance"] - 1e-9
        # another mechanism may win a bucket alone (negative loss): one mechanism serves every bucket
        assert why["next_mechanism"]["mechanism"] != plan["mechanism"] and abs(why["next_mechanism"]["loss_pct"]) < 100
        assert why["figures"]["tokens_per_forward"] == b["predicted"]["tokens_per_forward"]["value"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mechanism", "eagle3"], "not in the profile"),
        (["--min-user-tps", "100000"], "no setting reaches"),
        (["--trials", "-1"], "--trials -1"),
        (["--objective", "latency"], "unknown objective"),
        (["--min-tps", "100"], "--min-tps is a floor"),
        (["--objective", "throughput", "--min-user-tps", "100000"], "no batch size and setting reach"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(capsys, tmp_path, argv, message):
    code = main(["search", "--profile", str(PROFILE_PATH), "--out", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert code == 1 and message in err and err.count("\n") == 1
    assert not (tmp_path / "plan.json").exists()


def test_missing_or_foreign_profile(capsys, tmp_path):
    assert main(["search", "--profile", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 1
    (tmp_path / "x.json").write_text(json.dumps({"hello": 1}))
    assert main(["search", "--profile", str(tmp_path / "x.json"), "--out", str(tmp_path)]) == 1
    assert "not a specdec-tune profile" in capsys.readouterr().err


def test_h200_plan_differs_and_says_modeled(profile, tmp_path):
    cpu = search(profile, "h", SearchSettings(seed=0, trials=120, out_dir=tmp_path / "cpu")).to_json()
    h200 = search(profile, "h", SearchSettings(seed=0, trials=120, out_dir=tmp_path / "h200", device="h200")).to_json()
    # the CPU plan's speculating buckets use AL derived below D_max: the weakest of its predictions is modeled
    assert h200["device"]["times"] == "modeled (hardware table)" and cpu["device"]["times"] == "modeled"
    assert all(b["predicted"]["verify_ms"]["source"] == "modeled" for b in h200["buckets"])
    at = {b["batch"]: b["draft_len"] for b in h200["buckets"]}
    # a 135M model on an H200 is launch-bound up to batch 8: verifying 16 tokens costs what 1 does, so D grows
    cpu_at = {b["batch"]: b["draft_len"] for b in cpu["buckets"]}
    assert at[4] > cpu_at[4] and at[8] > cpu_at[8]
    assert h200["study"]["gap_pct"] <= 2.0
    assert min(b["predicted"]["speedup"]["value"] for b in h200["buckets"]) >= 0.999  # never worse than plain


def test_unknown_device_is_refused(capsys, tmp_path):
    assert main(["search", "--profile", str(PROFILE_PATH), "--out", str(tmp_path), "--device", "h900"]) == 1
    assert "unknown device 'h900'" in capsys.readouterr().err and not (tmp_path / "plan.json").exists()


def test_unknown_forced_mechanism_raises(profile):
    with pytest.raises(SpecdecError, match="not in the profile"):
        Space(CostModel(profile), SearchSettings(mechanisms=("dflash",)))


@pytest.mark.parametrize("objective", ["speedup", "pareto"])
def test_plan_json_is_the_plan_record_and_its_generated_schema_holds_it(profile, tmp_path, objective):
    import jsonschema

    from specdec_tune.autotune.plan_schema import load_plan, plan_json_schema

    plan = search(profile, "h", SearchSettings(trials=60, objective=objective, out_dir=tmp_path)).to_json()
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written == plan and load_plan(tmp_path / "plan.json").to_json() == written  # the record round-trips the file
    jsonschema.Draft202012Validator(plan_json_schema()).validate(written)
    written["buckets"][0]["draft_len"] = -1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(plan_json_schema()).validate(written)
    (tmp_path / "bad.json").write_text(json.dumps(written))
    with pytest.raises(SpecdecError, match="at buckets/0/draft_len"):
        load_plan(tmp_path / "bad.json")
