"""The runtime's errors: a generation that cannot proceed (the generation loop and the
vision encoder both raise it) and a trap of the reference machine; the CLI reports each as
one line."""


class GenerationError(Exception):
    """Generation cannot proceed as asked; the message says why and what to do."""


class MachineTrap(Exception):
    """The machine stopped: the message names the command and the tensors involved."""
