"""nfab's FSDP2 front end: a `ReduceScatter` comm on every `fully_shard` module, over one runtime.

FSDP2 reduces each param group's gradients with one reduce-scatter per module per step, calling
`FSDPModule.set_custom_reduce_scatter`'s comm with the group's flat gradient viewed (W, C) and this
rank's output shard (C,). Per call:

1. route: the controller's groups over the module's row layout (`core/shards.py`): the same
   regions, globs, phases and demotions as on DDP, a pure function of agreed state;
2. a control word ([local |g|^2, loss], and in the step's first call the previous step's probe
   sums) is all-gathered, launched first (asynchronous);
3. FP32 groups go through `reduce_scatter_tensor` with FSDP2's own op (the whole input when the
   module is all FP32: exactly plain FSDP2's collective); lossy groups through the exact low-bit
   reduce-scatters of `core/rowscatter.py`, each rank decoding only its own row; on a probe step
   a lossy group's probed slices are also sampled and reduce-scattered in FP32, and each rank
   compares its decoded row with that exact row (`core/shardprobe.py`);
4. a non-finite |g|^2 on any rank fills the output with NaN on every rank (decided on the device from the
   gathered word: no host read in the comm).

The step boundary is the first reduce-scatter of a module that already reduced this step (FSDP2
calls each module once per synced backward), or `step_stats()`: there the step's words and probe
sums are read to the host once and folded into statistics and health, so the next step's routes
are host decisions made from values every rank holds bit for bit.

Control is DDP's (`RuntimeState`): probes rotate over the lossy regions, space out once the run is
quiet and stay within `Health.probe_budget`; a loss spike or gradient-norm jump opens an FP32
shadow window that probes every lossy region, and only a region whose probe (the W ranks' sums
added) falls below `min_fidelity_cosine` is demoted, from the next step on, on every rank.

Error feedback is not offered here: a residual per parameter would be a full-size unsharded
gradient on every rank, what sharding was chosen to avoid. nfab keeps no per-rank copy of any
gradient between calls. Within a call a codec reads the rows where they lie and allocates their
packed levels or votes and its own row's decode; a group that is only part of the chunk (a mixed
module under block routes or qsum) copies its columns, at most the group's flat gradient.

Reading the layout needs FSDP2's parameter records (`FSDPParam`'s padded shard size and
unsharded size): torch exposes no public accessor, so `group_entries` is the one place that
reads them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from nfab.errors import NfabError
from nfab.profile.schema import Profile
from nfab.runtime.bindings import classify
from nfab.runtime.control import fidelity
from nfab.runtime.control.controller import FP32, BucketRoutes, Group
from nfab.runtime.control.fidelity import RegionSums
from nfab.runtime.control.moment import NoiseMoment
from nfab.runtime.core import rowscatter, shardprobe
from nfab.runtime.core.fold import read_to_host
from nfab.runtime.core.shards import ShardLayout, build_layout, row_segments, row_sources
from nfab.runtime.frontends.fsdp_layout import Codec, ShardCost, codec_for, fsdp_modules, group_entries
from nfab.runtime.state import RuntimeState
from nfab.runtime.stats import StepStats
from nfab.wire.blockq.scatter import BlockQScatter
from nfab.wire.contract import all_gather_flat, allgather_factor, reduce_scatter_flat
from nfab.wire.cost import CostModel
from nfab.wire.registry import REDUCERS
from nfab.wire.sign.scatter import SignScatter


@dataclass(slots=True)
class CallRecord:
    """One reduce-scatter of a step, as the fold reads it."""

    layout: ShardLayout
    routes: BucketRoutes
    word: torch.Tensor
    """The gathered control words, (W, 2 + carried sums): each rank's [|g|^2, loss, ...]."""
    wire_bytes: float
    baseline: float
    collectives: int
    elements: dict[str, int] = field(default_factory=dict)
    fallbacks: tuple[tuple[str, str], ...] = ()
    seconds: float = 0.0
    carried: tuple[str, ...] = ()
    """The regions whose previous-step probe sums the word carries after its two fields (first call)."""
    probes: tuple[tuple[tuple, torch.Tensor], ...] = ()
    """Per probed group: its parameters and this rank's probe sums on the device (`shardprobe.compare`)."""
    probe_bytes: float = 0.0
    """Of `wire_bytes`: the probes' FP32 reduce-scatters and the carried sums."""
    ready: Any = None
    """On CUDA, an event recorded on the reduce-scatter stream after the word and the probe sums: the
    fold waits on it (FSDP2's own end-of-backward wait is skipped under `set_is_last_backward(False)`)."""


