"""Time to accuracy: how soon each communication variant reaches FP32's smoothed final validation loss.

The same model, recipe (a shipped training config and the user's overrides: optimizer,
schedule, clipping, accumulation, precision, as `nfab train` steps them: `step.recipe_step`), data
and seed train under each variant on the same W gloo ranks, on an emulated link (`link`:
`nfab.bench.netns`):

- `fp32`: plain DDP; it trains its full `steps`, and its smoothed final validation loss sets the target;
- `bf16`: torch's `bf16_compress_hook` (bf16 DDP, the honest baseline);
- `powersgd`: torch's `powerSGD_hook`, rank 4, one bucket (several abort on gloo);
- `nfab-profile`: nfab with the calibrated profile (cost gate on: by default, on a shaped link, the link
  declared as a user who knows theirs declares it, `declared_cost_model`; else attach measures it).

The target (`target_loss`): FP32's smoothed final validation loss, the mean of its last
`target_evals` evaluations, plus `tolerance` (2%: `target_loss`). Why not FP32's exact final
loss: on a small held-out set that one number is a draw, and a variant that ends level with
FP32 reaches it or not by luck (the default resnet18 run had bf16, PowerSGD and nfab all miss it
in twice FP32's steps, while FP32 itself had been there at step 120 of 150). Every variant is
evaluated every `eval_every` steps and at FP32's last step; a variant reaches the target at its
first evaluation whose loss is <= the target, and stops there, or at `max_factor` x FP32's steps
without it (`time_to_target_s` null). FP32 itself is judged by the same rule, so its time to
target may be shorter than its full run.

Steps are interleaved as in `nfab.bench.step` (step i of every variant still training runs
before step i+1 of any, in an order that rotates each step; each step starts after a
barrier), so machine noise hits the variants alike; each variant's trajectory does not
depend on the order, so this is the same as running FP32 first. The clock is training only:
a variant's wall time is the sum of its steps' times (each the slowest rank's); evaluation,
barriers and byte counting are outside it, and so is step 1 (one-off set-up: DDP's buckets,
nfab's plans and compiled kernels; reported as `first_step_s`), for every variant alike.

Bytes: `wire_bytes` counts the gradient bytes each rank sends up to the target (FP32 and bf16
ring all-reduce, PowerSGD's P/Q all-reduces after its uncompressed start, nfab's own count with
probes and control words); on a shaped link `link_bytes` adds what the link's tx counter saw.
"""

# No `from __future__ import annotations`: the hooks `attach_comm` registers are checked by DDP.
import copy
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import nfab
from nfab.bench import host, linkbytes, netns
from nfab.bench import step as step_mod
from nfab.bench.variants import POWERSGD_START, attach_comm, ddp_for
from nfab.config.shipped import resolve_config
from nfab.data import build_dataset, make_eval_loader
from nfab.distributed import run_ranks
from nfab.errors import ConfigError
from nfab.models import build_model
from nfab.train.config import NFAB_BUCKET_MB, TrainConfig, load_config
from nfab.train.loop import evaluate
from nfab.train.setup import BatchStream, build_optimizer, lr_factor
from nfab.validation import STRICT_DATACLASS, validate_dataclass
from nfab.wire.cost import is_declared, parse_link

