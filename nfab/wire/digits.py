"""Small integers as the digits of containers, in groups of whole int64 words, as traced functions.

Why: a container of k digits (blockq's radix lanes, base R; qsum's one-block int32 lanes, base
2^b) read as a (containers, k) view is k strided byte columns, and inductor's C++ runs such a
kernel scalar (it stops vectorising at 35 strided loads and stores). Here values are handled in
*groups*: the fewest whole containers whose digits, `width` bytes each, fill whole int64 words,
the containers themselves filling whole words (`groups`). A transposing copy turns the groups
into rows -- the values' words to (words, groups) (`word_columns`), or the containers' words to
(words of a group, groups) (`columns_fn`) -- so that the kernel's every load is a contiguous row
and every operation an int64 vector one:

- packing (`pack_fn`, `pack`: blockq's radix digits): each digit a byte field of a word, times
  R^j, summed into its container;
- unpacking: the digits of each container (any R: blockq's float64 split,
  `blockq.fused.radix_unpack_fn`; R = 2^b: a shift and a mask, `lane_unpack_fn`, for
  `qsum.fused.unpack`), assembled into whole int64 words of digits (`digit_words`), whose
  uint8 / int32 view is the values.

Element order is consecutive: element i is digit i % k of container i // k (`radix`'s order, and
`lanes`' for a container of at most 8 lanes: one block). The integers are those of `radix.pack`
/ `lanes.unpack` (sums of digits times powers that never carry: exact in any order in int64).
"""

from __future__ import annotations

import math
from functools import cache

import torch

from nfab.wire import fusion


