// RUN: toptpu-opt %s -p top-pipeline --mlir-print-ir-before=fuse --mlir-print-ir-after=top-pipeline,shape-infer 2>&1 >/dev/null | filecheck %s --check-prefix=NAMED
// RUN: toptpu-opt %s -p top-pipeline --mlir-print-ir-before-all --mlir-print-ir-after-all 2>&1 >/dev/null | filecheck %s --check-prefix=ALL
// RUN: toptpu-opt %s -p top-pipeline --print-between-passes 2>&1 >/dev/null | filecheck %s --check-prefix=BETWEEN
// RUN: not toptpu-opt %s -p top-pipeline --mlir-print-ir-after=shapeinfer 2>&1 | filecheck %s --check-prefix=UNKNOWN
// RUN: toptpu-opt %s -p canonicalize --mlir-print-ir-after=fuse 2>&1 >/dev/null | filecheck %s --check-prefix=ABSENT

// mlir-opt's IR printing: --mlir-print-ir-before=PASS / --mlir-print-ir-after=PASS (a pass,
// or a named pipeline: before its first pass, after its last; comma-separated or repeated),
// -before-all / -after-all, each dump on stderr under mlir-opt's header. top-pipeline runs
// shape-infer, canonicalize, fold-constants, cse, fuse, canonicalize, fold-constants, cse:
// shape-infer ranks %0, canonicalize drops the dead exp. --print-between-passes prints after every pass, the last one included.
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<*xf32> {
    %0 = "top.silu"(%x) : (tensor<1x8x64xf32>) -> tensor<*xf32>
    %dead = "top.exp"(%0) : (tensor<*xf32>) -> tensor<*xf32>
    func.return %0 : tensor<*xf32>
  }
}

// NAMED:      // -----// IR Dump After shape-infer //----- //
// NAMED:      top.silu %x : tensor<1x8x64xf32> -> tensor<1x8x64xf32>
// NAMED:      top.exp
// NAMED:      // -----// IR Dump Before fuse //----- //
// NAMED-NOT:  top.exp
// NAMED:      // -----// IR Dump After top-pipeline //----- //
// NAMED:      func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
// NAMED-NOT:  IR Dump

// ALL:      // -----// IR Dump Before shape-infer //----- //
// ALL:      -> tensor<*xf32>
// ALL:      // -----// IR Dump After shape-infer //----- //
// ALL-NEXT: builtin.module {
// ALL:      // -----// IR Dump Before canonicalize //----- //
// ALL:      // -----// IR Dump After canonicalize //----- //
// ALL:      // -----// IR Dump Before fold-constants //----- //
// ALL:      // -----// IR Dump After fold-constants //----- //
// ALL:      // -----// IR Dump Before cse //----- //
// ALL:      // -----// IR Dump After cse //----- //
// ALL:      // -----// IR Dump Before fuse //----- //
// ALL:      // -----// IR Dump After fuse //----- //
// ALL:      // -----// IR Dump Before canonicalize //----- //
// ALL:      // -----// IR Dump After canonicalize //----- //
// ALL:      // -----// IR Dump Before fold-constants //----- //
// ALL:      // -----// IR Dump After fold-constants //----- //
// ALL:      // -----// IR Dump Before cse //----- //
// ALL:      // -----// IR Dump After cse //----- //
// ALL-NEXT: builtin.module {
// ALL-NOT:  IR Dump

// BETWEEN:      // -----// IR after shape-infer //----- //
// BETWEEN:      // -----// IR after canonicalize //----- //
// BETWEEN:      // -----// IR after fold-constants //----- //
// BETWEEN:      // -----// IR after cse //----- //
// BETWEEN:      // -----// IR after fuse //----- //
// BETWEEN:      // -----// IR after canonicalize //----- //
// BETWEEN:      // -----// IR after fold-constants //----- //
// BETWEEN:      // -----// IR after cse //----- //
// BETWEEN-NEXT: builtin.module {

// UNKNOWN: toptpu-opt: error: --mlir-print-ir-after=shapeinfer: no pass or pipeline of that name (did you mean 'shape-infer'?)

// ABSENT: toptpu-opt: note: --mlir-print-ir-after=fuse: the pipeline does not run 'fuse', nothing is printed for it
// ABSENT-NOT: IR Dump
