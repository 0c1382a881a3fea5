"""GPU check of kernels/eigh.py: accuracy vs float64, timing at the 128K Llama/GLM shapes, CUDA graph capture, and
the decode step's page update at a step that completes a page (batch 1, both shapes) by Jacobi sweeps.

Run from the repository root on a CUDA machine: ``python3 scripts/dev/check_eigh_gpu.py`` (loads kernels/ directly).
"""

import importlib
import statistics
import sys
import types

import torch

lk = types.ModuleType("lk")
lk.__path__ = ["kernels"]
sys.modules["lk"] = lk
E = importlib.import_module("lk.eigh")
Bd = importlib.import_module("lk.build")
PU = importlib.import_module("lk.page_update")
dev = "cuda"
torch.manual_seed(0)
print(torch.__version__, importlib.import_module("triton").__version__, torch.cuda.get_device_name())


def errs(a, w, v):
    a = a.double()
    w = w.double()
    v = v.double()
    ref = torch.cat([torch.linalg.eigvalsh(p) for p in a.split(8192)])
    sc = ref.abs().amax(-1).clamp_min(1e-30)
    ew = ((w - ref).abs().amax(-1) / sc).max().item()
    rec = ((v @ torch.diag_embed(w) @ v.mT - a).norm(dim=(1, 2)) / a.norm(dim=(1, 2)).clamp_min(1e-30)).max().item()
    orth = (v.mT @ v - torch.eye(a.shape[-1], device=dev, dtype=torch.float64)).abs().max().item()
    srt = bool((w.diff(dim=-1) >= 0).all())
    return f"eval {ew:.1e} rec {rec:.1e} orth {orth:.1e} sorted {srt} finite {bool(torch.isfinite(v).all())}"


def gram(m, n=16, d=128, frac=1.0):
    k = torch.randn(m, n, d, device=dev) + 2 * torch.randn(m, 1, d, device=dev)
    w = (torch.rand(m, n, 1, device=dev) < frac).float()
    mu = (k * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)
    c = (k - mu) * w
    return c @ c.mT


for n in (2, 4, 8, 16, 32):
    a = gram(16384, n)
    print(f"n={n} gram", errs(a, *E.sym_eigh(a)))
a = gram(16384, frac=0.3)
print("n=16 few tokens", errs(a, *E.sym_eigh(a)))
q, _ = torch.linalg.qr(torch.randn(16384, 16, 16, device=dev, dtype=torch.float64))
for name, ev in [
    ("clustered", [1.0] * 6 + [2.0] * 5 + [2.0 + 1e-6] * 5),
    ("rank1", [0.0] * 15 + [3.0]),
    ("geom", None),
]:
    evt = (
        10.0 ** -(7 * torch.rand(16384, 16, device=dev, dtype=torch.float64))
        if ev is None
        else torch.tensor(ev, device=dev, dtype=torch.float64)
    )
    a = (q @ torch.diag_embed(evt.expand(16384, 16)) @ q.mT).float()
    print(f"n=16 {name}", errs(a, *E.sym_eigh(a)))


def bench(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


PREFILL = {"llama": (8, 348.5), "glm": (2, 344.0)}
for model, (h, pre) in PREFILL.items():
    T = 131072
    a = gram(h * T // 16)
    w = torch.empty(a.shape[:-1], device=dev)
    v = torch.empty_like(a)
    for sweeps, nw in [(8, 1), (6, 1), (8, 2)]:
        t = bench(lambda: E._eigh_kernel[(a.shape[0],)](a, w, v, N=16, SWEEPS=sweeps, num_warps=nw))
        print(
            f"{model} {a.shape[0]} matrices sym_eigh sweeps={sweeps} warps={nw}: {t:.3f} ms ({100 * t / pre:.2f}% of layer prefill)"
        )

    def chunked():
        for p in a.split(8192):
            torch.linalg.eigh(p)

    print(f"{model} torch.linalg.eigh chunked: {bench(chunked, 3):.3f} ms")
    keys = torch.randn(1, h, T, 128, device=dev, dtype=torch.bfloat16)
    pages = keys.view(1, h, T // 16, 16, 128)
    valid = torch.ones(1, 1, 1, 16, device=dev, dtype=torch.bool).expand(1, h, T // 16, 16)
    for r in (4, 8):
        t = bench(lambda: Bd.build_summary(pages, valid, r, 4), 5)
        print(f"{model} build_summary r{r}i4: {t:.3f} ms ({100 * t / pre:.2f}% of layer prefill)")

k = E._eigh_kernel[(1,)](a, w, v, N=16, SWEEPS=8, num_warps=1)
print("compiled n=16: n_regs", getattr(k, "n_regs", None), "n_spills", getattr(k, "n_spills", None))
k = E._eigh_kernel[(1,)](gram(1, 32), w, v, N=32, SWEEPS=10, num_warps=4)
print("compiled n=32: n_regs", getattr(k, "n_regs", None), "n_spills", getattr(k, "n_spills", None))

# decode: one page per (row, KV head), captured in a CUDA graph
keys = torch.randn(4, 8, 1, 16, 128, device=dev, dtype=torch.bfloat16)
valid = torch.rand(4, 8, 1, 16, device=dev) > 0.1
eager = Bd.build_summary(keys, valid, 4, 4)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    Bd.build_summary(keys, valid, 4, 4)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    out = Bd.build_summary(keys, valid, 4, 4)
g.replay()
torch.cuda.synchronize()
print("graph capture OK; replay == eager:", all(torch.equal(out[k], eager[k]) for k in eager))
print(f"decode page build (32 pages) graph replay: {bench(g.replay, 20) * 1e3:.1f} us")


# the decode step's page update at a step where every row completes a page: batch 1, 512K, by sweeps
for model, h in (("glm", 2), ("llama", 8)):
    cap, B, d = 524288 + 2048, 16, 128
    key_buf = torch.randn(1, h, cap, d, device=dev, dtype=torch.bfloat16)
    slot_valid = torch.ones(1, cap, device=dev, dtype=torch.bool)
    row_start = torch.zeros(1, device=dev, dtype=torch.int32)
    n_complete = torch.zeros(1, device=dev, dtype=torch.int32)
    for r in (4, 8):
        summary = [
            torch.zeros(shape, dtype=dt, device=dev)
            for shape, dt in Bd.summary_shapes((1, h, cap // B), B, d, r, 4).values()
        ]
        for tokens, what in ((524288, "completing"), (524289, "not completing")):
            length = torch.tensor([tokens], device=dev, dtype=torch.int32)
            row = []
            for sweeps in (5, 6, 7, 8) if what == "completing" else (6,):

                def step(sweeps=sweeps):
                    PU.update_completed_pages(
                        "locks",
                        key_buf,
                        slot_valid,
                        row_start,
                        length,
                        summary,
                        page_size=B,
                        rank=r,
                        basis_bits=4,
                        n_complete=n_complete,
                        sweeps=sweeps,
                    )

                g = torch.cuda.CUDAGraph()
                step()
                torch.cuda.synchronize()
                with torch.cuda.graph(g):
                    for _ in range(20):
                        step()
                row.append(f"sweeps={sweeps} {bench(g.replay, 10) * 1e3 / 20:.1f} us")
            print(f"{model} r{r}i4 page update, {what} step, batch 1: " + ", ".join(row))