TTA_VARIANTS: tuple[str, ...] = ("fp32", "bf16", "powersgd", "nfab-profile")
"""Variant names in the JSON, in order; `fp32` is always run (it sets the target)."""
STEP_NAMES = {"fp32": "plain"}
"""tta variant -> the `nfab.bench.step` variant that runs it (others: the same name)."""
MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    # resnet18 at width 32 (2.8M parameters) on 8x8 digits: FP32's all-reduce is most of a step
    # on 100 Mbit/s. A cosine floor of 0.1, as the GPT config has, so that a variant still
    # training past FP32's length still learns (at 0.0 its learning rate would be zero there).
    "resnet18": ("resnet18-digits", ("model.width=32", "schedule.min_lr_ratio=0.1")),
    "gpt": ("gpt-nano-stdlib", ()),
}
"""`--model` -> (shipped config, its overrides for this benchmark)."""
POWERSGD_RANK = 4
TARGET_TOLERANCE = 0.02
"""The target is FP32's smoothed final loss times 1 + this: level with FP32, within 2%."""
TARGET_EVALS = 3
"""FP32's last evaluations averaged into its smoothed final loss (at `eval_every` 10: its last 30 steps)."""
UNSET_BY_RECIPE = ("comm", "launch", "parallel")
"""Config sections a `bench tta` override may not set: the variants and the ranks are the benchmark's.
The rest of the recipe (optimizer, clipping, accumulation, precision, schedule, data) every variant
trains with (`step.recipe_step`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TtaConfig:
    """One time-to-accuracy run (JSON-able: it crosses into the namespace and the ranks)."""

    __pydantic_config__ = STRICT_DATACLASS

    model: str = "resnet18"
    """A key of `MODELS` (the shipped config it trains)."""
    overrides: tuple[str, ...] = ()
    """`key=value` overrides on that config (after the benchmark's own)."""
    steps: int | None = None
    """FP32's steps (the schedule's length for every variant); None: the config's."""
    eval_every: int = 10
    """Validation cadence in steps (plus one evaluation at FP32's last step)."""
    max_factor: float = 2.0
    """A variant gives up at max_factor x FP32's steps."""
    variants: tuple[str, ...] = TTA_VARIANTS
    world_size: int = 2
    link: str | None = None
    """A tc rate to shape the ranks' loopback to (`100mbit`), or None (loopback)."""
    cost_model: str = "measure"
    """nfab's cost model: `measure` (at attach), a declared link (`link:100mbit`, what `nfab bench tta --link
    100mbit` passes: `declared_cost_model`) or `none`."""
    profile: dict[str, Any] | None = None
    """The profile (JSON dict) for `nfab-profile`; None: `variants.test_profile()`."""
    profile_source: str = "test profile"
    powersgd_rank: int = POWERSGD_RANK
    powersgd_start: int = POWERSGD_START
    eval_batches: int | None = None
    """Cap on validation batches per rank (None: the config's `eval_batches`, else all)."""
    tolerance: float = TARGET_TOLERANCE
    """The target is FP32's smoothed final loss x (1 + tolerance) (`target_loss`)."""
    target_evals: int = TARGET_EVALS
    """FP32's last evaluations averaged into its smoothed final loss."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"bench tta model must be one of {', '.join(MODELS)}, got {self.model!r}")
        unknown = [v for v in self.variants if v not in TTA_VARIANTS]
        if unknown:
            raise ConfigError(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(TTA_VARIANTS)}")
        # fp32 first, always: it sets the target
        object.__setattr__(self, "variants", tuple(v for v in TTA_VARIANTS if v == "fp32" or v in self.variants))
        if not 0.0 <= self.tolerance < 1.0:
            raise ConfigError(f"tolerance must be in [0, 1) (0.02: within 2% of FP32), got {self.tolerance}")
        for key in ("eval_every", "world_size", "powersgd_rank", "target_evals"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {self.steps}")
        if self.max_factor < 1.0:
            raise ConfigError(f"max_factor must be >= 1, got {self.max_factor}")
        if self.link is not None:
            object.__setattr__(self, "link", netns.check_rate(self.link))
        if is_declared(self.cost_model):
            parse_link(self.cost_model)  # one line here, not inside a rank
        elif self.cost_model not in step_mod.COST_MODELS:
            raise ConfigError(f"cost_model must be one of {', '.join(step_mod.COST_MODELS)}, got {self.cost_model!r}")
        for o in self.overrides:  # what a variant, not the recipe, decides: refused rather than ignored
            key = o.split("=", 1)[0].strip()
            if key.split(".", 1)[0] in UNSET_BY_RECIPE:
                raise ConfigError(f"bench tta sets each variant's communication and launch itself (--variants, "
                                  f"--profile, --world-size): drop the override {o!r}")
        self.train_config()  # a bad override is one line here, not inside a rank

    def train_config(self) -> TrainConfig:
        """The recipe every variant trains with: the shipped config, the benchmark's and the user's overrides."""
        name, own = MODELS[self.model]
        steps = () if self.steps is None else (f"steps={self.steps}",)
        return load_config(resolve_config(name), [*own, *self.overrides, *steps])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["variants"], d["overrides"] = list(self.variants), list(self.overrides)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TtaConfig":
        return validate_dataclass(cls, d, where="bench tta")


@dataclass(slots=True)
class Trainee:
    """One variant on this rank: its step.Run, schedule, clock and evaluation curve."""

    name: str
    run: step_mod.Run
    scheduler: torch.optim.lr_scheduler.LambdaLR
    steps: int = 0
    clock_s: float = 0.0
    """Training time so far: the sum of the slowest rank's step times (agreed at evaluations),
    step 1 excepted (see `first_step_s`)."""
    first_step_s: float | None = None
    """Step 1's time, kept off the clock for every variant alike: DDP builds its buckets, PowerSGD
    its state and nfab its plans and loads its compiled kernels, once per process, not per step."""
    pending: list[float] = field(default_factory=list)
    """This rank's step times since the last evaluation."""
    wire_bytes: float = 0.0
    link_bytes: int = 0
    curve: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    control: list[dict[str, Any]] = field(default_factory=list)
    """nfab only: per step, its route mix and any fallback or health event (why a step was slow)."""


def _step_bytes(t: Trainee, cfg: TtaConfig, module: torch.nn.Module, world: int, seen: int) -> float:
    """Gradient bytes this rank sent in the step just taken (see the module docstring); for nfab,
    also notes the step's control (route mix, fallback reason, health events) in `t.control`."""
    rt = t.run.runtime
    if rt is not None:
        if rt.step <= seen:
            return 0.0
        st = rt.history[-1]
        t.control.append({"step": t.steps + 1, "route_mix": st.route_mix, "fallback": st.fallback_reason or None,
                          "events": list(st.events)})
        return float(st.wire_bytes)
    if t.name == "powersgd" and t.steps >= cfg.powersgd_start:
        return linkbytes.powersgd_bytes(module, world, cfg.powersgd_rank)
    if t.name == "powersgd":  # its uncompressed first steps
        return linkbytes.per_rank_bytes("plain", module, world, None)
    return linkbytes.per_rank_bytes(STEP_NAMES.get(t.name, t.name), module, world, None)


def build_trainees(cfg: TtaConfig, tc: TrainConfig, module: torch.nn.Module, spec: Any, fp32_steps: int,
                   ) -> list[Trainee]:
    """Every variant from one seeded model: DDP, the recipe's optimizer and schedule, its communication."""
    out = []
    for name in cfg.variants:
        sname = STEP_NAMES.get(name, name)
        ddp = ddp_for(sname, copy.deepcopy(module), NFAB_BUCKET_MB)
        opt = build_optimizer(ddp.module, tc.optim, spec.optimizer)
        scaler = torch.amp.GradScaler("cpu") if tc.precision == "fp16" else None
        run = step_mod.Run(name, ddp, opt, scaler=scaler)
        run.runtime, run.state = attach_comm(
            sname, ddp, total_steps=fp32_steps, seed=tc.seed, cost_model=cfg.cost_model, profile=cfg.profile,
            powersgd_rank=cfg.powersgd_rank, powersgd_start=cfg.powersgd_start, optimizer=opt,
            head_modules=spec.head_modules, loss_scaler=scaler)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, fp32_steps, tc.schedule))
        out.append(Trainee(name, run, sched))
    return out


