"""The nfab DDP communication hook and its state (`Runtime`).

Per bucket, in the hook body (DDP calls it in bucket order on every rank):

1. look up the bucket plan and this step's groups (controller: pure function of agreed
   state, so every rank launches the same collectives in the same order);
2. encode each group (adding error-feedback residuals on lossy routes; slices that need
   neither residuals nor a probe sample are read where they lie in the bucket); qsum
   encodes with a scale every rank already agrees on (see "qsum scales" below);
3. build the control word: [non-finite flag, loss, has loss, per-slice sign scales,
   per-slice qsum max |x|], all-gathered and averaged in rank order, so bits match on
   every rank and in the one-process replay (only buckets with a lossy group, and the
   step's first bucket);
4. launch, asynchronously: one collective per group plus the control word's all-gather,
   or — beside a signgather group, when the cost model says it is cheaper (always at
   W=2) — the control word and every payload as the bytes of ONE all-gather, each
   group's W copies combined on receipt exactly as its own collective would;
5. return a future whose callback decodes, writes every slice back to its own offset
   (decoded, scaled and written in one pass), and zeroes the bucket on all ranks if any
   rank saw a non-finite gradient.

No collective is ever launched from a callback (callbacks finish in different orders on
different ranks). What the control words say is folded into the health state at the
start of the next step, before any route for that step is chosen.

qsum scales. Lanes summed on the wire need one scale on every rank before encoding.
Agreeing it in the step is a blocking all-reduce (MAX) inside the hook, and on a busy
link that small collective queues behind the payloads already in flight, stalling
backward. Three cases:
- a qsum slice in a coalesced bucket is gathered, not summed: each rank encodes with its
  own per-segment max |x| (control word) and every rank decodes each row with that
  row's scale — no agreement, no saturation, finer levels;
- otherwise `qsum_scale="exact"` (default) agrees by the blocking MAX, as calibrate's
  replay does (`StepStats.scale_rounds` counts them);
- `qsum_scale="delayed"` ("delayed scaling", as FP8 recipes scale by an amax history):
  a slice that was on qsum in the previous step encodes with the max of its agreed
  max |x| over the last `AMAX_HISTORY` steps, identical on every rank; elements beyond
  it saturate at +-scale for that step (`StepStats.saturated_slices`). Measured in
  `nfab bench study`, that clipping cost GPT +1.4% loss against exact's +0.06%, so it is
  opt-in. A slice's first qsum step, or its first after a gap, agrees exactly.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations
# against dist.GradBucket and torch.futures.Future at registration.
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nfab.profile.schema import Profile
from nfab.runtime import health as health_mod
from nfab.runtime.bindings import classify
from nfab.runtime.controller import FP32, BucketRoutes, Controller, Group
from nfab.runtime.plan import BucketPlan, build_plan, plan_key
from nfab.runtime.stats import StepStats
from nfab.wire.cost import CostModel
from nfab.wire.qsum import QSum
from nfab.wire.reducer import write_into
from nfab.wire.reducers import REDUCERS, all_gather_flat, allgather_factor, allreduce_factor, mean_of_ranks

log = logging.getLogger(__name__)

_CTRL_HEAD = 3  # nonfinite, loss, has_loss
HISTORY_STEPS = 4096
AMAX_HISTORY = 16
"""Steps of agreed max |x| a qsum slice's delayed scale is the max of."""
QSUM_SCALES = ("delayed", "exact")
SIGNGATHER = "signgather"


@dataclass(slots=True)
class _Launched:
    """One group's payload collective in flight, and what decoding it needs."""

    group: Group
    future: torch.futures.Future | None
    """The group's own collective (None while unlaunched, or when it rides the coalesced gather)."""
    scale_cols: list[int] | None
    """Columns of the control word that hold this group's per-slice sign scales."""
    shared: torch.Tensor | None
    """The scale qsum encoded with (delayed, or agreed by MAX before encoding)."""
    amax_cols: list[int] | None = None
    """Columns of the control word that hold this group's per-slice max |x| (qsum)."""
    payload: torch.Tensor | None = None
    """What the group sends, until it is launched."""
    part: tuple[int, int, torch.dtype] | None = None
    """(byte offset, bytes, dtype) of the payload in each row of the coalesced all-gather."""


