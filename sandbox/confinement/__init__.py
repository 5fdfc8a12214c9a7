"""Where candidate code is confined: worker processes spawned fresh and killed with their whole tree
(`processes`), the filesystem they may see (`filesystem`: Landlock; `mountns` where it is missing), their
resource limits and system-call filter (`limits`), and process-tree bookkeeping (`proctree`).

Standard library only: a worker imports this package before torch, while it still has one thread.
"""
