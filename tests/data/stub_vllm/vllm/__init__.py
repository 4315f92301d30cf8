"""A stand-in for vLLM with just what profiles/vllm_runner.py calls, so that the runner's own code (its serve loop,
its forks, its runs) is tested where vLLM is not installed. Each import is logged to $STUB_VLLM_LOG, each engine's
process id too. A prompt of one token 13 crashes the engine's process; a prompt of one token 7 sleeps a minute."""

import os
import time
from types import SimpleNamespace

__version__ = "0.32.0"


def _log(line: str) -> None:
    with open(os.environ["STUB_VLLM_LOG"], "a") as f:
        f.write(line + "\n")


_log("import")


class SamplingParams:
    def __init__(self, max_tokens: int = 16, **_: object) -> None:
        self.max_tokens = max_tokens


class _Engine:
    def __init__(self) -> None:
        self.requests: dict[str, list] = {}
        self.vllm_config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=64, block_size=16))

    def add_request(self, rid: str, prompt: dict, params: SamplingParams) -> None:
        ids = prompt["prompt_token_ids"]
        if ids == [13]:
            os._exit(3)
        if ids == [7]:
            time.sleep(60)
        self.requests[rid] = [params.max_tokens, []]

    def step(self) -> list:
        out = []
        for rid, (left, tokens) in list(self.requests.items()):
            tokens.append(1)
            done = len(tokens) >= left
            completion = SimpleNamespace(token_ids=list(tokens), finish_reason="length" if done else None)
            out.append(SimpleNamespace(request_id=rid, outputs=[completion], finished=done))
            if done:
                del self.requests[rid]
        return out

    def get_metrics(self) -> list:
        return []

    def abort_request(self, ids: list) -> None:
        for rid in ids:
            self.requests.pop(rid, None)


class LLM:
    def __init__(self, **_: object) -> None:
        _log(f"engine {os.getpid()}")
        self.llm_engine = _Engine()
