"""What `nfab.attach` checks before it registers the hook, so a mistake is one `NfabError` at the call.

Inside DDP's backward a problem surfaces as a hook failure on some rank, mid-step; every
check here needs only the profile, the arguments and the wrapped module, so it runs on
every rank before anything is registered.
"""

from __future__ import annotations

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


def check_attach(profile: Profile, module: nn.Module, *, explicit: bool, total_steps: int | None,
                 model_signature: str | None) -> None:
    """Everything `attach` can check before registering: phases vs total_steps, the model's signature.

    Route names were checked when the profile or route was parsed (`nfab.profile.routes`).
    """
    check_phases(profile, total_steps)
    if not explicit:
        check_model(profile, module, model_signature)
