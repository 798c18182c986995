"""Model utilities that need no running engine: synthesis of small random-weight checkpoints."""

from .synth import MODEL_SPECS, synthesize

__all__ = ["MODEL_SPECS", "synthesize"]
