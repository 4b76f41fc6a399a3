"""`nfab train`'s parent process: validate everything, then run the ranks under torchrun.

Every user error (config, model, data set, profile, run dir) is found here, before
anything is written, and raised as one `NfabError` line. Then torchrun
(`python -m torch.distributed.run ... -m nfab.train.worker CONFIG.json`) starts the
ranks; a worker failure comes back as one line naming the rank and its error, with
torchrun's own output kept in `RUN_DIR/logs/node{N}.log`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nfab.attach_checks import check_globs
from nfab.config.calibrated import layout_mismatch, profile_base, recipe_changes
from nfab.config.pairing import default_data, resolve_pairing
from nfab.config.run import AUTO
from nfab.config.shipped import resolve_profile
from nfab.data import build_dataset, make_loader
from nfab.data.user import resolve_collate
from nfab.errors import ConfigError, NfabError, ProfileError
from nfab.fsutil import atomic_write_text
from nfab.loss import resolve_loss
from nfab.profile.evidence import failed_validation
from nfab.profile.schema import Profile
from nfab.runtime.control.controller import candidates
from nfab.runtime.core.hierarchy import parse as parse_hierarchy
from nfab.train import checkpoint, fault, rundir
from nfab.train.config import TrainConfig, load_config
from nfab.train.metrics import METRICS_FILE, SUMMARY_FILE
from nfab.train.worker import ERROR_MARK, LAUNCHER_ENV
from nfab.wire.cost import CostModel, is_declared

CONFIG_FILE = "config.json"
LOG_DIR = "logs"
_NOT_PERSISTED = ("resume", "overwrite", "command", "quiet")
log = logging.getLogger(__name__)
Warn = Callable[[str], None]


class WorkerError(NfabError):
    """The ranks started but the run failed; `code` is the exit code to hand on."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def resolve_config(config_path: str | None, overrides: list[str], flags: list[str],
                   names: dict[str, str] | None = None, setting: str | None = None) -> TrainConfig:
    """The run's config, each layer over the one before:

    the profile's calibrated setting (`--profile` alone reproduces it; `setting`, a profile
    given beside `--fp32` or `--route`, gives its setting without its routes: the baseline
    of the same run), or for `--resume` without a config the run dir's saved config; then
    the config file; then `names` (`--model` / `--dataset`: a section naming another builder
    drops the options of the one below; a model with no data set from any layer gets its
    task's); then `key=value` overrides and flags.
    """
    sections = {k: {"name": v} for k, v in (names or {}).items() if v is not None}
    probe = load_config(config_path, overrides + flags, sections=sections)
    base: dict[str, Any] = {}
    where = ""
    if config_path is None and probe.resume and probe.run_dir:
        saved = Path(probe.run_dir) / CONFIG_FILE
        if saved.is_file():
            base = {k: v for k, v in json.loads(saved.read_text()).items() if k not in _NOT_PERSISTED}
            where = str(saved)
    if not base and (setting is not None or probe.comm.profile not in (None, AUTO)):
        path = str(resolve_profile(setting or probe.comm.profile))
        base = profile_base(Profile.load(path), path)
        if setting is not None:
            del base["comm"]  # the setting only: the flags say how it communicates
    if "model" in sections and "data" not in sections and config_path is None and "data" not in base:
        # `--model M` with no data set from a file or a calibrated setting: M's task picks it, as
        # `nfab calibrate M` does (a classifier was paired with the config default's stdlib-text)
        sections["data"] = {"name": default_data(probe.model.name, probe.model.options)}
    if not base and not sections:
        return probe
    try:
        return load_config(config_path, overrides + flags, base=base, sections=sections)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}" if where else str(exc)) from exc


def default_run_dir(cfg: TrainConfig) -> str:
    c = cfg.comm
    if c.fp32:
        label = "fp32"
    elif c.profile:
        label = Path(c.profile).stem
    else:
        label = c.route if isinstance(c.route, str) else "mixed"
    name = cfg.model.name.rsplit(":", 1)[-1]
    return str(Path("runs") / f"{name}-{label}-{time.strftime('%Y%m%d-%H%M%S')}")


def has_run(run_dir: Path) -> bool:
    return any((run_dir / p).exists() for p in (SUMMARY_FILE, METRICS_FILE, checkpoint.CHECKPOINT_DIR))


