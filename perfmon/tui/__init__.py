"""Textual dashboard (the only package that imports textual)."""
