// RUN: rm -rf %t && mkdir -p %t
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe_checkpoint.safetensors|' %s > %t/a.mlir
// RUN: toptpu-opt %t/a.mlir -p 'expert-parallel{devices=2},convert-top-to-tpu{mode=w4f32}' --weights-out %t/w.safetensors | filecheck %s

// Expert parallelism over a pre-quantized checkpoint's experts: the checkpoint's integers,
// scales and zero points of each stacked projection are cut along E with the float
// weight (`W@shard0-2` and its `#checkpoint.*` annexes), so the lowering takes each
// device's experts' integers as they are (`tpu.a16_moe_experts` over 2 of the 4 experts,
// `:ckpt.` parts, nothing re-quantized).
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @decode(%x: tensor<1x32xf32>) -> tensor<1x32xf32> {
    %router = top.weight "router.weight" : tensor<4x32xf32>
    %gate = top.weight "experts.gate_proj" : tensor<4x32x32xf32>
    %up = top.weight "experts.up_proj" : tensor<4x32x32xf32>
    %down = top.weight "experts.down_proj" : tensor<4x32x32xf32>
    %logits = top.matmul %x, %router {transpose_b = true} : tensor<1x32xf32>, tensor<4x32xf32> -> tensor<1x4xf32>
    %w, %i = "top.moe_route"(%logits) {k = 2 : i64, normalize = true, operandSegmentSizes = array<i32: 1, 0>} : (tensor<1x4xf32>) -> (tensor<1x2xf32>, tensor<1x2xi32>)
    %y = "top.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<1x32xf32>, tensor<4x32x32xf32>, tensor<4x32x32xf32>, tensor<4x32x32xf32>, tensor<1x2xf32>, tensor<1x2xi32>) -> tensor<1x32xf32>
    func.return %y : tensor<1x32xf32>
  }
}

// CHECK-LABEL: func.func @decode
// CHECK-DAG:   %[[GQ:.*]] = tpu.weight "experts.gate_proj@shard0-2:ckpt.qweight" {source = "experts.gate_proj@shard0-2", part = "checkpoint.qweight"} : tensor<2x32x16xui8>
// CHECK-DAG:   %[[GS:.*]] = tpu.weight "experts.gate_proj@shard0-2:ckpt.scales" {source = "experts.gate_proj@shard0-2", part = "checkpoint.scales"} : tensor<2x32x1xf16>
// CHECK-DAG:   %[[GZ:.*]] = tpu.weight "experts.gate_proj@shard0-2:ckpt.zeros" {source = "experts.gate_proj@shard0-2", part = "checkpoint.zeros"} : tensor<2x32x1xui8>
// CHECK-DAG:   tpu.weight "experts.down_proj@shard0-2:ckpt.qweight" {source = "experts.down_proj@shard0-2", part = "checkpoint.qweight"} : tensor<2x32x16xui8>
// CHECK-NOT:   "experts.gate_proj:
// CHECK:       %[[Y:.*]] = tpu.a16_moe_experts %{{.*}}, gate(%[[GQ]], %[[GS]] zeros %[[GZ]]), up({{.*}}), down({{.*}}), %{{.*}}, %{{.*}} {weight_bits = array<i64: 4, 4, 4>, group_size = array<i64: 32, 32, 32>
// CHECK-NEXT:  "dev.all_reduce"(%[[Y]]) {devices = 2 : i64
