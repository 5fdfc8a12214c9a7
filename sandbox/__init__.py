"""The kernel sandbox: workspaces, compile, verify, profile and rewards.

Kept import-light: worker processes import `sandbox.worker` and must not pay for pydantic.
"""

import os

# the folder that holds this package: worker processes and the toolchain probe put it on PYTHONPATH
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
