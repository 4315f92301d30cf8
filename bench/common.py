"""What the benchmark scripts share: counting model forwards, repository-relative paths, writing a result."""

from __future__ import annotations

import collections
import contextlib
import sys
import time
from pathlib import Path

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.dflash import DFlashHead
from specdec_tune.profiles.drafters.eagle3 import Eagle3Head
from specdec_tune.profiles.drafters.heads import DraftHead
from specdec_tune.profiles.drafters.mtp import MtpHead
from specdec_tune.profiles.models.generic import GenericCausalLM
from specdec_tune.profiles.models.llama import CausalLM
from specdec_tune.records import write_json

ROOT = Path(__file__).resolve().parent.parent

# What one counted forward is, per kind (written into the results that count them).
FORWARDS_COUNTED = {
    "target": "one pass of the full-depth target (forward or forward_capture, built-in or generic path): a verify step, a prefill, a timed profile step",
    "draft_model": "one pass of a shallower model (the draft model): its catch-up over the new tokens, or one draft step",
    "eagle3, mtp": "one DraftHead.step: a serial head's catch-up over the new target states, or one draft step",
    "dflash, dspark": "one DFlashHead.block_hidden: the block pass (the catch-up's key/value projections are not counted)",
}


def _head_kind(head: DraftHead) -> str:
    """The mechanism a head belongs to, as the drafter registry names it."""
    if isinstance(head, DFlashHead):
        return "dspark" if head.markov_head is not None else "dflash"
    if isinstance(head, Eagle3Head):
        return "eagle3"
    return "mtp" if isinstance(head, MtpHead) else type(head).__name__


class ForwardCounter:
    """Model forwards run while `active()` is open: model passes by depth, learned-head passes by mechanism.

    Every model pass goes through its forward's `_run` (forward and forward_capture alike, CausalLM and GenericCausalLM),
    a serial head's through `DraftHead.step`, a block head's through `DFlashHead.block_hidden`: those are patched while
    counting.
    """

    def __init__(self) -> None:
        self.by_depth: collections.Counter = collections.Counter()  # CausalLM layers -> passes
        self.heads: collections.Counter = collections.Counter()  # mechanism -> head passes

    @contextlib.contextmanager
    def active(self):
        runs = {cls: cls._run for cls in (CausalLM, GenericCausalLM)}
        step, block = DraftHead.step, DFlashHead.block_hidden
        by_depth, heads = self.by_depth, self.heads

        def counting(run):
            def counted_run(model, *a, **k):
                by_depth[len(model.layers)] += 1
                return run(model, *a, **k)

            return counted_run

        def counted_step(head, *a, **k):
            heads[_head_kind(head)] += 1
            return step(head, *a, **k)

        def counted_block(head, *a, **k):
            heads[_head_kind(head)] += 1
            return block(head, *a, **k)

        for cls, run in runs.items():
            cls._run = counting(run)
        DraftHead.step, DFlashHead.block_hidden = counted_step, counted_block
        try:
            yield self
        finally:
            for cls, run in runs.items():
                cls._run = run
            DraftHead.step, DFlashHead.block_hidden = step, block

    def paused(self, fn):
        """fn wrapped so that the forwards it runs (a speed probe's) are not counted."""

        def run(*args, **kwargs):
            by_depth, heads = self.by_depth.copy(), self.heads.copy()
            try:
                return fn(*args, **kwargs)
            finally:
                self.by_depth.clear(), self.by_depth.update(by_depth)
                self.heads.clear(), self.heads.update(heads)

        return run

    def summary(self, target_layers: int) -> dict:
        """{"target_forwards": n, "drafter_forwards": {"draft_model": n, "eagle3": n, ...}}: a model of the target's
        depth is the target, a shallower (or deeper) one the draft model; kinds that never ran are left out."""
        drafters = {"draft_model": sum(n for depth, n in self.by_depth.items() if depth != target_layers)} | dict(self.heads)
        return {"target_forwards": self.by_depth[target_layers], "drafter_forwards": {k: n for k, n in sorted(drafters.items()) if n}}


def counted(fn):
    """Run fn() while counting forwards; returns (result, ForwardCounter, seconds)."""
    counter = ForwardCounter()
    t0 = time.perf_counter()
    with counter.active():
        result = fn()
    return result, counter, time.perf_counter() - t0


def shown(path) -> str | None:
    """A path as a result file records it: relative to the repository when inside it, else its name."""
    if path is None:
        return None
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else p.name


def run_and_write(run, args) -> dict | None:
    """run(args), written atomically to args.out; a handled error is one line on stderr and None."""
    try:
        result = run(args)
    except SpecdecError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    write_json(args.out, result)
    return result


def write_table(args, text: str) -> None:
    """The result's short table, beside its JSON (same name, .md) and on stdout."""
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
