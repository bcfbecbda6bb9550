"""The version of queen_sync, in one place (the package face and the HTTP User-Agent read it)."""

__version__ = "0.1.0"
