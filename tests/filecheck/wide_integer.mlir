// RUN: not toptpu-opt %s -p top-pipeline 2>&1 | filecheck %s

// An integer type wider than MLIR allows (a digit typed into i64 a few times): refused at the
// token, before xDSL computes its 2^width value range (seconds and gigabytes).
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<3x2xf32> {
    %0 = "top.permute"(%x) {order = array<i6464646464: 1, 0>} : (tensor<2x3xf32>) -> tensor<3x2xf32>
    func.return %0 : tensor<3x2xf32>
  }
}
// CHECK: parse error
// CHECK: wide_integer.mlir:7:43
// CHECK: integer type i6464646464 is wider than MLIR's limit of 16777215 bits
// CHECK-NOT: Traceback
