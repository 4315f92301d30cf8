"""Do the heads' `config.json` files validate with the `speculators` package's own config classes?

Runs in the project's Python: it writes (or takes) head folders in the speculators layout, then validates each
`config.json` in a separate virtualenv that has `speculators` installed (its pins may clash with this package's),
through a short program run there: `SpeculatorModelConfig.from_pretrained(folder)` must resolve to the config class
registered for the file's `speculators_model_type` (Eagle3SpeculatorConfig, the MTP config, DFlashSpeculatorConfig,
DSparkSpeculatorConfig), keep the algorithm fields, and round-trip through `to_dict()`. Beyond the config, speculators'
own model class (Eagle3DraftModel, MTPDraftModel, DFlashDraftModel, DSparkDraftModel) is asked to load the weights;
that is recorded (which tensors map, whether they are equal), not required.

Heads checked: every folder given with --head (e.g. a head written by `specdec-tune train-drafter`), else this
target's cached demo heads where present, plus a freshly written untrained head of each mechanism for the demo target
(the same writer as the trainer's). Writes a JSON record and exits 0 when every config validates, 1 when one fails,
2 when the virtualenv is missing.

    python bench/speculators_config_check.py [--head FOLDER ...] [--python .venv-speculators/bin/python]
                                             [--out bench/results/speculators_config_check.json]

Create the virtualenv once (a git-ignored folder; speculators pins transformers below this package's, so the project's
torch is shared and only transformers and the light dependencies are its own):
    python3 -m venv --system-site-packages .venv-speculators
    .venv-speculators/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 transformers==5.19.0
    .venv-speculators/bin/pip install "openai>=2.0.0" "datasets<=5.1.0,>=4.0.0" loguru pydantic-settings
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PYTHON = REPO / ".venv-speculators" / "bin" / "python"
DEFAULT_OUT = REPO / "bench" / "results" / "speculators_config_check.json"
SCHEMA = "specdec-tune/speculators-config-check/1"

# Runs inside the speculators virtualenv: argv = folders; prints one JSON list.
VALIDATOR = r"""
import json, sys, importlib.metadata
from speculators import SpeculatorModelConfig
import speculators.models  # registers the algorithm config classes
out = []
for folder in sys.argv[1:]:
    raw = json.load(open(f"{folder}/config.json"))
    rec = {"folder": folder, "speculators_model_type": raw.get("speculators_model_type")}
    try:
        registry = SpeculatorModelConfig.registry or {}
        cls = registry.get(raw["speculators_model_type"])
        cfg = SpeculatorModelConfig.from_pretrained(folder)
        rec["class"] = type(cfg).__name__
        rec["registered_class"] = getattr(cls, "__name__", None)
        again = cfg.to_dict()
        keys = [k for k in ("draft_vocab_size", "norm_before_residual", "target_hidden_size",
                            "eagle_aux_hidden_state_layer_ids", "num_nextn_predict_layers", "block_size",
                            "aux_hidden_state_layer_ids", "mask_token_id", "sample_from_anchor", "markov_rank",
                            "markov_head_type", "enable_confidence_head", "confidence_head_with_markov") if k in raw]
        rec["fields_kept"] = {k: again.get(k) == raw[k] for k in keys}
        tl = again.get("transformer_layer_config", {})
        rec["transformer_layer_config"] = {k: tl.get(k)
                                           for k in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers")}
        sc = cfg.speculators_config
        rec["speculative_tokens"] = sc.proposal_methods[0].speculative_tokens
        rec["verifier_architectures"] = list(sc.verifier.architectures or [])
        rec["ok"] = rec["class"] == rec["registered_class"] and all(rec["fields_kept"].values())
    except Exception as e:  # report every failure, validate the rest
        rec["ok"] = False
        rec["error"] = f"{type(e).__name__}: {e}"[:2000]
    try:  # beyond the config: speculators' own model class loads the weights (it fills the verifier's from its path)
        import torch
        from safetensors.torch import load_file
        from speculators.models import Eagle3DraftModel, MTPDraftModel
        from speculators.models.dflash import DFlashDraftModel
        from speculators.models.dspark import DSparkDraftModel
        classes = {"eagle3": Eagle3DraftModel, "mtp": MTPDraftModel,
                   "dflash": DFlashDraftModel, "dspark": DSparkDraftModel}
        model = classes[raw["speculators_model_type"]].from_pretrained(folder)
        theirs, ours = model.state_dict(), load_file(f"{folder}/model.safetensors")
        rec["weights"] = {"loaded": True, "ours_not_in_model": [k for k in ours if k not in theirs],
                          "model_not_in_ours": [k for k in theirs if k not in ours],
                          "equal": all(torch.equal(theirs[k].float(), ours[k].float()) for k in ours if k in theirs)}
    except Exception as e:  # recorded, not fatal: the acceptance bar here is the config
        rec["weights"] = {"loaded": False, "error": f"{type(e).__name__}: {e}"[:500]}
    out.append(rec)
print(json.dumps({"speculators_version": importlib.metadata.version("speculators"),
                  "transformers_version": importlib.metadata.version("transformers"), "results": out}))
"""


def fresh_heads(folder: Path) -> list[Path]:
    """An untrained head of each mechanism for the demo target, written by the trainer's writer."""
    from specdec_tune.profiles.drafters.checkpoints import save_head
    from specdec_tune.profiles.drafters.heads import HEAD_KINDS
    from specdec_tune.profiles.models.folders import architectures, model_folder
    from specdec_tune.profiles.models.loading import load_model

    target = load_model(None, dtype="float32")
    _, verifier, config, _ = model_folder(None)
    return [
        save_head(
            kind.new(target.model),
            mechanism,
            folder / mechanism,
            verifier=str(verifier),
            verifier_architectures=architectures(config, str(verifier)),
            speculative_tokens=3,
        )
        for mechanism, kind in HEAD_KINDS.items()
    ]


def cached_heads() -> list[Path]:
    from specdec_tune.profiles.models.folders import cache_root

    return sorted(
        p for p in (cache_root() / "heads").glob("*") if (p / "config.json").is_file() and ".tmp" not in p.name
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", action="append", default=[], help="A head folder to validate (repeatable).")
    ap.add_argument(
        "--python", type=Path, default=DEFAULT_PYTHON, help="Python of the virtualenv with speculators installed."
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    if not args.python.is_file():
        print(
            f"speculators virtualenv not found ({args.python}); create it with: "
            f"python3 -m venv {args.python.parent.parent} && "
            f"{args.python.parent}/pip install speculators",
            file=sys.stderr,
        )
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        heads = [Path(h) for h in args.head] or cached_heads()
        heads += fresh_heads(Path(tmp))
        proc = subprocess.run(
            [str(args.python), "-c", VALIDATOR, *map(str, heads)],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if proc.returncode != 0:
        print(proc.stderr[-4000:], file=sys.stderr)
        return 1
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in result["results"]:
        r["folder"] = Path(r["folder"]).name  # no machine paths in the record
    record = {
        "schema": SCHEMA,
        "created_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "source": "measured",
        "how": "config.json written by profiles/drafters/checkpoints.save_head (the trainer's writer), loaded with "
        "speculators' SpeculatorModelConfig.from_pretrained in an isolated virtualenv",
        **result,
        "passed": all(r["ok"] for r in result["results"]),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    for r in result["results"]:
        w = r.get("weights", {})
        weights = (
            "weights load in speculators' model"
            if w.get("loaded") and w.get("equal")
            else f"weights: {w.get('error', 'differ')[:60]}"
        )
        print(
            f"{r['folder']:<12} {r['speculators_model_type']:<7} {r.get('class', '-'):<24} "
            f"{'ok' if r['ok'] else 'FAILED ' + r.get('error', str(r.get('fields_kept')))}; {weights}"
        )
    print(
        f"speculators {result['speculators_version']}: {'all valid' if record['passed'] else 'failures'}; "
        f"wrote {args.out}"
    )
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
