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
from nfab.models.registry import model_signature as signature_of
from nfab.profile.schema import Profile


def check_phases(profile: Profile, total_steps: int | None) -> None:
    """Phases placed by fraction need the run's length; a length must be a positive step count."""
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps < 1):
        raise NfabError(f"total_steps must be a positive integer, got {total_steps!r}")
    by_fraction = [p.name for p in profile.phases if p.start.fraction is not None and p.start.fraction > 0]
    if by_fraction and total_steps is None:
        raise NfabError(f"profile for {profile.model.name!r} places phase {by_fraction[0]!r} at a fraction of the "
                        "run: pass total_steps= to nfab.attach")


def check_model(profile: Profile, module: nn.Module, model_signature: str | None) -> None:
    """A profile with a signature refuses a model of another parameter layout (the DDP module's own)."""
    if not profile.model.signature:
        return
    signature = model_signature if model_signature is not None else signature_of(module)
    if signature != profile.model.signature:
        raise ProfileError(
            f"profile was made for model {profile.model.name!r} with another parameter layout "
            f"(signature {profile.model.signature[:12]}…, this model {signature[:12]}…)")


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


def check_attach(profile: Profile, module: nn.Module, *, explicit: bool, total_steps: int | None,
                 model_signature: str | None, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Everything `attach` can check before registering: phases vs total_steps, the model's signature,
    the route's parameter globs, the optimizer's parameters.

    Route names were checked when the profile or route was parsed (`nfab.profile.routes`).
    """
    check_phases(profile, total_steps)
    if not explicit:
        check_model(profile, module, model_signature)
    check_globs(profile, module)
    check_optimizer(optimizer, module)
