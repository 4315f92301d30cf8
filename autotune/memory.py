"""Does a bucket fit on the device? The memory model of the search, over the profile's `memory` record.

At batch B, context C and draft length D, for mechanism m with its weights in format q, per device:

    needed(B, C, D) = (W_target + W_m(q)) / P  +  B · (C + 1 + D) · (kv_target + kv_m) / P'  +  A(B, 1 + D) / P
    fits           ⇔  needed ≤ f · M

W: weights (profiles/memory.py), kv: KV bytes per token, 1 + D the lookahead slots a running request holds, A the
activation peak (measured where the profile has it at that (B, T), else B·T · the modeled bytes per row), M the
device's memory and f the memory fraction (vLLM's gpu_memory_utilization, default 0.9). P is the tensor-parallel size
(weights and activations split P ways); P' = P / max(1, P / H_kv): KV heads split P ways, replicated once P exceeds
them. Where the engine keeps the KV cache in a pool of its own (vLLM on a CPU), the KV term must fit the pool and the
rest the device. Concurrency that fits, the largest B with needed(B, C, D) ≤ f · M:

    B_max = floor((f · M − W / P) / ((C + 1 + D) · kv / P' + (1 + D) · a / P))      a: activation bytes per row

A `--device` projection (projection.py) rewrites the record for the other device: M from the hardware table, weights and
KV in bf16 (the dtype the projection models), no measured activation.
"""

from __future__ import annotations

import dataclasses
import math

from specdec_tune import SpecdecError
from specdec_tune.profiles.memory import weight_bytes

DEFAULT_FRACTION = 0.9  # vLLM's gpu_memory_utilization default


@dataclasses.dataclass(frozen=True)
class Need:
    weights_bytes: float
    kv_bytes: float
    activation_bytes: float
    budget_bytes: float
    kv_pool_bytes: float | None = None  # the engine's own KV pool, where it has one

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes + self.activation_bytes

    @property
    def fits(self) -> bool:
        if self.kv_pool_bytes is not None:
            return (
                self.kv_bytes <= self.kv_pool_bytes and self.weights_bytes + self.activation_bytes <= self.budget_bytes
            )
        return self.total_bytes <= self.budget_bytes

    def text(self) -> str:
        if self.kv_pool_bytes is not None:
            return (
                f"KV {gb(self.kv_bytes)} against the engine's KV pool of {gb(self.kv_pool_bytes)}; "
                f"weights {gb(self.weights_bytes)} + "
                f"activations {gb(self.activation_bytes)} against {gb(self.budget_bytes)}"
            )
        return (
            f"needs {gb(self.total_bytes)} (weights {gb(self.weights_bytes)} + KV {gb(self.kv_bytes)} + activations "
            f"{gb(self.activation_bytes)}), {gb(self.budget_bytes)} available"
        )


def gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


