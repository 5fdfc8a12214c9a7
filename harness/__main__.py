"""`python -m harness rollout|eval|export|view ...`, the same commands `cuda-agent` mounts."""

from harness.cli import app
from harness.viewer.cli import app as viewer_app

app.add_typer(viewer_app)  # `view`: mounted beside the others here, as cuda_agent.cli mounts it
app()
