"""The end-of-run facts `profile` prints: tokens per forward per mechanism and domain, the verify knee, and the
measured speedup bound (or, for engine rounds, the measured speedup) per batch bucket."""

from __future__ import annotations

from specdec_tune.profiles import micro
from specdec_tune.profiles.schema import Profile


def summary(profile: Profile) -> dict:
    """The end-of-run facts: AL per mechanism x domain, the verify knee, the measured speedup bound per bucket."""
    D_max = profile.workload.max_draft_len
    ctx = profile.workload.ctx_buckets[0]
    verify = {(p.batch, p.tokens): p.median_ms for p in profile.verify if p.ctx == ctx}
    greedy = [a for a in profile.acceptance if a.temperature == 0.0 and a.quant == "none"]
    al = {
        (a.mechanism, a.domain): a.tokens_per_forward[-1] for a in greedy
    }  # at each drafter's longest D (a block caps it)
    al_ci = {(a.mechanism, a.domain): a.tokens_per_forward_ci[-1] for a in greedy if a.tokens_per_forward_ci}
    bounds = {}
    if profile.rounds:  # engine rounds: tokens per forward x T_round(B, 0) / T_round(B, D), draft and host included
        rounds: dict[tuple[str, int, int], float] = {
            (r.mechanism, r.batch, r.draft_len): r.median_ms for r in profile.rounds if r.ctx == ctx and r.median_ms
        }
        cost = {
            B: {(m, D): rounds[("none", B, 0)] / t for (m, b, D), t in rounds.items() if b == B and D}
            for B in profile.workload.batch_buckets
            if ("none", B, 0) in rounds
        }
    else:  # T_verif(B, 1) / T_verif(B, 1+D): draft and host cost left out, an upper bound
        measured = {cell: ms for cell, ms in verify.items() if ms is not None}
        cost = {
            B: {
                (a.mechanism, D): measured[(B, 1)] / measured[(B, D + 1)]
                for a in greedy
                for D in range(1, a.max_draft_len + 1)
                if measured.get((B, D + 1))
            }
            for B in profile.workload.batch_buckets
            if (B, 1) in measured
        }
    for B, ratios in cost.items():
        bounds[B] = max(
            [(1.0, 0, "-")]
            + [
                (a.tokens_per_forward[D] * ratios[(a.mechanism, D)], D, a.mechanism)
                for a in greedy
                if a.domain == "all"
                for D in range(1, a.max_draft_len + 1)
                if (a.mechanism, D) in ratios
            ]
        )
    gemm = (
        micro.linear_forward_curve(
            [p.model_dump() for p in profile.micro if p.kind == "linear"], profile.target["num_layers"]
        )
        if any(p.kind == "linear" for p in profile.micro)
        else []
    )
    gemm_ms = {p["m"]: p["median_ms"] for p in gemm}
    gemm_share = {
        B: gemm_ms[B] / verify[(B, 1)] for B in profile.workload.batch_buckets if B in gemm_ms and verify.get((B, 1))
    }
    knees = {
        B: micro.knee([{"t": t, "ms": verify[(B, t)]} for t in range(1, D_max + 2) if verify.get((B, t))], "t", "ms")
        for B in profile.workload.batch_buckets
        if not profile.rounds
    }
    return {
        "al": al,
        "al_ci": al_ci,
        "bounds": bounds,
        "knees": knees,
        "ctx": ctx,
        "gemm_share": gemm_share,
        "prompts": dict(profile.workload.prompts_by_domain),
        "engine_rounds": bool(profile.rounds),
    }
