"""Reports in the paper's shape: markdown tables (task rows x arms, one table per length and budget),
an average table (arm x budget), a PNG of score vs budget per arm, and the selection-fidelity table/plot."""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from locks_hf.selectors import family_sort_key

from .jsonl import read_json, read_jsonl, resolve

#: What to do about a damaged file of a run folder given to `report`.
RUN_FIX = (
    "name a run folder that `locks-hf-eval sweep` wrote (config.json + results.jsonl); a damaged one: "
    "run `locks-hf-eval merge --out <run>` again where predictions/ is, else restore the file from a copy"
)

# Arm families are ordered by selector (each declares its `report_order`), larger summaries first.
_fam_key = family_sort_key


def _run_rows(run_dir: Path) -> tuple[list[str], list[dict]]:
    """A run folder's arms (in its config's order) and merged rows (merging a sweep's predictions first)."""
    from .merge import merge
    from .rundir import PREDICTION_KEYS

    if (run_dir / "predictions").is_dir():  # a sweep's folder; a published one holds only the merged files
        merge(run_dir)
    cfg = read_json(run_dir / "config.json", fix=RUN_FIX)
    arms = [a["name"] for a in cfg.get("arms", [])]
    return arms, read_jsonl(run_dir / "results.jsonl", required=PREDICTION_KEYS, fix=RUN_FIX)  # or .jsonl.gz


def load_cells(run_dir: Path, complete_only: bool = True) -> list[dict]:
    """(task, length, arm) cells: mean score x100 over records (avg@k over samples first).

    ``complete_only``: only records that every arm of the run has finished enter (a partial or
    in-progress run then compares all arms on the same records).
    """
    return _cells(*_run_rows(run_dir), complete_only)


def load_pooled_cells(run_dirs: list[Path]) -> list[dict]:
    """`load_cells` over the records of several runs of one benchmark (independent draws of records,
    e.g. two seeds): the arms every run has, each record keyed by its run (``<i>:<folder>/<id>``)."""
    if len(run_dirs) < 2:
        raise ValueError("--pool joins the records of several runs: give at least two --run folders")
    configs = [read_json(run / "config.json", fix=RUN_FIX) for run in run_dirs]
    for run, cfg in zip(run_dirs[1:], configs[1:]):
        for key in ("model", "protocol"):
            if cfg.get(key) != configs[0].get(key):
                raise ValueError(
                    f"--pool: {run} has {key}={cfg.get(key)!r} and {run_dirs[0]} {configs[0].get(key)!r}; "
                    "pool runs of one model and protocol only"
                )
        if cfg.get("benchmark", {}).get("name") != configs[0].get("benchmark", {}).get("name"):
            raise ValueError(f"--pool: {run} and {run_dirs[0]} are runs of different benchmarks; pool one benchmark")
    runs = [_run_rows(run) for run in run_dirs]
    arms = [a for a in runs[0][0] if all(a in other for other, _ in runs[1:])]
    rows = [
        {**r, "id": f"{i}:{run.name}/{r['id']}"}
        for i, (run, (_, got)) in enumerate(zip(run_dirs, runs))
        for r in got
        if r["arm"] in arms
    ]
    return _cells(arms, rows, True)


