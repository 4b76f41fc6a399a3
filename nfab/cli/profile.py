"""`nfab profile schema|check`: the profile file's JSON schema, and validating a profile without training."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from nfab.cli.output import console


def schema_text() -> str:
    """The JSON schema as written to `schemas/profile.schema.json` (stable key order, trailing newline)."""
    from nfab.profile.schema import json_schema

    return json.dumps(json_schema(), indent=2) + "\n"


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Operating profiles: JSON schema, validation.", no_args_is_help=True)

    @group.command("schema")
    def schema(
        out: Annotated[Path | None, typer.Option("--out", "-o", help="Write the schema here (default: stdout).",
                                                 show_default=False)] = None,
    ) -> None:
        """Print (or write) the profile file's JSON schema, for editors and other tools."""
        from nfab.fsutil import atomic_write_text

        text = schema_text()
        if out is None:
            typer.echo(text, nl=False)
        else:
            atomic_write_text(out, text)
            console.print(f"wrote {out}", highlight=False)

    @group.command("check")
    def check(
        profile: Annotated[str, typer.Argument(metavar="PROFILE", help="profile.json or a shipped name.")],
    ) -> None:
        """Validate a profile (strict types, unknown keys refused) and print what it routes.

        Exit 3 (as `nfab calibrate`'s) for a valid file whose profile failed its validation."""
        from nfab.cli.calibrate import VALIDATION_FAILED, profile_table
        from nfab.config.calibrated import calibrated_setting
        from nfab.config.shipped import resolve_profile
        from nfab.profile.evidence import failed_validation
        from nfab.profile.schema import Profile

        path = resolve_profile(profile)
        prof = Profile.load(path)
        setting = calibrated_setting(prof, f"profile {path}")
        validation = prof.evidence.get("validation")
        failed = failed_validation(validation)
        if failed is not None:  # first, and alone on its line: a `check && train` must not miss it
            console.print(f"[red]{escape(str(path))}: {failed}[/]; recalibrate it (nfab calibrate) before training "
                          f"with it (exit {VALIDATION_FAILED})", highlight=False, soft_wrap=True)
        console.print(profile_table(prof))
        if setting is not None:
            console.print(f"calibrated on {setting.model or prof.model.name} / {setting.dataset}, "
                          f"W={setting.world_size}, {setting.optimizer.name} lr {setting.optimizer.lr:g}, "
                          f"batch {setting.batch_size}, {setting.steps} steps", highlight=False)
        if isinstance(validation, dict):  # the file is valid; whether the profile held its tolerance is this
            from nfab.profile.evidence import describe_validation

            console.print(describe_validation(validation), highlight=False)
        if failed is not None:
            console.print(f"{path}: a valid file, but its profile failed its validation", highlight=False,
                          soft_wrap=True)
            raise typer.Exit(VALIDATION_FAILED)
        console.print(f"{path}: valid", highlight=False)

    app.add_typer(group, name="profile")
