// RUN: sed 's|@WEIGHTS@|%S/Inputs/checkpoint.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=w4bf16}' --weights-out %t.weights.safetensors | filecheck %s
// RUN: sed 's|@WEIGHTS@|%S/Inputs/checkpoint.safetensors|' %s | not toptpu-opt -p 'convert-top-to-tpu{mode=bf16}' 2>&1 | filecheck %s --check-prefix=FLOAT

// A pre-quantized checkpoint layer lowers to a16_matmul over exactly its integers, f16
// scales (kept f16 under bf16 activations) and zeros; act-order (g_idx) becomes a gather
// of the input channels; a weight the quantizer left in float stays float.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x4x64xf32>) -> tensor<1x4x32xf32> {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %p = "top.weight"() {name = "proj.weight"} : () -> tensor<32x32xf32>
    %y = "top.matmul"(%x, %w) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x4x64xf32>, tensor<32x64xf32>) -> tensor<1x4x32xf32>
    %z = "top.matmul"(%y, %p) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x4x32xf32>, tensor<32x32xf32>) -> tensor<1x4x32xf32>
    func.return %z : tensor<1x4x32xf32>
  }
}

// CHECK-DAG: [[Q:%.*]] = tpu.weight "fc.weight:ckpt.qweight" {source = "fc.weight", part = "checkpoint.qweight"} : tensor<32x32xui8>
// CHECK-DAG: [[S:%.*]] = tpu.weight "fc.weight:ckpt.scales" {source = "fc.weight", part = "checkpoint.scales"} : tensor<32x2xf16>
// CHECK-DAG: [[Z:%.*]] = tpu.weight "fc.weight:ckpt.zeros" {source = "fc.weight", part = "checkpoint.zeros"} : tensor<32x2xui8>
// CHECK-DAG: [[P:%.*]] = tpu.weight "fc.weight:ckpt.perm" {source = "fc.weight", part = "checkpoint.perm"} : tensor<64xi32>
// CHECK-DAG: tpu.weight "proj.weight:bf16" {source = "proj.weight", part = "data"} : tensor<32x32xbf16>
// CHECK:     [[G:%.*]] = tpu.gather %x, [[P]] {axis = 2 : i64, compute = bf16}
// CHECK:     tpu.a16_matmul [[G]], [[Q]], [[S]] zeros [[Z]] {weight_bits = 4 : i64, group_size = 32 : i64
// CHECK:     tpu.matmul
// CHECK-NOT: q4g

// FLOAT: 'fc.weight' comes pre-quantized from the checkpoint: use a weight-only mode
