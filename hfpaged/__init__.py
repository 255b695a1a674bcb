"""hfpaged: paged KV cache + continuous batching for Hugging Face transformers models, in place.

import hfpaged
hfpaged.patch(model)
results = model.generate_many(prompts, tokenizer=tok, max_new_tokens=64)
"""

from .core.config import EngineConfig
from .engine import Engine, ModelUnpatched
from .generate import generate_many
from .model.attention import UnsupportedModelError
from .outputs import GenerationResult, RequestOutput, SequenceOutput
from .patch import patch, reset_prefix_cache, sleep, stats, unpatch, wake
from .serve import Server
from .streaming import StreamEvent, astream_many, stream_many

__all__ = [
    "Engine",
    "EngineConfig",
    "GenerationResult",
    "ModelUnpatched",
    "RequestOutput",
    "SequenceOutput",
    "Server",
    "StreamEvent",
    "UnsupportedModelError",
    "astream_many",
    "generate_many",
    "patch",
    "reset_prefix_cache",
    "serve",
    "sleep",
    "stats",
    "stream_many",
    "unpatch",
    "wake",
]
__version__ = "0.1.0"
# ``hfpaged.serve`` is the server package, and calling it serves a model: hfpaged.serve(model, tokenizer)
