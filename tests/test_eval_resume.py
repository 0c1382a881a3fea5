"""Resume and merge read what a killed sweep left behind (a torn last line of a predictions file is
dropped, and cut off before the file is appended to again); anything else that does not parse, and
foreign rows, are named by file:line, never skipped nor a KeyError."""

import json

import pytest

from locks_hf.eval.jsonl import InputFileError, end_last_line, read_jsonl
from locks_hf.eval.merge import merge

ROW = {
    "id": "vt-4096-0",
    "task": "vt",
    "length": 4096,
    "arm": "full",
    "family": "full",
    "budget": None,
    "selector": "full",
    "sample": 0,
    "pred": "",
    "score": 1.0,
}


def _row(**changes):
    return json.dumps({**ROW, **changes}, ensure_ascii=False) + "\n"


def test_a_last_line_torn_inside_a_multibyte_character_is_dropped_and_cut_off_before_appending(tmp_path, caplog):
    path = tmp_path / "predictions" / "shard-0-of-1.jsonl"
    path.parent.mkdir()
    torn = _row(id="vt-4096-1", pred="Zürich ünd «Ωμέγα»").encode()
    cut = torn.index("Ω".encode()) + 1  # inside the two bytes of Ω
    path.write_bytes(_row(pred="naïve").encode() + _row(id="vt-4096-2").encode() + torn[:cut])
    assert [r["id"] for r in read_jsonl(path, appended=True)] == ["vt-4096-0", "vt-4096-2"]
    assert "shard-0-of-1.jsonl:3: dropped a line torn" in caplog.text
    assert merge(tmp_path)["rows"] == 2
    assert json.loads((tmp_path / "results.jsonl").read_text().splitlines()[0])["pred"] == "naïve"
    end_last_line(path)  # what resume does before appending: the torn line is gone, the rest kept
    assert path.read_bytes() == _row(pred="naïve").encode() + _row(id="vt-4096-2").encode()


def test_a_whole_last_row_without_its_newline_is_kept_and_ended(tmp_path):
    path = tmp_path / "shard-0-of-1.jsonl"
    path.write_text(_row() + _row(id="vt-4096-1").rstrip("\n"))
    assert len(read_jsonl(path, appended=True)) == 2  # counted done on resume ...
    end_last_line(path)
    assert path.read_text() == _row() + _row(id="vt-4096-1")  # ... so it must stay


@pytest.mark.parametrize("middle", [b'{"id": "vt-4096-1", "ta', b'{"id": "\xff"}'])
def test_a_torn_line_before_the_last_is_an_error_naming_it(tmp_path, middle):
    path = tmp_path / "predictions" / "shard-0-of-1.jsonl"
    path.parent.mkdir()
    path.write_bytes(_row().encode() + middle + b"\n" + _row(id="vt-4096-2").encode())
    with pytest.raises(InputFileError, match=r"shard-0-of-1.jsonl:2: not (valid JSON|UTF-8).*remove that line"):
        merge(tmp_path)


@pytest.mark.parametrize("line", ['{"task": "vt", "arm": "full"}', "[1, 2]", '"text"'])
def test_a_complete_row_without_an_id_is_named(tmp_path, line):
    path = tmp_path / "predictions" / "shard-0-of-1.jsonl"
    path.parent.mkdir()
    path.write_text(_row() + line + "\n")
    with pytest.raises(
        InputFileError, match=r"shard-0-of-1.jsonl:2: (a row without \['id'|a (list|str), not an object)"
    ):
        merge(tmp_path)
