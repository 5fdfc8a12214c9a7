"""A static HTML viewer for rollout and eval runs: overview, episode table, episodes, training charts."""

from harness.viewer.data import ViewerError, build_view
from harness.viewer.html import render, script_json, write_html

__all__ = ["ViewerError", "build_view", "render", "script_json", "write_html"]
