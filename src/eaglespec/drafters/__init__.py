"""Drafters: everything that proposes a draft tree, behind one small interface (`Drafter`).

- base.py: `Drafter`, `TreeSettings`, `VanillaDrafter` (plain decoding through the same loop)
- eagle.py: `EagleDrafter`, an EAGLE head growing EAGLE-2 / EAGLE-1 trees or chains
- lookup.py: prompt lookup (n-grams of the context); draft_model.py: a smaller model of the same tokenizer
- staged.py: that draft model's own steps speculated by a second stage (staged speculative decoding)
- autotree.py: the tree choice of `--tree auto` / `calibrate` (per-CPU-class defaults, cached calibration)
"""

from .base import (DRAFT_MODEL_METHODS, HEAD_METHODS, METHODS, Drafter, DraftWork, TreeSettings, VanillaDrafter,
                   tree_chosen_by_run)
from .eagle import EagleDrafter, TreeGrowth

__all__ = ["DRAFT_MODEL_METHODS", "HEAD_METHODS", "METHODS", "Drafter", "DraftWork", "EagleDrafter", "TreeGrowth",
           "TreeSettings", "VanillaDrafter", "tree_chosen_by_run"]
