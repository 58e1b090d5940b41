"""One error base: every exception class toptpu raises for bad input derives from
`toptpu.errors.ToptpuError`, so the command lines report all of them as one line by one
`except` (no tuple to keep in step with the modules), and what is not one is a bug."""

from __future__ import annotations

import importlib
import inspect

from test_imports import MODULES

from toptpu.errors import CompileError, ToptpuError

#: exception classes of ours that are not user errors, and why
NOT_USER_ERRORS = {
    "toptpu.opt.InternalError": "toptpu-opt's report of a crashed pass: a bug (exit 70)",
    "toptpu.backend.reference.interpreter.NoEvaluatorError":
        "an op without a kernel reached the interpreter: a gap in toptpu",
    "toptpu.passes.top_pipeline.InvalidPassOutput":
        "a pass turned valid IR into invalid IR: a bug in the pass",
    "toptpu.backend.reference.interpreter.KernelBindingError":
        "an op class whose kernel binding names no function of kernels.py: a bug in the op "
        "class (ours or a plugin's)",
    "toptpu.weight_calibration.layers._InputsSeen":
        "control flow inside the calibration: stops a forward once a module's inputs are "
        "seen, caught where it is raised",
    "toptpu.command_io.LineTooLong":
        "a chat line longer than the reader takes: caught by the chat loop, which says so "
        "and reads the next line",
    "toptpu.backend.target.link.LinkError":
        "a collective the link model cannot time (unknown algorithm, no devices): a bug of "
        "the caller",
}


def _exception_classes() -> dict[str, type[BaseException]]:
    found = {}
    for name in sorted(MODULES):
        if name.endswith("__main__"):
            continue
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == name:
                found[f"{name}.{cls.__qualname__}"] = cls
    return found


def test_every_error_of_ours_is_a_toptpu_error_or_listed() -> None:
    classes = _exception_classes()
    assert len(classes) > 30  # the walk sees the project's errors
    strays = sorted(n for n, c in classes.items()
                    if not issubclass(c, ToptpuError) and n not in NOT_USER_ERRORS
                    and issubclass(c, Exception))
    assert not strays, f"not derived from ToptpuError (nor listed as a bug): {strays}"
    for name in NOT_USER_ERRORS:  # the list stays true
        assert name in classes and not issubclass(classes[name], ToptpuError), name


def test_the_base_keeps_each_errors_builtin_kind() -> None:
    """Deriving from the base keeps what callers already catch (ValueError, KeyError...)."""
    from toptpu.dialects.weight_store import MissingWeightError
    from toptpu.passes.convert_top_to_tpu import ConversionError

    assert issubclass(ConversionError, ValueError) and issubclass(ConversionError, ToptpuError)
    assert issubclass(MissingWeightError, KeyError)
    assert issubclass(CompileError, ToptpuError)
