// RUN: toptpu-opt %s -p expand-silu | filecheck %s
// RUN: toptpu-opt %s -p 'expand-silu{form=tanh}' | filecheck %s --check-prefix=TANH
// RUN: toptpu-opt %s -p 'expand-silu,canonicalize,cse' | filecheck %s --check-prefix=SIMPLIFY
// RUN: not toptpu-opt %s -p 'expand-silu{form=erf}' 2>&1 | filecheck %s --check-prefix=FORM
// RUN: not toptpu-opt %S/Inputs/tpu_silu.mlir -p expand-silu 2>&1 | filecheck %s --check-prefix=LEVEL

// The SwiGLU of an MLP: silu(gate) * up. expand-silu writes the silu as the ops of its
// definition, each named after it; the multiply by `up` is untouched.
builtin.module {
  func.func @main(%gate: tensor<1x4x8xf32>, %up: tensor<1x4x8xf32>) -> tensor<1x4x8xf32> {
    %s = "top.silu"(%gate) : (tensor<1x4x8xf32>) -> tensor<1x4x8xf32> loc("mlp.act")
    %y = "top.mul"(%s, %up) : (tensor<1x4x8xf32>, tensor<1x4x8xf32>) -> tensor<1x4x8xf32> loc("mlp.mul")
    func.return %y : tensor<1x4x8xf32>
  }
}

// CHECK:      %[[SIG:.*]] = top.sigmoid %gate : tensor<1x4x8xf32> -> tensor<1x4x8xf32>
// CHECK-NEXT: %[[S:.*]] = top.mul %gate, %[[SIG]] : tensor<1x4x8xf32>, tensor<1x4x8xf32> -> tensor<1x4x8xf32>
// CHECK-NEXT: %{{.*}} = top.mul %[[S]], %up
// CHECK-NOT:  top.silu

// TANH:      %[[H:.*]] = top.mul_const %gate {value = 5.000000e-01 : f64}
// TANH-NEXT: %[[T:.*]] = top.tanh %[[H]]
// TANH-NEXT: %[[A:.*]] = top.mul_const %[[T]] {value = 5.000000e-01 : f64}
// TANH-NEXT: %[[B:.*]] = top.add_const %[[A]] {value = 5.000000e-01 : f64}
// TANH-NEXT: %[[S:.*]] = top.mul %gate, %[[B]]
// TANH-NEXT: top.mul %[[S]], %up
// TANH-NOT:  top.silu

// Canonicalization does not fold the expansion back: silu stays expanded.
// SIMPLIFY:     top.sigmoid
// SIMPLIFY-NOT: top.silu

// FORM: toptpu-opt: error: -p 'expand-silu{form=erf}': expand-silu: form must be sigmoid or tanh, not 'erf'

// LEVEL: pass 'expand-silu': the input is already Tpu IR (it holds 'tpu.silu' (mlp.act)); expand-silu takes Top IR
