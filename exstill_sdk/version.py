"""The SDK's version, importable without loading the client (exstill_sdk/__init__.py)."""

__version__ = "0.1.0"
