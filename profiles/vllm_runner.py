"""One vLLM engine, driven step by step: round times and speculative-decoding counters as vLLM itself runs them.

Runs inside the vLLM interpreter (its own virtualenv, or this one where vLLM imports): imports only vLLM (and the torch
it brings) and the standard library, never this package.

    python vllm_runner.py JOB.json RESULT.json
    python vllm_runner.py --serve      jobs read from stdin, each run in a process forked from this one (`serve`)

JOB.json:
    model_dir           Hugging Face folder vLLM loads (config.json with `architectures`, safetensors, tokenizer)
    speculative_config  dict given to vLLM as `speculative_config`, or null for plain decoding
    speculative_config_file  instead: a JSON file read as written (a bundle's own vllm/speculative_config.json; a
                        relative path inside it is relative to the working directory the caller runs this in)
    max_num_seqs        vLLM's largest running batch
    engine              more EngineArgs, passed through (dtype, max_model_len, tensor_parallel_size, quantization, ...)
    runs                what to run, in order, on the one engine:
        name            the run's name (echoed)
        prompts         token-id lists
        concurrency     requests in flight: the first `concurrency` start together, each finished one is replaced by
                        the next prompt (continuous batching, as a server keeps its batch)
        max_tokens      new tokens per request
        temperature     0 = greedy
        ignore_eos      keep every row decoding to max_tokens (timing runs: the batch stays full)
        seed            sampling seed (temperature > 0)
    probe               optional: the device's speed, timed in this process on either side of every run and between its
                        steps (`Probe`): layers, rows, hidden, intermediate, dtype, iters, every_steps

RESULT.json (written whatever happens; `ok: false` and vLLM's message when the engine fails to start):
    vllm_version, engine_args, init_s, kv_cache (the KV cache vLLM allocated: num_blocks x block_size tokens),
    and per run:
    steps     per engine step: wall ms, requests running before it, rows that were already decoding, whether a prompt
              was prefilled in it, and the counters' change over it (drafts, draft tokens, accepted tokens)
    requests  per request: output token ids, rounds (steps that gave it tokens, its prefill's excluded), and vLLM's
              per-request spec-decode metrics (drafted and accepted per verify step)
    counters  vLLM's aggregate spec-decode counters over the run (per position included)
    error     vLLM's message where the run failed (its requests are aborted and the next run is tried)
    probe_ms  the probe's ms just before the run, after every `every_steps`-th step, and just after the run (where
              the job has a probe)

Exit status: 0 when the engine started (a run may still have failed: see its `error`), 1 when it did not, 2 on an
unusable job.

A step is timed as LLMEngine.step() returns it, with the engine core in this process (no multiprocessing): scheduling,
drafting, the target's forward, rejection sampling and output processing, exactly the work of one decode round.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

# Before vLLM is imported: keep the engine core in this process (steps are then timed whole and synchronous), take a
# small KV cache (GiB), leave thread placement to the OS (pinning OpenMP to a core another process keeps busy slows
# decoding many times over on a small shared machine), and never reach for a hub.
for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "ERROR",
}.items():
    os.environ.setdefault(_key, _value)

COUNTER_NAMES = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POS_NAME = "vllm:spec_decode_num_accepted_tokens_per_pos"


def error_text(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())[:600]


def read_counters(engine) -> dict:
    """vLLM's spec-decode counters, summed over engines (LLMEngine.get_metrics)."""
    from vllm.v1.metrics.reader import Counter, Vector

    out: dict[str, Any] = {
        "num_drafts": 0,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
        "num_accepted_tokens_per_pos": [],
    }
    for m in engine.get_metrics():
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
    out["num_accepted_tokens_per_pos"] = [x - y for x, y in zip(a, b + [0] * (len(a) - len(b)))]
    return out


