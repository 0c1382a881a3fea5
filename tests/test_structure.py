"""The library's seams: the selector registry, one paged-layer base, the kernel backend, the query hook."""

import pytest
import torch
from conftest import tiny

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache
from locks_hf.attention import observe_decode_queries
from locks_hf.cache import LocksLayer
from locks_hf.eval.arms import parse_arms
from locks_hf.paged import PagedLayer
from locks_hf.selectors import (
    PageSelector,
    config_for_family,
    family_of,
    family_sort_key,
    make_selector,
    parse_family,
    register_selector,
    selector_class,
    selector_names,
    static_selector_names,
    summary_layout,
    unregister_selector,
)
from locks_hf.static_cache import LocksStaticLayer


# -- the selector registry -------------------------------------------------------------------------------
def test_registry_declares_the_builtin_selectors():
    baselines = ("kvzip", "lazy_eviction", "rkv", "rocketkv", "shadowkv", "triattention")
    assert selector_names() == (
        "locks",
        "locks_rerank",
        "oracle",
        "quest",
        "full",
        "shared_basis",
        "shared_all",
        *baselines,
    )
    assert static_selector_names() == ("locks", "locks_rerank", "oracle", "quest", "full")
    assert {n: selector_class(n).kernel_method for n in selector_names()} == {
        "locks": "locks",
        "locks_rerank": "locks",
        "oracle": "oracle",
        "quest": "quest",
        "full": "full",
        "shared_basis": None,
        "shared_all": None,
        **dict.fromkeys(baselines),
    }
    assert [n for n in selector_names() if selector_class(n).token_level] == list(baselines)
    assert make_selector(LocksConfig(selector="full")) is None
    assert make_selector(LocksConfig(selector="quest")).per_head
    with pytest.raises(LocksConfigError, match="selector must be one of"):
        selector_class("topk")


@pytest.mark.parametrize(
    "config",
    [
        LocksConfig(rank=8, basis_bits=4),
        LocksConfig(rank=4, basis_bits=2),
        LocksConfig(rank=16, basis_bits=16),
        LocksConfig(selector="oracle"),
        LocksConfig(selector="quest"),
        LocksConfig(selector="full"),
        LocksConfig(selector="shared_basis", rank=20),
        LocksConfig(selector="shared_all", rank=28, basis_bits=8),
    ],
)
def test_arm_labels_round_trip(config):
    """family_of and parse_family are inverse: the label rebuilds the same config."""
    family = family_of(config)
    cls, _ = parse_family(family)
    assert cls.name == config.selector
    assert config_for_family(family, budget=config.budget, page_size=config.page_size) == config
    assert config.label == (family if cls.dense else f"{family}-b{config.budget}")


def test_report_order_of_the_paper_families():
    order = [
        "full",
        "oracle",
        "locks-r16bf16",
        "locks-r8bf16",
        "locks-r8i4",
        "locks-r4i4",
        "locks-r2i4",
        "shared_basis-r36",
        "shared_basis-r20",
        "shared_all-r52",
        "shared_all-r28",
        "quest",
        "kvzip",
        "shadowkv",
        "rocketkv",
        "rkv",
        "triattention",
        "lazy_eviction",
        "lazy_eviction-a0.0005",
    ]
    assert sorted(reversed(order), key=family_sort_key) == order
    assert sorted(["zzz", "quest", "aaa"], key=family_sort_key) == ["quest", "aaa", "zzz"]


def test_summary_layout_follows_declared_fields():
    base = LocksConfig(selector="quest", rank=4)
    assert summary_layout(base) == summary_layout(base.replace(rank=8, budget=512))
    locks = LocksConfig(rank=4)
    assert summary_layout(locks) != summary_layout(locks.replace(rank=8))
    assert summary_layout(locks) == summary_layout(locks.replace(budget=512, group_combine="group_max"))


class _RecentFirst(PageSelector):
    """A toy selector, defined outside the package: scores pages by position (later = better)."""

    name = "test_recent_first"
    kernel_method = None

    def page_scores(self, summary, keys, valid, query, scale):
        b, h, G = query.shape[:3]
        P = valid.shape[2]
        return torch.arange(P, dtype=torch.float32).expand(b, h, G, P).clone()


@pytest.fixture
def recent_first():
    register_selector(_RecentFirst)
    yield _RecentFirst
    unregister_selector(_RecentFirst.name)


