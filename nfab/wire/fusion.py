"""What every codec's `torch.compile`d stages share: when they run, how they compile, the hash.

Why: the torch path (what CUDA takes, and CPU under `NFAB_HOST_KERNELS=0`) is one memory-bound
pass per torch op -- a dozen for the counter hash alone -- so eager it runs at a few hundredths
of a copy. Each codec's `fused.py` writes a whole stage (encode: hash + scale + rounding + lane
packing; decode: unpack + scale + the write into the bucket) as one pure function of tensors,
and inductor compiles it into a few kernels (C++ on the CPU, Triton on CUDA).

Bits: every compiled stage computes the eager path's numbers op for op, and three compiler
liberties that would change them are switched off for these graphs (`OPTIONS`):

- floating-point contraction (a multiply and an add fused into one FMA, one rounding instead
  of two): off for the C++ build (`cpp.enable_floating_point_contract_flag`, inductor's
  default too) and for Triton (`emulate_precision_casts`, which makes inductor pass
  `enable_fp_fusion=False`);
- Triton's approximate fp32 division: `eager_numerics.division_rounding` asks for `div_rn`,
  as eager CUDA divides;
- division by a constant rewritten as a multiplication by its reciprocal (inductor does it on
  every device but the CPU): no graph here divides by a Python number -- divisors and scale
  factors enter as fp32 tensors (`constant`), which also lets one graph serve every route.

Integer arithmetic (the hash) wraps mod 2^32 in int32 on every backend, as in eager torch.
Compiling is opt-in (`dispatch.compile_paths`, `NFAB_COMPILE=1`); the first compile error logs
one warning and the eager torch path runs for the rest of the process (`run` returns None).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, lru_cache
from typing import Any

import torch

from nfab.wire import dispatch, noise

log = logging.getLogger(__name__)

OPTIONS: dict[str, Any] = {
    "cpp.enable_floating_point_contract_flag": "off",
    "emulate_precision_casts": True,
    "eager_numerics.division_rounding": True,
}
"""Inductor settings for every codec graph: the eager path's roundings (see the module docstring)."""


@cache
def inductor_options() -> dict[str, Any]:
    """`OPTIONS` as this torch's inductor spells them. Raises `RuntimeError` (so `_run` falls back to the
    exact eager path, with its reason) where inductor lacks one: torch 2.4 has neither Triton
    setting, and compiled without them a GPU's graph would not round as eager does. torch 2.4 holds
    the contraction flag as a bool, 2.11 and later as "off"/"on"; passed as the wrong type, every
    compile failed with a message that named the flag, not the torch."""
    from torch._inductor import config

    out: dict[str, Any] = {}
    for key, value in OPTIONS.items():
        node: Any = config
        for part in key.split("."):
            if not hasattr(node, part):
                raise RuntimeError(f"torch {torch.__version__}'s inductor has no {key} setting, which keeps "
                                   "compiled codec stages bit-equal to eager")
            node = getattr(node, part)
        out[key] = (value != "off") if isinstance(node, bool) and isinstance(value, str) else value
    return out


def unsupported() -> str | None:
    """The one line that says why this torch cannot compile the codec stages exactly (`inductor_options`
    raises: torch 2.4), or None where it can (what the device check records and its test expects)."""
    try:
        inductor_options()
    except RuntimeError as e:
        return str(e)
    return None


GOLDEN_I32 = noise.GOLDEN - (1 << 32)
MIX2_I32 = noise.MIX2 - (1 << 32)

_failed = False
_compile_stages = True


def failed() -> bool:
    """Whether a compile error switched the compiled stages off for this process."""
    return _failed


def active(*tensors: torch.Tensor) -> bool:
    """Whether the compiled stages run on these tensors: the torch path is taken (not the host
    kernels), compiling is switched on (`dispatch.compile_enabled`) and has not failed."""
    return not _failed and dispatch.compile_enabled() and not dispatch.supports(*tensors)


