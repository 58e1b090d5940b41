// Blocks of experts that their reader does not know of, or that do not cut the experts
// in equal blocks, or hold more rows than a block, are refused by the verifiers
// (tests/filecheck/moe_expert_blocks.mlir runs this file with --verify-diagnostics).
builtin.module {
  func.func @prefill(%x: tensor<128x1024xf32>, %w: tensor<128x2xf32>, %i: tensor<128x2xi32>) -> tensor<128x1024xf32> {
    %gate = tpu.weight "experts.gate_proj" {source = "experts.gate_proj", part = "data"} : tensor<16x512x1024xf32>
    %up = tpu.weight "experts.up_proj" {source = "experts.up_proj", part = "data"} : tensor<16x512x1024xf32>
    %down = tpu.weight "experts.down_proj" {source = "experts.down_proj", part = "data"} : tensor<16x1024x512xf32>
    // expected-error @below {{tpu.group with four tiles counts computes one experts op in blocks of experts (expert_blocks)}}
    %y = tpu.group(%x, %gate, %up, %down, %w, %i) {slices = 32 : i64, cost = 2199189 : i64, tiles = array<i64: 1, 1, 16, 2>, tile_outer = 0 : i64, acc = 114688 : i64} : (tensor<128x1024xf32>, tensor<16x512x1024xf32>, tensor<16x512x1024xf32>, tensor<16x1024x512xf32>, tensor<128x2xf32>, tensor<128x2xi32>) -> tensor<128x1024xf32> {
    ^bb0(%x_1: tensor<128x1024xf32>, %gate_1: tensor<16x512x1024xf32>, %up_1: tensor<16x512x1024xf32>, %down_1: tensor<16x1024x512xf32>, %w_1: tensor<128x2xf32>, %i_1: tensor<128x2xi32>):
      %x_2 = tpu.load %x_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 98304, 0>} : tensor<128x1024xf32> -> tensor<128x1024xf32>
      %gate_2 = tpu.load %gate_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem = array<i64: 0, 16384>} : tensor<16x512x1024xf32> -> tensor<1x256x1024xf32>
      %up_2 = tpu.load %up_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem = array<i64: 32768, 49152>} : tensor<16x512x1024xf32> -> tensor<1x256x1024xf32>
      %down_2 = tpu.load %down_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 2>, by_index, lmem = array<i64: 65536, 81920>} : tensor<16x1024x512xf32> -> tensor<1x1024x256xf32>
      %w_2 = tpu.load %w_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 106496, 0>} : tensor<128x2xf32> -> tensor<128x2xf32>
      %i_2 = tpu.load %i_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 106560, 0>} : tensor<128x2xi32> -> tensor<128x2xi32>
      %y_1 = tpu.moe_experts %x_2, %gate_2, %up_2, %down_2, %w_2, %i_2 {ts = 1 : i64, fetched_from = 16 : i64, lmem = array<i64: 131072, 32768>} : tensor<128x1024xf32>, tensor<1x256x1024xf32>, tensor<1x256x1024xf32>, tensor<1x1024x256xf32>, tensor<128x2xf32>, tensor<128x2xi32> -> tensor<128x1024xf32>
      %0 = tpu.store %y_1 {slice_axis = 1 : i64, tile_axes = array<i64: 0, 1, -1, -1>, ts = 2 : i64} : tensor<128x1024xf32> -> tensor<128x1024xf32>
      tpu.yield %0 : tensor<128x1024xf32>
    }
    func.return %y : tensor<128x1024xf32>
  }
}


