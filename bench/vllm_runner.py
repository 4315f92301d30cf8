"""Run one greedy generation in the real vLLM engine and report its speculative-decoding counters.

Runs inside the vLLM virtualenv: imports only vLLM and the standard library.

    python vllm_runner.py INPUT.json OUTPUT.json

INPUT.json:
    model_dir           Hugging Face folder (config.json with `architectures`, safetensors, tokenizer)
    speculative_config  dict passed to LLM(speculative_config=...), or null for plain decoding
    prompts             list of token-id lists
    max_tokens          new tokens per prompt
    max_num_seqs        vLLM's maximum running batch
    seed                engine seed
    optional: dtype ("float32"), max_model_len, stop_token_ids, enforce_eager (true)

OUTPUT.json (written even when the engine fails, with `ok: false` and the error verbatim):
    vLLM version, SpeculativeConfig's field names and `method` literals, the standalone
    SpeculativeConfig construction result, output token ids per prompt, the aggregate counters
    (vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _per_pos),
    mean acceptance length = 1 + accepted / drafts, per-request counters where the version has
    them, and wall seconds.

Exit status: 0 on success, 1 when the engine failed, 2 on unusable input.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import sys
import time
import traceback
import typing

# Before vLLM is imported: keep the engine core in this process (one process, no spawn), take a
# small KV cache (GiB), leave thread placement to the OS (pinning OpenMP to a core another process
# keeps busy slows decoding many times over on a small shared machine), and never reach for a hub.
for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

COUNTER_NAMES = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS_NAME = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _literal_values(annotation) -> list[str]:
    """Every string in a (possibly nested, possibly Optional) Literal annotation, in order."""
    out: list[str] = []
    if typing.get_origin(annotation) is typing.Literal:
        for arg in typing.get_args(annotation):
            out += _literal_values(arg) if not isinstance(arg, str) else [arg]
    else:
        for arg in typing.get_args(annotation):
            out += _literal_values(arg)
    return list(dict.fromkeys(out))


def describe_speculative_config_class() -> dict:
    """SpeculativeConfig's field names and accepted `method` literals in the installed vLLM."""
    from vllm.config import SpeculativeConfig

    pydantic_fields = getattr(SpeculativeConfig, "__pydantic_fields__", None) or getattr(SpeculativeConfig, "model_fields", None)
    if dataclasses.is_dataclass(SpeculativeConfig):
        names = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    else:
        names = list(pydantic_fields or {})
    methods: list[str] = []
    if pydantic_fields and "method" in pydantic_fields:
        methods = _literal_values(pydantic_fields["method"].annotation)
    if not methods:
        try:
            from vllm.config import speculative

            methods = _literal_values(getattr(speculative, "SpeculativeMethod"))
        except (ImportError, AttributeError):
            methods = []
    return {
        "fields": names,
        "method_literals": methods,
        "has_num_speculative_tokens_per_batch_size": "num_speculative_tokens_per_batch_size" in names,
    }