@cache
def _compiled(fn: Callable[..., Any], kind: tuple[Any, ...]) -> Callable[..., Any]:
    """`fn` compiled as its own code object, one per `kind` of arguments (`_kind`). Why: dynamo keeps
    at most `recompile_limit` (8) graphs per code object. Every layout's stage made by one factory
    (`pack_fn(layout)`, ...) is a closure of the same code, and dynamo makes a graph of its own for
    every size 0 or 1 (an empty or one-element last row, `row_parts`) and every dtype; past 8 in a
    process (a sweep of routes, world sizes and bucket layouts) the 9th failed to compile and
    switched every stage to eager. A copy of the code per closure and kind keeps one cache each.

    On the CPU the integer tensors arrive as float views of their words (`_as_float_words`) and the
    graph views them back (`_integer_views`): the same bits, read by float vector loads."""
    views = tuple(k[2] if k is not None else None for k in kind)

    def stage(*args: Any) -> Any:
        return fn(*_integer_views(args, views))

    own = types.FunctionType(stage.__code__.replace(), stage.__globals__, fn.__name__, None, stage.__closure__)
    return torch.compile(own, dynamic=True, fullgraph=True, options=inductor_options())


FLOAT_WORDS = {torch.int32: torch.float32, torch.int64: torch.float64}
"""Integer dtypes a CPU stage receives as float views of the same words (`_as_float_words`)."""


