"""Test-facing fault injection: `NFAB_FAULT="crash@step=K,rank=R"`.

Syntax: one or more faults separated by `;`, each `KIND@key=value,key=value`.
Keys: `step` (required, the 0-based optimizer step at whose start the fault fires),
`rank` (global rank, default 0), `attempt` (torchrun attempt it fires on, i.e. the
value of TORCHELASTIC_RESTART_COUNT, default 0: a restarted run does not repeat it).
Any other key is kept in `params` for the fault kind to interpret.

Kinds: `crash` — `os._exit(1)` on that rank, no cleanup (a killed process).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from nfab.errors import ConfigError

ENV = "NFAB_FAULT"
KINDS = ("crash",)


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault: what, at which step, on which rank and attempt."""

    kind: str
    step: int
    rank: int = 0
    attempt: int = 0
    params: dict[str, str] = field(default_factory=dict)

    def fires(self, step: int, rank: int, attempt: int) -> bool:
        return self.step == step and self.rank == rank and self.attempt == attempt


def parse_faults(text: str | None) -> tuple[Fault, ...]:
    """Parse an NFAB_FAULT value (empty or None: no faults); bad syntax is a ConfigError."""
    faults = []
    for item in filter(None, (s.strip() for s in (text or "").split(";"))):
        kind, sep, rest = item.partition("@")
        if not sep or kind not in KINDS:
            raise ConfigError(f"{ENV}: {item!r} must look like KIND@step=K[,rank=R] with KIND in {KINDS}")
        fields: dict[str, str] = {}
        for pair in filter(None, rest.split(",")):
            key, eq, value = pair.partition("=")
            if not eq:
                raise ConfigError(f"{ENV}: {pair!r} in {item!r} must be key=value")
            fields[key.strip()] = value.strip()
        try:
            step = int(fields.pop("step"))
            rank = int(fields.pop("rank", "0"))
            attempt = int(fields.pop("attempt", "0"))
        except KeyError as exc:
            raise ConfigError(f"{ENV}: {item!r} needs step=K") from exc
        except ValueError as exc:
            raise ConfigError(f"{ENV}: {item!r}: step, rank and attempt must be integers") from exc
        faults.append(Fault(kind, step, rank, attempt, fields))
    return tuple(faults)


def faults_from_env() -> tuple[Fault, ...]:
    return parse_faults(os.environ.get(ENV))


def restart_attempt() -> int:
    """torchrun's restart count for this worker group (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def inject(faults: tuple[Fault, ...], step: int, rank: int) -> None:
    """Fire every fault due at the start of `step` on `rank`."""
    attempt = restart_attempt()
    for f in faults:
        if f.fires(step, rank, attempt) and f.kind == "crash":
            os._exit(1)
