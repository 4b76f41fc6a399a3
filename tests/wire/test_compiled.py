"""The compiled torch path (`wire/fusion.py`, each codec's `fused.py`) against the eager torch path
and the numba host path, bit for bit, on the lossy routes.

Twice: with the stage functions called as plain torch ops (`fusion.stages_compiled(False)`: the
compiled path's buffers, views, padding and word arithmetic, in the default suite, seconds), and
compiled. The compiled run is skipped unless NFAB_COMPILE_TESTS=1: torch.compile builds C++ for
every lane layout on the first call (minutes on the shared 2-core box; seconds once inductor's
on-disk cache holds them), which the default suite should not pay. Run:
`NFAB_COMPILE_TESTS=1 pytest tests/wire/test_compiled.py` (`make device-check` runs it, on CUDA there).
"""

from __future__ import annotations

import os

import pytest
import torch

from nfab.wire import dispatch, fusion, noise
from nfab.wire.registry import REDUCERS

needs_compile = pytest.mark.skipif(os.environ.get("NFAB_COMPILE_TESTS") != "1",
                                   reason="compiles C++ for minutes: set NFAB_COMPILE_TESTS=1")

DEVICE = torch.device(os.environ.get("NFAB_COMPILE_TESTS_DEVICE", "cpu"))
LAYOUTS = [
    [64 * 300],  # one view of whole blocks (blockq's one-kernel encode and decode)
    [64 * 40 + 5, 64 * 7, 3, 130],  # tails, short segments: several views, several segments
    [1000, 0, 4096 + 77],  # an empty segment
    # a bucket of many small parameters (norms, biases), over 16 block views: every segment and
    # block in one kernel through a per-element index (qsum, blockq)
    [64 * 3 + 5, 7, 130, 64, 1, 200, 64 * 2, 33, 0, 90, 64 * 5 + 63, 17, 5, 70, 3, 64 * 4 + 1],
    [fusion.ROW * 4 + 1],  # one segment whose last row holds one element (a level stage's own tail kernel)
]
ROUTES = ["blockq-bq3", "blockq-bq2", "blockq-bq4", "blockq-bq8", "blockq-bl5", "blockq-bl6", "blockq-bq4-128",
          "blockq-bq3-256", "blockqscatter-bq3", "blockqscatter-bq4", "blockqscatter-bl5", "signgather",
          "signcount", "signscatter", "qsum-q8", "qsum-q4", "qsum-q2"]
SIGN = {"signgather", "signcount", "signscatter"}


def _generator(name: str, keys: torch.Tensor, rank: int, world_size: int):
    if name.startswith("blockq"):
        return noise.Stratum(keys, rank, world_size)  # stratified: one key source, a shift per rank
    return keys + rank if name.startswith("qsum") else None  # qsum: a key per segment and rank


