"""vLLM's own code as the check of a learned head's folder (speculators layout), in vLLM's interpreter.

A short program runs where SPECDEC_TUNE_VLLM_PYTHON points (or in this interpreter where vLLM imports) and does what
`vllm serve <head folder>` does with the folder, step by step, recording what ran and vLLM's own words where a step
could not:

  reader         maybe_override_with_speculators (the speculative config and verifier vLLM takes from the folder) and
                 get_config (vLLM's SpeculatorsConfig: the algos registry rewrites transformer_layer_config, e.g.
                 refuses an EAGLE-3 layer that is neither llama nor qwen3)
  engine_config  EngineArgs(model=<target>, speculative_config=<that config>).create_engine_config(); where this
                 platform's model runner refuses the method, the refusal is recorded and `draft_config` builds the
                 SpeculativeConfig alone (EngineArgs.create_speculative_config) on a VllmConfig without it
  model_class    ModelRegistry.resolve_model_cls on the draft's architectures: the class vLLM picks
  construct      initialize_model on the CPU, in a one-process distributed group (gloo), as the proposer builds it
  load_weights   the class's own load_weights on the folder's tensors as vLLM's loader reads them (get_all_weights)

What the load left out is read from the parameters themselves: every floating parameter starts as NaN and every
parameter's weight loader records the tensors it was given, so a parameter that no tensor reached (or only partly:
q but not k of a fused qkv) is `unloaded`, and a tensor of the folder that reached no parameter is `dropped`, with
where it stopped (the class's load_weights skipped it by name, its weights mapper mapped it out, or the loader
never placed it). Unloaded parameters that vLLM's proposer takes from the target after loading (its embedding and
LM head where the head ships none: llm_base_proposer.py `_maybe_share_embeddings` / `_maybe_share_lm_head`) are
listed as `from_target`, and DFlash's mask-embedding placeholder, unused without a mask_embedding.pt, as `unused`.

A tensor consumed by a class other than through a parameter's weight loader (EAGLE-3's `mask_hidden` buffer, which
this tool never writes) would show as dropped.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.exporters.native_checks import interpreter, run_program
from specdec_tune.profiles.models.views import engine_model_view

VARIABLE = "SPECDEC_TUNE_VLLM_PYTHON"
STEPS = ("reader", "engine_config", "model_class", "construct", "load_weights")
# Tensors vLLM's head classes skip by name on purpose: the target-to-draft map, "training-only; the draft remaps via
# d2t" (qwen3_dspark.py load_weights; llama_eagle3.py and qwen3_dflash.py skip it the same way).
SKIPPED_BY_DESIGN = ("t2d",)

_PROGRAM = r"""
import json, sys, tempfile, traceback
job = json.load(open(sys.argv[1]))
out = {"steps_run": [], "steps_not_run": [], "unloaded": [], "dropped": [], "from_target": [], "unused": [],
       "error": None}
state = {}

def said(e):
    return " ".join(f"{type(e).__name__}: {e}".split())[:600]

def step(name, fn):
    if out["error"] is not None or name in state.get("skip", {}):
        reason = state.get("skip", {}).get(name) or "an earlier step failed"
        out["steps_not_run"].append({"step": name, "reason": reason})
        return
    try:
        ran = fn()
    except Exception as e:
        out["error"] = f"{name}: {said(e)}"
        out["steps_not_run"].append({"step": name, "reason": said(e)})
        out["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
        return
    out["steps_run"].append(ran or name)

import vllm
out["version"] = vllm.__version__
folder = job["folder"]
if not job.get("target"):
    state["skip"] = {s: job["no_target"] for s in ("engine_config", "model_class", "construct", "load_weights")}

def reader():
    from vllm.transformers_utils.config import get_config, maybe_override_with_speculators
    verifier, _, spec = maybe_override_with_speculators(folder, None, trust_remote_code=False)
    out["reader"] = {"speculative_config": spec, "verifier": verifier}
    hf = get_config(folder, trust_remote_code=False)
    keep = ("architectures", "model_type", "draft_vocab_size", "target_hidden_size", "norm_before_residual",
            "eagle_aux_hidden_state_layer_ids", "dflash_config", "target_layer_ids", "sample_from_anchor",
            "markov_rank", "block_size", "rope_parameters")
    d = hf.to_dict()
    draft = {k: d[k] for k in keep if d.get(k) is not None}
    out["reader"] |= {"config_class": type(hf).__name__, "draft_config": draft}
    state["spec"] = spec

def engine_args(spec):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=job["target"], speculative_config=spec, dtype=job["dtype"], max_num_seqs=1,
                      max_model_len=job["max_model_len"], enforce_eager=True, seed=0)

