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
app.command("sweep-nosa")(sweep_nosa.sweep_nosa)
app.add_typer(spava.app, name="spava")
app.command("sweep-spava")(sweep_spava.sweep_spava)
app.command("tune-kernels")(tune_kernels.tune_kernels)


@app.callback()
def _root() -> None:
    """Search, probe and run sparse attention for long-context LLMs and VLMs."""


def main() -> None:
    app()
