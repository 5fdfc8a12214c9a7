"""The kernel sandbox: workspaces, compile, verify, profile and rewards.

Kept import-light: worker processes import `sandbox.worker` and must not pay for pydantic.
"""
