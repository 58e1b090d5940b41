// RUN: toptpu-opt %s -p shape-infer | filecheck %s
// RUN: toptpu-opt %s -p shape-infer --print-op-generic | filecheck %s --check-prefix=GENERIC

// Result types left unranked (as an importer or a hand-edited file may leave them) are
// derived from the arguments; the function signature follows the returned values.
builtin.module {
  func.func @main(%x: tensor<1x16x64xf32>, %w: tensor<64xf32>) -> tensor<*xf32> {
    %0 = "top.rms_norm"(%x, %w) {eps = 1.0e-06 : f64} : (tensor<1x16x64xf32>, tensor<64xf32>) -> tensor<*xf32>
    %1 = "top.reshape"(%0) {shape = array<i64: 1, 16, 4, 16>} : (tensor<*xf32>) -> tensor<*xf32>
    %2 = "top.reduce"(%1) {mode = "sum", axes = array<i64: 3>, keepdims = false} : (tensor<*xf32>) -> tensor<*xf32>
    func.return %2 : tensor<*xf32>
  }
}

// CHECK:      func.func @main(%x: tensor<1x16x64xf32>, %w: tensor<64xf32>) -> tensor<1x16x4xf32>
// CHECK-NEXT:   %0 = top.rms_norm %x weight %w {eps = 1.000000e-06 : f64} : tensor<1x16x64xf32> weight tensor<64xf32> -> tensor<1x16x64xf32>
// CHECK-NEXT:   %1 = top.reshape %0 {shape = array<i64: 1, 16, 4, 16>} : tensor<1x16x64xf32> -> tensor<1x16x4x16xf32>
// CHECK-NEXT:   %2 = top.reduce %1 {{.*}} : tensor<1x16x4x16xf32> -> tensor<1x16x4xf32>
// CHECK-NEXT:   func.return %2 : tensor<1x16x4xf32>

// GENERIC: "top.rms_norm"(%{{.*}}, %{{.*}}) {eps = 1.000000e-06 : f64}
