// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | not toptpu-opt -p shape-infer --split-input-file 2>&1 | filecheck %s
// RUN: not toptpu-opt %s -p shape-infer --split-input-file 2>&1 | filecheck %s --check-prefix=EXIT

// shape-infer refuses what it cannot type: an op whose result types cannot be derived from
// its operands (named by its kind and location; shape_infer_unnamed.mlir: without one), a
// weight the store does not hold, a weight whose shape in the IR is not the store's, a
// store file that does not exist. The second run line: the first chunk alone stops
// toptpu-opt with exit status 1.

// an unranked result verifies (shape-infer has not run); deriving it fails at the op
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<*xf32> {
    %0 = "top.reshape"(%x) {shape = array<i64: 7>} : (tensor<2x3xf32>) -> tensor<*xf32> loc("flat")
    func.return %0 : tensor<*xf32>
  }
}
// CHECK:      pass 'shape-infer': shape inference failed at 'top.reshape' (flat): cannot reshape [2, 3] to [7]

// EXIT:       toptpu-opt: {{.*}}shape_infer_errors.mlir: pass 'shape-infer': shape inference failed at 'top.reshape' (flat): cannot reshape [2, 3] to [7]
// EXIT-NOT:   Traceback

// -----

// a weight the store does not hold
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @f() -> tensor<8xf32> {
    %w = "top.weight"() {name = "lm_head.weight"} : () -> tensor<8xf32>
    func.return %w : tensor<8xf32>
  }
}
// CHECK:      pass 'shape-infer': weight 'lm_head.weight' is not in the weight store {{.*}}Inputs/weights.safetensors

// -----

// fc.weight is [32, 64] in the store
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @f() -> tensor<64x32xf32> {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<64x32xf32>
    func.return %w : tensor<64x32xf32>
  }
}
// CHECK:      pass 'shape-infer': weight 'fc.weight' has shape [32, 64] in the store but [64, 32] in the IR

// -----

builtin.module attributes {top.weight_store = "no/such/weights.safetensors"} {
  func.func @f() -> tensor<8xf32> {
    %w = "top.weight"() {name = "fc.bias"} : () -> tensor<8xf32>
    func.return %w : tensor<8xf32>
  }
}
// CHECK:      pass 'shape-infer': weight store '{{.*}}no/such/weights.safetensors' does not exist
