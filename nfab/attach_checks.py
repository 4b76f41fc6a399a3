"""What `nfab.attach` checks before it registers the hook, so a mistake is one `NfabError` at the call.

Inside DDP's backward a problem surfaces as a hook failure on some rank, mid-step; every
check here needs only the profile, the arguments and the wrapped module, so it runs on
every rank before anything is registered.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from nfab.errors import NfabError, ProfileError
from nfab.models.registry import layout_differences
from nfab.models.registry import model_signature as signature_of
from nfab.profile.routes import parse_route, split_route
from nfab.profile.schema import Profile
from nfab.runtime.bindings import classify


def check_phases(profile: Profile, total_steps: int | None) -> None:
    """Phases placed by fraction need the run's length; a length must be a positive step count."""
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise NfabError(f"total_steps must be a positive integer, got {total_steps!r}")
    by_fraction = [p.name for p in profile.phases if p.start.fraction is not None and p.start.fraction > 0]
    if by_fraction and total_steps is None:
        raise NfabError(f"profile for {profile.model.name!r} places phase {by_fraction[0]!r} at a fraction of the "
                        "run: pass total_steps= to nfab.attach")


def check_model(profile: Profile, module: nn.Module, model_signature: str | None, *,
                sibling: bool = False, head_modules: tuple[str, ...] | None = None) -> str | None:
    """A profile with a signature refuses a model of another parameter layout (the DDP module's own).

    With `sibling` (attach's explicit opt-in) a profile calibrated on a sibling model, the same region
    classes at other sizes, is taken: its region routes carry over. Returned then: the one line attach
    logs, naming what differs; a region class the profile routes that the model lacks (its regions as
    `head_modules` makes them) is refused."""
    if not profile.model.signature:
        return None
    signature = model_signature if model_signature is not None else signature_of(module)
    if signature != profile.model.signature:
        seen = profile.provenance.get("calibrated") or profile.provenance.get("in_run") or {}
        kept = seen.get("parameters")  # the layout calibration saw (offline, or inside a run)
        which = f": {layout_differences(list(kept), module)}" if isinstance(kept, list) and kept else ""
        if sibling:
            return _sibling_note(profile, module, which, head_modules)
        raise ProfileError(
            f"profile was made for model {profile.model.name!r} with another parameter layout "
            f"(signature {profile.model.signature[:12]}…, this model {signature[:12]}…){which}")


def check_globs(profile: Profile, module: nn.Module) -> None:
    """Every parameter-name glob of the route names a trainable parameter: `{"lyr1.*": "bq2"}` for
    `l1` would otherwise send everything FP32 with nothing said."""
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    for glob in profile.overrides:
        if not any(fnmatchcase(name, glob) for name in names):
            sample = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
            raise NfabError(f"route glob {glob!r} matches no trainable parameter of this model (its names: {sample})")


def check_optimizer(optimizer: torch.optim.Optimizer | None, module: nn.Module) -> None:
    """`optimizer=` steps at least one of the model's trainable parameters: nfab reads its moments for
    the drift monitor and corrects its second moment, which another model's optimizer would not
    hold. (A model split between optimizers passes the one for its largest part.)"""
    if optimizer is None:
        return
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    trainable = [p for p in module.parameters() if p.requires_grad]
    if trainable and not any(id(p) in owned for p in trainable):
        raise NfabError(f"optimizer= ({type(optimizer).__name__}) steps none of this model's parameters: "
                        "pass the optimizer built from the wrapped model's parameters")


GRADIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The gradient dtypes nfab's hook reduces (DDP buckets a model's gradients in its parameters' dtype)."""


def check_params(module: nn.Module) -> None:
    """Every trainable parameter has a dense gradient of a dtype the hook reduces.

    A float64 (or complex) model and an `Embedding(sparse=True)` pass through DDP, and would
    fail inside the first backward: in the norm pass (float64) or the bucket plan (a sparse
    gradient has no storage to view).
    """
    for name, p in module.named_parameters():
        if p.requires_grad and p.dtype not in GRADIENT_DTYPES:
            raise NfabError(f"parameter {name!r} is {p.dtype}: nfab reduces float32, bfloat16 and float16 "
                            "gradients (convert the model, e.g. model.float())")
    for name, m in module.named_modules():
        if getattr(m, "sparse", False) is True and any(p.requires_grad for p in m.parameters(recurse=False)):
            raise NfabError(f"{type(m).__name__} {name or '(root)'!r} has sparse=True: nfab's hook reduces dense "
                            "gradients (DDP all-reduces a sparse one without a hook); build it with sparse=False")


