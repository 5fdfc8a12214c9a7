"""Is it right: `verify` runs the reference and the candidate on fresh inputs in separate workers and
compares; `selfcheck` verifies a task's reference against itself; `taskcheck` validates a task file
on the meta device before it is used."""
