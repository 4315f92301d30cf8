"""The drafter interface and registry.

A drafter proposes up to D tokens per sequence each round; the target verifies them
(`specdec_tune.profiles.specdec`). One module per mechanism registers itself here with
`@register("name")`; nothing outside the module names its class.

Lifecycle for one batch of sequences (rows):
  start(prompts)      once, with each row's prompt token ids
  propose(request)    every round, with each live row's full token ids so far
  keep_rows(indices)  when rows finish: keep only these rows, in this order

Token lists only grow between rounds (accepted drafts and the bonus token are appended; a rejected
draft never enters them), so a stateful drafter may diff the new lists against what it has seen.

A drafter that reads the target's hidden states (EAGLE-3, MTP) names the layers in `hidden_layers`; each
request then carries the states of the positions the target ran since the previous request (after prefill:
the prompt but its last token; after a round with n drafts accepted: the n+1 verified positions).
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from specdec_tune import SpecdecError

if TYPE_CHECKING:
    import torch
    from _typeshed import DataclassInstance

    from specdec_tune.profiles.models.loading import LoadedModel

DraftKind = Literal["model_free", "serial", "parallel"]


@dataclasses.dataclass(frozen=True)
class DraftRequest:
    """One round's question to the drafter, for the rows still generating."""

    token_ids: list[list[int]]  # per row: prompt + generated tokens, the last one not yet in the target's KV cache
    max_tokens: list[int]  # per row: at most this many draft tokens (≤ D; smaller near max_new_tokens)
    temperature: float  # 0 = greedy drafting
    generator: torch.Generator | None = None  # for sampled drafts; None when temperature == 0
    # For drafters that declare `hidden_layers`: the target's hidden states at those layers (concatenated in that
    # order) for the positions the target has run since the previous request, left-aligned and padded:
    # [B, T_max, len(hidden_layers) * hidden]. Row b's first num_hidden[b] entries belong to token positions
    # len(token_ids[b]) - 1 - num_hidden[b] .. len(token_ids[b]) - 2 (every token but the last is in the target's
    # KV cache). None (and num_hidden None) for drafters that declare no layers.
    hidden_states: torch.Tensor | None = None
    num_hidden: list[int] | None = None


@dataclasses.dataclass(frozen=True)
class Draft:
    """The drafter's answer: tokens per row (possibly fewer than asked, possibly none)."""

    tokens: list[list[int]]
    # probs[b, i, :] is the distribution token i of row b was drawn from: [B, max_len, V] float32.
    # None means the proposals are deterministic (model-free, or greedy drafting): q is one-hot.
    probs: torch.Tensor | None = None


class Drafter(ABC):
    """Proposes draft tokens for a batch of sequences. Subclasses register with `@register`."""

    name: ClassVar[str]
    kind: ClassVar[DraftKind]  # how it costs: lookups, D serial model steps, or one parallel pass
    # Target layers whose hidden states this drafter reads (see CausalLM.forward_capture for the ids):
    # the loop then fills DraftRequest.hidden_states. Empty: the drafter reads tokens only.
    hidden_layers: tuple[int, ...] = ()
    draft_len_multiple: int = 1  # D must be a multiple of this (a multi-layer MTP checkpoint: its layer count)
    max_draft_len: int | None = None  # the longest draft it can make (a block drafter: its block); None = any
    # How greedy acceptance is replayed from the target's trajectory (profiles/replay.py PROPOSERS): "prefix" for a
    # drafter whose proposals depend only on the tokens so far, "teacher_forced" for a greedy draft model (its `model`);
    # None: only the speculative loop measures it.
    replay: ClassVar[str | None] = None

    if TYPE_CHECKING:  # what `create` relies on of a registered drafter (declared for the type checker only)
        Options: ClassVar[type[DataclassInstance]]  # its options, every field with a default (`parse_options`)

        def __init__(self, target: LoadedModel | None, options: Any) -> None: ...

    @abstractmethod
    def start(self, prompts: list[list[int]]) -> None:
        """Begin a new batch; row b's prompt is prompts[b]."""

    @abstractmethod
    def propose(self, request: DraftRequest) -> Draft:
        """Propose up to request.max_tokens[b] tokens continuing request.token_ids[b]."""

    def keep_rows(self, indices: list[int]) -> None:  # noqa: B027  (a hook, not abstract: no per-row state, no-op)
        """Drop finished rows; the kept rows are renumbered 0..len(indices)-1."""

    def with_quantized_weights(self, fmt: str) -> Drafter:
        """A copy whose weights are fake-quantized to `fmt` (profiles.drafters.quant); the original is untouched."""
        raise SpecdecError(f"the {self.name} drafter has no weights to quantize", "quantize only model-based drafters")

    def describe(self) -> dict[str, Any]:
        """Settings that identify this drafter in a profile (name, kind, options)."""
        own: DataclassInstance | None = getattr(self, "options", None)  # its Options, where it keeps them
        options = dataclasses.asdict(own) if dataclasses.is_dataclass(own) else {}
        return {"name": self.name, "kind": self.kind, "options": options}