@dataclass(slots=True)
class _BucketRecord:
    """One bucket's bookkeeping for the current step (written by the hook and its callback)."""

    index: int
    plan: BucketPlan
    routes: BucketRoutes
    elements: dict[str, int]
    wire_bytes: float
    fp32_wire_bytes: float
    hook_time_s: float = 0.0
    nonfinite: bool = False
    grad_sq: float = 0.0
    loss: float | None = None
    probe_cosine: float | None = None
    probe_regions: frozenset[str] = frozenset()
    pending_residuals: dict[str, torch.Tensor] = field(default_factory=dict)
    pending_amax: dict[str, float] = field(default_factory=dict)
    """Agreed (MAX over ranks) max |x| per qsum slice this step, for the delayed scales."""
    saturated_slices: int = 0
    scale_rounds: int = 0
    buffer: torch.Tensor | None = None
    launched: list[_Launched] = field(default_factory=list)
    gathered: torch.Tensor | None = None
    """This bucket's all-gathered control word (W rows), when one was sent on its own."""
    coalesced: torch.Tensor | None = None
    """The bucket's one all-gather (W rows of control word + payloads), when coalesced."""
    ctrl_numel: int = 0
    """Length of the control word at the start of each coalesced row (0: none)."""
    collectives: int = 0
    probe: torch.futures.Future | None = None


