"""nfab (NEURON-Fabric): controlled low-bit gradient communication for PyTorch DDP.

Public API: `nfab.attach(ddp_model, profile)` (its options: `nfab.AttachConfig`), `nfab.calibrate(model,
data, loss=...)` (calibrate the user's own training: `nfab.calibrate.api`), `nfab.Profile` and
`nfab.Hierarchy` (two-level reduction, `attach(..., hierarchy=)`); `nfab.NfabError`, what `attach` raises
for a mistake at the call (`nfab.ProfileError`, a profile that cannot be used, is one); the `nfab` CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nfab.errors import NfabError, ProfileError

__version__ = "0.1.0"
__all__ = ["AttachConfig", "Hierarchy", "NfabError", "Profile", "ProfileError", "attach", "calibrate", "__version__"]

if TYPE_CHECKING:
    from nfab.api import attach
    from nfab.config.attach import AttachConfig
    from nfab.profile.schema import Profile
    from nfab.runtime.core.hierarchy import Hierarchy


def __getattr__(name: str) -> Any:
    # lazy: `nfab --version` and the CLI's help must not pay for importing torch
    if name == "attach":
        from nfab.api import attach

        return attach
    if name == "AttachConfig":
        from nfab.config.attach import AttachConfig

        return AttachConfig
    if name == "calibrate":  # the package, callable as the Python calibration API
        import nfab.calibrate

        return nfab.calibrate
    if name == "Profile":
        from nfab.profile.schema import Profile

        return Profile
    if name == "Hierarchy":
        from nfab.runtime.core.hierarchy import Hierarchy

        return Hierarchy
    raise AttributeError(name)
