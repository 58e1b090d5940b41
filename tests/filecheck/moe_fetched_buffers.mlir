// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=f32},layer-group{chip=bm1684x},address-assign' --weights-out %t.weights.safetensors | filecheck %s
// RUN: sed 's|@WEIGHTS@|%S/Inputs/moe.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=w8bf16 group-size=-1 symmetric=false},layer-group{chip=bm1684x},address-assign' --weights-out %t.q.weights.safetensors | filecheck %s --check-prefix=Q
// RUN: toptpu-opt %S/Inputs/moe_fetched_buffers_bad.mlir --split-input-file --verify-diagnostics | filecheck %s --check-prefix=BAD

// The experts' local buffers hold the experts a step fetches, not all E: layer-group sizes
// each indexed load (`by_index`) of the experts' stacked weights for the distinct experts
// its slice's indices [T, k] can name, min(E, T x k) rows, and the experts op reads them
// as `fetched_from` E (the named experts in ascending order in the first rows). One
// token (decode, top-2 of 4): 2 rows. A prefill chunk of 2 tokens can name all 4: the
// buffers hold every expert at its place (no `fetched_from`). Quantized experts: every
// stacked tensor (integers, scales, zero points) likewise.
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
  func.func @prefill(%x: tensor<2x8xf32>) -> tensor<*xf32> {
    %router = top.weight "router.weight" : tensor<4x8xf32>
    %gate = top.weight "experts.gate_proj" : tensor<4x3x8xf32>
    %up = top.weight "experts.up_proj" : tensor<4x3x8xf32>
    %down = top.weight "experts.down_proj" : tensor<4x8x3xf32>
    %logits = top.matmul %x, %router {transpose_b = true} : tensor<2x8xf32>, tensor<4x8xf32> -> tensor<*xf32>
    %w, %i = "top.moe_route"(%logits) {k = 2 : i64, normalize = true, operandSegmentSizes = array<i32: 1, 0>} : (tensor<*xf32>) -> (tensor<*xf32>, tensor<*xi32>)
    %y = "top.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<2x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>, tensor<*xf32>, tensor<*xi32>) -> tensor<*xf32>
    func.return %y : tensor<*xf32>
  }
}

// CHECK-LABEL: func.func @decode
// CHECK:     tpu.load %gate{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem{{.*}} : tensor<4x3x8xf32> -> tensor<2x3x8xf32>
// CHECK:     tpu.load %up{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem{{.*}} : tensor<4x3x8xf32> -> tensor<2x3x8xf32>
// CHECK:     tpu.load %down{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem{{.*}} : tensor<4x8x3xf32> -> tensor<2x8x3xf32>
// CHECK:     tpu.moe_experts {{.*}} fetched_from = 4 : i64{{.*}} : tensor<1x8xf32>, tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<2x8x3xf32>, tensor<1x2xf32>, tensor<1x2xi32> -> tensor<1x8xf32>
// CHECK-LABEL: func.func @prefill
// CHECK:     tpu.load %gate{{[_0-9]*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem{{.*}} : tensor<4x3x8xf32> -> tensor<4x3x8xf32>
// CHECK-NOT: fetched_from
// CHECK:     tpu.moe_experts {{.*}} : tensor<2x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>

// Q-LABEL: func.func @decode
// Q-COUNT-9: tpu.load %{{[0-9]+}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem{{.*}} : tensor<4x{{[0-9]+}}x{{[0-9]+}}x{{[a-z0-9]+}}> -> tensor<2x
// Q:     tpu.a16_moe_experts {{.*}}fetched_from = 4 : i64
// Q-LABEL: func.func @prefill
// Q-NOT: fetched_from

// BAD-NOT: error
