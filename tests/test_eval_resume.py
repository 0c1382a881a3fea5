"""Resume and merge read what a killed sweep left behind; foreign rows are named, never a KeyError."""

import json

import pytest

from locks_hf.eval.runner import _jsonl, merge

ROW = {"id": "vt-4096-0", "task": "vt", "length": 4096, "arm": "full", "family": "full", "budget": None,
       "selector": "full", "sample": 0, "pred": "", "score": 1.0}


def _row(**changes):
    return json.dumps({**ROW, **changes}, ensure_ascii=False) + "\n"


def test_a_line_torn_inside_a_multibyte_character_is_skipped(tmp_path):
    path = tmp_path / "predictions" / "shard-0-of-1.jsonl"
    path.parent.mkdir()
    torn = _row(id="vt-4096-1", pred="Zürich ünd «Ωμέγα»").encode()
    cut = torn.index("Ω".encode()) + 1  # inside the two bytes of Ω
    path.write_bytes(_row(pred="naïve").encode() + torn[:cut] + b"\n" + _row(id="vt-4096-2").encode() + torn[:cut])
    assert [r["id"] for r in _jsonl(path)] == ["vt-4096-0", "vt-4096-2"]
    assert merge(tmp_path)["rows"] == 2
    assert json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])["pred"] == "naïve"


@pytest.mark.parametrize("line", ['{"task": "vt", "arm": "full"}', "[1, 2]", '"text"'])
def test_a_complete_row_without_an_id_is_named(tmp_path, line):
    path = tmp_path / "predictions" / "shard-0-of-1.jsonl"
    path.parent.mkdir()
    path.write_text(_row() + line + "\n")
    with pytest.raises(ValueError, match=r"shard-0-of-1.jsonl:2: a row without \['id'"):
        merge(tmp_path)