class Runtime:
    """nfab's hook state: routes, residuals, health, statistics. One per DDP model and rank."""

    def __init__(
        self,
        ddp: DistributedDataParallel,
        profile: Profile,
        *,
        explicit: bool,
        error_feedback: bool = True,
        total_steps: int | None = None,
        cost_model: CostModel | None = None,
        seed: int = 0,
        head_modules: tuple[str, ...] | None = None,
        qsum_scale: str = "exact",
        coalesce: bool = True,
    ) -> None:
        if qsum_scale not in QSUM_SCALES:
            raise ValueError(f"qsum_scale must be one of {', '.join(QSUM_SCALES)}, got {qsum_scale!r}")
        self.profile = profile
        self.qsum_scale = qsum_scale
        self.coalesce = coalesce
        """Send a bucket with a signgather group as one all-gather when that is cheaper."""
        self.group = getattr(ddp, "process_group", None)
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.error_feedback = error_feedback
        self.controller = Controller(profile, self.world_size, cost_model, explicit=explicit, total_steps=total_steps)
        module = ddp.module
        self.bindings = classify(module, head_modules)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.regions = {n: b.region for n, b in self.bindings.items()}
        self.plans: dict[tuple[int, ...], BucketPlan] = {}
        self.residuals: dict[str, torch.Tensor] = {}
        self.amax: dict[str, deque[tuple[int, float]]] = {}
        """Per qsum slice: (step, agreed max |x|) of its latest consecutive qsum steps."""
        self.health = health_mod.HealthState()
        self.seed = seed
        self.param_index = {n: i for i, n in enumerate(self.names.values())}
        self.step = 0
        self.history: deque[StepStats] = deque(maxlen=HISTORY_STEPS)
        """The latest steps' statistics (bounded: a run of days must not grow without end)."""
        self.events: list[health_mod.HealthEvent] = []
        self._records: list[_BucketRecord] = []
        self._step_open = False
        self._saw_last = False
        self._probed = False
        self._loss_local: float | None = None

    # ---- public ---------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor | float) -> None:
        """Report this rank's loss; it rides with the next control word, reduced across ranks."""
        self._loss_local = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)

    def step_stats(self) -> StepStats | None:
        """Statistics of the last finished step (call after backward; None before any)."""
        if self._step_open and self._records and self._saw_last:
            self._finish_step()
        return self.history[-1] if self.history else None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: residuals, step and health (noise is seeded per step)."""
        self.step_stats()
        return {
            "version": 1,
            "step": self.step,
            "residuals": {k: v.clone() for k, v in self.residuals.items()},
            "health": self.health.to_dict(),
            "amax": {k: [list(e) for e in h] for k, h in self.amax.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported runtime state version {state.get('version')!r}")
        self.step = int(state["step"])
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.health = health_mod.HealthState.from_dict(state["health"])
        # absent in states saved before delayed scaling: those slices agree exactly once
        self.amax = {k: deque(((int(st), float(a)) for st, a in h), maxlen=AMAX_HISTORY)
                     for k, h in state.get("amax", {}).items()}

    # ---- the hook -------------------------------------------------------------------
    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        t0 = time.perf_counter()
        if self._saw_last:
            self._finish_step()
        carrier = not self._step_open  # the step's first bucket carries the loss
        if carrier:
            self._begin_step()
        buffer = bucket.buffer()
        plan = self._plan(bucket, buffer)
        phase = self.controller.phase(self.step)
        routes = self.controller.routes(plan, phase, self.health.demoted())
        w = self.world_size
        use_ef = self.error_feedback and phase.error_feedback
        probing = routes.has_lossy and not self._probed and self._probe_step()
        rec = _BucketRecord(bucket.index(), plan, routes, {}, 0.0, REDUCERS[FP32].wire_bytes(buffer.numel(), w),
                            buffer=buffer)
        self._records.append(rec)
        if bucket.is_last():
            self._saw_last = True

        ctrl_cols: list[torch.Tensor] = []  # per-slice columns of the control word after its head
        probe_parts: list[torch.Tensor] = []
        nonfinite = False
        coalesced = self._coalesce(routes.groups)
        for group in routes.groups:
            red = REDUCERS[group.key]
            rec.elements[group.label] = rec.elements.get(group.label, 0) + group.numel
            shared = amax_cols = None
            if group.lossy and not (group.whole or red.needs_shared_scale or probing or use_ef):
                # nothing to add or sample: encode the slices where they lie, no gathered copy
                enc = red.encode_views(_views(buffer, group), group.lengths, w)
            else:
                # a whole-bucket group works on the bucket itself: it is overwritten by the result
                x = buffer if group.whole else _gather(buffer, group)
                if group.key == FP32:
                    self._flush_residuals(x, group, buffer if group.whole else None)
                    x.mul_(1.0 / w)  # pre-scale exactly as DDP does (x * (1/W), not x / W)
                    rec.launched.append(_Launched(group, None, None, None, payload=x))
                    continue
                if probing:
                    probe_parts.append(x[_probe_index(group.numel)].clone())  # a strided sample, before EF
                if use_ef and group.lossy:
                    self._add_residuals(x, group)
                if red.needs_shared_scale:
                    amax = red.local_scale(x, group.lengths)
                    nonfinite |= not bool(torch.isfinite(amax).all())
                    # gathered, not summed: each rank encodes with its own scale (in the control word)
                    shared = amax if coalesced else self._delayed_scale(group)
                    if shared is None:  # no recent agreed history: agree now (blocking)
                        shared = amax.clone()
                        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.group)
                        rec.scale_rounds += 1
                        rec.collectives += 1
                        rec.wire_bytes += allreduce_factor(w) * shared.numel() * 4
                    amax_cols = _columns(ctrl_cols, amax)
                noise = self._noise(group) if red.needs_shared_scale else None
                enc = red.encode(x, group.lengths, w, shared, noise)
                if use_ef and enc.local is not None:
                    self._stage_residuals(rec, group, x - enc.local)
            scale_cols = None
            if enc.scales is not None:
                # a non-finite element makes its segment's scale non-finite: no extra pass
                nonfinite |= not bool(torch.isfinite(enc.scales).all())
                scale_cols = _columns(ctrl_cols, enc.scales)
            rec.launched.append(_Launched(group, None, scale_cols, shared, amax_cols, payload=enc.payload))

        if probe_parts:
            self._probed = True
            probe = torch.cat(probe_parts).mul_(1.0 / w)
            rec.probe_regions = frozenset(s.region for g in routes.groups if g.lossy for s in g.slices)
            rec.wire_bytes += allreduce_factor(w) * probe.numel() * 4
            rec.probe = REDUCERS[FP32].launch(probe, w, self.group)
            rec.collectives += 1

        # The control word rides with every bucket that has a lossy group (its scales and
        # a non-finite flag that decoding would otherwise hide) and with the step's first
        # bucket (the loss). FP32-only buckets need none: a non-finite element on any rank
        # shows in the reduced result itself, identically on every rank.
        ctrl = None
        if routes.has_lossy or carrier:
            loss = self._loss_local if carrier else None
            head = torch.tensor([float(nonfinite), loss or 0.0, float(loss is not None)])
            ctrl = torch.cat([head, *ctrl_cols])
        if coalesced:
            futs = [self._launch_coalesced(rec, ctrl)]
        else:
            futs = self._launch_each(rec, ctrl)
        if rec.probe is not None:
            futs.append(rec.probe)
        rec.hook_time_s += time.perf_counter() - t0
        return torch.futures.collect_all(futs).then(lambda done: self._finish_bucket(rec, done))

    def _launch_each(self, rec: _BucketRecord, ctrl: torch.Tensor | None) -> list[torch.futures.Future]:
        """One collective per group, as its reducer sends it, plus the control word's all-gather."""
        w = self.world_size
        futs = []
        for launched in rec.launched:
            payload, launched.payload = launched.payload, None
            assert payload is not None
            red = REDUCERS[launched.group.key]
            rec.wire_bytes += red.collective_factor(w) * payload.numel() * payload.element_size()
            launched.future = red.launch(payload, w, self.group)
            futs.append(launched.future)
        if ctrl is not None:
            rec.gathered = torch.empty(w * ctrl.numel())
            futs.append(all_gather_flat(rec.gathered, ctrl, group=self.group, async_op=True).get_future())
            rec.wire_bytes += allgather_factor(w) * ctrl.numel() * 4
        rec.collectives += len(futs)
        return futs

    def _launch_coalesced(self, rec: _BucketRecord, ctrl: torch.Tensor | None) -> torch.futures.Future:
        """The control word and every group's payload as the bytes of ONE all-gather.

        Each rank then combines the W copies of each payload as its collective would have
        (`Reducer.combine`: the integer lane SUM for qsum, rank-order sums for fp32/bf16,
        the rows for signgather), so results match the per-group path on every rank.
        """
        w = self.world_size
        parts: list[torch.Tensor] = []
        written = 0

        def put(data: torch.Tensor) -> int:
            """Append `data`'s bytes at the next 8-byte boundary; their offset."""
            nonlocal written
            at = _aligned(written)
            if at > written:
                parts.append(torch.zeros(at - written, dtype=torch.uint8))
            raw = data.contiguous().view(torch.uint8)
            parts.append(raw)
            written = at + raw.numel()
            return at

        if ctrl is not None:
            put(ctrl)
            rec.ctrl_numel = ctrl.numel()
        for launched in rec.launched:
            assert launched.payload is not None
            payload, launched.payload = launched.payload, None
            launched.part = (put(payload), payload.numel() * payload.element_size(), payload.dtype)
        flat = torch.cat(parts)
        rec.coalesced = torch.empty(w * flat.numel(), dtype=torch.uint8)
        rec.wire_bytes += allgather_factor(w) * flat.numel()
        rec.collectives += 1
        return all_gather_flat(rec.coalesced, flat, group=self.group, async_op=True).get_future()

    def _coalesce(self, groups: tuple[Group, ...]) -> bool:
        """Send the bucket as one all-gather? Only beside a signgather group (whose payload is
        an all-gather anyway), and only when gathering the other payloads (W-1 copies instead
        of a ring all-reduce's 2(W-1)/W) adds no bytes (W=2, or nothing else to send) or,
        under a cost model, costs less wire time than the collectives it saves."""
        if not self.coalesce or not any(g.key == SIGNGATHER for g in groups):
            return False
        w = self.world_size
        others = [g for g in groups if g.key != SIGNGATHER]
        extra = sum((allgather_factor(w) - REDUCERS[g.key].collective_factor(w)) * REDUCERS[g.key].payload_bytes(
            g.numel, w) for g in others)
        if extra <= 0:
            return True
        cm = self.controller.cost_model
        if cm is None:  # no link model: never send more bytes (as sign then picks by bytes)
            return False
        saved = cm.allgather.latency_s + cm.allreduce.latency_s * len(others)
        return extra / cm.allgather.bandwidth_bps < saved

    def _finish_bucket(self, rec: _BucketRecord, done: torch.futures.Future) -> torch.Tensor:
        """Decode every group into its slices; agree on non-finite buckets. Runs as a future
        callback (any thread, any order across buckets): it launches no collective."""
        done.value()  # a failed collective (e.g. a peer timed out) raises its own error before results are read
        t1 = time.perf_counter()
        w, buffer = self.world_size, rec.buffer
        assert buffer is not None
        rows = rec.coalesced.view(w, -1) if rec.coalesced is not None else None
        if rows is not None and rec.ctrl_numel:
            table = rows[:, : 4 * rec.ctrl_numel].contiguous().view(torch.float32)
        else:
            table = rec.gathered.view(w, -1) if rec.gathered is not None else None
        if table is not None:
            rec.nonfinite = bool(table[:, 0].sum() > 0)
            has = table[:, 2] > 0
            rec.loss = float(table[has, 1].sum() / has.sum()) if bool(has.any()) else None
        decoded_lossy = []
        if not rec.nonfinite:
            for launched in rec.launched:
                group, red = launched.group, REDUCERS[launched.group.key]
                gathered = None
                if launched.part is not None:  # this group's W payloads inside the one all-gather
                    assert rows is not None
                    off, nbytes, dtype = launched.part
                    gathered = list(rows[:, off : off + nbytes].contiguous().view(dtype))
                if launched.amax_cols is not None:
                    self._stage_amax(rec, launched, table, per_rank=gathered is not None)
                if gathered is not None and isinstance(red, QSum):  # each row with its own rank's scales
                    assert table is not None and launched.amax_cols is not None
                    decode = partial(red.decode_gathered, gathered, table[:, launched.amax_cols], group.numel,
                                     group.lengths)
                else:
                    if gathered is not None:
                        reduced = red.combine(gathered)
                    else:
                        assert launched.future is not None
                        reduced = launched.future.value()
                    if group.key == FP32:
                        if not group.whole:
                            write_into(_views(buffer, group), reduced)
                        continue
                    scale_mean = launched.shared
                    if launched.scale_cols:
                        assert table is not None
                        scale_mean = mean_of_ranks(table[:, launched.scale_cols])
                    decode = partial(red.decode, reduced, scale_mean, group.numel, group.lengths, w)
                probed = rec.probe is not None and group.lossy
                if group.whole:  # decode straight into the bucket: no temporary, no copy
                    out = decode(out=buffer)
                elif not probed:  # decode, scale and write each slice at its offset, one pass
                    decode(out=_views(buffer, group))
                    continue
                else:  # the probe compares the group's decoded values as one tensor
                    out = decode(out=None)
                    write_into(_views(buffer, group), out)
                if probed:
                    decoded_lossy.append(out[_probe_index(group.numel)])
        grad_sq = float(torch.linalg.vector_norm(buffer)) ** 2 if not rec.nonfinite else math.inf
        if not math.isfinite(grad_sq):  # any rank's NaN/Inf: the same zeroed bucket everywhere
            rec.nonfinite = True
            buffer.zero_()
            grad_sq = 0.0
        else:
            if decoded_lossy:
                est, ref = torch.cat(decoded_lossy), rec.probe.value()  # type: ignore[union-attr]
                rec.probe_cosine = float(torch.nn.functional.cosine_similarity(est, ref, dim=0, eps=1e-30))
            self.residuals.update(rec.pending_residuals)
        rec.grad_sq = grad_sq
        rec.launched, rec.gathered, rec.coalesced, rec.probe, rec.buffer = [], None, None, None, None  # free early
        rec.hook_time_s += time.perf_counter() - t1
        return buffer

    # ---- internals ------------------------------------------------------------------
    def _plan(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> BucketPlan:
        params = bucket.parameters()
        key = plan_key(params)
        plan = self.plans.get(key)
        if plan is None:
            plan = build_plan(params, bucket.gradients(), buffer, self.names, self.regions)
            self.plans[key] = plan
        return plan

    def _probe_step(self) -> bool:
        every = self.profile.health.probe_every
        return every > 0 and self.step % every == 0

    def _noise(self, group: Group) -> list[torch.Generator]:
        """One rounding-noise generator per slice, seeded by (seed, rank, step, parameter)."""
        gens = []
        for s in group.slices:
            g = torch.Generator(device="cpu")
            g.manual_seed(hash((self.seed, self.rank, self.step, self.param_index[s.name])) & 0x7FFF_FFFF_FFFF)
            gens.append(g)
        return gens

    def _add_residuals(self, x: torch.Tensor, group: Group) -> None:
        pos = 0
        for s in group.slices:
            r = self.residuals.get(s.name)
            if r is not None:
                x[pos : pos + s.numel].add_(r)
            pos += s.numel

    def _delayed_scale(self, group: Group) -> torch.Tensor | None:
        """The group's delayed qsum scales: the max of each slice's agreed history, or None
        (agree now) when any slice was not on qsum in the previous step."""
        if self.qsum_scale != "delayed":
            return None
        out = []
        for s in group.slices:
            h = self.amax.get(s.name)
            if not h or h[-1][0] != self.step - 1:
                return None
            out.append(max(a for _, a in h))
        return torch.tensor(out, dtype=torch.float32)

    @staticmethod
    def _stage_amax(rec: _BucketRecord, launched: _Launched, table: torch.Tensor | None,
                    per_rank: bool = False) -> None:
        """Record the slices' agreed max |x| (MAX over ranks' control words), and count the
        slices whose elements saturated at the (shared) scale they were encoded with."""
        assert table is not None and launched.shared is not None and launched.amax_cols is not None
        agreed = table[:, launched.amax_cols].amax(dim=0)
        if not per_rank:  # a rank's own scale never saturates
            rec.saturated_slices += int((agreed > launched.shared).sum())
        for s, a in zip(launched.group.slices, agreed.tolist(), strict=True):
            rec.pending_amax[s.name] = a

    def _stage_residuals(self, rec: _BucketRecord, group: Group, resid: torch.Tensor) -> None:
        pos = 0
        for s in group.slices:
            rec.pending_residuals[s.name] = resid[pos : pos + s.numel]
            pos += s.numel

    def _flush_residuals(self, x: torch.Tensor, group: Group, whole_buffer: torch.Tensor | None) -> None:
        """A slice back on fp32 sends what error feedback still owed it, then forgets it."""
        if not self.residuals:
            return
        pos = 0
        for s in group.slices:
            r = self.residuals.pop(s.name, None)
            if r is not None:
                start = s.offset if whole_buffer is not None else pos
                x[start : start + s.numel].add_(r)
            pos += s.numel

    def _fold_amax(self, agreed: dict[str, float]) -> None:
        """Append this step's agreed max |x| to each slice's history (restarted after a gap)."""
        for name, a in agreed.items():
            h = self.amax.get(name)
            if h is None or h[-1][0] != self.step - 1:
                h = self.amax[name] = deque(maxlen=AMAX_HISTORY)
            h.append((self.step, a))

    def _begin_step(self) -> None:
        self._step_open = True
        self._saw_last = False
        self._probed = False
        self._records = []

    def _finish_step(self) -> None:
        """Fold the finished step's agreed control words into stats and health state."""
        recs = sorted(self._records, key=lambda r: r.index)
        phase = self.controller.phase(self.step)
        st = StepStats(step=self.step, phase=phase.name, buckets=len(recs))
        reasons: dict[str, set[str]] = {}
        probe_regions: frozenset[str] = frozenset()
        for r in recs:
            st.wire_bytes += int(round(r.wire_bytes))
            st.fp32_wire_bytes += int(round(r.fp32_wire_bytes))
            for k, v in r.elements.items():
                st.route_elements[k] = st.route_elements.get(k, 0) + v
            for why, region in r.routes.fallbacks:
                reasons.setdefault(why, set()).add(region)
            st.skipped |= r.nonfinite
            st.grad_norm += r.grad_sq
            st.hook_time_s += r.hook_time_s
            st.saturated_slices += r.saturated_slices
            st.scale_rounds += r.scale_rounds
            st.collectives += r.collectives
            if not r.nonfinite:
                self._fold_amax(r.pending_amax)
            if r.probe_cosine is not None:
                st.fidelity_cosine, probe_regions = r.probe_cosine, r.probe_regions
        st.grad_norm = math.sqrt(st.grad_norm)
        st.loss = next((r.loss for r in recs if r.loss is not None), None)
        lossy = frozenset().union(*(self.controller.lossy_regions(r.plan, phase) for r in recs))
        obs = health_mod.Observation(self.step, st.loss, st.grad_norm, st.skipped, st.fidelity_cosine, probe_regions)
        events = health_mod.update(self.health, self.profile.health, obs, lossy)
        if st.skipped:
            reasons.setdefault("nonfinite", set())
        for e in events:
            st.events.append(f"{e.kind}:{e.reason}:{','.join(e.regions)}")
            if e.kind == "fallback":
                reasons.setdefault(e.reason, set()).update(e.regions)
            log.info("step %d %s (%s) regions=%s", e.step, e.kind, e.reason, ",".join(e.regions))
        self.events.extend(events)
        # `fallback` flags a safety event (health, capacity, non-finite); the cost gate's
        # steady routing to FP32 where compression does not pay is named in the reason only
        st.fallback = any(why != "cost" for why in reasons)
        st.fallback_reason = "; ".join(
            f"{why}({','.join(sorted(regs))})" if regs else why for why, regs in sorted(reasons.items())
        )
        self.history.append(st)
        self.step += 1
        self._step_open = False
        self._saw_last = False
        self._records = []
        self._loss_local = None


PROBE_ELEMENTS = 1 << 16
"""The fidelity probe reduces at most this many elements per group in FP32: a strided
sample estimates the cosine well and keeps the probe's bytes negligible."""


def _probe_index(numel: int) -> slice:
    """The elements a fidelity probe samples from a group of `numel`: every k-th."""
    return slice(0, numel, max(1, -(-numel // PROBE_ELEMENTS)))


def _columns(ctrl_cols: list[torch.Tensor], values: torch.Tensor) -> list[int]:
    """Append `values` to the control word's columns; the indices they will occupy."""
    start = _CTRL_HEAD + sum(t.numel() for t in ctrl_cols)
    ctrl_cols.append(values)
    return list(range(start, start + values.numel()))


def _aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of 8 (every payload dtype can be viewed in place)."""
    return -(-nbytes // 8) * 8


def _gather(buffer: torch.Tensor, group: Group) -> torch.Tensor:
    """The group's slices as one contiguous fp32 tensor (a copy)."""
    return buffer.clone() if group.whole else torch.cat(_views(buffer, group))


def _views(buffer: torch.Tensor, group: Group) -> list[torch.Tensor]:
    """The group's slices as views of the bucket (encode sources, decode destinations)."""
    return [buffer[s.offset : s.offset + s.numel] for s in group.slices]


def nfab_hook(state: Runtime, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The function registered with `DistributedDataParallel.register_comm_hook`."""
    return state.hook(bucket)
