// RUN: toptpu-opt %s -p fuse --split-input-file | filecheck %s

// pow-mean-add-rsqrt-mul, then the weight multiply -> one rms_norm with weight
builtin.module {
  func.func @rms(%x: tensor<1x8x64xf32>, %w: tensor<64xf32>) -> tensor<1x8x64xf32> {
    %0 = "top.pow"(%x) {exponent = 2.0 : f64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
    %1 = "top.reduce"(%0) {mode = "mean", axes = array<i64: 2>, keepdims = true} : (tensor<1x8x64xf32>) -> tensor<1x8x1xf32>
    %2 = "top.add_const"(%1) {value = 1.0e-06 : f64} : (tensor<1x8x1xf32>) -> tensor<1x8x1xf32>
    %3 = "top.rsqrt"(%2) : (tensor<1x8x1xf32>) -> tensor<1x8x1xf32>
    %4 = "top.mul"(%x, %3) : (tensor<1x8x64xf32>, tensor<1x8x1xf32>) -> tensor<1x8x64xf32>
    %5 = "top.mul"(%w, %4) : (tensor<64xf32>, tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
    func.return %5 : tensor<1x8x64xf32>
  }
}

// CHECK-LABEL: func.func @rms
// CHECK-NEXT:    [[N:%.*]] = top.rms_norm %x weight %w {eps = 1.000000e-06 : f64}
// CHECK-NEXT:    func.return [[N]]

// -----

// rotate-half: x*cos + cat(-x[..., 8:], x[..., :8])*sin -> rope(x, cos, sin) "half"
builtin.module {
  func.func @rope(%x: tensor<1x8x4x16xf32>, %cos: tensor<1x8x1x16xf32>, %sin: tensor<1x8x1x16xf32>) -> tensor<1x8x4x16xf32> {
    %0 = "top.mul"(%x, %cos) : (tensor<1x8x4x16xf32>, tensor<1x8x1x16xf32>) -> tensor<1x8x4x16xf32>
    %1 = "top.slice"(%x) {axis = 3 : i64, start = 0 : i64, end = 8 : i64, step = 1 : i64} : (tensor<1x8x4x16xf32>) -> tensor<1x8x4x8xf32>
    %2 = "top.slice"(%x) {axis = 3 : i64, start = 8 : i64, end = 16 : i64, step = 1 : i64} : (tensor<1x8x4x16xf32>) -> tensor<1x8x4x8xf32>
    %3 = "top.mul_const"(%2) {value = -1.0 : f64} : (tensor<1x8x4x8xf32>) -> tensor<1x8x4x8xf32>
    %4 = "top.concat"(%3, %1) {axis = 3 : i64} : (tensor<1x8x4x8xf32>, tensor<1x8x4x8xf32>) -> tensor<1x8x4x16xf32>
    %5 = "top.mul"(%4, %sin) : (tensor<1x8x4x16xf32>, tensor<1x8x1x16xf32>) -> tensor<1x8x4x16xf32>
    %6 = "top.add"(%0, %5) : (tensor<1x8x4x16xf32>, tensor<1x8x4x16xf32>) -> tensor<1x8x4x16xf32>
    func.return %6 : tensor<1x8x4x16xf32>
  }
}

// CHECK-LABEL: func.func @rope
// CHECK-NEXT:    [[R:%.*]] = top.rope %x, %cos, %sin {mode = "half"}
// CHECK-NEXT:    func.return [[R]]

// -----

// scaled_dot_product_attention as the importer leaves it: torch layout [B, H, S, D] around a
// sequence-major attention, k/v repeated to the query heads (GQA). The repeat folds into
// kv_heads and the layout permutes cancel (also through rope).
builtin.module {
  func.func @gqa(%q: tensor<1x8x4x16xf32>, %k: tensor<1x8x2x16xf32>, %v: tensor<1x8x2x16xf32>, %cos: tensor<1x1x8x16xf32>, %sin: tensor<1x1x8x16xf32>, %mask: tensor<1x1x8x8xf32>) -> tensor<1x8x4x16xf32> {
    %qt = "top.permute"(%q) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x8x4x16xf32>) -> tensor<1x4x8x16xf32>
    %qr = "top.rope"(%qt, %cos, %sin) {mode = "half"} : (tensor<1x4x8x16xf32>, tensor<1x1x8x16xf32>, tensor<1x1x8x16xf32>) -> tensor<1x4x8x16xf32>
    %kt = "top.permute"(%k) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x8x2x16xf32>) -> tensor<1x2x8x16xf32>
    %vt = "top.permute"(%v) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x8x2x16xf32>) -> tensor<1x2x8x16xf32>
    %k5 = "top.reshape"(%kt) {shape = array<i64: 1, 2, 1, 8, 16>} : (tensor<1x2x8x16xf32>) -> tensor<1x2x1x8x16xf32>
    %ke = "top.expand"(%k5) {shape = array<i64: 1, 2, 2, 8, 16>} : (tensor<1x2x1x8x16xf32>) -> tensor<1x2x2x8x16xf32>
    %kr = "top.reshape"(%ke) {shape = array<i64: 1, 4, 8, 16>} : (tensor<1x2x2x8x16xf32>) -> tensor<1x4x8x16xf32>
    %v5 = "top.reshape"(%vt) {shape = array<i64: 1, 2, 1, 8, 16>} : (tensor<1x2x8x16xf32>) -> tensor<1x2x1x8x16xf32>
    %ve = "top.expand"(%v5) {shape = array<i64: 1, 2, 2, 8, 16>} : (tensor<1x2x1x8x16xf32>) -> tensor<1x2x2x8x16xf32>
    %vr = "top.reshape"(%ve) {shape = array<i64: 1, 4, 8, 16>} : (tensor<1x2x2x8x16xf32>) -> tensor<1x4x8x16xf32>
    %aq = "top.permute"(%qr) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x4x8x16xf32>) -> tensor<1x8x4x16xf32>
    %ak = "top.permute"(%kr) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x4x8x16xf32>) -> tensor<1x8x4x16xf32>
    %av = "top.permute"(%vr) {order = array<i64: 0, 2, 1, 3>} : (tensor<1x4x8x16xf32>) -> tensor<1x8x4x16xf32>
    %a = "top.attention"(%aq, %ak, %av, %mask) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 4 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x4x16xf32>, tensor<1x8x4x16xf32>, tensor<1x8x4x16xf32>, tensor<1x1x8x8xf32>) -> tensor<1x8x4x16xf32>
    func.return %a : tensor<1x8x4x16xf32>
  }
}

