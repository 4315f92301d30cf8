"""SGLang's own code as the check of a head folder written by sglang_heads.py: does SGLang 0.5.23 load every tensor
into the parameter it is meant for?

A short program runs in SGLang's virtualenv (SPECDEC_TUNE_SGLANG_PYTHON, as native_checks.py runs SGLang's argument
parser) and, on the folder as written:

  config     ModelConfig(folder, is_draft_model=True, speculative_algorithm=...): the draft path's config load
             (transformers' AutoConfig under SGLang's get_config), then the class SGLang's registry picks for it
  parallel   a one-process gloo world and SGLang's model-parallel groups, as SGLang's own layer tests set them up
             (sglang/test/layer_ut_utils.py:13-35, test_utils.py:2101-2124): its layers read the groups even at tp 1
  build      the draft class on CPU through the loader's _initialize_model (model_loader/loader.py:285-312); every
             parameter is then filled with NaN, so a parameter (or a q/k/v or gate/up shard) no tensor reaches shows
  load       load_weights with the folder's tensors (safetensors_weights_iterator); each parameter's weight_loader is
             wrapped to see which tensors arrive: `dropped` are the file's tensors no loader received, `unloaded` the
             parameters left holding NaN (less those SGLang takes from the target at run time, in `from_target`)
  read back  what the class read from the config: context features, block size, mask token, gamma, sample_from_anchor,
             Markov head, attention type; SGLang's DSpark runtime resolution (dspark_config.py:84-134)
  capture    the target class's own set_eagle3_layers_to_capture / set_dflash_layers_to_capture (on a stand-in
             holding the target's layer count): the layers whose input SGLang captures for the head

Two things of SGLang's import chain are not run on this CPU build and are replaced, each said in `notes`: torchvision
(imported by its config package for InternVL image transforms; the PyPI wheel needs CUDA torch) by an empty stand-in,
and the fallback RoPE kernel that RotaryEmbedding imports from vLLM on a platform that is neither CUDA nor SGLang's CPU
engine (layers/rotary_embedding/base.py:123-141): no forward runs, so neither is called.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec_tune.exporters.mechanisms import MECHANISMS
from specdec_tune.exporters.native_checks import interpreter, run_program

# the registry's SGLang records of the heads sglang_heads.py writes, by the draft class a folder names
_HEADS = {
    m.sglang.head_layout.architecture: m.sglang
    for m in MECHANISMS.values()
    if m.sglang is not None and m.sglang.head_layout is not None
}
ALGORITHMS = {arch: s.algorithm for arch, s in _HEADS.items()}  # draft class -> --speculative-algorithm

_PROGRAM = r"""
import json, os, socket, sys, types
job = json.load(open(sys.argv[1]))
out = {"steps_run": [], "steps_not_run": [], "notes": [], "unloaded": [], "dropped": [], "from_target": [],
       "read": {}, "error": None}
if job["confidence"]:
    os.environ["SGLANG_RAGGED_VERIFY_MODE"] = "cap-accept"
    out["notes"].append("SGLANG_RAGGED_VERIFY_MODE=cap-accept, so that the DSpark confidence head is built "
                        "(its default, static, builds none and skips those weights)")
steps = ["config", "parallel", "build", "load", "read back", "capture"]

def skip_rest(reason):
    done = set(out["steps_run"]) | {s["step"] for s in out["steps_not_run"]}
    out["steps_not_run"] += [{"step": s, "reason": reason} for s in steps if s not in done]

def fail(step, e):
    msg = " ".join(f"{type(e).__name__}: {e}".split())[:400]
    out["steps_not_run"].append({"step": step, "reason": msg})
    out["error"] = out["error"] or f"{step}: {msg}"

try:
    import torchvision  # noqa: F401
except Exception as e:
    import importlib.abc, importlib.machinery
    class _Empty(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            root = name.split(".")[0]
            return importlib.machinery.ModuleSpec(name, self, is_package=True) if root == "torchvision" else None
        def create_module(self, spec):
            from unittest import mock
            m = types.ModuleType(spec.name)
            m.__path__ = []
            m.__getattr__ = lambda attr: mock.MagicMock(name=f"{spec.name}.{attr}")
            return m
        def exec_module(self, module):
            pass
    for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Empty())
    why = " ".join(f"{type(e).__name__}: {e}".split())[:160]
    out["notes"].append(f"torchvision replaced by an empty stand-in ({why}): SGLang's config package imports it "
                        "for image transforms")

