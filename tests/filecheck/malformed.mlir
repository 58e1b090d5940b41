// RUN: not toptpu-opt %s 2>&1 | filecheck %s

// Malformed input gives a diagnostic that points at the line, not a Python traceback.
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<3x2xf32> {
    %0 = "top.permute"(%x) {order = array<i64: 1, 0>} : (tensor<2x3xf32>) -> tensor<3x2xf32>
    func.return %0 tensor<3x2xf32>
  }
}
// CHECK: parse error
// CHECK: malformed.mlir:7:20
// CHECK: Expected ':'
// CHECK-NOT: Traceback