def declared_cost_model(link: str | None) -> str:
    """nfab's cost model in `bench tta` by default: the emulated link, declared (`100mbit` -> `link:100mbit`),
    as a user who knows their link declares it; `measure` without a link (or one a declaration cannot name).

    Why not `measure` under `--link`: `tc tbf` passes its 256 KB burst at loopback speed, so the
    measurement's small all-reduces are near free and its big ones pay the rate; the line through them
    has a negative latency and misses its points by 264-973%, the measurement names it implausible, and
    the gate keeps FP32 on every region and step (seed 0 of the default command, 2026-12-07: nfab
    1851 ms a step, FP32's 1842, 1331 MB to FP32's 1343)."""
    if link is None:
        return "measure"
    spec = f"link:{link}"
    try:
        parse_link(spec)
    except ConfigError:
        return "measure"
    return spec


def smoothed_final(curve: list[dict[str, Any]], evals: int = TARGET_EVALS) -> float:
    """The mean validation loss of a curve's last `evals` evaluations (all of them if fewer)."""
    last = [p["val_loss"] for p in curve[-evals:]]
    return float(sum(last) / len(last))


def target_loss(fp32_curve: list[dict[str, Any]], tolerance: float = TARGET_TOLERANCE,
                evals: int = TARGET_EVALS) -> float:
    """The loss every variant is judged against: FP32's smoothed final loss x (1 + tolerance)."""
    return smoothed_final(fp32_curve, evals) * (1.0 + tolerance)


