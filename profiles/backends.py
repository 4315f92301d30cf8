"""`profile`'s measurement backends behind one interface: settings in, `Profile` out (written to OUT/profile.json).

    torch  this package's own loop on the device (profiles/profiler.py): the verify curve, draft and host costs apart,
           acceptance by replay of the target's trajectories; the demo's default, and the way to profile where no
           serving engine runs
    vllm   the serving engine itself (profiles/vllm_profile.py): whole decode rounds as vLLM runs them, acceptance from its
           counters; in its own virtualenv (SPECDEC_TUNE_VLLM_PYTHON) where vLLM does not import here

The profile records its backend (`backend`, and `engine` with the engine's version and options) and the backend is
part of its fingerprint; the cost model reads either (autotune/cost_model.py).
"""

from __future__ import annotations

from specdec_tune.profiles.schema import Profile
from specdec_tune.settings import ProfileSettings


def _torch(settings: ProfileSettings, progress, started: float | None) -> Profile:
    from specdec_tune.profiles.profiler import Profiler

    return Profiler(settings, progress=progress, started=started).run()


def _vllm(settings: ProfileSettings, progress, started: float | None) -> Profile:
    from specdec_tune.profiles.vllm_profile import VllmProfiler

    return VllmProfiler(settings, progress=progress, started=started).run()


BACKENDS = {"torch": _torch, "vllm": _vllm}


def run_profile(settings: ProfileSettings, progress=None, started: float | None = None) -> Profile:
    settings.validate()
    return BACKENDS[settings.engine](settings, progress, started)
