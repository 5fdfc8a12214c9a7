"""How long verify waits for the candidate on an input set: relative to the reference's own time on it.

A kernel that never returns used to cost VerifyConfig.trial_timeout_s (120 s by default) on every task, while the
verify held its device's lock shared, so no profile there could time. On a task whose reference takes milliseconds a
hang is known within seconds: the candidate's waits on an input set (its forward, the first set's second call, the
release of its outputs) are allowed `factor` times the reference's time on the sets so far, never less than
`floor_s` (a first call's start-up: a cold extension, a CUDA context's lazy loading) nor more than `cap_s` (the
configured trial timeout, the MCP server's --trial-timeout). docs/judge-workers.md, "Hangs cost seconds".
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbox.config import VerifyConfig
from sandbox.results import TrialTimeout


def relative_timeout(reference_s: float | None, cap_s: float, floor_s: float, factor: float) -> tuple[float, str]:
    """The candidate's timeout and the rule that set it: "relative" (factor x the reference), "floor" (the
    reference too fast for factor x it to cover a start-up), or "cap" (the trial timeout: the rule off, no
    reference time yet, or factor x it past the cap). Pure: tests state the rule through it."""
    if reference_s is None or factor <= 0:
        return cap_s, "cap"
    seconds, rule = (factor * reference_s, "relative") if factor * reference_s > floor_s else (floor_s, "floor")
    return (cap_s, "cap") if seconds >= cap_s else (seconds, rule)


@dataclass
class TrialClock:
    """The candidate's timeout through one verify: the slowest of the reference's input sets sets it (a signed set
    or another size may be slower than the first), and the last one applied goes into the result."""

    cfg: VerifyConfig
    reference_s: float | None = None
    seconds: float = 0.0
    rule: str = "cap"

    def __post_init__(self) -> None:
        self.seconds = self.cfg.trial_timeout_s

    def reference_took(self, reply: dict) -> float:
        """The reference's reply to an input set (its `elapsed_s`: inputs drawn, forward, synchronized): the
        candidate's timeout on that set, in seconds."""
        took = reply.get("elapsed_s")
        if isinstance(took, (int, float)) and took >= 0:
            self.reference_s = max(self.reference_s or 0.0, float(took))
        self.seconds, self.rule = relative_timeout(self.reference_s, self.cfg.trial_timeout_s,
                                                   self.cfg.trial_timeout_floor_s, self.cfg.trial_timeout_factor)
        return self.seconds

    def record(self) -> TrialTimeout:
        return TrialTimeout(seconds=self.seconds, rule=self.rule, reference_s=self.reference_s,
                            cap_s=self.cfg.trial_timeout_s, floor_s=self.cfg.trial_timeout_floor_s,
                            factor=self.cfg.trial_timeout_factor)

    def explain(self) -> str:
        """What a timeout message adds: which rule set the time the candidate was given."""
        ref = f"the reference's {self.reference_s:.3g} s" if self.reference_s is not None else "no reference time"
        if self.rule == "relative":
            why = f"{self.cfg.trial_timeout_factor:g}x {ref}"
        elif self.rule == "floor":
            why = f"the floor of {self.cfg.trial_timeout_floor_s:g} s ({self.cfg.trial_timeout_factor:g}x {ref} is less)"
        else:
            why = f"the trial timeout of {self.cfg.trial_timeout_s:g} s (the cap; {ref})"
        return f"the candidate's timeout on an input set was {self.seconds:.3g} s: {why}"
