// RUN: not toptpu-opt %s -p lmem-verify --split-input-file 2>&1 | filecheck %s
// RUN: not toptpu-opt %s -p lmem-verify 2>&1 | filecheck %s --check-prefix=EXIT

// lmem-verify re-checks the local addresses (`lmem`, per lane) that layer-group wrote, on
// bm1684x: 256 KiB per lane, 64-byte alignment, 16 banks of 16 KiB. Each chunk below is one
// group; every chunk but the valid ones must fail with the named diagnostic (on stderr:
// --split-input-file goes on to the next chunk, as mlir-opt, and exits 1 at the end).
// x is [1, 8, 32] f32 = 1 KiB: 16 B in each of 64 lanes, rounded up to 64 B per lane.

// A valid single-slice group: the resident load in bank 0, silu's result in bank 1.
builtin.module {
  func.func @ok(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK:      func.func @ok
// CHECK:        tpu.load %{{.*}} {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>}
// CHECK:        tpu.silu %{{.*}} {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>}

// -----

// Reuse in time is legal: a (silu) is dead once b (exp) has read it, so c (tanh, stored)
// may take a's bytes; each result sits in another bank than its input.
builtin.module {
  func.func @reuse(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a0: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a0) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %a = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("a")
      %b = "tpu.exp"(%a) {compute = f32, ts = 1 : i64, lmem = array<i64: 32768>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("b")
      %c = "tpu.tanh"(%b) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("c")
      %t = "tpu.store"(%c) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("c.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.a")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK:      func.func @reuse
// CHECK:        tpu.tanh %{{.*}} {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>}

// -----

// A valid two-slice pipeline: the sliced load and the stored result get two copies each
// (slice i+1 is loaded while slice i computes).
builtin.module {
  func.func @pingpong(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = 1 : i64, ts = 0 : i64, lmem = array<i64: 0, 64>} : (tensor<1x8x32xf32>) -> tensor<1x4x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384, 16448>} : (tensor<1x4x32xf32>) -> tensor<1x4x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = 1 : i64, ts = 2 : i64} : (tensor<1x4x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK:      func.func @pingpong
// CHECK:        lmem = array<i64: 0, 64>

// -----

// misaligned: 16400 is not a multiple of 64
builtin.module {
  func.func @misaligned(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16400>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @misaligned
// CHECK:      pass 'lmem-verify': group.act: act at 16400 is not 64-byte aligned

// EXIT:       toptpu-opt: {{.*}}lmem_verify.mlir: pass 'lmem-verify': group.act: act at 16400 is not 64-byte aligned
// EXIT-NOT:   Traceback

// -----

// outside the lane: the buffer starts where the lane ends
builtin.module {
  func.func @outside(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 262144>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @outside
// CHECK:      pass 'lmem-verify': group.act: act at [262144, 262208) is outside the lane (262144 B)

// -----

// overlap: silu's result written over the resident load it reads (both live)
builtin.module {
  func.func @overlap(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @overlap
// CHECK:      pass 'lmem-verify': group.act: live buffers overlap: x.load [0, 64) and act [0, 64)

// -----

// overlap in time: a (silu) is still read by c (add) when b (exp) is written over it
builtin.module {
  func.func @overlap_live(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a0: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a0) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %a = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("a")
      %b = "tpu.exp"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("b")
      %c = "tpu.add"(%a, %b) {compute = f32, ts = 1 : i64, lmem = array<i64: 32768>} : (tensor<1x8x32xf32>, tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("c")
      %t = "tpu.store"(%c) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("c.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.a")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @overlap_live
// CHECK:      pass 'lmem-verify': group.a: live buffers overlap: a [16384, 16448) and b [16384, 16448)

// -----

// bank conflict: no shared bytes, but silu writes bank 0 while reading its input there
builtin.module {
  func.func @bank(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 64>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @bank
// CHECK:      pass 'lmem-verify': group.act: bank conflict: act writes bank(s) [0] that its input x.load occupies

// -----

// a compute result without an address
builtin.module {
  func.func @missing(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @missing
// CHECK:      pass 'lmem-verify': group.act: act has no local address

// -----

// two copies where one slice (no pipeline) has one
builtin.module {
  func.func @copies(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64, ts = 0 : i64, lmem = array<i64: 0>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384, 16448>} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK-NOT:  func.func @copies
// CHECK:      pass 'lmem-verify': group.act: act needs 1 address(es), has 2

