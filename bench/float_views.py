"""Side by side in one process, one core: the compiled torch path with a CPU stage's int32 / int64
arguments passed as float views (`fusion._as_float_words`, what nfab does) and passed as they are.

    python -m bench.float_views qsum-q8,blockq-bq3 2,4 [ROUNDS]

Prints each reducer@W's ratio to a copy per round and the median, both ways (docs/gpu.md, "The same
command on an AVX2 machine")."""

from __future__ import annotations

import statistics
import sys

from nfab.bench.wire import bench_wire
from nfab.wire import fusion


def main(reducers: list[str], world_sizes: list[int], rounds: int) -> dict[str, list[float]]:
    given = fusion._as_float_words
    out: dict[str, list[float]] = {}
    try:
        for _ in range(rounds):
            for mode in ("views", "plain"):
                fusion._as_float_words = given if mode == "views" else (lambda args: args)
                for row in bench_wire(reducers=reducers, impl="compiled", world_sizes=world_sizes):
                    if row.ratio_to_copy is not None:
                        out.setdefault(f"{row.reducer}@W={row.world_size}/{mode}", []).append(row.ratio_to_copy)
    finally:
        fusion._as_float_words = given
    return out


if __name__ == "__main__":
    ratios = main(sys.argv[1].split(","), [int(w) for w in sys.argv[2].split(",")],
                  int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    for key in sorted(ratios):
        runs = " ".join(f"{v:.3f}" for v in ratios[key])
        print(f"{key:34s} median {statistics.median(ratios[key]):.3f}  ({runs})")
