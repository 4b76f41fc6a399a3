"""The operating profile: a versioned JSON file that says which route each region takes when.

Public: `Profile` (also exported as `nfab.Profile`).
"""

from nfab.profile.schema import REGIONS, Fallback, Health, Phase, Profile

__all__ = ["REGIONS", "Fallback", "Health", "Phase", "Profile"]