import importlib.metadata
import torch
out["version"] = importlib.metadata.version("sglang")
folder, algorithm = job["folder"], job["algorithm"]
try:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture
    mc = ModelConfig(folder, is_draft_model=True, speculative_algorithm=algorithm, dtype="float32",
                     trust_remote_code=False)
    cls, arch = get_model_architecture(mc)
    out["read"].update(config_class=type(mc.hf_config).__name__, model_class=cls.__name__, architecture=arch)
    out["steps_run"].append("config")
except Exception as e:
    fail("config", e)
if out["error"] is None:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        from sglang.srt.distributed import parallel_state
        from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
        from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
        from sglang.srt.server_args import ServerArgs
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        reset_context()
        publish(ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1), role="test",
                ranks=SpawnRanks(world_rank=0))
        get_parallel().override_permanently(world_group=parallel_state._WORLD)
        initialize_model_parallel(backend="gloo")
        out["steps_run"].append("parallel")
    except Exception as e:
        fail("parallel", e)
if out["error"] is None:
    try:
        import sglang.srt.layers.rotary_embedding.base as rope_base
        if not rope_base._is_cuda:
            rope_base._is_cpu = True
            out["notes"].append("RotaryEmbedding built without its fallback kernel (a vLLM import off CUDA)")
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.model_loader.loader import _initialize_model
        torch.set_default_dtype(torch.float32)
        with torch.device("cpu"):
            model = _initialize_model(mc, LoadConfig(), None)
        out["steps_run"].append("build")
    except Exception as e:
        fail("build", e)
if out["error"] is None:
    try:
        from sglang.srt.model_loader.weight_utils import default_weight_loader, safetensors_weights_iterator
        received = set()
        params = dict(model.named_parameters())
        for name, p in params.items():
            original = getattr(p, "weight_loader", default_weight_loader)
            def loader(param, weight, *args, _original=original, **kwargs):
                received.add(id(weight))
                received.add(weight.data_ptr())
                return _original(param, weight, *args, **kwargs)
            p.weight_loader = loader
            with torch.no_grad():
                p.fill_(float("nan"))
        files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
        tensors = list(safetensors_weights_iterator(files))
        model.load_weights(iter(tensors))
        consumed = {"d2t"} if getattr(model, "hot_token_id", None) is not None else set()
        out["dropped"] = [n for n, t in tensors
                          if id(t) not in received and t.data_ptr() not in received and n not in consumed]
        if consumed:
            out["read"]["hot_token_ids"] = int(model.hot_token_id.numel())
        shared = set(job["from_target"])
        for name, p in params.items():
            left = int(torch.isnan(p.detach()).sum())
            if left:
                entry = name if left == p.numel() else f"{name} ({left} of {p.numel()} values)"
                (out["from_target"] if name in shared else out["unloaded"]).append(entry)
        out["steps_run"].append("load")
    except Exception as e:
        fail("load", e)
if out["error"] is None:
    try:
        read = out["read"]
        if algorithm == "EAGLE3":
            inner = model.model
            read.update(num_aux_hidden_states=inner.num_aux_hidden_states, fc_in=inner.fc.in_features,
                        draft_vocab_size=int(mc.hf_config.draft_vocab_size),
                        load_lm_head_from_target=bool(model.load_lm_head_from_target),
                        eagle_aux_hidden_state_layer_ids=(mc.hf_config.eagle_config or {}).get(
                            "eagle_aux_hidden_state_layer_ids"))
            layer_ids = read["eagle_aux_hidden_state_layer_ids"]
        else:
            from sglang.srt.speculative.dflash_utils import parse_dflash_draft_config
            draft = parse_dflash_draft_config(draft_hf_config=mc.hf_config)
            layer_ids = draft.resolve_target_layer_ids(target_num_layers=job["target_layers"])
            read.update(block_size=model.block_size, num_context_features=model.num_context_features,
                        target_layer_ids=layer_ids, mask_token_id=draft.mask_token_id,
                        attention=[layer.self_attn.attn_type.name for layer in model.layers])
        if algorithm == "DSPARK":
            from sglang.srt.speculative.dspark_components.dspark_config import resolve_runtime_config
            runtime = resolve_runtime_config(draft_hf_config=mc.hf_config, speculative_num_draft_tokens=None,
                                             target_vocab_size=job["target_vocab"])
            read.update(gamma=runtime.gamma, verify_num_draft_tokens=runtime.verify_num_draft_tokens,
                        sample_from_anchor=bool(model.sample_from_anchor),
                        markov_head=type(model.markov_head).__name__,
                        confidence_head=model.confidence_head is not None)
        out["steps_run"].append("read back")
    except Exception as e:
        fail("read back", e)