def check_world(profile: Profile, world: int, where: str, warn: Warn) -> None:
    """World size against the profile's range and each route's reducer capacity.

    Over the range or a reducer's capacity, the route falls back to FP32 with a warning (the
    runtime checks capacity per reducer, so that is safe); with `fallback.on_capacity: error`
    the run is refused.
    """
    strict = profile.fallback.on_capacity == "error"
    if not profile.check_world_size(world):
        span = f"{profile.world_size.min}..{profile.world_size.max}"
        if strict:
            raise NfabError(f"{where} is valid for world sizes {span}, this run has {world} ranks "
                            "(fallback.on_capacity is 'error')")
        warn(f"{where} is valid for world sizes {span}, this run has {world} ranks: training anyway, "
             "routes over a reducer's capacity fall back to fp32")
    for route in sorted(profile.routes_used()):
        reducers = candidates(route)
        if reducers and not any(r.capacity(world).ok for r in reducers):
            why = "; ".join(f"{r.name}: {r.capacity(world).reason}" for r in reducers)
            if strict:
                raise NfabError(f"route {route} cannot run exactly at W={world} ({why}); "
                                "fallback.on_capacity is 'error'")
            warn(f"route {route} cannot run exactly at W={world} ({why}): its regions fall back to fp32")


def check_resume(run_dir: Path, module: Any) -> None:
    """`--resume`: a checkpoint exists, is readable (weights only) and fits the model to build."""
    path = checkpoint.latest(run_dir)
    if path is None:
        raise NfabError(f"--resume: no checkpoint in {run_dir} (the run stopped before its first one): pass "
                        "--overwrite to start it again")
    state = checkpoint.read(path / "state.pt", mmap=True)
    if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
        raise NfabError(f"checkpoint {path} is not an nfab checkpoint (no model state)")
    checkpoint.check_model_state(state["model"], module, path)


def check_gpus(nproc: int, gpus: int) -> None:
    """On a machine with GPUs every rank takes its own (NCCL, `worker._device`): more ranks than GPUs
    failed in the surplus ranks with CUDA's "invalid device ordinal" while the rest waited for them."""
    if gpus and nproc > gpus:
        raise ConfigError(f"--nproc {nproc} on a node with {gpus} GPU{'s' if gpus > 1 else ''}: nfab runs one "
                          f"rank per GPU; pass --nproc {gpus} or fewer")


