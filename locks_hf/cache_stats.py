"""`CacheStatistics`: what a Locks cache reports about its decode steps, summed over its Locks layers.

The counters are tensors on the layers' devices (reading them is the only sync); bytes follow the
traffic model of `locks_hf.traffic`.
"""

from __future__ import annotations

from .paged import PagedLayer


class CacheStatistics:
    """Statistics of a cache whose ``layers`` include Locks layers (`PagedLayer`)."""

    layers: list

    @property
    def locks_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    def reset_stats(self) -> None:
        for layer in self.locks_layers:
            layer.reset_stats()

    def attended_fraction(self) -> float:
        """Share of cached real tokens that decode steps attended, over all Locks layers (1.0 = dense)."""
        counts = [l.counts.tolist() for l in self.locks_layers if l.counts is not None]
        # per layer: with a model split over GPUs (device_map) the counters live on several devices
        context = sum(c for _, c in counts)
        return sum(a for a, _ in counts) / context if context else float("nan")

    def decode_traffic(self) -> dict[str, float] | None:
        """Per (layer, row, KV head) and decode step, averaged over the Locks layers since the last
        ``reset_stats``: ``attended_tokens`` (tokens whose K/V were read) and ``read_bytes`` (those
        K/V plus what choosing them read: page summaries, reduced keys, ...). ``None`` before any
        decode step."""
        head_steps = attended = read = 0
        for layer in self.locks_layers:
            if not layer.decode_steps or layer.counts is None:
                continue
            b, h = layer.kv_batch, layer.kv_heads
            tokens = int(layer.counts[0])
            head_steps += layer.decode_steps * b * h
            attended += tokens
            read += layer.attended_kv_bytes() + layer.estimate_bytes
        if not head_steps:
            return None
        return {"attended_tokens": attended / head_steps, "read_bytes": read / head_steps}