def _cells(arms: list[str], rows: list[dict], complete_only: bool) -> list[dict]:
    from .merge import TRAFFIC

    by_id = defaultdict(set)
    for r in rows:
        by_id[r["id"]].add(r["arm"])
    keep = {i for i, a in by_id.items() if not complete_only or set(arms) <= a}
    per_rec = defaultdict(list)
    traffic: dict[str, defaultdict[tuple, list]] = {name: defaultdict(list) for name in TRAFFIC}
    meta = {}
    for r in rows:
        if r["id"] not in keep:
            continue
        per_rec[(r["task"], r["length"], r["arm"], r["id"])].append(r.get("score", 0.0))
        for name, values in traffic.items():
            if r.get(name) is not None:
                values[(r["task"], r["length"], r["arm"])].append(r[name])
        meta[r["arm"]] = (r["family"], r["budget"], r["selector"])
    cells = defaultdict(list)
    records: defaultdict[tuple, dict[str, float]] = defaultdict(dict)
    for (task, length, arm, rec), sc in per_rec.items():
        cells[(task, length, arm)].append(sum(sc) / len(sc))
        records[(task, length, arm)][rec] = 100 * sum(sc) / len(sc)
    order = {a: i for i, a in enumerate(arms)}
    out = []
    for (task, length, arm), v in sorted(
        cells.items(), key=lambda kv: (str(kv[0][1]), kv[0][0], order.get(kv[0][2], 999))
    ):
        fam, bud, sel = meta[arm]
        means = {
            name: (sum(got) / len(got)) if (got := values.get((task, length, arm))) else None
            for name, values in traffic.items()
        }
        out.append(
            {
                "task": task,
                "length": length,
                "arm": arm,
                "family": fam,
                "budget": bud,
                "selector": sel,
                "n": len(v),
                "score": 100 * sum(v) / len(v),
                "records": records[(task, length, arm)],  # record id -> score x100 (avg@k)
                **means,
            }
        )
    return out


def _budget_head(b) -> str:
    """A budget column's heading; ``None``: a run of dense arms only (full attention, on bf16 or quantized
    KV, or transformers' caches), whose scores do not depend on a budget."""
    return "any budget" if b is None else f"b={b}"


def _arm_budget_table(rows: list[str], budgets: list, value) -> list[str]:
    """Markdown lines of an arm x budget table: one row per arm, ``value(arm, budget)`` a string."""
    lines = ["| arm | " + " | ".join(map(_budget_head, budgets)) + " |", "|---|" + "---|" * len(budgets)]
    return lines + [f"| {r} | " + " | ".join(value(r, b) for b in budgets) + " |" for r in rows]


def _fmt(x):
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def tables_markdown(cells: list[dict]) -> tuple[str, dict]:
    """Markdown tables and the averages {(length, family, budget): (mean score, tasks)}."""
    by_len = defaultdict(list)
    for c in cells:
        by_len[c["length"]].append(c)
    md, averages = [], {}
    for L in sorted(by_len, key=lambda x: (x is None, x)):
        cs = by_len[L]
        tasks = list(dict.fromkeys(c["task"] for c in cs))
        fams = sorted({c["family"] for c in cs}, key=_fam_key)
        budgets = sorted({c["budget"] for c in cs if c["budget"] is not None}) or [None]
        # dense families (full attention, on bf16 or quantized KV) have one cell per task, shown at every budget
        dense = [f for f in fams if all(c["budget"] is None for c in cs if c["family"] == f)]
        cell = {(c["task"], c["family"], c["budget"]): c for c in cs}
        # only tasks finished by every arm enter the averages (so partial runs compare like with like);
        # the arms are the (family, budget) pairs the run has (ShadowKV, e.g., only where it fits)
        arm_cells = {(f, b) for (_, f, b) in cell}
        complete_tasks = [
            t
            for t in tasks
            if all(
                (t, f, b) in cell
                and cell[(t, f, b)]["n"] == max(cell[(t, ff, bb)]["n"] for (tt, ff, bb) in cell if tt == t)
                for f, b in arm_cells
            )
        ]
        title = f"length {L}" if L else "all records"
        sparse = [f for f in fams if f not in dense]
        md.append(f"### {title}: average over tasks (score x100)\n")
        md.append(f"Tasks in the average: {', '.join(complete_tasks) or 'none complete yet'}.\n")
        for f in dense if complete_tasks else ():
            v = sum(cell[(t, f, None)]["score"] for t in complete_tasks) / len(complete_tasks)
            for b in budgets:
                averages[(L, f, b)] = (v, len(complete_tasks))
        for f in sparse:
            for b in budgets:
                got = [cell[(t, f, b)]["score"] for t in complete_tasks if (t, f, b) in cell]
                if got and len(got) == len(complete_tasks):
                    averages[(L, f, b)] = (sum(got) / len(got), len(got))
        shown = (dense if complete_tasks else []) + sparse
        md += _arm_budget_table(shown, budgets, lambda f, b: _fmt(averages.get((L, f, b), (None,))[0]))
        md.append("")
        md += kv_quant_tables(
            averages,
            L,
            shown,
            budgets,
            title,
            lambda t, f, b: cell.get((t, f, None if f in dense else b)),
            complete_tasks,
        )
        for b in budgets:
            md.append(
                f"#### {title}, per task\n"
                if b is None
                else f"#### {title}, budget b={b} (tokens per layer and KV head)\n"
            )
            md.append("| task | n | " + " | ".join(fams) + " |")
            md.append("|---|---|" + "---|" * len(fams))
            for t in tasks:
                row = []
                for f in fams:
                    found = cell.get((t, f, None if f in dense else b))
                    row.append(_fmt(found["score"]) if found else "")
                n = max((cell[k]["n"] for k in cell if k[0] == t), default=0)
                md.append(f"| {t} | {n} | " + " | ".join(row) + " |")
            md.append("")
        md += _traffic_tables(cs, title, fams, budgets)
    return "\n".join(md), averages


