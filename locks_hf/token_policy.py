"""Token-level cache policies: eviction and per-token selection methods as a keep mask over slots.

`LocksCache` keeps every K/V. A KV-cache *eviction* method (SnapKV-style prompt compression, R-KV,
LazyEviction, ...) is reproduced exactly by a boolean keep mask ``[b, h, Gm, L]`` over the layer's
``L`` slots (``Gm = 1``: one set per KV head; ``Gm = G``: one per query head) that the policy
updates after prefill and at decode steps: a token whose mask bit is cleared is never attended
again, as if its K/V had been freed. Methods that pick tokens afresh at every step (RocketKV's
top-k stage, ShadowKV's chunk selection) return the step's attended set from `TokenPolicy.select`
without changing the mask.

A decode step (`policy_decode`, the reference PyTorch path on any device):

1. on the first decode step of a cache the policy builds its `PolicyState` from what prefill left
   (`TokenPolicy.start`: the prompt's keys, the last prompt queries kept by the layer);
2. the new slot enters the mask (kept) and `TokenPolicy.select` returns the slots to attend;
3. attention over exactly those slots (a gather of the kept tokens, softmax renormalised over them);
4. `TokenPolicy.observe` sees the step's attention probabilities and may evict.

Accounting: tokens attended per (row, KV head) are the union over the group's query heads of the
attended slots (what must be read from the cache); `TokenPolicy.select` also returns the bytes its
estimation read (e.g. RocketKV's reduced keys), added to the layer's traffic counter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from .selectors.base import SelectionMethod


class PolicyState:
    """One layer's policy state: per-slot tensors ``[b, h, Gm, L]`` (the keep mask among them) with
    the value new slots take, per-row tensors, and the decode steps taken."""

    def __init__(self, keep: torch.Tensor, prompt_len: int) -> None:
        self.slot: dict[str, torch.Tensor] = {"keep": keep}
        self.fill: dict[str, float | bool] = {"keep": True}
        self.tensors: dict[str, torch.Tensor] = {}  # any other state, batch-first
        self.info: dict[str, object] = {}  # plain values fixed at `start` (plans, sizes)
        self.prompt_len = prompt_len  # slots cached when decode began
        self.steps = 0  # decode steps finished

    @property
    def keep(self) -> torch.Tensor:
        return self.slot["keep"]

    @keep.setter
    def keep(self, mask: torch.Tensor) -> None:
        self.slot["keep"] = mask

    @property
    def length(self) -> int:
        return self.keep.shape[-1]

    def add_slot_tensor(self, name: str, tensor: torch.Tensor, fill: float) -> None:
        """Track ``tensor [b, h, Gm, L]``; slots appended later start at ``fill`` (or `set_fill`)."""
        self.slot[name], self.fill[name] = tensor, fill

    def set_fill(self, name: str, fill: float) -> None:
        self.fill[name] = fill

    def extend(self, length: int) -> None:
        """Append slots up to ``length`` (decode tokens: kept, per-slot tensors at their fill)."""
        extra = length - self.length
        if extra <= 0:
            return
        for name, t in self.slot.items():
            pad = t.new_full((*t.shape[:-1], extra), self.fill[name])
            self.slot[name] = torch.cat([t, pad], dim=-1)

    def truncate(self, length: int) -> None:
        self.slot = {n: t[..., :length] for n, t in self.slot.items()}

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PolicyState:
        """A new state with a batch-dim transform (beam reorder, row selection, clone) of every tensor."""
        new = copy.copy(self)
        new.slot = {n: fn(t) for n, t in self.slot.items()}
        new.fill = dict(self.fill)
        new.tensors = {n: fn(t) for n, t in self.tensors.items()}
        return new


class TokenPolicy(SelectionMethod):
    """Base class of the token-level policies: a `start`, and a `select` and/or an `observe`.

    Declared like page selectors (and registered in the same registry): a token policy never reads
    page summaries, has no kernel path (the reference PyTorch path runs on CPU and GPU alike) and is
    not usable by the static layout (its state is per slot and changes shape).
    """

    token_level = True
    static_cache = False
    report_order = 60  # after the page selectors; each baseline sets its place (the paper's column order)
    #: Keep one mask per query head (``Gm = G``) instead of one per KV head.
    per_query_head = False

    def start(self, layer, query: torch.Tensor, scale: float) -> PolicyState:
        """State at the first decode step (``query [b, h, G, d]`` is that step's): every real slot
        cached before it kept."""
        return PolicyState(self.full_mask(layer, query.shape[2]), layer.length - 1)

    def select(self, layer, state: PolicyState, query: torch.Tensor, scale: float) -> tuple[torch.Tensor, int]:
        """Slots this step attends, ``[b, h, 1 or G, L]``, and the bytes the choice read."""
        return state.keep, 0

    def observe(self, layer, state: PolicyState, query: torch.Tensor, probs: torch.Tensor) -> None:
        """After attention: ``probs [b, h, G, L]`` (zero off the attended slots); may evict."""

    # -- helpers for subclasses ---------------------------------------------------------------
    def full_mask(self, layer, group: int) -> torch.Tensor:
        """Every real slot written so far but the newest (the step's own token), ``[b, h, Gm, L-1]``."""
        b, h = layer.keys.shape[:2]
        gm = group if self.per_query_head else 1
        real = layer.slot_valid[:, : layer.length - 1]
        return real[:, None, None].expand(b, h, gm, -1).clone()


def kept_indices(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots set in ``mask [..., L]`` in increasing order, padded to the largest count:
    ``index [..., W]`` and ``ok [..., W]`` (False for padding)."""
    count = mask.sum(-1)
    width = int(count.max()) if mask.numel() else 0
    order = torch.sort(mask.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
    ok = torch.arange(width, device=mask.device) < count.unsqueeze(-1)
    return order, ok


def slots_mask(index: torch.Tensor, ok: torch.Tensor, length: int) -> torch.Tensor:
    """The mask ``[..., length]`` of the slots ``index [..., W]`` where ``ok``."""
    target = torch.where(ok, index, length)
    mask = torch.zeros((*index.shape[:-1], length + 1), dtype=torch.bool, device=index.device)
    return mask.scatter_(-1, target, True)[..., :length]


def gather_slots(buf: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``buf [b, h, L, d]`` at ``index [b, h, W]`` -> ``[b, h, W, d]``."""
    return buf.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1]))


