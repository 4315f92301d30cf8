"""Drafter mechanisms. Importing this package registers every built-in one."""

from specdec_tune.profiles.drafters import dflash, draft_model, eagle3, mtp, ngram, suffix  # noqa: F401
from specdec_tune.profiles.drafters.base import Draft, DraftRequest, Drafter, available, create, register
import specdec_tune.profiles.train_drafter  # noqa: E402,F401  (registers where head drafters find their heads)

__all__ = ["Draft", "DraftRequest", "Drafter", "available", "create", "register"]