def target_rule(cfg: TtaConfig) -> str:
    """The target's definition in words (the JSON's `target_rule`, the tables' titles)."""
    return (f"FP32's mean validation loss over its last {cfg.target_evals} evaluations "
            f"+ {cfg.tolerance:.0%}")


def reached(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first evaluation point at or below the target, or None."""
    return next((p for p in curve if p["val_loss"] <= target), None)


def rank_main(rank: int, world: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `nfab bench tta` (under `run_ranks`)."""
    cfg = TtaConfig.from_dict(cfg_dict)
    tc = cfg.train_config()
    device = torch.device("cpu")
    spec = build_model(tc.model.name, seed=tc.seed, **tc.model.options)
    n = tc.steps
    limit = int(round(cfg.max_factor * n))
    trainees = build_trainees(cfg, tc, spec.module, spec, n)
    recipe = step_mod.Recipe.of(tc)
    train_data = build_dataset(tc.data.name, split="train", seed=tc.seed, **tc.data.options)
    test_data = build_dataset(tc.data.name, split="test", seed=tc.seed, **tc.data.options)
    stream = BatchStream(train_data, batch_size=tc.data.batch_size, rank=rank, world_size=world, seed=tc.seed)
    eval_loader = make_eval_loader(test_data, batch_size=tc.data.eval_batch_size, rank=rank, world_size=world)
    max_batches = cfg.eval_batches if cfg.eval_batches is not None else tc.data.eval_batches
    counter = linkbytes.TxCounter("lo" if cfg.link is not None and rank == 0 else None)
    module0 = trainees[0].run.ddp.module
    target: float | None = None
    for i in range(limit):
        active = [t for t in trainees if not t.done]
        if not active:
            break
        batches = [stream.next() for _ in range(recipe.accum_steps)]  # the same micro-batches for every variant
        k = i % len(active)
        for t in active[k:] + active[:k]:
            seen = t.run.runtime.step if t.run.runtime is not None else 0
            dist.barrier()
            before = counter.read()
            t.pending.append(step_mod.recipe_step(t.run, batches, spec.task, recipe))
            dist.barrier()
            t.link_bytes += counter.read() - before
            t.wire_bytes += _step_bytes(t, cfg, module0, world, seen)
            t.scheduler.step()
            t.steps += 1
        at_eval = (i + 1) % cfg.eval_every == 0 or i + 1 in (n, limit)
        if not at_eval:
            continue
        for t in active:
            times = torch.tensor(t.pending, dtype=torch.float64)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            if t.first_step_s is None:
                t.first_step_s, times = float(times[0]), times[1:]
            t.clock_s += float(times.sum())
            t.pending = []
            loss = evaluate(t.run.ddp.module, eval_loader, spec.task, max_batches, device).loss
            t.curve.append({"step": t.steps, "time_s": t.clock_s, "val_loss": loss, "wire_bytes": t.wire_bytes,
                            "link_bytes": t.link_bytes})
        if i + 1 == n:
            target = target_loss(trainees[0].curve, cfg.tolerance, cfg.target_evals)
            trainees[0].done = True
        if target is not None:
            for t in active:
                t.done = t.done or reached(t.curve, target) is not None or t.steps >= limit
    assert target is not None
    return {"target_loss": target, "fp32_smoothed_loss": smoothed_final(trainees[0].curve, cfg.target_evals),
            "fp32_steps": n, "max_steps": limit, "task": spec.task,
            "parameters": sum(p.numel() for p in module0.parameters()),
            "variants": {t.name: variant_result(t, target, cfg.powersgd_rank) for t in trainees},
            "params_sha256": {t.name: linkbytes.params_digest(t.run.ddp.module) for t in trainees}}


def variant_result(t: Trainee, target: float, powersgd_rank: int = POWERSGD_RANK) -> dict[str, Any]:
    """One variant's JSON entry: time, steps and bytes to the target (None if never), and its curve."""
    hit = reached(t.curve, target)
    last = t.curve[-1]
    rt = t.run.runtime
    description = step_mod.describe(STEP_NAMES.get(t.name, t.name))
    if t.name == "powersgd":  # the step bench's text names its own rank (2); this run's is cfg's
        description = f"torch powerSGD_hook, rank {powersgd_rank}"
    return {
        "description": description,
        "time_to_target_s": None if hit is None else hit["time_s"],
        "steps_to_target": None if hit is None else hit["step"],
        "steps": t.steps,
        "final_loss": last["val_loss"],
        "best_loss": min(p["val_loss"] for p in t.curve),
        "wire_bytes": (hit or last)["wire_bytes"],
        "link_bytes": (hit or last)["link_bytes"],
        "train_time_s": last["time_s"],
        "first_step_s": t.first_step_s,
        "route_mix": None if rt is None else rt.history[-1].route_mix,
        **({} if rt is None else control_summary(t.control)),
        "curve": t.curve,
    }


def control_summary(control: list[dict[str, Any]]) -> dict[str, Any]:
    """What nfab's control did over the run: steps in fallback (by reason), steps all-FP32, health events."""
    reasons: dict[str, int] = {}
    for c in control:
        if c["fallback"]:
            reasons[c["fallback"]] = reasons.get(c["fallback"], 0) + 1
    return {
        "fallback_steps": sum(reasons.values()),
        "fallback_reasons": reasons,
        "all_fp32_steps": [c["step"] for c in control if c["route_mix"].get("fp32", 0.0) >= 1.0],
        "health_events": [f"{c['step']}: {e}" for c in control for e in c["events"]][:50],
    }


# ---- running and summarising --------------------------------------------------------
def _timeout(cfg: TtaConfig) -> float:
    """A hang guard, generous (the machine is shared): about 3 s per variant step."""
    steps = cfg.train_config().steps
    return 600.0 + 3.0 * steps * (1 + cfg.max_factor * (len(cfg.variants) - 1))


def _run_local_target(payload: dict[str, Any]) -> dict[str, Any]:
    cfg = TtaConfig.from_dict(payload)
    out = run_ranks(rank_main, cfg.world_size, cfg.to_dict(), timeout_s=_timeout(cfg), pg_timeout_s=900)[0]
    out["link"] = None
    return out


def run(cfg: TtaConfig) -> dict[str, Any]:
    """Run the benchmark (on a shaped loopback when `cfg.link`); the raw result dict of rank 0."""
    if cfg.link is None:
        return _run_local_target(cfg.to_dict())
    return netns.run_shaped(cfg.link, "nfab.bench.tta:_run_local_target", cfg.to_dict(),
                            timeout_s=_timeout(cfg) + 60)


def ratios(variants: dict[str, dict[str, Any]], base: str) -> dict[str, float | None]:
    """Per variant, base's time to target / the variant's (>1: the variant is faster); None if either
    missed, or if the variant was there before any training time passed (a run of one step: 0 s)."""
    b = variants.get(base, {}).get("time_to_target_s")
    return {name: (None if b is None or not v["time_to_target_s"] else b / v["time_to_target_s"])
            for name, v in variants.items()}


def lower_bounds(variants: dict[str, dict[str, Any]], base: str) -> dict[str, float | None]:
    """Where base never reached the target and a variant did: base's whole training time / the
    variant's time to target, a lower bound on the speed-up (base would need longer still)."""
    b = variants.get(base)
    if b is None or b["time_to_target_s"] is not None:
        return {name: None for name in variants}
    return {name: (None if not v["time_to_target_s"] else b["train_time_s"] / v["time_to_target_s"])
            for name, v in variants.items()}


def report(cfg: TtaConfig, raw: dict[str, Any], command: str = "") -> dict[str, Any]:
    """The JSON document: `kind`, the target, each variant (with its curve) and its speed-ups
    (`speedup_vs_B`, or `speedup_vs_B_at_least` where B never reached the target)."""
    variants = raw["variants"]
    for base in ("fp32", "bf16"):
        for name, r in ratios(variants, base).items():
            variants[name][f"speedup_vs_{base}"] = r
        for name, r in lower_bounds(variants, base).items():
            variants[name][f"speedup_vs_{base}_at_least"] = r
    return {
        "kind": "nfab.bench.tta",
        "nfab_version": nfab.__version__,
        "torch_version": torch.__version__,
        "machine": host.describe(),
        "command": command or " ".join(sys.argv),
        "config": cfg.to_dict(),
        "recipe": cfg.train_config().model_dump(mode="json"),
        "clock": "training steps 2.. only (slowest rank per step); evaluation and step 1 excluded for every "
                 "variant",
        "link": raw.get("link"),
        "parameters": raw["parameters"],
        "target_loss": raw["target_loss"],
        "target_rule": target_rule(cfg),
        "fp32_smoothed_loss": raw.get("fp32_smoothed_loss"),
        "fp32_steps": raw["fp32_steps"],
        "max_steps": raw["max_steps"],
        "variants": variants,
        "params_sha256": raw["params_sha256"],
    }


def mean_step_ms(v: dict[str, Any]) -> float:
    """A variant's mean training time per step, ms (its clock over its steps)."""
    return float(1e3 * v["train_time_s"] / max(v["steps"] - 1, 1))  # step 1 is off the clock


def summary_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Table rows: time and steps to target, speed-ups against FP32 and bf16, bytes to target."""
    def per_step(v: dict[str, Any]) -> float:  # `wire_bytes` runs to the target (or the end): so do the steps
        return v["wire_bytes"] / max(v["steps_to_target"] or v["steps"], 1)

    fp32_bytes = per_step(doc["variants"]["fp32"])
    rows = []
    for name, v in doc["variants"].items():
        sent = per_step(v)
        rows.append({"variant": name, "time_to_target_s": v["time_to_target_s"],
                     "steps_to_target": v["steps_to_target"], "steps": v["steps"], "final_loss": v["final_loss"],
                     **{k: v.get(k) for k in ("speedup_vs_fp32", "speedup_vs_bf16", "speedup_vs_fp32_at_least",
                                              "speedup_vs_bf16_at_least")},
                     "wire_bytes": v["wire_bytes"], "step_ms": mean_step_ms(v),
                     "fewer_bytes_per_step_vs_fp32": None if sent == 0 else float(fp32_bytes / sent)})
    return rows


def write_json(path: Any, doc: dict[str, Any]) -> Any:
    return step_mod.write_json(path, doc)