def validate(cfg: TrainConfig, warn: Warn = log.warning) -> TrainConfig:
    """Check everything a user can get wrong, writing nothing; return the config resolved.

    The model's options are fitted to the data set (`nfab.config.pairing`) and written back,
    so the ranks build exactly what was checked and config.json records it.
    """
    cfg.comm.check_choice()
    fault.faults_from_env()
    pair = resolve_pairing(cfg.model.name, cfg.model.options, cfg.data.name, cfg.data.options, cfg.seed)
    cfg.model.options = pair.model_options
    cfg.data.options = pair.data_options
    spec = pair.spec
    if not any(p.requires_grad for p in spec.module.parameters()):  # DDP refused it inside every rank
        raise ConfigError(f"model {spec.name} has no trainable parameter: nothing to train or to communicate")
    data = build_dataset(cfg.data.name, split="train", seed=cfg.seed, **cfg.data.options)
    if cfg.data.eval is None:  # each rank evaluates on it
        build_dataset(cfg.data.name, split="test", seed=cfg.seed, **cfg.data.options)
    else:
        build_dataset(cfg.data.eval, split="test", seed=cfg.seed)
    resolve_loss(cfg.loss)  # an unimportable loss is one line here, not one per rank
    resolve_collate(cfg.data.collate)
    world = cfg.launch.world_size
    make_loader(data, batch_size=cfg.data.batch_size, rank=0, world_size=world, seed=cfg.seed)
    check_gpus(cfg.launch.nproc, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if cfg.comm.profile not in (None, AUTO):  # "auto" calibrates inside the run: no file to check yet
        cfg.comm.profile = str(resolve_profile(cfg.comm.profile))
        profile = Profile.load(cfg.comm.profile)
        if (mismatch := layout_mismatch(profile, spec)) is not None:
            raise ProfileError(f"profile {cfg.comm.profile}: {mismatch}")
        check_world(profile, world, f"profile {cfg.comm.profile}", warn)
        if (changed := recipe_changes(profile, cfg)) is not None:
            warn(f"profile {cfg.comm.profile}: {changed}")
        if (failed := failed_validation(profile.evidence.get("validation"))) is not None:  # calibrate said so, once
            warn(f"profile {cfg.comm.profile}: {failed}; it trains as calibrated: recalibrate it (nfab calibrate) "
                 "or train --fp32")
        check_globs(profile, spec.module)  # a glob that matches nothing: refused here, not in every rank
    if cfg.comm.route is not None:
        check_world(Profile.static(cfg.comm.route), world, "route", warn)
        check_globs(Profile.static(cfg.comm.route), spec.module)
    layout = parse_hierarchy(cfg.comm.hierarchy)
    if layout is not None and layout.local_world is not None:  # "auto" is torchrun's --nproc per node
        layout.topology(world, 0)
    if cfg.comm.cost_model not in ("measure", "none") and not is_declared(cfg.comm.cost_model):
        CostModel.load(cfg.comm.cost_model)
    if cfg.run_dir is None:
        cfg.run_dir = default_run_dir(cfg)
    run_dir = Path(cfg.run_dir)
    if cfg.launch.node_rank == 0:
        if run_dir.exists() and not run_dir.is_dir():
            raise NfabError(f"run dir {run_dir} is a file")
        if cfg.resume:
            check_resume(run_dir, spec.module)
            saved = run_dir / CONFIG_FILE
            if saved.is_file():
                done = _summary(run_dir)
                rundir.check_resume(json.loads(saved.read_text()), _persisted(cfg),
                                    finished_steps=done.get("steps") if done.get("complete") is True else None)
        if has_run(run_dir) and not (cfg.resume or cfg.overwrite):
            state = "a finished run" if _summary(run_dir).get("complete") is True else "an unfinished run"
            raise NfabError(f"run dir {run_dir} already holds {state}; pass --resume to continue it "
                            "or --overwrite to replace it")
    return cfg


def _summary(run_dir: Path) -> dict[str, Any]:
    """The run dir's summary.json as written so far ({} before the first one)."""
    summary = run_dir / SUMMARY_FILE
    return json.loads(summary.read_text() or "{}") if summary.is_file() else {}


def torchrun_argv(cfg: TrainConfig, config_file: Path) -> list[str]:
    """torchrun's arguments (what follows `torchrun` on a command line)."""
    lc = cfg.launch
    argv = ["--nnodes", str(lc.nnodes),
            "--nproc-per-node", str(lc.nproc), "--max-restarts", str(lc.max_restarts), "--monitor-interval", "0.5"]
    if lc.rdzv_endpoint:
        # a node that never joins ends the wait after launch.timeout_s (static: the store's timeout;
        # c10d: the join timeout), not torch's 600-900 s
        wait = str(max(1, round(lc.timeout_s)))
        argv += ["--rdzv-endpoint", lc.rdzv_endpoint, "--node-rank", str(lc.node_rank),
                 "--rdzv-conf", f"timeout={wait},join_timeout={wait}"]
    elif not lc.rdzv_backend:
        # One node: a c10d store on a free port. Each restart is a new rendezvous round with its
        # own keys; the static backend reuses the first round's store, and a restarted rank
        # could read a dead peer's address from it.
        argv += ["--standalone"]
    if lc.rdzv_backend:
        argv += ["--rdzv-backend", lc.rdzv_backend]
    return argv + ["-m", "nfab.train.worker", str(config_file)]


@dataclass(frozen=True, slots=True)
class LaunchResult:
    run_dir: Path
    summary: dict[str, Any] | None


def launch(cfg: TrainConfig, warn: Warn = log.warning) -> LaunchResult:
    """Validate, prepare the run dir (node 0), run torchrun, and surface a failure as one line.

    `warn` receives one line per safe fallback decided before launch (world size, capacity).
    """
    cfg = validate(cfg, warn)
    run_dir = Path(cfg.run_dir)  # type: ignore[arg-type]
    if cfg.launch.node_rank != 0:  # node 0 writes the run dir; the others write their own log there
        return _run(cfg, run_dir)
    with rundir.held(run_dir):  # one nfab train at a time per run dir
        if cfg.overwrite:
            rundir.clear(run_dir)
        atomic_write_text(run_dir / CONFIG_FILE, json.dumps(_persisted(cfg), indent=2) + "\n")
        return _run(cfg, run_dir)


def _persisted(cfg: TrainConfig) -> dict[str, Any]:
    """What config.json records: the resolved config, less the flags of this invocation."""
    return {k: v for k, v in cfg.to_dict().items() if k not in _NOT_PERSISTED}


def _run(cfg: TrainConfig, run_dir: Path) -> LaunchResult:
    node = cfg.launch.node_rank
    log_path = run_dir / LOG_DIR / f"node{node}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nfab-train-") as tmp:
        config_file = Path(tmp) / "config.json"
        config_file.write_text(cfg.to_json())
        ranks = range(node * cfg.launch.nproc, (node + 1) * cfg.launch.nproc) if cfg.launch.nnodes == 1 else range(0)
        before = os.environ.get(LAUNCHER_ENV)
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # the ranks' parent: they end with it (worker.py)
        try:
            failure = run_torchrun(torchrun_argv(cfg, config_file), log_path, ranks)
        finally:  # a caller's own later subprocesses must not inherit it
            if before is None:
                os.environ.pop(LAUNCHER_ENV, None)
            else:
                os.environ[LAUNCHER_ENV] = before
    if failure is not None:
        text = log_path.read_text(errors="replace") if log_path.is_file() else ""
        message, worker_code = explain_failure(text, *failure)
        where = f"log: {log_path}" if text else f"its log {log_path} is empty"
        raise WorkerError(f"training failed: {message} ({where}){_disk_note(run_dir)}", worker_code)
    summary_path = run_dir / SUMMARY_FILE
    summary = json.loads(summary_path.read_text()) if node == 0 and summary_path.is_file() else None
    return LaunchResult(run_dir, summary)