// -----
builtin.module {
  func.func @prefill(%x: tensor<128x1024xf32>, %w: tensor<128x2xf32>, %i: tensor<128x2xi32>) -> tensor<128x1024xf32> {
    %gate = tpu.weight "experts.gate_proj" {source = "experts.gate_proj", part = "data"} : tensor<16x512x1024xf32>
    %up = tpu.weight "experts.up_proj" {source = "experts.up_proj", part = "data"} : tensor<16x512x1024xf32>
    %down = tpu.weight "experts.down_proj" {source = "experts.down_proj", part = "data"} : tensor<16x1024x512xf32>
    %y = tpu.group(%x, %gate, %up, %down, %w, %i) {slices = 32 : i64, cost = 2199189 : i64, tiles = array<i64: 1, 1, 16, 2>, tile_outer = 0 : i64, acc = 114688 : i64} : (tensor<128x1024xf32>, tensor<16x512x1024xf32>, tensor<16x512x1024xf32>, tensor<16x1024x512xf32>, tensor<128x2xf32>, tensor<128x2xi32>) -> tensor<128x1024xf32> {
    ^bb0(%x_1: tensor<128x1024xf32>, %gate_1: tensor<16x512x1024xf32>, %up_1: tensor<16x512x1024xf32>, %down_1: tensor<16x1024x512xf32>, %w_1: tensor<128x2xf32>, %i_1: tensor<128x2xi32>):
      %x_2 = tpu.load %x_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 98304, 0>} : tensor<128x1024xf32> -> tensor<128x1024xf32>
      %gate_2 = tpu.load %gate_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem = array<i64: 0, 16384>} : tensor<16x512x1024xf32> -> tensor<1x256x1024xf32>
      %up_2 = tpu.load %up_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem = array<i64: 32768, 49152>} : tensor<16x512x1024xf32> -> tensor<1x256x1024xf32>
      %down_2 = tpu.load %down_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 2>, by_index, lmem = array<i64: 65536, 81920>} : tensor<16x1024x512xf32> -> tensor<1x1024x256xf32>
      %w_2 = tpu.load %w_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 106496, 0>} : tensor<128x2xf32> -> tensor<128x2xf32>
      %i_2 = tpu.load %i_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 106560, 0>} : tensor<128x2xi32> -> tensor<128x2xi32>
      // expected-error @below {{tpu.moe_experts expert_blocks 3 must divide its experts (fetched_from) in blocks, at least 2}}
      %y_1 = tpu.moe_experts %x_2, %gate_2, %up_2, %down_2, %w_2, %i_2 {ts = 1 : i64, fetched_from = 16 : i64, expert_blocks = 3 : i64, lmem = array<i64: 131072, 32768>} : tensor<128x1024xf32>, tensor<1x256x1024xf32>, tensor<1x256x1024xf32>, tensor<1x1024x256xf32>, tensor<128x2xf32>, tensor<128x2xi32> -> tensor<128x1024xf32>
      %0 = tpu.store %y_1 {slice_axis = 1 : i64, tile_axes = array<i64: 0, 1, -1, -1>, ts = 2 : i64} : tensor<128x1024xf32> -> tensor<128x1024xf32>
      tpu.yield %0 : tensor<128x1024xf32>
    }
    func.return %y : tensor<128x1024xf32>
  }
}


// -----
builtin.module {
  func.func @prefill(%x: tensor<128x1024xf32>, %w: tensor<128x2xf32>, %i: tensor<128x2xi32>) -> tensor<128x1024xf32> {
    %gate = tpu.weight "experts.gate_proj" {source = "experts.gate_proj", part = "data"} : tensor<16x512x1024xf32>
    %up = tpu.weight "experts.up_proj" {source = "experts.up_proj", part = "data"} : tensor<16x512x1024xf32>
    %down = tpu.weight "experts.down_proj" {source = "experts.down_proj", part = "data"} : tensor<16x1024x512xf32>
    %y = tpu.group(%x, %gate, %up, %down, %w, %i) {slices = 32 : i64, cost = 2199189 : i64, tiles = array<i64: 1, 1, 16, 2>, tile_outer = 0 : i64, acc = 114688 : i64} : (tensor<128x1024xf32>, tensor<16x512x1024xf32>, tensor<16x512x1024xf32>, tensor<16x1024x512xf32>, tensor<128x2xf32>, tensor<128x2xi32>) -> tensor<128x1024xf32> {
    ^bb0(%x_1: tensor<128x1024xf32>, %gate_1: tensor<16x512x1024xf32>, %up_1: tensor<16x512x1024xf32>, %down_1: tensor<16x1024x512xf32>, %w_1: tensor<128x2xf32>, %i_1: tensor<128x2xi32>):
      %x_2 = tpu.load %x_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 98304, 0>} : tensor<128x1024xf32> -> tensor<128x1024xf32>
      %gate_2 = tpu.load %gate_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem = array<i64: 0, 16384>} : tensor<16x512x1024xf32> -> tensor<2x256x1024xf32>
      %up_2 = tpu.load %up_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem = array<i64: 32768, 49152>} : tensor<16x512x1024xf32> -> tensor<2x256x1024xf32>
      %down_2 = tpu.load %down_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0, 2>, by_index, lmem = array<i64: 65536, 81920>} : tensor<16x1024x512xf32> -> tensor<2x1024x256xf32>
      %w_2 = tpu.load %w_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 106496, 0>} : tensor<128x2xf32> -> tensor<128x2xf32>
      %i_2 = tpu.load %i_1 {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: 0, -1, -1, -1>, lmem = array<i64: 106560, 0>} : tensor<128x2xi32> -> tensor<128x2xi32>
      // expected-error @below {{tpu.moe_experts holds 2 rows of a block of 1 experts (expert_blocks 16); its indices [128, 2] can name 1: it must hold from 1 to 1}}
      %y_1 = tpu.moe_experts %x_2, %gate_2, %up_2, %down_2, %w_2, %i_2 {ts = 1 : i64, fetched_from = 16 : i64, expert_blocks = 16 : i64, lmem = array<i64: 131072, 32768>} : tensor<128x1024xf32>, tensor<2x256x1024xf32>, tensor<2x256x1024xf32>, tensor<2x1024x256xf32>, tensor<128x2xf32>, tensor<128x2xi32> -> tensor<128x1024xf32>
      %0 = tpu.store %y_1 {slice_axis = 1 : i64, tile_axes = array<i64: 0, 1, -1, -1>, ts = 2 : i64} : tensor<128x1024xf32> -> tensor<128x1024xf32>
      tpu.yield %0 : tensor<128x1024xf32>
    }
    func.return %y : tensor<128x1024xf32>
  }
}