def engine_config():
    spec = dict(state["spec"])
    if job.get("num_speculative_tokens"):
        spec["num_speculative_tokens"] = job["num_speculative_tokens"]
    ran = "engine_config"
    try:
        vc = engine_args(spec).create_engine_config()
    except Exception as e:
        msg = said(e)
        if not ("Model Runner V1 does not support" in msg or "Model Runner V2" in msg):
            raise
        # this platform's model runner refuses the method, not the head: the draft's own config is built alone
        out["steps_not_run"].append({"step": "engine_config", "reason": msg})
        out["platform_refusal"] = msg
        bare = engine_args(None).create_engine_config()
        sc = engine_args(spec).create_speculative_config(bare.model_config, bare.parallel_config)
        object.__setattr__(bare, "speculative_config", sc)
        vc, ran = bare, "draft_config"
    sc = vc.speculative_config
    state["vc"] = vc
    out["engine_config"] = {"built": ran, "method": sc.method, "num_speculative_tokens": sc.num_speculative_tokens,
                            "draft_architectures": list(sc.draft_model_config.architectures),
                            "parallel_drafting": bool(sc.parallel_drafting)}
    return ran

def model_class():
    from vllm.model_executor.models import ModelRegistry
    dmc = state["vc"].speculative_config.draft_model_config
    cls, arch = ModelRegistry.resolve_model_cls(dmc.architectures, model_config=dmc)
    out["model_class"] = {"architecture": arch, "class": f"{cls.__module__}.{cls.__qualname__}"}

def construct():
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    vc = state["vc"]
    dmc = vc.speculative_config.draft_model_config
    state["context"] = set_current_vllm_config(vc)  # referenced: held for the rest of the program, as a worker
    state["context"].__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="file://" + tempfile.mkstemp()[1])
    initialize_model_parallel(1, 1)
    with set_default_torch_dtype(dmc.dtype), torch.device("cpu"):
        state["model"] = initialize_model(vllm_config=vc, model_config=dmc)
    out["construct"] = {"device": "cpu", "dtype": str(dmc.dtype),
                        "parameters": sum(p.numel() for p in state["model"].parameters())}

def load_weights():
    import torch
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import get_draft_load_config
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader
    from vllm.model_executor.models import utils as model_utils
    vc, model = state["vc"], state["model"]
    dmc = vc.speculative_config.draft_model_config
    loader = get_model_loader(get_draft_load_config(vc))
    ptr = lambda t: t.untyped_storage().data_ptr()
    reached, entered, kept = {}, set(), set()
    def wrap(pname, inner):
        def weight_loader(param, loaded, *args, **kwargs):
            reached.setdefault(pname, set()).add(ptr(loaded))
            return inner(param, loaded, *args, **kwargs)
        return weight_loader
    params = dict(model.named_parameters())
    with torch.no_grad():
        for pname, p in params.items():
            p.weight_loader = wrap(pname, getattr(p, "weight_loader", default_weight_loader))
            if p.is_floating_point():
                p.fill_(float("nan"))
    Auto, Mapper = model_utils.AutoWeightsLoader, model_utils.WeightsMapper
    auto_load, mapper_apply = Auto.load_weights, Mapper.apply
    def seen(weights, into):
        for name, t in weights:
            into.add(ptr(t))
            yield name, t
    Auto.load_weights = lambda self, weights, *a, **k: auto_load(self, seen(weights, entered), *a, **k)
    Mapper.apply = lambda self, weights: seen(mapper_apply(self, weights), kept)
    given = {}
    def folder_weights():
        for name, t in loader.get_all_weights(dmc, model):
            given[name] = t  # kept alive: a freed storage's address may be reused by the next tensor
            yield name, t
    try:
        model.load_weights(folder_weights())
    finally:
        Auto.load_weights, Mapper.apply = auto_load, mapper_apply
    placed = set().union(*reached.values()) if reached else set()
    for name, t in sorted(given.items()):
        p = ptr(t)
        if p in placed:
            continue
        where = ("skipped by the class's load_weights" if p not in entered
                 else "mapped out by its weights mapper" if p not in kept else "not placed by AutoWeightsLoader")
        out["dropped"].append({"name": name, "where": where})
    own_embed = bool(getattr(model, "has_own_embed_tokens", False))
    own_head = bool(getattr(model, "has_own_lm_head", False))
    inner = getattr(model, "model", None)
    for pname, p in params.items():
        if pname in reached and not (p.is_floating_point() and bool(torch.isnan(p).any())):
            continue
        if pname == "model.embed_tokens.weight" and not own_embed:
            out["from_target"].append(pname)
        elif pname == "lm_head.weight" and not own_head:
            out["from_target"].append(pname)
        elif pname == "model.mask_embedding" and not getattr(inner, "has_separate_mask_embedding", True):
            out["unused"].append(pname)
        else:
            out["unloaded"].append(pname if pname not in reached else pname + " (partly)")
    out["load"] = {"tensors": len(given), "parameters": len(params), "has_own_embed_tokens": own_embed,
                   "has_own_lm_head": own_head}