if out["error"] is None:
    if not job["target_architectures"]:
        out["steps_not_run"].append({"step": "capture", "reason": "no target config given"})
    else:
        try:
            from sglang.srt.models.registry import ModelRegistry
            target_cls, _ = ModelRegistry.resolve_model_cls(job["target_architectures"])
            stand_in = types.SimpleNamespace(
                pp_group=types.SimpleNamespace(is_last_rank=True),
                config=types.SimpleNamespace(num_hidden_layers=job["target_layers"]),
                model=types.SimpleNamespace(layers_to_capture=[]), capture_aux_hidden_states=False)
            hook = "set_eagle3_layers_to_capture" if algorithm == "EAGLE3" else "set_dflash_layers_to_capture"
            getattr(target_cls, hook)(stand_in, list(layer_ids))
            out["read"]["captured_before_layers"] = list(stand_in.model.layers_to_capture)
            out["read"]["target_class"] = target_cls.__name__
            out["steps_run"].append("capture")
        except Exception as e:
            out["steps_not_run"].append(
                {"step": "capture", "reason": " ".join(f"{type(e).__name__}: {e}".split())[:300]})
skip_rest("an earlier step failed")
out["ok"] = out["error"] is None and not out["unloaded"] and not out["dropped"]
print("RESULT " + json.dumps(out))
"""


def check_sglang_head(folder: Path | str, target_config: dict | None = None, timeout_s: float = 600) -> dict:
    """Run SGLang's own config load, model class and `load_weights` on an SGLang head folder (see the module
    docstring). Returns {ok, steps_run, steps_not_run [{step, reason}], unloaded, dropped, from_target, read, notes,
    error, version}. Raises native_checks.EngineMissing where no SGLang interpreter is set."""
    python = interpreter("sglang", "SPECDEC_TUNE_SGLANG_PYTHON")
    folder = Path(folder).resolve()
    config = json.loads((folder / "config.json").read_text())
    arch = (config.get("architectures") or [""])[0]
    target = (target_config or {}).get("text_config") or target_config or {}
    hidden, target_hidden = config.get("hidden_size"), config.get("target_hidden_size", config.get("hidden_size"))
    layout = _HEADS[arch].head_layout if arch in _HEADS else None
    job = {
        "folder": str(folder),
        "algorithm": ALGORITHMS.get(arch, "EAGLE3"),
        "confidence": bool(config.get("enable_confidence_head", False)),
        # EAGLE-3 takes the target's embedding where the widths match (models/llama.py:910-919, eagle_worker_v2.py:363)
        "from_target": ["model.embed_tokens.weight"]
        if layout is not None and layout.target_embedding and hidden == target_hidden
        else [],
        "target_layers": int(target.get("num_hidden_layers") or config.get("num_target_layers") or 0),
        "target_vocab": int(target.get("vocab_size") or config.get("vocab_size") or 0),
        "target_architectures": list((target_config or {}).get("architectures") or []),
    }
    out = run_program(python, _PROGRAM, job, cwd=folder, timeout_s=timeout_s)
    if "steps_run" not in out:  # the program itself did not finish
        error = "; ".join(out.get("errors", [])) or "no result"
        return {
            "ok": False,
            "steps_run": [],
            "steps_not_run": [{"step": "all", "reason": error}],
            "unloaded": [],
            "dropped": [],
            "error": error,
        }
    return out


__all__ = ["ALGORITHMS", "check_sglang_head"]
