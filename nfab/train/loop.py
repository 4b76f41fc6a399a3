"""The training loop of one rank: setup, steps, cleanup.

Every rank runs `train(cfg)` under torchrun; rank 0 alone writes artifacts. A run
resumes from the latest checkpoint in its run dir when `cfg.resume` is set or torchrun
restarted the worker group (TORCHELASTIC_RESTART_COUNT > 0).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import nfab
from nfab.config.optim import autocast
from nfab.config.pairing import adopt_task
from nfab.config.run import AUTO, IN_RUN_DIR
from nfab.data import build_dataset, make_eval_loader
from nfab.data.user import resolve_collate
from nfab.errors import NfabError
from nfab.loss import UserLoss, batch_size_of, cross_entropy, resolve_loss, to_device
from nfab.models import build_model, model_signature
from nfab.profile.schema import file_sha256
from nfab.runtime.frontends.ddp import Runtime
from nfab.train import checkpoint, fault
from nfab.train.config import TrainConfig
from nfab.train.metrics import METRICS_FILE, SUMMARY_FILE, make_row, write_metrics, write_summary
from nfab.train.parallel import Wrapped, wrap
from nfab.train.progress import ProgressBar
from nfab.train.setup import BatchStream, build_optimizer, clip_and_step, lr_factor, plain_logits
from nfab.wire import cost as cost_mod

if TYPE_CHECKING:
    from nfab.runtime.frontends.fsdp import ShardedRuntime  # FSDP2's front end: imported when used

log = logging.getLogger(__name__)
_STAGE = ["setup"]


def stage() -> str:
    """Where this rank's training is (which collective it may be waiting in), for timeout errors."""
    return _STAGE[0]


def _at(where: str) -> None:
    _STAGE[0] = where


@dataclass(slots=True)
class EvalResult:
    loss: float
    accuracy: float | None


