// RUN: rm -rf %t && mkdir -p %t
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s > %t/a.mlir
// RUN: toptpu-opt %t/a.mlir -p 'expert-parallel{devices=2}' --weights-out %t/w.safetensors | filecheck %s
// RUN: toptpu-opt %t/a.mlir -p 'expert-parallel{devices=4}' --weights-out %t/w4.safetensors | filecheck %s --check-prefix=FOUR
// RUN: not toptpu-opt %t/a.mlir -p 'expert-parallel{devices=3}' --weights-out %t/w3.safetensors 2>&1 | filecheck %s --check-prefix=THREE

// Expert parallelism: the router and everything else stay whole; the experts op reads
// its E/N experts (the stacked weights cut along axis 0), its indices made local (minus
// the device's first expert, a one-element shard weight; an index of another device's
// expert, or a padded row's -1, made -1), and an all-reduce sums the devices' shares.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @decode(%x: tensor<1x8xf32>) -> tensor<1x8xf32> {
    %router = top.weight "router.weight" : tensor<4x8xf32>
    %gate = top.weight "experts.gate_proj" : tensor<4x3x8xf32>
    %up = top.weight "experts.up_proj" : tensor<4x3x8xf32>
    %down = top.weight "experts.down_proj" : tensor<4x8x3xf32>
    %logits = top.matmul %x, %router {transpose_b = true} : tensor<1x8xf32>, tensor<4x8xf32> -> tensor<1x4xf32>
    %w, %i = "top.moe_route"(%logits) {k = 2 : i64, normalize = true, operandSegmentSizes = array<i32: 1, 0>} : (tensor<1x4xf32>) -> (tensor<1x2xf32>, tensor<1x2xi32>)
    %y = "top.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<1x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>, tensor<1x2xf32>, tensor<1x2xi32>) -> tensor<1x8xf32>
    %out = top.add %x, %y : tensor<1x8xf32>, tensor<1x8xf32> -> tensor<1x8xf32>
    func.return %out : tensor<1x8xf32>
  }
}

// CHECK-LABEL: func.func @decode(%x: tensor<1x8xf32>) -> tensor<1x8xf32>
// CHECK-NOT:   dev.split
// CHECK:       top.weight "router.weight" : tensor<4x8xf32>
// CHECK-NOT:   "experts.gate_proj"
// CHECK:       %logits = top.matmul %x, %router {transpose_b = true} : tensor<1x8xf32>, tensor<4x8xf32> -> tensor<1x4xf32>
// CHECK-NEXT:  %w, %i = top.moe_route %logits {k = 2 : i64, normalize = true}
// CHECK-NEXT:  %[[G:.*]] = top.weight "experts.gate_proj@shard0-2" : tensor<2x3x8xf32>
// CHECK-NEXT:  %[[U:.*]] = top.weight "experts.up_proj@shard0-2" : tensor<2x3x8xf32>
// CHECK-NEXT:  %[[D:.*]] = top.weight "experts.down_proj@shard0-2" : tensor<2x8x3xf32>
// CHECK-NEXT:  %[[F:.*]] = top.weight "tp.offsets.2x2@shard0-2" : tensor<1xi32>
// CHECK-NEXT:  %[[PER:.*]] = "top.constant"() {value = dense<2> : tensor<1xi32>}
// CHECK-NEXT:  %[[NO:.*]] = "top.constant"() {value = dense<-1> : tensor<1xi32>}
// CHECK-NEXT:  %[[REL:.*]] = top.sub %i, %[[F]] : tensor<1x2xi32>, tensor<1xi32> -> tensor<1x2xi32>
// CHECK-NEXT:  %[[HELD:.*]] = top.compare %[[REL]], %[[PER]] {predicate = "lt"}
// CHECK-NEXT:  %[[K:.*]] = top.where %[[HELD]], %[[REL]], %[[NO]]
// CHECK-NEXT:  %[[L:.*]] = top.clamp %[[K]] {min = -1.000000e+00 : f64} : tensor<1x2xi32> -> tensor<1x2xi32>
// CHECK-NEXT:  %[[Y:.*]] = top.moe_experts %x, %[[G]], %[[U]], %[[D]], %w, %[[L]] : {{.*}} -> tensor<1x8xf32>
// CHECK-NEXT:  %[[S:.*]] = "dev.all_reduce"(%[[Y]]) {devices = 2 : i64, algorithm = "tree"} : (tensor<1x8xf32>) -> tensor<1x8xf32>
// CHECK-NEXT:  %out = top.add %x, %[[S]]

// A token's 2 experts over 4 devices of one expert each: the local op takes k = 2 over
// its one expert (a slot naming another device's expert is -1 there)
// FOUR:        top.weight "experts.gate_proj@shard0-4" : tensor<1x3x8xf32>
// FOUR:        %[[PER:.*]] = "top.constant"() {value = dense<1> : tensor<1xi32>}
// FOUR:        top.moe_experts {{.*}} : tensor<1x8xf32>, tensor<1x3x8xf32>, tensor<1x3x8xf32>, tensor<1x8x3xf32>, tensor<1x2xf32>, tensor<1x2xi32> -> tensor<1x8xf32>
// FOUR-NEXT:   "dev.all_reduce"({{.*}}) {devices = 4 : i64

// THREE:       4 experts do not divide among 3 devices
