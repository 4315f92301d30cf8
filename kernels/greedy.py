"""The greedy acceptance rule: what the speculative loop (profiles/specdec.py) applies and what the acceptance kernels
(kernels/acceptance.py) are checked against, written once in torch."""

from __future__ import annotations

import torch


def verify_greedy(
    logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance.

    logits: [B, 1+K, V]; drafts: [B, K] (padding past draft_lens is ignored); draft_lens: [B].
    Returns num_accepted [B] (0..draft_lens) and the next token [B] (argmax after the accepted prefix).
    """
    B, K = drafts.shape
    target = logits.argmax(-1)  # [B, 1+K]
    offered = torch.arange(K, device=drafts.device)[None, :] < draft_lens[:, None]  # [B, K]
    match = (drafts == target[:, :K]) & offered
    num_accepted = match.long().cumprod(dim=1).sum(dim=1)  # [B]
    next_token = target.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token
