"""The runtime's errors: a generation that cannot proceed (the generation loop and the
vision encoder both raise it) and a trap of the reference machine; the CLI reports each as
one line."""

from toptpu.errors import ToptpuError


class GenerationError(ToptpuError):
    """Generation cannot proceed as asked; the message says why and what to do."""


class MachineTrap(ToptpuError):
    """The machine stopped: the message names the command and the tensors involved."""