def _as_float_words(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The CPU tensors among `args` of int32 / int64 as float32 / float64 views of the same words.

    Why: inductor's C++ reads a vector of int32 or int64 on AVX2 through `Vectorized<int>::loadu(ptr,
    count)`, which in torch 2.13 always copies the lanes through a stack buffer (the float and double
    loads have a full-vector fast path): a store-forwarding stall per 8 lanes. On an AVX2 machine a
    level kernel that read its int32 counter steps so took 20 ms per 4M elements, 5.3 with the steps
    passed as a float view; a shift and a mask of int32 words 4.0 ms against 1.2 (a copy: 1.0). A
    view of a dtype of the same size moves no data and is bit-exact (the graph only reinterprets it);
    on the host it costs about 5 us per integer argument and call (a stage of three int32 and two
    fp32 arguments: 84-93 us a call against 69-72, one core). Tensors on other devices go as they
    are: Triton loads integers natively."""
    return tuple(a.view(FLOAT_WORDS[a.dtype]) if isinstance(a, torch.Tensor) and a.dtype in FLOAT_WORDS
                 and a.device.type == "cpu" else a for a in args)


def _integer_views(args: tuple[Any, ...], views: tuple[torch.dtype | None, ...]) -> list[Any]:
    """`args` with every float view `_as_float_words` made viewed back as its integer dtype (traced)."""
    return [a.view(d) if d is not None else a for a, d in zip(args, views, strict=True)]


@contextmanager
def stages_compiled(enabled: bool) -> Iterator[None]:
    """Run the stages through `torch.compile` (default) or, with False, call each stage function as
    plain eager torch ops: the same buffers, views and arithmetic, without the compiler. That is
    how the default test suite covers the compiled path's wiring in seconds, where compiling its
    C++ takes minutes (tests/wire/test_compiled.py)."""
    global _compile_stages
    was, _compile_stages = _compile_stages, enabled
    try:
        yield
    finally:
        _compile_stages = was


class StageWatcher:
    """Told when a stage starts and ends (`watching`): how `nfab.bench.launches` tells a stage's
    own ops (one compiled graph) from the ops around it."""

    def enter(self) -> None: ...

    def exit(self) -> None: ...


_watcher: StageWatcher | None = None


@contextmanager
def watching(watcher: StageWatcher) -> Iterator[None]:
    """Report every stage `run` calls to `watcher` while the block runs."""
    global _watcher
    was, _watcher = _watcher, watcher
    try:
        yield
    finally:
        _watcher = was


def run(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn` compiled, on `args`; None (and eager from then on) when compiling fails."""
    if _watcher is not None:
        watcher = _watcher
        watcher.enter()
        try:
            return _run(fn, *args)
        finally:
            watcher.exit()
    return _run(fn, *args)


def _run(fn: Callable[..., Any], *args: Any) -> Any:
    global _failed
    if not _compile_stages:
        return fn(*args)
    try:
        words = _as_float_words(args)
        return _compiled(fn, _kind(words, args))(*words)
    except Exception as err:  # noqa: BLE001  (any compiler failure: the eager path is exact)
        _failed = True
        log.warning("nfab: torch.compile of a codec stage failed, the eager torch path runs instead: %s",
                    str(err).splitlines()[0] if str(err) else type(err).__name__)
        return None


def _kind(args: tuple[Any, ...], given: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    """What dynamo specialises a graph on, per tensor argument: its dtype and each size as 0, 1 or
    more (`_compiled`), and the integer dtype it was given as where `args` holds its float view
    (`given`: the arguments before `_as_float_words`), else None."""
    given = args if given is None else given
    return tuple((a.dtype, tuple(min(d, 2) for d in a.shape), g.dtype if g.dtype != a.dtype else None)
                 if isinstance(a, torch.Tensor) else None for a, g in zip(args, given, strict=True))


_STATIC: dict[int, int] = {v: v for v in range(1 << 12)} | {
    (1 << b) + d: (1 << b) + d for b in range(64) for d in (-1, 0)}
"""`static`'s table, filled before any stage traces: small ints, powers of two and masks; builders
add their larger constants (radix powers) when they build (`static` outside a trace)."""


def static(value: int) -> int:
    """`value` as a constant inside a traced stage. Why: under `dynamic=True` dynamo makes a closure's
    ints (and its objects' int attributes) symbolic, and inductor's C++ then computed a shift by a
    lane width as a float vector (a C++ compile error, so the eager fallback). Looked up in a
    module-level table, the int is specialised to its value (a guard on it), as a literal would be.

    Traced, it only reads the table: a value already there costs a guard on that value alone. A
    value added while tracing guards the table's length, so every graph traced before it compiles
    again on its next call (a dozen graphs per new constant in `test_compiled.py`): builders call
    `static` on their constants when they build, outside the trace, and the table starts filled."""
    if not torch.compiler.is_compiling():
        return _STATIC.setdefault(value, value)
    try:
        return _STATIC[value]
    except KeyError:  # not registered: added while tracing (the length guard above)
        return _STATIC.setdefault(value, value)


@lru_cache(maxsize=256)
def constant(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor on `device`, made once (rounded to fp32 as eager torch rounds a Python
    scalar that meets an fp32 tensor)."""
    return torch.tensor(value, dtype=torch.float32, device="cpu").to(device, non_blocking=True)


@lru_cache(maxsize=64)
def int_constant(value: int, device: torch.device) -> torch.Tensor:
    """A 1-element int32 tensor on `device`, made once (a stratum's shift: one graph for every rank)."""
    return torch.tensor([value], dtype=torch.int32, device="cpu").to(device, non_blocking=True)


ROW = 256
"""Elements per row of a 1-D level stage's body (`row_parts`): 16 AVX-512 vectors of counters from
one scalar row base and a 1 KB `weyl` table (rows of 16: 1.06 ms per 4M elements, of 256: 0.94)."""


@lru_cache(maxsize=64)
def weyl(width: int, device: torch.device) -> torch.Tensor:
    """The counter steps along one row, int32 k * G mod 2^32 for k < `width`, on `device`, made once.

    Why: an element's counter is base + i * G. Written with `torch.arange`, inductor's C++ builds each
    vector of i from 16 scalar inserts: 0.5-0.65 ms of the 1.7 ms that a level kernel took on 4M
    elements on one core. As a row's base (one scalar per row) plus this table (one vector load,
    in cache), the same kernel takes 1.0 ms and computes the same words. On CUDA it is one more
    small load per element, from cache."""
    steps = (torch.arange(width, dtype=torch.int64, device="cpu") * noise.GOLDEN) & 0xFFFFFFFF
    return as_i32(steps).to(device, non_blocking=True)


def row_parts(*tensors: torch.Tensor) -> list[tuple[int, tuple[torch.Tensor, ...]]]:
    """The 1-D `tensors` (one length n) as a level stage's parts, each (its first element's index,
    the tensors' (rows, width) views): their whole rows of `ROW`, then their last n % ROW elements
    as one row; an empty part left out. The rows are what lets a stage take its counters from
    `weyl`; the short last row is a second small kernel."""
    n = tensors[0].shape[0]
    body = n - n % ROW
    parts = [(0, tuple(t[:body].view(-1, ROW) for t in tensors))] if body else []
    if n > body:
        parts.append((body, tuple(t[body:].view(1, -1) for t in tensors)))
    return parts


def row_steps(x: torch.Tensor, first: torch.Tensor, weyl: torch.Tensor, lo: torch.Tensor | None = None) -> torch.Tensor:
    """lo + (first + r * ROW + k) * G mod 2^32 for element (r, k) of the (rows, width) rows `x`
    (`row_parts`; int32 `first`, 1 element; `lo`, int32, 1 element: a key's low word, or None for the
    unkeyed counter): one scalar base per row plus the row's steps from `weyl` (no index vector).
    `lo` joins the row's scalar, not each element: one vector add fewer in a hash-bound kernel."""
    row = (torch.arange(x.shape[0], dtype=torch.int32, device=x.device) * ROW + first) * GOLDEN_I32
    if lo is not None:
        row = row + lo
    return row.unsqueeze(1) + weyl[: x.shape[1]]


def levels_of(x: torch.Tensor, safe: torch.Tensor, counters: torch.Tensor, shift: torch.Tensor | None,
              half_m: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Stochastically rounded levels, int32 in [0, M]: floor((x / safe + 1) * M/2 + u) clamped to
    [0, M], u the noise of the keyed `counters` (`uniform_of`), in the eager path's fp32 order.
    Every rounding stage's arithmetic (qsum's, blockq's, indexed or not).

    The same integers as floor-then-clamp for every t but NaN: capped at M (t > M, +inf), cut toward
    zero (a non-negative t truncates to its floor), then raised to 0 as an integer (a t below 0, -inf
    and NaN, which the x86 conversion makes INT_MIN, all give 0; the reference casts a NaN level to
    0 as well, and a non-finite gradient is flagged before its levels matter). Why this order: one
    NaN-aware float clamp and an integer max are 5 vector instructions where two float clamps were 8,
    in a level kernel that is compute-bound on one CPU core. A compare-and-select for the cap (3 in
    all) ran as fast in a one-level kernel but made inductor store every digit's t in radix packing
    (bq2: 6.2 -> 8.6-11 ms per 4M elements), as it reads t twice."""
    t = (x.to(torch.float32) / safe + 1.0) * half_m + uniform_of(counters, shift)
    return torch.minimum(t, m).to(torch.int32).clamp(min=0)


def as_i32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as int32 with the same low 32 bits (`noise._as_i32`, traced)."""
    return (words - ((words >> 31) << 32)).to(torch.int32)


def u24(c: torch.Tensor) -> torch.Tensor:
    """lowbias32 of the int32 counters `c`, cut to its top 24 bits (int32 in [0, 2^24)): the
    words of `noise.uniform`, in traced ops (products wrap mod 2^32; shifts masked to logical)."""
    c = c ^ ((c >> 16) & 0xFFFF)
    c = c * noise.MIX1
    c = c ^ ((c >> 15) & 0x1FFFF)
    c = c * MIX2_I32
    c = c ^ ((c >> 16) & 0xFFFF)
    return (c >> 8) & 0xFFFFFF


def uniform_of(c: torch.Tensor, shift: torch.Tensor | None) -> torch.Tensor:
    """u (fp32, multiples of 2^-24 in [0, 1)) of the keyed counters `c`, shifted by `shift` / 2^24 mod 1
    (None: unshifted, two integer ops per element fewer in a hash-bound kernel)."""
    words = u24(c) if shift is None else (u24(c) + shift) & 0xFFFFFF
    return words.to(torch.float32) * 2.0**-24
