"""Draft heads: EAGLE-1 and EAGLE-3, and their checkpoint format."""

from .base import DraftHead
from .checkpoint import (
           build_head,
           check_head_fits,
           load_head,
           read_draft_vocab,
           save_draft_vocab,
           save_head,
)
from .config import HeadConfig
from .eagle1 import Eagle1Head
from .eagle3 import Eagle3Head

__all__ = ["DraftHead", "Eagle1Head", "Eagle3Head", "HeadConfig", "build_head", "check_head_fits", "load_head",
           "read_draft_vocab", "save_draft_vocab", "save_head"]
