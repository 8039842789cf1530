"""The package version, in a module of its own so nothing imports the package root from below."""

__version__ = "0.6.0"
