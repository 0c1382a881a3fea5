"""ShadowKV (Sun et al., ICML 2025): chunk landmarks for selection, outlier chunks and a local window.

After prefill, the prompt (but its last 4 chunks and the remainder, the local window) is cut into
chunks of 8 tokens; each chunk's landmark is the mean of its post-RoPE keys. The 48 chunks whose
least similar key (cosine similarity to the landmark) is lowest are outliers, kept and attended
at every step like the local window. At each decode step every query head scores the other chunks
by a softmax of its logits against their landmarks, the group takes the maximum, and the best
``(b - 384 - 32) / 8`` chunks are attended, besides the outliers, the local window and every
generated token. The 384-token outlier block and the 32-token window count within the budget
``b``, so a budget needs at least 424 tokens (one selectable chunk): below, the method does not fit.
"""

from __future__ import annotations

import torch

from ..errors import BudgetDoesNotFit
from ..token_policy import TokenPolicy, slots_mask

CHUNK = 8
LOCAL_CHUNKS = 4
OUTLIER_CHUNKS = 48
FIXED_TOKENS = (LOCAL_CHUNKS + OUTLIER_CHUNKS) * CHUNK  # 416, counted within the budget


def selectable_chunks(budget: int) -> int:
    return (budget - FIXED_TOKENS) // CHUNK


def landmarks_and_outliers(keys: torch.Tensor, n_outliers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk landmarks ``[h, C, d]`` of ``keys [h, C * 8, d]`` and the outlier-chunk mask ``[h, C]``
    (the ``n_outliers`` chunks whose lowest key-to-landmark cosine similarity is smallest; ties to
    the earlier chunk)."""
    acc = torch.promote_types(keys.dtype, torch.float32)
    chunks = keys.to(acc).unflatten(1, (-1, CHUNK))  # [h, C, 8, d]
    landmarks = chunks.mean(2)
    similarity = torch.nn.functional.cosine_similarity(chunks, landmarks.unsqueeze(2), dim=-1).amin(-1)
    order = torch.sort(similarity, dim=-1, stable=True).indices[..., :n_outliers]
    outliers = torch.zeros(similarity.shape, dtype=torch.bool, device=keys.device).scatter_(-1, order, True)
    return landmarks, outliers


def chunk_scores(landmarks: torch.Tensor, query: torch.Tensor, scale: float) -> torch.Tensor:
    """``[..., h, C]``: max over the group of each query head's softmax over the landmarks
    ``[..., h, C, d]`` (``query [..., h, G, d]``)."""
    logits = scale * torch.einsum("...hgd,...hcd->...hgc", query.to(landmarks.dtype), landmarks)
    return torch.softmax(logits, dim=-1).amax(-2)


class ShadowKVPolicy(TokenPolicy):
    """ShadowKV at budget ``b >= 424``: 384 outlier tokens + 32 local + ``b - 416`` selected."""

    name = "shadowkv"
    report_order = 62

    @classmethod
    def validate(cls, config, head_dim=None) -> None:
        super().validate(config, head_dim)
        if selectable_chunks(config.budget) < 1:
            raise BudgetDoesNotFit(
                f"shadowkv does not fit budget {config.budget}: its 384-token outlier block and 32-token local "
                f"window count within the budget, which needs at least {FIXED_TOKENS + CHUNK} tokens"
            )

    def start(self, layer, query, scale):
        state = super().start(layer, query, scale)
        b, h, _, d = query.shape
        T = state.length
        starts = layer.row_tensors()[0].tolist()
        n_chunks = [max((T - s) // CHUNK - LOCAL_CHUNKS, 0) for s in starts]
        C = max(n_chunks)
        landmarks = layer.keys.new_zeros((b, h, C, d), dtype=torch.promote_types(layer.keys.dtype, torch.float32))
        selectable = torch.zeros((b, h, C), dtype=torch.bool, device=layer.keys.device)
        fixed = state.keep.clone()  # the local window, then the outliers
        for row, (s, n) in enumerate(zip(starts, n_chunks)):
            if n == 0:
                continue
            fixed[row, :, 0, s : s + n * CHUNK] = False
            marks, outliers = landmarks_and_outliers(layer.keys[row, :, s : s + n * CHUNK], min(OUTLIER_CHUNKS, n))
            landmarks[row, :, :n] = marks
            selectable[row, :, :n] = ~outliers
            fixed[row, :, 0, s : s + n * CHUNK] = outliers.repeat_interleave(CHUNK, -1)
        state.keep = fixed
        state.tensors.update(landmarks=landmarks, selectable=selectable)
        state.info["starts"] = starts
        return state

    def select(self, layer, state, query, scale):
        landmarks, selectable = state.tensors["landmarks"], state.tensors["selectable"]
        b, h, C, d = landmarks.shape
        k = selectable_chunks(self.config.budget)
        scores = chunk_scores(landmarks, query, scale).masked_fill(~selectable, float("-inf"))
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
        chosen = torch.zeros_like(selectable).scatter_(-1, best, True) & selectable  # [b, h, C]
        start = torch.tensor(state.info["starts"], device=chosen.device).view(b, 1, 1)
        slots = (start + torch.arange(C * CHUNK, device=chosen.device)).expand(b, h, -1)  # each row's chunk grid
        picked = slots_mask(slots, chosen.repeat_interleave(CHUNK, -1), state.length)
        read = b * h * C * d * layer.keys.element_size()  # the landmarks
        return (state.keep | picked.unsqueeze(2)), read
