"""Kernel configs for the plan's shapes: tuning keys, timed or tile-rule choices, and the `KernelTable` that records
them.

A plan fixes the shapes the kernels will see: per batch bucket (B, D), verification attention runs
G·(1+D) query rows per KV head over a cache of about ctx + 1 + D keys, and acceptance reads 1+D logit
rows of the vocabulary. Each shape maps to a key (kernel modules define theirs: `KEY`, `key_for`):

    verify_attention   rows_bucket (G·(1+D): next power of two up to the tile, whole tiles above it),
                       head_dim, kv_bucket (next power of two of the KV length)
    greedy_accept, rejection_sample    vocab_bucket (next power of two of V)

For every key the plan needs, `tune_kernels` picks one config:
- on a CUDA device, every candidate the kernel module's `prune` keeps is timed with triton's
  `do_bench` (median ms, summed over the plan shapes that share the key); a candidate that fails to
  compile or launch scores inf and loses (as triton's autotuner does); the winner is `measured`;
- without one, the kernel module's `tile_rule` decides and the entry says `modeled`.

The table is keyed by its factors (triton version, kernel source hashes, device); `stale_factors`
names the ones that changed, and a lookup that misses falls back to the tile rule.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.kernels.buckets import DEFAULT_TILE_ROWS, kv_bucket, next_pow2, rows_bucket, vocab_bucket  # noqa: F401  (the table's keys)
from specdec_tune.records import read_json, write_json

KERNEL_TABLE_SCHEMA_VERSION = 1

# kernel name -> the module that holds its kernel, reference, CONFIGS, prune, tile_rule and bench
TUNED_KERNELS = {
    "verify_attention": "specdec_tune.kernels.verify_attention",
    "greedy_accept": "specdec_tune.kernels.acceptance",
    "rejection_sample": "specdec_tune.kernels.acceptance",
}


def kernel_module(kernel: str):
    if kernel not in TUNED_KERNELS:
        raise SpecdecError(f"unknown kernel {kernel!r}", f"use one of {', '.join(TUNED_KERNELS)}")
    return importlib.import_module(TUNED_KERNELS[kernel])


def source_hashes() -> dict[str, str]:
    """sha256 of each kernel module's source: a changed kernel makes every table and cubin built from it stale."""
    files = sorted({TUNED_KERNELS[k].rsplit(".", 1)[1] for k in TUNED_KERNELS})
    here = Path(__file__).resolve().parent
    return {name: hashlib.sha256((here / f"{name}.py").read_bytes()).hexdigest() for name in files}


# ---------------------------------------------------------------------------------- served shapes


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """The target's sizes the kernels depend on."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def group(self) -> int:
        """G: query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_model_config(cls, config) -> ModelShapes:
        """From a `profiles.models.llama.ModelConfig`."""
        return cls(config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size)


@dataclasses.dataclass(frozen=True)
class ServedShapes:
    """What a deployment serves: (batch, draft length) per bucket, the context the kernels are keyed at, and the
    attention tile's rows."""

    buckets: tuple[tuple[int, int], ...]  # (B, D)
    ctx: int
    tile_rows: int = DEFAULT_TILE_ROWS


def call_shapes(served: ServedShapes, shapes: ModelShapes) -> list[dict]:
    """Every kernel call shape a deployment produces: {"kernel", "key", "shape" (bench keyword arguments)}.

    Per bucket (B, D): verification attention with T = 1+D rows per query head over ctx + T keys; with
    speculation on (D > 0) the two acceptance kernels over [B, 1+D, V] logits.
    """
    if shapes.num_heads % shapes.num_kv_heads:
        raise SpecdecError(
            f"{shapes.num_heads} query heads over {shapes.num_kv_heads} KV heads",
            "query heads must be a multiple of KV heads",
        )
    from specdec_tune.kernels import (
        acceptance,
        verify_attention,
    )  # imported on use: they need triton (kernels/__init__.py)

    ctx, out = served.ctx, []
    for B, D in served.buckets:
        T = 1 + D
        out.append(
            {
                "kernel": "verify_attention",
                "key": verify_attention.key_for(shapes.group, T, shapes.head_dim, ctx + T, served.tile_rows),
                "shape": {
                    "batch": B,
                    "num_heads": shapes.num_heads,
                    "num_kv_heads": shapes.num_kv_heads,
                    "head_dim": shapes.head_dim,
                    "num_tokens": T,
                    "kv_len": ctx + T,
                },
            }
        )
        if D > 0:
            for kernel in acceptance.KERNELS:
                out.append(
                    {
                        "kernel": kernel,
                        "key": acceptance.key_for(shapes.vocab_size),
                        "shape": {"kernel": kernel, "batch": B, "draft_len": D, "vocab_size": shapes.vocab_size},
                    }
                )
    return out


# ----------------------------------------------------------------------------------- the table


