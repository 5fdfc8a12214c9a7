"""The agent's instructions (SKILL.md) and CUDA optimization knowledge."""

from pathlib import Path

SKILL_PATH = Path(__file__).parent / "SKILL.md"


def skill_text() -> str:
    return SKILL_PATH.read_text()