def kv_quant_tables(
    averages: dict, length, fams: list[str], budgets: list, title: str, cell_at=None, tasks: Sequence[str] = ()
) -> list[str]:
    """The paper's Table 4 shape, one table per family run on quantized KV (``locks-r8i4+kv4-post`` ...):
    rows KV bf16 / 4-bit post / 4-bit pre / 2-bit post / 2-bit pre (those run), columns the budgets.
    With ``cell_at(task, family, budget)`` (a cell of `load_cells` or ``None``) and the averaged
    ``tasks``, a second table gives each quantized row's difference to KV bf16 with its
    `paired_difference` interval."""
    from locks_hf.kv_quant import split_kv_label

    variants: defaultdict[str, dict[str, str]] = defaultdict(dict)  # base family -> {row label: family}
    for f in fams:
        base, kv = split_kv_label(f)
        if kv:
            extra = "".join(f" {k[3]}{kv[k]}" for k in ("kv_group", "kv_residual") if k in kv)
            order = f" {kv['summary_from']}" if "summary_from" in kv else ""
            variants[base][f"{kv['kv_bits']}-bit{extra}{order}"] = f
    md = []
    explained = False
    for base, rows in variants.items():
        if base in fams:
            rows = {"KV bf16": base, **rows}
        shown = sorted(
            rows, key=lambda r: (r != "KV bf16", -int(r.split("-")[0]) if r[0].isdigit() else 0, r.endswith("pre"), r)
        )
        md.append(f"#### {title}: {base} on quantized KV (KIVI), score x100\n")
        md.append("| KV | " + " | ".join(map(_budget_head, budgets)) + " |")
        md.append("|---|" + "---|" * len(budgets))
        md += [
            f"| {r} | " + " | ".join(_fmt(averages.get((length, rows[r], b), (None,))[0]) for b in budgets) + " |"
            for r in shown
        ]
        md.append("")
        if cell_at is None or "KV bf16" not in rows or not tasks:
            continue
        diffs = {r: [paired_difference(cell_at, tasks, rows[r], base, b) for b in budgets] for r in shown[1:]}
        if not any(g for got in diffs.values() for g in got):
            continue  # cells without their records (built by hand): no pairing
        md.append(f"#### {title}: {base} on quantized KV, difference to KV bf16 (points, 95% interval)\n")
        if not explained:
            md.append(
                "Paired by record: the mean over tasks of each task's mean difference, and the 2.5-97.5 "
                f"percentiles of that mean over {BOOTSTRAP_RESAMPLES:,} resamples of each task's records "
                "(percentile bootstrap). The interval shows how far a few records a task move the difference; "
                "it is not a test.\n"
            )
            explained = True
        md.append("| KV | " + " | ".join(map(_budget_head, budgets)) + " |")
        md.append("|---|" + "---|" * len(budgets))
        for r, got in diffs.items():
            shown_cells = ("" if g is None else f"{g[0]:+.1f} [{g[1]:+.1f}, {g[2]:+.1f}]" for g in got)
            md.append(f"| {r} | " + " | ".join(shown_cells) + " |")
        md.append("")
    return md


