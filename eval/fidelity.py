"""Selection fidelity (paper §3, Table 1 / Fig. 1) on real queries and keys captured while decoding.

For every captured decode step (layer, query heads, the cache as it was at that step) and every arm
(selector x budget) we rebuild the arm's page set exactly as `locks_hf.backends.reference.reference_decode` does
(summaries of the complete pages, `page_scores`, `select_pages`) and measure against exact attention:

* ``mass``      retained attention mass gamma_S: share of the exact softmax mass on the selected pages,
                averaged over the query heads of the group;
* ``recall``    exact-LSE page recall: overlap of the arm's free (non-forced) pages with the oracle's
                ``k - 2`` free pages, divided by the oracle's count (1.0 for the oracle itself);
* ``rel_err``   ``|o_S - o| / |o|`` of the attention output renormalised over the selected pages;
* ``excl_err`` / ``excl_mass``  the exclusion test: attend everything *except* the selected pages
                (a selector that finds the mass leaves a complement whose output is far from ``o``).

Capture: `capture_decode` records, through `locks_hf.attention.observe_decode_queries`, the decode
query of every `LocksLayer` at each step, and reads the keys/values from the cache afterwards
(nothing is evicted, so the first ``L`` slots are the cache of the step with ``L`` tokens).
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from locks_hf.compat import cache_keyword
from locks_hf.selectors import forced_pages, make_selector

from .jsonl import InputFileError, end_last_line, read_jsonl, resolve


# ----------------------------------------------------------------------------------------------------
# metrics on tensors
def selection_metrics(
    keys: torch.Tensor,
    values: torch.Tensor,
    valid: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    selected: torch.Tensor,
    oracle_selected: torch.Tensor,
    forced: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per (batch row, KV head) metrics, averaged over the group's query heads.

    Shapes: ``keys [b,h,P,B,d]``, ``values [b,h,P,B,dv]``, ``valid [b,1,P,B]``, ``query [b,h,G,d]``,
    ``selected / oracle_selected [b,h,P]`` bool, ``forced [b,h,P]`` bool (sink + recent pages).
    Returns tensors ``[b, h]``: mass, recall, rel_err, excl_err, excl_mass.
    """
    k, v, q = keys.double(), values.double(), query.double()
    logits = scale * torch.einsum("bhgd,bhpid->bhgpi", q, k)
    tok_ok = valid.unsqueeze(2)  # [b,1,1,P,B]
    logits = logits.masked_fill(~tok_ok, float("-inf"))
    b, h, G, P, B = logits.shape
    flat = logits.flatten(-2)
    p = torch.softmax(flat, -1)
    vf = v.flatten(2, 3)  # [b,h,P*B,dv]
    o = torch.einsum("bhgn,bhnd->bhgd", p, vf)
    page_mass = p.unflatten(-1, (P, B)).sum(-1)  # [b,h,G,P]
    sel = selected.unsqueeze(2)
    mass = (page_mass * sel).sum(-1)  # [b,h,G]

    def restricted(mask_pages):
        m = (mask_pages.unsqueeze(2).unsqueeze(-1) & tok_ok).expand(b, h, G, P, B).flatten(-2)
        lg = flat.masked_fill(~m, float("-inf"))
        any_ok = m.any(-1, keepdim=True)
        pr = torch.softmax(lg, -1).nan_to_num(0.0) * any_ok
        return torch.einsum("bhgn,bhnd->bhgd", pr, vf), any_ok.squeeze(-1)

    o_s, _ = restricted(selected)
    o_x, any_x = restricted(~selected)
    norm = o.norm(dim=-1).clamp_min(1e-30)
    rel = (o_s - o).norm(dim=-1) / norm
    ex = ((o_x - o).norm(dim=-1) / norm).masked_fill(~any_x, float("nan"))
    free, ofree = selected & ~forced, oracle_selected & ~forced
    denom = ofree.sum(-1).double()
    recall = ((free & ofree).sum(-1).double() / denom).masked_fill(denom == 0, float("nan"))
    return {
        "mass": mass.mean(2),
        "recall": recall,
        "rel_err": rel.mean(2),
        "excl_err": ex.mean(2),
        "excl_mass": (1 - mass).mean(2),
    }


