"""The decode-step benchmark runs end to end on the CPU (tiny model): a smoke test that keeps the
script in step with the caches it drives (its GPU figures are in the README)."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_decode_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_step_runs_on_cpu(tmp_path):
    out = tmp_path / "step.json"
    _load().main(["--shape", "tiny", "--device", "cpu", "--contexts", "512", "--budget", "64",
                  "--arms", "full,r4i4,quest", "--steps", "2", "--warmup", "1", "--out", str(out)])
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "r4i4", "quest"}
    assert rows["full"]["attended"] == 1.0
    assert 0.0 < rows["r4i4"]["attended"] < 0.5  # b = 64 of 512 tokens: the step was sparse
    assert all(r["median_ms"] > 0 and len(r["all_ms"]) == 2 for r in rows.values())
