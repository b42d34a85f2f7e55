"""Dashboard panels, one a module."""
