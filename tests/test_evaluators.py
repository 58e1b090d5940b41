"""The interpreter's evaluator table, keyed by op class: every compute op has one, a Tpu op
shares its Top counterpart's, and an op without one is a clear error."""

from __future__ import annotations

import numpy as np
import pytest
from xdsl.dialects import func
from xdsl.dialects.builtin import f32
from xdsl.ir import Block

from toptpu.backend.reference import interpreter
from toptpu.backend.reference.interpreter import (
    EVALUATORS,
    EvalContext,
    NoEvaluatorError,
    evaluate_op,
    evaluates,
    evaluator_for,
)
from toptpu.dialects import dev, top, tpu
from toptpu.dialects.common import tensor

#: ops the interpreter runs as part of another (the layer group runs its loads, stores and
#: terminator itself)
INSIDE_GROUPS = {tpu.LoadOp, tpu.StoreOp, tpu.YieldOp}


def test_every_op_has_an_evaluator_and_tpu_shares_top_s() -> None:
    ops = (*top.Top.operations, *tpu.Tpu.operations, *dev.Dev.operations)
    missing = [op.name for op in ops if op not in EVALUATORS and op not in INSIDE_GROUPS]
    assert missing == []
    for top_op, tpu_op in tpu.TPU_OF_TOP.items():
        assert EVALUATORS[tpu_op] is EVALUATORS[top_op], tpu_op.name
    assert set(EVALUATORS) <= set(ops)


def test_an_op_without_an_evaluator_is_named() -> None:
    with pytest.raises(NoEvaluatorError, match=r"no evaluator for 'func.return' "
                                               r"\(xdsl.dialects.func.ReturnOp\)"):
        evaluator_for(func.ReturnOp())
    with pytest.raises(NoEvaluatorError, match="'tpu.yield'"):
        evaluate_op(tpu.YieldOp(operands=[[]]), [], EvalContext(None))


def test_a_second_evaluator_for_an_op_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interpreter, "EVALUATORS", dict(EVALUATORS))
    with pytest.raises(ValueError, match="'top.rope' has two evaluators: evaluate_kernel "
                                         "and other"):
        @evaluates(top.RopeOp)
        def other(*_: object) -> list[np.ndarray]:
            return []


#: each unary elementwise op's function in float64, independent of the kernels
UNARY_REFERENCE = {
    "top.rsqrt": lambda x: 1.0 / np.sqrt(x), "top.sqrt": np.sqrt, "top.exp": np.exp,
    "top.cos": np.cos, "top.sin": np.sin, "top.tanh": np.tanh,
    "top.sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "top.silu": lambda x: x / (1.0 + np.exp(-x)), "top.relu": lambda x: np.maximum(x, 0.0),
    "top.softplus": lambda x: np.where(x > 20, x, np.log1p(np.exp(x))),
}


def test_top_and_tpu_unary_ops_compute_their_function() -> None:
    """Each Top unary op and its derived Tpu op compute the op's own function (float64
    numpy, not the kernels) to f32 precision, and the two give the same bytes."""
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    x[x == 0] = 0.5
    pos = np.abs(x)  # rsqrt and sqrt take positive inputs
    (arg,) = Block(arg_types=[tensor(x.shape, f32)]).args
    assert {op.name for op in tpu.UNARY_ELEMENTWISE} == set(UNARY_REFERENCE)
    for top_op, tpu_op in tpu.UNARY_ELEMENTWISE.items():
        xin = pos if top_op.name in ("top.rsqrt", "top.sqrt") else x
        ra = evaluate_op(top_op.build([arg]), [xin], EvalContext(None))[0]
        rb = evaluate_op(tpu_op.build([arg]), [xin], EvalContext(None))[0]
        want = UNARY_REFERENCE[top_op.name](xin.astype(np.float64))
        np.testing.assert_allclose(ra, want, rtol=2e-6, atol=1e-7, err_msg=top_op.name)
        assert ra.dtype == np.float32 and ra.tobytes() == rb.tobytes(), top_op.name
