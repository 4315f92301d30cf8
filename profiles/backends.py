"""`profile`'s measurement backends behind one interface: settings in, `Profile` out (written to OUT/profile.json).

    torch  this package's own loop on the device (profiles/torch_profile.py): the verify curve, draft and host costs
           apart, acceptance by replay of the target's trajectories; the demo's default, and the way to profile where no
           serving engine runs
    vllm   the serving engine itself (profiles/vllm_profile.py): whole decode rounds as vLLM runs them, acceptance from
           its counters; in its own virtualenv (SPECDEC_TUNE_VLLM_PYTHON) where vLLM does not import here

The profile records its backend (`backend`, and `engine` with the engine's version and options) and the backend is
part of its fingerprint; the cost model reads either (autotune/cost_model.py). What differs between the backends for a
later stage is a field of its `Backend` record, not a comparison of names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specdec_tune import SpecdecError
from specdec_tune.profiles.schema import Profile
from specdec_tune.progress import Progress
from specdec_tune.settings import ProfileSettings


def _torch(settings: ProfileSettings, progress: Progress | None, started: float | None) -> Profile:
    from specdec_tune.profiles.torch_profile import TorchProfiler

    return TorchProfiler(settings, progress=progress, started=started).run()


def _vllm(settings: ProfileSettings, progress: Progress | None, started: float | None) -> Profile:
    from specdec_tune.profiles.vllm_profile import VllmProfiler

    return VllmProfiler(settings, progress=progress, started=started).run()


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    run: Callable[[ProfileSettings, Progress | None, float | None], Profile]
    # the serving engine whose own steps the profile timed (its figures hold for that engine's config first), None
    # where this package's loop timed the parts of a round apart (verify, draft, host)
    serving_engine: str | None
    # verify cells a later check can measure again on this machine (the torch loop's), where a suspect cell is repaired
    remeasurable_cells: bool


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("torch", _torch, serving_engine=None, remeasurable_cells=True),
        Backend("vllm", _vllm, serving_engine="vllm", remeasurable_cells=False),
    )
}


def backend_of(profile: Profile) -> Backend:
    """The backend a profile was measured with."""
    try:
        return BACKENDS[profile.backend]
    except KeyError:
        raise SpecdecError(
            f"the profile was measured with an unknown backend {profile.backend!r}",
            f"profile again with --engine {' or '.join(BACKENDS)}",
        ) from None


def run_profile(settings: ProfileSettings, progress: Progress | None = None, started: float | None = None) -> Profile:
    settings.validate()
    return BACKENDS[settings.engine].run(settings, progress, started)
