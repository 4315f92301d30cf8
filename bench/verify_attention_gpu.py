"""Verification attention on a GPU: the Triton kernel against torch's scaled_dot_product_attention over the
plan's shapes, and the tile steps at G·(1+D) multiples of 128.

    python bench/verify_attention_gpu.py                       # demo + 8B Llama shapes, ctx 4096 (about 1-2 minutes)
    python bench/verify_attention_gpu.py --plan artifacts/plan.json   # the plan's buckets and ctx
    python bench/verify_attention_gpu.py --quick               # fewer points (the GPU test runs it)
    python bench/verify_attention_gpu.py --cpu-smoke --out x.json     # tiny shapes under TRITON_INTERPRET on a CPU:
                                                                      # the script runs

Three parts, all in bf16 with random weights (timing does not depend on values):
  check       the kernel against its fp32 torch reference, contiguous and paged caches, before any timing;
  plan        per bucket (B, D): Triton (contiguous, paged) and torch SDPA as the model calls it (`gqa_attention`:
              G·(1+D) rows per KV head, boolean mask), median ms from triton.testing.do_bench;
  tile sweep  one batch, D swept so that G·(1+D) crosses 128, 256 and 384; the shipped config and a fixed
              128-row tile; `tile_steps` is the time just past each multiple over the time at it.

Writes bench/results/verify_attention_gpu.json and prints a short table. Without CUDA it says so and exits 3
(nothing written) unless --cpu-smoke is given.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path

from common import ROOT, run_and_write

MODELS = {  # name -> (query heads, KV heads, head dim)
    "smollm2-135m": (9, 3, 64),
    "llama-8b": (32, 8, 128),
}
DEFAULT_BUCKETS = [(1, 3), (2, 3), (4, 1), (8, 1), (16, 0)]  # (batch, D): the README's demo schedule
TILE_ROWS = 128
EXIT_NO_GPU = 3


def sweep_draft_lens(group: int, max_rows: int, quick: bool) -> list[int]:
    """D values whose G·(1+D) sit just below, at and just past each multiple of the tile, plus a few between."""
    rows = set()
    for k in range(1, max_rows // TILE_ROWS + 1):
        edge = k * TILE_ROWS
        rows |= (
            {edge - group, edge, edge + group}
            if quick
            else {edge - 2 * group, edge - group, edge, edge + group, edge + 2 * group}
        )
    if not quick:
        rows |= {group, 32, 64, 96}
    return sorted({max(0, -(-r // group) - 1) for r in rows if r > 0})


def run(args) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are decorated
    import triton

    from specdec_tune.kernels import verify_attention as va
    from specdec_tune.profiles.models.llama import gqa_attention
    from specdec_tune.profiles.timing import time_call

    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    if cuda:

        def median_ms(fn) -> float:
            return float(triton.testing.do_bench(fn, return_mode="median"))
    else:

        def median_ms(fn) -> float:
            return time_call(fn, device=device, warmup=0, repeats=1).median_ms

    models = {"tiny": (4, 2, 16)} if args.cpu_smoke else MODELS
    ctx = 24 if args.cpu_smoke else args.ctx
    buckets = args.buckets[:2] if args.cpu_smoke else args.buckets

    def inputs(model, B, T, page_size=0):
        H, H_kv, hd = models[model]
        return va.make_inputs(B, H, H_kv, hd, T, ctx + T, dtype=dtype, device=device, page_size=page_size)

    def sdpa_call(q, k, v):
        B, _, T, _ = q.shape
        L = k.shape[2]
        positions = (L - T) + torch.arange(T, device=device)
        mask = (torch.arange(L, device=device)[None, :] <= positions[:, None]).expand(B, 1, T, L)  # [B, 1, T, L]
        return partial(gqa_attention, q, k, v, mask)

    # ---- check: the kernel against the fp32 reference before timing it
    check = []
    for model in models:
        for B, D in [(2, 3), (3, 15)][: 1 if args.cpu_smoke else 2]:
            for page_size in (0, 16):
                q, k, v, lens, table = inputs(model, B, 1 + D, page_size)
                lens = (lens - torch.arange(B, device=device, dtype=torch.int32) * 5).clamp_min(1 + D)  # ragged
                got = va.verify_attention(q, k, v, lens, block_table=table)
                ref = va.verify_attention_ref(q, k, v, lens, table, out_dtype=torch.float32)
                err = float((got.float() - ref).abs().max())
                check.append(
                    {
                        "model": model,
                        "cache": "paged" if page_size else "contiguous",
                        "batch": B,
                        "draft_len": D,
                        "max_abs_err": err,
                        "passed": err < 3e-2,
                    }
                )
    aot_check = aot_round_trip(models, ctx, device) if cuda else {"skipped": "no CUDA device"}
    if not all(c["passed"] for c in check) or not aot_check.get("passed", True):
        from specdec_tune import SpecdecError

        bad = next((c for c in check if not c["passed"]), aot_check)
        raise SpecdecError(f"kernel check failed: {bad}", "fix the kernel before timing it")

    # ---- plan shapes: Triton (contiguous, paged) against SDPA
    plan_rows = []
    for model in models:
        H, H_kv, hd = models[model]
        G = H // H_kv
        for B, D in buckets:
            T = 1 + D
            q, k, v, lens, _ = inputs(model, B, T)
            qp, kp, vp, lensp, table = inputs(model, B, T, page_size=16)
            out = torch.empty_like(q)
            config = va.tile_rule(va.key_for(G, T, hd, ctx + T))
            row = {
                "model": model,
                "batch": B,
                "draft_len": D,
                "rows": G * T,
                "ctx": ctx,
                "config": config,
                "triton_contiguous_ms": median_ms(partial(va.verify_attention, q, k, v, lens, out=out, config=config)),
                "triton_paged_ms": median_ms(
                    partial(va.verify_attention, qp, kp, vp, lensp, block_table=table, out=out, config=config)
                ),
                "sdpa_ms": median_ms(sdpa_call(q, k, v)),
            }
            row["speedup_vs_sdpa"] = row["sdpa_ms"] / row["triton_contiguous_ms"]
            plan_rows.append(row)

    # ---- tile sweep: time over G·(1+D) across multiples of the tile
    sweep, steps = [], []
    for model in models:
        H, H_kv, hd = models[model]
        G = H // H_kv
        B = 1 if args.cpu_smoke else args.sweep_batch
        max_rows = 2 * TILE_ROWS if args.quick or args.cpu_smoke else 3 * TILE_ROWS
        fixed = {"BLOCK_M": TILE_ROWS, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
        points = {}
        for D in sweep_draft_lens(G, max_rows, args.quick or args.cpu_smoke):
            T = 1 + D
            q, k, v, lens, _ = inputs(model, B, T)
            out = torch.empty_like(q)
            config = va.tile_rule(va.key_for(G, T, hd, ctx + T))
            point = {
                "model": model,
                "batch": B,
                "ctx": ctx,
                "draft_len": D,
                "rows": G * T,
                "config": config,
                "triton_ms": median_ms(
                    partial(va.verify_attention, q, k, v, lens, out=out, config=config, num_splits=1)
                ),
                "triton_tile128_ms": median_ms(
                    partial(va.verify_attention, q, k, v, lens, out=out, config=fixed, num_splits=1)
                ),
                "sdpa_ms": median_ms(sdpa_call(q, k, v)),
            }
            sweep.append(point)
            points[G * T] = point
        for edge in range(TILE_ROWS, max_rows + 1, TILE_ROWS):
            at = max((r for r in points if r <= edge), default=None)
            past = min((r for r in points if r > edge), default=None)
            if at is None or past is None:
                continue
            steps.append(
                {
                    "model": model,
                    "tile_rows": TILE_ROWS,
                    "edge_rows": edge,
                    "rows_at": at,
                    "rows_past": past,
                    "ratio_tile128": points[past]["triton_tile128_ms"] / points[at]["triton_tile128_ms"],
                    "ratio_shipped": points[past]["triton_ms"] / points[at]["triton_ms"],
                    "ratio_sdpa": points[past]["sdpa_ms"] / points[at]["sdpa_ms"],
                }
            )

    result = {
        "source": "measured" if cuda else "cpu-smoke (interpreter: times are not GPU times)",
        "dtype": "bfloat16",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "check": check,
        "plan": plan_rows,
        "tile_sweep": sweep,
        "tile_steps": steps,
        "aot": aot_check,
        "settings": {
            "ctx": ctx,
            "buckets": [list(b) for b in buckets],
            "quick": args.quick,
            "plan_file": str(args.plan.name) if args.plan else None,
        },
    }
    if cuda:
        props = torch.cuda.get_device_properties(device)
        result["device"] = {
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count,
        }
    return result


def aot_round_trip(models: dict, ctx: int, device) -> dict:
    """Cubins compiled ahead of time for this GPU's arch, loaded from their manifest and launched through `Launcher`:
    the same results as the reference, and no silent JIT fallback."""
    import tempfile

    import torch

    from specdec_tune.kernels import acceptance, aot
    from specdec_tune.kernels import verify_attention as va
    from specdec_tune.kernels.tuning import ModelShapes
    from specdec_tune.profiles.specdec import verify_greedy

    model = next(iter(models))
    H, H_kv, hd = models[model]
    B, D, V = 2, 3, 32000
    plan = {"ctx": ctx, "tile": {"rows": 128}, "buckets": [{"batch": B, "draft_len": D}], "max_draft_len": D}
    with tempfile.TemporaryDirectory() as tmp:
        manifest = aot.build_bundle_kernels(
            plan, Path(tmp), archs=(aot.current_arch(),), shapes=ModelShapes(H, H_kv, hd, V)
        )
        launcher = aot.Launcher(Path(tmp), manifest)
        q, k, v, lens, table = va.make_inputs(
            B, H, H_kv, hd, 1 + D, ctx + 1 + D, dtype=torch.bfloat16, device=device, page_size=manifest["page_size"]
        )
        config = next(b["config"] for b in manifest["binaries"] if b["kernel"] == "verify_attention")
        errors = {}
        for splits in (1, 4):
            got = va.verify_attention(
                q, k, v, lens, block_table=table, config=config, num_splits=splits, launcher=launcher
            )
            errors[f"paged_splits_{splits}"] = float(
                (got.float() - va.verify_attention_ref(q, k, v, lens, table, out_dtype=torch.float32)).abs().max()
            )
        logits = torch.randn((B, 1 + D, V), device=device)
        drafts = logits[:, :D].argmax(-1)
        lens_d = torch.tensor([D, 1], device=device)
        greedy_ok = all(
            torch.equal(a, b)
            for a, b in zip(
                acceptance.greedy_accept(logits, drafts, lens_d, launcher=launcher),
                verify_greedy(logits, drafts, lens_d),
            )
        )
        return {
            "arch": aot.current_arch(),
            "cubins": len({b["path"] for b in manifest["binaries"]}),
            "launched": launcher.launched,
            "fallbacks": launcher.fallbacks,
            "max_abs_err": errors,
            "greedy_equal": greedy_ok,
            "passed": greedy_ok
            and max(errors.values()) < 3e-2
            and not launcher.fallbacks
            and {"verify_attention_kernel", "verify_attention_combine_kernel", "greedy_accept_kernel"}
            <= set(launcher.launched),
        }


def table(result: dict) -> str:
    lines = [f"{'model':<14}{'B':>4}{'D':>4}{'rows':>6}{'triton ms':>11}{'paged ms':>10}{'sdpa ms':>9}{'x sdpa':>8}"]
    for r in result["plan"]:
        lines.append(
            f"{r['model']:<14}{r['batch']:>4}{r['draft_len']:>4}{r['rows']:>6}{r['triton_contiguous_ms']:>11.4f}"
            f"{r['triton_paged_ms']:>10.4f}{r['sdpa_ms']:>9.4f}{r['speedup_vs_sdpa']:>8.2f}"
        )
    lines.append("tile steps (time just past a multiple of 128 rows / time at it):")
    for s in result["tile_steps"]:
        lines.append(
            f"  {s['model']:<14} {s['rows_at']:>4} -> {s['rows_past']:<4} rows: "
            f"128-row tile x{s['ratio_tile128']:.2f}, "
            f"shipped config x{s['ratio_shipped']:.2f}, sdpa x{s['ratio_sdpa']:.2f}"
        )
    return "\n".join(lines)


def _buckets(text: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in pair.split(":")) for pair in text.split(",")]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "verify_attention_gpu.json")
    ap.add_argument("--plan", type=Path, default=None, help="take the batch buckets, D and ctx from this plan.json")
    ap.add_argument("--buckets", type=_buckets, default=DEFAULT_BUCKETS, help="batch:D pairs, e.g. 1:3,4:1,16:0")
    ap.add_argument("--ctx", type=int, default=4096, help="cached tokens per sequence before the new ones")
    ap.add_argument("--sweep-batch", type=int, default=8, help="batch of the tile sweep")
    ap.add_argument("--quick", action="store_true", help="fewer sweep points, rows up to 256")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="without CUDA: tiny shapes under the Triton interpreter (times are meaningless)",
    )
    args = ap.parse_args(argv)
    if args.plan:
        plan = json.loads(args.plan.read_text())
        args.buckets = [(int(b["batch"]), int(b["draft_len"])) for b in plan["buckets"]]
        args.ctx = int(plan["ctx"])
    import torch

    if not torch.cuda.is_available() and not args.cpu_smoke:
        print(
            "skipped: no CUDA device here; this benchmark times GPU kernels (run it on a GPU machine, or pass "
            "--cpu-smoke to check the script under the Triton interpreter)",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    result = run_and_write(run, args)
    if result is None:
        return 1
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
