"""The runtime's error for a generation that cannot proceed (the generation loop and the
vision encoder both raise it; the CLI reports it as one line)."""


class GenerationError(Exception):
    """Generation cannot proceed as asked; the message says why and what to do."""
