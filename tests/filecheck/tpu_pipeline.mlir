// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s > %t.mlir
// RUN: toptpu-opt %t.mlir -p 'tpu-pipeline{mode=bf16}' --weights-out %t.weights.safetensors --strip-debuginfo -o %t.pipeline
// RUN: filecheck %s --input-file %t.pipeline
// RUN: toptpu-opt %t.mlir -p 'convert-top-to-tpu{mode=bf16},canonicalize,fold-constants,cse,weight-reorder,layer-group{chip=bm1684x},lmem-verify{chip=bm1684x},address-assign' --weights-out %t.weights.safetensors --strip-debuginfo -o %t.passes
// RUN: diff %t.pipeline %t.passes
// RUN: toptpu-opt %t.mlir -p 'tpu-pipeline{mode=w4bf16 chip=none group-size=32}' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=NOCHIP

// tpu-pipeline{mode, chip} = convert-top-to-tpu, canonicalize, fold-constants, cse,
// weight-reorder, layer-group, lmem-verify, address-assign (the diff: the same text as
// those passes one by one); with chip=none it stops after weight-reorder. A norm, a no-op reshape, a linear and silu:
// lowered to bf16 storage (norm and matmul computing in f32), the reshape folded, the
// three ops in one group (8 tokens fit: one slice), every local buffer at an aligned
// address, and the regions sized: weights 64 x f32 + 32x64 x bf16 + 32 x f32 = 256 + 4096
// + 128 = 4480 B; io x 1024 + z 512 = 1536 B; no activation crosses a group.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
    %nw = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %b = "top.weight"() {name = "fc.bias"} : () -> tensor<32xf32>
    %n = "top.rms_norm"(%x, %nw) {eps = 1.0e-06 : f64} : (tensor<1x8x64xf32>, tensor<64xf32>) -> tensor<1x8x64xf32>
    %r = "top.reshape"(%n) {shape = array<i64: 1, 8, 64>} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
    %y = "top.matmul"(%r, %w, %b) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 1>} : (tensor<1x8x64xf32>, tensor<32x64xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
    %z = "top.silu"(%y) : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %z : tensor<1x8x32xf32>
  }
}

// CHECK:      func.func @main(%x: tensor<1x8x64xbf16>) -> tensor<1x8x32xbf16> attributes {tpu.regions = #tpu.regions<0 : i64, 0 : i64, 4480 : i64, 1536 : i64>}
// CHECK-DAG:    [[NW:%.*]] = tpu.weight "norm.weight" {source = "norm.weight", part = "data"} : tensor<64xf32>
// CHECK-DAG:    [[W:%.*]] = tpu.weight "fc.weight:bf16" {source = "fc.weight", part = "data"} : tensor<32x64xbf16>
// CHECK-DAG:    [[B:%.*]] = tpu.weight "fc.bias" {source = "fc.bias", part = "data"} : tensor<32xf32>
// CHECK:        [[G:%.*]] = tpu.group(%x, [[NW]], [[W]], [[B]]) {slices = 1 : i64, cost = {{[0-9]+}} : i64, gaddrs = array<i64: -1>}
// CHECK:          tpu.load {{.*}} {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: {{[0-9]+}}>} : tensor<1x8x64xbf16> ->
// CHECK:          [[N:%.*]] = tpu.rms_norm {{.*}} {eps = 1.000000e-06 : f64, compute = f32, ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK-NOT:      tpu.reshape
// CHECK-NEXT:     [[Y:%.*]] = tpu.matmul [[N]], {{.*}} bias {{.*}} {transpose_b = true, compute = f32, ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>} : tensor<1x8x64xbf16>, tensor<32x64xbf16> bias tensor<32xf32> -> tensor<1x8x32xbf16>
// CHECK-NEXT:     [[Z:%.*]] = tpu.silu [[Y]] {compute = bf16, ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK-NEXT:     [[S:%.*]] = tpu.store [[Z]] {slice_axis = -1 : i64, ts = 2 : i64} : tensor<1x8x32xbf16> -> tensor<1x8x32xbf16>
// CHECK-NEXT:     tpu.yield [[S]]
// CHECK-NEXT:   }
// CHECK-NEXT:   func.return [[G]]
// CHECK-NOT:    top.

// NOCHIP:       func.func @main(%x: tensor<1x8x64xbf16>) -> tensor<1x8x32xbf16> {
// NOCHIP:         tpu.a16_matmul {{.*}} {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32
// NOCHIP-NOT:     tpu.group
// NOCHIP-NOT:     tpu.regions