_REGISTRY: dict[str, type[Drafter]] = {}
BUILT_IN = (
    "dflash",
    "draft_model",
    "eagle3",
    "mtp",
    "ngram",
    "suffix",
)  # modules of this package, each registering one


def registry() -> dict[str, type[Drafter]]:
    """Every drafter class by name: the built-in ones are imported (and so registered) on first use, so that a module
    that needs one drafter's files (a head's layout) does not load every drafter's code."""
    for module in BUILT_IN:
        importlib.import_module(f"specdec_tune.profiles.drafters.{module}")
    return _REGISTRY


def register(name: str):
    """Class decorator: make a drafter available under `name`."""

    def wrap(cls: type[Drafter]) -> type[Drafter]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    return sorted(registry())


def parse_options(cls: type[DataclassInstance], raw: dict[str, str]) -> DataclassInstance:
    """Build the drafter's `Options` dataclass from string key=value pairs, strictly."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, object] = {}
    for key, text in raw.items():
        if key not in fields:
            raise SpecdecError(
                f"unknown drafter option {key!r}",
                f"known options: {', '.join(sorted(fields)) or 'none'}",
            )
        default: Any = fields[key].default  # every option has one (a bool, int, float or str)
        try:
            values[key] = type(default)(text) if not isinstance(default, bool) else text.lower() in ("1", "true", "yes")
        except ValueError:
            raise SpecdecError(
                f"drafter option {key}={text!r} is not a {type(default).__name__}", "give a number"
            ) from None
    return cls(**values)


def describe_spec(name: str, options: dict[str, str] | None = None) -> dict[str, Any]:
    """What `Drafter.describe` gives, plus the class's draft-length limit, without building the drafter: for an engine
    that runs the mechanism itself. Options are checked as `create` checks them."""
    if name not in registry():
        raise SpecdecError(f"unknown drafter mechanism {name!r}", f"choose one of: {', '.join(available())}")
    cls = _REGISTRY[name]
    parsed = parse_options(cls.Options, options or {})
    limit = (
        cls.max_draft_len if isinstance(cls.max_draft_len, int) else None
    )  # a block drafter's comes from its checkpoint
    return {"name": name, "kind": cls.kind, "options": dataclasses.asdict(parsed), "max_draft_len": limit}


def create(name: str, target: LoadedModel, options: dict[str, str] | None = None) -> Drafter:
    """Instantiate the drafter registered as `name` for `target`."""
    if name not in registry():
        raise SpecdecError(f"unknown drafter mechanism {name!r}", f"choose one of: {', '.join(available())}")
    cls = _REGISTRY[name]
    return cls(target, parse_options(cls.Options, options or {}))
