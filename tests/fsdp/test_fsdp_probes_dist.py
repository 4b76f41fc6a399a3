"""FSDP2's fidelity probes and FP32 shadow windows on real gloo ranks (W=2, the tiny model's five
comms called with random inputs laid out as FSDP2 lays them out, a few steps each).

- A probe's per-region cosine equals one computed here from every rank's input and every rank's
  decoded shard at the columns the probe samples, and its bytes are counted apart.
- An injected loss spike (the reported loss x10, the gradients untouched) opens a shadow window:
  with faithful routes it demotes nothing and counts a false alarm; with one region's route made
  deliberately bad (its decoded values negated) it demotes that region only, from the next step,
  on every rank alike.
- Regular probes pause while the run's probe bytes exceed `Health.probe_budget` of the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import fsdpmodels  # noqa: E402

import nfab  # noqa: E402
from nfab.distributed import run_ranks  # noqa: E402
from nfab.profile.schema import Profile  # noqa: E402
from nfab.runtime.control.controller import Group  # noqa: E402
from nfab.runtime.core import rowscatter  # noqa: E402
from nfab.runtime.frontends.fsdp import ShardedRuntime  # noqa: E402

pytestmark = pytest.mark.world_size(2)

ROUTE = {"small": "bq2", "norm": "q8", "bias": "sign"}  # every codec family; the weights are `small`
SPIKE_AT = 3


class BrokenRoute(ShardedRuntime):
    """A route made deliberately bad in one region (`broken`): its decoded values come out negated."""

    broken = ""

    def _decode(self, codec, rows, g: Group, comm, group, direct):  # noqa: ANN001, ANN202
        res = super()._decode(codec, rows, g, comm, group, direct)
        pos = 0
        for s in g.slices:
            if s.region == self.broken:
                res.mean[pos : pos + s.numel].neg_()
            pos += s.numel
        return res


def _attach(health: dict, broken: str = "") -> ShardedRuntime:
    torch.manual_seed(0)
    model = fsdpmodels.shard(fsdpmodels.Tiny())
    prof = Profile.static(ROUTE)  # as a profile: its health is the test's
    rt = nfab.attach(model, prof.model_copy(update={"health": prof.health.model_copy(update=health)}),
                     cost_model=None)
    if broken:
        rt.__class__ = BrokenRoute
        rt.broken = broken
    return rt


def _step(rt: ShardedRuntime, rank: int, step: int, loss: float = 1.0) -> list:
    """One step: every module's reduce-scatter of this rank's random input (AVG, as FSDP2 asks on gloo);
    (comm, every rank's input, every rank's output) per module."""
    rt.observe_loss(loss)
    seen = []
    for comm in rt.comms:
        lay = comm.layout
        x = fsdpmodels.grad_input(lay, rank, step)
        out = torch.empty(lay.chunk)
        rt.reduce_scatter(comm, out, x.clone(), dist.group.WORLD, dist.ReduceOp.AVG)
        xs = [torch.empty_like(x) for _ in range(rt.world_size)]
        outs = [torch.empty_like(out) for _ in range(rt.world_size)]
        dist.all_gather(xs, x)
        dist.all_gather(outs, out)
        seen.append((comm, xs, outs))
    return seen


def _probe_run(rank: int, world_size: int) -> dict:
    rt = _attach({"probe_every": 1, "probe_rotate": False})  # every lossy region, every step (budget 5%)
    seen = _step(rt, rank, 0)
    stats = [rt.step_stats()]
    for step in range(1, 8):
        _step(rt, rank, step)
        stats.append(rt.step_stats())
    # independently: every rank's row of every probed parameter, every k-th column of its share
    per_row = -(-512 // world_size)
    sums: dict[str, list[float]] = {}
    sent = 0.0
    for comm, xs, outs in seen:
        lay, samples = comm.layout, 0
        for p in lay.params:
            if p.region not in ROUTE:
                continue
            cols = torch.arange(p.offset, p.offset + p.shard_numel, max(1, -(-p.shard_numel // per_row)))
            samples += cols.numel()
            for r in range(world_size):
                ref = sum(x.view(world_size, lay.chunk)[r, cols].double() for x in xs) / world_size
                est = outs[r][cols].double()
                acc = sums.setdefault(p.region, [0.0, 0.0, 0.0])
                for i, v in enumerate((est @ ref, est @ est, ref @ ref)):
                    acc[i] += float(v)
        sent += rowscatter.plain_bytes(samples, world_size, 4)  # one FP32 reduce-scatter of the sample
    cosine = {r: dot / (ee * ff) ** 0.5 for r, (dot, ee, ff) in sums.items()}
    return {"stats": stats, "cosine": cosine, "sent": sent, "health": rt.health.to_dict(),
            "state": rt.state_dict()}


def test_probe_fidelity_equals_an_independent_computation_and_stays_within_budget():
    out = run_ranks(_probe_run, 2)
    stats, cosine = out[0]["stats"], out[0]["cosine"]
    assert set(cosine) == set(ROUTE) and all(0.3 < c < 0.99999 for c in cosine.values()), cosine  # lossy
    # step 0's probe comes back with step 1's first word, the W ranks' sums added
    assert stats[0].region_cosine == {} and set(stats[1].region_cosine) == set(ROUTE)
    for region, want in cosine.items():
        assert stats[1].region_cosine[region] == pytest.approx(want, rel=1e-5), region
    assert stats[0].probe_wire_bytes == out[0]["sent"] and stats[0].wire_bytes > stats[0].probe_wire_bytes
    # every rank agrees on everything it decided from (probes, health, routes)
    assert [_row(s) for s in stats] == [_row(s) for s in out[1]["stats"]]
    assert out[0]["state"] == out[1]["state"]
    # a probe step (its fidelity back a step later) only ever starts within budget; probes every step
    # would cost far more than 5% on this tiny model, so most are skipped
    probed = [t for t in range(len(stats) - 1) if stats[t + 1].region_cosine]
    assert probed[0] == 0 and len(probed) < len(stats) - 1
    for t in probed:
        before = stats[:t]
        spent = sum(s.probe_wire_bytes for s in before)
        assert spent <= 0.05 * sum(s.wire_bytes - s.probe_wire_bytes for s in before), t
    health = out[0]["health"]
    # probe bytes, all bytes, shadow windows' bytes (none here), the last probe's (the next one's estimate)
    assert health["bytes"][:3] == [sum(s.probe_wire_bytes for s in stats), sum(s.wire_bytes for s in stats), 0]


def _row(s) -> tuple:  # noqa: ANN001
    return (s.step, s.route_mix, s.loss, s.grad_norm, s.wire_bytes, s.probe_wire_bytes, s.fidelity_cosine,
            s.region_cosine, s.shadow, s.alarms, s.false_alarms, s.fallback_reason, s.events)


def _shadow_run(rank: int, world_size: int, broken: str) -> dict:
    # warm-up 2: the step-0 probe's verdict (read at step 1) is not judged; no other regular probe
    rt = _attach({"warmup_steps": 2, "probe_every": 100, "shadow_steps": 2}, broken)
    stats = []
    for step in range(SPIKE_AT + 4):
        _step(rt, rank, step, loss=10.0 if step == SPIKE_AT else 1.0)
        stats.append(rt.step_stats())
    return {"stats": stats, "state": rt.state_dict()}


@pytest.mark.parametrize("broken", ["", "norm"])
def test_an_alarm_opens_a_shadow_that_demotes_only_an_unfaithful_region(broken):
    out = run_ranks(_shadow_run, 2, broken)
    stats = out[0]["stats"]
    assert [_row(s) for s in stats] == [_row(s) for s in out[1]["stats"]]
    assert out[0]["state"] == out[1]["state"]
    alarm, first, last, close = stats[SPIKE_AT], stats[SPIKE_AT + 1], stats[SPIKE_AT + 2], stats[SPIKE_AT + 3]
    assert any(e.startswith("alarm:loss_spike:") for e in alarm.events) and alarm.alarms == 1
    assert first.shadow and last.shadow and not close.shadow
    assert set(last.region_cosine) == set(ROUTE)  # the window's first probe: every lossy region
    mix = close.route_mix
    if not broken:
        assert all(c > 0.3 for c in last.region_cosine.values())
        assert "shadow:false alarm:" in close.events and close.false_alarms == 1
        assert mix == stats[0].route_mix and "fp32" not in mix and not close.fallback
        assert not any(e.startswith("fallback") for s in stats for e in s.events)
    else:
        assert last.region_cosine[broken] < -0.5 and all(c > 0.3 for r, c in last.region_cosine.items() if r != broken)
        assert [e for e in last.events if e.startswith("fallback")] == [
            f"fallback:fidelity({last.region_cosine[broken]:.3f}):{broken}"]
        assert "shadow:demotion needed:" in close.events and close.false_alarms == 0
        # only the broken region is FP32 from the step after the verdict; the others keep their routes
        assert close.fallback_reason == f"health({broken})" and set(mix) == {"fp32", "bq2", "sign"}
        assert last.route_mix == stats[0].route_mix and "fp32" not in last.route_mix
