// RUN: toptpu-opt %s -p convert-top-to-linalg --split-input-file | filecheck %s
// RUN: toptpu-opt %s -p 'convert-top-to-linalg,mlir{pipeline="canonicalize,cse"}' --split-input-file | filecheck %s --check-prefix=MLIR
// RUN: not toptpu-opt %S/Inputs/topk.mlir -p convert-top-to-linalg 2>&1 | filecheck %s --check-prefix=TOPK
// RUN: not toptpu-opt %S/Inputs/topk.mlir -p 'mlir{pipeline="no-such-pass"}' 2>&1 | filecheck %s --check-prefix=BADPIPE

// weights become trailing function arguments; linear = bias-initialised accumulator and a
// reduction over k (transpose_b reads the weight as [N, K])
builtin.module {
  func.func @linear(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %b = "top.weight"() {name = "fc.bias"} : () -> tensor<32xf32>
    %y = "top.matmul"(%x, %w, %b) {transpose_b = true} : (tensor<1x8x64xf32>, tensor<32x64xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-LABEL: func.func @linear(%x: tensor<1x8x64xf32>, %w: tensor<32x64xf32> {top.weight = "fc.weight", top.name = "fc.weight"}, %b: tensor<32xf32> {top.weight = "fc.bias", top.name = "fc.bias"})
// CHECK-NOT:     top.
// CHECK:         [[INIT:%.*]] = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d2)>, affine_map<(d0, d1, d2) -> (d0, d1, d2)>], iterator_types = ["parallel", "parallel", "parallel"]} ins(%b
// CHECK:         linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>, affine_map<(d0, d1, d2, d3) -> (d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>], iterator_types = ["parallel", "parallel", "parallel", "reduction"]} ins(%x, %w : tensor<1x8x64xf32>, tensor<32x64xf32>) outs([[INIT]] : tensor<1x8x32xf32>)
// CHECK-NEXT:    ^bb0(%{{.*}}: f32, %{{.*}}: f32, %{{.*}}: f32):
// CHECK-NEXT:      arith.mulf
// CHECK-NEXT:      arith.addf

// MLIR-LABEL: func.func @linear
// MLIR:         linalg.generic {{.*}}"reduction"

// -----

// numpy broadcasting: size-1 axes read index 0, missing leading axes are dropped
builtin.module {
  func.func @bcast(%x: tensor<2x8x64xf32>, %m: tensor<8x1xf32>) -> tensor<2x8x64xf32> {
    %y = "top.mul"(%x, %m) : (tensor<2x8x64xf32>, tensor<8x1xf32>) -> tensor<2x8x64xf32>
    func.return %y : tensor<2x8x64xf32>
  }
}

// CHECK-LABEL: func.func @bcast
// CHECK:         [[E:%.*]] = tensor.empty() : tensor<2x8x64xf32>
// CHECK-NEXT:    linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d1, d2)>, affine_map<(d0, d1, d2) -> (d1, 0)>, affine_map<(d0, d1, d2) -> (d0, d1, d2)>], iterator_types = ["parallel", "parallel", "parallel"]} ins(%x, %m : {{.*}}) outs([[E]] : tensor<2x8x64xf32>)
// CHECK:           arith.mulf

// -----

// GQA attention with history: scores per part (kv head = h floordiv rep), one softmax
// over both parts (max, then sum of exp), weighted values accumulated part after part
builtin.module {
  func.func @gqa(%q: tensor<1x8x4x16xf32>, %k: tensor<1x8x2x16xf32>, %v: tensor<1x8x2x16xf32>, %hk: tensor<1x4x2x16xf32>, %hv: tensor<1x4x2x16xf32>, %mask: tensor<1x1x8x12xf32>) -> tensor<1x8x4x16xf32> {
    %a = "top.attention"(%q, %k, %v, %mask, %hk, %hv) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>} : (tensor<1x8x4x16xf32>, tensor<1x8x2x16xf32>, tensor<1x8x2x16xf32>, tensor<1x1x8x12xf32>, tensor<1x4x2x16xf32>, tensor<1x4x2x16xf32>) -> tensor<1x8x4x16xf32>
    func.return %a : tensor<1x8x4x16xf32>
  }
}

// CHECK-LABEL: func.func @gqa
// CHECK:         [[SH:%.*]] = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3, d4) -> (d0, d2, d1, d4)>, affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, (d1 floordiv 2), d4)>, {{.*}}]{{.*}}"reduction"]} ins(%q, %hk
// the history part reads mask columns 0..3, the new part columns 4..11
// CHECK:         tensor.extract %mask[%{{.*}}, %{{.*}}, %{{.*}}, %{{.*}}] : tensor<1x1x8x12xf32>
// CHECK:         ins(%q, %k
// CHECK:         arith.constant 4 : index
// CHECK:         tensor.extract %mask
// CHECK:         arith.constant 0xff800000 : f32
// CHECK:         arith.maximumf
// CHECK:         arith.maximumf
// CHECK:         math.exp
// CHECK:         math.exp
// CHECK:         affine_map<(d0, d1, d2, d3, d4) -> (d0, d4, (d2 floordiv 2), d3)>{{.*}} ins({{.*}}, %hv
// CHECK:         affine_map<(d0, d1, d2, d3, d4) -> (d0, d4, (d2 floordiv 2), d3)>{{.*}} ins({{.*}}, %v
// CHECK:         arith.divf
// CHECK:         func.return

// -----

// rms_norm: f32 sum of squares, then x * rsqrt(mean + eps) * w; rope "half" reads the
// rotated partner by index; reshape = collapse to 1-D + expand (MLIR folds the pair)
builtin.module {
  func.func @norm_rope(%x: tensor<1x8x4x16xf32>, %w: tensor<16xf32>, %cos: tensor<1x8x1x16xf32>, %sin: tensor<1x8x1x16xf32>) -> tensor<1x8x64xf32> {
    %n = "top.rms_norm"(%x, %w) {eps = 1.0e-06 : f64} : (tensor<1x8x4x16xf32>, tensor<16xf32>) -> tensor<1x8x4x16xf32>
    %r = "top.rope"(%n, %cos, %sin) {mode = "half"} : (tensor<1x8x4x16xf32>, tensor<1x8x1x16xf32>, tensor<1x8x1x16xf32>) -> tensor<1x8x4x16xf32>
    %s = "top.reshape"(%r) {shape = array<i64: 1, 8, 64>} : (tensor<1x8x4x16xf32>) -> tensor<1x8x64xf32>
    func.return %s : tensor<1x8x64xf32>
  }
}

// CHECK-LABEL: func.func @norm_rope
// CHECK:         "reduction"]} ins(%x : tensor<1x8x4x16xf32>)
// CHECK:         arith.mulf
// CHECK:         math.rsqrt
// CHECK:         [[ROPE:%.*]] = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, 0, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, 0, d3)>
// CHECK:           [[HALF:%.*]] = arith.constant 8 : index
// CHECK:           [[FIRST:%.*]] = arith.cmpi slt, %{{.*}}, [[HALF]] : index
// CHECK:           tensor.extract
// CHECK:           arith.negf
// CHECK:         tensor.collapse_shape [[ROPE]] {{.*}} into tensor<512xf32>
// CHECK-NEXT:    tensor.expand_shape {{.*}} output_shape [1, 8, 64] : tensor<512xf32> into tensor<1x8x64xf32>

// MLIR-LABEL: func.func @norm_rope
// MLIR:         tensor.collapse_shape %{{.*}} {{\[}}[0 : i64], [1 : i64], [2 : i64, 3 : i64]] : tensor<1x8x4x16xf32> into tensor<1x8x64xf32>
// MLIR-NOT:     expand_shape
// MLIR:         func.return

// -----

// bf16 storage is computed in f32 and rounded once at the end
builtin.module {
  func.func @softmax_bf16(%x: tensor<4x8xbf16>) -> tensor<4x8xbf16> {
    %y = "top.softmax"(%x) {axis = 1 : i64} : (tensor<4x8xbf16>) -> tensor<4x8xbf16>
    func.return %y : tensor<4x8xbf16>
  }
}

// CHECK-LABEL: func.func @softmax_bf16
// CHECK:         arith.extf %{{.*}} : bf16 to f32
// CHECK-NEXT:    arith.maximumf
// CHECK:         math.exp
// CHECK:         arith.divf
// CHECK-NEXT:    arith.truncf %{{.*}} : f32 to bf16
// CHECK-NEXT:    linalg.yield %{{.*}} : bf16

// TOPK: 'top.topk' (topk): only k = 1 (argmax/argmin) is lowered, not k = 2
// TOPK-SAME: sorting has no linalg form
// TOPK-NOT: Traceback

// BADPIPE: MLIR does not understand the pipeline 'no-such-pass'
// BADPIPE-SAME: 'no-such-pass' does not refer to a registered pass
// BADPIPE-NOT: Traceback
