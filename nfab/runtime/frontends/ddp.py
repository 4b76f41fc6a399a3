"""The nfab DDP communication hook and its state (`Runtime`).

The parts it drives, each readable alone (paths under `nfab/runtime/`):
- `control/word.py`: the control word — named head fields, per-slice columns, build and parse;
- `core/coalesce.py`: one all-gather for a whole bucket — the decision, packing, reading parts;
- `core/scales.py`: qsum's shared scales (exact agreement, or the delayed amax history);
- `core/agreement.py`: a bucket's exact scale agreements as one asynchronous MAX per dtype;
- `core/encode.py`: the hook body's work per bucket (prepare groups, encode them, launch collectives);
- `core/decode.py`: the callback's work per bucket (decode into slices, NaN in a non-finite bucket);
- `core/handoff.py`: the immutable values passed encode -> launch (`EncodedGroup`), hook ->
  callback (`Launch`) and back (`Outcome`);
- `core/twolevel.py`: with `hierarchy=`, lossy groups reduced node-local -> across nodes -> node-local;
- `core/plan.py` (a bucket's slice table), `core/fold.py` (the step boundary), `control/controller.py`
  (routes), `control/health.py`, `control/fidelity.py` and `control/probes.py` (health and probes),
  `control/optim.py` and `control/moment.py` (the optimizer-aware parts), `bindings.py`, `state.py`
  and `stats.py` (parameters, the state both front ends share, statistics).

Per bucket, in the hook body (DDP calls it in bucket order on every rank):
1. look up the bucket plan and this step's groups (controller: a pure function of agreed
   state, so every rank launches the same collectives in the same order);
2. prepare each group (error-feedback residuals added on lossy routes, the optimizer's
   weights, the local scale) and launch the bucket's exact scale agreements (qsum, block
   routes) as one asynchronous MAX per dtype; a bucket with one in flight that is not the
   step's last is completed by the next hook body (its round trip overlaps the backward of
   the next bucket), any other right away — buckets complete in bucket order on every rank;
3. complete: encode each group with its agreed scale (slices that need neither residuals nor
   a probe sample are read where they lie in the bucket) and build the control word (head +
   per-slice scales / max |x|) — for every bucket with a lossy group, the step's first bucket
   (loss, previous probe's cosine and region fidelity) and its last (the |g|^2 of FP32-only
   buckets since the previous word: the step's norm is complete);
4. launch, asynchronously: one collective per group plus the word's all-gather, or —
   beside a signgather group, when cheaper — all of it as the bytes of ONE all-gather;
5. return a future whose callback (`decode.finish_bucket`) decodes every slice in place
   and fills the bucket with NaN on all ranks if any rank saw a non-finite gradient (for a bucket
   completed by the next hook body, a future that the callback's result completes).

No collective is launched from a callback (callbacks finish in different orders on
different ranks): every one is launched from a hook body, so every rank launches them in the
same order (a deferred bucket's payload after the next bucket's agreement), and nothing in
the hook body waits for the device. Once per step, at
the step boundary (`step_stats()`, or else the next step's first hook), the step's
control-word tables are read to the host in one copy and folded into statistics, health
and qsum scale history: the next step's routes are host decisions made from values every
rank holds bit for bit.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations
# against dist.GradBucket and torch.futures.Future at registration.
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nfab.profile.schema import Phase, Profile
from nfab.runtime.bindings import classify, trained_module
from nfab.runtime.control import word as control
from nfab.runtime.control.controller import BucketRoutes
from nfab.runtime.control.fidelity import RegionFidelity
from nfab.runtime.control.moment import NoiseMoment
from nfab.runtime.control.optim import LossScale, Preconditioner
from nfab.runtime.core import agreement as agreement_mod
from nfab.runtime.core import coalesce, encode, twolevel
from nfab.runtime.core.decode import finish_bucket
from nfab.runtime.core.fold import carried_state, drop_ef_residuals, fidelity_columns, fold_step, load_carried
from nfab.runtime.core.handoff import HOOK_PHASES, EncodedGroup, Launch, Outcome
from nfab.runtime.core.hierarchy import Hierarchy
from nfab.runtime.core.plan import BucketPlan, build_plan, plan_key
from nfab.runtime.core.scales import AMAX_HISTORY, QSUM_SCALES, AmaxHistory
from nfab.runtime.state import RuntimeState
from nfab.runtime.stats import StepStats
from nfab.wire.cost import CostModel
from nfab.wire.registry import allreduce_factor

__all__ = ["AMAX_HISTORY", "HOOK_PHASES", "QSUM_SCALES", "Runtime", "nfab_hook"]



class Runtime(RuntimeState):
    """nfab's hook state: routes, residuals, health, statistics. One per DDP model and rank (the
    front-end-neutral part, `observe_loss` and the step's health, is `RuntimeState`)."""

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
        hierarchy: Hierarchy | str | int | None = None,
    ) -> None:
        self.group = getattr(ddp, "process_group", None)
        self.two_level = twolevel.setup(hierarchy, self.group)  # with a hierarchy, routes are decided at W = nodes
        super().__init__(profile, dist.get_world_size(self.group), dist.get_rank(self.group), explicit=explicit,
                         cost_model=cost_model, total_steps=total_steps, seed=seed,
                         route_world_size=self.two_level.nodes if self.two_level else None)
        self.scales = AmaxHistory(qsum_scale)
        self.coalesce = coalesce  # send a bucket with a signgather group as one all-gather when cheaper
        self.error_feedback = error_feedback
        module = trained_module(ddp.module)
        self.bindings = classify(module, head_modules)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.regions = {n: b.region for n, b in self.bindings.items()}
        self.param_index = {n: i for i, n in enumerate(self.names.values())}
        self.devices = {n: p.device for n, p in module.named_parameters()}  # where a loaded residual goes
        self.plans: dict[tuple[int, ...], BucketPlan] = {}
        self._gathered: dict[int, tuple[BucketRoutes, bool]] = {}  # the coalescing decision per routes
        self.residuals: dict[str, torch.Tensor] = {}
        self.preconditioner: Preconditioner | None = None  # attach(optimizer=): probes compare where Adam acts
        self.moment: NoiseMoment | None = None  # attach(noise_moment=): rounding noise out of Adam's v
        self.loss_scale: LossScale | None = None  # attach(loss_scaler=): the scale the hook's gradients carry
        # the step in progress: launches written by the hook, outcomes by the callbacks
        self._launches: list[Launch] = []
        self._outcomes: list[Outcome] = []
        self._carried_sq: torch.Tensor | None = None
        # exact scale agreements launched before a bucket's groups encode, a non-last bucket's
        # completed by the next hook body; False: each group agrees blocking as it encodes (the
        # same bits: tests compare the two)
        self.overlap_agreement = True
        self.deferred_buckets = 0  # buckets launched from a later hook body, over the run
        self._pending: tuple[encode.Opened, torch.futures.Future] | None = None
        self._step_open = False
        self._saw_last = False
        # this rank's last probe (plain cosine and its regions; per-region fidelity): the next first word carries it
        self._cosine_next: tuple[float, frozenset[str]] | None = None
        self._fidelity_next: dict[str, RegionFidelity] = {}

    @property
    def qsum_scale(self) -> str:
        return self.scales.mode

    # ---- public ---------------------------------------------------------------------
    def step_stats(self) -> StepStats | None:
        """Statistics of the last finished step (call after backward; None before any)."""
        if self._step_open and self._saw_last:
            self._finish_step()
        return self.history[-1] if self.history else None

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: residuals, step and health (noise is seeded per step).
        The residuals are copied to the host: a checkpoint gathers every rank's state to rank 0, which
        would otherwise unpickle rank r's CUDA residuals onto its own cuda:r."""
        self.step_stats()
        return {
            **self.base_state(),
            "residuals": {k: v.detach().to("cpu", copy=True) for k, v in self.residuals.items()},
            "amax": self.scales.state_dict(),
            # the last probe's values ride the next step's first word: a resumed run sends them too
            "carried_probe": carried_state(self._cosine_next, self._fidelity_next),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_base_state(state)
        # onto their parameter's device (a checkpoint holds them on the host): the hook adds them in place
        self.residuals = {k: v.to(self.devices.get(k, v.device), copy=True) for k, v in state["residuals"].items()}
        # absent in states saved before delayed scaling: those slices agree exactly once
        self.scales.load_state_dict(state.get("amax", {}))
        self._cosine_next, self._fidelity_next = load_carried(state.get("carried_probe"))

    # ---- the hook -------------------------------------------------------------------
    def hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._saw_last:
            self._finish_step()
        t0 = time.thread_time()  # phase boundaries: plan, norm, encode (its first part here)
        first = not self._step_open
        if first:
            self._step_open, self._saw_last = True, False
        last = bucket.is_last()
        self._saw_last |= last
        buffer = bucket.buffer()
        window = self.window
        if first and window is not None and window.pending is not None:  # a window ended: agree, then adopt
            self.adopt(window.agree(buffer.device))
        plan, routes, ctx = self._context(bucket, buffer)
        if window is not None and window.measuring(self.step):  # before any encode touches the buffer
            window.take(plan, buffer, self.step, ctx.loss_scale, self._optimizer_scale)
            if last:
                window.launch()
        t1 = time.thread_time()
        staged = self.overlap_agreement and not (self.two_level and routes.has_lossy)  # else: all at `_complete`
        # before any group is pre-scaled or encoded in place; staged, sign groups add theirs as they encode
        bucket_sq = encode.local_sq(buffer, routes.groups, ctx if staged else None)
        t2 = time.thread_time()
        probe_parts: list[torch.Tensor] = []
        prepared, agreement = None, None
        if staged:
            prepared = tuple(encode.prepare_group(ctx, buffer, g, probe_parts) for g in routes.groups)
            agreement = agreement_mod.launch([p.agree for p in prepared], self.world_size, self.group)
        opened = encode.Opened(bucket.index(), plan, routes, ctx, buffer, first, last, bucket_sq, prepared,
                               probe_parts, agreement, (t1 - t0, t2 - t1, time.thread_time() - t2))
        earlier, self._pending = self._pending, None
        if earlier is not None:  # the previous bucket's agreement has had this bucket's backward to land
            self._complete(*earlier)
        if agreement is not None and not last:  # launched from the next hook body, in bucket order
            result = _result_future(buffer.device)
            self._pending = (opened, result)
            self.deferred_buckets += 1
            return result
        return self._complete(opened, None)

    def _complete(self, opened: encode.Opened,
                  result: torch.futures.Future | None) -> torch.futures.Future[torch.Tensor]:
        """Encode a bucket with its agreed scales, build its control word and launch it: in its
        own hook body, or (when its agreement was in flight) in the next one. Buckets complete in
        bucket order on every rank, so the collectives' order is the same everywhere; `result`
        (the future DDP holds for a deferred bucket) completes with the bucket's callback."""
        t0 = time.thread_time()
        ctx, buffer, routes, first = opened.ctx, opened.buffer, opened.routes, opened.first
        word, probe_parts = control.Builder(), list(opened.probe_parts)
        blocking = encode.Blocking()
        levels = None
        if opened.prepared is None:
            encoded, levels = twolevel.encode_bucket(self.two_level, ctx, buffer, routes.groups, word, probe_parts,
                                                     blocking)
        else:
            agreed = [None] * len(opened.prepared)
            if opened.agreement is not None:
                agreed = opened.agreement.wait(len(opened.prepared))
                blocking.rounds, blocking.wire_bytes = opened.agreement.rounds, opened.agreement.wire_bytes
            encoded = [encode.finish_group(ctx, buffer, p, a, word)
                       for p, a in zip(opened.prepared, agreed, strict=True)]
        bucket_sq = opened.bucket_sq
        for e in encoded if opened.prepared is not None else ():
            if e.sq is not None:  # the share the norm pass left to this group's encoder
                bucket_sq = e.sq if bucket_sq is None else encode.add_sq(bucket_sq, e.sq)
        assert bucket_sq is not None, "the norm pass left a group's |x|^2 to an encoder that did not take it"
        # the step's first word: the previous step's region fidelity, agreed at the fold
        fid_cols = fidelity_columns(word, self._fidelity_next, buffer.device) if first else None
        ctrl = None
        if routes.has_lossy or first or opened.last:
            ctrl = word.build(bucket_sq, self._carried_sq, self._step_values(first, buffer.device))
            self._carried_sq = None
        else:  # an FP32-only bucket's |g|^2 rides with the next control word
            self._carried_sq = bucket_sq if self._carried_sq is None else self._carried_sq + bucket_sq
        plan_s, norm_s, encode_s = opened.phases
        launch, futs = self._launch(opened.index, opened.plan, routes, buffer, ctx, encoded, ctrl, probe_parts,
                                    blocking, fid_cols, (plan_s, norm_s, encode_s + time.thread_time() - t0))
        self._launches.append(twolevel.with_levels(launch, levels))
        # a coalesced bucket has one future: chained as it is (`collect_all` of one costs a combined future)
        combined = len(futs) > 1
        waited = torch.futures.collect_all(futs) if combined else futs[0]
        done = waited.then(partial(self._callback, launch, combined))
        if result is None:
            return done
        done.add_done_callback(partial(_forward, result))
        return result

    def _context(self, bucket: dist.GradBucket,
                 buffer: torch.Tensor) -> tuple[BucketPlan, BucketRoutes, encode.EncodeContext]:
        """The bucket's plan, this step's groups, and what encoding them needs."""
        plan = self._plan(bucket, buffer)
        phase = self.controller.phase(self.step)
        routes = self.controller.routes(plan, phase, self.health.demoted())
        w, pre = self.world_size, self.preconditioner
        # a probe step samples its regions (`control/probes.py`) in every lossy bucket
        probing = self.probe_regions(phase) if routes.has_lossy else frozenset()
        gathered = self._gathered.get(id(routes))
        if gathered is None or gathered[0] is not routes:  # a pure function of the (cached) routes
            gathered = self._gathered[id(routes)] = (routes, not self.two_level and coalesce.should_coalesce(
                routes.groups, w, self.coalesce, self.controller.cost_model))
        ctx = encode.EncodeContext(w, self.group, self.step, self.seed, self.rank, self.param_index,
                                   self.error_feedback and phase.error_feedback, probing, gathered[1],
                                   self.residuals, self.scales, frozenset(self.health.ef_off),
                                   self._quantization_scale if pre else None, self._step_loss_scale())
        return plan, routes, ctx

    def _optimizer_scale(self, name: str) -> torch.Tensor | None:
        """A parameter's sqrt(v) + eps now (None without a second moment): what a window's replay divides by."""
        return None if self.preconditioner is None else self.preconditioner.quantization_scale(name, self.step)

    def _step_loss_scale(self) -> torch.Tensor | None:
        """The loss scale this step's gradients carry (`EncodeContext.loss_scale`), or None without a scaler."""
        return self.loss_scale() if self.loss_scale is not None else None

    def _quantization_scale(self, names: Sequence[str], lengths: Sequence[int],
                            device: torch.device) -> torch.Tensor | None:
        """What block routes divide a group by: the preconditioner's sqrt(v) + eps, times the loss
        scale under a scaler (the hook's gradients carry it, v does not: `optim.loss_scale_of`)."""
        assert self.preconditioner is not None
        q = self.preconditioner.flat_scale(names, lengths, device, step=self.step)
        return None if q is None else encode.scaled(q, self._step_loss_scale())

    def _launch(self, index: int, plan: BucketPlan, routes: BucketRoutes, buffer: torch.Tensor,
                ctx: encode.EncodeContext, encoded: list[EncodedGroup], ctrl: torch.Tensor | None,
                probe_parts: list[torch.Tensor], blocking: encode.Blocking,
                fid_cols: tuple[tuple[str, ...], control.Columns] | None,
                phases: tuple[float, float, float]) -> tuple[Launch, list]:
        """Launch the bucket's collectives (one coalesced all-gather, or one per group + the
        word's) and the probe; the `Launch` its callback receives, and the futures. `phases`:
        thread CPU seconds of the bucket's plan, norm and encode (the launch is timed here)."""
        t0 = time.thread_time()
        w, pg = self.world_size, self.group
        if ctx.gathered:
            sent, ctrl_part, rows, futs, nbytes = encode.launch_coalesced(encoded, ctrl, w, pg, buffer.device)
            recv, collectives = None, 1
        else:
            sent, recv, futs, nbytes, collectives = encode.launch_each(encoded, ctrl, w, pg)
            ctrl_part, rows = None, None
        probe = encode.launch_probe(probe_parts, w, pg, ctx.probing)
        if probe is not None:
            futs.append(probe.future)
            nbytes += allreduce_factor(w) * probe.numel * 4
            collectives += 1
        elements: dict[str, int] = {}
        for g in routes.groups:
            elements[g.label] = elements.get(g.label, 0) + g.numel
        baseline = allreduce_factor(w) * buffer.numel() * buffer.element_size()
        launch = Launch(index, plan, routes, buffer, tuple(sent), recv, ctrl_part, rows, probe,
                        nbytes + blocking.wire_bytes, baseline, collectives + blocking.rounds, blocking.rounds,
                        tuple(elements.items()),
                        (*zip(HOOK_PHASES, (*phases, time.thread_time() - t0), strict=True),), fid_cols,
                        loss_scale=ctx.loss_scale)
        return launch, futs

    def _callback(self, launch: Launch, combined: bool, done: torch.futures.Future) -> torch.Tensor:
        """Decode the bucket once its collectives are done. `done` is a collective's own future or,
        `combined`, `collect_all`'s, whose value is the list of the collectives' futures: that future
        holds no device, so `then` did not make this stream wait for their CUDA events (NCCL completes
        a future when it enqueues the collective). Each one's `wait()` does, without a host sync,
        before the control word, the rows and the payloads are read."""
        value = done.value()  # a failed collective (e.g. a peer timed out) raises its own error before results are read
        if combined:
            for fut in value:
                fut.wait()
        self._outcomes.append(self._finish(launch))
        return launch.buffer

    def _finish(self, launch: Launch) -> Outcome:
        """The callback's work: decode into the bucket; the callback's one hand-back value."""
        # the optimizer state as of the previous step: no rank has stepped yet (still in backward)
        pre = self.preconditioner
        return finish_bucket(launch, self.world_size, partial(pre.inverse_rms, step=self.step) if pre else None,
                             self.moment)

    def _step_values(self, first: bool, device: torch.device) -> control.StepValues:
        """The step's first word carries this rank's loss and the previous probe's cosine."""
        if not first:
            return control.StepValues()
        loss = self.take_loss()  # consumed here: a step boundary must not drop it
        if isinstance(loss, float):
            loss = torch.full((), loss, dtype=torch.float32, device=device)
        return control.StepValues(loss, self._cosine_next[0] if self._cosine_next is not None else None)

    # ---- internals ------------------------------------------------------------------
    def _plan(self, bucket: dist.GradBucket, buffer: torch.Tensor) -> BucketPlan:
        params = bucket.parameters()
        key = plan_key(params)
        plan = self.plans.get(key)
        if plan is None:
            plan = build_plan(params, bucket.gradients(), buffer, self.names, self.regions)
            self.plans[key] = plan
        return plan

    def probe_regions(self, phase: Phase) -> frozenset[str]:
        """The regions this step's probe samples (`RuntimeState.probing`); dense early probes feed the
        drift monitor, so only under an optimizer with a second moment (the monitor reads it, and acts
        on nothing else), and sample every region while error feedback runs in one."""
        ef = (self.error_feedback and phase.error_feedback
              and bool(set(self.controller.model_lossy(phase, self.regions)) - self.health.ef_off))
        pre = self.preconditioner
        return self.probing(phase, dense=pre is not None and pre.adaptive, watch_all=ef)

    def _finish_step(self) -> None:
        """Fold the finished step's agreed control words into stats, health and scale history."""
        assert self._pending is None, "a bucket's launch was deferred past the step's last bucket"
        t0 = time.thread_time()
        phase = self.controller.phase(self.step)
        probe_regions = self._cosine_next[1] if self._cosine_next is not None else frozenset()
        folded = fold_step(self.step, phase.name, self._launches, self._outcomes, self.world_size)
        st = folded.stats
        for name, resid in folded.residuals:
            self.residuals[name] = resid
        self.scales.fold(folded.amax, self.step)
        lossy = frozenset().union(*(self.controller.lossy_regions(la.plan, phase) for la in self._launches))
        with_ef = lossy if self.error_feedback and phase.error_feedback else frozenset()
        events = self.observe_health(st, lossy, folded.fidelity, probe_regions, with_ef)
        drop_ef_residuals(self.residuals, self.regions, events)
        folded.record(events)
        if self.window is not None and self.window.measuring(self.step):
            st.calibrating, st.calibration_wire_bytes = True, self.window.fold(self.step, self.reference_series())
            st.wire_bytes += st.calibration_wire_bytes
        st.hook_phases["fold"] = time.thread_time() - t0
        st.hook_time_s += st.hook_phases["fold"]
        self.history.append(st)
        self._cosine_next = folded.cosine
        self._fidelity_next = folded.fidelity_local
        self.step += 1
        self._step_open = self._saw_last = False
        self._launches, self._outcomes = [], []


def _result_future(device: torch.device) -> torch.futures.Future:
    """The future DDP holds for a bucket launched from a later hook body (on an accelerator it
    carries the device, so DDP's wait orders its streams after the decode)."""
    return torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()


def _forward(result: torch.futures.Future, done: torch.futures.Future) -> None:
    """Complete a deferred bucket's future with its callback's result (or its error)."""
    try:
        value = done.value()
    except Exception as e:  # noqa: BLE001 - a failed collective fails the bucket DDP waits on
        result.set_exception(e)
        return
    result.set_result(value)


def nfab_hook(state: Runtime, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The function registered with `DistributedDataParallel.register_comm_hook`."""
    return state.hook(bucket)
