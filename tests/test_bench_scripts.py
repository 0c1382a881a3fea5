"""The decode-step benchmark runs end to end on the CPU (tiny model): a smoke test that keeps the
script in step with the caches it drives (its GPU figures are in the README)."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_decode_step.py"


def _load(name: str = "bench_decode_step"):
    import sys

    sys.path.insert(0, str(SCRIPT.parent))  # the scripts import each other, as when run from scripts/
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return module


def test_bench_decode_step_runs_on_cpu(tmp_path):
    out = tmp_path / "step.json"
    _load().main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--contexts",
            "512",
            "--budget",
            "64",
            "--arms",
            "full,r4i4,quest,r4i4+kv4-post",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "r4i4", "quest", "r4i4+kv4-post"}
    assert rows["full"]["attended"] == 1.0
    assert 0.0 < rows["r4i4"]["attended"] < 0.5  # b = 64 of 512 tokens: the step was sparse
    assert all(r["median_ms"] > 0 and len(r["all_ms"]) == 2 for r in rows.values())
    assert all(r["mean_ms"] == pytest.approx(sum(r["all_ms"]) / 2) for r in rows.values())
    # 4-bit KV: the attended K/V read at their packed size (codes, scales and zero points: 5/16 of bf16)
    kv = rows["r4i4+kv4-post"]["read_bytes"] - rows["r4i4"]["read_bytes"]
    assert kv < 0


def test_the_glm_shapes_are_transformers_glm(tmp_path):
    """``glm4-9b-hf`` is transformers' GlmForCausalLM at GLM-4-9B's size (fused gate/up, q/k/v biases, RoPE on
    half of each head); its small twin runs a dense and a sparse step on the CPU."""
    module = _load()
    config = module.model_config("glm4-9b-hf")
    assert config.model_type == "glm" and config.attention_bias
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 13696, 40)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 2, 128)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    model = module.random_model("tiny-glm", __import__("torch").device("cpu"))
    layer = model.model.layers[0]
    assert type(model).__name__ == "GlmForCausalLM" and hasattr(layer.mlp, "gate_up_proj")
    assert layer.self_attn.q_proj.bias is not None
    out = tmp_path / "glm.json"
    module.main(
        ["--shape", "tiny-glm", "--device", "cpu", "--contexts", "512", "--budget", "64", "--arms", "full,r4i4"]
        + ["--steps", "2", "--warmup", "1", "--out", str(out)]
    )
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["full"]["attended"] == 1.0 and 0.0 < rows["r4i4"]["attended"] < 0.5


def test_the_fused_glm_shape_has_four_projections_a_layer(tmp_path):
    """``glm4-9b-fused`` is GLM-4-9B's own layout (q/k/v in one projection, gate and up in one, RoPE on half of
    each head) at its size; its small twin runs a dense, a sparse and an attention-free step on the CPU."""
    module = _load()
    config = module.model_config("glm4-9b-fused")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 13696, 40)
    # (the prefill reads config.head_dim, which Phi3Config does not set by itself)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 2, 128)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    torch = __import__("torch")
    model = module.random_model("tiny-fused", torch.device("cpu"))
    layer = model.model.layers[0]
    linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 and hasattr(layer.self_attn, "qkv_proj") and hasattr(layer.mlp, "gate_up_proj")
    out = tmp_path / "fused.json"
    module.main(
        ["--shape", "tiny-fused", "--device", "cpu", "--contexts", "512", "--budget", "64"]
        + ["--arms", "full,r4i4,no-attention", "--steps", "2", "--warmup", "1", "--out", str(out)]
    )
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["full"]["attended"] == 1.0 and 0.0 < rows["r4i4"]["attended"] < 0.5
    assert rows["no-attention"]["attended"] == 0.0


def _no_attention_and_full(module, tmp_path, *, graphs: str, context: str, steps: str) -> dict:
    """The rows, by arm, of ``no-attention`` and ``full`` steps of the tiny model on the CPU."""
    out = tmp_path / f"na_{graphs}.json"
    module.main(
        ["--shape", "tiny", "--device", "cpu", "--contexts", context, "--budget", "64", "--graphs", graphs]
        + ["--arms", "no-attention,full", "--steps", steps, "--warmup", "1", "--out", str(out)]
    )
    return {r["arm"]: r for r in json.loads(out.read_text())["rows"]}


def test_the_no_attention_arm_skips_attention_only(tmp_path):
    """``no-attention``: the step without reading K/V (every attention's output is its query), faster than dense
    on the same model, and the next arm has its attention back."""
    module = _load()
    rows = _no_attention_and_full(module, tmp_path, graphs="none", context="2048", steps="3")
    assert rows["no-attention"]["read_bytes"] == 0 and rows["no-attention"]["attended"] == 0.0
    assert rows["full"]["attended"] == 1.0 and rows["full"]["read_bytes"] > 0
    torch = __import__("torch")
    q = torch.randn(1, 4, 3, 32)
    out, weights = module.skip_attention(None, q, None, None, None)
    # the query itself (not zeros a compiler could see through): its projection and RoPE stay in the step
    assert weights is None and out.shape == (1, 3, 4, 32) and torch.equal(out, q.transpose(1, 2))
    model = module.random_model("tiny", __import__("torch").device("cpu"))
    embed = model.model.embed_tokens.weight  # one row of it is read; the LM head (a weight of its own) in full
    assert model.lm_head.weight is not embed
    assert module.weight_read_bytes(model) == sum(p.numel() * 4 for p in model.parameters()) - embed.numel() * 4


def test_the_compiled_no_attention_step_keeps_every_projection(tmp_path):
    """Compiled by inductor, the ``no-attention`` step runs as many matrix products as the dense one: seven a
    layer (q, k, v, o, gate, up, down) and the LM head. Zeros made from the query's shape alone (the arm's first
    form) let inductor drop ``q_proj``: 13 instead of 15 for 2 layers on the CPU; ``query * 0`` (its second) let
    the CUDA build drop it (242 instead of 282 for GLM-4-9B). The count is read from inductor's generated code and
    reported in each compiled row."""
    module = _load()
    rows = _no_attention_and_full(module, tmp_path, graphs="compile", context="512", steps="1")
    layers = rows["full"]["layers"]
    assert rows["no-attention"]["matrix_products"] == rows["full"]["matrix_products"] == 7 * layers + 1
    assert module.matrix_products(["extern_kernels.mm(a, b, out=c)", "extern_kernels.addmm(x, a, b)"]) == 2
    assert module.lost_products(list(rows.values())) == []


def test_a_no_attention_row_with_fewer_products_than_dense_is_flagged():
    """What a CUDA build did to the arm's previous form (``query * 0``): 242 products against dense's 282."""
    lost_products = _load().lost_products
    rows = [
        {"context": 512, "arm": "full", "matrix_products": 282},
        {"context": 512, "arm": "no-attention", "matrix_products": 242},
        {"context": 1024, "arm": "no-attention", "matrix_products": 10},  # no dense row of its context
        {"context": 512, "arm": "r4i4", "matrix_products": 200},  # only the no-attention arm is checked
    ]
    assert lost_products(rows) == [rows[1]] and rows[1]["lost_products"] == 40
    assert lost_products([{"context": 512, "arm": "no-attention", "matrix_products": None}, rows[0]]) == []


def test_profile_groups_kernels_by_who_wrote_them():
    """`--profile` sums a step's kernels by group: the library's, inductor's, the vendor's matrix products."""
    group = _load().kernel_group
    assert group("_locks_mma_kernel") == group("_select_kernel") == "library"
    assert group("triton_poi_fused__to_copy_add_mul_0") == group("triton_red_fused_mean_1") == "inductor"
    assert group("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT") == "matrix products"
    assert group("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "matrix products"
    assert group("void at::native::vectorized_elementwise_kernel<4>") == "other"


def test_inductor_options_are_for_the_inductor_step_only():
    with pytest.raises(SystemExit, match="--graphs compile-cuda"):
        _load().main(["--shape", "tiny", "--device", "cpu", "--inductor-options", '{"max_autotune": true}'])


def test_isolate_runs_each_arm_in_a_process_of_its_own(tmp_path):
    """``--isolate``: one child process per arm, rows gathered in the order one process gives."""
    import os

    out = tmp_path / "step.json"
    common = ["--shape", "tiny", "--device", "cpu", "--contexts", "512,1K", "--budget", "64"]
    common += ["--arms", "full,r4i4", "--steps", "2", "--warmup", "1"]
    _load().main([*common, "--isolate", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["isolated"] and [(r["context"], r["arm"]) for r in rows] == [
        (512, "full"),
        (512, "r4i4"),
        (1024, "full"),
        (1024, "r4i4"),
    ]
    pids = {r["arm"]: r["pid"] for r in rows}
    assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()
    assert all(r["pid"] == pids[r["arm"]] for r in rows)  # an arm's contexts share its process
    _load().main([*common, "--out", str(tmp_path / "one.json")])  # without: the same rows, one process
    same = json.loads((tmp_path / "one.json").read_text())["rows"]
    assert [(r["context"], r["arm"], r["attended"]) for r in same] == [
        (r["context"], r["arm"], r["attended"]) for r in rows
    ]
    assert {r["pid"] for r in same} == {os.getpid()}


def test_host_profile_times_the_timed_path_and_rewinds(capsys):
    """``--host-profile``: cProfile over the steps the timer runs, the static cache rewound after each."""
    import torch

    bench = _load()

    class Layer:
        cumulative_length = torch.tensor([100])

    class FakeStepper:
        model = type("Model", (), {"device": torch.device("cpu")})()
        cache = type("Cache", (), {"layers": [Layer()]})()
        calls = 0

        def step(self):
            type(self).calls += 1
            Layer.cumulative_length += 1
            return sum(range(20_000))  # host work the profile must attribute to this method

    stepper = FakeStepper()
    rows = bench.host_profile(stepper, 3)
    assert stepper.calls == 3 and int(Layer.cumulative_length) == 100
    step = next(r for r in rows if r["function"].startswith("step (test_bench_scripts.py"))
    assert step["calls_per_step"] == 1 and step["own_ms_per_step"] > 0
    assert "host profile" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--host-profile needs --graphs"):
        bench.main(["--device", "cpu", "--shape", "tiny", "--host-profile", "2"])


def test_bench_throughput_runs_on_cpu(tmp_path):
    """scripts/bench_throughput.py: the synthetic fill, the batch, the step and the table (tiny model, CPU)."""
    out = tmp_path / "throughput.json"
    _load("bench_throughput").main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--contexts",
            "512",
            "--budget",
            "64",
            "--arms",
            "full,r4i4,r4i4+kv4-post",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--max-batch",
            "2",
            "--out",
            str(out),
        ]
    )
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"full", "r4i4", "r4i4+kv4-post"}
    assert all(r["batch"] == 2 and r["tokens_per_s"] > 0 and len(r["all_ms"]) == 2 for r in rows.values())
    assert rows["full"]["attended"] == 1.0 and 0 < rows["r4i4+kv4-post"]["attended"] < 0.5
    bench = _load("bench_throughput")  # each arm against dense bf16 and against dense on its own K/V storage
    assert bench.dense_twin("r4i4+kv4-post") == "full+kv4-post" and bench.dense_twin("r8i4") == "full"
    table = [
        dict(context=512, arm="full+kv4-post", tokens_per_s=10.0),
        dict(context=512, arm="r4i4+kv4-post", tokens_per_s=51.3),
    ]
    assert bench.throughput_ratio(table, table[1], "full+kv4-post") == "5.13x"
    assert bench.throughput_ratio(table, table[1], "full") == "-"


def test_gemv_floor_lays_out_the_same_weights_three_ways(tmp_path):
    """scripts/dev/gemv_floor.py (docs/performance.md): seven, six and four projections a layer of the same
    weights (the biased layouts' biases aside), run on the CPU (its timings need a GPU)."""
    spec = importlib.util.spec_from_file_location("gemv_floor", SCRIPT.parent / "dev" / "gemv_floor.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gemv.json"
    rows = module.main(["--device", "cpu", "--shape", "tiny", "--out", str(out)])
    by = {r["layout"]: r for r in rows}
    assert [by[k]["projections_per_layer"] for k in ("llama-block", "glm-hf", "fused")] == [7, 6, 4]
    tiny = module.model_config("tiny")
    biases = tiny.num_hidden_layers * (tiny.num_attention_heads + 2 * tiny.num_key_value_heads) * tiny.head_dim * 4
    assert by["glm-hf"]["weight_bytes"] == by["fused"]["weight_bytes"] == by["llama-block"]["weight_bytes"] + biases
    assert json.loads(out.read_text())["rows"] == rows


def test_bench_gemv_checks_every_tile_against_float64(tmp_path):
    """scripts/dev/bench_gemv.py on the CPU (interpreter; its timings need a GPU): every projection of the layout
    and the LM head, each tile's output as close to the float64 product as ``F.linear``'s."""
    spec = importlib.util.spec_from_file_location("bench_gemv", SCRIPT.parent / "dev" / "bench_gemv.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "gemv.json"
    rows = module.main(["--device", "cpu", "--shape", "tiny", "--tiles", "4:32:4:1,1:64:2:1", "--out", str(out)])
    assert [r["projection"] for r in rows] == ["qkv", "o", "gate_up", "down", "head"]
    assert all(len(r["tiles"]) == 2 for r in rows)
    assert all(e["err"] <= 10 * r["cublas_err"] + 1e-5 for r in rows for e in r["tiles"])
    saved = json.loads(out.read_text())["rows"]  # (no timings off the GPU: NaN floors, which compare unequal)
    assert [(r["projection"], r["tiles"]) for r in saved] == [(r["projection"], r["tiles"]) for r in rows]


def test_bench_unpack_checks_the_codes_and_times_both_forms(tmp_path):
    """scripts/dev/bench_unpack.py: both shapes at 4 and 2 bits, each form timed, the rows in its JSON."""
    spec = importlib.util.spec_from_file_location("bench_unpack", SCRIPT.parent / "dev" / "bench_unpack.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "unpack.json"
    rows = module.main(["--repeat", "1", "--out", str(out)])
    assert [(r["packed"], r["bits"]) for r in rows] == [(n, b) for n in module.SHAPES for b in (4, 2)]
    assert all(r["unpack_us"] > 0 and r["stacked_us"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows


def test_bench_quantized_cache_runs_on_cpu(tmp_path, capsys):
    """scripts/bench_quantized_cache.py: transformers' QuantizedCache beside Locks on quantized KV, one table."""
    pytest.importorskip("optimum.quanto")
    out = tmp_path / "qc.json"
    args = ["--shape", "tiny", "--device", "cpu", "--contexts", "512", "--budget", "64", "--steps", "2"]
    _load("bench_quantized_cache").main([*args, "--warmup", "1", "--out", str(out)])
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"dense", "hf-quanto4", "full+kv4", "r4i4+kv4-post"}
    assert all(len(r["all_ms"]) == 2 and r["ms_per_step"] > 0 for r in rows.values())
    assert "| 512 | hf-quanto4 |" in capsys.readouterr().out


def test_bench_generate_runs_on_cpu(tmp_path):
    """scripts/bench_generate.py: every kind of arm through a real generate() (tiny model, CPU)."""
    out = tmp_path / "generate.json"
    _load("bench_generate").main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--runs",
            "400:1,300:2",
            "--budget",
            "64",
            "--new-tokens",
            "6",
            "--arms",
            "hf-dynamic,hf-static,r4i4,static-r4i4,captured-r4i4",
            "--host-profile",
            "5",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["context"], r["batch"], r["arm"]) for r in rows] == [
        (n, b, a)
        for n, b in ((400, 1), (300, 2))
        for a in ("hf-dynamic", "hf-static", "r4i4", "static-r4i4", "captured-r4i4")
    ]
    for r in rows:
        assert r["ms_per_step"] > 0 and len(r["step_ms"]) == 5 and len(r["tokens"]) == 6
        assert (r["attended"] == 1.0) == r["arm"].startswith("hf-")
    by_arm = {(r["context"], r["arm"]): r for r in rows}
    assert by_arm[(400, "r4i4")]["tokens"] == by_arm[(400, "static-r4i4")]["tokens"]
    assert by_arm[(400, "r4i4")]["tokens"] == by_arm[(400, "captured-r4i4")]["tokens"]
    assert by_arm[(400, "hf-dynamic")]["tokens"] == by_arm[(400, "hf-static")]["tokens"]
    assert by_arm[(400, "hf-dynamic")]["torch_compile_s"] == 0.0  # eager: nothing compiled
    assert all(r["torch_compile_s"] >= 0.0 for r in rows)
    assert all(r["triton_compiles"]["seconds"] >= 0.0 for r in rows)
    for r in rows:  # where the host time went, and torch.compile's phases
        cumulative = [f["cumulative_s"] for f in r["host_profile"]]
        assert len(cumulative) == 5 and cumulative == sorted(cumulative, reverse=True)
        phases = r["torch_compile_phases_s"]
        assert phases.get("entire_frame_compile", 0.0) == pytest.approx(r["torch_compile_s"], abs=1e-2)


def test_bench_generate_hands_its_inductor_options_to_the_captured_arms(tmp_path, monkeypatch):
    """``--inductor-options`` reaches ``decode_compile_config`` of the ``captured-`` arms (and the JSON); without
    such an arm it is refused."""
    bench = _load("bench_generate")
    asked = []

    def recording(options=None):
        asked.append(options)
        return decode_compile_config(options)

    from locks_hf import decode_compile_config

    monkeypatch.setattr(bench, "decode_compile_config", recording)
    out = tmp_path / "generate.json"
    common = ["--shape", "tiny", "--device", "cpu", "--runs", "200:1", "--budget", "64", "--new-tokens", "3"]
    options = ["--inductor-options", '{"combo_kernels": true}', "--out", str(out)]
    bench.main([*common, "--arms", "r4i4,captured-r4i4", *options])
    result = json.loads(out.read_text())
    assert asked == [{"combo_kernels": True}] and result["inductor_options"] == {"combo_kernels": True}
    rows = {r["arm"]: r for r in result["rows"]}
    assert rows["r4i4"]["tokens"] == rows["captured-r4i4"]["tokens"]
    with pytest.raises(SystemExit):
        bench.main([*common, "--arms", "r4i4", *options])


def test_a_gemv_arm_of_bench_generate_is_its_arm_on_the_gemv_projections(tmp_path):
    """``r4i4+gemv`` / ``hf-static+gemv``: the arm's cache and settings, the projections swapped first (on the
    CPU the swap is refused with `gemv_projections`' error, before any generate())."""
    import torch

    bench = _load("bench_generate")
    assert bench.locks_config("static-r4i4+gemv", 64) == bench.locks_config("static-r4i4", 64)
    assert bench.make_cache("hf-dynamic+gemv", None, 64, 128) is None
    config = _load().random_model("tiny", torch.device("cpu")).config
    assert type(bench.make_cache("static-r4i4+gemv", config, 64, 128)) is type(
        bench.make_cache("static-r4i4", config, 64, 128)
    )
    args = ["--shape", "tiny", "--device", "cpu", "--runs", "200:1", "--new-tokens", "2", "--arms", "r4i4+gemv"]
    with pytest.raises(ValueError, match="model.to\\('cuda'\\)"):
        bench.main([*args, "--out", str(tmp_path / "g.json")])


def test_bench_generate_sums_triton_compiles_by_kernel():
    """The listener's compile times (microseconds, by stage) summed per kernel; cache hits only counted,
    and a listener set before is still called and put back."""
    from types import SimpleNamespace

    triton = pytest.importorskip("triton")
    knobs = pytest.importorskip("triton.knobs")
    seen, before = [], knobs.compilation.listener
    knobs.compilation.listener = lambda **kw: seen.append(kw["cache_hit"])
    try:
        with _load("bench_generate").TritonCompiles() as log:
            for name, hit, stages in (("a", False, [2, 3]), ("b", False, [1]), ("a", False, [4]), ("a", True, [9])):
                times = SimpleNamespace(
                    ir_initialization=1_000_000, lowering_stages=[("s", 1_000_000 * x) for x in stages], store_results=0
                )
                triton.knobs.compilation.listener(
                    src=None, metadata={"name": name}, metadata_group={}, times=times, cache_hit=hit
                )
        assert log.summary() == {
            "seconds": 6.0 + 2.0 + 5.0,
            "compiles": 3,
            "cache_hits": 1,
            "kernels": {"a": {"compiles": 2, "seconds": 11.0}, "b": {"compiles": 1, "seconds": 2.0}},
        }
        assert seen == [False, False, False, True]
        assert knobs.compilation.listener is not None and knobs.compilation.listener.__name__ == "<lambda>"
    finally:
        knobs.compilation.listener = before


@pytest.mark.slow  # an ahead-of-time Triton compile: tens of seconds of CPU
def test_compile_time_script_compiles_the_rolled_fma_kernel_for_sm90():
    """scripts/dev/compile_time.py (docs/compile_time.md) drives Triton's private AOT API: keep it working.
    Rank 8 takes the rolled chunk loop, which compiles in seconds and fits in 128 registers; with the codes
    loaded a chunk ahead it compiles too, without spilling."""
    import os
    import re
    import subprocess
    import sys

    import pytest

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "dev" / "compile_time.py"), "--ranks", "8", "--prefetch", "0,1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    found = re.findall(
        r"rank 8 bits \d+ prefetch (\d): [\d.]+ s \{'registers': (\d+), 'local_bytes': (\d+)", run.stdout
    )
    assert [f[0] for f in found] == ["0", "1"], run.stdout  # the plain loop and the codes loaded a chunk ahead
    assert int(found[0][1]) <= 128 and all(int(spilled) == 0 for _, _, spilled in found), found


@pytest.mark.slow  # both engines on three tiny jobs: about a minute of CPU
def test_bench_sweep_runs_on_cpu(tmp_path):
    """scripts/bench_sweep.py at a tiny shape: both engines on jobs a and b, the identity check at a
    covering budget, and the memory job (one prefix, every arm) write their table and JSON."""
    spec = importlib.util.spec_from_file_location("bench_sweep", SCRIPT.parent / "bench_sweep.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "sweep.json"
    module.main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--jobs",
            "warmup,a,b,memory",
            "--budget",
            "64",
            "--w-arms",
            "full,locks-r4i4,quest",
            "--w-budgets",
            "64,96",
            "--w-new",
            "3",
            "--arms",
            "full,locks-r4i4,quest",
            "--a-records",
            "2",
            "--a-context",
            "128",
            "--a-new",
            "3",
            "--b-arms",
            "full,quest",
            "--b-prompt",
            "16",
            "--b-new",
            "20",
            "--b-samples",
            "2",
            "--b-old-new",
            "4",
            "--context",
            "256",
            "--memory-new",
            "2",
            "--check-context",
            "48",
            "--check-new",
            "3",
            "--check-records",
            "1",
            "--out",
            str(out),
        ]
    )
    results = {r["job"]: r for r in json.loads(out.read_text())["results"]}
    a, b, memory, warmup = results["a"], results["b"], results["memory"], results["warmup"]
    assert warmup["n_arms"] == 5 and warmup["steps_built"] == 3  # one batch: full, r4i4, quest
    assert [p["new_step"] for p in warmup["per_arm"]] == [True, True, False, True, False]
    assert a["static"]["tokens"] == a["eager"]["tokens"] == 2 * 3 * 3  # records x arms x new tokens
    assert b["static"]["tokens"] == 2 * 2 * 20 and b["eager"]["tokens"] == 2 * 4
    for job in (a, b):
        check = job["identity"]
        assert check["identical"] == check["compared"] > 0 and check["attended_equal"]
    assert [p["tokens"] for p in memory["per_arm"]] == [2, 2, 2]