@torch.no_grad()
def evaluate(module: torch.nn.Module, loader: Any, task: str, max_batches: int | None, device: torch.device,
             sharded: bool = False, step_loss: UserLoss | None = None) -> EvalResult:
    """Held-out loss (and accuracy for classifiers): sums and counts all-reduced across ranks.

    The loss is the step's (`step_loss`, default: `nfab.loss.default_loss`), weighted by the samples of
    each batch; on nfab's own `(x, y)` batches whose `module(x)` gives logits it is cross-entropy weighted
    by the predictions (tokens for a language model), with a classifier's accuracy.

    `sharded` (FSDP2): every forward all-gathers parameters, so every rank runs as many forwards as
    the rank with the most batches (a rank's strided shard can hold one batch fewer: the digits test
    set at W=11 gives ranks one or two batches of 32); a rank past its own batches runs its first one
    again and counts nothing. Left unmatched, its all-reduce met the others' all-gathers."""
    step_loss = step_loss or resolve_loss(None)
    was_training = module.training
    module.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss * n, correct, n (samples or tokens)
    own = len(loader) if max_batches is None else min(len(loader), max_batches)
    forwards = own
    if sharded:
        most = torch.tensor([own], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        forwards = int(most.item())
    batches = iter(loader)
    first: Any = None
    accuracy = False
    for i in range(forwards):
        if i >= own:
            if first is not None:  # a rank with no batch at all has nothing to run (W beyond the data)
                step_loss(module, first)
            continue
        batch = to_device(next(batches), device)
        first = first if first is not None else batch
        if plain_logits(step_loss, module, batch):
            x, y = batch
            logits = module(x)
            n = y.numel()
            sums[0] += cross_entropy(logits, y).double() * n
            if task == "classification":
                accuracy = True
                sums[1] += (logits.argmax(-1) == y).sum().double()
        else:
            n = batch_size_of(batch)
            sums[0] += step_loss(module, batch).detach().double() * n
        sums[2] += n
    module.train(was_training)
    dist.all_reduce(sums)
    n = max(sums[2].item(), 1.0)
    return EvalResult(sums[0].item() / n, sums[1].item() / n if accuracy else None)


def mean_loss(loss: torch.Tensor, device: torch.device) -> float:
    """The cross-rank mean of this rank's loss (a 0-d tensor), summed in rank order (bit-identical on
    every rank and mode)."""
    local = loss.reshape(1).to(device, torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return float(torch.cat(gathered).sum().item() / len(gathered))


def replicas_identical(module: torch.nn.Module, device: torch.device) -> bool:
    """Collective: do all ranks hold bit-identical parameters? (a SHA-256 of every parameter, all-gathered).

    Only for replicated (DDP) models: under FSDP each rank holds its own shard.
    """
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().reshape(-1).cpu().contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
    local = torch.tensor(list(digest.digest()[:16]), dtype=torch.int64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def route_label(cfg: TrainConfig) -> str | None:
    """summary.json's `route`: the route string, a dict as JSON, "fp32" for --fp32, None with a profile."""
    c = cfg.comm
    if c.fp32:
        return "fp32"
    if isinstance(c.route, dict):
        return json.dumps(c.route, sort_keys=True)
    return c.route


def _cost_model(cfg: TrainConfig, wrapped: Wrapped, saved: str | None,
                device: torch.device) -> cost_mod.CostModel | None:
    """The run's cost model: the checkpoint's (a resume decides as the run did), none, measured on the
    gradients' `device` (NCCL's collectives take no CPU tensor, and the codecs timed must be the
    device's), a declared link (`link:100mbit`), or read from a JSON file."""
    if saved:
        return cost_mod.CostModel.from_dict(json.loads(saved))
    choice = cfg.comm.cost_model
    if choice == "none":
        return None
    if choice == "measure":
        return cost_mod.measure(wrapped.group, device=device)
    if cost_mod.is_declared(choice):
        return cost_mod.declared(choice, dist.get_world_size(wrapped.group), dist.get_backend(wrapped.group))
    return cost_mod.CostModel.load(choice)


def _levels(runtime: Runtime | ShardedRuntime | None) -> str | None:
    """"NODESxLOCAL" when the hook reduces in two levels, else None (flat)."""
    two = getattr(runtime, "two_level", None)  # FSDP2's reduce-scatter is one level
    return f"{two.topology.nodes}x{two.topology.local_world}" if two is not None else None


_COLLECTIVE = {"ddp": "all-reduce in DDP", "fsdp": "reduce-scatter in FSDP"}


def _check_parallel(cfg: TrainConfig, shared: dict[str, Any]) -> None:
    """A checkpoint resumes under the wrapper it was written under (its optimizer state is keyed by it)."""
    saved = json.loads(shared.get("config") or "{}").get("parallel", "ddp")
    if saved != cfg.parallel:
        raise NfabError(f"the checkpoint was written under parallel={saved}; resume it with --parallel {saved}")


def restart_history(run_dir: Path, shared: dict[str, Any], resumed: bool, start: int) -> list[dict[str, Any]]:
    """Every (re)start of this run so far, this one included when it resumed.

    An entry is `{"kind": "restart" | "resume", "attempt": torchrun's restart count,
    "resumed_from_step": the step training continues at}`. Earlier entries come from the
    run's summary.json (rank 0 rewrites it as soon as a run resumes, so a second restart
    before the next checkpoint still finds the first), else from the checkpoint.
    """
    history: list[dict[str, Any]] = list(shared.get("restarts", []))
    summary = run_dir / SUMMARY_FILE
    if resumed and summary.is_file():
        with contextlib.suppress(ValueError, OSError):
            saved = json.loads(summary.read_text()).get("restarts")
            if isinstance(saved, list) and len(saved) >= len(history):
                history = saved
    attempt = fault.restart_attempt()
    if attempt > 0 or resumed:
        history.append({"kind": "restart" if attempt > 0 else "resume", "attempt": attempt,
                        "resumed_from_step": start})
    return history


def train(cfg: TrainConfig, device: torch.device) -> dict[str, Any] | None:
    """Run (or continue) the configured training on this rank; rank 0 returns the summary."""
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    run_dir = Path(cfg.run_dir or ".")
    faults = fault.faults_from_env()
    session_start = time.perf_counter()

    _at("checkpoint load (broadcast)")
    resumed = None
    if cfg.resume or fault.restart_attempt() > 0:
        resumed = checkpoint.load(run_dir)
        if resumed is None and cfg.resume and fault.restart_attempt() == 0:
            raise NfabError(f"no checkpoint to resume in {run_dir}")
    shared, own = resumed if resumed is not None else ({}, {})

    # ---- setup ------------------------------------------------------------------------
    spec = build_model(cfg.model.name, seed=cfg.seed, **cfg.model.options)
    module = spec.module.to(device)
    if shared:
        _check_parallel(cfg, shared)
        checkpoint.check_model_state(shared["model"], module, run_dir / checkpoint.CHECKPOINT_DIR)
        module.load_state_dict(shared["model"])  # the full state, before any sharding
    signature = model_signature(module) if cfg.comm.profile not in (None, AUTO) else None
    train_data = build_dataset(cfg.data.name, split="train", seed=cfg.seed, **cfg.data.options)
    test_data = (build_dataset(cfg.data.name, split="test", seed=cfg.seed, **cfg.data.options) if cfg.data.eval is None
                 else build_dataset(cfg.data.eval, split="test", seed=cfg.seed))
    task = adopt_task(spec, train_data.spec).task
    step_loss = resolve_loss(cfg.loss)
    collate = resolve_collate(cfg.data.collate)
    stream = BatchStream(train_data, batch_size=cfg.data.batch_size, rank=rank, world_size=world, seed=cfg.seed,
                         collate=collate)
    eval_loader = make_eval_loader(test_data, batch_size=cfg.data.eval_batch_size, rank=rank, world_size=world,
                                   collate=collate)
    _at(f"setup ({cfg.parallel.upper()} construction, cost-model measurement)")
    wrapped = wrap(spec, cfg.parallel, device, cfg.comm.bucket_mb)
    model = wrapped.model
    runtime: Runtime | ShardedRuntime | None = None
    cost_json = shared.get("cost_model")
    # after wrapping (FSDP swaps in sharded parameters), before attach (nfab reads its family and state)
    optimizer = build_optimizer(module, cfg.optim, spec.optimizer)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
    if not cfg.comm.fp32:
        cm = _cost_model(cfg, wrapped, cost_json, device)
        cost_json = cm.to_json() if cm is not None else None
        runtime = nfab.attach(
            model, profile=cfg.comm.profile, route=cfg.comm.route, error_feedback=cfg.comm.error_feedback,
            total_steps=cfg.steps, cost_model=cm, seed=cfg.seed, head_modules=spec.head_modules,
            model_signature=signature,
            qsum_scale=cfg.comm.qsum_scale, optimizer=optimizer, hierarchy=cfg.comm.hierarchy,
            noise_moment=cfg.comm.noise_moment, loss_scaler=scaler if scaler.is_enabled() else None,
            calibration_out=run_dir / IN_RUN_DIR if cfg.comm.profile == AUTO else None,
            calibration_window=cfg.comm.calibration_window,
        )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg.steps, cfg.schedule))
    rows: list[dict[str, Any]] = list(shared.get("rows", []))
    start = int(shared.get("step", 0))
    restarts = restart_history(run_dir, shared, cfg.resume or fault.restart_attempt() > 0, start)
    wall_before = float(shared.get("wall_time_s", 0.0))
    if shared:
        wrapped.load_optimizer_state(optimizer, shared["optimizer"])
        scheduler.load_state_dict(shared["scheduler"])
        stream.load_state_dict(shared["data"])
        if shared.get("scaler"):
            scaler.load_state_dict(shared["scaler"])
        checkpoint.set_rng_state(own["rng"])
        if runtime is not None:
            runtime.load_state_dict(own["hook"])
    plain_bytes = wrapped.baseline_wire_bytes(world)
    identity = {
        "model": spec.name, "dataset": cfg.data.name, "world_size": world, "parallel": cfg.parallel,
        "route": route_label(cfg),
        "fp32": cfg.comm.fp32, "bucket_cap_mb": cfg.comm.bucket_mb, "hierarchy": _levels(runtime),
        "noise_moment": getattr(runtime, "moment", None) is not None,  # comm.noise_moment as resolved
        # "auto": what it fitted is in the run dir (IN_RUN_DIR), rewritten at each window's end
        "profile": None if cfg.comm.profile is None else {
            "path": cfg.comm.profile, "sha256": None if cfg.comm.profile == AUTO else file_sha256(cfg.comm.profile)},
        "nfab_version": nfab.__version__, "torch_version": torch.__version__, "command": cfg.command,
    }

    def wall() -> float:
        return wall_before + time.perf_counter() - session_start

    def save_checkpoint(step: int) -> None:
        _at(f"step {step - 1}: checkpoint (model and optimizer state gathered to rank 0)")
        model_state, optimizer_state = wrapped.model_state(), wrapped.optimizer_state(optimizer)
        state = {
            "step": step, "model": model_state, "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(), "data": stream.state_dict(), "scaler": scaler.state_dict(),
            "rows": rows,
            "wall_time_s": wall(), "cost_model": cost_json, "config": cfg.to_json(), "restarts": restarts,
        } if master else None
        own_state = {"rng": checkpoint.rng_state(), "hook": runtime.state_dict() if runtime is not None else None}
        _at(f"step {step - 1}: checkpoint (gather to rank 0)")
        checkpoint.save(run_dir, step, state, own_state)

    final: dict[str, Any] = {}

    def write(complete: bool) -> None:
        if complete:
            _at("end of run (replica checksum all-gather)")
            # under FSDP each rank holds its own shard: no replicas to compare
            final["replicas_identical"] = replicas_identical(module, device) if cfg.parallel == "ddp" else None
            if final["replicas_identical"] is False:
                log.warning("rank %d: the replicas' parameters differ at the end of the run", rank)
        if master:
            write_metrics(run_dir / METRICS_FILE, rows)
            record = {"restart_count": sum(r["kind"] == "restart" for r in restarts), "restarts": restarts}
            write_summary(run_dir / SUMMARY_FILE, identity, rows, lm=task == "lm", complete=complete,
                          wall_time_s=wall(), extra={**record, **(final if complete else {})})

    title = f"{spec.name} {identity['route'] or Path(cfg.comm.profile or '').name} W={world}"
    bar = ProgressBar(cfg.steps, start, title, enabled=master and not cfg.quiet)
    wire_mb = sum(r["wire_bytes"] for r in rows) / 1e6

    if restarts and master and start < cfg.steps:
        write(complete=False)  # the restart is on record before the next checkpoint

    # ---- loop -------------------------------------------------------------------------
    model.train()
    try:
        for step in range(start, cfg.steps):
            fault.inject(faults, step, rank)
            factor = fault.loss_factor(faults, step, rank)
            _at(f"step {step}: forward/backward (gradient {_COLLECTIVE[cfg.parallel]})")
            t0 = time.perf_counter()
            lr = scheduler.get_last_lr()[0]
            # summed on the device in float64 (as a Python float would, bit for bit): a float() of each
            # micro-batch's loss waited for its forward before its backward could be queued on a GPU
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for micro in range(cfg.accum_steps):
                batch = to_device(stream.next(), device)
                last = micro == cfg.accum_steps - 1
                with wrapped.sync(last):
                    with autocast(cfg.precision, device.type):
                        loss = step_loss(model, batch)
                    if factor is not None:  # injected NaN / Inf / spike (NFAB_FAULT)
                        loss = loss * factor
                    loss_sum = loss_sum + loss.detach().double()
                    if runtime is not None and last:
                        runtime.observe_loss(loss_sum / cfg.accum_steps)
                    scaler.scale(loss / cfg.accum_steps).backward()
            row = _step_row(runtime, step, lr, plain_bytes, wrapped, device)
            if scaler.is_enabled():  # the gradients carried the loss scale: report the optimizer's norm
                row["grad_norm"] /= scaler.get_scale()
            _at(f"step {step}: loss all-gather")
            row["loss"] = mean_loss(loss_sum / cfg.accum_steps, device)
            clip_and_step(optimizer, module.parameters(), cfg.optim.grad_clip, scaler, skipped=row["skipped"])
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            row["step_time_s"] = time.perf_counter() - t0
            done = step + 1
            if (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps:
                _at(f"step {step}: evaluation (all-reduce)")
                ev = evaluate(module, eval_loader, task, cfg.data.eval_batches, device,
                              sharded=cfg.parallel == "fsdp", step_loss=step_loss)
                row["eval_loss"] = ev.loss
                row["eval_accuracy"] = ev.accuracy if ev.accuracy is not None else float("nan")
            rows.append(row)
            wire_mb += row["wire_bytes"] / 1e6
            bar.update(row, wire_mb)
            if (cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or done == cfg.steps:
                save_checkpoint(done)
                write(complete=done == cfg.steps)
            elif cfg.metrics_every and done % cfg.metrics_every == 0:
                write(complete=False)
    finally:
        bar.close()
    # ---- cleanup ----------------------------------------------------------------------
    if start >= cfg.steps:  # resumed a finished run: nothing to do but rewrite artifacts
        write(complete=True)
    if not master:
        return None
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def _step_row(runtime: Runtime | ShardedRuntime | None, step: int, lr: float, plain_bytes: int, wrapped: Wrapped,
              device: torch.device) -> dict[str, Any]:
    """The metrics row of a step that just finished its backward (loss and times are filled by the caller)."""
    if runtime is None:
        norm = wrapped.grad_norm(device)
        # the reduced gradient is the same on every rank, so is this decision: skip, never step on NaN/Inf
        bad = not math.isfinite(norm)
        return make_row(step=step, phase="fp32", loss=float("nan"), lr=lr, grad_norm=norm,
                        wire_bytes=plain_bytes, baseline_wire_bytes=plain_bytes, route_mix={"fp32": 1.0},
                        skipped=bad, fallback_reason="nonfinite" if bad else "")
    st = runtime.step_stats()
    assert st is not None and st.step == step, f"hook stats for step {st and st.step}, loop at {step}"
    return make_row(step=step, phase=st.phase, loss=float("nan"), lr=lr, grad_norm=st.grad_norm,
                    wire_bytes=st.wire_bytes, baseline_wire_bytes=st.baseline_wire_bytes, route_mix=st.route_mix,
                    fallback=st.fallback, fallback_reason=st.fallback_reason, skipped=st.skipped,
                    fidelity_cosine=st.fidelity_cosine, region_cosine=st.region_cosine,
                    hook_time_s=st.hook_time_s, collectives=st.collectives,
                    scale_rounds=st.scale_rounds, saturated_slices=st.saturated_slices, events="; ".join(st.events),
                    intra_node_bytes=st.intra_node_bytes, inter_node_bytes=st.inter_node_bytes,
                    probe_wire_bytes=st.probe_wire_bytes, shadow_wire_bytes=st.shadow_wire_bytes,
                    cost_gated=st.cost_gated, shadow=st.shadow,
                    alarms=st.alarms, false_alarms=st.false_alarms,
                    calibrating=st.calibrating, calibration_wire_bytes=st.calibration_wire_bytes)
