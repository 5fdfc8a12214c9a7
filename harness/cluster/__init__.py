"""Judging and rollouts across a Ray cluster: a thin placement and retry layer over the harness.

Each actor (`actor.ToolServerActor`) holds one `cuda-agent serve` over stdio on its own node, one per GPU
(`num_gpus=1`), or a set number per node on a CPU-only cluster; Ray restarts an actor that dies. The driver
sees each actor as an ordinary `harness.mcp_tools.ToolServer` (`servers.RayToolServer`), so episodes, the
final judgment and the rollout's lost-server retry are the single-host code, unchanged: every reward still
comes from the same judge. `connect` joins or starts the cluster and plans the placement; `cli` is
`cuda-agent cluster up|status|down` for a pool that outlives one command (verl's reward and tools reach it
by address). Ray is an optional extra: `pip install 'cuda-agent[ray]'`.
"""
