"""The runtime's errors: a generation that cannot proceed (the generation loop and the
vision encoder both raise it) and a trap of the reference machine; the CLI reports each as
one line."""

from toptpu.errors import GenerationError, ToptpuError

__all__ = ["GenerationError", "MachineTrap"]


class MachineTrap(ToptpuError):
    """The machine stopped: the message names the command and the tensors involved."""
