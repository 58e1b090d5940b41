// RUN: toptpu-opt %S/Inputs/every_top_op.mlir | filecheck %s
// RUN: toptpu-opt %S/Inputs/every_top_op.mlir | toptpu-opt | filecheck %s
// RUN: toptpu-opt %S/Inputs/every_top_op.mlir --print-op-generic | filecheck %s --check-prefix=GENERIC
// RUN: toptpu-opt %S/Inputs/every_top_op.mlir --print-op-generic | toptpu-opt | filecheck %s

// The ops print in their custom forms (what --dump-ir and toptpu-opt write), which parse
// back to the same IR (the second run reads the first's output); --print-op-generic prints
// xDSL's generic form (what real MLIR and the model files read), which reads back to the
// same custom text.

// CHECK:      %w = top.weight "fc.weight" : tensor<6x8xf32>
// CHECK:      %half = "top.constant"() {value = dense<5.000000e-01> : tensor<8xf32>} : () -> tensor<8xf32>
// CHECK:      %a0 = top.add %r0, %r1 : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
// CHECK:      %a2 = top.mul %a1, %c : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
// CHECK:      %rn = top.rms_norm %wh weight %g {eps = 1.000000e-06 : f64} : tensor<2x4x8xf32> weight tensor<8xf32> -> tensor<2x4x8xf32>
// CHECK:      %rc = top.reshape %c {shape = array<i64: 1, 4, 2, 8>} : tensor<2x4x8xf32> -> tensor<1x4x2x8xf32>
// CHECK:      %ro = top.rope %q, %rc, %rs {mode = "half"} : tensor<1x4x2x8xf32>, tensor<1x4x2x8xf32>, tensor<1x4x2x8xf32> -> tensor<1x4x2x8xf32>
// CHECK:      %at = top.attention %ro, %k, %v mask %mask history %hk, %hv {scale = 2.500000e-01 : f64, q_heads = 2 : i64, kv_heads = 1 : i64, head_dim = 8 : i64} : tensor<1x4x2x8xf32>, tensor<1x4x1x8xf32>, tensor<1x4x1x8xf32> mask tensor<1x1x4x6xf32> history tensor<1x2x1x8xf32>, tensor<1x2x1x8xf32> -> tensor<1x4x2x8xf32>
// CHECK:      %mm = top.matmul %ln, %w bias %b {transpose_b = true} : tensor<2x4x8xf32>, tensor<6x8xf32> bias tensor<6xf32> -> tensor<2x4x6xf32>
// CHECK:      %tk, %tk_1 = top.topk %mm {k = 1 : i64, axis = -1 : i64, largest = true} : tensor<2x4x6xf32> -> tensor<2x4x1xf32>, tensor<2x4x1xi32>
// CHECK:      %cc, %cc_1 = top.causal_conv1d %cx, %dw state %cstate valid %valid : tensor<1x4x8xf32>, tensor<8x3xf32> state tensor<1x2x8xf32> valid tensor<1x4xf32> -> tensor<1x4x8xf32>, tensor<1x2x8xf32>
// CHECK:      %d2 = top.concat %d1, %d1 {axis = 2 : i64} : tensor<1x8x4xf32>, tensor<1x8x4xf32> -> tensor<1x8x8xf32>
// CHECK-NOT:  "top.

// GENERIC:    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<6x8xf32>
// GENERIC:    %at = "top.attention"(%ro, %k, %v, %mask, %hk, %hv) {scale = 2.500000e-01 : f64, q_heads = 2 : i64, kv_heads = 1 : i64, head_dim = 8 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>} : (tensor<1x4x2x8xf32>, tensor<1x4x1x8xf32>, tensor<1x4x1x8xf32>, tensor<1x1x4x6xf32>, tensor<1x2x1x8xf32>, tensor<1x2x1x8xf32>) -> tensor<1x4x2x8xf32>
// GENERIC:    %mm = "top.matmul"(%ln, %w, %b) {transpose_b = true} : (tensor<2x4x8xf32>, tensor<6x8xf32>, tensor<6xf32>) -> tensor<2x4x6xf32>
