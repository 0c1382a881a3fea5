"""Arms decoded by transformers' own `QuantizedCache`: the ecosystem's quantized KV beside Locks' KIVI arms.

An arm ``hf-<backend><bits>[g<group>][r<residual>]`` (``hf-quanto4``, ``hf-quanto2``, ``hf-hqq4g64``)
decodes with full attention over K/V that ``transformers.QuantizedCache`` stores quantized with that
backend (optimum-quanto or HQQ, installed by the user) at ``bits`` bits, in groups of ``group`` (default
32, KIVI's and the ``+kv`` arms' default) with the newest ``residual`` tokens in full precision (default
128, transformers' and the ``+kv`` arms'). transformers quantizes keys and values alike, along the
axis its backend is configured for (``axis_key`` / ``axis_value`` 0, its default): that is what a user
of its cache gets, so it is what the arm runs.

Such an arm prefills the record's prompt into its own cache: transformers' quantized layer attends
the prompt in full precision and quantizes it at the end of the forward, which is what a fork of the
runner's dense prefill would give; the first answer token is still the shared one. It cannot run on
the static engine, and it reports no attended fraction or traffic (transformers does not count them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from locks_hf.compat import cache_keyword

__all__ = ["HFQuantized", "parse_hf_quantized"]

_LABEL = re.compile(r"hf-(?P<backend>quanto|hqq)(?P<bits>\d+)(?:g(?P<group>\d+))?(?:r(?P<residual>\d+))?")
#: Bits each backend of transformers' cache accepts (its own checks, said before a model loads).
_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
_PACKAGE = {"quanto": "optimum-quanto", "hqq": "hqq"}


@dataclass(frozen=True)
class HFQuantized:
    """Settings of one transformers `QuantizedCache` arm."""

    backend: str
    bits: int
    group: int = 32
    residual: int = 128

    @property
    def label(self) -> str:
        return (
            f"hf-{self.backend}{self.bits}"
            + (f"g{self.group}" if self.group != 32 else "")
            + (f"r{self.residual}" if self.residual != 128 else "")
        )

    def check_model(self, model_config) -> None:
        """Refuse a model transformers' QuantizedCache cannot hold (it takes full-attention layers only),
        before anything runs."""
        kinds = set(getattr(model_config.get_text_config(), "layer_types", None) or ["full_attention"])
        if kinds - {"full_attention"}:
            raise ValueError(
                f"arm {self.label!r}: transformers' QuantizedCache holds only models whose layers are all full "
                f"attention; {model_config.model_type} has {sorted(kinds - {'full_attention'})} layers: run it on "
                "a model such as smollm2-135m, or compare with the +kv arms alone"
            )

    def new_cache(self, model_config):
        """An empty `transformers.QuantizedCache` with these settings (raises if its backend is missing)."""
        from transformers import QuantizedCache

        try:
            return QuantizedCache(
                backend=self.backend,
                config=model_config,
                nbits=self.bits,
                q_group_size=self.group,
                residual_length=self.residual,
            )
        except ImportError as err:
            raise ImportError(
                f"arm {self.label!r} needs transformers' {self.backend} backend: pip install {_PACKAGE[self.backend]}"
            ) from err

    @torch.no_grad()
    def prefilled(self, model, prompt_ids: torch.Tensor):
        """A new cache holding ``prompt_ids [1, n]`` (one dense forward, quantized at its end)."""
        cache = self.new_cache(model.config)
        model(prompt_ids, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1)
        return cache


def parse_hf_quantized(family: str) -> HFQuantized | None:
    """The settings of an ``hf-...`` arm family; ``None`` for any other family. A malformed ``hf-`` label
    raises `ValueError` saying what is accepted."""
    if not family.startswith("hf-"):
        return None
    m = _LABEL.fullmatch(family)
    if m is None:
        raise ValueError(
            f"arm {family!r}: transformers' QuantizedCache arms are hf-<quanto|hqq><bits>[g<group>][r<residual>], "
            "e.g. hf-quanto4, hf-quanto2g64, hf-hqq4r256"
        )
    backend, bits = m["backend"], int(m["bits"])
    if bits not in _BITS[backend]:
        raise ValueError(f"arm {family!r}: transformers' {backend} cache takes bits {_BITS[backend]}, not {bits}")
    group = int(m["group"]) if m["group"] else 32
    residual = int(m["residual"]) if m["residual"] else 128
    if group < 1 or residual < 1:
        raise ValueError(f"arm {family!r}: group and residual must be positive")
    return HFQuantized(backend, bits, group, residual)