#: Resamples of `paired_difference`'s interval (seeded: a report is reproducible).
BOOTSTRAP_RESAMPLES = 2000


def paired_difference(
    cell_at, tasks: Sequence[str], family: str, base: str, budget
) -> tuple[float, float, float] | None:
    """``family`` minus ``base`` at ``budget``, in points: (mean over ``tasks`` of each task's mean
    difference over the records both arms finished, 2.5th and 97.5th percentile of that mean when each
    task's records are resampled with replacement). ``None`` where a task lacks either cell."""
    import numpy as np

    diffs = []
    for t in tasks:
        a, b = cell_at(t, family, budget), cell_at(t, base, budget)
        if a is None or b is None or "records" not in a or "records" not in b:
            return None
        both = sorted(set(a["records"]) & set(b["records"]))
        if not both:
            return None
        diffs.append(np.array([a["records"][i] - b["records"][i] for i in both]))
    rng = np.random.default_rng(0)
    resampled = np.mean([d[rng.integers(0, len(d), (BOOTSTRAP_RESAMPLES, len(d)))].mean(1) for d in diffs], axis=0)
    lo, hi = np.percentile(resampled, [2.5, 97.5])
    return float(np.mean([d.mean() for d in diffs])), float(lo), float(hi)


#: The decode-traffic tables: (cell key, heading, formatter, full attention shown).
_TRAFFIC_TABLES = (
    ("attended_fraction", "attended fraction of cached tokens during decode", lambda v: f"{v:.3f}", False),
    ("attended_tokens", "tokens attended per (layer, KV head) and decode step (K/V read)", lambda v: f"{v:.0f}", True),
    (
        "read_bytes",
        "KiB read per (layer, KV head) and decode step (K/V plus the selection's reads)",
        lambda v: f"{v / 1024:.1f}",
        True,
    ),
)


def _traffic_tables(cs: list[dict], title: str, fams: list[str], budgets: list) -> list[str]:
    """Markdown lines of the decode-traffic tables (means over tasks) of one length's cells: a budget
    column per budget, full attention's value (no budget) in each column."""
    md = []
    dense = {f for f in fams if all(c["budget"] is None for c in cs if c["family"] == f)}  # full (+kv)
    for key, heading, shown, with_full in _TRAFFIC_TABLES:
        got = [c for c in cs if c.get(key) is not None]
        rows = [f for f in fams if (with_full or f not in dense) and any(c["family"] == f for c in got)]
        if not rows:
            continue
        md.append(f"#### {title}: {heading} (mean over tasks)\n")

        def mean(f, b, key=key, got=got, shown=shown):
            vals = [float(c[key]) for c in got if c["family"] == f and (f in dense or c["budget"] == b)]
            return shown(sum(vals) / len(vals)) if vals else ""

        md += _arm_budget_table(rows, budgets, mean)
        md.append("")
    return md