for name, fn in (("reader", reader), ("engine_config", engine_config), ("model_class", model_class),
                 ("construct", construct), ("load_weights", load_weights)):
    step(name, fn)
print("RESULT " + json.dumps(out))
"""


def _verifier_folder(folder: Path) -> Path | None:
    """The head's verifier where it names a folder on this machine (what `vllm serve <head folder>` loads)."""
    try:
        config = json.loads((folder / "config.json").read_text())
        name = config["speculators_config"]["verifier"]["name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Path(name) if isinstance(name, str) and (Path(name) / "config.json").is_file() else None


def check_head(
    folder: Path | str,
    target: Path | str | None = None,
    *,
    num_speculative_tokens: int | None = None,
    dtype: str = "float32",
    max_model_len: int | None = None,
    timeout_s: float = 600,
) -> dict:
    """Run vLLM's reader, model class and weight loading on a head folder. `target`: the verifier's Hugging Face
    folder (default: the folder the head's config names, where it is on this machine; without one only the reader
    runs); `max_model_len` None: the target config's own. Returns {ok, steps_run, steps_not_run ({step, reason}),
    unloaded, dropped ({name, where}), error, from_target, unused, platform_refusal (where this platform's runner
    refuses the method), version, and what each step found}. Raises EngineMissing where no interpreter has vLLM."""
    folder = Path(folder).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise SpecdecError(f"{folder} has no config.json", "give a head folder written in the speculators layout")
    python = interpreter("vllm", VARIABLE)
    target_folder = Path(target).expanduser().resolve() if target is not None else _verifier_folder(folder)
    with tempfile.TemporaryDirectory() as tmp:
        view = engine_model_view(target_folder, Path(tmp) / "target") if target_folder is not None else None
        job = {
            "folder": str(folder),
            "target": str(view) if view is not None else None,
            "no_target": "no target: the head's verifier is not a folder on this machine (give target=)",
            "num_speculative_tokens": num_speculative_tokens,
            "dtype": dtype,
            "max_model_len": max_model_len,
        }
        raw = run_program(python, _PROGRAM, job, cwd=folder, timeout_s=timeout_s)
    return _result(raw)


def _result(raw: dict) -> dict:
    """The program's answer with `ok`: every step ran, nothing unloaded, nothing dropped but what vLLM skips by
    design. A program that died gives its own error."""
    if "steps_run" not in raw:
        error = "; ".join(raw.get("errors") or ["the check program gave no result"])
        return {
            "ok": False,
            "steps_run": [],
            "steps_not_run": [{"step": s, "reason": error} for s in STEPS],
            "unloaded": [],
            "dropped": [],
            "error": error,
        }
    dropped = [d for d in raw["dropped"] if d["name"].rsplit(".", 1)[-1] not in SKIPPED_BY_DESIGN]
    done = set(raw["steps_run"])
    ran = done >= set(STEPS) - {"engine_config"} and bool(done & {"engine_config", "draft_config"})
    return {
        "ok": raw["error"] is None and ran and not raw["unloaded"] and not dropped,
        **raw,
    }


__all__ = ["SKIPPED_BY_DESIGN", "STEPS", "check_head"]
