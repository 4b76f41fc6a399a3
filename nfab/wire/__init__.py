"""The wire layer: codecs, integer lanes, reducers and the cost model.

Pure tensor code and collectives; no model knowledge. One folder or module per codec
family, each holding its torch reference (any device) beside its compiled CPU kernels:

- `lowp.py`: fp32 / bf16 / fp16 all-reduce (torch only);
- `sign/`: `codec.py` (reference), `reducers.py`, `scatter.py`, `host.py` (tensors to
  kernels), `bit_kernels.py`, `vote_kernels.py`, `trit_kernels.py`;
- `qsum/`: `lanes.py` (reference lane packing), `reducer.py`, `host.py`,
  `level_kernels.py`, `lane_kernels.py`, `chunk_kernels.py`;
- `blockq/`: `reducer.py` (reference and its compiled dispatch), `scatter.py`, `radix.py`,
  `grid.py` (block views), `replay.py`, `table.py` (the scale table), `kernels.py`.

Shared by all: `dispatch.py` (the one choice of implementation per device), `segments.py`
and `host_slices.py` (per-segment helpers, torch and compiled), `shared_kernels.py` (numba
intrinsics: cache directory, prefetch, noise hash), `noise.py`, `slices.py`, `routes.py`,
`contract.py` (the Reducer contract), `registry.py` (route -> reducers), `cost.py`, and
`numba_cache.py` (where numba caches the compiled kernels: a per-user directory).
"""

from nfab.wire import numba_cache

numba_cache.configure()  # before any codec module imports numba: importing one runs this first