def plot_scores(cells: list[dict], path: Path, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    _, averages = tables_markdown(cells)
    averages = {k: v for k, v in averages.items() if k[2] is not None}  # a dense-only run has no budget axis
    lengths = sorted({k[0] for k in averages}, key=lambda x: (x is None, x))
    if not lengths:
        return None
    many = len({k[1] for k in averages}) > 6  # a legend beside the panels, not over the lines
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.5 * len(lengths) + 2 * many, 4), squeeze=False)
    for j, (ax, L) in enumerate(zip(axes[0], lengths)):
        fams = sorted({k[1] for k in averages if k[0] == L}, key=_fam_key)
        for i, f in enumerate(fams):
            pts = sorted((k[2], v[0]) for k, v in averages.items() if k[0] == L and k[1] == f)
            if f == "full":
                ax.axhline(pts[0][1], color="black", linestyle="--", label="full")
                continue
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=_MARKERS[i % len(_MARKERS)],
                linestyle=":" if _token_level(f) else "-",
                label=f,
            )
        ax.set_ylabel("score (avg over tasks)")
        _style_budget_axis(
            ax,
            "budget b (tokens per layer and KV head)",
            f"{title}, {L} tokens" if L else title,
            legend=not many or j == len(lengths) - 1,
            outside=many,
        )
        budgets = sorted({k[2] for k in averages if k[0] == L})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    return _save_figure(fig, path)


_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p")


def _token_level(family: str) -> bool:
    """The family is a token-level baseline (`locks_hf.token_policy`), drawn dotted."""
    from locks_hf.selectors import parse_family

    try:
        return bool(parse_family(family)[0].token_level)
    except ValueError:
        return False


def _style_budget_axis(ax, xlabel: str, title: str, legend: bool = True, outside: bool = False) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize=8, **({"loc": "upper left", "bbox_to_anchor": (1.02, 1.0)} if outside else {}))


def _save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def fidelity_markdown(rows: list[dict]) -> str:
    """Table 1 shape: per arm family and budget, mass / recall / rel. error / exclusion, all layers."""
    allrows = [r for r in rows if r["layer"] == "all"]
    fams = sorted({r["family"] for r in allrows}, key=_fam_key)
    budgets = sorted({int(r["budget"]) for r in allrows if r["budget"] not in (None, "", "None")})
    md = []
    for metric, label in (
        ("mass", "retained attention mass gamma_S (%)"),
        ("recall", "exact-LSE page recall (%)"),
        ("rel_err", "relative output error |o_S - o|/|o|"),
        ("excl_err", "exclusion test: relative error attending all but S"),
        ("attended_pages", "pages attended per KV head (Quest: union over the group's query heads)"),
        ("needle_hit", "needle page attended (% of steps x layers x heads; niah prompts only)"),
    ):
        md.append(f"#### {label}\n")

        def shown(f, b, metric=metric):
            r = next((r for r in allrows if r["family"] == f and str(r["budget"]) == str(b)), None)
            v = None if r is None or r[metric] in (None, "") else float(r[metric])
            return (
                ""
                if v is None
                else (
                    f"{100 * v:.1f}"
                    if metric in ("mass", "recall", "needle_hit")
                    else f"{v:.1f}"
                    if metric == "attended_pages"
                    else f"{v:.3f}"
                )
            )

        md += _arm_budget_table(fams, budgets, shown)
        md.append("")
    layers = sorted({r["layer"] for r in rows if r["layer"] != "all"}, key=lambda x: int(x))
    if layers:
        md.append("#### per layer: retained mass (%) / recall (%) at each budget\n")
        md.append("| arm | budget | " + " | ".join(f"layer {l}" for l in layers) + " |")
        md.append("|---|---|" + "---|" * len(layers))
        for f in fams:
            for b in budgets:
                cells = []
                for l in layers:
                    r = next(
                        (
                            r
                            for r in rows
                            if r["family"] == f and str(r["budget"]) == str(b) and str(r["layer"]) == str(l)
                        ),
                        None,
                    )
                    if r is None or r["mass"] in (None, ""):
                        cells.append("")
                    else:
                        rec = "" if r["recall"] in (None, "") else f"{100 * float(r['recall']):.1f}"
                        cells.append(f"{100 * float(r['mass']):.1f} / {rec}")
                md.append(f"| {f} | {b} | " + " | ".join(cells) + " |")
        md.append("")
    return "\n".join(md)