class ShardedRuntime(RuntimeState):
    """nfab's state for an FSDP2 model on one rank: `observe_loss`, `step_stats`, `state_dict` as on DDP."""

    def __init__(self, root: nn.Module, profile: Profile, *, explicit: bool, cost_model: CostModel | None,
                 total_steps: int | None = None, seed: int = 0, head_modules: tuple[str, ...] | None = None,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(profile, dist.get_world_size(group), dist.get_rank(group), explicit=explicit,
                         cost_model=ShardCost(cost_model) if cost_model is not None else None,  # type: ignore[arg-type]
                         total_steps=total_steps, seed=seed)
        self.group = group
        self.regions = {n: b.region for n, b in classify(root, head_modules).items()}
        self.param_index = {n: i for i, n in enumerate(self.regions)}
        self.error_feedback = False
        self.moment: NoiseMoment | None = None  # attach(noise_moment=): block routes' rounding noise out of v
        self.comms: list[NfabReduceScatter] = []
        self._records: list[CallRecord] = []
        self._reduced: set[int] = set()
        self._sums_next: dict[str, RegionSums] = {}  # this rank's last probe: the next first word carries it

    # ---- public -------------------------------------------------------------------------
    def step_stats(self) -> StepStats | None:
        """Statistics of the last finished step (call after backward; None before any)."""
        if self._records:
            self._finish_step()
        return self.history[-1] if self.history else None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the step (noise is seeded per step) and health.
        Per rank: nothing here is a gradient, so every rank's state is the same few numbers."""
        self.step_stats()
        # the last probe's sums ride the next step's first word: a resumed run sends them too
        return {**self.base_state(), "carried_probe": shardprobe.carried_state(self._sums_next)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_base_state(state)
        self._sums_next = shardprobe.load_carried(state.get("carried_probe"))

    # ---- the comm -----------------------------------------------------------------------
    def reduce_scatter(self, comm: NfabReduceScatter, output: torch.Tensor, inp: torch.Tensor,
                       group: dist.ProcessGroup, op: Any) -> None:
        """One module's reduce-scatter: `output` gets this rank's row of the op over the W ranks' `inp`."""
        if id(comm) in self._reduced:  # a module reduces once per synced backward: a new step began
            self._finish_step()
        self._reduced.add(id(comm))
        t0 = time.thread_time()
        w, lay = self.world_size, comm.layout
        if inp.numel() != lay.numel:
            raise NfabError(f"FSDP2 reduce-scatter input of {inp.numel()} elements, layout of {lay.numel}: "
                            "a parameter without a gradient changes the group's layout (unsupported)")
        rows = inp.view(w, lay.chunk)
        window = self.window
        if window is not None and not self._records and window.pending is not None:  # a window ended: agree
            self.adopt(window.agree(inp.device))
        sampled = 0
        if window is not None and window.measuring(self.step):  # before any group reads or scales the rows
            sampled = window.take_rows(id(comm), lay.params, lay.chunk, inp)  # in this call's wire bytes
        phase = self.controller.phase(self.step)
        routes = self.controller.routes(comm.plan, phase, self.health.demoted())
        probing = self.probing(phase) if routes.has_lossy else frozenset()
        word, word_fut, carried = self._launch_word(inp, group)
        probe_bytes = shardprobe.word_bytes(len(carried), w)
        nbytes, collectives = allgather_factor(w) * 8.0 + probe_bytes + sampled, 1 + (sampled > 0)
        probes: list[tuple[tuple, torch.Tensor]] = []
        elements: dict[str, int] = {}
        fallbacks = list(routes.fallbacks)
        real = lay.by_name()
        for g in routes.groups:
            label = REDUCERS[g.key].route  # sign, bq3, ...: the codec family, whichever DDP reducer won
            codec = codec_for(label)
            if g.key != FP32 and codec is None:
                fallbacks.extend(("fsdp", s.region) for s in g.slices)
                label = "fp32"
            elements[label] = elements.get(label, 0) + sum(real[s.name].numel for s in g.slices)
            if codec is None:
                nbytes += self._plain(rows, output, g, group, op, comm)
            else:
                res, probe = self._lossy(codec, rows, output, g, group, op, comm, probing)
                nbytes += res.wire_bytes
                collectives += res.collectives - 1
                if probe is not None:
                    probes.append(probe[0])
                    nbytes += probe[1]
                    probe_bytes += probe[1]
                    collectives += 1
            collectives += 1
        word_fut.wait()
        # a non-finite |g|^2 on any rank: the output NaN everywhere (on the device, no host read), as plain
        # FSDP2's would be non-finite: a loss scaler skips the step (`decode._spoil_if` says why)
        output.masked_fill_(~torch.isfinite(word[:, 0].sum()), float("nan"))
        baseline = rowscatter.plain_bytes(lay.chunk, w, inp.element_size())
        ready = None
        if output.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()  # on the stream this runs on: FSDP2's reduce-scatter stream
        self._records.append(CallRecord(lay, routes, word, nbytes, baseline, collectives, elements,
                                        tuple(sorted(set(fallbacks))), time.thread_time() - t0, carried,
                                        tuple(probes), probe_bytes, ready))

    def _launch_word(self, inp: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, Any, tuple[str, ...]]:
        """All-gather this rank's [|g|^2 of the input, loss] (loss: NaN but in the step's first call, which
        also carries this rank's sums of the previous step's probe); the regions those sums are of."""
        sq = torch.linalg.vector_norm(inp, dtype=torch.float32).square()
        first = not self._records
        loss = self.take_loss() if first else None
        if isinstance(loss, torch.Tensor):
            if loss.device.type == "cuda":  # made on the default stream, read here on FSDP2's reduce-scatter
                loss.record_stream(torch.cuda.current_stream(loss.device))  # stream: not reused before that
            loss_t = loss.to(device=inp.device, dtype=torch.float32).reshape(())
        else:
            loss_t = torch.full((), math.nan if loss is None else loss, dtype=torch.float32, device=inp.device)
        mine = torch.stack([sq, loss_t])
        carried: tuple[str, ...] = ()
        if first and self._sums_next:
            carried, values = shardprobe.word_values(self._sums_next, inp.device)
            mine = torch.cat([mine, values])
        word = torch.empty(self.world_size * mine.numel(), dtype=torch.float32, device=inp.device)
        work = all_gather_flat(word, mine, group=group, async_op=True)
        return word.view(self.world_size, -1), work, carried

    def _plain(self, rows: torch.Tensor, output: torch.Tensor, g: Group, group: dist.ProcessGroup, op: Any,
               comm: NfabReduceScatter) -> float:
        """An FP32 group: `reduce_scatter_tensor` with FSDP2's own op (on the whole input when it is the
        whole row). PREMUL_SUM(f) is sent as x * f summed (what it means; gloo has no PREMUL_SUM)."""
        w = self.world_size
        premul = _premul_factor(op, comm.divide_factor())
        part = _group_rows(rows, g)
        if premul is not None:
            part = part.mul_(premul) if g.whole else part.mul(premul)
            op = dist.ReduceOp.SUM
        out = output if g.whole else torch.empty(part.shape[1], dtype=part.dtype, device=part.device)
        reduce_scatter_flat(out, part.reshape(-1), op=op, group=group)
        if not g.whole:
            _write_row(output, out, g)
        return rowscatter.plain_bytes(part.shape[1], w, part.element_size())

    def _lossy(self, codec: Codec, rows: torch.Tensor, output: torch.Tensor, g: Group,
               group: dist.ProcessGroup, op: Any, comm: NfabReduceScatter, probing: frozenset[str],
               ) -> tuple[rowscatter.RowResult, tuple[tuple[tuple, torch.Tensor], float] | None]:
        """A lossy group: the exact low-bit reduce-scatter of its rows, this rank's row written back,
        scaled for FSDP2's op; with its probe's sums and bytes when `probing` samples one of its slices
        (sampled from the rows before the codec reads them)."""
        w, numel = self.world_size, g.numel
        names = tuple(s.name for s in g.slices)
        probe = shardprobe.launch(rows, g, probing, w, group) if probing else None
        direct = output if g.whole and output.dtype == torch.float32 else None  # decoded in place, no row buffer
        res = self._decode(codec, rows, g, comm, group, direct)
        mean = res.mean[:numel]
        probed = None if probe is None else (shardprobe.compare(probe, mean, w), probe.wire_bytes)
        factor = _op_factor(op, w, comm.divide_factor())
        if res.variance is not None and self.moment is not None:  # each parameter's real share of the row
            var = res.variance.mul_(factor * factor) if factor != 1.0 else res.variance
            by_name, pos, parts = comm.layout.by_name(), 0, []
            for s in g.slices:
                parts.append(var[pos : pos + by_name[s.name].real(self.rank)])
                pos += s.numel
            self.moment.record(names, [t.numel() for t in parts], torch.cat(parts))
        if mean.data_ptr() != output.data_ptr():
            _write_row(output, mean, g)
        if factor != 1.0:
            _scale_row(output, factor, g)
        return res, probed

    def _decode(self, codec: Codec, rows: torch.Tensor, g: Group, comm: NfabReduceScatter,
                group: dist.ProcessGroup, direct: torch.Tensor | None) -> rowscatter.RowResult:
        """This rank's row of the mean of a lossy group over the W ranks' `rows` (W, C): the codec's
        exact reduce-scatter (sign reads its segments where they lie; block routes and qsum read the
        rows there when the group is the whole chunk, else copy its columns); `direct`: the output
        to decode into, when the group is all of it."""
        w, numel = self.world_size, g.numel
        names = tuple(s.name for s in g.slices)
        padded = rowscatter.row_numel(codec, numel, w)
        segments = comm.segments(names, padded)
        if isinstance(codec, SignScatter):
            return rowscatter.sign_reduce_scatter(codec, rows.reshape(-1), comm.sources(names, padded), segments,
                                                  numel, self.rank, group, direct, self.step)
        x = _group_rows(rows, g)
        if isinstance(codec, BlockQScatter):
            return rowscatter.block_reduce_scatter(codec, x, segments, self._seeds(comm, names, padded),
                                                   self.rank, group, direct, self.moment is not None)
        # qsum: ranks round independently (this rank's seeds), as on DDP
        return rowscatter.qsum_reduce_scatter(codec, x, segments, self._seeds(comm, names, padded, self.rank),
                                              self.rank, group, direct)

    def _seeds(self, comm: NfabReduceScatter, names: tuple[str, ...], padded: int, who: int = -1) -> np.ndarray:
        """One rounding-noise seed per segment of every row, from (seed, who, step, parameter, row, part),
        independent of the module: `who` -1 gives the same seeds on every rank (block routes' stratified
        rounding shifts by the rank), a rank's own index its own seeds (qsum rounds independently)."""
        out = []
        by_name = comm.layout.by_name()
        for r in range(self.world_size):
            total = 0
            for name in names:
                p = by_name[name]
                real = p.real(r)
                idx = self.param_index.get(name, -1)
                out.extend(hash((self.seed, who, self.step, idx, r, part)) & 0x7FFF_FFFF_FFFF
                           for part, n in enumerate((real, p.shard_numel - real)) if n)
                total += p.shard_numel
            if padded > total:
                out.append(hash((self.seed, who, self.step, -1, r, 2)) & 0x7FFF_FFFF_FFFF)
        return np.array(out, dtype=np.uint64)

    def _finish_step(self) -> None:
        """Fold the step's gathered words and probe sums into statistics and health (one host read of
        them all): the previous step's probe, agreed from the first word, is what health judges."""
        if not self._records:
            return
        t0 = time.thread_time()
        phase = self.controller.phase(self.step)
        records, w = self._records, self.world_size
        sums = [t for r in records for _, t in r.probes]
        for r in records:
            if r.ready is not None:  # the stream reading them waits for the one that wrote them
                torch.cuda.current_stream(r.word.device).wait_event(r.ready)
        host = read_to_host([*(r.word for r in records), *sums])
        words = [np.asarray(flat, dtype=np.float64).reshape(w, -1) for flat in host[: len(records)]]
        head = np.stack([wd[:, :2] for wd in words])  # (calls, W, 2): each rank's [|g|^2, loss]
        per_rank_sq = head[:, :, 0].sum(axis=0)
        skipped = not bool(np.isfinite(per_rank_sq).all())
        first_loss = head[0, :, 1]
        st = StepStats(self.step, phase.name)
        st.wire_bytes = int(sum(r.wire_bytes for r in records))
        st.baseline_wire_bytes = int(sum(r.baseline for r in records))
        st.probe_wire_bytes = int(round(sum(r.probe_bytes for r in records)))
        for r in records:
            for k, v in r.elements.items():
                st.route_elements[k] = st.route_elements.get(k, 0) + v
        reasons = sorted({f"{why}({region})" for r in records for why, region in r.fallbacks})
        st.fallback_reason = "; ".join(reasons)
        st.skipped = skipped
        st.flag_fallbacks({why for r in records for why, _ in r.fallbacks})
        st.grad_norm = 0.0 if skipped else float(math.sqrt(per_rank_sq.mean()))
        st.loss = float(first_loss.mean()) if np.isfinite(first_loss).all() else None
        st.buckets = len(records)
        st.collectives = sum(r.collectives for r in records)
        # the previous step's probe: every rank's sums, added in rank order (the same bits everywhere)
        agreed = shardprobe.agree(words[0].tolist(), records[0].carried, 2) if records[0].carried else {}
        fid = {region: s.fidelity() for region, s in agreed.items()}
        st.fidelity_cosine = fidelity.sums_cosine(agreed)
        st.region_cosine = {region: f.cosine for region, f in fid.items()}
        lossy = frozenset().union(*(self.controller.lossy_regions(r.layout.plan(), phase) for r in records))
        events = self.observe_health(st, lossy, fid, frozenset(fid))
        st.events = [f"{e.kind}:{e.reason}:{','.join(e.regions)}" for e in events]
        # this step's probe: this rank's sums per region, for the next step's first word (none when skipped)
        params: dict[str, fidelity.ParamProbe] = {}
        if not skipped:
            flat = iter(host[len(records) :])
            for meta, _ in (p for r in records for p in r.probes):
                params.update(fidelity.read_params(meta, next(flat)))
        self._sums_next = fidelity.region_sums(params)
        if self.window is not None and self.window.measuring(self.step):
            st.calibrating, st.calibration_wire_bytes = True, self.window.fold(self.step, self.reference_series())
        st.hook_phases = {"reduce_scatter": sum(r.seconds for r in records), "fold": time.thread_time() - t0}
        st.hook_time_s = sum(st.hook_phases.values())
        self.history.append(st)
        self.step += 1
        self._records, self._reduced = [], set()


class NfabReduceScatter(ReduceScatter):
    """The comm nfab installs on one FSDP2 module (`set_custom_reduce_scatter`)."""

    def __init__(self, runtime: ShardedRuntime, layout: ShardLayout, param_group: Any) -> None:
        self.runtime = runtime
        self.layout = layout
        self.plan = layout.plan()
        self._param_group = param_group
        self._segments: dict[tuple[tuple[str, ...], int], list[list[int]]] = {}
        self._sources: dict[tuple[tuple[str, ...], int], list[tuple[int, int]]] = {}

    def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN201 - FSDP2's signature
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN201
        self.runtime.reduce_scatter(self, output_tensor, input_tensor, group, op)
        return None

    def divide_factor(self) -> float | None:
        """FSDP2's gradient divide factor for this module (`set_gradient_divide_factor`), if set."""
        return getattr(self._param_group, "gradient_divide_factor", None)

    def segments(self, names: tuple[str, ...], padded: int) -> list[list[int]]:
        """Every row's segment table for a group of parameters (cached: the layout is fixed)."""
        key = (names, padded)
        seg = self._segments.get(key)
        if seg is None:
            seg = self._segments[key] = [row_segments(self.layout, names, r, padded)
                                         for r in range(self.layout.world_size)]
        return seg

    def sources(self, names: tuple[str, ...], padded: int) -> list[tuple[int, int]]:
        """Where each of `segments(names, padded)`'s segments lies in the input (cached)."""
        key = (names, padded)
        got = self._sources.get(key)
        if got is None:
            got = self._sources[key] = row_sources(self.layout, names, padded)
        return got


def _group_rows(rows: torch.Tensor, g: Group) -> torch.Tensor:
    """A group's columns of the W ranks' rows (W, C): the rows themselves when the group is all of
    them (read where they lie), else its slices' columns copied side by side."""
    return rows if g.whole else torch.cat([rows[:, s.offset : s.offset + s.numel] for s in g.slices], dim=1)


def _write_row(output: torch.Tensor, values: torch.Tensor, g: Group) -> None:
    """A group's part of this rank's row, written where its slices lie in the output."""
    pos = 0
    for s in g.slices:
        output[s.offset : s.offset + s.numel].copy_(values[pos : pos + s.numel])
        pos += s.numel


def _scale_row(output: torch.Tensor, factor: float, g: Group) -> None:
    """A group's part of the output times FSDP2's op factor (in place)."""
    if g.whole:
        output.mul_(factor)
        return
    for s in g.slices:
        output[s.offset : s.offset + s.numel].mul_(factor)


def _premul_factor(op: Any, divide_factor: float | None) -> float | None:
    """f of a PREMUL_SUM(f) op (the op's own, else 1 / FSDP2's divide factor); None for other ops."""
    if op != dist.ReduceOp.PREMUL_SUM:
        return None
    factor = getattr(op, "factor", None)
    if isinstance(factor, float | int):
        return float(factor)
    if divide_factor is None:
        raise NfabError("FSDP2 asked for PREMUL_SUM without a gradient divide factor")
    return 1.0 / divide_factor


def _op_factor(op: Any, world_size: int, divide_factor: float | None) -> float:
    """What multiplies the decoded mean for FSDP2's op: 1 for AVG, W for SUM (divides done outside,
    `set_force_sum_reduction_for_comms`), W / factor for PREMUL_SUM(1 / factor)."""
    if op == dist.ReduceOp.AVG:
        return 1.0
    if op == dist.ReduceOp.SUM:
        return float(world_size)
    premul = _premul_factor(op, divide_factor)
    if premul is not None:
        return world_size * premul
    raise NfabError(f"FSDP2 reduce-scatter op {op} is not supported by nfab (AVG, SUM, PREMUL_SUM are)")


def install(runtime: ShardedRuntime, root: nn.Module) -> list[NfabReduceScatter]:
    """Derive every module's layout and install nfab's reduce-scatter on it (all checked first)."""
    names = {id(p): n for n, p in root.named_parameters()}
    found = []
    for module in fsdp_modules(root):
        got = group_entries(module, names, runtime.regions)
        if got is not None:
            found.append((module, *got))
    comms = []
    for module, pg, entries in found:
        comm = NfabReduceScatter(runtime, build_layout(entries, runtime.world_size), pg)
        module.set_custom_reduce_scatter(comm)
        comms.append(comm)
    runtime.comms = comms
    return comms
