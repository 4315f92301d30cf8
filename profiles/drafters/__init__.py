"""Drafter mechanisms, one module each (`base.BUILT_IN`), registered as `create` and `available` first need them."""

from specdec_tune.profiles.drafters.base import Draft, Drafter, DraftRequest, available, create, register

__all__ = ["Draft", "DraftRequest", "Drafter", "available", "create", "register"]
