"""A stand-in for vLLM behind the measurement backend's interface (`run(job, timeout_s, cwd)`), answering in the
runner's result format (profiles/vllm_runner.py), so that the vllm backend, its cost model and the engine check run in
CI.

It simulates what the runner would observe: continuous batching over a run's prompts at its concurrency, one step per
round; a request drafts K tokens per round (K from the config, or from its per-batch ranges at the step's batch size,
as vLLM's dense lookup gives it), each accepted with probability `accept` given the ones before (a chain), plus one
bonus token; a step costs base + per_token · rows · (1 + K) ms, times a seeded jitter. Its KV cache is sized as vLLM's
CPU worker sizes it, from the model folders' configs. Mechanisms in `refuse` fail at
start-up with a message, as vLLM refuses one it cannot run; `fail_run` names a run that dies part-way (out of memory).
`slowdown` is the machine's speed: every step and the speed probe (`probe_ms`, around each run where the job asks for
it) take that many times as long; a tuple gives each engine the next of its figures in turn (a machine that drifts).
`luck` is each engine's own speed, in turn as `slowdown`'s, on its steps alone: what the probe does not see (where a
process's memory and threads land).
"""

from __future__ import annotations

import random
from pathlib import Path


class FakeVllm:
    version = "0.32.0"
    python = "fake-python"

    def __init__(
        self,
        accept: float = 0.6,
        base_ms: float = 40.0,
        per_token_ms: float = 1.5,
        draft_ms_per_token: float = 0.0,
        refuse: dict[str, str] | None = None,
        fail_run: str | None = None,
        ignore_schedule: bool = False,
        jitter: float = 0.05,
        slowdown: float | tuple[float, ...] = 1.0,
        probe_ms: float = 20.0,
        luck: tuple[float, ...] = (1.0,),
    ) -> None:
        self.accept, self.base_ms, self.per_token_ms, self.draft_ms_per_token = (
            accept,
            base_ms,
            per_token_ms,
            draft_ms_per_token,
        )
        self.refuse, self.fail_run, self.ignore_schedule, self.jitter = refuse or {}, fail_run, ignore_schedule, jitter
        self.slowdowns, self.probe_ms = slowdown if isinstance(slowdown, tuple) else (slowdown,), probe_ms
        self.slowdown, self.lucks, self.luck = self.slowdowns[0], luck, luck[0]
        self.jobs: list[dict] = []

    def _k(self, config: dict | None, batch: int) -> int:
        if not config:
            return 0
        ranges = config.get("num_speculative_tokens_per_batch_size")
        if ranges and not self.ignore_schedule:
            return min(
                next((k for lo, hi, k in ranges if lo <= batch <= hi), ranges[-1][2]), config["num_speculative_tokens"]
            )
        return config["num_speculative_tokens"]

    def run(self, job: dict, timeout_s: float, cwd=None) -> dict:
        self.slowdown = self.slowdowns[len(self.jobs) % len(self.slowdowns)]
        self.luck = self.lucks[len(self.jobs) % len(self.lucks)]
        self.jobs.append(job)
        config = job.get("speculative_config")
        if job.get("speculative_config_file"):
            import json

            config = json.loads(Path(job["speculative_config_file"]).read_text())
        method = (config or {}).get("method")
        if not Path(job["model_dir"]).is_absolute() and cwd is None:  # the runner starts in a folder of its own
            return {
                "ok": False,
                "error": f"HFValidationError: Repo id must be in the form 'repo_name': {job['model_dir']!r}",
                "runs": [],
            }
        if method in self.refuse:
            return {"ok": False, "error": self.refuse[method], "runs": []}
        rng = random.Random(len(self.jobs))
        out = {
            "ok": True,
            "error": None,
            "vllm_version": self.version,
            "init_s": 1.0,
            "runs": [],
            "kv_cache": self._kv_cache(job, config),
        }
        for spec in job["runs"]:
            if spec["name"] == self.fail_run:
                out["runs"].append({"name": spec["name"], "error": "OutOfMemoryError: simulated"})
                continue
            out["runs"].append(
                self._run(spec, config, rng)
                | ({"probe_ms": [self.probe_ms * self.slowdown] * 2} if job.get("probe") else {})
            )
        return out

    @staticmethod
    def _kv_cache(job: dict, config: dict | None) -> dict:
        """As vLLM's CPU worker sizes it: the KV pool over one block's page in every attention layer (the target's and a
        draft model's), 2 · block size · KV heads · head dim · dtype bytes per layer."""
        import json
        from pathlib import Path

        block, pool = 16, 1 << 30
        dtype_bytes = {"float32": 4}.get(job.get("engine", {}).get("dtype"), 2)
        folders = [job["model_dir"]] + ([config["model"]] if config and config.get("model") else [])
        page = 0
        for folder in folders:
            c = json.loads((Path(folder) / "config.json").read_text())
            kv_heads = c.get("num_key_value_heads") or c["num_attention_heads"]
            head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
            page += c["num_hidden_layers"] * 2 * block * kv_heads * head_dim * dtype_bytes
        return {"num_blocks": pool // page, "block_size": block}

    def _run(self, spec: dict, config: dict | None, rng: random.Random) -> dict:
        pending = list(range(len(spec["prompts"])))
        conc = spec.get("concurrency", len(pending))
        requests = {
            i: {"output_ids": [], "rounds": 0, "finish_reason": None, "spec": None, "drafted": [], "accepted": []}
            for i in pending
        }
        live: list[int] = []
        fresh: set[int] = set()
        steps = []
        while pending or live:
            while pending and len(live) < conc:
                i = pending.pop(0)
                live.append(i)
                fresh.add(i)
            running, decoding = len(live), sum(1 for i in live if i not in fresh)
            k = self._k(config, running)
            drafts = drafted_tokens = accepted_total = 0
            for i in list(live):
                r = requests[i]
                if i in fresh:  # the prefill's token
                    r["output_ids"].append(1)
                    fresh.discard(i)
                    continue
                n = 0
                if k:
                    while n < k and rng.random() < self.accept:
                        n += 1
                    r["drafted"].append(k)
                    r["accepted"].append(n)
                    drafts, drafted_tokens, accepted_total = drafts + 1, drafted_tokens + k, accepted_total + n
                r["rounds"] += 1
                r["output_ids"] += [1] * (n + 1)
            for i in list(live):
                if len(requests[i]["output_ids"]) >= spec["max_tokens"]:
                    requests[i]["output_ids"] = requests[i]["output_ids"][: spec["max_tokens"]]
                    live.remove(i)
            ms = (
                (self.base_ms + self.per_token_ms * running * (1 + k) + self.draft_ms_per_token * k)
                * (1 + self.jitter * rng.random())
                * self.slowdown
                * self.luck
            )
            steps.append(
                {
                    "ms": ms,
                    "running": running,
                    "decoding": decoding,
                    "prefill": decoding < running,
                    "num_drafts": drafts,
                    "num_draft_tokens": drafted_tokens,
                    "num_accepted_tokens": accepted_total,
                }
            )
        for r in requests.values():
            r["spec"] = (
                {"per_step_drafted": r.pop("drafted"), "per_step_accepted": r.pop("accepted")} if config else None
            )
        return {
            "name": spec["name"],
            "steps": steps,
            "requests": [requests[i] for i in range(len(spec["prompts"]))],
            "counters": {},
        }
