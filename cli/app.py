"""The typer application: registers one command per module."""

from __future__ import annotations

import typer

from . import calibrate, check, diff, engines, evaluate, export, import_minference, inspect, pareto, probe_layers, spava, sweep_nosa, sweep_spava, tune_kernels, validate

app = typer.Typer(
    name="sparsesearch",
    help="Search, probe and run sparse attention for long-context LLMs and VLMs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command("calibrate")(calibrate.calibrate)
app.command("check")(check.check)
app.command("evaluate")(evaluate.evaluate)
app.command("pareto")(pareto.pareto)
app.command("probe-layers")(probe_layers.probe_layers)
app.command("inspect")(inspect.inspect)
app.command("validate")(validate.validate)
app.command("export")(export.export)
app.command("import-minference")(import_minference.import_minference)
app.command("check-export")(engines.check_export)
app.command("diff")(diff.diff)
app.command("tune-kernels")(tune_kernels.tune_kernels)
# One shape for the methods with subcommands: `nosa sweep`, `spava run`, `spava sweep`. The older top-level
# names stay as aliases (scripts and docs use them), marked as such in --help.
nosa_app = typer.Typer(help="NOSA: decode-time block selection (paper 004): sweep.", no_args_is_help=True)
nosa_app.command("sweep")(sweep_nosa.sweep_nosa)
spava.app.command("sweep")(sweep_spava.sweep_spava)
app.add_typer(nosa_app, name="nosa")
app.add_typer(spava.app, name="spava")


def _alias(name: str, target: str, command) -> None:
    """Register ``command`` under an older name, its help opening with the name to use now."""
    app.command(name, help=f"Alias of `{target}`. {command.__doc__}")(command)


_alias("sweep-nosa", "nosa sweep", sweep_nosa.sweep_nosa)
_alias("sweep-spava", "spava sweep", sweep_spava.sweep_spava)


@app.callback()
def _root() -> None:
    """Search, probe and run sparse attention for long-context LLMs and VLMs."""


def main() -> None:
    app()
