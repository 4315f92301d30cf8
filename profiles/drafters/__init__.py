"""Drafter mechanisms. Importing this package registers every built-in one."""

from specdec_tune.profiles.drafters import dflash, draft_model, eagle3, mtp, ngram, suffix  # noqa: F401
from specdec_tune.profiles.drafters.base import Draft, DraftRequest, Drafter, available, create, register

__all__ = ["Draft", "DraftRequest", "Drafter", "available", "create", "register"]
