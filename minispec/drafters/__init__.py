"""Drafters: who proposes the tokens the target verifies. base.py holds the interface; each other
file is one drafter."""

from .base import AutoregressiveDrafter, Drafter, NoDrafter, Proposal
from .draft_model import ModelDrafter
from .eagle import EagleDrafter
from .lookup import LookupFirstDrafter
from .ngram import NgramDrafter

__all__ = ["Drafter", "AutoregressiveDrafter", "NoDrafter", "Proposal", "ModelDrafter", "EagleDrafter",
           "LookupFirstDrafter", "NgramDrafter"]
