// Buffers of the fetched experts that could not hold what the indices name, or that
// their reader does not know of, are refused by the verifiers (tests/filecheck/
// moe_fetched_buffers.mlir runs this file with --verify-diagnostics).
builtin.module attributes {top.weight_store = "moe.safetensors"} {
  func.func @decode(%x: tensor<1x8xf32>) -> tensor<1x8xf32> {
    %router = tpu.weight "router.weight" {source = "router.weight", part = "data"} : tensor<4x8xf32>
    %gate = tpu.weight "experts.gate_proj" {source = "experts.gate_proj", part = "data"} : tensor<4x3x8xf32>
    %up = tpu.weight "experts.up_proj" {source = "experts.up_proj", part = "data"} : tensor<4x3x8xf32>
    %down = tpu.weight "experts.down_proj" {source = "experts.down_proj", part = "data"} : tensor<4x8x3xf32>
    %y = tpu.group(%x, %router, %gate, %up, %down) {slices = 1 : i64, cost = 2601 : i64} : (tensor<1x8xf32>, tensor<4x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>) -> tensor<1x8xf32> {
    ^bb0(%x_1: tensor<1x8xf32>, %router_1: tensor<4x8xf32>, %gate_1: tensor<4x3x8xf32>, %up_1: tensor<4x3x8xf32>, %down_1: tensor<4x8x3xf32>):
      %x_2 = tpu.load %x_1 {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : tensor<1x8xf32> -> tensor<1x8xf32>
      %router_2 = tpu.load %router_1 {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 64>} : tensor<4x8xf32> -> tensor<4x8xf32>
      %gate_2 = tpu.load %gate_1 {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem = array<i64: 128>} : tensor<4x3x8xf32> -> tensor<1x3x8xf32>
      %up_2 = tpu.load %up_1 {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem = array<i64: 192>} : tensor<4x3x8xf32> -> tensor<1x3x8xf32>
      %down_2 = tpu.load %down_1 {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem = array<i64: 256>} : tensor<4x8x3xf32> -> tensor<1x8x3xf32>
      %logits = tpu.matmul %x_2, %router_2 {transpose_b = true, compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : tensor<1x8xf32>, tensor<4x8xf32> -> tensor<1x4xf32>
      %w, %w_1 = tpu.moe_route %logits {k = 2 : i64, normalize = true, compute = f32, ts = 1 : i64, lmem = array<i64: 320, 384>} : tensor<1x4xf32> -> tensor<1x2xf32>, tensor<1x2xi32>
      // expected-error @below {{tpu.moe_experts holds 1 of its 4 experts (fetched_from); its indices [1, 2] can name 2: it must hold from 2 to 3}}
      %y_1 = tpu.moe_experts %x_2, %gate_2, %up_2, %down_2, %w, %w_1 {compute = f32, ts = 1 : i64, fetched_from = 4 : i64, lmem = array<i64: 16384>} : tensor<1x8xf32>, tensor<1x3x8xf32>, tensor<1x3x8xf32>, tensor<1x8x3xf32>, tensor<1x2xf32>, tensor<1x2xi32> -> tensor<1x8xf32>
      %0 = tpu.store %y_1 {slice_axis = -1 : i64, ts = 2 : i64} : tensor<1x8xf32> -> tensor<1x8xf32>
      tpu.yield %0 : tensor<1x8xf32>
    }
    func.return %y : tensor<1x8xf32>
  }
}


// -----
builtin.module attributes {top.weight_store = "moe.safetensors"} {
  func.func @decode(%x: tensor<1x8xf32>) -> tensor<1x8xf32> {
    %router = tpu.weight "router.weight" {source = "router.weight", part = "data"} : tensor<4x8xf32>
    %gate = tpu.weight "experts.gate_proj" {source = "experts.gate_proj", part = "data"} : tensor<4x3x8xf32>
    %up = tpu.weight "experts.up_proj" {source = "experts.up_proj", part = "data"} : tensor<4x3x8xf32>
    %down = tpu.weight "experts.down_proj" {source = "experts.down_proj", part = "data"} : tensor<4x8x3xf32>
    %y = tpu.group(%x, %router, %gate, %up, %down) {slices = 1 : i64, cost = 2601 : i64} : (tensor<1x8xf32>, tensor<4x8xf32>, tensor<4x3x8xf32>, tensor<4x3x8xf32>, tensor<4x8x3xf32>) -> tensor<1x8xf32> {
    ^bb0(%x_1: tensor<1x8xf32>, %router_1: tensor<4x8xf32>, %gate_1: tensor<4x3x8xf32>, %up_1: tensor<4x3x8xf32>, %down_1: tensor<4x8x3xf32>):
      %x_2 = tpu.load %x_1 {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : tensor<1x8xf32> -> tensor<1x8xf32>
      %router_2 = tpu.load %router_1 {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 64>} : tensor<4x8xf32> -> tensor<4x8xf32>
      // expected-error @below {{tpu.load by_index holds 2 of 4 rows; its consumer tpu.moe_experts reads them as every row}}
      %gate_2 = tpu.load %gate_1 {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem = array<i64: 128>} : tensor<4x3x8xf32> -> tensor<2x3x8xf32>
      %up_2 = tpu.load %up_1 {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem = array<i64: 192>} : tensor<4x3x8xf32> -> tensor<2x3x8xf32>
      %down_2 = tpu.load %down_1 {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem = array<i64: 256>} : tensor<4x8x3xf32> -> tensor<2x8x3xf32>
      %logits = tpu.matmul %x_2, %router_2 {transpose_b = true, compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : tensor<1x8xf32>, tensor<4x8xf32> -> tensor<1x4xf32>
      %w, %w_1 = tpu.moe_route %logits {k = 2 : i64, normalize = true, compute = f32, ts = 1 : i64, lmem = array<i64: 320, 384>} : tensor<1x4xf32> -> tensor<1x2xf32>, tensor<1x2xi32>
      %y_1 = tpu.moe_experts %x_2, %gate_2, %up_2, %down_2, %w, %w_1 {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : tensor<1x8xf32>, tensor<2x3x8xf32>, tensor<2x3x8xf32>, tensor<2x8x3xf32>, tensor<1x2xf32>, tensor<1x2xi32> -> tensor<1x8xf32>
      %0 = tpu.store %y_1 {slice_axis = -1 : i64, ts = 2 : i64} : tensor<1x8xf32> -> tensor<1x8xf32>
      tpu.yield %0 : tensor<1x8xf32>
    }
    func.return %y : tensor<1x8xf32>
  }
}

