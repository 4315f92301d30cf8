"""One per-batch draft-length schedule, written the three ways the engines take it.

A plan's schedule is (batch bucket, D) pairs; bucket b serves the batch sizes above the previous
bucket and up to b, and nothing is served above the last bucket (the engine's batch cap is set to it).

    vLLM          num_speculative_tokens_per_batch_size  [[lo, hi, K], ...]  ranges from 1, K ≤ num_speculative_tokens
    TensorRT-LLM  draft_len_schedule                      {hi: K, ...}        1.3rc: inclusive upper bounds; the first
                                                                              value is max_draft_len; above the last key
                                                                              K = 0
                                                          {lo: K, ...}        1.2: lower bounds ("batch >= key"), key 1
                                                                              holds max_draft_len; the last key's K
                                                                              carries upward
    SGLang        one server per concurrency band         [(lo, hi, K), ...]  no per-batch table in one server

Adjacent buckets with the same K merge. Each form converts back to the same per-batch-size K.
"""

from __future__ import annotations

from specdec_tune import SpecdecError

Schedule = list[tuple[int, int]]  # (batch bucket, D), buckets ascending


def check_schedule(schedule: Schedule) -> None:
    batches = [b for b, _ in schedule]
    if not schedule or batches[0] < 1 or any(b2 <= b1 for b1, b2 in zip(batches, batches[1:])):
        raise SpecdecError(
            f"schedule buckets {batches} are not ascending positive batch sizes", "re-run `specdec-tune search`"
        )
    if any(d < 0 for _, d in schedule):
        raise SpecdecError("a schedule has a negative draft length", "re-run `specdec-tune search`")


def bands(schedule: Schedule) -> list[tuple[int, int, int]]:
    """Inclusive batch-size ranges [lo, hi] with one K each, from 1 to the last bucket, equal neighbours merged."""
    check_schedule(schedule)
    out: list[tuple[int, int, int]] = []
    lo = 1
    for hi, k in schedule:
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], hi, k)
        else:
            out.append((lo, hi, k))
        lo = hi + 1
    return out


def to_vllm(schedule: Schedule) -> list[list[int]]:
    return [list(band) for band in bands(schedule)]


def to_trtllm(schedule: Schedule) -> dict[int, int]:
    """Upper bound -> K. TensorRT-LLM requires the smallest key's value to be the maximum (the plan's rule)."""
    table = {hi: k for _, hi, k in bands(schedule)}
    while len(table) > 1 and table[max(table)] == 0:  # above the last key K is already 0
        del table[max(table)]
    first = table[min(table)]
    if first != max(table.values()):
        raise SpecdecError(
            f"TensorRT-LLM needs the smallest batch to carry the largest draft length, got {table}",
            "re-run `specdec-tune search`, which keeps that rule",
        )
    return table


def to_trtllm_lower(schedule: Schedule) -> dict[int, int]:
    """TensorRT-LLM 1.2's form: lower bound -> K; key 1 carries max_draft_len (the plan's rule)."""
    table = {lo: k for lo, _, k in bands(schedule)}
    if table[1] != max(table.values()):
        raise SpecdecError(
            f"TensorRT-LLM needs batch 1 to carry the largest draft length, got {table}",
            "re-run `specdec-tune search`, which keeps that rule",
        )
    return table


def to_sglang(schedule: Schedule) -> list[tuple[int, int, int]]:
    return bands(schedule)


def k_at_lower(table: dict[int, int], batch: int) -> int:
    """The K TensorRT-LLM 1.2 uses at `batch`: the value of the largest key at or below it."""
    return table[max(k for k in table if k <= batch)]


def k_at(table: dict[int, int] | list, batch: int) -> int:
    """The K an engine uses at `batch`, from either the vLLM ranges or the TensorRT-LLM (1.3rc) thresholds."""
    if isinstance(table, dict):
        keys = [k for k in sorted(table) if k >= batch]
        return table[keys[0]] if keys else 0
    for lo, hi, k in table:
        if lo <= batch <= hi:
            return k
    return table[-1][2] if batch > table[-1][1] else 0  # vLLM: the last K extends to max_num_seqs


def from_vllm(ranges: list[list[int]]) -> Schedule:
    if not ranges or ranges[0][0] != 1 or any(r2[0] != r1[1] + 1 for r1, r2 in zip(ranges, ranges[1:])):
        raise SpecdecError(
            f"vLLM ranges {ranges} must start at 1 and be contiguous", "write ranges like [[1,4,3],[5,16,1]]"
        )
    return [(hi, k) for _, hi, k in ranges]


def from_trtllm(table: dict[int, int], max_batch: int) -> Schedule:
    keys = sorted(table)
    out = [(k, table[k]) for k in keys]
    if keys[-1] < max_batch:
        out.append((max_batch, 0))
    return out
