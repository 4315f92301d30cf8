"""What every head's checkpoint reader shares: the layer settings of a config, the check against the verifier (the
target the head will run on), the strict copy of the weights, and the draft-vocabulary map. The readers themselves live
with their heads (eagle3.py, mtp.py, dflash.py) and are found through `heads.HEAD_KINDS`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from specdec_tune import SpecdecError
from specdec_tune.profiles.drafters.heads import DraftHead
from specdec_tune.profiles.models.llama import CausalLM, ModelConfig

if TYPE_CHECKING:
    from specdec_tune.profiles.models.generic import GenericCausalLM

_Head = TypeVar("_Head", bound=DraftHead)


def layer_config(hf: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf({"model_type": "llama", **hf})
    except KeyError as e:
        raise SpecdecError(
            f"{where} lacks {e.args[0]}", "the head's transformer layer config must give the layer's shape"
        ) from None


def check_verifier(
    folder: Path,
    what: str,
    target: CausalLM | GenericCausalLM,
    *,
    hidden: int,
    vocab: int,
    layer_ids: tuple[int, ...] = (),
) -> None:
    t = target.config
    if hidden != t.hidden_size:
        raise SpecdecError(
            f"the {what} in {folder} reads target states of width {hidden}, but the target's hidden size is "
            f"{t.hidden_size}",
            "use a head trained for this target (its verifier)",
        )
    if vocab != t.vocab_size:
        raise SpecdecError(
            f"the {what} in {folder} has a {vocab}-token vocabulary, the target {t.vocab_size}",
            "use a head trained with the target's tokenizer",
        )
    bad = [i for i in layer_ids if not 0 <= i <= t.num_layers]
    if bad:
        raise SpecdecError(
            f"the {what} in {folder} reads target layers {list(layer_ids)}; {bad} do not exist in the "
            f"{t.num_layers}-layer target",
            "use a head trained for this target (eagle_aux_hidden_state_layer_ids)",
        )


def load_into(
    head: _Head, state: dict[str, torch.Tensor], folder: Path, shared: set[str], target: CausalLM | GenericCausalLM
) -> _Head:
    """Copy `state` into `head` strictly: every weight but the target's shared ones, with matching shapes."""
    expected = {k: v for k, v in head.state_dict().items() if k not in shared}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        name = missing[0] if missing else unexpected[0]
        raise SpecdecError(
            f"weights in {folder} {'lack' if missing else 'hold an unknown tensor'} {name}",
            "check the checkpoint matches its config.json",
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise SpecdecError(
                f"{k} in {folder} has shape {list(v.shape)}, the config implies {list(expected[k].shape)}",
                "check the checkpoint matches its config.json and the target",
            )
    head.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=False)
    return head.to(device=target.device, dtype=target.dtype)


def draft_map(
    state: dict, draft_vocab: int, layer: ModelConfig, target: CausalLM | GenericCausalLM, folder: Path, what: str
) -> dict:
    """`state` with t2d dropped and d2t checked (or zeros added for the full vocabulary in order)."""
    state = {k: v for k, v in state.items() if k != "t2d"}
    if "d2t" in state:
        d2t = state["d2t"].long()
        mapped = torch.arange(d2t.numel()) + d2t
        if d2t.numel() != draft_vocab or int(mapped.min()) < 0 or int(mapped.max()) >= target.config.vocab_size:
            raise SpecdecError(
                f"d2t in {folder} does not map {draft_vocab} draft ids into the target's {target.config.vocab_size}",
                "check draft_vocab_size and the d2t tensor",
            )
    elif draft_vocab != layer.vocab_size:
        raise SpecdecError(
            f"the {what} in {folder} has a {draft_vocab}-token draft vocabulary but no d2t map",
            "add d2t to the weights",
        )
    else:
        state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
    return state
