// RUN: not toptpu-opt %s -p lmem-verify 2>&1 | filecheck %s

// Regression test of a fixed bug:
// lmem-verify compares every pair of *different* buffers (passes/lmem.py verify_group,
// `for j in range(i + 1, n)`), never the two ping-pong copies of one buffer with each other.
// Here both copies of silu's stored result sit at 16384: slice 1's result is written (t=7)
// while slice 0's is still being stored (until t=8), which the allocator (allocate_group)
// does avoid but the verifier accepts.

// ping-pong copies of the store buffer on the same bytes in a two-slice pipeline (slice 1's
// result is written while slice 0's is still being stored); a copy pair of the same buffer
builtin.module {
  func.func @pingpong_same(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = 1 : i64, ts = 0 : i64, lmem = array<i64: 0, 64>} : (tensor<1x8x32xf32>) -> tensor<1x4x32xf32> loc("x.load")
      %s = "tpu.silu"(%l) {compute = f32, ts = 1 : i64, lmem = array<i64: 16384, 16384>} : (tensor<1x4x32xf32>) -> tensor<1x4x32xf32> loc("act")
      %t = "tpu.store"(%s) {slice_axis = 1 : i64, ts = 2 : i64} : (tensor<1x4x32xf32>) -> tensor<1x8x32xf32> loc("act.store")
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("group.act")
    func.return %y : tensor<1x8x32xf32>
  }
}

// CHECK:      pass 'lmem-verify': group.act: live buffers overlap: act [16384, 16448) and act [16384, 16448)
