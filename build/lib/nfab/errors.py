"""Errors a user can cause. The CLI turns every `NfabError` into one line and exit code 2."""

from __future__ import annotations


class NfabError(Exception):
    """A problem with the user's input or environment, reported as one clear line."""


class CapacityError(NfabError):
    """A reducer was asked to be exact at a world size its lanes or levels cannot hold."""


class ProfileError(NfabError):
    """A profile file is malformed, of another schema version, or made for another model."""


class ConfigError(NfabError):
    """A config file or `key=value` override is malformed or names an unknown key."""
