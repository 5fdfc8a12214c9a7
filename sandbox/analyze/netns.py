"""`python -P -m sandbox.analyze.netns NCU ARGS...`: ncu and the process it analyses in a network namespace of their
own, with only a loopback, then ncu exec'd. Standard library only (it runs with a worker's environment).

Why not the target's own namespace, as every worker has: ncu's injected library in the target talks to the ncu
process that started it, and a target that left for a namespace of its own hung there (on an H200 with ncu 2025.3.1
the analysis ran into its time limit; the same analysis in ncu's namespace took 9 s). Here both leave together: the
target reaches ncu and nothing else. Where the namespace cannot be made (not root), the target is told so and its
result says the network was not isolated.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import sys

NETNS_ENV = "CUDA_AGENT_ANALYZE_NETNS"
JOINED, NOT_JOINED = "launcher", "launcher-failed"  # what the target is told
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH22x", b"lo", 0)))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def leave_network() -> bool:
    try:
        if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
            return False
    except (OSError, AttributeError):
        return False
    try:
        loopback_up()
    except OSError:
        pass  # ncu may still reach its target without it (a unix socket); if not, the analysis times out and says so
    return True


def main(argv: list[str]) -> None:
    os.environ[NETNS_ENV] = JOINED if leave_network() else NOT_JOINED
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
