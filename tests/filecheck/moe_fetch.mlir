// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=f32},layer-group{chip=bm1684x},address-assign' --weights-out %t.weights.safetensors | filecheck %s
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=f32},layer-group{chip=bm1684x},address-assign' -t 'commands{chip=bm1684x}' | filecheck %s --check-prefix=CMD
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=w8bf16 group-size=-1 symmetric=false},layer-group{chip=bm1684x},address-assign' --weights-out %t.q.weights.safetensors | filecheck %s --check-prefix=Q
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=w8bf16 group-size=-1 symmetric=false},layer-group{chip=bm1684x},address-assign' --weights-out %t.q.weights.safetensors -t 'commands{chip=bm1684x}' | filecheck %s --check-prefix=QCMD

// The experts are fetched by index: layer-group makes the loads of the experts' stacked
// weights (the operands moe_experts reads only at its indices) indexed loads (`by_index`),
// and codegen emits each as a load by the indices' local buffer, after the router has
// computed them (one token: its k experts' rows move, not all E). Quantized experts
// (`tpu.a16_moe_experts`, here w8bf16 asymmetric) likewise: every stacked tensor of gate,
// up and down — the integers, the scales and the zero points — is loaded by the indices.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @decode(%x: tensor<1x8xf32>) -> tensor<*xf32> {
    %router = top.weight "router.weight" : tensor<4x8xf32>
    %gate = top.weight "experts.gate_proj" : tensor<4x3x8xf32>
    %up = top.weight "experts.up_proj" : tensor<4x3x8xf32>
    %down = top.weight "experts.down_proj" : tensor<4x8x3xf32>
    %logits = top.matmul %x, %router {transpose_b = true} : tensor<1x8xf32>, tensor<4x8xf32> -> tensor<*xf32>
    %w, %i = "top.moe_route"(%logits) {k = 2 : i64, normalize = true, operandSegmentSizes = array<i32: 1, 0>} : (tensor<*xf32>) -> (tensor<*xf32>, tensor<*xi32>)
    %y = "top.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<1x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>, tensor<*xf32>, tensor<*xi32>) -> tensor<*xf32>
    func.return %y : tensor<*xf32>
  }
}

// CHECK-LABEL: func.func @decode
// CHECK:     tpu.load %router{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, lmem
// CHECK:     tpu.load %gate{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem
// CHECK:     tpu.load %up{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem
// CHECK:     tpu.load %down{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem
// CHECK:     tpu.moe_route
// CHECK:     tpu.moe_experts

// CMD:      cmp moe_route {{.*}} -> L{{[0-9]+}}#{{[0-9]+}},L[[I:[0-9]+#[0-9]+]] g0.s0
// CMD-NEXT: dma load     w:experts.gate_proj 4x3x8xfloat32 [all] by L[[I]] ->
// CMD-NEXT: dma load     w:experts.up_proj 4x3x8xfloat32 [all] by L[[I]] ->
// CMD-NEXT: dma load     w:experts.down_proj 4x8x3xfloat32 [all] by L[[I]] ->
// CMD-NEXT: cmp moe_experts

// Q-LABEL: func.func @decode
// Q:     tpu.load %router{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, lmem
// Q-COUNT-9: tpu.load %{{[0-9]+}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem
// Q-NOT: tpu.load
// Q:     tpu.moe_route
// Q:     tpu.a16_moe_experts %x_{{[0-9]+}}, gate(%{{[0-9]+}}, %{{[0-9]+}} zeros %{{[0-9]+}}), up(%{{[0-9]+}}, %{{[0-9]+}} zeros %{{[0-9]+}}), down(%{{[0-9]+}}, %{{[0-9]+}} zeros %{{[0-9]+}})

// QCMD:      cmp moe_route {{.*}} -> L{{[0-9]+}}#{{[0-9]+}},L[[I:[0-9]+#[0-9]+]] g0.s0
// QCMD-NEXT: dma load     w:experts.gate_proj:q8g8a:bf16.qweight 4x3x8xuint8 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.gate_proj:q8g8a:bf16.scales 4x3x1xbfloat16 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.gate_proj:q8g8a:bf16.zeros 4x3x1xuint8 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.up_proj:q8g8a:bf16.qweight 4x3x8xuint8 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.up_proj:q8g8a:bf16.scales 4x3x1xbfloat16 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.up_proj:q8g8a:bf16.zeros 4x3x1xuint8 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.down_proj:q8g3a:bf16.qweight 4x8x3xuint8 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.down_proj:q8g3a:bf16.scales 4x8x1xbfloat16 [all] by L[[I]] ->
// QCMD-NEXT: dma load     w:experts.down_proj:q8g3a:bf16.zeros 4x8x1xuint8 [all] by L[[I]] ->
// QCMD-NEXT: cmp a16_moe_experts
