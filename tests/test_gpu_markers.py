"""Every test that needs CUDA is in the GPU suite (marked ``gpu``, which conftest skips without CUDA):
`pytest -m gpu` selects them all, and none hides behind a CUDA check of its own."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What, in a test's decorators, body or its module's ``pytestmark``, says that it needs CUDA.
NEEDS_CUDA = re.compile(
    r"skipif\(\s*not\s+torch\.cuda\.is_available\(\)"  # skipped without CUDA
    r"|skipif\([^)]*DEV\s*!=\s*[\"']cuda[\"']"  # ... or without compiled kernels
    r"|\.to\([\"']cuda[\"']\)|\.cuda\(\)|device=[\"']cuda[\"']"
)  # puts tensors on it

PLUGIN = """
import json, os

def pytest_collection_finish(session):
    rows = [{"nodeid": i.nodeid, "file": str(i.path), "name": i.originalname,
             "gpu": i.get_closest_marker("gpu") is not None} for i in session.items]
    with open(os.environ["GPU_MARKERS_OUT"], "w") as f:
        json.dump(rows, f)
"""


def _collect(tmp_path) -> list[dict]:
    (tmp_path / "gpu_markers_plugin.py").write_text(PLUGIN)
    out = tmp_path / "items.json"
    env = {
        **os.environ,
        "GPU_MARKERS_OUT": str(out),
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "gpu_markers_plugin",
            "tests",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text())


def _sources(path: Path) -> tuple[dict[str, str], str]:
    """Each test function's decorators and body (by name, classes included) and the module's ``pytestmark``."""
    text = path.read_text()
    tree = ast.parse(text)
    functions, mark = {}, ""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            parts = [ast.get_source_segment(text, d) or "" for d in node.decorator_list]
            functions[node.name] = "\n".join(parts + [ast.get_source_segment(text, node) or ""])
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            mark = ast.get_source_segment(text, node) or ""
    return functions, mark


def test_tests_that_need_cuda_are_gpu_marked(tmp_path):
    items = _collect(tmp_path)
    sources: dict[str, tuple[dict[str, str], str]] = {}
    unmarked = []
    for item in items:
        if item["gpu"] or Path(item["file"]).name == Path(__file__).name:  # this file names the patterns
            continue
        if item["file"] not in sources:
            sources[item["file"]] = _sources(Path(item["file"]))
        functions, mark = sources[item["file"]]
        if NEEDS_CUDA.search(functions.get(item["name"], "") + "\n" + mark):
            unmarked.append(item["nodeid"])
    assert not unmarked, (
        f"tests that need CUDA without @pytest.mark.gpu (conftest skips those without CUDA): {unmarked}"
    )
    gpu = {item["nodeid"].split("[")[0] for item in items if item["gpu"]}
    # the GPU suite: tests that need CUDA, and the kernel test files (compiled there)
    assert "tests/test_layout.py::test_one_liner_compiles_once_across_budgets_on_cuda" in gpu
    assert "tests/test_sweep_engine.py::test_cuda_graph_and_compiled_steps_equal_the_eager_step_on_cuda" in gpu
    assert any(n.startswith("tests/test_kernels.py::") for n in gpu)
    assert any(n.startswith("tests/test_kernels_real_shapes.py::") for n in gpu)


def test_the_pattern_sees_cuda_checks():
    assert NEEDS_CUDA.search('@pytest.mark.skipif(not torch.cuda.is_available(), reason="x")')
    assert NEEDS_CUDA.search('@pytest.mark.skipif(DEV != "cuda", reason="x")')
    assert NEEDS_CUDA.search('model = tiny_model("llama").to("cuda")')
    assert not NEEDS_CUDA.search('@pytest.mark.skipif(torch.cuda.is_available(), reason="runs without CUDA")')