class Probe:
    """A fixed piece of work timed around and within each run, in the engine's own process and threads: the linear
    layers of one decode forward of the target's shape (`layers` x (attention in and out [hidden, 2·hidden], MLP up
    [hidden, 2·intermediate], down [intermediate, hidden]) on `rows` rows), weights allocated once. Its ms is the
    median of `iters` forwards on either side of a run and one forward between its steps, so that the samples spread
    over the run as the machine's spells do (the steps are timed apart from it). The profile records it at profile
    time; a later run's probe against that says how much slower or faster the shared machine runs now than when the
    rounds were profiled."""

    def __init__(self, spec: dict) -> None:
        import torch

        dtype = getattr(torch, spec["dtype"])
        h, i = int(spec["hidden"]), int(spec["intermediate"])
        shapes = [
            (h, 2 * h),
            (h, 2 * i),
            (i, h),
        ]  # a dense product's time does not depend on the values: constants are quick to make
        self.weights = [[torch.full((a, b), 0.01, dtype=dtype) for a, b in shapes] for _ in range(int(spec["layers"]))]
        self.x_h = torch.full((int(spec["rows"]), h), 0.5, dtype=dtype)
        self.x_i = torch.full((int(spec["rows"]), i), 0.5, dtype=dtype)
        self.iters, self.every_steps, self.torch = int(spec["iters"]), int(spec.get("every_steps") or 0), torch

    def ms(self, iters: int | None = None) -> float:
        times = []
        with self.torch.inference_mode():
            for _ in range(iters or self.iters):
                t0 = time.perf_counter()
                for attn, up, down in self.weights:
                    self.x_h @ attn
                    self.x_h @ up
                    self.x_i @ down
                times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]


def engine_args(job: dict) -> dict:
    kwargs = dict(job.get("engine") or {})
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("seed", 0)
    kwargs.setdefault("enforce_eager", True)  # no torch.compile on a CPU: start-up in seconds; a GPU run passes False
    kwargs |= dict(
        model=job["model_dir"],
        tokenizer=job["model_dir"],
        max_num_seqs=int(job["max_num_seqs"]),
        disable_log_stats=False,  # the counters need stat logging on
        enable_prefix_caching=False,  # every prompt prefilled from scratch
        speculative_config=job.get("speculative_config"),
        trust_remote_code=bool(job.get("trust_remote_code", False)),
    )
    if job.get("speculative_config"):
        kwargs["per_request_spec_decode_metrics"] = "detailed"  # drafted / accepted per verify step, per request
    return kwargs


