// RUN: not toptpu-opt %s -p top-pipeline 2>&1 | filecheck %s

// A verifier error points at the op in the file, not only at its kind.
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = "top.silu"(%x) : (tensor<2x3xf32>) -> tensor<2x3xf32>
    %1 = "top.softmax"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %1 : tensor<2x3xf32>
  }
}
// CHECK: does not verify
// CHECK: missing_attribute.mlir:7:5
// CHECK: attribute 'axis' expected in operation 'top.softmax'
// CHECK-NOT: Traceback
