// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p shape-infer | filecheck %s --check-prefix=SHAPE
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=bf16}' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=BF16
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=w8f16}' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=W8
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-linalg' | filecheck %s --check-prefix=LINALG
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-linalg,mlir{pipeline="canonicalize,cse"}' | filecheck %s --check-prefix=MLIR

// A sparse mixture-of-experts block (Qwen3-MoE's): the router's linear, top.moe_route (the
// softmax's top 2 of 4 experts, renormalized; `valid` marks the chunk's real rows) and
// top.moe_experts on the experts stacked by expert (gate and up [E, I, H], down [E, H, I]). Result types are left unranked for
// shape-infer to derive.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @block(%x: tensor<5x8xf32>, %valid: tensor<5xf32>) -> tensor<*xf32> {
    %router = top.weight "router.weight" : tensor<4x8xf32>
    %gate = top.weight "experts.gate_proj" : tensor<4x3x8xf32>
    %up = top.weight "experts.up_proj" : tensor<4x3x8xf32>
    %down = top.weight "experts.down_proj" : tensor<4x8x3xf32>
    %logits = top.matmul %x, %router {transpose_b = true} : tensor<5x8xf32>, tensor<4x8xf32> -> tensor<*xf32>
    %w, %i = "top.moe_route"(%logits, %valid) {k = 2 : i64, normalize = true, operandSegmentSizes = array<i32: 1, 1>} : (tensor<*xf32>, tensor<5xf32>) -> (tensor<*xf32>, tensor<*xi32>)
    %y = "top.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<5x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>, tensor<*xf32>, tensor<*xi32>) -> tensor<*xf32>
    func.return %y : tensor<*xf32>
  }
  func.func @decode(%x: tensor<1x8xf32>) -> tensor<*xi32> {
    %router = top.weight "router.weight" : tensor<4x8xf32>
    %logits = top.matmul %x, %router {transpose_b = true} : tensor<1x8xf32>, tensor<4x8xf32> -> tensor<*xf32>
    %w, %i = "top.moe_route"(%logits) {k = 3 : i64, operandSegmentSizes = array<i32: 1, 0>} : (tensor<*xf32>) -> (tensor<*xf32>, tensor<*xi32>)
    func.return %i : tensor<*xi32>
  }
}

// shape-infer: the weights [T, k] in the logits' type, the indices i32 [T, k], y like x
// SHAPE-LABEL: func.func @block
// SHAPE-SAME:    -> tensor<5x8xf32>
// SHAPE:         %w, %i = top.moe_route %logits valid %valid {k = 2 : i64, normalize = true} : tensor<5x4xf32> valid tensor<5xf32> -> tensor<5x2xf32>, tensor<5x2xi32>
// SHAPE-NEXT:    %y = top.moe_experts %x, %gate, %up, %down, %w, %i : tensor<5x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>, tensor<5x2xf32>, tensor<5x2xi32> -> tensor<5x8xf32>
// SHAPE-LABEL: func.func @decode
// SHAPE-SAME:    -> tensor<1x3xi32>
// SHAPE:         top.moe_route %logits {k = 3 : i64} : tensor<1x4xf32> -> tensor<1x3xf32>, tensor<1x3xi32>

// convert-top-to-tpu: both compute in f32; the indices stay i32; the experts' stacked
// weights take the activation type (the router is a matmul like any other)
// BF16-LABEL: func.func @block(%x: tensor<5x8xbf16>, %valid: tensor<5xbf16>) -> tensor<5x8xbf16>
// BF16:         tpu.moe_route {{.*}} {k = 2 : i64, normalize = true, compute = f32} : tensor<5x4xbf16> valid tensor<5xbf16> -> tensor<5x2xbf16>, tensor<5x2xi32>
// BF16-NEXT:    tpu.moe_experts {{.*}} {compute = f32} : tensor<5x8xbf16>, tensor<4x3x8xbf16>, tensor<4x3x8xbf16>, tensor<4x8x3xbf16>, tensor<5x2xbf16>, tensor<5x2xi32> -> tensor<5x8xbf16>
// BF16-NOT:     top.

