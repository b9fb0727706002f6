"""The `sparsesearch` command line: one thin typer module per command over library calls."""
