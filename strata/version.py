"""The package version (pyproject.toml keeps the same number)."""

__version__ = "0.1.0"
