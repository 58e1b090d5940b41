// RUN: toptpu-opt %s -p canonicalize | filecheck %s --check-prefix=CANON
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=bf16},canonicalize' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=TPU
// RUN: toptpu-opt %s -p convert-top-to-linalg | filecheck %s --check-prefix=LINALG

// top.clamp (ARCHITECTURE.md, "How to add an op") through the passes that ask the op class:
// its canonicalization (a clamp of a clamp is one clamp: the outer clamp of the inner's
// bounds), convert-top-to-tpu's generic lowering to its Tpu twin (whose patterns are its
// base class's), and its linalg lowering (max, then min; an integer clamp in its own type).

builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<2x8xf32>, %ids: tensor<2x8xi32>) -> (tensor<2x8xf32>, tensor<2x8xi32>) {
    %a = top.clamp %x {min = -1.0 : f64, max = 1.0 : f64} : tensor<2x8xf32> -> tensor<2x8xf32>
    %b = top.clamp %a {min = 0.5 : f64, max = 3.0 : f64} : tensor<2x8xf32> -> tensor<2x8xf32>
    %i = top.clamp %ids {max = 4.0 : f64} : tensor<2x8xi32> -> tensor<2x8xi32>
    func.return %b, %i : tensor<2x8xf32>, tensor<2x8xi32>
  }
}

// CANON:      func.func @main
// CANON-NEXT:   %b = top.clamp %x {min = 5.000000e-01 : f64, max = 1.000000e+00 : f64} : tensor<2x8xf32> -> tensor<2x8xf32>
// CANON-NEXT:   %i = top.clamp %ids {max = 4.000000e+00 : f64} : tensor<2x8xi32> -> tensor<2x8xi32>
// CANON-NEXT:   func.return %b, %i

// TPU:        func.func @main(%x: tensor<2x8xbf16>, %ids: tensor<2x8xi32>) -> (tensor<2x8xbf16>, tensor<2x8xi32>)
// TPU-NEXT:     %b = tpu.clamp %x {min = 5.000000e-01 : f64, max = 1.000000e+00 : f64, compute = bf16} : tensor<2x8xbf16> -> tensor<2x8xbf16>
// TPU-NEXT:     %i = tpu.clamp %ids {max = 4.000000e+00 : f64, compute = i32} : tensor<2x8xi32> -> tensor<2x8xi32>
// TPU-NEXT:     func.return %b, %i
// TPU-NOT:      top.

// LINALG:       linalg.generic
// LINALG:         arith.constant -1.000000e+00 : f32
// LINALG-NEXT:    arith.maximumf
// LINALG-NEXT:    arith.constant 1.000000e+00 : f32
// LINALG-NEXT:    arith.minimumf
// LINALG:       linalg.generic
// LINALG:         arith.maximumf
// LINALG:         arith.minimumf
// LINALG:       linalg.generic
// LINALG:         arith.constant 4 : i32
// LINALG-NEXT:    arith.minsi
// LINALG-NOT:     top.clamp
