"""`make device-check`: the one prepared command for a lent GPU (and, without one, on CPU).

Runs, in this order, each step under its own time limit and all of them within `TOTAL_S`, with
results as JSON under `--out` (default `$OUT`, else runs/device-check) and a one-screen summary
(summary.txt, also printed, rewritten after every step):

1. cuda_tests: `pytest -m cuda` (tests/runtime/test_cuda.py: every hook body and callback
   under `torch.cuda.set_sync_debug_mode("error")`, a host sync raises);
2. wire: `nfab bench wire --device cuda --impl torch` (encode + decode GB/s and the ratio to the
   device's own copy bandwidth), and on CPU the numba host path beside the torch path;
3. ranks: a 2-rank run on the one device (gloo with CUDA tensors): DDP under nfab's hook on
   mixed lossy routes, replicas bit-identical, the fp32 route equal to plain DDP; and FSDP2
   (`fully_shard` per block and on the root): the fp32 route equal to plain FSDP2, a lossy
   mix finite;
4. hook: a ~100M-parameter GPT (`gpt` size 125m) at W=2 on the one device: step ms of plain
   DDP and of nfab's hook side by side (`VARIANTS`), and the hook's own ms per step. Through
   gloo, whose CUDA collectives copy through the host: the ratios to plain DDP measure that,
   not NCCL.

With no CUDA the same script runs on CPU in quick mode (small sizes), says "no CUDA: ran on
cpu" and finishes in well under 300 s: that is how it is kept working between lendings
(`make device-check` on a CPU machine: about 20 s on the 2-core dev box, 2026-12-04). There its
ranks fork from one server that imported torch and nfab once (`fork_ranks_from_server`): spawned,
the 4 ranks of the ranks and hook steps took 50 s of a 76 s check on the loaded box, forked 8 s
(2026-12-08); a GPU's ranks still spawn. At most 8
files are written under the output folder (the device runner brings back no more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "nfab")
"""The hook step's DDP variants: no hook; nfab's hook on the default path (CUDA: eager torch ops;
CPU: the numba kernels), run interleaved step by step with plain DDP in one 2-rank run (`step_hook`)."""
MIXED = {"linear": "bq3", "embedding": "bq3", "head": "sign", "norm": "bf16", "bias": "q8"}
WIRE_REDUCERS = ("allreduce-bf16,signgather,signcount,signscatter,qsum-q8,qsum-q4,blockq-bq3,blockq-bq2,"
                 "blockqscatter-bq3")
LIMITS_S = {"cuda_tests": 180, "wire": 120, "ranks": 50, "hook": 150}
"""Per step, on a GPU, each also capped by what is left of `TOTAL_S` (CPU quick mode: far less)."""
TOTAL_S = 540.0
"""The whole check: under the device runner's 600 s per command, with room for make, the install and
the summary (written after every step, so a run cut short still brings back what it did)."""
_deadline = time.monotonic() + TOTAL_S


def _limit(step: str, share: float = 1.0) -> float:
    """`step`'s limit (times `share`), capped by what is left of the whole check's `TOTAL_S`."""
    return max(5.0, min(LIMITS_S[step] * share, _deadline - time.monotonic()))


def _env(cuda: bool) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": cuda,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu", "date": time.strftime("%Y-%m-%d %H:%M %Z")}
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        info["numba"] = None
    return info


def _run(cmd: list[str], limit_s: float, base_env: dict | None = None) -> tuple[int, str]:
    """A subprocess in the repo root with nfab importable from it; (return code, output tail)."""
    base = os.environ if base_env is None else base_env
    env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1"}
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, out[-4000:]
    return p.returncode, (p.stdout + p.stderr)[-4000:]


def step_cuda_tests(out: Path, cuda: bool, quick: bool) -> dict:
    rc, tail = _run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-rs", "-p", "no:cacheprovider",
                     "tests/runtime/test_cuda.py"], _limit("cuda_tests"))
    last = [ln for ln in tail.splitlines() if ln.strip()][-1:] or [""]
    ok = rc == 0 or (not cuda and rc == 5)  # 5: nothing collected
    return {"ok": ok, "rc": rc, "result": last[0], "tail": tail}


def step_wire(out: Path, cuda: bool, quick: bool) -> dict:
    numel = 1 << (18 if quick else 24)
    runs = {}
    impls = ["torch"] if cuda else ["host", "torch"]
    for impl in impls:
        path = out / f"wire_{impl}.json"
        rc, tail = _run([sys.executable, "-m", "nfab", "bench", "wire", "--device", "cuda" if cuda else "cpu",
                         "--impl", impl, "--numel", str(numel), "--world-sizes", "2,4", "--reducers", WIRE_REDUCERS,
                         "--json", str(path)], _limit("wire", 1.0 / len(impls)))
        rows = json.loads(path.read_text()) if rc == 0 and path.exists() else []
        runs[impl] = {"rc": rc, "rows": [{k: r[k] for k in ("reducer", "world_size", "encode_decode_gbps",
                                                           "copy_gbps", "ratio_to_copy")} for r in rows],
                      "tail": tail if rc else ""}
    ok = all(r["rc"] == 0 for r in runs.values())
    return {"ok": ok, "numel": numel, "runs": runs}


def _ranks_main(rank: int, world_size: int, use_cuda: bool, quick: bool) -> dict:
    """DDP on the shared device under nfab's hook: mixed routes, and the fp32 route against plain DDP."""
    import copy

    from torch.nn.parallel import DistributedDataParallel as DDP

    import nfab

    dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Flatten(), torch.nn.Linear(32 * 8, 64),
                                torch.nn.LayerNorm(64), torch.nn.Linear(64, 16)).to(dev)
    plain, ours = copy.deepcopy(model), copy.deepcopy(model)
    kw = {"device_ids": [dev]} if use_cuda else {}
    d_mixed, d_plain, d_ours = DDP(model, **kw), DDP(plain, **kw), DDP(ours, **kw)
    nfab.attach(d_mixed, route=MIXED, head_modules=("4",), cost_model=None)
    nfab.attach(d_ours, route="fp32", cost_model=None)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (d_mixed, d_plain, d_ours)]
    g = torch.Generator().manual_seed(rank)
    fp32_equal = True
    for _ in range(3 if quick else 5):
        x = torch.randint(0, 64, (16, 8), generator=g).to(dev)
        y = torch.randint(0, 16, (16,), generator=g).to(dev)
        for m, opt in zip((d_mixed, d_plain, d_ours), opts, strict=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
        fp32_equal &= all(torch.equal(p.grad, q.grad) for p, q in zip(plain.parameters(), ours.parameters(),
                                                                       strict=True))
        for opt in opts:
            opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    return {"flat": flat, "fp32_equal": fp32_equal, "finite": bool(torch.isfinite(flat).all()),
            "fsdp2": _fsdp2(rank, dev, quick)}


def _fsdp2(rank: int, dev: torch.device, quick: bool) -> dict:
    """FSDP2 under nfab's reduce-scatter: route fp32 against plain FSDP2 (local shards bit for bit),
    and a lossy mix (bq3 / sign / bq8: routes FSDP2 offers) finite after a few SGD steps. An error is
    recorded, not raised; a torch without FSDP2's custom reduce-scatter (before 2.9) is a skip."""
    from nfab.runtime.frontends import fsdp2

    if (why := fsdp2.unsupported()) is not None:
        return {"skipped": why}
    try:
        from torch.distributed.fsdp import fully_shard

        import nfab

        def build(route: str | dict | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Sequential(torch.nn.LayerNorm(32),
                                        torch.nn.Linear(32, 32)), torch.nn.Linear(32, 4)).to(dev)
            fully_shard(model[1])
            fully_shard(model)
            if route is not None:
                nfab.attach(model, route=route, head_modules=("2",), cost_model=None)
            return model, torch.optim.SGD(model.parameters(), lr=0.1)

        runs = {"plain": build(None), "fp32": build("fp32"), "mixed": build({"linear": "bq3", "head": "sign",
                                                                               "norm": "fp32", "bias": "bq8"})}
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(8, 16, generator=g).to(dev)
            y = torch.randint(0, 4, (8,), generator=g).to(dev)
            for model, opt in runs.values():
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                opt.step()

        def local(model: torch.nn.Module) -> torch.Tensor:
            return torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).cpu()

        return {"fp32_equals_plain": torch.equal(local(runs["plain"][0]), local(runs["fp32"][0])),
                "mixed_finite": bool(torch.isfinite(local(runs["mixed"][0])).all())}
    except Exception as e:  # noqa: BLE001 - recorded in the check's results
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}