def _round_trip(name: str, lengths: list[int], world_size: int, impl: str) -> dict[str, list[torch.Tensor]]:
    """Every rank's payload, scales and own decoded contribution; the decoded mean, and the mean
    decoded into a slice of a bucket (fp32 ranks, and rank 1 in bf16)."""
    red = REDUCERS[name]
    n = sum(lengths)
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r), device="cpu") * (r + 1)
          for r in range(world_size)]
    for r, x in enumerate(xs):  # exact zeros on every rank: a sign vote by the tie
        x[::9] = -0.0 if r == 1 else 0.0
    xs = [(x.to(torch.bfloat16) if r == 1 else x).to(DEVICE) for r, x in enumerate(xs)]
    keys = noise.draw_keys(torch.Generator().manual_seed(7), len(lengths), torch.device("cpu")).to(DEVICE)
    with dispatch.host_paths(impl == "host"), dispatch.compile_paths(impl == "compiled"):
        shared = (torch.stack([red.local_scale(x, lengths) for x in xs]).amax(0)
                  if red.needs_shared_scale else None)
        agreed = [] if shared is None else [red.agree_input(shared).cpu()]  # blockq: the scale codes
        encs = [red.encode(x, lengths, world_size, shared, _generator(name, keys, r, world_size), tie=r + 1)
                for r, x in enumerate(xs)]
        locals_ = [e.local for e in encs]  # read before the payloads are combined, as the hook does
        reduced = red.combine([e.payload for e in encs])
        scale = shared if shared is not None else torch.stack([e.scales for e in encs]).mean(0)
        mean = red.decode(reduced.clone(), scale, n, lengths, world_size)
        bucket = torch.full((n + 3,), 7.0, device=DEVICE)
        red.decode(reduced.clone(), scale, n, lengths, world_size, out=bucket[1 : 1 + n])
    return {"payload": [e.payload.cpu() for e in encs], "local": [t.cpu() for t in locals_], "mean": [mean.cpu()],
            "bucket": [bucket.cpu()], "shared": [] if shared is None else [shared.cpu()],
            "scales": [e.scales.cpu() for e in encs if e.scales is not None], "agreed": agreed}


def _assert_same(a: dict, b: dict, what: str, keys=None) -> None:
    for key in keys or a:
        assert len(a[key]) == len(b[key]), f"{what}: {key}"
        for i, (x, y) in enumerate(zip(a[key], b[key], strict=True)):
            assert torch.equal(x, y), f"{what}: {key}[{i}]"


def _check(name: str, world_size: int, layouts: list[list[int]] = LAYOUTS) -> None:
    """The compiled path (stages compiled or not, as the caller set) against eager and numba."""
    if not REDUCERS[name].capacity(world_size).ok:
        pytest.skip("over capacity")
    for lengths in layouts:
        eager, compiled = _round_trip(name, lengths, world_size, "torch"), _round_trip(name, lengths, world_size,
                                                                                        "compiled")
        assert not fusion.failed(), "torch.compile failed: the eager path ran"
        _assert_same(eager, compiled, f"compiled vs eager {lengths}")
        if not dispatch.AVAILABLE or DEVICE.type != "cpu":
            continue
        host = _round_trip(name, lengths, world_size, "host")
        if name in SIGN:  # the host path sums |x| in its own order: scales to fp32 rounding, votes bit-equal
            _assert_same(host, compiled, f"compiled vs host {lengths}", ["payload"])
            assert torch.equal(torch.sign(host["mean"][0]), torch.sign(compiled["mean"][0]))
            assert torch.allclose(host["mean"][0], compiled["mean"][0], rtol=2e-6, atol=0)
        else:
            _assert_same(host, compiled, f"compiled vs host {lengths}",
                         ["payload", "local", "mean", "bucket", "shared", "agreed"])


COMPILED_WORLD_SIZES = [int(w) for w in os.environ.get("NFAB_COMPILE_TESTS_WORLD_SIZES", "2,3").split(",")]
"""`make device-check` compiles W=2 only (about 140 graphs for W=2 and 3: minutes of builds)."""


