// RUN: not toptpu-opt %s 2>&1 | filecheck %s

// IR that parses but does not verify is reported with the op and the inferred type.

builtin.module {
  func.func @g(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = "top.permute"(%x) {order = array<i64: 1, 0>} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK: does not verify
// CHECK: top.permute
// CHECK: inferred ['tensor<3x2xf32>']
// CHECK-NOT: Traceback