// CHECK-LABEL: func.func @gqa
// CHECK-NOT:     top.permute
// CHECK-NOT:     top.expand
// CHECK:         [[C:%.*]] = top.reshape %cos {shape = array<i64: 1, 8, 1, 16>}
// CHECK:         [[S:%.*]] = top.reshape %sin {shape = array<i64: 1, 8, 1, 16>}
// CHECK:         [[R:%.*]] = top.rope %q, [[C]], [[S]] {mode = "half"}
// CHECK:         [[A:%.*]] = top.attention [[R]], %k, %v mask %mask {{{.*}}kv_heads = 2 : i64
// CHECK-NEXT:    func.return [[A]]

// -----

// attention over concat(history, new) along the sequence -> history operands; the new keys
// are never copied next to the cache (reload-free KV concatenation)
builtin.module {
  func.func @history(%q: tensor<1x1x4x16xf32>, %k: tensor<1x1x2x16xf32>, %v: tensor<1x1x2x16xf32>, %hk: tensor<1x32x2x16xf32>, %hv: tensor<1x32x2x16xf32>, %mask: tensor<1x1x1x33xf32>) -> tensor<1x1x4x16xf32> {
    %ck = "top.concat"(%hk, %k) {axis = 1 : i64} : (tensor<1x32x2x16xf32>, tensor<1x1x2x16xf32>) -> tensor<1x33x2x16xf32>
    %cv = "top.concat"(%hv, %v) {axis = 1 : i64} : (tensor<1x32x2x16xf32>, tensor<1x1x2x16xf32>) -> tensor<1x33x2x16xf32>
    %a = "top.attention"(%q, %ck, %cv, %mask) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x1x4x16xf32>, tensor<1x33x2x16xf32>, tensor<1x33x2x16xf32>, tensor<1x1x1x33xf32>) -> tensor<1x1x4x16xf32>
    func.return %a : tensor<1x1x4x16xf32>
  }
}

// CHECK-LABEL: func.func @history
// CHECK-NOT:     top.concat
// CHECK:         top.attention %q, %k, %v mask %mask history %hk, %hv {

// -----

// linear decomposed as flatten + matmul(permute(w)) + bias add + unflatten -> one matmul
builtin.module {
  func.func @linear(%x: tensor<1x8x64xf32>, %w: tensor<32x64xf32>, %b: tensor<32xf32>) -> tensor<1x8x32xf32> {
    %0 = "top.reshape"(%x) {shape = array<i64: 8, 64>} : (tensor<1x8x64xf32>) -> tensor<8x64xf32>
    %1 = "top.permute"(%w) {order = array<i64: 1, 0>} : (tensor<32x64xf32>) -> tensor<64x32xf32>
    %2 = "top.matmul"(%0, %1) {operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<8x64xf32>, tensor<64x32xf32>) -> tensor<8x32xf32>
    %3 = "top.add"(%2, %b) : (tensor<8x32xf32>, tensor<32xf32>) -> tensor<8x32xf32>
    %4 = "top.reshape"(%3) {shape = array<i64: 1, 8, 32>} : (tensor<8x32xf32>) -> tensor<1x8x32xf32>
    func.return %4 : tensor<1x8x32xf32>
  }
}

// CHECK-LABEL: func.func @linear
// CHECK-NEXT:    [[M:%.*]] = top.matmul %x, %w bias %b {transpose_b = true
// CHECK-NEXT:    func.return [[M]]
