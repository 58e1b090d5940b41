"""Every pass toptpu registers, by name, as a function that imports the pass's module and
returns its class: xDSL's registry (`xdsl.transforms.get_all_passes`), so that a tool pays
only for the passes it runs (`toptpu-opt -p top-pipeline` loads no Tpu-level pass, no
linalg lowering: its start-up, issue 43). `all_passes()` imports them all (`--help`).
"""

from __future__ import annotations

from collections.abc import Callable

from xdsl.passes import ModulePass
from xdsl.transforms.canonicalize import CanonicalizePass


def _shape_infer() -> type[ModulePass]:
    from toptpu.passes.shape_infer import ShapeInferPass

    return ShapeInferPass


def _canonicalize() -> type[ModulePass]:
    """xDSL's own: it runs each op's canonicalization patterns."""
    return CanonicalizePass


def _fold_constants() -> type[ModulePass]:
    from toptpu.passes.fold_constants import FoldConstantsPass

    return FoldConstantsPass


def _fuse() -> type[ModulePass]:
    from toptpu.passes.fuse import FusePass

    return FusePass


def _top_pipeline() -> type[ModulePass]:
    from toptpu.passes.top_pipeline import TopPipeline

    return TopPipeline


def _convert_top_to_tpu() -> type[ModulePass]:
    from toptpu.passes.convert_top_to_tpu import ConvertTopToTpuPass

    return ConvertTopToTpuPass


def _weight_reorder() -> type[ModulePass]:
    from toptpu.passes.weight_reorder import WeightReorderPass

    return WeightReorderPass


def _layer_group() -> type[ModulePass]:
    from toptpu.passes.layer_group import LayerGroupPass

    return LayerGroupPass


def _lmem_verify() -> type[ModulePass]:
    from toptpu.passes.layer_group import LmemVerifyPass

    return LmemVerifyPass


def _address_assign() -> type[ModulePass]:
    from toptpu.passes.address_assign import AddressAssignPass

    return AddressAssignPass


def _machine_pipeline() -> type[ModulePass]:
    from toptpu.passes.pipelines import MachinePipeline

    return MachinePipeline


def _tpu_pipeline() -> type[ModulePass]:
    from toptpu.passes.pipelines import TpuPipeline

    return TpuPipeline


def _convert_top_to_linalg() -> type[ModulePass]:
    from toptpu.passes.convert_top_to_linalg import ConvertTopToLinalgPass

    return ConvertTopToLinalgPass


def _mlir_pipeline() -> type[ModulePass]:
    from toptpu.passes.mlir_pipeline import MLIRPipelinePass

    return MLIRPipelinePass


def _expert_parallel() -> type[ModulePass]:
    from toptpu.passes.tensor_parallel import ExpertParallelPass

    return ExpertParallelPass


def _tensor_parallel() -> type[ModulePass]:
    from toptpu.passes.tensor_parallel import TensorParallelPass

    return TensorParallelPass


#: pass name -> its class, imported when called (each name is its class's `name`)
PASSES: dict[str, Callable[[], type[ModulePass]]] = {
    "shape-infer": _shape_infer,
    "canonicalize": _canonicalize,
    "fold-constants": _fold_constants,
    "fuse": _fuse,
    "top-pipeline": _top_pipeline,
    "convert-top-to-tpu": _convert_top_to_tpu,
    "weight-reorder": _weight_reorder,
    "layer-group": _layer_group,
    "lmem-verify": _lmem_verify,
    "address-assign": _address_assign,
    "machine-pipeline": _machine_pipeline,
    "tpu-pipeline": _tpu_pipeline,
    "convert-top-to-linalg": _convert_top_to_linalg,
    "mlir": _mlir_pipeline,
    "tensor-parallel": _tensor_parallel,
    "expert-parallel": _expert_parallel,
}

#: the named pipelines (each runs a sequence of the passes above)
PIPELINE_NAMES: tuple[str, ...] = ("top-pipeline", "tpu-pipeline", "machine-pipeline")


def all_passes() -> dict[str, type[ModulePass]]:
    """Every pass toptpu registers, by name, imported."""
    return {name: get() for name, get in PASSES.items()}
