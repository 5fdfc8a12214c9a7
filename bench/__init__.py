"""Benchmarks of the judge, the MCP server, synthesis and training: one module each, run from the repository's
root as `python -m bench.NAME --help`. bench.proofs holds the proofs that training works (learns, speed,
repair, the paper's stages) and the task families they share. docs/benchmarks.md lists each benchmark with
what it measures, its command and its latest figure; bench/device.sh runs them on a GPU by named parts."""