def plot_fidelity(rows: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    allrows = [r for r in rows if r["layer"] == "all" and r["budget"] not in (None, "", "None")]
    fams = sorted({r["family"] for r in allrows}, key=_fam_key)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (m, lab) in zip(
        axes,
        (("mass", "retained mass gamma_S"), ("recall", "exact-LSE page recall"), ("rel_err", "relative output error")),
    ):
        for f in fams:
            pts = sorted(
                (int(r["budget"]), float(r[m])) for r in allrows if r["family"] == f and r[m] not in (None, "")
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f)
        _style_budget_axis(ax, "budget b", lab)
    return _save_figure(fig, path)


def agreement_markdown(run_dir: Path) -> str:
    """Share of records (x100) whose prediction is identical to the full-attention arm's, per arm family
    and budget (records finished by every arm only)."""
    from .rundir import PREDICTION_KEYS

    cfg = read_json(run_dir / "config.json", fix=RUN_FIX)
    arms = [a["name"] for a in cfg.get("arms", [])]
    if "full" not in arms:
        return ""
    rows = read_jsonl(run_dir / "results.jsonl", required=PREDICTION_KEYS + ("pred",), fix=RUN_FIX)
    preds: defaultdict[tuple, dict] = defaultdict(dict)
    meta = {}
    for r in rows:
        preds[(r["id"], r.get("sample", 0), r["length"])][r["arm"]] = r["pred"].strip()
        meta[r["arm"]] = (r["family"], r["budget"])
    done = {k: v for k, v in preds.items() if set(arms) <= set(v)}
    if not done:
        return ""
    lengths = sorted({k[2] for k in done}, key=lambda x: (x is None, x))
    fams = sorted({meta[a][0] for a in arms if a != "full"}, key=_fam_key)
    # dense arms (full+kv4) at every one; a run of dense arms only has one column
    budgets = sorted({meta[a][1] for a in arms if meta[a][1] is not None}) or [None]
    md = []
    for L in lengths:
        recs = [v for k, v in done.items() if k[2] == L]
        md.append(
            f"#### {'length ' + str(L) if L else 'all records'}: prediction identical to full attention (% of {len(recs)} records)\n"
        )

        def same_share(f, b, recs=recs):
            arm = next((a for a in arms if meta.get(a) in ((f, b), (f, None))), None)
            return "" if arm is None else f"{100 * sum(v[arm] == v['full'] for v in recs) / len(recs):.0f}"

        md += _arm_budget_table(fams, budgets, same_share)
        md.append("")
    return "\n".join(md)


def summary_markdown(runs_cells: list[list[dict]], png: Path, label: str) -> str:
    """For several runs of distinct prompt lengths: one arm x (length, budget) table of the averages
    over tasks and one plot of them (a panel per length); ``""`` otherwise."""
    lengths = [{c["length"] for c in cells} for cells in runs_cells]
    if len(runs_cells) < 2 or any(a & b for i, a in enumerate(lengths) for b in lengths[i + 1 :]):
        return ""
    cells = [c for run in runs_cells for c in run]
    _, averages = tables_markdown(cells)
    columns = sorted({(k[0], k[2]) for k in averages}, key=lambda k: (k[0] is None, k[0], k[1]))
    fams = sorted({k[1] for k in averages}, key=_fam_key)
    md = [
        "## Summary: average over tasks (score x100), every run\n",
        "| arm | " + " | ".join(f"{_length_label(L)} b={b}" for L, b in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for f in fams:
        md.append(f"| {f} | " + " | ".join(_fmt(averages.get((L, f, b), (None,))[0]) for L, b in columns) + " |")
    md.append("")
    if plot_scores(cells, png, label):
        md.append(f"![score vs budget]({png.name})\n")
    return "\n".join(md)


def _length_label(length) -> str:
    return "" if length is None else f"{length // 1024}K" if length % 1024 == 0 else str(length)


def write_report(
    run_dirs: list[Path],
    out_dir: Path,
    title: str = "Locks sweep",
    name: str = "report",
    fidelity_dirs: list[Path] | None = None,
    notes: str | None = None,
    pool: bool = False,
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}\n"]
    if notes:
        parts.append(notes.strip() + "\n")
    run_cells = {run: load_cells(run) for run in run_dirs}
    first = read_json(run_dirs[0] / "config.json", fix=RUN_FIX) if run_dirs else {}
    label = f"{first.get('benchmark', {}).get('name', '')} {first.get('model', '')}".strip()
    parts.append(summary_markdown(list(run_cells.values()), out_dir / f"{name}.png", label))
    if pool:
        names = " + ".join(run.name for run in run_dirs)
        parts.append(f"## Pooled: {names}\n")
        parts.append(
            "The records of every run together (independent draws of one benchmark), for the arms every run has; "
            "each record keeps its run's prediction.\n"
        )
        parts.append(tables_markdown(load_pooled_cells(run_dirs))[0])
    for run in run_dirs:
        cfg = read_json(run / "config.json", fix=RUN_FIX)
        cells = run_cells[run]
        timing = (run / "timing.csv").read_text() if (run / "timing.csv").exists() else ""
        md, _ = tables_markdown(cells)
        bench = cfg.get("benchmark", {})
        parts.append(f"## {bench.get('name', 'benchmark')} - {cfg.get('model')} ({run.name})\n")
        parts.append(f"Protocol: {cfg.get('protocol_text', cfg.get('protocol'))}\n")
        parts.append("Benchmark: `" + json.dumps({k: v for k, v in bench.items() if k != "haystack"}) + "`\n")
        parts.append("Only records finished by every arm enter the tables (n = records per task).\n")
        png = plot_scores(cells, out_dir / f"{name}-{run.name}.png", f"{bench.get('name', '')} {cfg.get('model')}")
        if png:
            parts.append(f"![score vs budget]({png.name})\n")
        parts.append(md)
        parts.append(agreement_markdown(run))
        if timing:
            parts.append("Wall time per arm (sum over its generations, after the shared prefill):\n")
            lines = timing.strip().splitlines()
            parts.append("| " + " | ".join(lines[0].split(",")) + " |")
            parts.append("|" + "---|" * len(lines[0].split(",")))
            parts += ["| " + " | ".join(l.split(",")) + " |" for l in lines[1:]]
            parts.append("")
    for fd in fidelity_dirs or []:
        csv_path, raw_path = fd / "fidelity.csv", resolve(fd / "fidelity_raw.jsonl")
        if not csv_path.exists() or csv_path.stat().st_mtime < raw_path.stat().st_mtime:
            from .fidelity import summarize_fidelity

            summarize_fidelity(fd)  # a run in progress: summarise what is there
        with open(csv_path) as f:
            rows = list(csv.DictReader(f))
        parts.append(f"## Selection fidelity ({fd.name})\n")
        from .fidelity import raw_rows

        raw = raw_rows(raw_path)
        prompts = sorted({r["prompt"] for r in raw})
        parts.append(
            f"{len(prompts)} prompts ({', '.join(prompts)}), {len(raw)} (step, layer, arm) measurements; "
            "means over decode steps, layers (full-attention layers only) and KV heads.\n"
        )
        png = plot_fidelity(rows, out_dir / f"{name}-fidelity-{fd.name}.png")
        if png:
            parts.append(f"![fidelity]({png.name})\n")
        parts.append(fidelity_markdown(rows))
    path = out_dir / f"{name}.md"
    path.write_text("\n".join(parts) + "\n")
    return path
