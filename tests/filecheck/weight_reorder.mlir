// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p weight-reorder --weights-out %t.weights.safetensors | filecheck %s

// A tpu.matmul whose 2-D weight is stored [K, N] (transpose_b false) gets a transposed copy
// [N, K] named "<weight>.t", its recipe part "data.t" (source kept) and transpose_b = true,
// so each output-channel tile is contiguous rows. fc.weight is 32x64 in the store: read
// here as K=32, N=64. Weights already [N, K] (transpose_b), activations as the right-hand
// side, transpose_a and batched weights stay as they are.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x8x32xf32>, %h: tensor<1x8x64xf32>, %a: tensor<16x8xf32>, %e: tensor<1x64x8xf32>) -> (tensor<1x8x64xf32>, tensor<1x8x32xf32>, tensor<1x8x8xf32>, tensor<8x64xf32>) {
    %w = "tpu.weight"() {name = "fc.weight", source = "fc.weight", part = "data"} : () -> tensor<32x64xf32>
    %b = "tpu.weight"() {name = "embed.weight", source = "embed.weight", part = "data"} : () -> tensor<16x64xf32>
    %y = "tpu.matmul"(%x, %w) {compute = f32, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x8x32xf32>, tensor<32x64xf32>) -> tensor<1x8x64xf32>
    %z = "tpu.matmul"(%h, %w) {transpose_b = true, compute = f32, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32>
    %s = "tpu.matmul"(%h, %e) {compute = f32, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x8x64xf32>, tensor<1x64x8xf32>) -> tensor<1x8x8xf32>
    %t = "tpu.matmul"(%a, %b) {transpose_a = true, compute = f32, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<16x8xf32>, tensor<16x64xf32>) -> tensor<8x64xf32>
    func.return %y, %z, %s, %t : tensor<1x8x64xf32>, tensor<1x8x32xf32>, tensor<1x8x8xf32>, tensor<8x64xf32>
  }
}

// CHECK:      func.func @main
// CHECK:        [[W:%.*]] = tpu.weight "fc.weight" {source = "fc.weight", part = "data"} : tensor<32x64xf32>
// CHECK:        [[B:%.*]] = tpu.weight "embed.weight" {source = "embed.weight", part = "data"} : tensor<16x64xf32>
// CHECK:        [[T:%.*]] = tpu.weight "fc.weight.t" {part = "data.t", source = "fc.weight"} : tensor<64x32xf32>
// CHECK-NEXT:   [[Y:%.*]] = tpu.matmul %x, [[T]] {compute = f32, transpose_b = true{{.*}}} : tensor<1x8x32xf32>, tensor<64x32xf32> -> tensor<1x8x64xf32>
// CHECK-NEXT:   tpu.matmul %h, [[W]] {transpose_b = true, compute = f32{{.*}}} : tensor<1x8x64xf32>, tensor<32x64xf32> -> tensor<1x8x32xf32>
// CHECK-NEXT:   tpu.matmul %h, %e {compute = f32{{.*}}} : tensor<1x8x64xf32>, tensor<1x64x8xf32> -> tensor<1x8x8xf32>
// CHECK-NEXT:   tpu.matmul %a, [[B]] {transpose_a = true, compute = f32{{.*}}} : tensor<16x8xf32>, tensor<16x64xf32> -> tensor<8x64xf32>
// CHECK-NOT:    tpu.weight
// CHECK:        func.return [[Y]],
