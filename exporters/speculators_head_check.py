"""speculators' own `SpeculatorModel.from_pretrained` on a head folder the bundle ships (speculators/), in speculators'
interpreter (SPECDEC_TUNE_SPECULATORS_PYTHON).

from_pretrained builds the class the config registers, loads the folder's tensors and then the verifier's own layers
(its embedding, and its LM head where the head ships none) from `speculators_config.verifier.name_or_path`. The check
runs on a copy of the folder whose verifier names the target's folder on this machine, so nothing is downloaded.
A tensor of the folder that is no entry of the model's state is `dropped`; the model's entries no tensor of the folder
holds are listed (`from_verifier_or_init`): the verifier's layers, and anything the class would leave at its
initial values.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from specdec_tune.exporters.native_checks import interpreter, run_program
from specdec_tune.profiles.models.views import engine_model_view

_PROGRAM = r"""
import glob, importlib.metadata, json, os, shutil, sys, tempfile
os.environ["HF_HUB_OFFLINE"] = "1"
job = json.load(open(sys.argv[1]))
from safetensors.torch import load_file
from speculators import SpeculatorModel
import speculators.models
out = {"version": importlib.metadata.version("speculators"), "steps_run": [], "dropped": [], "error": None}
folder = tempfile.mkdtemp()
shutil.copytree(job["folder"], folder, dirs_exist_ok=True)
config = json.load(open(folder + "/config.json"))
config["speculators_config"]["verifier"]["name_or_path"] = job["target"]
json.dump(config, open(folder + "/config.json", "w"))
try:
    model = SpeculatorModel.from_pretrained(folder, verifier=None)
    out["steps_run"].append("from_pretrained")
    out["class"] = type(model).__name__
    have = set(model.state_dict())
    shipped = set()
    for f in glob.glob(folder + "/*.safetensors"):
        shipped |= set(load_file(f))
    out["dropped"] = sorted(shipped - have)
    out["from_verifier_or_init"] = sorted(have - shipped)
except Exception as e:
    out["error"] = " ".join(f"{type(e).__name__}: {e}".split())[:500]
print("RESULT " + json.dumps(out))
"""


def check_speculators_head(folder: Path | str, target: Path, timeout_s: float = 600) -> dict:
    """speculators' from_pretrained on `folder` with `target` (the verifier's Hugging Face folder) as its verifier.
    Returns {ok, steps_run, dropped, from_verifier_or_init, class, error, version}; raises native_checks.EngineMissing
    where no speculators interpreter is set."""
    python = interpreter("speculators", "SPECDEC_TUNE_SPECULATORS_PYTHON")
    with tempfile.TemporaryDirectory() as tmp:
        view = engine_model_view(Path(target), Path(tmp) / "target")
        out = run_program(python, _PROGRAM, {"folder": str(Path(folder).resolve()), "target": str(view)}, Path(tmp))
    if "steps_run" not in out:
        error = "; ".join(out.get("errors") or ["the check program gave no result"])
        return {"ok": False, "steps_run": [], "dropped": [], "error": error}
    return {"ok": out["error"] is None and not out["dropped"], **out}


__all__ = ["check_speculators_head"]
