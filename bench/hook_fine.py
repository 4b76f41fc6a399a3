"""Where the hook's CPU goes, function by function: `bench/hook_resnet.py`'s run with thread-CPU
wrappers around the hook's module functions (inclusive times, ms per step after the warm-up,
rank 0). The wrappers cost a little each (two clock reads): read shares, and take totals from
`bench/hook_resnet.py`. A function called from inside a compiled kernel is not seen.

    OMP_NUM_THREADS=1 PYTHONPATH=.:bench .venv/bin/python bench/hook_fine.py STEPS [BUCKET_MB] [profile|ROUTE]
"""
import importlib
import json
import sys
import time

import hook_resnet

from nfab.distributed import run_ranks

TARGETS = {
    "nfab.runtime.hook": ("Runtime._finish_step", "_result_future", "Runtime.hook", "Runtime._complete",
                          "Runtime._context", "Runtime._launch", "Runtime._callback", "Runtime._finish",
                          "Runtime._plan", "Runtime._step_values"),
    "nfab.runtime.encode": ("all_gather_flat", "local_sq", "prepare_group", "finish_group", "launch_coalesced",
                            "launch_each", "_noise", "slices", "gather_slices", "_in_place", "reads_sq"),
    "nfab.runtime.decode": ("mean_of_ranks", "finish_bucket", "_decode_group", "_control_table", "_zero_if",
                            "_probe_sums"),
    "nfab.runtime.agreement": ("launch", "Agreement.wait"),
    "nfab.runtime.control": ("Builder.build", "Builder.add", "nonfinite", "table"),
    "nfab.runtime.coalesce": ("pack", "should_coalesce", "Part.rows"),
    "nfab.runtime.fold": ("fold_step",),
    "nfab.runtime.controller": ("Controller.routes", "Controller.phase"),
    "nfab.wire.sign": ("SignGather.encode_views", "SignGather.decode", "SignGather.combine"),
    "nfab.wire.qsum": ("QSum.encode", "QSum.decode_gathered", "QSum.level_values", "QSum.encode_own_views"),
    "nfab.wire.fastpath": ("sign_votes_views", "majority_into", "gather", "slices_sq", "qsum_levels",
                           "segment_max_abs", "qsum_own_levels", "gathered_levels"),
    "nfab.wire.noise": ("seeded_keys",),
    "nfab.wire.kernels": ("qsum_own_scale", "sign_bits_f32", "gathered_levels"),  # none called from a kernel
    "nfab.wire.votekernels": ("majority_segments",),
    "torch.futures": ("collect_all",),
}


def _wrap(acc: dict[str, float]) -> None:
    for modname, names in TARGETS.items():
        mod = importlib.import_module(modname)
        for dotted in names:
            owner, attr = (mod, dotted) if "." not in dotted else (getattr(mod, dotted.split(".")[0]),
                                                                   dotted.split(".")[1])
            orig = getattr(owner, attr, None)
            if orig is None:
                continue
            if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
                continue

            def timed(*a, _orig=orig, _name=f"{modname.split('.')[-1]}.{dotted}", **k):
                t = time.thread_time()
                try:
                    return _orig(*a, **k)
                finally:
                    acc[_name] = acc.get(_name, 0.0) + time.thread_time() - t
            setattr(owner, attr, timed)


def _rank(rank: int, world: int, steps: int, mb: float, what: str) -> dict:
    acc: dict[str, float] = {}
    _wrap(acc)
    from nfab.runtime.hook import Runtime
    stats, calls = Runtime.step_stats, [0]

    def counted(self):  # the first WARM steps (compiles, DDP's rebuild) are not counted
        calls[0] += 1
        if calls[0] == hook_resnet.WARM:
            acc.clear()
        return stats(self)
    Runtime.step_stats = counted
    out = hook_resnet._rank(rank, world, steps, mb, what)
    return {"summary": out, "fine_ms": {k: round(1e3 * v / (steps - hook_resnet.WARM), 3) for k, v in
                                        sorted(acc.items(), key=lambda kv: -kv[1])}}


if __name__ == "__main__":
    steps = int(sys.argv[1])
    mb = float(sys.argv[2]) if len(sys.argv) > 2 else 4.0
    what = sys.argv[3] if len(sys.argv) > 3 else "profile"
    res = run_ranks(_rank, 2, steps, mb, what, timeout_s=900)[0]
    print(json.dumps(res["summary"]))
    for k, v in res["fine_ms"].items():
        print(f"{v:8.3f}  {k}")
