// RUN: toptpu-opt %s -p 'layer-group{chip=bm1684x},lmem-verify{chip=bm1684x}' | filecheck %s
// RUN: toptpu-opt %S/Inputs/moe_expert_blocks_bad.mlir --split-input-file --verify-diagnostics | filecheck %s --check-prefix=BAD

// A prefill chunk's experts in blocks of experts (the expert-major schedule): 128 rows of
// top-2 over 16 f32 experts of 512 x 1024 (6 MB an expert, 96 MB a layer: not in
// bm1684x's 16 MB). The layer group's reduction parts are blocks of consecutive experts
// (`expert_blocks`; `tiles` R, C, blocks): gate, up and down are indexed loads of one
// block's chosen experts (`tile_axes` -1, -1, 0), every row of the chunk in one row
// block, so each chosen expert is loaded once, the blocks folded into one accumulator in
// ascending order. @large: experts of 4096 x 1024 (48 MB each) do not fit one at a time:
// each block in parts of I (`tiles` R, C, blocks, parts of I; `tile_axes` -1, -1, 0 and
// I's axis). A decode step (one token) keeps the buffers of its k experts, no blocks.
// Planning reads shapes only.
builtin.module {
  func.func @prefill(%x: tensor<128x1024xf32>, %w: tensor<128x2xf32>, %i: tensor<128x2xi32>) -> tensor<128x1024xf32> {
    %gate = "tpu.weight"() {name = "experts.gate_proj", source = "experts.gate_proj", part = "data"} : () -> tensor<16x512x1024xf32>
    %up = "tpu.weight"() {name = "experts.up_proj", source = "experts.up_proj", part = "data"} : () -> tensor<16x512x1024xf32>
    %down = "tpu.weight"() {name = "experts.down_proj", source = "experts.down_proj", part = "data"} : () -> tensor<16x1024x512xf32>
    %y = "tpu.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<128x1024xf32>, tensor<16x512x1024xf32>, tensor<16x512x1024xf32>, tensor<16x1024x512xf32>, tensor<128x2xf32>, tensor<128x2xi32>) -> tensor<128x1024xf32>
    func.return %y : tensor<128x1024xf32>
  }
  func.func @large(%x: tensor<128x1024xf32>, %w: tensor<128x2xf32>, %i: tensor<128x2xi32>) -> tensor<128x1024xf32> {
    %gate = "tpu.weight"() {name = "big.gate_proj", source = "big.gate_proj", part = "data"} : () -> tensor<8x4096x1024xf32>
    %up = "tpu.weight"() {name = "big.up_proj", source = "big.up_proj", part = "data"} : () -> tensor<8x4096x1024xf32>
    %down = "tpu.weight"() {name = "big.down_proj", source = "big.down_proj", part = "data"} : () -> tensor<8x1024x4096xf32>
    %y = "tpu.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<128x1024xf32>, tensor<8x4096x1024xf32>, tensor<8x4096x1024xf32>, tensor<8x1024x4096xf32>, tensor<128x2xf32>, tensor<128x2xi32>) -> tensor<128x1024xf32>
    func.return %y : tensor<128x1024xf32>
  }
  func.func @decode(%x: tensor<1x1024xf32>, %w: tensor<1x2xf32>, %i: tensor<1x2xi32>) -> tensor<1x1024xf32> {
    %gate = "tpu.weight"() {name = "experts.gate_proj", source = "experts.gate_proj", part = "data"} : () -> tensor<16x512x1024xf32>
    %up = "tpu.weight"() {name = "experts.up_proj", source = "experts.up_proj", part = "data"} : () -> tensor<16x512x1024xf32>
    %down = "tpu.weight"() {name = "experts.down_proj", source = "experts.down_proj", part = "data"} : () -> tensor<16x1024x512xf32>
    %y = "tpu.moe_experts"(%x, %gate, %up, %down, %w, %i) : (tensor<1x1024xf32>, tensor<16x512x1024xf32>, tensor<16x512x1024xf32>, tensor<16x1024x512xf32>, tensor<1x2xf32>, tensor<1x2xi32>) -> tensor<1x1024xf32>
    func.return %y : tensor<1x1024xf32>
  }
}

// CHECK-LABEL: func.func @prefill
// CHECK:       tpu.group(%x, %gate, %up, %down, %w, %i) {slices = 16 : i64, cost = {{[0-9]+}} : i64, tiles = array<i64: 1, 1, 16>, tile_outer = {{[01]}} : i64, acc = {{[0-9]+}} : i64}
// CHECK:         tpu.load %gate{{.*}} {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, -1, 0>, by_index, lmem{{.*}} : tensor<16x512x1024xf32> -> tensor<1x512x1024xf32>
// CHECK:         tpu.load %up{{.*}} tile_axes = array<i64: -1, -1, 0>, by_index
// CHECK:         tpu.load %down{{.*}} tile_axes = array<i64: -1, -1, 0>, by_index, lmem{{.*}} : tensor<16x1024x512xf32> -> tensor<1x1024x512xf32>
// CHECK:         tpu.moe_experts {{.*}}fetched_from = 16 : i64, expert_blocks = 16 : i64
// CHECK:         tpu.store
// CHECK-LABEL: func.func @large
// CHECK:       tiles = array<i64: 1, 1, 8, {{[0-9]+}}>
// CHECK:         tpu.load %gate{{.*}} tile_axes = array<i64: -1, -1, 0, 1>, by_index, lmem{{.*}} -> tensor<1x{{[0-9]+}}x1024xf32>
// CHECK:         tpu.load %up{{.*}} tile_axes = array<i64: -1, -1, 0, 1>, by_index
// CHECK:         tpu.load %down{{.*}} tile_axes = array<i64: -1, -1, 0, 2>, by_index, lmem{{.*}} -> tensor<1x1024x{{[0-9]+}}xf32>
// CHECK:         tpu.moe_experts {{.*}}fetched_from = 8 : i64, expert_blocks = 8 : i64
// CHECK-LABEL: func.func @decode
// CHECK-NOT:   expert_blocks
// CHECK:         tpu.load %gate{{.*}} {slice_axis = -1 : i64, ts = 0 : i64, by_index, lmem{{.*}} -> tensor<2x512x1024xf32>
// CHECK:         tpu.moe_experts {{.*}}fetched_from = 16 : i64
// CHECK-NOT:   expert_blocks

// BAD-NOT: error