@needs_compile
@pytest.mark.parametrize("world_size", COMPILED_WORLD_SIZES)
@pytest.mark.parametrize("name", ROUTES)
def test_compiled_stages_are_the_eager_and_the_host_path_bit_for_bit(name, world_size):
    _check(name, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("name", ROUTES)
def test_the_stages_uncompiled_are_the_eager_and_the_host_path_bit_for_bit(name, world_size):
    """W=4 and 8 add the int64 lanes of several blocks, the int32 lanes, 4-bit count words and
    signscatter's int64 shards to what W=2 and 3 reach."""
    with fusion.stages_compiled(False):
        _check(name, world_size)


LARGE_SEGMENT = [[(1 << 16) + 77]]
"""One segment from 64K elements: its sign scale's |x| sum is compiled, in the votes' graph (`summed_in_one`)."""


def _summed_calls(monkeypatch) -> list[int]:
    from nfab.wire.sign import fused as sign_fused
    calls: list[int] = []
    summed = sign_fused.votes_summed_into

    def counted(out, x, tie):
        calls.append(x.numel())
        return summed(out, x, tie)

    monkeypatch.setattr(sign_fused, "votes_summed_into", counted)
    return calls


@pytest.mark.parametrize(("name", "world_size"), [("signgather", 2), ("signgather", 4), ("signcount", 2),
                                                  ("signcount", 4), ("signscatter", 2)])
def test_a_large_segment_sums_its_sign_scale_in_the_votes_graph(name, world_size, monkeypatch):
    """The votes and the scale's |x| sum from one read of x: the eager path's scale and payload, bit for
    bit. (signscatter at W=4 writes its votes shard by shard into int32 rows and sums apart.)"""
    calls = _summed_calls(monkeypatch)
    with fusion.stages_compiled(False):
        _check(name, world_size, LARGE_SEGMENT)
    assert calls and set(calls) == {LARGE_SEGMENT[0][0]}, "the votes' graph did not sum the scale"


@needs_compile
@pytest.mark.parametrize("name", sorted(SIGN))
def test_a_large_segment_sums_its_sign_scale_in_the_compiled_votes_graph(name, monkeypatch):
    calls = _summed_calls(monkeypatch)
    _check(name, 2, LARGE_SEGMENT)
    assert calls, "the votes' graph did not sum the scale"


@needs_compile
def test_compiled_stages_compile_once_for_every_bucket_size():
    """dynamic=True: a new bucket size of the same kind (whole chunks; whole chunks and a tail) reuses
    the graphs (no compile per shape). Counted as graphs added by the second size of each kind, so
    whichever tests compiled the stages before, the check is the same."""
    for sizes in ((64 * 50, 64 * 1000), (64 * 77, 64 * 177)):
        _round_trip("blockq-bq3", [sizes[0]], 2, "compiled")
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        _round_trip("blockq-bq3", [sizes[1]], 2, "compiled")
        added = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        assert added == 0, f"{added} graphs compiled again for {sizes[1]} elements"


def test_each_kind_of_arguments_has_its_own_compiled_stage():
    """Dynamo makes a graph of its own for every size 0 or 1 and every dtype, and keeps 8 per code
    object: `fusion._compiled` takes one copy of a stage per kind, so no mix of tails and dtypes in
    a process reaches the limit."""
    kinds = {fusion._kind((torch.empty(n, dtype=dt), torch.empty(2, 3), 5)) for n in (0, 1, 2, 700) for dt in
             (torch.float32, torch.bfloat16)}
    assert len(kinds) == 6  # sizes 2 and 700 are one kind
    rows = [fusion._kind((torch.empty(n, 4),)) for n in (0, 1, 2, 9)]
    assert len(set(rows)) == 3 and rows[2] == rows[3]


def _word_stage(out: torch.Tensor, words: torch.Tensor, wide: torch.Tensor) -> torch.Tensor:
    """Integer words in, integer words out, in place and returned: what every stage does with its
    counters, keys and containers."""
    out.copy_(words ^ 0x5A5A5A5A)
    return (wide >> 3) ^ wide


def test_integer_arguments_reach_a_cpu_stage_as_float_views_and_leave_it_as_integers():
    """On the CPU a stage's int32 / int64 arguments go to the compiler as float32 / float64 views of the
    same words (`fusion._as_float_words`: inductor's AVX2 C++ reads integer vectors through a stack
    buffer) and are viewed back in the graph; every other argument, and every non-CPU tensor,
    goes as it is."""
    i32, i64, u8, f = (torch.arange(3, dtype=d) for d in (torch.int32, torch.int64, torch.uint8, torch.float32))
    words = fusion._as_float_words((i32, i64, u8, f, 5))
    assert [getattr(w, "dtype", None) for w in words] == [torch.float32, torch.float64, torch.uint8,
                                                         torch.float32, None]
    assert words[0].data_ptr() == i32.data_ptr()  # a view, not a copy
    kind = fusion._kind(words, (i32, i64, u8, f, 5))
    assert [k[2] if k else None for k in kind] == [torch.int32, torch.int64, None, None, None]
    back = fusion._integer_views(words, tuple(k[2] if k else None for k in kind))
    assert all(torch.equal(a, b) for a, b in zip(back[:4], (i32, i64, u8, f), strict=True))
    meta = torch.empty(2, dtype=torch.int32, device="meta")
    assert fusion._as_float_words((meta,))[0] is meta


@needs_compile
@pytest.mark.skipif(DEVICE.type != "cpu", reason="the float views are the CPU's (on a GPU a C++ build the "
                    "device check has no time for)")
def test_integer_words_that_are_nan_as_floats_pass_a_compiled_stage_bit_for_bit():
    """The float views carry any word, a signalling NaN's among them, through the compiled loads and
    stores unchanged (no float arithmetic touches them), in an in-place output and a returned one."""
    words = torch.tensor([0x7F800001, -1, 0x7FC00000, -(1 << 31), 0, 0x00000001] * 700, dtype=torch.int32)
    wide = torch.tensor([0x7FF0000000000001, -1, 1 << 62, 0x7FF8000000000000] * 700, dtype=torch.int64)
    want_out, got_out = torch.empty_like(words), torch.empty_like(words)
    want = _word_stage(want_out, words, wide)
    got = fusion.run(_word_stage, got_out, words, wide)
    assert not fusion.failed() and got is not None
    assert torch.equal(got_out, want_out) and torch.equal(got, want) and got.dtype == torch.int64


@needs_compile
def test_one_stage_over_more_kinds_than_dynamos_limit_stays_compiled():
    """qsum's level stage over 10 kinds of argument (empty, one-element and longer rows, fp32 and bf16
    input, uint8 and int32 output) in one process: every one compiled, the same levels as eager."""
    from nfab.wire.qsum import fused as qsum_fused

    weyl, key = fusion.weyl(fusion.ROW, DEVICE), torch.tensor([123456789123], device=DEVICE)
    args = (torch.tensor([2.0], device=DEVICE), key, fusion.int_constant(1, DEVICE),
            fusion.constant(3.5, DEVICE), fusion.constant(7.0, DEVICE), weyl)
    for rows, width in ((0, fusion.ROW), (1, fusion.ROW), (3, fusion.ROW), (1, 1), (1, 5)):
        for x_dtype in (torch.float32, torch.bfloat16):
            for out_dtype in (torch.uint8, torch.int32) if width == 5 else (torch.uint8,):
                g = torch.Generator().manual_seed(rows + width)
                x = torch.randn(rows, width, generator=g).to(DEVICE, x_dtype)
                got, want = (torch.empty(rows, width, dtype=out_dtype, device=DEVICE) for _ in range(2))
                fusion.run(qsum_fused.levels_into, got, x, *args)
                with fusion.stages_compiled(False):
                    fusion.run(qsum_fused.levels_into, want, x, *args)
                assert not fusion.failed(), "torch.compile failed: the eager path ran"
                assert torch.equal(got, want), (rows, width, x_dtype, out_dtype)


@needs_compile
def test_compiled_scale_codes_and_flag_of_edge_values_are_eager_bit_for_bit():
    """blockq's codes of every scale, its neighbours, zeros, subnormals, inf and NaN (`table.codes_of`), and
    the non-finite flag of block maxima holding an inf (`fused.flagged`): compiled, the same as eager."""
    from nfab.wire.blockq import fused as blockq_fused
    from nfab.wire.blockq import table

    s = table.SCALES
    special = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-41, 2.0**-40, 2.0**23.75, 2.0**24, 3e38, float("inf"),
                            float("nan")])
    m = torch.cat([s, torch.nextafter(s, torch.tensor(float("inf"))), torch.nextafter(s, torch.tensor(0.0)), special])
    got = fusion.run(table.codes_of, m.to(DEVICE), s.to(DEVICE))
    want = torch.searchsorted(s, torch.nan_to_num(m, nan=0.0)).clamp_(max=255).to(torch.uint8)
    maxima = torch.tensor([1.0, 2.0, float("inf"), 0.5], device=DEVICE)
    flagged = fusion.run(blockq_fused.flagged, maxima)
    assert not fusion.failed(), "torch.compile failed: the eager path ran"
    assert torch.equal(got.cpu(), want)
    assert flagged[0].isnan() and torch.equal(flagged[1:], maxima[1:])
    assert torch.equal(fusion.run(blockq_fused.flagged, maxima[:2]), maxima[:2])


