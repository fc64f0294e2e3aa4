"""Deployments of the flows (serve.py, presets.py, prefect.yaml); importing flows turns Prefect server
analytics off (see flows/__init__.py)."""
import flows  # noqa: F401
