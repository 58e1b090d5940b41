// RUN: toptpu-opt %s -p address-assign --split-input-file | filecheck %s
// RUN: not toptpu-opt %S/Inputs/ungrouped.mlir -p address-assign 2>&1 | filecheck %s --check-prefix=UNGROUPED

// Four groups in a chain; a is read again by g3, so it lives over groups 0..3, b over 1..2,
// c over 2..3, e over 3..4; d is the function's output (no activation address: -1).
// Activations are placed largest first, first fit among those alive at the same time:
//   a 2048 B -> 0; b 1024 B -> 2048 (a alive); c 1024 B -> 3072 (a and b alive);
//   e 1024 B -> 2048 (b is dead by group 3: e reuses its bytes)  => activations = 4096 B.
// Constants are packed in order, each 64-byte aligned: 128 B at 0, 8 B at 128 => 192 B.
// Weights: fc.weight 32x64 f32 = 8192 B. IO: x 2048 B + d 1024 B = 3072 B.
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
    %w = "tpu.weight"() {name = "fc.weight", source = "fc.weight", part = "data"} : () -> tensor<32x64xf32>
    %k = "tpu.constant"() {value = dense<0.5> : tensor<32xf32>} : () -> tensor<32xf32>
    %k2 = "tpu.constant"() {value = dense<[1.0, 2.0]> : tensor<2xf32>} : () -> tensor<2xf32>
    %a = "tpu.group"(%x) ({
    ^bb0(%x0: tensor<1x8x64xf32>):
      %l = "tpu.load"(%x0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
      "tpu.yield"(%t) : (tensor<1x8x64xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
    %b = "tpu.group"(%a, %w) ({
    ^bb0(%a0: tensor<1x8x64xf32>, %w0: tensor<32x64xf32>):
      %l = "tpu.load"(%a0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
      %lw = "tpu.load"(%w0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<32x64xf32>) -> tensor<32x64xf32>
      %m = "tpu.matmul"(%l, %lw) {transpose_b = true, compute = f32, ts = 1 : i64} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%m) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32>
    %c = "tpu.group"(%b, %k2) ({
    ^bb0(%b0: tensor<1x8x32xf32>, %k0: tensor<2xf32>):
      %l = "tpu.load"(%b0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %lk = "tpu.load"(%k0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<2xf32>) -> tensor<2xf32>
      %r = "tpu.reshape"(%l) {shape = array<i64: 1, 8, 16, 2>, compute = f32, ts = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x16x2xf32>
      %s = "tpu.mul"(%r, %lk) {compute = f32, ts = 1 : i64} : (tensor<1x8x16x2xf32>, tensor<2xf32>) -> tensor<1x8x16x2xf32>
      %r2 = "tpu.reshape"(%s) {shape = array<i64: 1, 8, 32>, compute = f32, ts = 1 : i64} : (tensor<1x8x16x2xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%r2) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>, tensor<2xf32>) -> tensor<1x8x32xf32>
    %e = "tpu.group"(%a, %c) ({
    ^bb0(%a0: tensor<1x8x64xf32>, %c0: tensor<1x8x32xf32>):
      %la = "tpu.load"(%a0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
      %lc = "tpu.load"(%c0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %h = "tpu.slice"(%la) {axis = 2 : i64, start = 0 : i64, end = 32 : i64, step = 1 : i64, compute = f32, ts = 1 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x32xf32>
      %s = "tpu.add"(%h, %lc) {compute = f32, ts = 1 : i64} : (tensor<1x8x32xf32>, tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x64xf32>, tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    %d = "tpu.group"(%e, %k) ({
    ^bb0(%e0: tensor<1x8x32xf32>, %k0: tensor<32xf32>):
      %l = "tpu.load"(%e0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %lk = "tpu.load"(%k0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<32xf32>) -> tensor<32xf32>
      %s = "tpu.add"(%l, %lk) {compute = f32, ts = 1 : i64} : (tensor<1x8x32xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
    func.return %d : tensor<1x8x32xf32>
  }
}

// CHECK:      func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> attributes {tpu.regions = #tpu.regions<4096 : i64, 192 : i64, 8192 : i64, 3072 : i64>}
// CHECK:        "tpu.constant"() {value = dense<5.000000e-01> : tensor<32xf32>, tpu.const_offset = 0 : i64}
// CHECK-NEXT:   "tpu.constant"() {value = dense<[1.000000e+00, 2.000000e+00]> : tensor<2xf32>, tpu.const_offset = 128 : i64}
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: 0>} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: 2048>} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32>
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: 3072>} : (tensor<1x8x32xf32>, tensor<2xf32>) -> tensor<1x8x32xf32>
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: 2048>} : (tensor<1x8x64xf32>, tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: -1>} : (tensor<1x8x32xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>

// -----

// A group with two results: one goes to the output (-1), the other is read by the next
// group; bf16 tensors are half the bytes (x [1, 8, 64] bf16 = 1024 B).
builtin.module {
  func.func @two(%x: tensor<1x8x64xbf16>) -> (tensor<1x8x64xbf16>, tensor<1x8x64xbf16>) {
    %p, %q = "tpu.group"(%x) ({
    ^bb0(%x0: tensor<1x8x64xbf16>):
      %l = "tpu.load"(%x0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      %s = "tpu.silu"(%l) {compute = bf16, ts = 1 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      %e = "tpu.exp"(%l) {compute = bf16, ts = 1 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      %u = "tpu.store"(%e) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      "tpu.yield"(%t, %u) : (tensor<1x8x64xbf16>, tensor<1x8x64xbf16>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x64xbf16>) -> (tensor<1x8x64xbf16>, tensor<1x8x64xbf16>)
    %r = "tpu.group"(%q) ({
    ^bb0(%q0: tensor<1x8x64xbf16>):
      %l = "tpu.load"(%q0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      %s = "tpu.tanh"(%l) {compute = bf16, ts = 1 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
      "tpu.yield"(%t) : (tensor<1x8x64xbf16>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x64xbf16>) -> tensor<1x8x64xbf16>
    func.return %p, %r : tensor<1x8x64xbf16>, tensor<1x8x64xbf16>
  }
}

// CHECK:      func.func @two({{.*}} attributes {tpu.regions = #tpu.regions<1024 : i64, 0 : i64, 0 : i64, 3072 : i64>}
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: -1, 0>}
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, gaddrs = array<i64: -1>}

// UNGROUPED: pass 'address-assign': run layer-group first: ops outside groups ['tpu.silu']
// UNGROUPED-NOT: Traceback