def _json_safe(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    return repr(value)


def check_speculative_config(config: dict | None, field_names: list[str]) -> dict:
    """Construct vLLM's own SpeculativeConfig from the dict alone (no target model attached).

    Methods that need the target (e.g. mtp) cannot be built standalone; the engine run then says
    whether the config works. Errors are reported verbatim.
    """
    if config is None:
        return {"ok": None, "error": None, "note": "no speculative_config: plain decoding"}
    result: dict = {"unknown_fields": sorted(set(config) - set(field_names))}
    try:
        from vllm.config import SpeculativeConfig

        built = SpeculativeConfig(**config)
    except Exception as e:  # pydantic ValidationError, ValueError from __post_init__, ...
        result.update(ok=False, error=_error_text(e))
        return result
    keys = list(dict.fromkeys(["method", "model", "num_speculative_tokens", *config]))
    result.update(ok=True, error=None, repr=repr(built), normalized={k: _json_safe(getattr(built, k, None)) for k in keys})
    if getattr(built, "num_speculative_tokens_per_batch_size", None):
        try:
            from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

            schedule = validate_and_normalize_dynamic_sd_schedule(list(built.num_speculative_tokens_per_batch_size))
            result["per_batch_schedule"] = {"ok": True, "normalized": [list(r) for r in schedule]}
        except ImportError:
            result["per_batch_schedule"] = {"ok": None, "error": "no schedule validator in this vLLM"}
        except Exception as e:
            result["per_batch_schedule"] = {"ok": False, "error": _error_text(e)}
    return result


def read_counters(llm) -> dict:
    """Sum of vLLM's spec-decode counters over engines, from LLM.get_metrics()."""
    from vllm.v1.metrics.reader import Counter, Vector

    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_accepted_tokens_per_pos": []}
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in COUNTER_NAMES:
            out[COUNTER_NAMES[m.name]] += int(m.value)
        elif isinstance(m, Vector) and m.name == PER_POS_NAME:
            per_pos = out["num_accepted_tokens_per_pos"]
            per_pos += [0] * (len(m.values) - len(per_pos))
            for i, v in enumerate(m.values):
                per_pos[i] += int(v)
    return out


def counters_delta(after: dict, before: dict) -> dict:
    out = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    a, b = after["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"]
    b = b + [0] * (len(a) - len(b))
    out["num_accepted_tokens_per_pos"] = [x - y for x, y in zip(a, b)]
    return out


def _engine_kwargs(job: dict) -> dict:
    import vllm.engine.arg_utils as arg_utils

    known = {f.name for f in dataclasses.fields(arg_utils.EngineArgs)}
    kwargs = dict(
        model=job["model_dir"],
        tokenizer=job["model_dir"],
        dtype=job.get("dtype", "float32"),
        max_num_seqs=int(job["max_num_seqs"]),
        seed=int(job.get("seed", 0)),
        enforce_eager=bool(job.get("enforce_eager", True)),  # no torch.compile / graphs: CPU start-up in seconds
        disable_log_stats=False,  # LLM.get_metrics() needs stat logging on
        enable_prefix_caching=False,  # every prompt prefilled from scratch, as the reference loop does
        speculative_config=job.get("speculative_config"),
    )
    if job.get("max_model_len"):
        kwargs["max_model_len"] = int(job["max_model_len"])
    if "per_request_spec_decode_metrics" in known and job.get("speculative_config"):
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return kwargs


def run(job: dict) -> dict:
    import vllm

    t_start = time.perf_counter()
    result: dict = {"ok": False, "error": None, "vllm_version": getattr(vllm, "__version__", "unknown"), "python": sys.version.split()[0]}
    try:
        result["torch_version"] = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        pass
    described = describe_speculative_config_class()
    result["speculative_config_fields"] = described["fields"]
    result["method_literals"] = described["method_literals"]
    result["has_num_speculative_tokens_per_batch_size"] = described["has_num_speculative_tokens_per_batch_size"]
    result["speculative_config_input"] = job.get("speculative_config")
    result["speculative_config_check"] = check_speculative_config(job.get("speculative_config"), described["fields"])

    from vllm import LLM, SamplingParams

    kwargs = _engine_kwargs(job)
    result["engine_args"] = {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")}
    try:
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["init_s"] = time.perf_counter() - t0
    except Exception as e:
        result["error"] = _error_text(e)
        result["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
        result["wall_s"] = time.perf_counter() - t_start
        return result

    params = SamplingParams(
        temperature=0.0,
        max_tokens=int(job["max_tokens"]),
        stop_token_ids=[int(t) for t in job.get("stop_token_ids", [])] or None,
    )
    prompts = [{"prompt_token_ids": [int(t) for t in p]} for p in job["prompts"]]
    try:
        before = read_counters(llm)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result["generate_s"] = time.perf_counter() - t0
        counters = counters_delta(read_counters(llm), before)
    except Exception as e:
        result["error"] = _error_text(e)
        result["traceback_tail"] = traceback.format_exc().splitlines()[-12:]
        result["wall_s"] = time.perf_counter() - t_start
        return result

    completions = [o.outputs[0] for o in outputs]
    result["outputs"] = [list(c.token_ids) for c in completions]
    result["finish_reasons"] = [c.finish_reason for c in completions]
    per_request = []
    for c in completions:
        m = getattr(c, "spec_decode_metrics", None)
        per_request.append(m.to_dict() if m is not None and hasattr(m, "to_dict") else None)
    result["per_request"] = per_request if any(p is not None for p in per_request) else None
    result["counters"] = counters
    drafts, accepted = counters["num_drafts"], counters["num_accepted_tokens"]
    result["mean_acceptance_length"] = 1.0 + accepted / drafts if drafts else None
    result["acceptance_rate"] = accepted / counters["num_draft_tokens"] if counters["num_draft_tokens"] else None
    result["mean_draft_len"] = counters["num_draft_tokens"] / drafts if drafts else None
    result["output_tokens"] = sum(len(o) for o in result["outputs"])
    result["ok"] = True
    result["wall_s"] = time.perf_counter() - t_start
    return result


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: vllm_runner.py INPUT.json OUTPUT.json", file=sys.stderr)
        return 2
    try:
        with open(argv[1]) as f:
            job = json.load(f)
        missing = [k for k in ("model_dir", "prompts", "max_tokens", "max_num_seqs") if k not in job]
        if missing:
            raise ValueError(f"input lacks {missing}")
    except (OSError, ValueError) as e:
        _write_json(argv[2], {"ok": False, "error": f"unusable input {argv[1]}: {_error_text(e)}"})
        return 2
    result = run(job)
    _write_json(argv[2], result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # vLLM may start worker processes that re-import this module
    sys.exit(main(sys.argv))
