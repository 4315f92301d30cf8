"""The Optuna study over a Space: TPE for one objective, NSGA-II for throughput vs per-user rate.

Any Optuna storage holds it: a JournalStorage file under the run's folder by default (`journal:PATH`: an
append-only log, many processes, no server; about a fifth of SQLite's per-trial commit cost), or an RDB URL such
as sqlite:///PATH or PostgreSQL (many machines).
Each worker fills the study up to its trial count, so a rerun or a resumed run adds only what is missing.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager
from typing import Literal

from specdec_tune import SpecdecError
from specdec_tune.autotune.space import Candidate, Space

RDB_OPEN_ATTEMPTS = 5
JOURNAL_LOCK_GRACE_S = 5


IN_MEMORY = "memory"  # a study in this process only, not kept (a re-plan's, whose trials nothing resumes)


def open_storage(url: str):
    """An Optuna storage: `journal:PATH` is a JournalStorage file, `memory` one in this process only; anything else an
    RDB URL."""
    import optuna

    if url == IN_MEMORY:
        return optuna.storages.InMemoryStorage()
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock

        path = url.removeprefix("journal:")
        _drop_torn_tail(path)
        # a writer killed while holding the lock leaves it behind; an append holds it for milliseconds, so a lock
        # untouched for JOURNAL_LOCK_GRACE_S is a dead writer's (Optuna's default waits 30 s)
        lock = JournalFileSymlinkLock(path, grace_period=JOURNAL_LOCK_GRACE_S)
        return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=lock))
    for attempt in range(RDB_OPEN_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(url)
        except Exception as e:  # noqa: BLE001 - the driver's own errors vary (no server, bad URL, missing driver)
            error = e  # two workers creating the schema of a fresh database at once: one loses the race and retries
            time.sleep(0.2 * (attempt + 1))
    raise SpecdecError(
        f"cannot open the study storage {url!r}: {str(error).splitlines()[0]}",
        "check the URL and that the server is reachable, or use sqlite:///PATH or journal:PATH",
    ) from None


def _drop_torn_tail(path: str) -> None:
    """A journal whose writer was killed mid-line ends in a line without its newline; Optuna refuses every line
    appended after it, so the torn record (an unfinished trial's, never a finished one) is cut before the study
    opens."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


def _labels(space: Space) -> list[str]:
    return [f"{m}/{q}" for m, q in space.pairs]


def candidate_of(space: Space, params: dict) -> Candidate:
    """The candidate a trial's parameters stand for, with the engine constraints applied."""
    m, q = space.pairs[_labels(space).index(params["drafter"])]
    policy = params.get("tile_policy", "free")
    if space.s.objective == "speedup":
        schedule = space.repair([space.snap(params[f"D_at_batch_{B}"], m, policy) for B in space.buckets])
        return Candidate(m, q, policy, space.buckets[-1], schedule)
    cap = params["max_batch"]
    return space.fill(m, q, policy, cap, {cap: space.snap(params["D_at_cap"], m, policy)})


def _suggest(space: Space, trial) -> Candidate:
    params = {"drafter": trial.suggest_categorical("drafter", _labels(space))}
    if len(space.policies) > 1:
        params["tile_policy"] = trial.suggest_categorical("tile_policy", space.policies)
    D_max = space.cost.max_draft_len
    if space.s.objective == "speedup":
        params |= {f"D_at_batch_{B}": trial.suggest_int(f"D_at_batch_{B}", 0, D_max) for B in space.buckets}
    else:
        params["max_batch"] = trial.suggest_categorical("max_batch", space.caps)
        params["D_at_cap"] = trial.suggest_int("D_at_cap", 0, D_max)
    c = candidate_of(space, params)
    trial.set_user_attr("schedule", list(c.schedule))
    return c


def _starts(space: Space) -> list[dict]:
    """No speculation for every drafter: the study starts from plain decoding and never loses to it."""
    if space.s.objective == "speedup":
        return [{"drafter": label, **{f"D_at_batch_{B}": 0 for B in space.buckets}} for label in _labels(space)]
    return [{"drafter": label, "max_batch": cap, "D_at_cap": 0} for label in _labels(space) for cap in space.caps]


def run_study(space: Space, storage: str, settings, n_trials: int | None = None):
    """Fill (or continue) the study; several processes may call this on one storage."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    pareto = settings.objective == "pareto"
    sampler: optuna.samplers.BaseSampler
    directions: list[Literal["minimize", "maximize"]]
    if pareto:
        sampler = optuna.samplers.NSGAIISampler(seed=settings.seed, population_size=20)
        directions = ["maximize", "maximize"]
    else:
        sampler = optuna.samplers.TPESampler(seed=settings.seed, multivariate=True, n_startup_trials=20)
        directions = ["maximize"]
    study = optuna.create_study(
        study_name=settings.study_name,
        storage=open_storage(storage),
        directions=directions,
        sampler=sampler,
        load_if_exists=True,
    )
    done = sum(1 for t in study.trials if t.state.is_finished())
    if done == 0:
        for params in _starts(space):
            study.enqueue_trial(params)
    if n_trials is None:
        n_trials = max(0, trials_for(space, settings) - done)

    def objective(trial):
        c = _suggest(space, trial)
        if pareto:
            p = space.at_cap(c)
            return p.tokens_per_s.value, p.per_user_tokens_per_s.value
        return space.score(c)

    if n_trials:
        with _ctrl_c_stops_after_the_trial(study):
            study.optimize(objective, n_trials=n_trials)
    return study


@contextmanager
def _ctrl_c_stops_after_the_trial(study):
    """Ctrl-C lets the running trial finish and be told, then interrupts: a KeyboardInterrupt raised inside
    Optuna's tell leaves the trial half-recorded (and Optuna 5.0 then fails with an UnboundLocalError instead of
    the interrupt). A second Ctrl-C interrupts at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before, asked = signal.getsignal(signal.SIGINT), []

    def stop(signum, frame):
        signal.signal(signal.SIGINT, before)
        asked.append(signum)
        try:
            study.stop()
        except RuntimeError:  # the study had already returned: the interrupt is raised below
            pass

    signal.signal(signal.SIGINT, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
    if asked:
        raise KeyboardInterrupt


def trials_for(space: Space, settings) -> int:
    """The study's trial count: the setting, else 100 per bucket (at least 300) for schedules, a third of
    the (small) operating-point space for the cap objectives (half for the Pareto front)."""
    if settings.trials:
        return settings.trials
    if settings.objective == "speedup":
        return max(300, 100 * len(space.buckets))
    return max(60, space.size() // (2 if settings.objective == "pareto" else 3))


def best_of(study, space: Space) -> Candidate:
    """The best finished trial; ties (several drafters at D = 0, say) go to the better schedule below the cap."""
    trials = [t for t in study.trials if t.state.name == "COMPLETE"]
    top = max(t.values[0] for t in trials)
    return max((candidate_of(space, t.params) for t in trials if t.values[0] >= top - 1e-12), key=space.rank)


def front_of(study, space: Space) -> list[Candidate]:
    """The study's Pareto set (NSGA-II), one candidate per distinct operating point."""
    by_point: dict[tuple, Candidate] = {}
    for t in sorted(study.best_trials, key=lambda t: t.number):
        c = candidate_of(space, t.params)
        p = space.at_cap(c)
        key = (p.tokens_per_s.value, p.per_user_tokens_per_s.value)
        if key not in by_point or space.rank(c) > space.rank(by_point[key]):
            by_point[key] = c
    return [by_point[xy] for xy in sorted(by_point, key=lambda xy: -xy[0])]
