"""`python -m harness rollout|eval|export ...`, the same commands `cuda-agent` mounts."""

from harness.cli import main

main()
