"""The wire layer: codecs, integer lanes, reducers and the cost model.

Pure tensor code and collectives; no model knowledge. One folder or module per codec
family, each holding its torch reference (any device) beside its compiled CPU kernels, and
an `ops.py`: the operations whose implementations differ, as a torch ops object and a host
one (`SignOps` / `HostSignOps`, `QSumOps` / `HostQSumOps`, `BlockQOps` / `HostBlockQOps`)
that `dispatch.ops` picks per device; the reducers call it and never ask which:

- `lowp.py`: fp32 / bf16 / fp16 all-reduce (torch only);
- `sign/`: `codec.py` (reference), `ops.py`, `reducers.py`, `scatter.py`, `host.py` (tensors
  to kernels), `bit_kernels.py`, `vote_kernels.py`, `trit_kernels.py`;
- `qsum/`: `lanes.py` (reference lane packing), `ops.py`, `reducer.py`, `host.py`,
  `level_kernels.py`, `lane_kernels.py`, `chunk_kernels.py`;
- `blockq/`: `reducer.py` (reference), `ops.py` (and the compiled path), `scatter.py`,
  `radix.py`, `grid.py` (block views), `replay.py`, `table.py` (the scale table), `kernels.py`.

Shared by all: `dispatch.py` (the one choice of implementation per device), `segments.py`
and `host_slices.py` (per-segment helpers, torch and compiled: `SegmentOps`, `SliceOps`), `shared_kernels.py` (numba
intrinsics: cache directory, prefetch, noise hash), `noise.py`, `slices.py`, `routes.py`,
`contract.py` (the Reducer contract), `registry.py` (route -> reducers), `cost.py`, and
`numba_cache.py` (where numba caches the compiled kernels: a per-user directory).
"""

from nfab.wire import numba_cache

numba_cache.configure()  # before any codec module imports numba: importing one runs this first