def step_ranks(out: Path, cuda: bool, quick: bool) -> dict:
    from nfab.distributed import run_ranks

    res = run_ranks(_ranks_main, 2, cuda, quick, timeout_s=_limit("ranks"))
    replicas = torch.equal(res[0]["flat"], res[1]["flat"])
    fsdp = [r["fsdp2"] for r in res]
    fsdp_ok = all(f.get("skipped") or (f.get("fp32_equals_plain") and f.get("mixed_finite")) for f in fsdp)
    ok = replicas and fsdp_ok and all(r["fp32_equal"] and r["finite"] for r in res)
    return {"ok": ok, "ddp": {"replicas_bit_identical": replicas, "fp32_route_equals_plain_ddp":
                              [r["fp32_equal"] for r in res], "finite": [r["finite"] for r in res]},
            "fsdp2": {"ok": fsdp_ok, "ranks": fsdp}}


def _hook_main(rank: int, world_size: int, use_cuda: bool, quick: bool, names: tuple[str, ...]) -> dict:
    """Step ms of the `names` variants (`VARIANTS`: plain DDP and nfab's hook on one path),
    interleaved step by step, on one GPT each."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import nfab
    from nfab.models.registry import build_model

    dev = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    size, batch, seq = ("nano", 4, 64) if quick else ("125m", 4, 512)
    variants = {}
    for name in names:
        spec = build_model("gpt", device=dev, seed=0, size=size)
        kw = {"device_ids": [dev]} if use_cuda else {}
        ddp = DDP(spec.module, bucket_cap_mb=25, **kw)
        rt = None if name == "plain" else nfab.attach(ddp, route=MIXED, head_modules=spec.head_modules, cost_model=None)
        variants[name] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4), rt, spec)
    params = sum(p.numel() for p in variants["plain"][3].module.parameters())
    g = torch.Generator().manual_seed(rank)
    times: dict[str, list[float]] = {k: [] for k in variants}
    hook_ms: dict[str, list[float]] = {k: [] for k in variants if k != "plain"}
    steps, warmup = (4, 1) if quick else (8, 2)

    def sync() -> None:
        if use_cuda:
            torch.cuda.synchronize(dev)

    for step in range(steps):
        idx = torch.randint(0, variants["plain"][3].vocab_size, (batch, seq + 1), generator=g).to(dev)
        for name, (ddp, opt, rt, _) in variants.items():
            sync()
            t0 = time.perf_counter()
            opt.zero_grad()
            logits = ddp(idx[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            sync()
            if step >= warmup:
                times[name].append(1e3 * (time.perf_counter() - t0))
                if rt is not None and rt.step_stats() is not None:
                    hook_ms[name].append(1e3 * rt.step_stats().hook_time_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"params": params, "size": size, "step_ms": med,
            "hook_ms": {k: statistics.median(v) if v else None for k, v in hook_ms.items()},
            "overhead": {k: med[k] / med["plain"] - 1 for k in hook_ms}}


def step_hook(out: Path, cuda: bool, quick: bool) -> dict:
    """nfab's hook in a 2-rank run beside plain DDP (`VARIANTS`)."""
    from nfab.distributed import run_ranks

    name = VARIANTS[1]
    res = run_ranks(_hook_main, 2, cuda, quick, VARIANTS, timeout_s=_limit("hook"))
    r = res[0]
    model = f"gpt {r['size']} ({r['params'] / 1e6:.1f}M parameters)"
    variants = {name: {"plain_ms_per_step": r["step_ms"][VARIANTS[0]], "ms_per_step": r["step_ms"][name],
                       "overhead_vs_plain": r["overhead"][name], "hook_ms_per_step": r["hook_ms"][name],
                       "ranks": res}}
    return {"ok": True, "model": model, "world_size": 2, "routes": MIXED, "variants": variants}


