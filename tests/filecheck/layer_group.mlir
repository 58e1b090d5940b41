// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=w4bf16 group-size=32},layer-group{chip=bm1684x},lmem-verify,address-assign' --weights-out %t.weights.safetensors | filecheck %s
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s | toptpu-opt -p 'convert-top-to-tpu{mode=bf16},layer-group{chip=bm1684x max-ops=1},address-assign' --weights-out %t.weights.safetensors | filecheck %s --check-prefix=SINGLE
// RUN: not toptpu-opt %S/Inputs/too_big.mlir -p 'layer-group{chip=bm1684x}' 2>&1 | filecheck %s --check-prefix=TOOBIG

// norm -> matmul -> silu over 8 tokens: one group (they fit), loads / compute / stores with
// local addresses and pipeline stages; address-assign sizes the regions.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
    %nw = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %n = "top.rms_norm"(%x, %nw) {eps = 1.0e-06 : f64} : (tensor<1x8x64xf32>, tensor<64xf32>) -> tensor<1x8x64xf32>
    %y = "top.matmul"(%n, %w) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32>
    %z = "top.silu"(%y) : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %z : tensor<1x8x32xf32>
  }
}

// CHECK:      func.func @main(%x: tensor<1x8x64xbf16>) -> tensor<1x8x32xbf16> attributes {tpu.regions = #tpu.regions<0 : i64, 0 : i64, {{[0-9]+}} : i64, {{[0-9]+}} : i64>}
// CHECK:        [[G:%.*]] = tpu.group(%x, {{.*}}) {slices = 1 : i64, cost = {{[0-9]+}} : i64, gaddrs = array<i64: -1>}
// CHECK-NEXT:   ^{{.*}}(%{{.*}}: tensor<1x8x64xbf16>{{.*}}):
// CHECK:          tpu.load %{{.*}} {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK:          tpu.rms_norm {{.*}} {{{.*}}ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK:          tpu.a16_matmul {{.*}} {{{.*}}ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK:          tpu.silu {{.*}} {{{.*}}ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK:          [[S:%.*]] = tpu.store %{{.*}} {slice_axis = -1 : i64, ts = 2 : i64} : tensor<1x8x32xbf16> -> tensor<1x8x32xbf16>
// CHECK-NEXT:     tpu.yield [[S]]
// CHECK-NEXT:   }
// CHECK-NEXT:   func.return [[G]]

// one op per group: the intermediates go through global memory (activations region)
// SINGLE:       tpu.regions = #tpu.regions<{{[1-9][0-9]*}} : i64
// SINGLE-COUNT-3: tpu.group(

// an op that cannot fit local memory even as one slice is refused by name
// TOOBIG: pass 'layer-group': 'tpu.softmax' (probs) cannot run from local memory on bm1684x: even its finest slicing (one slice) still needs 1048576 B per lane, 786432 B more than a lane's 262144 B
// TOOBIG-NOT: Traceback
