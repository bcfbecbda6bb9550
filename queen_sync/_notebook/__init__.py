"""Notebook helpers: re-run cells and rich display."""