def groups(digits: int, width: int, container_bytes: int = 8) -> tuple[int, int]:
    """(containers, int64 words of values) per group: the fewest whole containers of `digits` digits
    whose digits, `width` bytes each (1, 2, 4 or 8), fill whole int64 words, and which themselves,
    `container_bytes` each (4 or 8), fill whole int64 words (k = 22 bytes: 4 containers in 11 words;
    k = 17: 8 in 17; unpacking int32 containers of 6 uint8 lanes: 4 in 3 words, of 5 lanes: 8 in 5)."""
    per_word = 8 // width
    g = math.lcm(math.lcm(digits, per_word) // digits, 8 // container_bytes)
    return g, g * digits // per_word


@cache
def columns_fn(rows: int):
    """(n,) int64 words then (t,) containers -> (rows, ceil((n + t) / rows)) int64: element r + rows * j
    of the two, one after the other, at [r, j], zero-padded (a transposing copy, one kernel): a
    group's containers' words as rows, so that an unpacking kernel reads every operand
    contiguously. The short second part is an int32 container that does not fill a word of its
    own, widened to one (non-negative: its high half zero)."""

    def columns(x: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
        g = fusion.static(rows)
        whole = torch.cat([x, rest.to(torch.int64)])
        n = whole.shape[0]
        return torch.nn.functional.pad(whole, (0, (n + g - 1) // g * g - n)).view(-1, g).t().contiguous()

    return columns


def word_columns(head: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The (groups, words) int64 words of `head` then the one row `tail`, transposed to (words,
    groups) in one kernel (`pack`: the values are read in place, only their last, partial group is
    copied; a cat of the rows first, then the transpose, cost a second copy)."""
    return torch.cat([head.t(), tail.t()], 1)


@cache
def pack_fn(radix: int, digits: int, width: int = 1):
    """Packing as a traced function: non-negative integer values of `width` bytes (uint8 levels, int32
    owner sums), read as int64 words and transposed to (words, groups) by `word_columns`, to the
    (groups, containers) int64 containers of `digits` base-`radix` digits.

    Each container is the sum of its digits times R^j, each digit a field of a word
    (`(w >> 8 * width * f) & mask`): exact in int64 (the sum stays below R^k <= 2^63), so
    `radix.pack`'s integers. Every load is a contiguous row of the transposed words (a group's
    digits fill whole words) and every operation an int64 vector one."""
    k, (g, _) = digits, groups(digits, width)
    per_word, mask = 8 // width, (1 << 8 * width) - 1
    powers = [fusion.static(radix**j) for j in range(k)]  # registered outside the trace (`fusion.static`)
    where = [[divmod(t * k + j, per_word) for j in range(k)] for t in range(g)]  # (word, field) of each digit

    def pack_digits(words: torch.Tensor) -> torch.Tensor:
        containers = []
        for t in range(fusion.static(g)):
            acc = None
            for j in range(fusion.static(k)):
                w, f = (fusion.static(i) for i in where[t][j])
                field = words[w] >> fusion.static(8 * width * f) if f else words[w]
                digit = field & fusion.static(mask) if width < 8 else field
                term = digit * fusion.static(powers[j]) if j else digit
                acc = term if acc is None else acc + term
            containers.append(acc)
        return torch.stack(containers, 1)

    return pack_digits


def digit_words(digits: list[torch.Tensor], width: int) -> torch.Tensor:
    """int64 digits in element order, one tensor per digit of a group, each over the groups, `width`
    bytes each, as the (groups, words) int64 words holding them: a uint8 / int32
    view of the words is the digits. Only these words are stored with a stride."""
    per_word = 8 // width
    packed = []
    for w in range(len(digits) // per_word):
        acc = digits[w * per_word]
        for f in range(1, per_word):
            acc = acc | (digits[w * per_word + f] << fusion.static(8 * width * f))
        packed.append(acc)
    return torch.stack(packed, 1)


@cache
def lane_unpack_fn(lane_bits: int, digits: int, width: int, container_bytes: int = 8):
    """The b-bit lanes of containers (radix 2^b, `digits` lanes) as a traced function: the containers'
    int64 words (one container, or two int32 ones side by side) of each group as rows, (words,
    groups) -- `columns_fn` -- to (groups, words) int64 words of the lanes in element order, `width`
    bytes each (`digit_words`): a shift and a mask per lane, no division."""
    g, _ = groups(digits, width, container_bytes)
    per_word = 8 // container_bytes

    def lane_digits(columns: torch.Tensor) -> torch.Tensor:
        s, top = fusion.static(lane_bits), fusion.static((1 << lane_bits) - 1)
        lanes = []
        for t in range(fusion.static(g // per_word)):
            for half in range(fusion.static(per_word)):  # an int32 container's bits above 31 are masked off
                c = columns[t] >> fusion.static(8 * container_bytes * half) if half else columns[t]
                for j in range(fusion.static(digits)):
                    lanes.append((c >> fusion.static(s * j) if j else c) & top)
        return digit_words(lanes, width)

    return lane_digits


def word_aligned(v: torch.Tensor) -> torch.Tensor:
    """`v` flat, contiguous and starting on a whole int64 word (a copy only where it is not)."""
    v = v.reshape(-1)
    if not v.is_contiguous() or (v.storage_offset() * v.element_size()) % 8:
        v = v.clone()
    return v


def word_parts(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The containers `c` as `columns_fn`'s two parts: their whole int64 words in place (`word_aligned`),
    and the last container that does not fill a word (an odd int32 one; `columns_fn` widens it to
    a word of its own) or nothing."""
    c = word_aligned(c)
    whole = c.numel() - c.numel() % (8 // c.element_size())
    return c[:whole].view(torch.int64), c[whole:]


def pack(values: torch.Tensor, radix: int, digits: int) -> torch.Tensor | None:
    """Non-negative integer `values` (uint8 levels, int32 owner sums; each below `radix`) as int64
    containers of `digits` base-`radix` digits (compiled; `radix.pack`'s integers), or None when
    compiling failed: the whole groups read in place as int64 words, the last, partial group from
    a zero-padded copy (so the kernel never reads past the values), both transposed by one copy
    (`word_columns`), then packed (`pack_fn`)."""
    v = word_aligned(values)
    width = v.element_size()
    g, words = groups(digits, width)
    span, n = g * digits, v.numel()
    whole = n // span
    tail = torch.zeros(span, dtype=v.dtype, device=v.device)
    tail[: n - whole * span] = v[whole * span :]
    columns = fusion.run(word_columns, v[: whole * span].view(torch.int64).view(whole, words),
                         tail.view(torch.int64).view(1, words))
    packed = None if columns is None else fusion.run(pack_fn(radix, digits, width), columns)
    return None if packed is None else packed.view(-1)[: -(-n // digits)]


def unpack_lanes(c: torch.Tensor, lane_bits: int, digits: int, width: int) -> torch.Tensor | None:
    """The `lane_bits`-bit lanes of the int32 / int64 containers `c` (compiled; uint8 for `width` 1,
    int32 for 4; at least m * digits of them, the caller reads a prefix), or None when compiling
    failed. The containers are transposed as int64 words (two int32 ones a word; an odd last one
    zero-extended to a word of its own), so the kernel reads every word once, contiguously: per 4M
    5- or 6-bit lanes on one core the copy took 0.35-0.42 ms as int64 words, 0.60-0.72 as int32
    containers, and the kernel 0.51-0.53 ms, 0.51-0.69."""
    flat = word_aligned(c)
    cb = flat.element_size()
    g, _ = groups(digits, width, cb)
    columns = fusion.run(columns_fn(g * cb // 8), *word_parts(flat))
    words = None if columns is None else fusion.run(lane_unpack_fn(lane_bits, digits, width, cb), columns)
    return None if words is None else words.view(torch.uint8 if width == 1 else torch.int32).view(-1)
