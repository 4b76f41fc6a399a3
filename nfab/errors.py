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


class UserCodeError(NfabError):
    """The user's own code (a loss, a data or model factory) raised: one line naming the function and its
    exception; the CLI logs the traceback and names the log."""
