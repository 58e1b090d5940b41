// RUN: rm -rf %t && mkdir -p %t
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s > %t/a.mlir
// RUN: toptpu-opt %t/a.mlir -p 'tensor-parallel{devices=2}' --weights-out %t/w.safetensors | filecheck %s
// RUN: sed 's|array<i64: 1, 2>|array<i64: 1, 4>|' %t/a.mlir > %t/four.mlir
// RUN: toptpu-opt %t/four.mlir -p 'tensor-parallel{devices=4}' --weights-out %t/w4.safetensors | filecheck %s --check-prefix=FOUR
// RUN: not toptpu-opt %t/a.mlir -p 'tensor-parallel{devices=3}' --weights-out %t/w3.safetensors 2>&1 | filecheck %s --check-prefix=THREE
//
// q/k/v column parallel (cut by heads, the bias too), the attention keeps its share of
// heads, o row parallel with the all-reduce before the residual add; an output cut by heads
// says so; the whole weights the shards replace are gone:
// CHECK:      func.func @block({{.*}}-> (tensor<1x4x64xf32> {top.name = "y"}, tensor<1x4x1x8xf32> {top.name = "k", dev.split = array<i64: 2, 2>})
// CHECK-NOT:  "fc.weight"}
// CHECK:      %[[W:.*]] = top.weight "fc.weight@shard0-2" : tensor<16x64xf32>
// CHECK-NEXT: %[[B:.*]] = top.weight "fc.bias@shard0-2" : tensor<16xf32>
// CHECK-NEXT: top.matmul %h, %[[W]] bias %[[B]] {transpose_b = true} : {{.*}} -> tensor<1x4x16xf32>
// CHECK:      top.weight "embed.weight@shard0-2" : tensor<8x64xf32>
// CHECK:      top.attention {{.*}} {scale = 2.500000e-01 : f64, q_heads = 2 : i64, kv_heads = 1 : i64, head_dim = 8 : i64
// CHECK:      %o = top.matmul %a3, %[[W]] : tensor<1x4x16xf32>, tensor<16x64xf32> -> tensor<1x4x64xf32>
// CHECK-NEXT: %[[S:.*]] = "dev.all_reduce"(%o) {devices = 2 : i64, algorithm = "tree"} : (tensor<1x4x64xf32>) -> tensor<1x4x64xf32>
// CHECK-NEXT: %y = top.add %x, %[[S]]
//
// The greedy head on split logits: a local top-1 made global by the piece's offset, both
// gathered, a second top-1 picks the winning device and its id:
// CHECK:      func.func @head(%logits: tensor<1x8xf32> {top.name = "logits", dev.split = array<i64: 1, 2>})
// CHECK:      %[[OFF:.*]] = top.weight "tp.offsets.8x2@shard0-2" : tensor<1xi32>
// CHECK-NEXT: %[[LV:.*]], %[[LI:.*]] = top.topk %logits {k = 1 : i64, axis = 1 : i64, largest = true} : tensor<1x8xf32> ->
// CHECK-NEXT: %[[GI:.*]] = top.add %[[LI]], %[[OFF]]
// CHECK-NEXT: %[[AV:.*]] = "dev.all_gather"(%[[LV]]) {axis = 1 : i64, devices = 2 : i64, algorithm = "tree"} : (tensor<1x1xf32>) -> tensor<1x2xf32>
// CHECK-NEXT: %[[AI:.*]] = "dev.all_gather"(%[[GI]]) {axis = 1 : i64, devices = 2 : i64, algorithm = "tree"} : (tensor<1x1xi32>) -> tensor<1x2xi32>
// CHECK-NEXT: %v, %[[WIN:.*]] = top.topk %[[AV]]
// CHECK-NEXT: %[[T:.*]] = top.gather %[[AI]], %[[WIN]] {axis = 1 : i64}
// CHECK-NEXT: %i = top.reshape %[[T]] {shape = array<i64: 1, 1>}
//
// (the head asks for logits in 4 pieces there)
// Four devices and two KV heads: each KV head's k/v on two devices (k_proj cut in 2 pieces,
// replicated), q in 4 pieces, the cache output in 2:
// FOUR:      tensor<1x4x1x8xf32> {top.name = "k", dev.split = array<i64: 2, 2>}
// FOUR:      top.weight "fc.weight@shard0-4" : tensor<8x64xf32>
// FOUR:      top.weight "embed.weight@shard0-2" : tensor<8x64xf32>
// FOUR:      top.attention {{.*}} {{.*}} q_heads = 1 : i64, kv_heads = 1 : i64
// FOUR:      "dev.all_reduce"(%o) {devices = 4 : i64
// FOUR:      "dev.all_gather"({{.*}}) {axis = 1 : i64, devices = 4 : i64, algorithm = "tree"} : (tensor<1x1xf32>) -> tensor<1x4xf32>
//
// THREE: tensor-parallel': attention: 4 query heads do not divide among 3 devices
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @block(%x: tensor<1x4x64xf32> {top.name = "x"}, %mask: tensor<1x1x4x4xf32> {top.name = "mask"}) -> (tensor<1x4x64xf32> {top.name = "y"}, tensor<1x4x2x8xf32> {top.name = "k"}) {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %b = "top.weight"() {name = "fc.bias"} : () -> tensor<32xf32>
    %n = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %h = "top.rms_norm"(%x, %n) {eps = 1.0e-06 : f64} : (tensor<1x4x64xf32>, tensor<64xf32>) -> tensor<1x4x64xf32>
    %q = "top.matmul"(%h, %w, %b) {transpose_b = true} : (tensor<1x4x64xf32>, tensor<32x64xf32>, tensor<32xf32>) -> tensor<1x4x32xf32> loc("q_proj")
    %e = "top.weight"() {name = "embed.weight"} : () -> tensor<16x64xf32>
    %k = "top.matmul"(%h, %e) {transpose_b = true} : (tensor<1x4x64xf32>, tensor<16x64xf32>) -> tensor<1x4x16xf32> loc("k_proj")
    %v = "top.matmul"(%h, %e) {transpose_b = true} : (tensor<1x4x64xf32>, tensor<16x64xf32>) -> tensor<1x4x16xf32> loc("v_proj")
    %q4 = "top.reshape"(%q) {shape = array<i64: 1, 4, 4, 8>} : (tensor<1x4x32xf32>) -> tensor<1x4x4x8xf32>
    %k4 = "top.reshape"(%k) {shape = array<i64: 1, 4, 2, 8>} : (tensor<1x4x16xf32>) -> tensor<1x4x2x8xf32>
    %v4 = "top.reshape"(%v) {shape = array<i64: 1, 4, 2, 8>} : (tensor<1x4x16xf32>) -> tensor<1x4x2x8xf32>
    %a = "top.attention"(%q4, %k4, %v4, %mask) {scale = 0.25 : f64, q_heads = 4 : i64, kv_heads = 2 : i64, head_dim = 8 : i64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x4x4x8xf32>, tensor<1x4x2x8xf32>, tensor<1x4x2x8xf32>, tensor<1x1x4x4xf32>) -> tensor<1x4x4x8xf32> loc("attention")
    %a3 = "top.reshape"(%a) {shape = array<i64: 1, 4, 32>} : (tensor<1x4x4x8xf32>) -> tensor<1x4x32xf32>
    %o = "top.matmul"(%a3, %w) : (tensor<1x4x32xf32>, tensor<32x64xf32>) -> tensor<1x4x64xf32> loc("o_proj")
    %y = "top.add"(%x, %o) : (tensor<1x4x64xf32>, tensor<1x4x64xf32>) -> tensor<1x4x64xf32>
    func.return %y, %k4 : tensor<1x4x64xf32>, tensor<1x4x2x8xf32>
  }
  func.func @head(%logits: tensor<1x16xf32> {top.name = "logits", dev.split = array<i64: 1, 2>}) -> (tensor<1x1xi32> {top.name = "token"}) {
    %v, %i = "top.topk"(%logits) {k = 1 : i64, axis = 1 : i64, largest = true} : (tensor<1x16xf32>) -> (tensor<1x1xf32>, tensor<1x1xi32>) loc("argmax")
    func.return %i : tensor<1x1xi32>
  }
}
