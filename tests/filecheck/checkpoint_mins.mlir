// RUN: sed 's|@WEIGHTS@|%S/Inputs/checkpoint_mins.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=w4f16}' --weights-out %t.weights.safetensors | filecheck %s
// RUN: sed 's|@WEIGHTS@|%S/Inputs/checkpoint_mins.safetensors|' %s | toptpu-opt -p 'tpu-pipeline{mode=w4f16 chip=bm1684x}' --weights-out %t.weights.safetensors -t commands | filecheck %s --check-prefix=CMD

// A scale-and-min checkpoint layer (a GGUF Q4_1 / Q4_K linear: w = q * scale + min, the min
// a float, not an integer zero point) lowers to a16_matmul over exactly its integers, f16
// scales and f16 mins, with no zero points; the machine loads the mins like the scales.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x4x64xf32>) -> tensor<1x4x32xf32> {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %y = "top.matmul"(%x, %w) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x4x64xf32>, tensor<32x64xf32>) -> tensor<1x4x32xf32>
    func.return %y : tensor<1x4x32xf32>
  }
}

// CHECK-DAG: [[Q:%.*]] = tpu.weight "fc.weight:ckpt.qweight" {source = "fc.weight", part = "checkpoint.qweight"} : tensor<32x32xui8>
// CHECK-DAG: [[S:%.*]] = tpu.weight "fc.weight:ckpt.scales" {source = "fc.weight", part = "checkpoint.scales"} : tensor<32x2xf16>
// CHECK-DAG: [[M:%.*]] = tpu.weight "fc.weight:ckpt.mins" {source = "fc.weight", part = "checkpoint.mins"} : tensor<32x2xf16>
// CHECK:     tpu.a16_matmul %x, [[Q]], [[S]] mins [[M]] {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32} : tensor<1x4x64xf16>, tensor<32x32xui8>, tensor<32x2xf16> mins tensor<32x2xf16> -> tensor<1x4x32xf16>
// CHECK-NOT: zeros

// CMD:      dma load     w:fc.weight:ckpt.mins 32x2xfloat16 [all] -> L[[MA:[0-9]+]]#[[MB:[0-9]+]]
// CMD:      cmp a16_matmul {{.*}} (L{{[0-9]+}}#{{[0-9]+}}, L{{[0-9]+}}#{{[0-9]+}}, L{{[0-9]+}}#{{[0-9]+}}, -, L[[MA]]#[[MB]], -)