def _key_id(kernel: str, key: dict) -> str:
    return kernel + "|" + ",".join(f"{k}={key[k]}" for k in sorted(key))


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    kernel: str
    key: dict
    config: dict
    source: str  # "measured" (timed here) | "modeled" (tile rule)
    median_ms: float | None = None  # the winner's time summed over `shapes`
    timings: tuple = ()  # ({"config", "median_ms"}, ...) of every candidate timed
    shapes: tuple = ()  # the plan shapes that share this key


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """Chosen config per (kernel, key), with the factors that decide whether it still holds."""

    factors: dict  # triton_version, sources (kernel module sha256), device
    tile_rows: int
    entries: tuple[KernelEntry, ...]
    schema_version: int = KERNEL_TABLE_SCHEMA_VERSION

    def lookup(self, kernel: str, key: dict) -> KernelEntry | None:
        want = _key_id(kernel, key)
        return next((e for e in self.entries if _key_id(e.kernel, e.key) == want), None)

    def config_for(self, kernel: str, key: dict) -> dict:
        """The recorded config, or the tile rule for a key the table does not hold."""
        entry = self.lookup(kernel, key)
        return dict(entry.config) if entry else kernel_module(kernel).tile_rule(key)

    def to_json(self) -> dict:
        return {
            "schema_version": self.schema_version,
            "factors": self.factors,
            "tile_rows": self.tile_rows,
            "entries": [
                dataclasses.asdict(e) | {"timings": list(e.timings), "shapes": list(e.shapes)} for e in self.entries
            ],
        }

    @classmethod
    def from_json(cls, data: dict) -> KernelTable:
        if not isinstance(data, dict) or data.get("schema_version") != KERNEL_TABLE_SCHEMA_VERSION:
            raise SpecdecError(
                f"not a version-{KERNEL_TABLE_SCHEMA_VERSION} kernel table",
                "re-run `specdec-tune export` to tune the kernels again",
            )
        try:
            entries = tuple(
                KernelEntry(
                    e["kernel"],
                    e["key"],
                    e["config"],
                    e["source"],
                    e.get("median_ms"),
                    tuple(e.get("timings", ())),
                    tuple(e.get("shapes", ())),
                )
                for e in data["entries"]
            )
            return cls(factors=data["factors"], tile_rows=int(data["tile_rows"]), entries=entries)
        except (KeyError, TypeError) as e:
            raise SpecdecError(f"kernel table entry is malformed ({e})", "re-run `specdec-tune export`") from None

    def write(self, path: Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def read(cls, path: Path) -> KernelTable:
        return cls.from_json(read_json(path, "kernel table"))


def current_factors(device=None) -> dict:
    """What a table's choices depend on: triton's version, the kernel sources, and the device that timed them."""
    import triton

    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        dev = {"kind": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}"}
    else:
        dev = {"kind": "none", "name": "tile rules (no GPU timed these)"}
    return {"triton_version": triton.__version__, "sources": source_hashes(), "device": dev}


def stale_factors(table: KernelTable, device=None) -> list[str]:
    """Factors of `table` that differ from this environment, one line each (empty: the table still holds)."""
    now = current_factors(device)
    changed = []
    if table.factors.get("triton_version") != now["triton_version"]:
        changed.append(f"triton_version: {table.factors.get('triton_version')} -> {now['triton_version']}")
    for name, digest in now["sources"].items():
        if table.factors.get("sources", {}).get(name) != digest:
            changed.append(f"sources.{name}: the kernel source changed")
    measured = any(e.source == "measured" for e in table.entries)
    if measured and table.factors.get("device") != now["device"]:
        changed.append(f"device: {table.factors.get('device', {}).get('name')} -> {now['device']['name']}")
    return changed


# ----------------------------------------------------------------------------------- tuning


def _time_config(module, config: dict, shapes: list[dict]) -> float:
    """Summed median ms over the shapes; inf when the config does not compile or launch (it loses)."""
    try:
        return sum(module.bench(config, **s) for s in shapes)
    except Exception:  # noqa: BLE001 - triton's OutOfResources, compilation and launch errors: a candidate that cannot run loses
        return math.inf


def tune_kernels(calls: list[dict], *, device=None, tile_rows: int = DEFAULT_TILE_ROWS) -> KernelTable:
    """One config per (kernel, key) of `calls` (from `call_shapes`): timed on a CUDA `device`, else the tile rule."""
    timed = device is not None and getattr(device, "type", None) == "cuda"
    grouped: dict[str, list[dict]] = {}
    for call in calls:
        grouped.setdefault(_key_id(call["kernel"], call["key"]), []).append(call)
    entries = []
    for group in grouped.values():
        kernel, key = group[0]["kernel"], group[0]["key"]
        module = kernel_module(kernel)
        shapes = tuple(c["shape"] for c in group)
        if not timed:
            entries.append(KernelEntry(kernel, key, module.tile_rule(key), "modeled", shapes=shapes))
            continue
        import torch

        with torch.cuda.device(device):
            timings = [
                {"config": c, "median_ms": _time_config(module, c, list(shapes))}
                for c in module.prune(module.CONFIGS, key)
            ]
        best = min(timings, key=lambda t: t["median_ms"])
        if math.isinf(best["median_ms"]):
            raise SpecdecError(
                f"no {kernel} config ran for key {key}",
                "check the CUDA install; `specdec-tune export --debug` shows the error",
            )
        entries.append(
            KernelEntry(
                kernel,
                key,
                best["config"],
                "measured",
                best["median_ms"],
                tuple(
                    {"config": t["config"], "median_ms": None if math.isinf(t["median_ms"]) else t["median_ms"]}
                    for t in timings
                ),
                shapes,
            )
        )
    return KernelTable(factors=current_factors(device if timed else None), tile_rows=tile_rows, entries=tuple(entries))