@needs_compile
@pytest.mark.parametrize("base", [33, 1276])
def test_compiled_radix_stages_of_groupings_the_routes_above_do_not_compile(base):
    """The routes above, at W = 2 and 3, compile the radix stages for groups of 4 and 8 containers
    of uint8 digits; bl5 at W = 8 (radix 33: 2 containers a group) and bq8 at W = 5 (radix 1276:
    int32 digits) group otherwise. Against `radix.pack` / `radix.unpack`, a ragged last group."""
    from nfab.wire.blockq import fused, radix

    layout = radix.radix_layout(base)
    k, g = layout.digits, torch.Generator().manual_seed(base)
    n = 8 * k * 50 + 3
    values = torch.randint(0, min(base, 256), (n,), generator=g).to(torch.uint8)
    digits = torch.randint(0, base, (layout.containers_for(n) * k,), generator=g)
    digits[:k] = base - 1
    packed = fused.radix_pack(values.to(DEVICE), layout)
    unpacked = fused.radix_unpack(radix.pack(digits, layout).to(DEVICE), layout)
    assert not fusion.failed() and packed is not None and unpacked is not None
    assert torch.equal(packed.cpu(), radix.pack(values, layout))
    assert torch.equal(unpacked[: digits.numel()].cpu().to(torch.int64), digits)


