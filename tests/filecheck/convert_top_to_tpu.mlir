// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=w4bf16 group-size=32}' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=W4
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=w8f16}' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=W8
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=bf16}' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=BF16
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | not toptpu-opt -p 'convert-top-to-tpu{mode=w4bf16 group-size=48}' 2>&1 | filecheck %s --check-prefix=BADGROUP
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | not toptpu-opt -p 'convert-top-to-tpu{mode=int3}' 2>&1 | filecheck %s --check-prefix=BADMODE

builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%ids: tensor<1x8xi32>, %pos: tensor<1x8xi64>, %mask: tensor<1x1x8x8xf32>) -> tensor<1x8x32xf32> {
    %embed = "top.weight"() {name = "embed.weight"} : () -> tensor<16x64xf32>
    %nw = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %b = "top.weight"() {name = "fc.bias"} : () -> tensor<32xf32>
    %inv = "top.weight"() {name = "inv_freq"} : () -> tensor<8xf32>
    // the position subgraph stays f32
    %p = "top.reshape"(%pos) {shape = array<i64: 1, 8, 1>} : (tensor<1x8xi64>) -> tensor<1x8x1xi64>
    %pf = "top.cast"(%p) {dtype = f32} : (tensor<1x8x1xi64>) -> tensor<1x8x1xf32>
    %ang = "top.mul"(%pf, %inv) : (tensor<1x8x1xf32>, tensor<8xf32>) -> tensor<1x8x8xf32>
    %ang2 = "top.concat"(%ang, %ang) {axis = 2 : i64} : (tensor<1x8x8xf32>, tensor<1x8x8xf32>) -> tensor<1x8x16xf32>
    %cos = "top.cos"(%ang2) : (tensor<1x8x16xf32>) -> tensor<1x8x16xf32>
    %sin = "top.sin"(%ang2) : (tensor<1x8x16xf32>) -> tensor<1x8x16xf32>
    %c4 = "top.reshape"(%cos) {shape = array<i64: 1, 8, 1, 16>} : (tensor<1x8x16xf32>) -> tensor<1x8x1x16xf32>
    %s4 = "top.reshape"(%sin) {shape = array<i64: 1, 8, 1, 16>} : (tensor<1x8x16xf32>) -> tensor<1x8x1x16xf32>
    // the embedding gather stays in the activation type
    %h = "top.gather"(%embed, %ids) {axis = 0 : i64} : (tensor<16x64xf32>, tensor<1x8xi32>) -> tensor<1x8x64xf32>
    %n = "top.rms_norm"(%h, %nw) {eps = 1.0e-06 : f64} : (tensor<1x8x64xf32>, tensor<64xf32>) -> tensor<1x8x64xf32>
    %q = "top.reshape"(%n) {shape = array<i64: 1, 8, 4, 16>} : (tensor<1x8x64xf32>) -> tensor<1x8x4x16xf32>
    %r = "top.rope"(%q, %c4, %s4) {mode = "half"} : (tensor<1x8x4x16xf32>, tensor<1x8x1x16xf32>, tensor<1x8x1x16xf32>) -> tensor<1x8x4x16xf32>
    %a = "top.attention"(%r, %r, %r, %mask) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 4 : i64, head_dim = 16 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x4x16xf32>, tensor<1x8x4x16xf32>, tensor<1x8x4x16xf32>, tensor<1x1x8x8xf32>) -> tensor<1x8x4x16xf32>
    %a2 = "top.reshape"(%a) {shape = array<i64: 1, 8, 64>} : (tensor<1x8x4x16xf32>) -> tensor<1x8x64xf32>
    %y = "top.matmul"(%a2, %w, %b) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 1>} : (tensor<1x8x64xf32>, tensor<32x64xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
    %z = "top.silu"(%y) : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %z : tensor<1x8x32xf32>
  }
}

// W4:      func.func @main(%ids: tensor<1x8xi32>, %pos: tensor<1x8xi64>, %mask: tensor<1x1x8x8xbf16>) -> tensor<1x8x32xbf16>
// W4-DAG:    tpu.weight "embed.weight:bf16" {source = "embed.weight", part = "data"} : tensor<16x64xbf16>
// W4-DAG:    tpu.weight "norm.weight" {source = "norm.weight", part = "data"} : tensor<64xf32>
// W4-DAG:    [[Q:%.*]] = tpu.weight "fc.weight:q4g32a:bf16.qweight" {source = "fc.weight", part = "qweight"} : tensor<32x32xui8>
// W4-DAG:    [[S:%.*]] = tpu.weight "fc.weight:q4g32a:bf16.scales" {source = "fc.weight", part = "scales"} : tensor<32x2xbf16>
// W4-DAG:    [[Z:%.*]] = tpu.weight "fc.weight:q4g32a:bf16.zeros" {source = "fc.weight", part = "zeros"} : tensor<32x2xui8>
// W4-DAG:    [[B:%.*]] = tpu.weight "fc.bias" {source = "fc.bias", part = "data"} : tensor<32xf32>
// W4:        tpu.cast %{{.*}} {dtype = f32, compute = f32} : tensor<1x8x1xi64> -> tensor<1x8x1xf32>
// W4:        tpu.cos %{{.*}} {compute = f32} : tensor<1x8x16xf32> -> tensor<1x8x16xf32>
// W4:        tpu.gather %{{.*}}, %ids {axis = 0 : i64, compute = bf16} : tensor<16x64xbf16>, tensor<1x8xi32> -> tensor<1x8x64xbf16>
// W4:        tpu.rms_norm {{.*}} {eps = 1.000000e-06 : f64, compute = f32} : tensor<1x8x64xbf16> weight tensor<64xf32> -> tensor<1x8x64xbf16>
// W4:        tpu.rope {{.*}} {mode = "half", compute = f32} : tensor<1x8x4x16xbf16>, tensor<1x8x1x16xf32>, tensor<1x8x1x16xf32> -> tensor<1x8x4x16xbf16>
// W4:        tpu.attention {{.*}} mask %mask {{{.*}}compute = f32{{.*}}} : {{.*}} mask tensor<1x1x8x8xbf16> -> tensor<1x8x4x16xbf16>
// W4:        tpu.a16_matmul %{{.*}}, [[Q]], [[S]] zeros [[Z]] bias [[B]] {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32
// W4:        tpu.silu %{{.*}} {compute = bf16} : tensor<1x8x32xbf16> -> tensor<1x8x32xbf16>
// W4-NOT:    top.
// W4-NOT:    tpu.cast %{{.*}} {dtype = bf16

// W8:        tpu.weight "fc.weight:q8g64s:f16.qweight" {source = "fc.weight", part = "qweight"} : tensor<32x64xi8>
// W8:        tpu.weight "fc.weight:q8g64s:f16.scales" {source = "fc.weight", part = "scales"} : tensor<32x1xf16>
// W8-NOT:    part = "zeros"
// W8:        tpu.a16_matmul {{.*}} {weight_bits = 8 : i64, group_size = 64 : i64

// BF16:      tpu.weight "fc.weight:bf16" {source = "fc.weight", part = "data"} : tensor<32x64xbf16>
// BF16:      tpu.matmul {{.*}} {transpose_b = true, compute = f32{{.*}}} : tensor<1x8x64xbf16>, tensor<32x64xbf16> bias tensor<32xf32> -> tensor<1x8x32xbf16>

// BADGROUP: group size 48 does not divide the input dimension K=64
// BADGROUP-NOT: Traceback
// BADMODE: unknown quantization mode 'int3'; choose one of f32, f16, bf16
