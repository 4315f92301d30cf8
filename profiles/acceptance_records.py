"""The profile's acceptance records, from per-prompt counters (both backends): one per domain and one for "all",
each figure per D with its 95% interval over prompts (profiles/intervals.py), and the per-prompt sums a paired
comparison between draft lengths resamples."""

from __future__ import annotations

import numpy as np

from specdec_tune.profiles import intervals
from specdec_tune.profiles.specdec import SpecCounters

BOOTSTRAP_RESAMPLES = 1000


def acceptance_records(
    name: str,
    fmt: str,
    temp: float,
    domains: list[str],
    at_max: list[SpecCounters],
    sums: dict[str, np.ndarray],
    method: str,
    checks: list[dict],
    *,
    max_draft_len: int,
    new_tokens: int,
    seed: int,
) -> list[dict]:
    """One acceptance record for every domain and one for "all" (domains weighted equally: `replay.figures`), from
    per-prompt counters at D_max (`at_max`) and the per-prompt sums at every D (`sums`)."""
    out = []
    for domain in ["all", *dict.fromkeys(domains)]:
        weights = dict.fromkeys(domains, 1.0) if domain == "all" else {domain: 1.0}
        figures = intervals.figures(sums, domains, weights, resamples=BOOTSTRAP_RESAMPLES, seed=seed)
        assert len(figures) == 4  # resampled: the figures and their intervals
        tpf, al, tpf_ci, al_ci = figures
        c = SpecCounters.total([x for x, d in zip(at_max, domains) if domain in ("all", d)])
        out.append(
            {
                "mechanism": name,
                "quant": fmt,
                "quant_source": "measured" if fmt == "none" else "emulated",
                "domain": domain,
                "temperature": temp,
                "max_draft_len": max_draft_len,
                "prompts": sum(domain in ("all", d) for d in domains),
                "new_tokens": new_tokens,
                "num_drafts": c.num_drafts,
                "num_draft_tokens": c.num_draft_tokens,
                "num_accepted_tokens": c.num_accepted_tokens,
                "num_accepted_tokens_per_pos": c.num_accepted_tokens_per_pos,
                "num_reached_per_pos": c.num_reached_per_pos,
                "num_rounds": c.num_rounds,
                "rounds": c.rounds,
                "conditional_acceptance": c.conditional_acceptance(),
                "tokens_per_forward": tpf.tolist(),
                "mean_al_vllm": al.tolist(),
                "tokens_per_forward_ci": _bounded_or_none(tpf_ci),
                "mean_al_vllm_ci": _bounded_or_none(al_ci),
                "method": method,
                "checks": checks if domain == "all" and fmt == "none" else [],
                **(
                    {
                        "per_prompt": {
                            "domains": list(domains),
                            **{
                                k: np.rint(sums[k]).astype(int).tolist()
                                for k in ("emitted", "rounds", "accepted", "drafts")
                            },
                        }
                    }
                    if domain == "all"
                    else {}
                ),
            }
        )
    return out


def _bounded_or_none(ci: np.ndarray) -> list:
    """An interval table as written: none ([]) where a domain of one prompt leaves it unbounded."""
    return ci.tolist() if np.isfinite(ci).all() else []
