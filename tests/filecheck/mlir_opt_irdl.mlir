// RUN: python -m toptpu.dialects.irdl_export > %t.irdl.mlir
// RUN: toptpu-opt %s -t mlir-generic | %mlir_opt --irdl-file=%t.irdl.mlir | filecheck %s
// RUN: toptpu-opt %s --print-op-generic | not %mlir_opt --irdl-file=%t.irdl.mlir 2>&1 | filecheck %s --check-prefix=PLAIN
// RUN: sed 's/axis = 1 : i64} : (tensor<1x2/axis = "one"} : (tensor<1x2/' %s | toptpu-opt --disable-verify -t mlir-generic | not %mlir_opt --irdl-file=%t.irdl.mlir 2>&1 | filecheck %s --check-prefix=BAD

// The real mlir-opt (MLIR 22, `python -m toptpu.dialects.mlir_check --which mlir-opt`)
// verifies toptpu's IR with the IRDL of top and tpu. It reads `-t mlir-generic`: the generic
// form with one operand segment per value of a variadic group (operandSegmentSizes), since
// MLIR 22's IRDL gives a variadic group one type and this concat joins tensors of two
// shapes; the plain generic form, without the segment sizes, is refused (PLAIN). MLIR checks
// on its own: an attribute of the wrong kind, let through by toptpu-opt --disable-verify, is
// refused by mlir-opt (BAD).
builtin.module {
  func.func @main(%a: tensor<1x2xf32>, %b: tensor<1x3xf32>) -> tensor<1x5xf32> {
    %0 = "top.concat"(%a, %b) {axis = 1 : i64} : (tensor<1x2xf32>, tensor<1x3xf32>) -> tensor<1x5xf32>
    %1 = "top.silu"(%0) : (tensor<1x5xf32>) -> tensor<1x5xf32>
    func.return %1 : tensor<1x5xf32>
  }
}

// CHECK:      "top.concat"(%{{.*}}, %{{.*}}) {axis = 1 : i64, operandSegmentSizes = array<i32: 1, 1, 0,
// CHECK:      "top.silu"

// PLAIN: error: 'operandSegmentSizes' attribute is expected but not provided

// BAD:      error: expected base attribute 'builtin.integer' but got 'builtin.string'
// BAD-NEXT: note: see current operation: %0 = "top.concat"(%arg0, %arg1) {axis = "one"