def check_attach(profile: Profile, module: nn.Module, *, explicit: bool, total_steps: int | None,
                 model_signature: str | None, optimizer: torch.optim.Optimizer | None = None,
                 sibling: bool = False, head_modules: tuple[str, ...] | None = None) -> str | None:
    """Everything `attach` can check before registering: phases vs total_steps, the model's signature,
    the route's parameter globs, the optimizer's parameters, the parameters' dtypes and density.

    Route names were checked when the profile or route was parsed (`nfab.profile.routes`).
    """
    check_phases(profile, total_steps)
    note = None
    if not explicit:
        note = check_model(profile, module, model_signature, sibling=sibling, head_modules=head_modules)
    check_globs(profile, module)
    check_optimizer(optimizer, module)
    check_params(module)
    return note


def _sibling_note(profile: Profile, module: nn.Module, which: str, head_modules: tuple[str, ...] | None) -> str:
    """The line a sibling's profile is attached with; refused where it routes a region class the model lacks."""
    have = {b.region for b in classify(module, head_modules).values()}
    routed = {r for p in profile.phases for r, route in p.routes.items() if route != "fp32"}
    if missing := sorted(routed - have):
        raise ProfileError(f"profile of a sibling routes region classes this model does not have "
                           f"({', '.join(missing)}): not the same region classes")
    return (f"nfab: attaching a sibling's profile (sibling=True): {profile.model.name!r} had another parameter "
            f"layout{which}; its region routes carry over")


def sign_zero_warning(profile: Profile, regions: dict[str, str], *, find_unused: bool,
                      error_feedback: bool, world_size: int) -> str | None:
    """The line `attach` logs where a sign route will meet exact zeros it cannot carry, else None.

    A sign vote is one bit and cannot abstain: an exactly-zero element votes by group rank and step,
    half of the ranks' zeros each way (`codec.sign_bits`). Where every rank's element is zero at even W
    the votes tie and it decodes to exactly 0. The vote left over does not cancel, and without error
    feedback it reaches the weights as +-scale, alternating in sign from step to step: where every
    rank's element is zero at odd W (an `embedding` region on sign: rows a batch does not touch), and
    where only some ranks hold the zero (DDP's `find_unused_parameters=True`).
    """
    signed: set[str] = set()
    for phase in profile.phases:
        if error_feedback and phase.error_feedback:
            continue
        signed.update(region for name, region in regions.items()
                      if profile.route_for(phase, name, region).startswith("sign"))
    odd_embedding = "embedding" in signed and world_size % 2 == 1
    if not signed or not (odd_embedding or find_unused):
        return None
    where = (f"at W={world_size} embedding rows a batch does not touch" if odd_embedding
             else "parameters unused on some ranks (find_unused_parameters=True)")
    return (f"nfab: sign votes cannot abstain: an exactly-zero gradient votes by rank and step, half of the ranks' "
            f"zeros each way, so {where} get a +-scale vote that alternates in sign from step to step without "
            "error feedback. Route them bq2 (a zero stays zero) or fp32, or use error feedback (SGD)")


def absent_regions_warning(route: object, regions: dict[str, str]) -> str | None:
    """The line `attach` logs when an explicit per-region route names a region class the model has no
    parameter of, else None. `{"linear": "bq2", "head": "sign"}` on a GPT whose head is tied to its
    embedding (region `embedding`) sent that head FP32 with nothing said. A warning, not a refusal: one
    route string serves several models (`conv:sign,norm:fp32` on a model without convolutions)."""
    parsed = parse_route(route)  # type: ignore[arg-type]
    if not isinstance(parsed, dict):
        return None  # one route everywhere names no region
    named, _ = split_route(parsed)
    absent = sorted(set(named) - set(regions.values()))
    if not absent:
        return None
    return (f"nfab: the route names region(s) {', '.join(absent)} that this model has no parameter of (its "
            f"regions: {', '.join(sorted(set(regions.values())))}); a head tied to the embedding is region "
            "embedding. nfab.runtime.bindings.classify(model) lists every parameter's")