def _disk_note(run_dir: Path, floor_bytes: int = 64 << 20) -> str:
    """`; the run dir's file system has N MB free` when it is nearly full: a full disk failed a rank
    in a checkpoint write, and the rank's own log, on the same disk, could not say so."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return ""
    return f"; {run_dir}'s file system has {free / 2**20:.1f} MB free (out of space?)" if free < floor_bytes else ""


def _rendezvous_line(exc: Exception, args: Any) -> str:
    """One line for a rendezvous failure (torch raises it with a traceback and a multi-line message)."""
    text = str(exc)
    where = args.rdzv_endpoint or "this node"
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return f"rendezvous endpoint {where}: its port is in use by another process; pass another --rdzv-endpoint"
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined is not None or "Timed out" in text:
        count = f" ({joined[1]} of {joined[2]} nodes joined)" if joined else ""
        return (f"rendezvous at {where} timed out after launch.timeout_s{count}: start every node with the same "
                "--rdzv-endpoint and --nnodes")
    return f"rendezvous at {where} failed: {text.splitlines()[0] if text else type(exc).__name__}"


def run_torchrun(argv: list[str], log_path: Path, ranks: range = range(0),
                 ) -> tuple[int, int, tuple[int, ...]] | None:
    """Run torchrun in this process with stderr (its logs and the workers') sent to `log_path`.

    Returns None on success, else (global rank, exit code) of the first failed worker and the
    ranks among `ranks` (this node's) that were still running when it failed: torchrun stops
    them, and after a collective timeout they are the ones that never arrived.
    """
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    sys.stderr.flush()
    saved = os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log_fd, 2)
    try:
        run(args)
        return None
    except ChildFailedError as exc:
        # A rank that died silently (killed, os._exit) is the cause; peers then fail on
        # closed connections, sometimes first. Prefer the silent one when the log shows it.
        text = log_path.read_text(errors="replace")
        loud = {int(r) for r in re.findall(rf"{re.escape(ERROR_MARK)}\[\d\] rank (\d+):", text)}
        # Ranks torchrun itself stopped after the first failure were still running: not a cause.
        stopped = {r for r, f in exc.failures.items() if f"Sending process {f.pid} closing signal" in text}
        alive = tuple(sorted({r for r in ranks if r not in exc.failures} | stopped))
        silent = sorted((r, f.exitcode) for r, f in exc.failures.items() if r not in loud and r not in stopped)
        if silent:
            return (*silent[0], alive)
        causes = {r: f for r, f in exc.failures.items() if r not in stopped} or exc.failures
        rank = min(causes, key=lambda r: (causes[r].timestamp, r))
        return rank, causes[rank].exitcode, tuple(r for r in alive if r != rank)
    except DistError as exc:  # the launcher's own rendezvous: a node that never came, a port in use
        raise WorkerError(_rendezvous_line(exc, args), 2 if "EADDRINUSE" in str(exc) else 1) from None
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log_fd)


def explain_failure(log: str, rank: int, exitcode: int, alive: tuple[int, ...] = ()) -> tuple[str, int]:
    """One line for a failed run: the first failed rank's own error, else its exit code.

    After a collective timeout, the ranks still running are named: they never arrived.
    """
    marks = re.findall(rf"{re.escape(ERROR_MARK)}\[(\d)\] rank (\d+): (.*)$", log, flags=re.M)
    own = [m for m in marks if int(m[1]) == rank]
    if own:
        message = f"rank {rank}: {own[-1][2]}"
        if alive and "timed out" in message:
            message += f"; rank {', '.join(map(str, alive))} never arrived and was stopped"
        return message, int(own[-1][0])
    watchdog = re.search(r"Watchdog caught collective operation timeout: (\w+\((?:[^()]|\([^()]*\))*\))", log)
    if exitcode == -signal.SIGABRT and watchdog:  # NCCL aborts the rank: nfab's own line is never printed
        return (f"rank {rank}: a collective timed out after launch.timeout_s and NCCL's watchdog ended the rank "
                f"({watchdog.group(1)}; its stack is in the log)"), 1
    if exitcode < 0:
        return f"rank {rank} was killed by signal {-exitcode}", 1
    return f"rank {rank} exited with code {exitcode} without an error message", 1