STEPS = {"cuda_tests": step_cuda_tests, "wire": step_wire, "ranks": step_ranks, "hook": step_hook}
"""In the order they run."""


def _summary(env: dict, results: dict, total_s: float) -> str:
    lines = [f"nfab device check  {env['date']}  device: {env['device']}  torch {env['torch']}",
             "" if env["cuda"] else "no CUDA: ran on cpu (quick mode)"]
    for name, r in results.items():
        mark = "ok  " if r.get("ok") else ("SKIP" if r.get("skipped") else "FAIL")
        lines.append(f"[{mark}] {name:<10} {r.get('seconds', 0):6.1f} s  {r.get('error', '')}".rstrip())
    ct = results.get("cuda_tests", {})
    if ct.get("result"):
        lines.append(f"  pytest -m cuda: {ct['result']}")
    for impl, run in results.get("wire", {}).get("runs", {}).items():
        worst = min((row["ratio_to_copy"] for row in run["rows"] if row["ratio_to_copy"]), default=None)
        cells = ", ".join(f"{row['reducer']}@{row['world_size']} {row['ratio_to_copy']:.2f}x"
                          for row in run["rows"] if row["world_size"] == 2 and row["ratio_to_copy"])
        lines.append(f"  wire {impl} path, enc+dec / copy (W=2): {cells}")
        if worst is not None:
            lines.append(f"    slowest {worst:.3f}x of the device's copy bandwidth")
    rk = results.get("ranks", {})
    if "ddp" in rk:
        fs = rk["fsdp2"]["ranks"][0]
        fsdp = fs.get("error") or fs.get("skipped") or (f"fp32 route = plain FSDP2 {fs['fp32_equals_plain']}, "
                                   f"lossy mix finite {fs['mixed_finite']}")
        lines.append(f"  2 ranks on one device: DDP replicas bit-identical {rk['ddp']['replicas_bit_identical']}, "
                     f"fp32 route = plain DDP {all(rk['ddp']['fp32_route_equals_plain_ddp'])}; FSDP2: {fsdp}")
    hk = results.get("hook", {})
    if hk.get("variants"):
        lines.append(f"  hook: {hk['model']}, W=2, each beside plain DDP"
                     + (" (gloo with CUDA tensors on one GPU: the ratios measure gloo's host copies, not NCCL):"
                        if env["cuda"] else ":"))
        for name, v in hk["variants"].items():
            ms = v["hook_ms_per_step"]
            lines.append(f"    {name}: {v['ms_per_step']:.1f} ms/step against {v['plain_ms_per_step']:.1f} "
                         f"({100 * v['overhead_vs_plain']:+.1f}%), hook "
                         + (f"{ms:.1f} ms/step" if ms is not None else "not timed"))
    lines.append(f"total {total_s:.0f} s")
    return "\n".join(ln for ln in lines if ln is not None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/device-check")
    ap.add_argument("--steps", default=",".join(STEPS), help="Comma-separated steps to run.")
    ap.add_argument("--quick", action="store_true", help="Small sizes (always on without CUDA).")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    quick = args.quick or not cuda
    if not cuda:  # the ranks and hook steps' 4 ranks fork from one server that loaded torch, DDP and nfab once
        from nfab.distributed import fork_ranks_from_server

        fork_ranks_from_server()  # (spawned, each paid that start-up: about half the CPU check's time)
    env = _env(cuda)
    global _deadline
    _deadline = time.monotonic() + TOTAL_S
    t_start = time.perf_counter()
    results: dict[str, dict] = {}
    for name in [s.strip() for s in args.steps.split(",") if s.strip()]:
        if name not in STEPS:
            print(f"unknown step {name!r}: choose from {', '.join(STEPS)}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        try:
            results[name] = STEPS[name](out, cuda, quick)
        except Exception as e:  # noqa: BLE001 - one failed step must not lose the others' results
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}",
                             "traceback": traceback.format_exc()[-4000:]}
        results[name]["seconds"] = time.perf_counter() - t0
        (out / "results.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
        text = _summary(env, results, time.perf_counter() - t_start)
        (out / "summary.txt").write_text(text + "\n")  # after every step: a run cut short keeps it
    text = _summary(env, results, time.perf_counter() - t_start)
    (out / "summary.txt").write_text(text + "\n")
    print(text)
    return 0 if all(r.get("ok") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
