"""Sweep arms decoded by transformers' own QuantizedCache (`locks_hf.eval.hf_quantized`)."""

from __future__ import annotations

import json

import pytest
import torch

from locks_hf.eval.arms import parse_arms
from locks_hf.eval.hf_quantized import HFQuantized, parse_hf_quantized


@pytest.mark.parametrize(
    "label, expected",
    [
        ("hf-quanto4", HFQuantized("quanto", 4, 32, 128)),
        ("hf-quanto2g64", HFQuantized("quanto", 2, 64, 128)),
        ("hf-hqq4r256", HFQuantized("hqq", 4, 32, 256)),
        ("hf-quanto4g128r64", HFQuantized("quanto", 4, 128, 64)),
    ],
)
def test_labels_parse_and_print_back(label, expected):
    assert parse_hf_quantized(label) == expected
    assert expected.label == label
    assert parse_hf_quantized("locks-r8i4+kv4-post") is None


@pytest.mark.parametrize(
    "label, message",
    [
        ("hf-quanto3", "takes bits (2, 4)"),
        ("hf-quanto", "hf-<quanto|hqq><bits>"),
        ("hf-kivi4", "hf-<quanto|hqq><bits>"),
        ("hf-quanto4g0", "must be positive"),
    ],
)
def test_bad_labels_say_what_is_accepted(label, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")):
        parse_arms([label], [64])


def test_arms_are_dense_once_and_refused_by_the_static_engine_and_fidelity():
    from locks_hf.eval.engine import check_arms
    from locks_hf.eval.fidelity import run_fidelity

    arms = parse_arms(["full", "hf-quanto4", "hf-quanto2"], [64, 128])
    assert [a.name for a in arms] == ["full", "hf-quanto4", "hf-quanto2"]
    assert arms[1].budget is None and arms[1].config.selector == "full" and arms[1].hf_cache.bits == 4
    with pytest.raises(ValueError, match=r"\['hf-quanto4', 'hf-quanto2'\] decode with transformers' QuantizedCache"):
        check_arms(arms)
    with pytest.raises(ValueError, match=r"arms \['hf-quanto4', 'hf-quanto2'\] quantize their K/V"):
        run_fidelity(None, [], arms, "/nonexistent/out")


def test_sweep_decodes_as_transformers_quantized_cache(tmp_path):
    """An ``hf-quanto4`` arm in a sweep gives the tokens of transformers' QuantizedCache run by hand on the
    same record: the prompt prefilled into the cache, the shared first token, then greedy steps."""
    pytest.importorskip("optimum.quanto")
    from transformers import QuantizedCache

    from locks_hf.eval.benchmarks import RulerBenchmark
    from locks_hf.eval.merge import merge
    from locks_hf.eval.plan import eos_ids
    from locks_hf.eval.runner import SweepRunner
    from locks_hf.eval.stopping import cut_at_stop
    from locks_hf.eval.testing import ByteTokenizer
    from locks_hf.models import tiny_model

    tok = ByteTokenizer()
    model = tiny_model("llama", vocab_size=256, max_position_embeddings=4096, head_dim=32)
    arms = parse_arms(["full", "hf-quanto4", "hf-quanto2"], [64])
    bench = RulerBenchmark(tok, ["niah_single_1"], [1024], num_samples=1)
    out = tmp_path / "hf"
    runner = SweepRunner(model, tok, bench, arms, out, model_name="tiny", progress=False, max_new_tokens=6, limit=1)
    runner.run()
    merge(out)
    rows = {r["arm"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {"full", "hf-quanto4", "hf-quanto2"}
    config = json.loads((out / "config.json").read_text())
    assert {a["name"]: a.get("hf_cache") for a in config["arms"]}["hf-quanto2"] == {
        "backend": "quanto",
        "bits": 2,
        "group": 32,
        "residual": 128,
    }

    rec = bench.records()[0]
    plan = runner.plan(rec)
    with torch.no_grad():
        first = model(plan.ids[:, : plan.split], logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
        for name, bits in (("hf-quanto4", 4), ("hf-quanto2", 2)):
            row = rows[name]
            assert row["attended_fraction"] is None and row["read_bytes"] is None
            cache = QuantizedCache(backend="quanto", config=model.config, nbits=bits, q_group_size=32)
            model(plan.ids[:, : plan.split], past_key_values=cache)
            new, token = [first.item()], first
            for _ in range(row["new_tokens"] - 1):
                token = model(token, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
                new.append(token.item())
            while new and new[-1] in eos_ids(model, tok):
                new.pop()
            assert cut_at_stop(tok.decode(new, skip_special_tokens=True), plan.stop) == row["pred"]


def test_a_model_with_sliding_layers_is_refused_before_anything_runs(tmp_path):
    from locks_hf.eval.benchmarks import RulerBenchmark
    from locks_hf.eval.runner import SweepRunner
    from locks_hf.eval.testing import ByteTokenizer
    from locks_hf.models import tiny_model

    tok = ByteTokenizer()
    model = tiny_model("gemma3", vocab_size=256, max_position_embeddings=4096, head_dim=32)
    bench = RulerBenchmark(tok, ["niah_single_1"], [1024], num_samples=1)
    with pytest.raises(ValueError, match=r"'hf-quanto4'.*only models whose layers are all full attention"):
        SweepRunner(model, tok, bench, parse_arms(["full", "hf-quanto4"], [64]), tmp_path / "x", progress=False)
    assert not (tmp_path / "x").exists()