def test_a_new_selector_is_one_class(recent_first):
    """Registering a class is all it takes: config, arms, caches (dynamic and static) and decode."""
    cfg = LocksConfig(selector="test_recent_first", budget=32)
    assert cfg.label == "test_recent_first-b32"
    arms = parse_arms(["full", "test_recent_first"], [32])
    assert [a.name for a in arms] == ["full", "test_recent_first-b32"]
    model = tiny("llama")
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    for cache in (LocksCache(model.config, cfg), LocksStaticCache(model.config, max_cache_len=256, locks=cfg)):
        out = model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=cache)
        assert out.shape == (1, 203)
        layer = cache.locks_layers[0]
        P = layer.complete_pages().sum()
        chosen = layer.last_selection[0, 0].nonzero().flatten().tolist()
        # sink, the newest page, and the k - 2 = 0 latest complete pages before it
        assert chosen == [0, (ids.shape[1] + 1) // 16] and P > 2  # the last step wrote slot 201
    unregister_selector("test_recent_first")
    with pytest.raises(LocksConfigError):
        LocksConfig(selector="test_recent_first")


def test_register_refuses_a_taken_name():
    class Other(_RecentFirst):
        name = "quest"

    with pytest.raises(ValueError, match="already registered"):
        register_selector(Other)


# -- one paged-layer base ----------------------------------------------------------------------------------
def test_dynamic_and_static_layers_share_the_page_logic():
    """Same K/V with a left-padded row: both layers answer the page-access methods alike."""
    B = 8
    cfg = LocksConfig(page_size=B, budget=4 * B, rank=4)
    g = torch.Generator().manual_seed(3)
    T = 61
    keys = torch.randn(2, 2, T, 16, generator=g, dtype=torch.float64)
    values = torch.randn(2, 2, T, 16, generator=g, dtype=torch.float64)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, :11] = False  # row 1: 11 padding slots
    mask = torch.zeros(2, 1, T, T, dtype=torch.float64)
    mask[1, :, :, :11] = torch.finfo(torch.float64).min
    dyn, sta = LocksLayer(cfg), LocksStaticLayer(T + 3 * B, cfg)
    for layer in (dyn, sta):
        assert isinstance(layer, PagedLayer)
        layer.update(keys, values)
        layer.prepare(mask, T)
    P = dyn.num_pages
    assert sta.num_pages >= P
    assert torch.equal(dyn.row_tensors()[0], sta.row_tensors()[0])
    assert torch.equal(dyn.row_tensors()[1], sta.row_tensors()[1])
    assert torch.equal(dyn.page_validity(), sta.page_validity()[:, :, :P])
    assert not sta.page_validity()[:, :, P:].any()
    assert torch.equal(dyn.complete_pages(), sta.complete_pages()[:, :P])
    pages = torch.tensor([[[0, 3, 6]] * 2, [[1, 2, 5]] * 2])  # written pages only (the rest is garbage)
    for values_too in (False, True):
        assert torch.equal(dyn.page_keys(pages, values_too), sta.page_keys(pages, values_too))
    assert torch.equal(dyn.page_validity_of(pages), sta.page_validity_of(pages))
    real = dyn.page_validity().unsqueeze(-1)  # [b, 1, P, B, 1]
    assert torch.equal(torch.where(real, dyn.all_page_keys(), 0), torch.where(real, sta.all_page_keys()[:, :, :P], 0))
    # row 1's pages start at its first real token: its page 1 holds slots 11 + B ...
    assert torch.equal(dyn.page_keys(pages)[1, :, 0], keys[1, :, 11 + B : 11 + 2 * B])
    n = dyn.n_summarized[1]
    for name, t in sta.summary.items():
        assert torch.equal(t[:, :, :n], dyn.summary[name][:, :, :n]), name