def test_soak_script_runs_on_cpu(tmp_path):
    spec = importlib.util.spec_from_file_location("soak_decode", SCRIPT.parent / "dev" / "soak_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "soak.json"
    summary = module.main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--prompt",
            "128",
            "--new-tokens",
            "200",
            "--sample-every",
            "100",
            "--budget",
            "64",
            "--out",
            str(out),
        ]
    )
    assert summary["attended_fraction"] < 0.5 and len(json.loads(out.read_text())["samples"]) == 2


def test_bench_kv_quant_imports_and_refuses_without_cuda(capsys):
    """scripts/bench_kv_quant.py (GPU only) imports cleanly, answers --help, and without CUDA refuses
    with a message rather than a traceback."""
    import torch

    module = _load("bench_kv_quant")
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "--contexts" in capsys.readouterr().out
    args = module.parse_args(["--contexts", "128K,512K", "--bits", "4,2"])
    assert [module.parse_ctx(c) for c in args.contexts.split(",")] == [128 << 10, 512 << 10]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            module.main([])


@pytest.mark.interpret
def test_bench_kv_quant_smoke_dense_and_tile_settings(tmp_path, monkeypatch):
    """`--device cpu` runs the script end to end (Triton's interpreter): the dense 4-bit decode (``--dense``)
    and the sparse lists, each at every ``--tile-pages`` setting; a setting changes the launch, not the
    result (the same error against the bf16 kernel), and ``auto`` is `launch_tiles`'s choice."""
    import torch

    from locks_hf import kernels
    from locks_hf.kernels import attend_quant

    launched = []
    attend = kernels.quantized_attention
    monkeypatch.setattr(kernels, "quantized_attention", lambda *a, **kw: launched.append((a, kw)) or attend(*a, **kw))
    module = _load("bench_kv_quant")
    common = ["--device", "cpu", "--shape", "tiny", "--contexts", "640", "--page-sizes", "16", "--bits", "4"]
    common += ["--warps", "4", "--residual", "64", "--tile-pages", "auto,1,2"]
    dense = module.main([*common, "--dense", "--out", str(tmp_path / "dense.json")])
    sparse = module.main([*common, "--budget", "128", "--lists", "2", "--out", str(tmp_path / "sparse.json")])
    auto = attend_quant.launch_tiles(16, 64, torch.float32, torch.float32)[0]
    for rows in (dense, sparse):
        assert [r["tile_pages"] for r in rows] == [auto, 1, 2]
        errs = [r["rel_err_vs_bf16"] for r in rows]
        assert 0 < errs[0] < 0.2 and max(errs) - min(errs) < 1e-6
    assert all(r["dense"] for r in dense) and not any(r["dense"] for r in sparse)
    assert {kw["tile_pages"] for _, kw in launched} == {None, 1, 2}  # each setting reached the launch
    assert {a[1] is None for a, _ in launched} == {True, False}  # dense (no page lists) and sparse
    assert json.loads((tmp_path / "dense.json").read_text())["rows"] == json.loads(json.dumps(dense))