def arm_selection(
    config,
    keys: torch.Tensor,
    valid: torch.Tensor,
    n_complete: int,
    query: torch.Tensor,
    scale: float,
    n_fit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The page set ``[b,h,P]`` an arm attends at this step, as `reference_decode` builds it; and the forced pages.

    ``full`` (or a context of at most ``k`` pages) selects every real page. Selectors with
    sequence-level state (the shared-basis controls) fit it on the first ``n_fit`` pages (the pages
    complete at the first decode step after the prefill, as `LocksLayer` does), frozen after.
    """
    b, h, P = keys.shape[0], keys.shape[1], keys.shape[2]
    page_real = valid[:, 0].any(-1)  # [b, P]
    sink, recent = forced_pages(page_real)
    forced = ((sink | recent) & page_real)[:, None].expand(b, h, P)
    selector = make_selector(config)
    if selector is None or P <= config.page_slots:
        return page_real[:, None].expand(b, h, P), forced
    vh = valid.expand(-1, h, -1, -1)
    nf = n_complete if n_fit is None else min(n_fit, n_complete)
    shared = selector.fit_sequence(keys[:, :, :nf], vh[:, :, :nf])
    summary = {**selector.summarize(keys[:, :, :n_complete], vh[:, :, :n_complete], shared), **shared}
    complete = (torch.arange(P, device=keys.device) < n_complete).expand(b, P)
    return selector.choose_pages(summary, keys, valid, query, scale, complete, config), forced


# ----------------------------------------------------------------------------------------------------
# capture
@dataclass
class Capture:
    layer: int
    length: int  # cached tokens at this step (the step's own token included)
    query: torch.Tensor  # [b, Hq, d] post-RoPE
    scale: float
    prompt: str = ""


@contextlib.contextmanager
def capturing_queries(out: list):
    """Within the block, every decode step of a `LocksLayer` appends (layer_idx, length, query, scale)."""
    from locks_hf.attention import observe_decode_queries

    def record(layer_idx, length, query, scale):
        out.append((layer_idx, length, query[:, :, 0].detach().clone(), float(scale)))

    with observe_decode_queries(record):
        yield out


@torch.no_grad()
def capture_decode(model, prompt_ids: torch.Tensor, steps: int = 8, page_size: int = 16):
    """Prefill densely, decode ``steps`` greedy tokens with full attention; return (captures, cache)."""
    from locks_hf import LocksCache, LocksConfig

    # dynamic layout: the captures read each step's length off the key tensor (the static layout's is
    # its whole capacity)
    cache = LocksCache(model.config, LocksConfig(selector="full", page_size=page_size), layout="dynamic")
    out = model(prompt_ids, **{cache_keyword(model): cache}, use_cache=True)
    tok = out.logits[:, -1:].argmax(-1)
    raw: list = []
    with capturing_queries(raw):
        for _ in range(steps):
            out = model(tok, **{cache_keyword(model): cache}, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
    caps = [Capture(layer=l, length=L, query=q, scale=s) for l, L, q, s in raw]
    return caps, cache


def capture_metrics(
    cap: Capture, cache, arms, page_size: int = 16, fit_length: int | None = None, needle: int | None = None
) -> dict[str, dict[str, float]]:
    """Metrics of every arm at one captured step: {arm_name: {metric: mean over batch and KV heads}}."""
    from locks_hf.config import LocksConfig

    layer = cache.layers[cap.layer]
    B = page_size
    L = cap.length
    P = math.ceil(L / B)
    # batch-1, unpadded prompts: the first L slots are exactly the cache of the step with L tokens
    kb, vb = layer.keys, layer.values  # [b, h, T, d] views of the cache (public DynamicLayer fields)
    b, h, _, d = kb.shape
    pad = P * B - L
    keys = torch.nn.functional.pad(kb[:, :, :L], (0, 0, 0, pad)).unflatten(2, (P, B))
    values = torch.nn.functional.pad(vb[:, :, :L], (0, 0, 0, pad)).unflatten(2, (P, B))
    sv = getattr(layer, "slot_valid", None)
    valid = sv[:, :L] if sv is not None else torch.ones(b, L, dtype=torch.bool, device=kb.device)
    if not bool(valid.all()):
        raise ValueError("fidelity capture expects unpadded batch-1 prompts")
    valid = torch.nn.functional.pad(valid, (0, pad), value=False).unflatten(1, (P, B)).unsqueeze(1)
    G = cap.query.shape[1] // h
    q = cap.query.reshape(b, h, G, d)
    n_complete = L // B
    results = {}
    oracle_cache: dict[int, torch.Tensor] = {}
    for arm in arms:
        cfg = arm.config
        sel, forced = arm_selection(
            cfg, keys, valid, n_complete, q, cap.scale, n_fit=None if fit_length is None else fit_length // B
        )
        kslots = cfg.page_slots
        if kslots not in oracle_cache:
            ocfg = LocksConfig(
                selector="oracle",
                page_size=B,
                rank=min(cfg.rank, B),
                budget=cfg.budget,
                group_combine=cfg.group_combine,
            )
            oracle_cache[kslots] = arm_selection(ocfg, keys, valid, n_complete, q, cap.scale)[0]
        m = selection_metrics(keys, values, valid, q, cap.scale, sel, oracle_cache[kslots], forced)
        row = {k: float(torch.nanmean(v.float())) if not torch.isnan(v).all() else float("nan") for k, v in m.items()}
        row["attended_pages"] = float(sel.sum(-1).double().mean())
        if needle is not None and 0 <= needle < L:  # is the page holding the answer token attended?
            row["needle_hit"] = float(sel[:, :, needle // B].double().mean())
        row["pages"] = P
        results[arm.name] = row
    return results


# ----------------------------------------------------------------------------------------------------
# driver
METRICS = ("mass", "recall", "rel_err", "excl_err", "excl_mass", "attended_pages", "pages", "needle_hit")


def run_fidelity(
    model, prompts: list[tuple], arms, out_dir, steps: int = 8, page_size: int = 16, progress: bool = True
) -> Path:
    """Capture ``steps`` decode steps per prompt, score every arm, write ``fidelity_raw.jsonl`` +
    ``fidelity.csv`` (mean per layer x arm and over all layers). Resumable per prompt.

    ``prompts``: ``(name, ids)`` or ``(name, ids, needle_token_index)``; with a needle index the
    share of steps whose selection holds the needle's page is reported (``needle_hit``).
    """
    from tqdm.auto import tqdm

    quantized = [arm.name for arm in arms if arm.config.kv_bits != 16 or arm.hf_cache is not None]
    if quantized:  # the captured keys are full precision: such arms would be scored as if unquantized
        raise ValueError(
            f"fidelity scores selection on captured full-precision K/V; arms {quantized} quantize their K/V "
            "(kv_bits, or transformers' QuantizedCache): run them with `locks-hf-eval sweep`"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw_path = out_dir / "fidelity_raw.jsonl"
    # prompts already measured (resume); a line torn by a kill is dropped and cut off before appending
    done = {r["prompt"] for r in raw_rows(raw_path)} if raw_path.exists() else set()
    end_last_line(raw_path)
    with open(raw_path, "a") as f:
        for item in tqdm(prompts, desc="fidelity", disable=not progress):
            name, ids = item[0], item[1]
            needle = item[2] if len(item) > 2 else None
            if name in done:
                continue
            caps, cache = capture_decode(model, ids, steps=steps, page_size=page_size)
            rows = []
            first_len = min((c.length for c in caps), default=None)  # the first decode step
            for cap in caps:
                for arm_name, m in capture_metrics(
                    cap, cache, arms, page_size, fit_length=first_len, needle=needle
                ).items():
                    rows.append({"prompt": name, "layer": cap.layer, "length": cap.length, "arm": arm_name, **m})
            f.write("".join(json.dumps(r) + "\n" for r in rows))
            f.flush()
    summarize_fidelity(out_dir, arms)
    return out_dir


def raw_rows(path: Path) -> list[dict]:
    """The measurements of ``fidelity_raw.jsonl``, which the harness appends to (`read_jsonl` ``appended``)."""
    return read_jsonl(
        path,
        required=("prompt", "layer", "arm"),
        appended=True,
        fix="remove that line (a prompt's measurements are redone on resume), or use another --out folder",
    )


def summarize_fidelity(out_dir, arms=None) -> list[dict]:
    out_dir = Path(out_dir)
    rows = raw_rows(out_dir / "fidelity_raw.jsonl")
    if not rows:
        raise InputFileError(
            f"{resolve(out_dir / 'fidelity_raw.jsonl')}: no measurements in it; run "
            "`locks-hf-eval fidelity` into that folder (with at least one prompt) first"
        )
    order = {a.name: i for i, a in enumerate(arms or [])}
    groups: dict[tuple, list] = defaultdict(list)
    for r in rows:
        groups[(r["arm"], r["layer"])].append(r)
        groups[(r["arm"], "all")].append(r)
    meta = {a.name: (a.family, a.budget) for a in (arms or [])}
    table = []
    for (arm, layer), rs in sorted(groups.items(), key=lambda kv: (order.get(kv[0][0], 999), kv[0][0], str(kv[0][1]))):
        fam, bud = meta.get(arm, (arm.rsplit("-b", 1)[0], int(arm.rsplit("-b", 1)[1]) if "-b" in arm else None))
        entry = {
            "arm": arm,
            "family": fam,
            "budget": bud,
            "layer": layer,
            "n": len(rs),
            "prompts": len({r["prompt"] for r in rs}),
        }
        for m in METRICS:
            vals = [r[m] for r in rs if r.get(m) is not None and not math.isnan(r[m])]
            entry[m] = round(sum(vals) / len(vals), 4) if vals else None
        table.append(entry)
    with open(out_dir / "fidelity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0].keys()))
        w.writeheader()
        w.writerows(table)
    return table
