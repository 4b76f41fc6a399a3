"""Integer lanes: several small non-negative integers packed into one machine integer.

Each lane holds one value in [0, 2**lane_bits). A container (uint8, int32 or int64)
holds `lanes` lanes side by side. When every rank's lane values are bounded so that the
*sum over W ranks* still fits in `lane_bits`, a plain integer all_reduce(SUM) of the
containers adds every lane exactly: no carry ever crosses from one lane into the next.
That turns a collective every backend has (ring, tree, gloo, NCCL) into W-way exact
counting, with no parameter server.

Signed containers keep their top bit clear (31 usable bits of int32, 63 of int64), so a
sum never wraps into the sign bit.

Element order. A container's lanes are split into *blocks* of at most 8 lanes (uint8
containers are one block). Block k holds lanes [l0, l1) and the element range
[m*l0, m*l1) of the m containers, container-major: element m*l0 + j*(l1-l0) + (l-l0)
sits in lane l of container j. For uint8 containers that is plain consecutive order.
The blocking lets the CPU path build a block from 8 consecutive 0/1 bytes with one
multiply, and decode a whole group of lanes with one table lookup (`decode_table`).
The torch path (any device) and the numpy path (CPU) produce identical containers.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

# (dtype, usable bits) in order of preference when two pack equally densely.
_CONTAINERS: tuple[tuple[torch.dtype, int, int], ...] = (
    (torch.uint8, 8, 8),  # dtype, usable bits, storage bits
    (torch.int32, 31, 32),
    (torch.int64, 63, 64),
)
_NP_CONTAINER = {torch.uint8: np.dtype("<u1"), torch.int32: np.dtype("<i4"), torch.int64: np.dtype("<i8")}
_TABLE_BITS = 15  # decode tables have at most 2**15 entries (<= 640 KiB, stays in L2)


@dataclass(frozen=True, slots=True)
class LaneLayout:
    """How lanes of `lane_bits` bits sit in a container dtype."""

    lane_bits: int
    container: torch.dtype
    lanes: int
    storage_bits: int

    @property
    def max_value(self) -> int:
        """Largest value one lane can hold (and so the largest W-rank sum)."""
        return (1 << self.lane_bits) - 1

    @property
    def bits_per_element(self) -> float:
        """Wire bits per packed element, container padding included."""
        return self.storage_bits / self.lanes

    def containers_for(self, numel: int) -> int:
        """Number of containers needed for `numel` lane values."""
        return -(-numel // self.lanes)

    @property
    def blocks(self) -> tuple[tuple[int, int], ...]:
        """Lane ranges [l0, l1) of the element blocks (see the module docstring)."""
        return _blocks(self)


def count_lane_bits(world_size: int) -> int:
    """Lane width that holds a count in [0, W]: ceil(log2(W + 1))."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    return max(1, math.ceil(math.log2(world_size + 1)))


@cache
def layout_for(lane_bits: int) -> LaneLayout:
    """The densest container layout for lanes of `lane_bits` bits (1..63)."""
    if not 1 <= lane_bits <= 63:
        raise ValueError(f"lane width must be in 1..63 bits, got {lane_bits}")
    best: LaneLayout | None = None
    for dtype, usable, storage in _CONTAINERS:
        lanes = usable // lane_bits
        if lanes == 0:
            continue
        cand = LaneLayout(lane_bits, dtype, lanes, storage)
        if best is None or cand.bits_per_element < best.bits_per_element - 1e-9:
            best = cand
    assert best is not None
    return best


@cache
def _blocks(layout: LaneLayout) -> tuple[tuple[int, int], ...]:
    if layout.container == torch.uint8:
        return ((0, layout.lanes),)
    return tuple((l0, min(l0 + 8, layout.lanes)) for l0 in range(0, layout.lanes, 8))


def _lane_views(flat: torch.Tensor, layout: LaneLayout, m: int):
    """(lane, column view) for every lane of a flat tensor of m * lanes elements."""
    for l0, l1 in layout.blocks:
        grid = flat[m * l0 : m * l1].view(m, l1 - l0)
        for lane in range(l0, l1):
            yield lane, grid[:, lane - l0]


