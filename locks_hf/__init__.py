"""locks-hf: Locks sparse decoding (page-local compact key summaries) for Hugging Face Transformers.

Importing this package registers ``attn_implementation="locks"`` with transformers.
"""

from .attention import locks_attention_forward, register
from .cache import LocksCache, LocksLayer
from .captured_step import captured_backend, decode_compile_config
from .concurrency import CacheInUseError
from .config import LocksConfig, LocksConfigError
from .models_support import UnsupportedModelError, check_model
from .projections import GemvLinear, gemv_projections, linear_projections
from .static_cache import LocksStaticCache
from .summaries import summary_bytes

register()

__all__ = [
    "CacheInUseError",
    "GemvLinear",
    "LocksCache",
    "LocksConfig",
    "LocksConfigError",
    "LocksLayer",
    "LocksStaticCache",
    "UnsupportedModelError",
    "captured_backend",
    "check_model",
    "decode_compile_config",
    "gemv_projections",
    "linear_projections",
    "locks_attention_forward",
    "summary_bytes",
]
__version__ = "0.1.0"