def test_trace_time_probe_counts_the_marked_layers_refusals(tmp_path):
    """scripts/dev/trace_time.py (docs/performance.md): the trace is timed, each marked layer is counted as
    reused or refused with torch's reason, and the layer class is left unmarked."""
    import torch

    if not hasattr(torch.compiler, "nested_compile_region"):
        pytest.skip("this torch has no nested_compile_region")
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    forward = LlamaDecoderLayer.forward
    spec = importlib.util.spec_from_file_location("trace_time", SCRIPT.parent / "dev" / "trace_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "trace.json"
    rows = module.main(["--layers", "2", "--caches", "hf-static", "--out", str(out)])
    plain, marked = rows
    assert plain["graph_nodes"] > 0 and plain["region_reuses"] == plain["region_refusals"] == 0
    assert marked["region_reuses"] + marked["region_refusals"] >= 1  # the second layer was looked up
    assert json.loads(out.read_text())["rows"] == rows
    assert LlamaDecoderLayer.forward is forward


@pytest.mark.slow
def test_saved_frames_probe_reports_each_process(tmp_path):
    """scripts/dev/saved_frames.py (docs/performance.md): four fresh processes on one cache folder; the warm one
    reuses the cold one's caches with the same logits, and a save or load that fails is reported, not raised."""
    spec = importlib.util.spec_from_file_location("saved_frames", SCRIPT.parent / "dev" / "saved_frames.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "frames.json"
    rows = module.main(["--layers", "1", "--out", str(out)])
    assert [r["mode"] for r in rows] == ["cold", "warm", "save", "load"]
    cold, warm = rows[0], rows[1]
    assert "error" not in cold and "error" not in warm and warm["same_logits"]
    assert warm["first_call_s"] < cold["first_call_s"]  # inductor's cache: no lowering, no code generation
    for row in rows[2:]:
        assert row["same_logits"] or row["error"]
        assert sum(row["dynamo_cache"].values()) == 1  # the saved-frames store was consulted once
    assert json.loads(out.read_text())["rows"] == rows


def test_a_gemv_arm_is_its_family_on_the_gemv_projections():
    """``r4i4+gemv`` is r4i4's configuration with the model's projections swapped for `GemvLinear`, and the
    swap is undone for the next arm; off CUDA the swap is refused with `gemv_projections`' error."""
    import torch

    from locks_hf.models import tiny_model
    from locks_hf.projections import GemvLinear

    bench = _load()
    assert bench.arm_family("r4i4+gemv") == "r4i4"
    assert bench.make_arm("r4i4+gemv", 64) == bench.make_arm("r4i4", 64)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="model.to\\('cuda'\\)"):
        bench.set_projections(model, True)
    bench.set_projections(model, False)  # already on nn.Linear: nothing to undo
    # as after a GPU arm's swap: the next arm puts the projections back on nn.Linear, the same parameters
    linears = {n: m for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    for n, m in linears.items():
        parent, _, child = n.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, GemvLinear.from_linear(m))
    bench.set_projections(model, True)  # already on the kernel: nothing to swap (nor to refuse)
    assert all(isinstance(model.get_submodule(n), GemvLinear) for n in linears)
    bench.set_projections(model, False)
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in linears)
    assert all(model.get_submodule(n).weight is m.weight for n, m in linears.items())