// a weight-only mode leaves the router float (its logits choose the experts: moe_route
// is a FLOAT_PRODUCER) in the activation type; the experts' 3-D stacks are quantized
// expert by expert into tpu.a16_moe_experts (w8: i8 per channel, each projection's
// channel along its own input: H for gate and up, I for down), their weights named by
// their source and part
// W8-LABEL: func.func @block
// W8-NOT:       tpu.a16_matmul
// W8-DAG:       = tpu.weight "experts.gate_proj:q8g8s:f16.qweight" {source = "experts.gate_proj", part = "qweight"} : tensor<4x3x8xi8>
// W8-DAG:       = tpu.weight "experts.down_proj:q8g3s:f16.scales" {source = "experts.down_proj", part = "scales"} : tensor<4x8x1xf16>
// W8:           %logits = tpu.matmul %x, %router {{.*}} : tensor<5x8xf16>, tensor<4x8xf16> -> tensor<5x4xf16>
// W8-NEXT:      tpu.moe_route {{.*}} : tensor<5x4xf16> valid tensor<5xf16> -> tensor<5x2xf16>, tensor<5x2xi32>
// W8:           tpu.a16_moe_experts %x, gate(%{{.*}}, %{{.*}}), up(%{{.*}}, %{{.*}}), down(%{{.*}}, %{{.*}}), %w, %w_1 {weight_bits = array<i64: 8, 8, 8>, group_size = array<i64: 8, 8, 3>, compute = f32} : tensor<5x8xf16>, gate(tensor<4x3x8xi8>, tensor<4x3x1xf16>), up(tensor<4x3x8xi8>, tensor<4x3x1xf16>), down(tensor<4x8x3xi8>, tensor<4x8x1xf16>), tensor<5x2xf16>, tensor<5x2xi32> -> tensor<5x8xf16>
// W8-NOT:       tpu.moe_experts

// convert-top-to-linalg: the softmax over the experts (max, sum of exponentials), each
// expert's rank in its row (a reduction over a second expert loop, ties to the lower
// index), slot j picks the expert of rank j, the renormalization, the padded rows'
// index -1 and weight 0; the experts dense over each token's k slots, their weights read
// by the slot's (clamped) index, a slot of index -1 weighted 0
// LINALG-LABEL: func.func @block(
// LINALG-SAME:    %gate: tensor<4x3x8xf32> {top.weight = "experts.gate_proj", {{.*}}}, %up: tensor<4x3x8xf32> {{.*}}, %down: tensor<4x8x3xf32> {top.weight = "experts.down_proj", {{.*}}})
// LINALG-NOT:     top.moe
// LINALG:         math.exp
// LINALG:         linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]} {{.*}} outs({{.*}} : tensor<5x4xi64>)
// LINALG:           arith.cmpf ogt
// LINALG:           arith.cmpi slt
// LINALG:           arith.ori
// LINALG:         linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]} {{.*}} outs({{.*}} : tensor<5x2xi32>, tensor<5x2xf32>)
// LINALG:         arith.divf
// LINALG:         arith.constant -1 : i32
// LINALG:         linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]} {{.*}} outs({{.*}} : tensor<5x2x3xf32>)
// LINALG:           tensor.extract %gate[
// LINALG:         linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]} {{.*}} outs({{.*}} : tensor<5x2x3xf32>)
// LINALG:           tensor.extract %up[
// LINALG:         linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "parallel", "reduction"]} {{.*}} outs({{.*}} : tensor<5x2x8xf32>)
// LINALG:           tensor.extract %down[
// LINALG:         linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]} {{.*}} outs({{.*}} : tensor<5x8xf32>)
// LINALG:           arith.cmpi sge

// MLIR 22 parses the lowered module and canonicalizes it
// MLIR-LABEL: func.func @block
// MLIR:         linalg.generic
// MLIR:         tensor.extract
// MLIR-LABEL: func.func @decode
