// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'tpu-pipeline{mode=f32}' --weights-out %t.weights.safetensors | filecheck %s

// Regression test of a fixed bug:
// weight-reorder replaces the [K, N] weight of a matmul by its [N, K] copy "fc.weight.t"
// but leaves the old tpu.weight in the function, unused, and tpu-pipeline runs nothing
// after weight-reorder that erases it (its canonicalize runs before). address-assign then
// counts it: weights = 16384 B for the one 32x64 f32 weight (8192 B) the net reads, and
// codegen lists it among the net's weights.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x8x32xf32>) -> tensor<1x8x64xf32> {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %y = "top.matmul"(%x, %w) : (tensor<1x8x32xf32>, tensor<32x64xf32>) -> tensor<1x8x64xf32>
    func.return %y : tensor<1x8x64xf32>
  }
}

// CHECK:     tpu.regions = #tpu.regions<0 : i64, 0 : i64, 8192 : i64, 3072 : i64>
// CHECK:     tpu.weight "fc.weight.t" {part = "data.t", source = "fc.weight"} : tensor<64x32xf32>
// CHECK-NOT: name = "fc.weight", source = "fc.weight", part = "data"
