"""locks-hf: Locks sparse decoding (page-local compact key summaries) for Hugging Face Transformers.

Importing this package registers ``attn_implementation="locks"`` with transformers: at once when
transformers is already imported, else the moment it is. The public names load on first use. Both
keep ``import locks_hf`` free of torch and transformers until they are needed, so that tools in the
package (``python -m locks_hf.eval.cli --help``) answer without seconds of imports.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

#: Public name -> the submodule defining it (imported on first access, PEP 562).
_PUBLIC = {
    "LocksCache": "cache",
    "LocksLayer": "cache",
    "LocksConfig": "config",
    "LocksConfigError": "config",
    "LocksStaticCache": "static_cache",
    "UnsupportedModelError": "models_support",
    "locks_attention_forward": "attention",
    "summary_bytes": "summaries",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))


def _register() -> None:
    from .attention import register

    register()


def _locks_attention(*args, **kwargs):
    """Stand-in registered when transformers is imported before ``locks_hf.attention`` can be (its
    import needs modules that may be importing transformers right then): the first call registers
    the real functions, which every later call reaches directly."""
    _register()
    from .attention import locks_attention_forward

    return locks_attention_forward(*args, **kwargs)


def _locks_mask(*args, **kwargs):
    """The mask function's stand-in (see `_locks_attention`)."""
    _register()
    from .attention import locks_mask

    return locks_mask(*args, **kwargs)


def _register_stand_ins() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("locks", _locks_attention)
    AttentionMaskInterface.register("locks", _locks_mask)


class _LoaderThenRegister(importlib.abc.Loader):
    """transformers' own loader, then `register` once its module has run (everything else delegated)."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_stand_ins()

    def __getattr__(self, name):  # get_resource_reader, get_source, ...: the real loader's
        return getattr(self._loader, name)


class _RegisterWhenTransformersLoads(importlib.abc.MetaPathFinder):
    """An import hook, active until transformers is imported: finds transformers with the other
    finders and wraps its loader so that ``attn_implementation="locks"`` is registered right after."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "transformers":
            return None
        sys.meta_path.remove(self)  # once; the finders below do the finding
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _LoaderThenRegister(spec.loader)
        return spec


if "transformers" in sys.modules:
    _register()
elif not any(isinstance(f, _RegisterWhenTransformersLoads) for f in sys.meta_path):
    sys.meta_path.insert(0, _RegisterWhenTransformersLoads())
