"""The maxjax version, in a module of its own: modules the package imports read it without
importing the package's lazy LLM (maxjax/__init__.py)."""
__version__ = "0.1.0"
