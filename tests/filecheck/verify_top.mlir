// RUN: not toptpu-opt %s --split-input-file 2>&1 | filecheck %s
// RUN: not toptpu-opt %s --split-input-file 2>&1 | filecheck %s --check-prefix=EXIT

// Each Top op family's verifier refuses an invalid op with a message naming the op and
// what is wrong, at the op's place in the file. Each chunk holds one invalid op;
// --split-input-file prints its diagnostic on stderr and goes on to the next chunk, exiting 1
// at the end, as mlir-opt (an op that verified would print IR, and its CHECK would not match).
// The second run line: the first chunk's error comes first, exit status 1, no traceback.
// gelu: approximate is 'none' or 'tanh' (a GeluApproximation)
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = "top.gelu"(%x) {approximate = "fast"} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 1):12:5
// CHECK-NEXT: "top.gelu"(%x)
// CHECK:      gelu approximation "fast" is not one of none, tanh

// EXIT:      toptpu-opt: the IR does not verify:
// EXIT-NEXT: verify_top.mlir (the chunk from line 1):12:5
// EXIT:      gelu approximation "fast" is not one of none, tanh
// EXIT-NOT:  Traceback

// -----
// binary: both operands share the element type
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<2x3xf16>) -> tensor<2x3xf32> {
    %0 = "top.add"(%x, %y) : (tensor<2x3xf32>, tensor<2x3xf16>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 25):5:5
// CHECK-NEXT: "top.add"(%x, %y)
// CHECK:      'top.add': operand element types differ: f32 vs f16

// -----
// binary: numpy broadcasting, nothing else
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<4xf32>) -> tensor<2x3xf32> {
    %0 = "top.mul"(%x, %y) : (tensor<2x3xf32>, tensor<4xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 37):5:5
// CHECK-NEXT: "top.mul"(%x, %y)
// CHECK:      'top.mul': shapes [2, 3], [4] do not broadcast

// -----
// compare: a known predicate
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xi1> {
    %0 = "top.compare"(%x, %x) {predicate = "lte"} : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xi1>
    func.return %0 : tensor<2x3xi1>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 49):5:5
// CHECK-NEXT: "top.compare"(%x, %x)
// CHECK:      compare predicate "lte" is not one of eq, ne, lt, le, gt, ge

// -----
// where: both branches of one element type
builtin.module {
  func.func @f(%c: tensor<2x3xi1>, %x: tensor<2x3xf32>, %y: tensor<2x3xbf16>) -> tensor<2x3xf32> {
    %0 = "top.where"(%c, %x, %y) : (tensor<2x3xi1>, tensor<2x3xf32>, tensor<2x3xbf16>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 61):5:5
// CHECK-NEXT: "top.where"(%c, %x, %y)
// CHECK:      'top.where': top.where branches must share the element type

// -----
// softmax: the axis exists
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = "top.softmax"(%x) {axis = 2 : i64} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 73):5:5
// CHECK-NEXT: "top.softmax"(%x)
// CHECK:      axis 2 is out of range for rank 2

// -----
// reduce: a known mode
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2xf32> {
    %0 = "top.reduce"(%x) {mode = "prod", axes = array<i64: 1>, keepdims = false} : (tensor<2x3xf32>) -> tensor<2xf32>
    func.return %0 : tensor<2xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 85):5:5
// CHECK-NEXT: "top.reduce"(%x)
// CHECK:      reduce mode "prod" is not one of mean, sum, max, min

// -----
// rms_norm: the weight matches the last axis
builtin.module {
  func.func @f(%x: tensor<2x8xf32>, %w: tensor<4xf32>) -> tensor<2x8xf32> {
    %0 = "top.rms_norm"(%x, %w) {eps = 1.0e-06 : f64} : (tensor<2x8xf32>, tensor<4xf32>) -> tensor<2x8xf32>
    func.return %0 : tensor<2x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 97):5:5
// CHECK-NEXT: "top.rms_norm"(%x, %w)
// CHECK:      'top.rms_norm': rms_norm weight [4] does not match the last axis of [2, 8]

// -----
// layer_norm: the affine shape is that of the normalized axes
builtin.module {
  func.func @f(%x: tensor<2x8xf32>, %w: tensor<2x8xf32>) -> tensor<2x8xf32> {
    %0 = "top.layer_norm"(%x, %w) {eps = 1.0e-05 : f64, axis = 1 : i64, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<2x8xf32>, tensor<2x8xf32>) -> tensor<2x8xf32>
    func.return %0 : tensor<2x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 109):5:5
// CHECK-NEXT: "top.layer_norm"(%x, %w)
// CHECK:      'top.layer_norm': layer_norm affine shape [2, 8] must be [8]

// -----
// rope: a known mode
builtin.module {
  func.func @f(%x: tensor<1x4x2x8xf32>, %c: tensor<1x4x1x8xf32>) -> tensor<1x4x2x8xf32> {
    %0 = "top.rope"(%x, %c, %c) {mode = "full"} : (tensor<1x4x2x8xf32>, tensor<1x4x1x8xf32>, tensor<1x4x1x8xf32>) -> tensor<1x4x2x8xf32>
    func.return %0 : tensor<1x4x2x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 121):5:5
// CHECK-NEXT: "top.rope"(%x, %c, %c)
// CHECK:      rope mode "full" is not one of half, interleaved

// -----
// rope: an even head dimension
builtin.module {
  func.func @f(%x: tensor<1x4x2x7xf32>, %c: tensor<1x4x1x7xf32>) -> tensor<1x4x2x7xf32> {
    %0 = "top.rope"(%x, %c, %c) {mode = "half"} : (tensor<1x4x2x7xf32>, tensor<1x4x1x7xf32>, tensor<1x4x1x7xf32>) -> tensor<1x4x2x7xf32>
    func.return %0 : tensor<1x4x2x7xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 133):5:5
// CHECK-NEXT: "top.rope"(%x, %c, %c)
// CHECK:      'top.rope': rope needs an even last dimension

// -----
// rope: cos/sin broadcast to x
builtin.module {
  func.func @f(%x: tensor<1x4x2x8xf32>, %c: tensor<1x5x1x8xf32>) -> tensor<1x4x2x8xf32> {
    %0 = "top.rope"(%x, %c, %c) {mode = "half"} : (tensor<1x4x2x8xf32>, tensor<1x5x1x8xf32>, tensor<1x5x1x8xf32>) -> tensor<1x4x2x8xf32>
    func.return %0 : tensor<1x4x2x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 145):5:5
// CHECK-NEXT: "top.rope"(%x, %c, %c)
// CHECK:      'top.rope': shapes [1, 4, 2, 8], [1, 5, 1, 8], [1, 5, 1, 8] do not broadcast

// -----
// attention: q/k/v are [B, S, H, D]
builtin.module {
  func.func @f(%q: tensor<4x4x16xf32>) -> tensor<4x4x16xf32> {
    %0 = "top.attention"(%q, %q, %q) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 4 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0>} : (tensor<4x4x16xf32>, tensor<4x4x16xf32>, tensor<4x4x16xf32>) -> tensor<4x4x16xf32>
    func.return %0 : tensor<4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 157):5:5
// CHECK-NEXT: "top.attention"(%q, %q, %q)
// CHECK:      'top.attention': attention q/k/v must be rank 4 [B, S, H, D]

// -----
// attention: shapes agree with the head attributes
builtin.module {
  func.func @f(%q: tensor<1x4x4x16xf32>, %k: tensor<1x4x2x16xf32>) -> tensor<1x4x4x16xf32> {
    %0 = "top.attention"(%q, %k, %k) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 4 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0>} : (tensor<1x4x4x16xf32>, tensor<1x4x2x16xf32>, tensor<1x4x2x16xf32>) -> tensor<1x4x4x16xf32>
    func.return %0 : tensor<1x4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 169):5:5
// CHECK-NEXT: "top.attention"(%q, %k, %k)
// CHECK:      'top.attention': attention shapes q[1, 4, 4, 16] k[1, 4, 2, 16] v[1, 4, 2, 16] disagree with q_heads=4 kv_heads=4 head_dim=16

// -----
// attention: GQA needs q_heads a multiple of kv_heads
builtin.module {
  func.func @f(%q: tensor<1x4x4x16xf32>, %k: tensor<1x4x3x16xf32>) -> tensor<1x4x4x16xf32> {
    %0 = "top.attention"(%q, %k, %k) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 3 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0>} : (tensor<1x4x4x16xf32>, tensor<1x4x3x16xf32>, tensor<1x4x3x16xf32>) -> tensor<1x4x4x16xf32>
    func.return %0 : tensor<1x4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 181):5:5
// CHECK-NEXT: "top.attention"(%q, %k, %k)
// CHECK:      'top.attention': q_heads 4 is not a multiple of kv_heads 3

// -----
// attention: k and v of one sequence
builtin.module {
  func.func @f(%q: tensor<1x4x4x16xf32>, %k: tensor<1x4x2x16xf32>, %v: tensor<1x5x2x16xf32>) -> tensor<1x4x4x16xf32> {
    %0 = "top.attention"(%q, %k, %v) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0>} : (tensor<1x4x4x16xf32>, tensor<1x4x2x16xf32>, tensor<1x5x2x16xf32>) -> tensor<1x4x4x16xf32>
    func.return %0 : tensor<1x4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 193):5:5
// CHECK-NEXT: "top.attention"(%q, %k, %v)
// CHECK:      'top.attention': attention k and v must share batch and sequence

// -----
// attention: history k and v come together
builtin.module {
  func.func @f(%q: tensor<1x4x4x16xf32>, %k: tensor<1x4x2x16xf32>, %m: tensor<1x1x4x12xf32>, %hk: tensor<1x8x2x16xf32>) -> tensor<1x4x4x16xf32> {
    %0 = "top.attention"(%q, %k, %k, %m, %hk) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>} : (tensor<1x4x4x16xf32>, tensor<1x4x2x16xf32>, tensor<1x4x2x16xf32>, tensor<1x1x4x12xf32>, tensor<1x8x2x16xf32>) -> tensor<1x4x4x16xf32>
    func.return %0 : tensor<1x4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 205):5:5
// CHECK-NEXT: "top.attention"(%q, %k, %k, %m, %hk)
// CHECK:      'top.attention': history_k and history_v come together

// -----
// attention: history shaped like k/v
builtin.module {
  func.func @f(%q: tensor<1x4x4x16xf32>, %k: tensor<1x4x2x16xf32>, %hk: tensor<1x8x2x8xf32>) -> tensor<1x4x4x16xf32> {
    %0 = "top.attention"(%q, %k, %k, %hk, %hk) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 0, 1, 1>} : (tensor<1x4x4x16xf32>, tensor<1x4x2x16xf32>, tensor<1x4x2x16xf32>, tensor<1x8x2x8xf32>, tensor<1x8x2x8xf32>) -> tensor<1x4x4x16xf32>
    func.return %0 : tensor<1x4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 217):5:5
// CHECK-NEXT: "top.attention"(%q, %k, %k, %hk, %hk)
// CHECK:      'top.attention': history shapes [1, 8, 2, 8]/[1, 8, 2, 8] do not match k/v

// -----
// attention: the mask covers history + new keys
builtin.module {
  func.func @f(%q: tensor<1x4x4x16xf32>, %k: tensor<1x4x2x16xf32>, %m: tensor<1x1x4x4xf32>, %hk: tensor<1x8x2x16xf32>) -> tensor<1x4x4x16xf32> {
    %0 = "top.attention"(%q, %k, %k, %m, %hk, %hk) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>} : (tensor<1x4x4x16xf32>, tensor<1x4x2x16xf32>, tensor<1x4x2x16xf32>, tensor<1x1x4x4xf32>, tensor<1x8x2x16xf32>, tensor<1x8x2x16xf32>) -> tensor<1x4x4x16xf32>
    func.return %0 : tensor<1x4x4x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 229):5:5
// CHECK-NEXT: "top.attention"(%q, %k, %k, %m, %hk, %hk)
// CHECK:      'top.attention': attention mask [1, 1, 4, 4] does not broadcast to [1, 4, 4, 12]

// -----
// matmul: rank >= 2
builtin.module {
  func.func @f(%x: tensor<8xf32>, %w: tensor<8x4xf32>) -> tensor<4xf32> {
    %0 = "top.matmul"(%x, %w) : (tensor<8xf32>, tensor<8x4xf32>) -> tensor<4xf32>
    func.return %0 : tensor<4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 241):5:5
// CHECK-NEXT: "top.matmul"(%x, %w)
// CHECK:      'top.matmul': matmul operands must have rank >= 2

// -----
// matmul: the contraction dimensions agree
builtin.module {
  func.func @f(%x: tensor<2x8xf32>, %w: tensor<8x4xf32>) -> tensor<2x8xf32> {
    %0 = "top.matmul"(%x, %w) {transpose_b = true} : (tensor<2x8xf32>, tensor<8x4xf32>) -> tensor<2x8xf32>
    func.return %0 : tensor<2x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 253):5:5
// CHECK-NEXT: "top.matmul"(%x, %w)
// CHECK:      'top.matmul': matmul contraction mismatch: [2, 8] @ [8, 4] (transpose_a=False, transpose_b=True)

// -----
// matmul: the bias is [N]
builtin.module {
  func.func @f(%x: tensor<2x8xf32>, %w: tensor<8x4xf32>, %b: tensor<8xf32>) -> tensor<2x4xf32> {
    %0 = "top.matmul"(%x, %w, %b) : (tensor<2x8xf32>, tensor<8x4xf32>, tensor<8xf32>) -> tensor<2x4xf32>
    func.return %0 : tensor<2x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 265):5:5
// CHECK-NEXT: "top.matmul"(%x, %w, %b)
// CHECK:      'top.matmul': matmul bias [8] must be [4]

// -----
// gather: integer indices
builtin.module {
  func.func @f(%t: tensor<16x8xf32>, %i: tensor<1x4xf32>) -> tensor<1x4x8xf32> {
    %0 = "top.gather"(%t, %i) {axis = 0 : i64} : (tensor<16x8xf32>, tensor<1x4xf32>) -> tensor<1x4x8xf32>
    func.return %0 : tensor<1x4x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 277):5:5
// CHECK-NEXT: "top.gather"(%t, %i)
// CHECK:      'top.gather': gather indices must be integers

// -----
// topk: 1 <= k <= the axis size
builtin.module {
  func.func @f(%x: tensor<1x16xf32>) -> tensor<1x17xf32> {
    %0, %1 = "top.topk"(%x) {k = 17 : i64, axis = 1 : i64} : (tensor<1x16xf32>) -> (tensor<1x17xf32>, tensor<1x17xi32>)
    func.return %0 : tensor<1x17xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 289):5:5
// CHECK-NEXT: "top.topk"(%x)
// CHECK:      'top.topk': topk k=17 out of range for axis size 16

// -----
// conv2d: channels agree with the weight and groups
builtin.module {
  func.func @f(%x: tensor<1x3x8x8xf32>, %w: tensor<4x2x2x2xf32>) -> tensor<1x4x4x4xf32> {
    %0 = "top.conv2d"(%x, %w) {strides = array<i64: 2, 2>, pads = array<i64: 0, 0, 0, 0>, dilations = array<i64: 1, 1>, groups = 1 : i64} : (tensor<1x3x8x8xf32>, tensor<4x2x2x2xf32>) -> tensor<1x4x4x4xf32>
    func.return %0 : tensor<1x4x4x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 301):5:5
// CHECK-NEXT: "top.conv2d"(%x, %w)
// CHECK:      'top.conv2d': conv2d channels 3 do not match weight 4x2, groups 1

// -----
// conv2d: a non-empty output
builtin.module {
  func.func @f(%x: tensor<1x3x2x2xf32>, %w: tensor<4x3x4x4xf32>) -> tensor<1x4x1x1xf32> {
    %0 = "top.conv2d"(%x, %w) {strides = array<i64: 1, 1>, pads = array<i64: 0, 0, 0, 0>, dilations = array<i64: 1, 1>, groups = 1 : i64} : (tensor<1x3x2x2xf32>, tensor<4x3x4x4xf32>) -> tensor<1x4x1x1xf32>
    func.return %0 : tensor<1x4x1x1xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 313):5:5
// CHECK-NEXT: "top.conv2d"(%x, %w)
// CHECK:      'top.conv2d': conv2d output would be empty

// -----
// reshape: the element count is kept
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<7xf32> {
    %0 = "top.reshape"(%x) {shape = array<i64: 7>} : (tensor<2x3xf32>) -> tensor<7xf32>
    func.return %0 : tensor<7xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 325):5:5
// CHECK-NEXT: "top.reshape"(%x)
// CHECK:      'top.reshape': cannot reshape [2, 3] to [7]

// -----
// permute: a permutation of the axes
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<3x3xf32> {
    %0 = "top.permute"(%x) {order = array<i64: 1, 1>} : (tensor<2x3xf32>) -> tensor<3x3xf32>
    func.return %0 : tensor<3x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 337):5:5
// CHECK-NEXT: "top.permute"(%x)
// CHECK:      'top.permute': permute order [1, 1] is not a permutation of rank 2

// -----
// expand: numpy broadcasting to the shape
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<4x3xf32> {
    %0 = "top.expand"(%x) {shape = array<i64: 4, 3>} : (tensor<2x3xf32>) -> tensor<4x3xf32>
    func.return %0 : tensor<4x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 349):5:5
// CHECK-NEXT: "top.expand"(%x)
// CHECK:      'top.expand': shapes [2, 3], [4, 3] do not broadcast

// -----
// concat: shapes agree off the axis
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<3x3xf32>) -> tensor<2x6xf32> {
    %0 = "top.concat"(%x, %y) {axis = 1 : i64} : (tensor<2x3xf32>, tensor<3x3xf32>) -> tensor<2x6xf32>
    func.return %0 : tensor<2x6xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 361):5:5
// CHECK-NEXT: "top.concat"(%x, %y)
// CHECK:      'top.concat': concat shapes [[2, 3], [3, 3]] disagree

// -----
// concat: one element type
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<2x3xf16>) -> tensor<2x6xf32> {
    %0 = "top.concat"(%x, %y) {axis = 1 : i64} : (tensor<2x3xf32>, tensor<2x3xf16>) -> tensor<2x6xf32>
    func.return %0 : tensor<2x6xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 373):5:5
// CHECK-NEXT: "top.concat"(%x, %y)
// CHECK:      'top.concat': concat inputs must share the element type

// -----
// slice: in range (nothing is clipped)
builtin.module {
  func.func @f(%x: tensor<2x8xf32>) -> tensor<2x4xf32> {
    %0 = "top.slice"(%x) {axis = 1 : i64, start = 6 : i64, end = 10 : i64, step = 1 : i64} : (tensor<2x8xf32>) -> tensor<2x4xf32>
    func.return %0 : tensor<2x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 385):5:5
// CHECK-NEXT: "top.slice"(%x)
// CHECK:      'top.slice': slice [6:10:1] out of range for axis 1 of size 8

// -----
// cast: the result type is the dtype attribute
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = "top.cast"(%x) {dtype = f16} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 397):5:5
// CHECK-NEXT: "top.cast"(%x)
// CHECK:      'top.cast' result types ['tensor<2x3xf32>'] differ from the inferred ['tensor<2x3xf16>']

// -----
// causal_conv1d: the taps are [C, K], one kernel per channel of x
builtin.module {
  func.func @f(%x: tensor<1x8x8xf32>, %w: tensor<16x4xf32>, %valid: tensor<1x8xf32>) -> tensor<1x8x8xf32> {
    %y, %s = "top.causal_conv1d"(%x, %w, %valid) {operandSegmentSizes = array<i32: 1, 1, 0, 1>} : (tensor<1x8x8xf32>, tensor<16x4xf32>, tensor<1x8xf32>) -> (tensor<1x8x8xf32>, tensor<1x3x8xf32>)
    func.return %y : tensor<1x8x8xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 409):5:5
// CHECK-NEXT: "top.causal_conv1d"(%x, %w, %valid)
// CHECK:      causal_conv1d weight is [16, 4]; it must be [C, K] = [8, K]

// -----
// causal_conv1d: the state holds the last K-1 inputs
builtin.module {
  func.func @f(%x: tensor<1x8x16xf32>, %w: tensor<16x4xf32>, %state: tensor<1x2x16xf32>, %valid: tensor<1x8xf32>) -> tensor<1x8x16xf32> {
    %y, %s = "top.causal_conv1d"(%x, %w, %state, %valid) {operandSegmentSizes = array<i32: 1, 1, 1, 1>} : (tensor<1x8x16xf32>, tensor<16x4xf32>, tensor<1x2x16xf32>, tensor<1x8xf32>) -> (tensor<1x8x16xf32>, tensor<1x3x16xf32>)
    func.return %y : tensor<1x8x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 421):5:5
// CHECK-NEXT: "top.causal_conv1d"(%x, %w, %state, %valid)
// CHECK:      causal_conv1d state is [1, 2, 16]; it must be [1, 3, 16]

// -----
// causal_conv1d: one valid flag per token
builtin.module {
  func.func @f(%x: tensor<1x8x16xf32>, %w: tensor<16x4xf32>, %valid: tensor<1x4xf32>) -> tensor<1x8x16xf32> {
    %y, %s = "top.causal_conv1d"(%x, %w, %valid) {operandSegmentSizes = array<i32: 1, 1, 0, 1>} : (tensor<1x8x16xf32>, tensor<16x4xf32>, tensor<1x4xf32>) -> (tensor<1x8x16xf32>, tensor<1x3x16xf32>)
    func.return %y : tensor<1x8x16xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 433):5:5
// CHECK-NEXT: "top.causal_conv1d"(%x, %w, %valid)
// CHECK:      causal_conv1d valid is [1, 4]; it must be [1, 8]

// -----
// causal_conv1d: a float input
builtin.module {
  func.func @f(%x: tensor<1x8x16xi32>, %w: tensor<16x4xf32>, %valid: tensor<1x8xf32>) -> tensor<1x8x16xi32> {
    %y, %s = "top.causal_conv1d"(%x, %w, %valid) {operandSegmentSizes = array<i32: 1, 1, 0, 1>} : (tensor<1x8x16xi32>, tensor<16x4xf32>, tensor<1x8xf32>) -> (tensor<1x8x16xi32>, tensor<1x3x16xi32>)
    func.return %y : tensor<1x8x16xi32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 445):5:5
// CHECK-NEXT: "top.causal_conv1d"(%x, %w, %valid)
// CHECK:      causal_conv1d x must be a float tensor, not i32

// -----
// gated_delta_rule: each key head serves a whole number of value heads
builtin.module {
  func.func @f(%q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x3x4xf32>, %g: tensor<1x8x3xf32>, %beta: tensor<1x8x3xf32>) -> tensor<1x8x3x4xf32> {
    %o, %s = "top.gated_delta_rule"(%q, %k, %v, %g, %beta) {scale = 0.5 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x3x4xf32>, tensor<1x8x3xf32>, tensor<1x8x3xf32>) -> (tensor<1x8x3x4xf32>, tensor<1x3x4x4xf32>)
    func.return %o : tensor<1x8x3x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 457):5:5
// CHECK-NEXT: "top.gated_delta_rule"(%q, %k, %v, %g, %beta)
// CHECK:      gated_delta_rule v has 3 heads, not a multiple of k's 2 heads

// -----
// gated_delta_rule: one decay per token and value head
builtin.module {
  func.func @f(%q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x4x4xf32>, %g: tensor<1x8x2xf32>, %beta: tensor<1x8x4xf32>) -> tensor<1x8x4x4xf32> {
    %o, %s = "top.gated_delta_rule"(%q, %k, %v, %g, %beta) {scale = 0.5 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x4x4xf32>, tensor<1x8x2xf32>, tensor<1x8x4xf32>) -> (tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>)
    func.return %o : tensor<1x8x4x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 469):5:5
// CHECK-NEXT: "top.gated_delta_rule"(%q, %k, %v, %g, %beta)
// CHECK:      gated_delta_rule g is [1, 8, 2]; it must be [1, 8, 4]

// -----
// gated_delta_rule: the recurrent state is f32 in every mode
builtin.module {
  func.func @f(%q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x4x4xf32>, %g: tensor<1x8x4xf32>, %beta: tensor<1x8x4xf32>, %state: tensor<1x4x4x4xbf16>) -> tensor<1x8x4x4xf32> {
    %o, %s = "top.gated_delta_rule"(%q, %k, %v, %g, %beta, %state) {scale = 0.5 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x4x4xf32>, tensor<1x8x4xf32>, tensor<1x8x4xf32>, tensor<1x4x4x4xbf16>) -> (tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>)
    func.return %o : tensor<1x8x4x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 481):5:5
// CHECK-NEXT: "top.gated_delta_rule"(%q, %k, %v, %g, %beta, %state)
// CHECK:      gated_delta_rule state must be f32 (the recurrent state is float32 in every mode), not bf16

// -----
// gated_delta_rule: the state is [1, Hv, Dk, Dv]
builtin.module {
  func.func @f(%q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x4x4xf32>, %g: tensor<1x8x4xf32>, %beta: tensor<1x8x4xf32>, %state: tensor<1x4x4x2xf32>) -> tensor<1x8x4x4xf32> {
    %o, %s = "top.gated_delta_rule"(%q, %k, %v, %g, %beta, %state) {scale = 0.5 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x4x4xf32>, tensor<1x8x4xf32>, tensor<1x8x4xf32>, tensor<1x4x4x2xf32>) -> (tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>)
    func.return %o : tensor<1x8x4x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 493):5:5
// CHECK-NEXT: "top.gated_delta_rule"(%q, %k, %v, %g, %beta, %state)
// CHECK:      gated_delta_rule state is [1, 4, 4, 2]; it must be [1, 4, 4, 4]

// -----
// gated_delta_rule: a finite scale
builtin.module {
  func.func @f(%q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x4x4xf32>, %g: tensor<1x8x4xf32>, %beta: tensor<1x8x4xf32>) -> tensor<1x8x4x4xf32> {
    %o, %s = "top.gated_delta_rule"(%q, %k, %v, %g, %beta) {scale = 0x7FF0000000000000 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x4x4xf32>, tensor<1x8x4xf32>, tensor<1x8x4xf32>) -> (tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>)
    func.return %o : tensor<1x8x4x4xf32>
  }
}
// CHECK:      verify_top.mlir (the chunk from line 505):5:5
// CHECK-NEXT: "top.gated_delta_rule"(%q, %k, %v, %g, %beta)
// CHECK:      gated_delta_rule scale is inf; it must be finite