def run_one(engine, run: dict, counter, probe: Probe | None = None) -> dict:
    """Keep `concurrency` requests in flight over the run's prompts; time and count every engine step (and between
    them, every `probe.every_steps` steps, the probe once). A failure aborts the run's requests (the next run starts on
    an empty engine) and is raised."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=float(run.get("temperature", 0.0)),
        max_tokens=int(run["max_tokens"]),
        ignore_eos=bool(run.get("ignore_eos", False)),
        seed=run.get("seed"),
    )
    prompts = list(enumerate(run["prompts"]))
    concurrency = int(run.get("concurrency", len(prompts)))
    name = run.get("name", "run")
    requests: dict[int, dict] = {}
    in_flight: dict[str, int] = {}  # request id -> prompt index
    steps, probe_ms = [], []
    before = last = read_counters(engine)

    def add_next() -> None:
        i, ids = prompts.pop(0)
        rid = f"{name}-{i}-{next(counter)}"
        engine.add_request(rid, {"prompt_token_ids": [int(t) for t in ids]}, params)
        in_flight[rid] = i
        requests[i] = {"output_ids": [], "rounds": 0, "finish_reason": None, "spec": None}

    try:
        while prompts and len(in_flight) < concurrency:
            add_next()
        added = True
        while in_flight:
            running = len(in_flight)
            decoding = sum(1 for i in in_flight.values() if requests[i]["output_ids"])
            t0 = time.perf_counter()
            outputs = engine.step()
            ms = 1e3 * (time.perf_counter() - t0)
            now = read_counters(engine)
            delta, last = counters_delta(now, last), now
            prefilled, added = added or decoding < running, False
            for out in outputs:
                i = in_flight.get(out.request_id)
                if i is None:
                    continue
                completion, record = out.outputs[0], requests[i]
                new = list(completion.token_ids)
                if len(new) > len(record["output_ids"]) and record["output_ids"]:
                    record["rounds"] += 1  # a decode round gave it tokens (the prefill's first token is not a round)
                record["output_ids"] = new
                if out.finished:
                    record["finish_reason"] = completion.finish_reason
                    metrics = getattr(completion, "spec_decode_metrics", None)
                    record["spec"] = metrics.to_dict() if metrics is not None and hasattr(metrics, "to_dict") else None
                    del in_flight[out.request_id]
                    if prompts:
                        add_next()
                        added = True
            steps.append(
                {
                    "ms": ms,
                    "running": running,
                    "decoding": decoding,
                    "prefill": prefilled,
                    "num_drafts": delta["num_drafts"],
                    "num_draft_tokens": delta["num_draft_tokens"],
                    "num_accepted_tokens": delta["num_accepted_tokens"],
                }
            )
            if probe and probe.every_steps and len(steps) % probe.every_steps == 0:
                probe_ms.append(probe.ms(1))
    except Exception:
        try:
            engine.abort_request(list(in_flight))
        except Exception:  # the engine itself is gone: the next run says so
            pass
        raise
    return {
        "name": name,
        "steps": steps,
        "requests": [requests[i] for i in sorted(requests)],
        "counters": counters_delta(read_counters(engine), before),
        "probe_ms": probe_ms,
    }


def run(job: dict) -> dict:
    import itertools

    import vllm

    result: dict = {"ok": False, "error": None, "vllm_version": getattr(vllm, "__version__", "unknown"), "runs": []}
    if job.get("speculative_config_file"):
        with open(job["speculative_config_file"], "rb") as f:
            job = job | {"speculative_config": json.loads(f.read().decode("utf-8"))}
    kwargs = engine_args(job)
    result["engine_args"] = {k: v for k, v in kwargs.items() if k not in ("model", "tokenizer")}
    try:
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        result["init_s"] = time.perf_counter() - t0
    except Exception as e:  # the engine's own refusal, verbatim: the caller records the mechanism as unsupported
        result["error"] = error_text(e)
        result["traceback_tail"] = traceback.format_exc().splitlines()[-8:]
        return result
    result["ok"] = True
    engine, counter = llm.llm_engine, itertools.count()
    cache = engine.vllm_config.cache_config  # the engine core runs in this process: its KV cache size is set here
    result["kv_cache"] = {"num_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}
    probe = Probe(job["probe"]) if job.get("probe") else None
    for spec in job["runs"]:
        before = probe.ms() if probe else None
        try:
            out = run_one(engine, spec, counter, probe)
        except Exception as e:  # out of memory, or the engine fails mid-run: this run fails, the next ones are tried
            out = {"name": spec.get("name"), "error": error_text(e)}
        if probe:
            out["probe_ms"] = [before, *out.get("probe_ms", []), probe.ms()]
        else:
            out.pop("probe_ms", None)
        result["runs"].append(out)
    return result


def write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def serve() -> int:
    """Import vLLM once, then run each job named on stdin in a process forked from this one: every engine starts in a
    process of its own, as from the command line, without paying the import again (about 10 s of a 40 s engine on a
    2-core CPU). This process starts no engine and no thread pool, so a fork copies nothing but the imports. A line in:
    {"job", "result", "cwd", "log"}; lines out: {"pid": the engine's process} once it is forked, {"exit": its status}
    once it ends (negative: the signal that ended it). The engine's output goes to the file `log`, not to this
    protocol."""
    import vllm  # noqa: F401  (what every forked engine inherits)
    from vllm import LLM  # noqa: F401

    for line in sys.stdin:
        ask = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the engine's process
            code = 1
            try:
                log = os.open(ask["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.chdir(ask["cwd"])
                code = main(["vllm_runner.py", ask["job"], ask["result"]])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    if argv[1:] == ["--serve"]:
        return serve()
    if len(argv) != 3:
        print("usage: vllm_runner.py JOB.json RESULT.json | vllm_runner.py --serve", file=sys.stderr)
        return 2
    try:
        with open(argv[1]) as f:
            job = json.load(f)
        missing = [k for k in ("model_dir", "max_num_seqs", "runs") if k not in job]
        if missing:
            raise ValueError(f"the job lacks {missing}")
    except (OSError, ValueError) as e:
        write_json(argv[2], {"ok": False, "error": f"unusable job {argv[1]}: {error_text(e)}"})
        return 2
    result = run(job)
    write_json(argv[2], result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":  # vLLM may start worker processes that re-import this module
    sys.exit(main(sys.argv))
