"""eaglespec: lossless EAGLE speculative decoding for transformers causal language models."""

from .api import Engine, GenerationResult, generate
from .drafters import Drafter, EagleDrafter, TreeSettings, VanillaDrafter
from .errors import EagleSpecError
from .models import DEFAULT_MODEL, load_target
from .spec.decode import Finished, GenerationStats, SpecDecoder, Step
from .spec.tree import DraftTree
from .spec.verify import SamplingParams
from .targets.hf import TargetModel

__version__ = "0.1.0"

__all__ = ["DEFAULT_MODEL", "DraftTree", "Drafter", "EagleDrafter", "EagleSpecError", "Engine", "Finished",
           "GenerationResult", "GenerationStats", "SamplingParams", "SpecDecoder", "Step", "TargetModel",
           "TreeSettings", "VanillaDrafter", "generate", "load_target"]