@needs_compile
@pytest.mark.parametrize("lane_bits", [5, 6])
def test_compiled_one_block_int32_lanes_are_lanes_pack_and_unpack(lane_bits):
    """The int32 lanes of blockq-bq4 at W = 2, 4 and blockq-bq3 at W = 4, 8 (5-bit lanes 6 to a
    container, 6-bit 5), unpacked as digits in groups of whole words (`digits.unpack_lanes`): a
    ragged last group, an odd number of containers, every lane at its largest value and at 0."""
    from nfab.wire.qsum import fused as qsum_fused
    from nfab.wire.qsum.lanes import layout_for, pack, unpack

    layout = layout_for(lane_bits)
    assert layout.container == torch.int32 and qsum_fused.digit_lanes(layout)
    n = 40 * 50 + 3 * layout.lanes + 1
    values = torch.randint(0, layout.max_value + 1, (n,), generator=torch.Generator().manual_seed(lane_bits))
    values = values.to(torch.uint8)
    values[: layout.lanes] = layout.max_value
    values[layout.lanes : 2 * layout.lanes] = 0
    containers = pack(values, layout)
    m = containers.numel()
    packed = qsum_fused.pack(values.to(DEVICE), layout)
    unpacked = qsum_fused.unpack(containers.to(DEVICE), layout)
    assert not fusion.failed() and packed is not None and unpacked is not None
    assert torch.equal(packed.cpu(), containers)
    assert unpacked.dtype == torch.uint8 and unpacked.numel() >= m * layout.lanes
    assert torch.equal(unpacked[: m * layout.lanes].cpu().to(torch.int32), unpack(containers, layout, m * layout.lanes))
