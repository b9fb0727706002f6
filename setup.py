"""Package discovery (the metadata is in pyproject.toml). Every package under sparsesearch/ is found, so a
new subpackage needs no edit here; cli/ and search_spaces/ sit at the top level of the repository (the
product's layout) and install as ``sparsesearch_cli`` (never shadowing another ``cli``) and
``sparsesearch.search_spaces``."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["sparsesearch", "sparsesearch.*"]), "sparsesearch_cli", "sparsesearch.search_spaces"],
    package_dir={"sparsesearch_cli": "cli", "sparsesearch.search_spaces": "search_spaces"},
)
