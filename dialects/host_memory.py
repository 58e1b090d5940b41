"""The host's memory as the kernel reports it: what the loaders check declared sizes against
before they allocate, and what the executors' weight cache sizes itself by (here because
both the frontends and the runtime may import this package)."""

from __future__ import annotations


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's available memory in bytes (MemAvailable), None where unknown."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
