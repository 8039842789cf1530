"""Bundled hook maps (TOML data), installed as ``blockdiff.hooks``; see docs/hook-maps.md."""
