"""`DecodeBackend`: where a Locks layer's per-step work runs, as a small abstract interface.

One instance per kind of backend (they keep no state); a layer holds the one chosen for it
(`locks_hf.backends.choice.choose_backend`) as ``layer.backend`` and every decode step calls it. A
backend reads and writes the layer only through `PagedLayer`'s public accessors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from ..config import LocksConfig
    from ..paged import PagedLayer


class DecodeBackend(ABC):
    """The per-layer decode operations: the sparse step, the static layer's per-step page summary, the
    summary build and a static quantized layer's per-step K/V write."""

    #: Short name for logs and reports.
    name: ClassVar[str]
    #: The step runs the dense ``"full"`` decode itself (flash-decoding over the written pages); without
    #: it a static layer's ``"full"`` decode attends with SDPA.
    decodes_densely: ClassVar[bool] = False
    #: The launches count a static layer's per-row statistics (`PagedLayer.step_tensors`); otherwise
    #: the layer counts them before the step.
    counts_row_statistics: ClassVar[bool] = False
    #: The step runs without a host synchronisation (a captured CUDA graph may hold it).
    graph_safe: ClassVar[bool] = False

    @abstractmethod
    def decode(self, layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        """One decode step: ``query [b, Hq, 1, d]`` -> output ``[b, 1, Hq, d]``, with the layer's
        bookkeeping (selection, statistics, traffic) recorded."""

    @abstractmethod
    def update_newest_page(self, layer: PagedLayer) -> None:
        """A static layer's per-step summary: the page the newest token completed, written in place with
        no host-side branch on whether one did."""

    def summarizes_in_step(self, layer: PagedLayer) -> bool:
        """Whether `decode` writes ``layer``'s per-step page summary itself (what `update_newest_page`
        writes, beside the step's own work), so that the layer's `prepare` leaves it to the step."""
        return False

    def page_update_key(self, layer: PagedLayer) -> Hashable | None:
        """What lets ``layer``'s per-step page summary join other layers' in one launch
        (`update_pages_of_layers`): layers of equal keys may share it; ``None``, the default: its own."""
        return None

    def update_pages_of_layers(self, layers: list[PagedLayer]) -> None:
        """The per-step page summaries of ``layers`` (of one `page_update_key`) in one launch: what
        `update_newest_page` writes for each."""
        raise TypeError(f"the {self.name} backend updates each layer's pages in its own step")

    @abstractmethod
    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """The layer's selector's per-page tensors for ``keys [b, h, n, B, d]`` (``valid [b, h, n, B]``)."""

    def append_kv(self, layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A static quantized layer's decode-step write: what KIVI's schedule has due quantized, then the
        token ``keys`` / ``values [b, h, 1, d]`` into the full-precision ring (no host synchronisation)."""
        raise TypeError(f"the {self.name} backend stores no quantized KV in the static layout")

    def plan(self, config: LocksConfig) -> Any:
        """What this backend derives once from a layer's settings for its steps (kept as the layer's
        ``kernel_plan`` until they change, `PagedLayer.refresh_backend`); ``None``: nothing."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__}>"
