"""search: the Optuna study against the exhaustive optimum, determinism, shared storage, bad input."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from specdec_tune import SpecdecError
from specdec_tune.autotune.cli import main
from specdec_tune.autotune.cost_model import CostModel
from specdec_tune.autotune.search import SearchSettings, Space, open_storage, run_study, search
from specdec_tune.profiles.schema import load_profile

PROFILE_PATH = Path(__file__).parent / "data" / "demo_profile.json"


@pytest.fixture(scope="module")
def profile():
    return load_profile(PROFILE_PATH)


@pytest.mark.parametrize("seed", [0, 1])
def test_study_reaches_the_exhaustive_optimum_on_a_sliver_of_the_space(profile, tmp_path, seed):
    plan = search(profile, "h", SearchSettings(trials=300, seed=seed, out_dir=tmp_path))
    study = plan["study"]
    assert study["gap_pct"] <= 1.0
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
    from specdec_tune.autotune.search import Candidate

    brute = max(space.score(Candidate("ngram", "none", space.repair(list(s))))
                for s in itertools.product(range(cost.max_draft_len + 1), repeat=3))
    assert value == pytest.approx(brute)


def test_same_profile_and_seed_give_the_same_plan(profile, tmp_path):
    a = search(profile, "h", SearchSettings(trials=60, seed=3, out_dir=tmp_path / "a"))
    b = search(profile, "h", SearchSettings(trials=60, seed=3, out_dir=tmp_path / "b"))
    strip = lambda p: {k: v for k, v in p.items() if k not in ("created_at", "study")}  # noqa: E731
    assert strip(a) == strip(b)
    # rerunning into the same folder reuses the finished study: no new trials, same plan
    again = search(profile, "h", SearchSettings(trials=60, seed=3, out_dir=tmp_path / "a"))
    assert again["study"]["trials"] == 60 and strip(again) == strip(a)


def _worker(journal: str, name: str) -> None:
    profile = load_profile(PROFILE_PATH)
    settings = SearchSettings(seed=0, study_name=name)
    run_study(Space(CostModel(profile), settings), f"journal:{journal}", settings, n_trials=25)


def test_two_workers_fill_one_journal_study(tmp_path):
    journal = str(tmp_path / "study.journal")
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_worker, args=(journal, "shared")) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    import optuna

    study = optuna.load_study(study_name="shared", storage=open_storage(f"journal:{journal}"))
    numbers = [t.number for t in study.trials]
    assert len(numbers) == 50 and sorted(numbers) == list(range(50))  # none lost, none duplicated
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mechanism", "eagle3"], "not in the profile"),
        (["--min-user-tps", "100000"], "no setting reaches"),
        (["--trials", "0"], "--trials 0"),
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


def test_unknown_forced_mechanism_raises(profile):
    with pytest.raises(SpecdecError, match="not in the profile"):
        Space(CostModel(profile), SearchSettings(mechanisms=("dflash",)))
