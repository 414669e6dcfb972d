"""Ahead-of-time artifacts: export (warm-cache), verify and load (serve --precompiled-artifacts)."""