def _numpy_ok(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and sys.byteorder == "little"


def pack(values: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """Pack non-negative integers (each <= layout.max_value) into containers.

    `values` is any integer or bool tensor; it is flattened and zero-padded to a whole
    number of containers. Returns a 1-D tensor of `layout.container` dtype.
    """
    flat = values.reshape(-1)
    if _numpy_ok(flat) and flat.dtype in (torch.bool, torch.uint8):
        fast = _pack_bytes_np(flat.contiguous().numpy().view(np.uint8), layout, flat.dtype == torch.bool)
        if fast is not None:
            return torch.from_numpy(fast)
    n = flat.numel()
    m = layout.containers_for(n)
    work = {torch.uint8: torch.uint8, torch.int32: torch.int32, torch.int64: torch.int64}[layout.container]
    padded = torch.zeros(m * layout.lanes, dtype=work, device=flat.device)
    padded[:n] = flat
    out = torch.zeros(m, dtype=work, device=flat.device)
    for lane, col in _lane_views(padded, layout, m):
        out |= col << (lane * layout.lane_bits)
    return out


def unpack(containers: torch.Tensor, layout: LaneLayout, numel: int) -> torch.Tensor:
    """Inverse of `pack` (also after an integer SUM): the first `numel` lane values.

    Returns int64 when the container is int64, else int32 (uint8 lanes come back as uint8).
    """
    mask = layout.max_value
    m = containers.numel()
    if _numpy_ok(containers) and layout.container == torch.uint8 and m:
        c = containers.contiguous().numpy()
        if layout.lane_bits == 1:
            return torch.from_numpy(np.unpackbits(c, count=numel, bitorder="little"))
        table = _lane_table_np(layout.lane_bits, layout.lanes)
        out = np.take(table, c, mode="clip").view(np.uint8)
        return torch.from_numpy(out[:numel].copy() if numel < out.size else out)
    out = torch.empty(m * layout.lanes, dtype=containers.dtype, device=containers.device)
    for lane, col in _lane_views(out, layout, m):
        torch.bitwise_and(containers >> (lane * layout.lane_bits), mask, out=col)
    return out[:numel]


def decode_table(
    containers: torch.Tensor, layout: LaneLayout, numel: int, values: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`values[lane value]` for the first `numel` lanes: unpack and look up in one go (fp32).

    `values` is a float32 table of length max_value + 1 (e.g. count -> vote). The CPU path
    looks up whole groups of lanes per table entry; both paths return identical values.
    With `out` (fp32, `numel` elements) the result is written there and `out` is returned.
    """
    m = containers.numel()
    if m == 0 or numel == 0:
        if out is not None:
            return out.zero_()
        return torch.zeros(numel, dtype=torch.float32, device=containers.device)
    direct = out is None or (_numpy_ok(out) and out.dtype == torch.float32 and out.is_contiguous())
    if (_numpy_ok(containers) and direct and values.numel() == layout.max_value + 1
            and layout.lane_bits <= _TABLE_BITS):
        res = torch.empty(numel, dtype=torch.float32) if out is None else out
        dst = res.view(-1).numpy()
        c = containers.contiguous().numpy()
        vals = values.detach().to(torch.float32).contiguous().numpy()
        b = layout.lane_bits
        for l0, l1 in layout.blocks:
            g = l1 - l0
            sub = max(d for d in range(1, g + 1) if g % d == 0 and d * b <= _TABLE_BITS)
            table = _value_table_np(vals, b, sub)
            base = m * l0  # first element of this block
            if base >= numel:
                break
            if layout.container == torch.uint8:
                idx = c
            else:
                k = g // sub
                idx = np.empty((m, k), dtype=np.intp)
                chunk_mask = (1 << (sub * b)) - 1
                for i in range(k):
                    np.bitwise_and(c >> ((l0 + i * sub) * b), chunk_mask, out=idx[:, i])
                idx = idx.reshape(-1)
            items = idx.size  # each item covers `sub` consecutive elements from `base`
            full = min(items, (numel - base) // sub)
            if full:
                np.take(table, idx[:full], mode="clip", out=dst[base : base + full * sub].view(table.dtype))
            end = min(numel, base + items * sub)
            if base + full * sub < end:  # a lookup that straddles `numel`
                rest = np.take(table, idx[full : full + 1], mode="clip").view(np.float32)
                dst[base + full * sub : end] = rest[: end - base - full * sub]
        return res
    lanes = unpack(containers, layout, numel)
    res = values.to(torch.float32)[lanes.to(torch.int64)]
    if out is not None:
        return out.copy_(res.view(out.shape))
    return res


@cache
def _lane_table_np(lane_bits: int, lanes: int) -> np.ndarray:
    """256 entries: a uint8 container -> its `lanes` lane values as one void item."""
    c = np.arange(256, dtype=np.int64)[:, None]
    shifts = np.arange(lanes, dtype=np.int64)[None, :] * lane_bits
    t = ((c >> shifts) & ((1 << lane_bits) - 1)).astype(np.uint8)
    return np.ascontiguousarray(t).view(f"V{lanes}").reshape(-1)


def _value_table_np(vals: np.ndarray, lane_bits: int, sub: int) -> np.ndarray:
    """2**(sub*lane_bits) entries: `sub` lanes -> their `sub` fp32 values as one void item."""
    key = (vals.tobytes(), lane_bits, sub)
    hit = _VALUE_TABLES.get(key)
    if hit is not None:
        return hit
    c = np.arange(1 << (sub * lane_bits), dtype=np.int64)[:, None]
    shifts = np.arange(sub, dtype=np.int64)[None, :] * lane_bits
    lane_vals = (c >> shifts) & ((1 << lane_bits) - 1)
    t = np.ascontiguousarray(vals[lane_vals]).view(f"V{4 * sub}").reshape(-1)
    if len(_VALUE_TABLES) > 64:
        _VALUE_TABLES.clear()
    _VALUE_TABLES[key] = t
    return t


_VALUE_TABLES: dict[tuple[bytes, int, int], np.ndarray] = {}

# One multiply gathers the low bits of consecutive bytes into lanes: (word type, magic, shift).
# b=2: byte i (at bit 8i) lands at bit 24+2i; b=4: byte i lands at bit 8+4i. The partial
# products never overlap, so no carry disturbs a lane (values up to the lane maximum).
_BYTE_MAGIC = {2: (np.uint32, 0x01041040, 24), 4: (np.uint16, 0x0110, 8)}


def _bit_magic(lane_bits: int) -> tuple[int, int, int]:
    """For 0/1 bytes in a uint64 and odd lane width b: byte i lands at bit K + b*i, K = 7(8-b)."""
    k = 7 * (8 - lane_bits)
    magic = sum(1 << (k - (8 - lane_bits) * i) for i in range(8))
    lsb = sum(1 << (lane_bits * i) for i in range(8))
    return magic, k, lsb


def _pack_bytes_np(v: np.ndarray, layout: LaneLayout, is_bool: bool = False) -> np.ndarray | None:
    """CPU fast path of `pack` for uint8/bool values; None when no fast path applies."""
    b, lanes = layout.lane_bits, layout.lanes
    if layout.container != torch.uint8 and (b % 2 == 0 or b > 7 or (not is_bool and int(v.max(initial=0)) > 1)):
        return None  # int containers: only 0/1 votes at odd widths take the multiply path
    n = v.size
    m = layout.containers_for(n)
    if n != m * lanes:
        padded = np.zeros(m * lanes, dtype=np.uint8)
        padded[:n] = v
        v = padded
    if layout.container == torch.uint8:
        if b == 8:
            return v.copy()
        if b == 1:
            return np.packbits(v, bitorder="little")
        word, magic, shift = _BYTE_MAGIC[b]
        prod = np.multiply(v.view(word), word(magic), dtype=word)
        return (prod >> word(shift)).astype(np.uint8)
    magic, k, lsb = _bit_magic(b)
    out = np.zeros(m, dtype=np.uint64)
    for l0, l1 in layout.blocks:
        g = l1 - l0
        block = v[m * l0 : m * l1]
        if g == 8:
            words = block.view(np.uint64)
        else:
            words8 = np.zeros((m, 8), dtype=np.uint8)
            words8[:, :g] = block.reshape(m, g)
            words = words8.view(np.uint64).reshape(-1)
        field = np.multiply(words, np.uint64(magic), dtype=np.uint64)
        field >>= np.uint64(k)
        field &= np.uint64(lsb)
        field <<= np.uint64(l0 * b)
        out |= field
    return out.view(_NP_CONTAINER[torch.int64]).astype(_NP_CONTAINER[layout.container], copy=False)


# ---- fused CPU sign encode ---------------------------------------------------------------
_SIGN_CHUNK = 1 << 16  # x elements per pass of the fused sign encoder (chunk + scratch stay in L2)


def segment_abs_sums(segments: Sequence[torch.Tensor]) -> np.ndarray:
    """sum |x| of each segment (float64), in chunks counted from the segment's own start.

    A parameter's scale must not depend on where DDP put it in a bucket (the first
    iteration after a resume uses DDP's initial layout, later ones the rebuilt layout),
    nor on whether the segments arrive as one tensor or as views of the bucket.
    """
    sums = np.zeros(len(segments), dtype=np.float64)
    longest = max((t.numel() for t in segments), default=0)
    absbuf = torch.empty(min(_SIGN_CHUNK, max(longest, 1)), dtype=torch.float32)
    for si, seg in enumerate(segments):
        for i in range(0, seg.numel(), _SIGN_CHUNK):
            j = min(i + _SIGN_CHUNK, seg.numel())
            part = absbuf[: j - i]
            torch.abs(seg[i:j], out=part)
            sums[si] += part.sum().item()
    return sums


def sign_bits_views(segments: Sequence[torch.Tensor]) -> tuple[torch.Tensor, np.ndarray]:
    """Votes (x >= 0) of consecutive segments packed 1 bit per element, little-endian, and
    their |x| sums: `sign_pack` for the 1-bit layout, read straight from views of a bucket
    (fp32, 1-D, contiguous, on CPU) with no gathered copy. Same bits as `sign_pack`."""
    n = sum(t.numel() for t in segments)
    votes = np.zeros(-(-n // 8) * 8, dtype=np.uint8)
    pos = 0
    for seg in segments:
        np.greater_equal(seg.numpy(), np.float32(0), out=votes[pos : pos + seg.numel()].view(np.bool_))
        pos += seg.numel()
    return torch.from_numpy(np.packbits(votes, bitorder="little")), segment_abs_sums(segments)


def sign_pack_supported(x: torch.Tensor, layout: LaneLayout) -> bool:
    """Whether `sign_pack` has a fused CPU path for this input and layout."""
    if not (_numpy_ok(x) and x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous()):
        return False
    if layout.container == torch.uint8:
        return layout.lane_bits in (1, 2, 4, 8)
    return layout.lane_bits % 2 == 1 and layout.lane_bits <= 7


def sign_pack(
    x: torch.Tensor, lengths: list[int], layout: LaneLayout, want_bits: bool = True
) -> tuple[torch.Tensor, np.ndarray, np.ndarray | None]:
    """Fused sign encode on CPU: one chunked pass over `x` (fp32, 1-D, contiguous).

    Per chunk it takes the votes (x >= 0: -0.0 votes positive, NaN negative, as
    `codecs.sign_bits`) and packs them into lanes
    (the containers are exactly `pack(x >= 0, layout)`). Returns (containers, |x| sums per
    segment as float64, the votes packed 1 bit per element little-endian or None). A
    segment's |x| sum depends only on its own elements, never on its neighbours or its
    offset, so every rank, every replay and every bucket layout gets the same bits.
    Requires `sign_pack_supported(x, layout)`.
    """
    xn = x.numpy()
    n = xn.size
    b, lanes = layout.lane_bits, layout.lanes
    m = layout.containers_for(n)
    sums = segment_abs_sums(torch.split(x, lengths))
    vbuf = np.zeros(_SIGN_CHUNK + 8, dtype=np.uint8)
    bits = np.empty(-(-n // 8), dtype=np.uint8) if want_bits else None

    def votes(a: int, e: int) -> np.ndarray:
        """0/1 votes of x[a:e] (e - a <= chunk); a is a multiple of 8."""
        ln = e - a
        v = vbuf[:ln]
        np.greater_equal(xn[a:e], np.float32(0), out=v.view(np.bool_))
        if bits is not None:
            bits[a // 8 : a // 8 + -(-ln // 8)] = np.packbits(v, bitorder="little")
        return v

    if layout.container == torch.uint8:
        out = np.empty(m, dtype=np.uint8)
        for a in range(0, n, _SIGN_CHUNK):
            e = min(a + _SIGN_CHUNK, n)
            v = votes(a, e)
            j0, ln = a // lanes, e - a
            pad = -(-ln // lanes) * lanes
            if b == 1:
                if bits is not None:
                    out[j0 : j0 + pad // 8] = bits[a // 8 : a // 8 + pad // 8]
                else:
                    out[j0 : j0 + pad // 8] = np.packbits(v, bitorder="little")
                continue
            vbuf[ln:pad] = 0
            if b == 8:
                out[j0 : j0 + pad] = vbuf[:pad]
                continue
            word, magic, shift = _BYTE_MAGIC[b]
            prod = np.multiply(vbuf[:pad].view(word), word(magic), dtype=word)
            out[j0 : j0 + pad // lanes] = prod.view(np.uint8)[shift // 8 :: np.dtype(word).itemsize]
        containers = out
    else:
        magic, k, lsb = _bit_magic(b)
        out = np.zeros(m, dtype=np.uint64)
        cc = _SIGN_CHUNK // 8  # containers per chunk (a multiple of 8, so chunks start on bytes)
        grid = np.zeros((cc, 8), dtype=np.uint8)
        fld = np.empty(cc, dtype=np.uint64)
        for l0, l1 in layout.blocks:
            g = l1 - l0
            for j0 in range(0, m, cc):
                a = m * l0 + g * j0
                if a >= n:
                    break
                e = min(a + g * min(cc, m - j0), n)
                v = votes(a, e)
                ln = e - a
                rows = -(-ln // g)
                if g == 8:
                    vbuf[ln : rows * 8] = 0
                    words = vbuf[: rows * 8].view(np.uint64)
                else:
                    vbuf[ln : rows * g] = 0
                    grid[:rows, :g] = vbuf[: rows * g].reshape(rows, g)
                    words = grid[:rows].reshape(-1).view(np.uint64)
                f = fld[:rows]
                np.multiply(words, np.uint64(magic), out=f)
                np.right_shift(f, np.uint64(k), out=f)
                np.bitwise_and(f, np.uint64(lsb), out=f)
                if l0:
                    np.left_shift(f, np.uint64(l0 * b), out=f)
                dst = out[j0 : j0 + rows]
                np.bitwise_or(dst, f, out=dst)
        containers = out.view(_NP_CONTAINER[torch.int64]).astype(_NP_CONTAINER[layout.container], copy=False)
    return torch.from_numpy(containers), sums, bits


# ---- bit-sliced counting of W one-bit rows (all-gathered signs) -------------------------
_PLANE_CHUNK = 1 << 16  # bytes of bit rows (8x as many elements) per lookup pass
_PLANE_TABLE_BYTES = 1 << 18


def _plane_group(planes: int) -> int:
    """Elements per table lookup for `planes` count bits: the table stays <= 256 KiB."""
    e = 8
    while e > 1 and (1 << (e * planes)) * 4 * e > _PLANE_TABLE_BYTES:
        e //= 2
    return e


def _plane_table_np(vals: np.ndarray, planes: int, e: int) -> np.ndarray:
    """2**(e*planes) entries: key (plane p's e bits at bits e*p..) -> e fp32 values as one void item."""
    key = (vals.tobytes(), -planes, e)
    hit = _VALUE_TABLES.get(key)
    if hit is not None:
        return hit
    keys = np.arange(1 << (e * planes), dtype=np.int64)
    counts = np.zeros((keys.size, e), dtype=np.int64)
    for i in range(e):
        for p in range(planes):
            counts[:, i] |= ((keys >> (e * p + i)) & 1) << p
    t = np.ascontiguousarray(vals[counts]).view(f"V{4 * e}").reshape(-1)
    if len(_VALUE_TABLES) > 64:
        _VALUE_TABLES.clear()
    _VALUE_TABLES[key] = t
    return t


def count_planes(rows: np.ndarray) -> list[np.ndarray]:
    """Bit-sliced sum of W rows of packed bits (W, nbytes): planes[p] holds bit p of each count."""
    planes: list[np.ndarray] = []
    for r in range(rows.shape[0]):
        carry = rows[r]
        for p in range(len(planes)):
            nxt = planes[p] & carry
            planes[p] ^= carry
            carry = nxt
        if len(planes) < count_lane_bits(r + 1):
            planes.append(carry.copy())  # a count of r + 1 rows needs one more bit
    return planes


def decode_bit_rows(
    rows: np.ndarray, numel: int, vals: np.ndarray, out: np.ndarray | None = None, scale: float | None = None
) -> np.ndarray:
    """`vals[count]` per element, count = how many of the W packed 1-bit rows (W, nbytes) have it set.

    `vals` has 2**count_lane_bits(W) float32 entries. The counts are never materialised:
    the rows are added bit-sliced (a few byte-wise ops per 8 elements), and each table
    lookup turns `e` elements' count bits into their `e` fp32 values at once. `scale`
    multiplies the table (fl(v * s), the same bits as scaling the output afterwards).
    """
    if out is None:
        out = np.empty(numel, dtype=np.float32)
    if numel == 0:
        return out
    planes = count_planes(rows)
    nb = len(planes)
    e = _plane_group(nb)
    table = _plane_table_np(vals, nb, e)
    if scale is not None:
        table = (table.view(np.float32) * np.float32(scale)).view(table.dtype)
    q = 8 // e  # lookups per byte
    mask = np.uint8((1 << e) - 1)
    full = numel // e  # lookups that lie wholly inside `numel`
    nbytes = rows.shape[1]
    kdt = np.uint8 if e * nb <= 8 else np.uint16  # keys never need more than 16 bits
    idx = np.empty(_PLANE_CHUNK * q, dtype=kdt)
    t8 = np.empty(_PLANE_CHUNK, dtype=np.uint8)
    acc = np.empty(_PLANE_CHUNK, dtype=kdt)
    wide = np.empty(_PLANE_CHUNK, dtype=kdt)
    for a in range(0, nbytes, _PLANE_CHUNK):
        z = min(a + _PLANE_CHUNK, nbytes)
        k = (z - a) * q
        ix = idx[:k].reshape(z - a, q)
        t, ac, wd = t8[: z - a], acc[: z - a], wide[: z - a]
        for s in range(q):
            if e == 8:
                ix[:, 0] = planes[0][a:z]
                continue
            for p in range(nb):
                np.right_shift(planes[p][a:z], np.uint8(s * e), out=t)
                np.bitwise_and(t, mask, out=t)
                if p == 0:
                    np.copyto(ac, t)
                else:
                    np.copyto(wd, t)
                    np.left_shift(wd, kdt(e * p), out=wd)
                    np.bitwise_or(ac, wd, out=ac)
            ix[:, s] = ac
        lo, hi = a * q, min(a * q + k, full)
        if hi > lo:
            np.take(table, idx[: hi - lo], mode="clip", out=out[lo * e : hi * e].view(table.dtype))
        if lo <= full < a * q + k and full * e < numel:  # the last, partial lookup
            start = max(full, lo)
            rest = np.take(table, idx[start - lo : start - lo + 1], mode="clip").view(np.float32)
            out[start * e : numel] = rest[: numel - start * e]
    return out
