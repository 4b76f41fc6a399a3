"""What the hook hands its callback, and what the callback hands back: immutable values, passed once.

    hook body (DDP's thread, bucket order)      callback (any thread, any order)
    ------------------------------------        --------------------------------
    encode groups -> `EncodedGroup` per group
    launch       -> `Launch` (frozen) ------->  decode into the bucket
                                                `Outcome` (frozen) -> Runtime's outcome list
    next step's first hook (or step_stats): fold every (Launch, Outcome) pair of the step,
    reading its device values to the host once.

The hook never reads what a callback wrote during the step, and a callback writes only
the bucket buffer (DDP's) and one `Outcome`; nothing is mutated by both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nfab.runtime.control.controller import BucketRoutes, Group
from nfab.runtime.control.word import Columns
from nfab.runtime.core.coalesce import Part
from nfab.runtime.core.plan import BucketPlan


@dataclass(frozen=True, slots=True)
class EncodedGroup:
    """The hook's record of one group, encoded and not yet launched: its payload (the reducer's
    `wire.contract.Encoded` payload, or the pre-scaled FP32 values), where its scales sit in the
    control word, and what the callback and the fold need to decode it and commit its error
    feedback. Handed from encode (`encode.finish_group`) to launch (`encode.launch_each`,
    `encode.launch_coalesced`), then carried in its `Sent`."""

    group: Group
    payload: torch.Tensor
    scale_cols: Columns | None = None
    """The group's per-slice sign scales in the control word (averaged over ranks)."""
    amax_cols: Columns | None = None
    """The group's per-slice max |x| in the control word (qsum)."""
    shared: torch.Tensor | None = None
    """The scale qsum encoded with (agreed, delayed, or this rank's own when gathered)."""
    residuals: tuple[tuple[str, torch.Tensor], ...] = ()
    """Error feedback staged per slice: committed at the fold unless the bucket was non-finite."""
    weights: torch.Tensor | None = None
    """Per element, what the group was divided by before encoding (block-scaled qsum in the
    optimizer's preconditioned space): the decoded mean is multiplied by it."""
    sq: torch.Tensor | None = None
    """The group's |x|^2 when its encoder took it on its own read (left out of the bucket's
    norm pass; the control word's |g|^2 adds it back)."""


@dataclass(frozen=True, slots=True)
class Sent:
    """One group after launch: its encoding and where its result arrives."""

    enc: EncodedGroup
    future: torch.futures.Future | None
    """The group's own collective (None when it rides the coalesced all-gather)."""
    part: Part | None
    """Its bytes in each row of the coalesced all-gather (None on its own collective)."""


@dataclass(frozen=True, slots=True)
class Probe:
    """A fidelity probe: a strided FP32 sample of the lossy groups, all-reduced beside them."""

    future: torch.futures.Future
    numel: int
    regions: frozenset[str] = frozenset()
    """The regions this probe samples (a group's slices outside them send no sample)."""


@dataclass(frozen=True, slots=True)
class LevelSent:
    """A bucket's two-level groups (`twolevel`), reduced in the hook body: bytes per level and
    the error feedback they staged (committed at the fold unless the bucket was non-finite)."""

    intra_bytes: float
    """Node-local reduce-scatter + all-gather, in the bucket's dtype (the fast link)."""
    inter_bytes: float
    """The route across nodes at W = nodes, scales included (the slow link)."""
    collectives: int
    residuals: tuple[tuple[str, torch.Tensor], ...] = ()


@dataclass(frozen=True, slots=True)
class Launch:
    """Everything the callback needs, written once by the hook."""

    index: int
    plan: BucketPlan
    routes: BucketRoutes
    buffer: torch.Tensor
    sent: tuple[Sent, ...]
    ctrl: torch.Tensor | None
    """Receive buffer of the control words' own all-gather (W words), when sent on its own."""
    ctrl_part: Part | None
    """The control word inside the coalesced rows, when coalesced."""
    rows: torch.Tensor | None
    """Receive buffer of the coalesced all-gather (W rows), when coalesced."""
    probe: Probe | None
    wire_bytes: float
    baseline_bytes: float
    """Bytes plain DDP sends for this bucket, in the bucket's own dtype."""
    collectives: int
    scale_rounds: int
    elements: tuple[tuple[str, int], ...]
    phases: tuple[tuple[str, float], ...]
    """Seconds the hook body spent in each phase for this bucket (`HOOK_PHASES`)."""
    fidelity_cols: tuple[tuple[str, ...], Columns] | None = None
    """The step's first word only: the previous step's per-region probe fidelity this rank
    measured (regions, and their `fidelity.ROW_FIELDS` columns), agreed over ranks at the fold."""
    levels: LevelSent | None = None
    """Its lossy groups' two-level reduction, already in the buffer (with a hierarchy)."""
    loss_scale: torch.Tensor | None = None
    """The loss scale the bucket's gradients carried (`EncodeContext.loss_scale`): its agreed max |x|
    go to the delayed-scale history divided by it."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one bucket's callback produced (device values; read on the host at the fold)."""

    index: int
    table: torch.Tensor | None
    """The bucket's all-gathered control words (W, n), when it sent one."""
    unsent_bad: torch.Tensor | None
    """For a bucket without a control word: its reduced values were non-finite (0-d bool)."""
    amax: tuple[tuple[tuple[str, ...], torch.Tensor], ...]
    """Per qsum group: its slices' names and their agreed max |x| (MAX over ranks)."""
    saturated: tuple[torch.Tensor, ...]
    """Per summed qsum group: how many of its slices exceeded the shared scale."""
    callback_time_s: float
    probe: tuple[tuple[tuple[tuple[str, str, bool, int], ...], torch.Tensor], ...] = ()
    """Per probed group: its parameters (name, region, preconditioned, samples) and their
    probe sums (`fidelity.STAT_FIELDS`) on the device; folded per region at the step's end,
    and the next step's first control word carries the result so ranks decide on agreed values."""


HOOK_PHASES = ("plan", "norm", "encode", "launch")
"""The hook body's phases, timed per bucket in thread CPU (`StepStats.hook_phases`; the callback
adds `decode`, the step boundary `fold`). A bucket launched from the next hook body (its scale
agreement in flight) counts both parts of its encode, and its launch, as its own."""