# -- the backend seam ---------------------------------------------------------------------------------------
def test_kernels_report_what_they_implement():
    kernels = pytest.importorskip("locks_hf.kernels")
    if not kernels.HAVE_TRITON:
        pytest.skip("no triton")
    ok = dict(dtype=torch.bfloat16, head_dim=64, page_size=16)
    assert kernels.implements("locks", **ok) and kernels.implements(
        "quest", per_head=True, group_combine="group_max", **ok
    )
    assert not kernels.implements("locks", group_combine="group_max", **ok)
    assert not kernels.implements("quest", group_combine="group_max", **ok)  # a shared selection: share_average only
    assert kernels.implements("full", **ok) and not kernels.implements(
        "full", dtype=torch.int8, head_dim=64, page_size=16
    )
    assert not kernels.implements("locks", basis_bits=16, **ok)
    assert not kernels.implements("locks", coef_bits=16, **ok)
    assert not kernels.implements("oracle", dtype=torch.bfloat16, head_dim=48, page_size=16)
    assert not kernels.implements("oracle", dtype=torch.bfloat16, head_dim=64, page_size=64)
    assert not kernels.implements("shared_basis", **ok)


def test_cpu_layers_stay_on_the_reference_path():
    from locks_hf.backends import REFERENCE, TOKEN_POLICY

    layer = LocksLayer(LocksConfig())
    layer.update(torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64))
    assert layer.backend is REFERENCE
    assert LocksLayer(LocksConfig(selector="rkv", budget=64)).backend is TOKEN_POLICY


def test_the_backend_is_chosen_once_per_allocation(monkeypatch):
    """A decode step reads ``layer.backend``; the rule runs when buffers or settings change, never per step."""
    import locks_hf.paged
    from locks_hf.backends import REFERENCE

    calls = []
    real = locks_hf.paged.choose_backend
    monkeypatch.setattr(locks_hf.paged, "choose_backend", lambda layer: calls.append(layer) or real(layer))
    model = tiny("llama")
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    cache = LocksCache(model.config, LocksConfig(budget=32))
    out = model(ids, past_key_values=cache)
    chosen = len(calls)
    for _ in range(3):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    assert len(calls) == chosen and all(layer.backend is REFERENCE for layer in cache.locks_layers)


# -- the decode-query hook ------------------------------------------------------------------------------------
def test_observe_decode_queries_sees_every_locks_decode_step():
    model = tiny("llama")
    ids = torch.randint(3, 256, (1, 70), generator=torch.Generator().manual_seed(1))
    cache = LocksCache(model.config, LocksConfig(selector="full"))
    out = model(ids, past_key_values=cache)
    seen = []
    with observe_decode_queries(lambda *args: seen.append(args)):
        model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    model(out.logits[:, -1:].argmax(-1), past_key_values=cache)  # outside the block: not seen
    n_layers = len(cache.locks_layers)
    assert [s[0] for s in seen] == list(range(n_layers))
    for _layer_idx, length, query, scale in seen:
        assert length == 71 and query.shape == (1, model.config.num_attention_heads, 1, 16)
        assert scale == pytest.approx(16**-0.5)


# -- the import graph -------------------------------------------------------------------------------------------
def _import_graph() -> dict[str, set[str]]:
    """``locks_hf``'s modules -> the modules they import (top-level and in functions; imports under
    ``if TYPE_CHECKING`` are not run and left out)."""
    import ast
    import os
    from pathlib import Path

    import locks_hf
    import locks_hf.eval
    import locks_hf.kernels

    # kernels/ and eval/ are subpackages by pyproject's package-dir (links under locks_hf/ in some
    # development trees): each package is read where the import system finds it.
    packages = {p.__name__: Path(p.__file__).parent for p in (locks_hf, locks_hf.kernels, locks_hf.eval)}
    files = {}
    for package, root in packages.items():
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if f"{package}.{d}" not in packages]
            for name in names:
                if name.endswith(".py"):
                    path = Path(folder) / name
                    parts = [*package.split("."), *path.relative_to(root).with_suffix("").parts]
                    files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
            for stmt in block.body
            for node in ast.walk(stmt)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names if alias.name in files)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                    target = f"{base}.{node.module}" if node.module else base
                else:
                    target = node.module
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if sub in files else target)
        graph[module] = {d for d in deps if d in files and d != module}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    graph = _import_graph()
    assert "locks_hf.backends.choice" in graph and "locks_hf.selectors.registry" in graph
    cycles = _cycles(graph)
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_backends_read_layers_through_public_accessors():
    """No backend module reads a layer's private fields (``layer._...``)."""
    import ast
    from pathlib import Path

    import locks_hf.backends

    for path in Path(locks_hf.backends.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "layer":
                assert not node.attr.startswith("_"), f"{path.name}:{node.lineno} reads layer.{node.attr}"
