// RUN: toptpu-opt %s -p 'layer-group{chip=bm1684x},lmem-verify{chip=bm1684x}' | filecheck %s

// A decode step's lm_head (Qwen2.5's 151936 x 896 bf16 weight, one row): split over its
// vocabulary (64 blocks of output channels) or over 28 parts of its 896 inputs (64-byte
// runs, whole DDR bursts) it costs the same to 0.1%; a split reduction must be cheaper by
// more than layer-group's REDUCTION_MARGIN, so the vocabulary split is kept (no
// accumulator, every weight block one contiguous run).
builtin.module {
  func.func @main(%x: tensor<1x896xbf16>) -> tensor<1x151936xbf16> {
    %w = "tpu.weight"() {name = "lm_head.weight", source = "lm_head.weight", part = "data"} : () -> tensor<151936x896xbf16>
    %y = "tpu.matmul"(%x, %w) {transpose_b = true, compute = bf16} : (tensor<1x896xbf16>, tensor<151936x896xbf16>) -> tensor<1x151936xbf16>
    func.return %y : tensor<1x151936xbf16>
  }
}

// CHECK:      tpu.group(%x, %w) {slices = 64 : i64, cost = {{[0-9]+}} : i64}
// CHECK-NOT:  acc =
// CHECK:        tpu.load %{{.*}} {slice_axis = -1 : i64
// CHECK:        tpu.load %{{.*}} {slice_axis = 0 : i64
// CHECK-SAME:     -> tensor<2374x896xbf16>
// CHECK:        tpu.matmul
// CHECK-NOT:  acc =
