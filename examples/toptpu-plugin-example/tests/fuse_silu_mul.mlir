// RUN: toptpu-opt %s -p fuse-silu-mul | filecheck %s
// RUN: toptpu-opt %s -p fuse-silu-mul | toptpu-opt | filecheck %s --check-prefix=ROUNDTRIP
// RUN: toptpu-opt %s -p fuse-silu-mul,convert-top-to-linalg | filecheck %s --check-prefix=LINALG
// RUN: toptpu-opt %s -p fuse-silu-mul | toptpu-opt --print-op-generic | filecheck %s --check-prefix=GENERIC
// RUN: not toptpu-opt %S/Inputs/bad_silu_mul.mlir 2>&1 | filecheck %s --check-prefix=VERIFY
// RUN: not toptpu-opt %S/Inputs/tpu_silu.mlir -p fuse-silu-mul 2>&1 | filecheck %s --check-prefix=LEVEL

// SwiGLU: silu(gate) * up becomes the plugin's op top.silu_mul (in either operand order),
// named after the multiply it replaces; a silu with another use stays as it is.
builtin.module {
  func.func @main(%gate: tensor<1x4x8xbf16>, %up: tensor<1x4x8xbf16>) -> (tensor<1x4x8xbf16>, tensor<1x4x8xbf16>, tensor<1x4x8xbf16>) {
    %s = "top.silu"(%gate) : (tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16> loc("mlp.act")
    %y = "top.mul"(%s, %up) : (tensor<1x4x8xbf16>, tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16> loc("mlp.mul")
    %s2 = "top.silu"(%up) : (tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16> loc("other.act")
    %y2 = "top.mul"(%gate, %s2) : (tensor<1x4x8xbf16>, tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16> loc("other.mul")
    %s3 = "top.silu"(%gate) : (tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16> loc("kept.act")
    %y3 = "top.mul"(%s3, %s3) : (tensor<1x4x8xbf16>, tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16> loc("kept.mul")
    func.return %y, %y2, %y3 : tensor<1x4x8xbf16>, tensor<1x4x8xbf16>, tensor<1x4x8xbf16>
  }
}

// CHECK:      %y = top.silu_mul %gate, %up : tensor<1x4x8xbf16>, tensor<1x4x8xbf16> -> tensor<1x4x8xbf16>
// CHECK-NEXT: %y2 = top.silu_mul %up, %gate : tensor<1x4x8xbf16>, tensor<1x4x8xbf16> -> tensor<1x4x8xbf16>
// CHECK-NEXT: %s3 = top.silu %gate
// CHECK-NEXT: %y3 = top.mul %s3, %s3

// ROUNDTRIP: top.silu_mul %gate, %up
// ROUNDTRIP: top.silu_mul %up, %gate

// LINALG:      linalg.generic
// LINALG:      arith.extf %{{.*}} : bf16 to f32
// LINALG:      math.exp
// LINALG:      arith.divf
// LINALG-NEXT: arith.mulf
// LINALG-NEXT: arith.truncf %{{.*}} : f32 to bf16
// LINALG-NOT:  top.silu_mul

// GENERIC: "top.silu_mul"(%{{.*}}, %{{.*}}) : (tensor<1x4x8xbf16>, tensor<1x4x8xbf16>) -> tensor<1x4x8xbf16>

// VERIFY: 'top.silu_mul': gate tensor<1x4x8xbf16> and up tensor<1x8xbf16> differ (silu_mul takes two tensors of one shape and type)

// LEVEL: pass 'fuse-silu-mul': the input is already Tpu IR (it holds 'tpu.silu' (mlp.act)); fuse-silu-mul takes Top IR
