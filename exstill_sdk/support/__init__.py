"""Machinery shared by several layers (the host SDK and the card runtime alike)."""
