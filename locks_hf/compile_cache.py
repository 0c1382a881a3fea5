"""Where compiled decode steps are kept between processes.

A static-layout cache makes ``generate()`` compile its decode step. Triton keeps its kernels in
``~/.triton/cache`` by default, but inductor keeps its FX graphs and generated code in
``/tmp/torchinductor_<user>``, which a reboot (or a container's fresh ``/tmp``) clears, so each of them
cost the cold compile again. The first static-layout cache of a process points inductor
at ``<locks_hf cache root>/inductor`` (``$LOCKS_HF_CACHE`` or ``~/.cache/locks_hf``) unless the user
named a folder with ``TORCHINDUCTOR_CACHE_DIR``, and logs where.

Recent torch releases write their default folder into ``TORCHINDUCTOR_CACHE_DIR`` when
``torch._dynamo`` is imported (transformers imports it), so the variable being set does not mean
the user set it: a value equal to torch's own default counts as unset.
"""

from __future__ import annotations

import logging
import os

from .user_cache import cache_root

logger = logging.getLogger(__name__)

#: inductor's own variable: a folder the user named wins over the library's default.
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def keep_compiled_steps() -> str:
    """Make inductor's cache folder persistent for this process (idempotent); returns the folder used.

    Leaves a folder the user named as it is; torch's own default (which importing ``torch._dynamo``
    writes into the variable) is replaced. Inductor reads the variable when it compiles, so setting it
    before the first compiled step is enough."""
    named = os.environ.get(INDUCTOR_CACHE_ENV)
    if named and not _is_torch_default(named):
        return named
    folder = cache_root() / "inductor"  # beside the converted models
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: keep torch's default rather than fail the cache
        logger.warning("LocksCache: cannot create %s (%s); inductor keeps its default cache folder", folder, e)
        return ""
    os.environ[INDUCTOR_CACHE_ENV] = str(folder)
    logger.info("LocksCache: compiled decode steps are cached in %s (set %s to change)", folder, INDUCTOR_CACHE_ENV)
    return str(folder)


def _is_torch_default(folder: str) -> bool:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(folder) == os.path.abspath(default_cache_dir())