def attend_slots(
    keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of ``query [b, h, G, d]`` over the slots of ``mask [b, h, 1 or G, L]`` of
    ``keys``/``values [b, h, >=L, d]``: only the union of the group's slots is gathered.

    Returns ``out [b, h, G, d]`` (fp32 accumulation, fp64 kept), ``probs [b, h, G, L]`` (zero off
    each head's slots) and the union ``[b, h, L]``.
    """
    b, h, G, d = query.shape
    L = mask.shape[-1]
    acc = torch.promote_types(query.dtype, torch.float32)
    union = mask.any(2)
    index, ok = kept_indices(union)  # [b, h, W]
    k = gather_slots(keys[:, :, :L], index).to(acc)
    v = gather_slots(values[:, :, :L], index).to(acc)
    own = mask.gather(-1, index.unsqueeze(2).expand(-1, -1, mask.shape[2], -1)) & ok.unsqueeze(2)
    logits = scale * torch.einsum("bhgd,bhnd->bhgn", query.to(acc), k)
    probs = torch.softmax(logits.masked_fill(~own, float("-inf")), dim=-1)
    # Unused gathered slots (padding) may hold anything, NaN included: zero V there.
    out = torch.einsum("bhgn,bhnd->bhgd", probs, v.masked_fill(~ok.unsqueeze(-1), 0.0))
    full = probs.new_zeros((b, h, G, L)).scatter_(-1, index.unsqueeze(2).expand(-1, -1, G, -1), probs)
    return out, full, union


def policy_decode(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step of a token-level policy: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``."""
    policy = layer.selector
    b, hq, _, d = query.shape
    h = layer.keys.shape[1]
    q = query.reshape(b, h, hq // h, d)
    if layer.policy_state is None:
        layer.policy_state = policy.start(layer, q, scale)
    state = layer.policy_state
    state.extend(layer.length)
    mask, estimate_bytes = policy.select(layer, state, q, scale)
    real = layer.slot_valid[:, None, None, : layer.length]
    out, probs, union = attend_slots(layer.keys, layer.values, q, mask & real, scale)
    policy.observe(layer, state, q, probs)
    state.steps += 1
    layer.record_step(union.sum(), real.sum() * h)
    layer.record_estimate(estimate_bytes)
    return out.reshape(b, 1, hq, -1).to(query.dtype)