class MemoryModel:
    """needed / fits / max_concurrency of the module docstring, for one profile (or its projection)."""

    def __init__(self, record: dict, *, fraction: float = DEFAULT_FRACTION, tensor_parallel: int = 1) -> None:
        if not 0 < fraction <= 1:
            raise SpecdecError(
                f"--memory-fraction {fraction:g} is outside (0, 1]",
                "give the share of device memory to plan into, e.g. 0.9",
            )
        if tensor_parallel < 1:
            raise SpecdecError(
                f"--tensor-parallel {tensor_parallel} is below 1", "give the number of devices one replica spans"
            )
        self.record, self.fraction, self.tp = record, fraction, tensor_parallel
        self.dtype_bytes = record["dtype_bytes"]
        self.device_bytes = int(record["device"]["usable_bytes"])
        self.device_source = record["device"]["source"]
        pool = record["device"].get("kv_cache_bytes")
        self.kv_pool_bytes = float(pool) if pool else None
        kv_heads = int(record["target"]["shape"]["kv_heads"])
        self.kv_split = tensor_parallel / max(1, tensor_parallel // kv_heads)
        self.measured_activation = {
            (a["batch"], a["tokens"]): a["bytes"] for a in record.get("activation", []) if a["source"] == "measured"
        }

    @property
    def budget_bytes(self) -> float:
        return self.fraction * self.device_bytes

    def _drafter(self, mechanism: str) -> dict:
        if mechanism == "none":
            return {"kv_bytes_per_token": 0}
        if mechanism not in self.record["drafters"]:
            raise SpecdecError(
                f"the profile's memory record has no drafter {mechanism!r}",
                "re-run `specdec-tune profile` with this version",
            )
        return self.record["drafters"][mechanism]

    def weights_bytes(self, mechanism: str, quant: str) -> float:
        """Per device: the target's weights (unquantized) and the drafter's in format `quant`."""
        drafter = self._drafter(mechanism)
        own = weight_bytes(drafter, quant, self.dtype_bytes) if "linear_params" in drafter else 0.0
        return (weight_bytes(self.record["target"], "none", self.dtype_bytes) + own) / self.tp

    def kv_bytes_per_token(self, mechanism: str) -> float:
        return (
            self.record["target"]["kv_bytes_per_token"] + self._drafter(mechanism)["kv_bytes_per_token"]
        ) / self.kv_split

    def activation_bytes(self, batch: int, tokens: int) -> float:
        measured = self.measured_activation.get((batch, tokens))
        return (
            measured if measured is not None else batch * tokens * self.record["activation_bytes_per_row"]
        ) / self.tp

    def need(self, batch: int, ctx: int, draft_len: int, mechanism: str = "none", quant: str = "none") -> Need:
        if draft_len == 0:
            mechanism, quant = "none", "none"
        return Need(
            self.weights_bytes(mechanism, quant),
            batch * (ctx + 1 + draft_len) * self.kv_bytes_per_token(mechanism),
            self.activation_bytes(batch, 1 + draft_len),
            self.budget_bytes,
            self.kv_pool_bytes,
        )

    def max_concurrency(self, ctx: int, draft_len: int, mechanism: str = "none", quant: str = "none") -> int:
        """The largest batch that fits (0: not even one request)."""
        if draft_len == 0:
            mechanism, quant = "none", "none"
        kv_row = (ctx + 1 + draft_len) * self.kv_bytes_per_token(mechanism)
        act_row = (1 + draft_len) * self.record["activation_bytes_per_row"] / self.tp
        room = self.budget_bytes - self.weights_bytes(mechanism, quant)
        if self.kv_pool_bytes is not None:
            by_kv = math.floor(self.kv_pool_bytes / kv_row) if kv_row else 1 << 30
            by_act = math.floor(room / act_row) if act_row else 1 << 30
            return max(0, min(by_kv, by_act))
        return max(0, math.floor(room / (kv_row + act_row)))

    def kv_capacity_tokens(self, mechanism: str, quant: str, batch: int, draft_len: int) -> int:
        """Tokens the KV cache holds for this deployment: the engine's pool, else what the budget leaves once the
        weights and the largest bucket's activations are in (what an engine reports as blocks x block size)."""
        if draft_len == 0:
            mechanism, quant = "none", "none"
        room = (
            self.kv_pool_bytes
            if self.kv_pool_bytes is not None
            else self.budget_bytes - self.weights_bytes(mechanism, quant) - self.activation_bytes(batch, 1 + draft_len)
        )
        return max(0, math.floor(room / self.kv_bytes_per_token(mechanism)))

    def summary(self, ctx: int, pairs: list[tuple[str, str]], draft_lens: dict[str, list[int]]) -> dict:
        """What plan.json records: the budget, its sources and, per mechanism / format and D, the concurrency that
        fits."""
        return {
            "fraction": self.fraction,
            "device_bytes": self.device_bytes,
            "budget_bytes": self.budget_bytes,
            "device_source": self.device_source,
            "tensor_parallel": self.tp,
            "kv_cache_pool_bytes": self.kv_pool_bytes,
            "ctx": ctx,
            "target_weights_bytes": self.weights_bytes("none", "none"),
            "target_kv_bytes_per_token": self.kv_bytes_per_token("none"),
            "max_concurrency": {"none": {"0": self.max_concurrency(ctx, 0)}}
            | {f"{m}/{q}": {str(D): self.max_concurrency(ctx, D, m, q) for D in draft_lens[m] if D} for m, q in pairs},
            "formula": (
                "weights/P + B·(C + 1 + D)·KV per token/P' + activations(B, 1 + D)/P <= fraction · device memory"
            ),
            "sources": {
                "weights, KV bytes per token": self.record["target"]["source"],
                "activations": "measured (allocator peak)" if self.measured_activation else "modeled from the config",
                "device memory": self.device_source,
            },
        }
