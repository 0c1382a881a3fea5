"""Helpers shared by the Triton kernels (jit functions and launch-side utilities)."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from contextvars import ContextVar

import torch
import triton
import triton.language as tl

#: "no page" in selection outputs (fixed-width lists are padded with it).
SENTINEL = -1
# Constants read inside kernels must be ``tl.constexpr`` globals.
SENTINEL_C = tl.constexpr(SENTINEL)
#: "no page found" inside kernels (larger than any page index).
BIG_PAGE = tl.constexpr(2**30)
#: key of a non-candidate page in the selection kernels (below every finite score's key).
NO_KEY = tl.constexpr(-(2**31))
LOG2E = tl.constexpr(1.4426950408889634)


_COMPILE_ONLY: ContextVar[bool] = ContextVar("locks_hf_compile_only", default=False)


@contextlib.contextmanager
def compile_only():
    """Within this block (in this thread only), `launch` compiles each kernel for the launch it is given and
    does not run it: Triton's ``warmup``, which specializes on the arguments exactly as the launch would.
    A decode step run in this mode leaves every buffer as it was and the compiled kernels in the kernels'
    caches, ready for the real step (see `locks_hf.precompile`)."""
    token = _COMPILE_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILE_ONLY.reset(token)


def compiling_only() -> bool:
    """Whether this thread is inside `compile_only`: host code that writes a tensor must not."""
    return _COMPILE_ONLY.get()


_pending_compiles: list[Callable[[], None]] = []
_pending_lock = threading.Lock()


def join_before_decode(wait: Callable[[], None]) -> None:
    """Have the next decode-time op (decode step, page update, quantized attention, KIVI append) made
    outside `compile_only`, in any thread, call ``wait`` before it launches anything. A background compile
    of those kernels (`locks_hf.precompile`) is so joined at the first launch that needs it, and runs on
    through whatever precedes that launch (torch.compile's own work at a first compiled step)."""
    with _pending_lock:
        _pending_compiles.append(wait)


def join_pending_compiles() -> None:
    """Call the waits `join_before_decode` registered (once each); nothing inside `compile_only`."""
    if not _pending_compiles or _COMPILE_ONLY.get():
        return
    with _pending_lock:
        waits = _pending_compiles[:]
        _pending_compiles.clear()
    for wait in waits:
        wait()


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``; under `compile_only`, the kernel's compile for that launch only."""
    if _COMPILE_ONLY.get():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        kernel[grid](*args, **kwargs)


def on_device(device: torch.device):
    """Make ``device`` current for the launches (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def as_length(length, device) -> torch.Tensor:
    """The cache length as the ``int32 [1]`` device tensor the kernels read (a Python int is copied
    over; a tensor, e.g. a static cache's, is used as is so a captured graph sees every new value)."""
    if torch.is_tensor(length):
        return length
    return torch.full((1,), int(length), dtype=torch.int32, device=device)


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 off CUDA: the interpreter's launch sizing)."""
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """Exact float32 products when the query is float32 (CPU tests); bf16/fp16 go to tensor cores."""
    return "ieee" if dtype == torch.float32 else "tf32"


#: Bytes of a line the L2 is asked for by `prefetch_l2` (sm_90's L2 line; sectors are 32 bytes).
L2_LINE = tl.constexpr(128)


@triton.jit
def prefetch_l2(base, n_bytes, LINES: tl.constexpr):
    """Ask the L2 for the first ``n_bytes`` bytes from ``base`` (at most ``LINES`` lines of `L2_LINE`
    bytes): ``prefetch.global.L2`` per line, a hint whose data comes to no register and which nothing
    waits on, meant to put a program's chained loads (a product, then its epilogue) on the way from DRAM
    at its start (measured slower in the scoring kernels: `score_tiles.L2_PREFETCH`). CUDA only (inline
    PTX): the launch sets the kernels' flag off elsewhere and in the interpreter."""
    off = tl.arange(0, LINES) * L2_LINE
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r",
        [base.to(tl.pointer_type(tl.int8)) + off, (off < n_bytes).to(tl.int32)],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def take_rows(x, G: tl.constexpr, GP: tl.constexpr):
    """First ``G`` rows of ``x [GP, N]`` whose rows ``>= G`` are zero (a dot with a zero-padded query).

    ``tl.dot`` needs at least 16 rows; a GQA group of 4 heads is padded to 16 and folded back here.
    """
    if G == GP:
        y = x
    else:
        y = tl.sum(tl.reshape(x, [GP // G, G, x.shape[1]]), axis=0)
    return y


@triton.jit
def slot_ok(valid_ptr, slot, length):
    """Real, written cache slots: ``0 <= slot < length`` and ``slot_valid[slot]`` (uint8 view)."""
    inside = (slot >= 0) & (slot < length)
    return inside & (tl.load(valid_ptr + slot, mask=inside, other=0) != 0)


@triton.jit
def arrived_last(tick_ptr, n):
    """Whether this program is the last of the ``n`` programs that arrive at the counter ``tick_ptr`` (int32,
    zero before the first arrival): the others' stores before their arrival are then visible to it (read them
    with ``cache_modifier=".cg"``), so it can carry on with their results in the same launch. The last one
    sets the counter back to zero, so a counter buffer serves launch after launch (a captured graph's replays
    included) with no memset of its own."""
    tl.debug_barrier()  # every thread's stores before the arrival, which the atomic (acq_rel, gpu) releases
    last = tl.atomic_add(tick_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
    tl.store(tick_ptr, 0, mask=last)
    return last


@triton.jit
def score_key(x):
    """Signed int32 key with the order of the float32 ``x`` (larger score -> larger key)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def kth_key(key, K):
    """A threshold ``t`` (int64) that splits the ``K`` largest keys of ``key [N]`` from the rest up to
    ties at ``t``: ``count(key > t) <= K <= count(key >= t)`` (``NO_KEY`` entries left out); just
    below the smallest key when at most ``K`` are left.

    A radix search from the top bit down, ``RADIX_BITS`` bits a round: each round takes one histogram
    of the next bits of the keys that share the prefix found so far (`radix_round`), for at most 7
    rounds on 32-bit keys, fewer where the keys' range leaves their top bits common. A round whose
    bucket holds exactly the keys still wanted ends the search there (the keys at or above its lower
    bound are the top ``K``). A round's histogram costs a warp vote a bit a key, one bucket a lane of a
    warp (64 buckets add layout exchanges, 256 cost 8 buckets a lane: slower), where a comparison with
    each of 16 thresholds, the search this replaced, cost 16 for 4 bits. No sort.
    """
    return kth_key_of(key, key, K, False)


#: Bits of the key resolved a search round of `kth_key`: a histogram of 32 buckets, one a lane.
RADIX_BITS = tl.constexpr(5)
RADIX_BINS = tl.constexpr(32)


@triton.jit
def _as_unsigned(key):
    """``key`` (int32) as uint32 with its order: ``NO_KEY`` is 0."""
    return (key ^ NO_KEY).to(tl.uint32, bitcast=True)


#: Whether this Triton's `tl.histogram` takes a mask (3.6 does, 3.3 does not): without, `radix_round` counts the
#: keys it leaves out in a second half of buckets that it drops.
HISTOGRAM_MASK = tl.constexpr("mask" in inspect.signature(tl.histogram).parameters)


@triton.jit
def radix_round(u, cand, pre, shift, BITS: tl.constexpr, BINS: tl.constexpr, MASKED: tl.constexpr):
    """Histogram ``[BINS]`` (``2**BITS``) of bits ``[shift, shift + BITS)`` of the candidates of ``u`` (uint32)
    whose bits above ``shift + BITS`` are those of ``pre`` (int64, below ``2**32``); ``MASKED``: in
    `tl.histogram`'s mask (`HISTOGRAM_MASK`). 32-bit work a key: the prefix test is one masked xor."""
    high = (tl.full([], -1, tl.int64) << (shift + BITS).to(tl.int64)).to(tl.uint32)  # 0 past bit 31
    inside = cand & (((u ^ pre.to(tl.uint32)) & high) == 0)
    bucket = ((u >> shift) & (BINS - 1)).to(tl.int32)
    if MASKED:
        hist = tl.histogram(bucket, BINS, mask=inside)
    else:
        both = tl.reshape(tl.histogram(tl.where(inside, bucket, bucket + BINS), 2 * BINS), [2, BINS])
        hist = tl.sum(tl.where((tl.arange(0, 2) == 0)[:, None], both, 0), axis=0)
    return hist


@triton.jit
def kth_key_of(key, more, K, TWO: tl.constexpr):
    """`kth_key` of the keys of ``key [N]`` and, with ``TWO``, of a second tile ``more [M]`` taken as one
    list: ``N + M`` keys whose count is not a power of two need no tile of the next power of two."""
    cand = key != NO_KEY
    u = _as_unsigned(key)
    lo = tl.min(tl.where(cand, u, 0xFFFFFFFF), axis=0).to(tl.int64)
    hi = tl.max(u, axis=0).to(tl.int64)
    n_cand = tl.sum(cand.to(tl.int32), axis=0)
    if TWO:
        cand2 = more != NO_KEY
        u2 = _as_unsigned(more)
        lo = tl.minimum(lo, tl.min(tl.where(cand2, u2, 0xFFFFFFFF), axis=0).to(tl.int64))
        hi = tl.maximum(hi, tl.max(u2, axis=0).to(tl.int64))
        n_cand += tl.sum(cand2.to(tl.int32), axis=0)
    # the bits from `shift` up are known: those above the top bit where the candidates differ, then one
    # bucket's a round; `want` of the keys with that prefix are still to be taken
    shift = 0
    while ((lo ^ hi) >> shift) > 0:
        shift += RADIX_BITS
    pre = (lo >> shift) << shift
    want = K
    if n_cand <= K:  # keep every candidate: threshold just under the smallest key
        pre = lo - 1
        shift = 0
    while shift > 0:
        shift -= RADIX_BITS
        hist = radix_round(u, cand, pre, shift, RADIX_BITS, RADIX_BINS, HISTOGRAM_MASK)
        if TWO:
            hist += radix_round(u2, cand2, pre, shift, RADIX_BITS, RADIX_BINS, HISTOGRAM_MASK)
        # keys with the prefix in each bucket or above it (a non-increasing count): the last bucket whose count
        # reaches `want` holds the next key to take
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        reach = at_or_above >= want
        top = tl.sum(reach.to(tl.int32), axis=0) - 1
        pre += top.to(tl.int64) << shift
        with_it = tl.min(tl.where(reach, at_or_above, 2147483647), axis=0)
        if with_it == want:  # the keys from this bucket up are the top K: none tied at one below it
            pre -= 1
            shift = 0
        else:
            want -= tl.max(tl.where(reach, 0, at_or_above), axis=0)
    return pre - 2147483648


@triton.jit
def top_keys(key, K):
    """Mask of the ``K`` largest keys of ``key [N]`` (ties: earlier position first).

    Entries equal to ``NO_KEY`` are never selected; with fewer than ``K`` other entries all of them
    are. The threshold from `kth_key` (every key above it is kept), then a prefix count of the ties at
    the threshold fills the rest.
    """
    return top_keys_of(key, key, K, False)[0]


@triton.jit
def top_keys_of(key, more, K, TWO: tl.constexpr):
    """`top_keys` of ``key [N]`` followed, with ``TWO``, by a second tile ``more [M]``: the masks of both
    (ties: earlier position first, every position of ``key`` before those of ``more``); without
    ``TWO`` the second mask is the first."""
    thr = kth_key_of(key, more, K, TWO)
    cand = key != NO_KEY
    above = cand & (key.to(tl.int64) > thr)
    tie = cand & (key.to(tl.int64) == thr)
    n_above = tl.sum(above.to(tl.int32), axis=0)
    if TWO:
        cand2 = more != NO_KEY
        above2 = cand2 & (more.to(tl.int64) > thr)
        tie2 = cand2 & (more.to(tl.int64) == thr)
        n_above += tl.sum(above2.to(tl.int32), axis=0)
    room = K - n_above
    rank = tl.cumsum(tie.to(tl.int32), axis=0)
    keep = above | (tie & (rank <= room))
    keep2 = keep
    if TWO:
        rank2 = tl.sum(tie.to(tl.int32), axis=0) + tl.cumsum(tie2.to(tl.int32), axis=0)
        keep2 = above2 | (tie2 & (rank2 <= room))
    return keep, keep2
