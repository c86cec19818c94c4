"""FreeScale's version (one home; fsdata/__init__.py re-exports it)."""
__version__ = "0.3.0"
