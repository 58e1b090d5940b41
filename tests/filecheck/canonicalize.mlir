// RUN: toptpu-opt %s -p canonicalize --split-input-file | filecheck %s

// xDSL's canonicalize runs each op's canonicalization patterns (the `get_canonicalization_patterns`
// of its class: toptpu.dialects.canonicalization); constant folding is fold-constants
// (fold_constants.mlir).

// No-op reshapes and permutes disappear; chains compose; dead ops are erased.
builtin.module {
  func.func @shapes(%x: tensor<2x3x4xf32>) -> (tensor<2x3x4xf32>, tensor<4x3x2xf32>, tensor<24xf32>) {
    %0 = "top.reshape"(%x) {shape = array<i64: 2, 3, 4>} : (tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
    %1 = "top.permute"(%0) {order = array<i64: 1, 0, 2>} : (tensor<2x3x4xf32>) -> tensor<3x2x4xf32>
    %2 = "top.permute"(%1) {order = array<i64: 1, 0, 2>} : (tensor<3x2x4xf32>) -> tensor<2x3x4xf32>
    %3 = "top.permute"(%x) {order = array<i64: 1, 0, 2>} : (tensor<2x3x4xf32>) -> tensor<3x2x4xf32>
    %4 = "top.permute"(%3) {order = array<i64: 2, 0, 1>} : (tensor<3x2x4xf32>) -> tensor<4x3x2xf32>
    %5 = "top.reshape"(%x) {shape = array<i64: 6, 4>} : (tensor<2x3x4xf32>) -> tensor<6x4xf32>
    %6 = "top.reshape"(%5) {shape = array<i64: 24>} : (tensor<6x4xf32>) -> tensor<24xf32>
    %dead = "top.exp"(%x) : (tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
    func.return %2, %4, %6 : tensor<2x3x4xf32>, tensor<4x3x2xf32>, tensor<24xf32>
  }
}

// CHECK-LABEL: func.func @shapes
// CHECK-NEXT:    %0 = top.permute %x {order = array<i64: 2, 1, 0>} : tensor<2x3x4xf32> -> tensor<4x3x2xf32>
// CHECK-NEXT:    %1 = top.reshape %x {shape = array<i64: 24>} : tensor<2x3x4xf32> -> tensor<24xf32>
// CHECK-NEXT:    func.return %x, %0, %1

// -----

// A permute that only moves unit axes is a reshape; x*1 and x+0 fold away.
builtin.module {
  func.func @units(%x: tensor<1x8x1x16xf32>) -> tensor<1x1x8x16xf32> {
    %0 = "top.mul_const"(%x) {value = 1.0 : f64} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %1 = "top.add_const"(%0) {value = 0.0 : f64} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %2 = "top.permute"(%1) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x8x1x16xf32>) -> tensor<1x1x8x16xf32>
    func.return %2 : tensor<1x1x8x16xf32>
  }
}

// CHECK-LABEL: func.func @units
// CHECK-NEXT:    %0 = top.reshape %x {shape = array<i64: 1, 1, 8, 16>}
// CHECK-NEXT:    func.return %0

// -----

// A Tpu permute of unit axes becomes a Tpu reshape (the patterns serve both levels); a
// cast to its own type, a full slice, an expand to its own shape and a concat of one input
// fold away; (x * 2) * 3 is x * 6.
builtin.module {
  func.func @tpu(%x: tensor<1x8x1x16xf32>) -> tensor<1x1x8x16xf32> {
    %0 = "tpu.cast"(%x) {dtype = f32} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %1 = "tpu.slice"(%0) {axis = 1 : i64, start = 0 : i64, end = 8 : i64, step = 1 : i64} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %2 = "tpu.expand"(%1) {shape = array<i64: 1, 8, 1, 16>} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %3 = "tpu.concat"(%2) {axis = 1 : i64} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %4 = "tpu.mul_const"(%3) {value = 2.0 : f64} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %5 = "tpu.mul_const"(%4) {value = 3.0 : f64} : (tensor<1x8x1x16xf32>) -> tensor<1x8x1x16xf32>
    %6 = "tpu.permute"(%5) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x8x1x16xf32>) -> tensor<1x1x8x16xf32>
    func.return %6 : tensor<1x1x8x16xf32>
  }
}

// CHECK-LABEL: func.func @tpu
// CHECK-NEXT:    %0 = tpu.mul_const %x {value = 6.000000e+00 : f64}
// CHECK-NEXT:    %1 = tpu.reshape %0 {shape = array<i64: 1, 1, 8, 16>}
// CHECK-NEXT:    func.return %1
