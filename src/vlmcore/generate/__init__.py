"""Native generation: a packed prefill and cached decoding on vlmcore's models (decode.py), the
caches (cache.py), token choice (sampling.py) and `vlmcore generate` (command.py)."""

from .decode import Generation, GenerationError, Prompt, generate
from .sampling import SamplingSettings, sampling_settings

__all__ = ["Generation", "GenerationError", "Prompt", "SamplingSettings", "generate", "sampling_settings"]
