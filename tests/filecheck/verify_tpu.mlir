// RUN: not toptpu-opt %s --split-input-file 2>&1 | filecheck %s
// RUN: not toptpu-opt %s --split-input-file 2>&1 | filecheck %s --check-prefix=EXIT

// Each Tpu op family's verifier (a16_matmul's quantization layout, the layer group's
// region, load/store slicing, the Top verifiers Tpu ops share) refuses an invalid op with a
// message naming it, at its place in the file. One invalid op per chunk; --split-input-file
// prints each diagnostic on stderr and goes on, exiting 1, as mlir-opt (an op that verified
// would print IR, and its CHECK would not match). The second run line: the first error first.
// a16_matmul: 4- or 8-bit weights
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 3 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xbf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 1):12:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': weight_bits must be 4 or 8, got 3

// EXIT:      toptpu-opt: the IR does not verify:
// EXIT-NEXT: verify_tpu.mlir (the chunk from line 1):12:5
// EXIT:      'tpu.a16_matmul': weight_bits must be 4 or 8, got 3
// EXIT-NOT:  Traceback

// -----
// a16_matmul: a 2-D qweight
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<1x32x32xui8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<1x32x32xui8>, tensor<32x2xbf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 25):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': a16_matmul qweight must be [N, K] (8 bit) or [N, K/2] (4 bit)

// -----
// a16_matmul: 4-bit weights packed two per ui8
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xi8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xi8>, tensor<32x2xbf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 37):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': 4-bit qweight must be ui8 (two nibbles per byte)

// -----
// a16_matmul: 8-bit ui8 weights come with zero points
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x64xui8>, %s: tensor<32x1xbf16>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s) {weight_bits = 8 : i64, group_size = 64 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 0, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x64xui8>, tensor<32x1xbf16>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 49):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': 8-bit weights are i8 without zero points or mins, ui8 with them

// -----
// a16_matmul: the group size divides K
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 48 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xbf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 61):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': group_size 48 does not divide K=64

// -----
// a16_matmul: the input's K is the weights'
builtin.module {
  func.func @f(%x: tensor<1x8x32xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x32xbf16>, tensor<32x32xui8>, tensor<32x2xbf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 73):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': a16_matmul input K=32 but weights have K=64

// -----
// a16_matmul: one scale per output channel and group
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x1xbf16>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x1xbf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 85):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': scales [32, 1] must be [32, 2]

// -----
// a16_matmul: ui8 zero points shaped like the scales
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xi8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xbf16>, tensor<32x2xi8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 97):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': zeros must be ui8 [32, 2]

// -----
// a16_matmul: floating-point scales
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xi32>, %z: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xi32>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 109):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': scales must be floating point

// -----
// a16_matmul: the bias is [N]
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xbf16>, %z: tensor<32x2xui8>, %b: tensor<64xf32>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z, %b) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 0, 1>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xbf16>, tensor<32x2xui8>, tensor<64xf32>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 121):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': bias must be [32]

// -----
// Tpu ops share Top's verifiers (here matmul's)
builtin.module {
  func.func @f(%x: tensor<2x8xbf16>, %w: tensor<4x16xbf16>) -> tensor<2x4xbf16> {
    %0 = "tpu.matmul"(%x, %w) {transpose_b = true, compute = f32} : (tensor<2x8xbf16>, tensor<4x16xbf16>) -> tensor<2x4xbf16>
    func.return %0 : tensor<2x4xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 133):5:{{[0-9]+}}
// CHECK-NEXT: tpu.matmul
// CHECK:      'tpu.matmul': matmul contraction mismatch: [2, 8] @ [4, 16] (transpose_a=False, transpose_b=True)

// -----
// compute names an element type
builtin.module {
  func.func @f(%x: tensor<2x8xbf16>) -> tensor<2x8xbf16> {
    %0 = "tpu.silu"(%x) {compute = "f32"} : (tensor<2x8xbf16>) -> tensor<2x8xbf16>
    func.return %0 : tensor<2x8xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 145):5:{{[0-9]+}}
// CHECK-NEXT: tpu.silu
// CHECK:      "f32" should be of attribute subclassing `TypeAttribute`

// -----
// group: one block argument per input
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>, %b: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%l) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %y : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 157):5:{{[0-9]+}}
// CHECK-NEXT: tpu.group
// CHECK:      tpu.group needs one block argument per input

// -----
// group: block arguments typed as the inputs
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xbf16>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64} : (tensor<1x8x32xbf16>) -> tensor<1x8x32xbf16>
      %c = "tpu.cast"(%l) {dtype = f32, compute = f32} : (tensor<1x8x32xbf16>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%c) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %y : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 174):5:{{[0-9]+}}
// CHECK-NEXT: tpu.group
// CHECK:      tpu.group block argument types must match the inputs

// -----
// group: the yielded values typed as the results
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x16xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%l) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x16xf32>
    func.return %y : tensor<1x8x16xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 192):5:{{[0-9]+}}
// CHECK-NEXT: tpu.group
// CHECK:      tpu.yield types must match the group results

// -----
// group: at least one slice
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%a) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%l) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 0 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %y : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 209):5:{{[0-9]+}}
// CHECK-NEXT: tpu.group
// CHECK:      tpu.group needs at least one slice

// -----
// group: isolated from above (its inputs are its block arguments)
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %y = "tpu.group"(%x) ({
    ^bb0(%a: tensor<1x8x32xf32>):
      %l = "tpu.load"(%x) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%l) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %y : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 226):5:{{[0-9]+}}
// CHECK-NEXT: tpu.group
// CHECK:      Operation using value defined out of its IsolatedFromAbove parent: LoadOp(%l = tpu.load %x

// -----
// yield: only inside a group (here it ends a function)
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) {
    "tpu.yield"(%x) : (tensor<1x8x32xf32>) -> ()
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 243):5:{{[0-9]+}}
// CHECK-NEXT: tpu.yield
// CHECK:      'tpu.yield' expects parent op 'tpu.group'

// -----
// load: no change of element type
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.load"(%x) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 254):5:{{[0-9]+}}
// CHECK-NEXT: tpu.load
// CHECK:      tpu.load cannot change the element type

// -----
// load: a whole tensor keeps its shape
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x4x32xf32> {
    %0 = "tpu.load"(%x) {slice_axis = -1 : i64} : (tensor<1x8x32xf32>) -> tensor<1x4x32xf32>
    func.return %0 : tensor<1x4x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 266):5:{{[0-9]+}}
// CHECK-NEXT: tpu.load
// CHECK:      tpu.load of a whole tensor must keep its shape

// -----
// load: the slice axis exists
builtin.module {
  func.func @f(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %0 = "tpu.load"(%x) {slice_axis = 3 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %0 : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 278):5:{{[0-9]+}}
// CHECK-NEXT: tpu.load
// CHECK:      tpu.load slice_axis 3 is out of range

// -----
// store: only the slice axis differs
builtin.module {
  func.func @f(%x: tensor<1x4x16xf32>) -> tensor<1x8x32xf32> {
    %0 = "tpu.store"(%x) {slice_axis = 1 : i64} : (tensor<1x4x16xf32>) -> tensor<1x8x32xf32>
    func.return %0 : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 290):5:{{[0-9]+}}
// CHECK-NEXT: tpu.store
// CHECK:      tpu.store may only slice along axis 1

// -----
// store: equal slices
builtin.module {
  func.func @f(%x: tensor<1x3x32xf32>) -> tensor<1x8x32xf32> {
    %0 = "tpu.store"(%x) {slice_axis = 1 : i64} : (tensor<1x3x32xf32>) -> tensor<1x8x32xf32>
    func.return %0 : tensor<1x8x32xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 302):5:{{[0-9]+}}
// CHECK-NEXT: tpu.store
// CHECK:      tpu.store slice of 3 does not divide the axis of size 8

// -----
// weight: a known part (transposed at most once)
builtin.module {
  func.func @f() -> tensor<32x64xf32> {
    %0 = "tpu.weight"() {name = "fc.weight.t.t", source = "fc.weight", part = "data.t.t"} : () -> tensor<32x64xf32>
    func.return %0 : tensor<32x64xf32>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 314):5:{{[0-9]+}}
// CHECK-NEXT: tpu.weight
// CHECK:      weight part "data.t.t" is not one of data, qweight, scales, zeros, checkpoint.qweight, checkpoint.scales, checkpoint.zeros, checkpoint.mins, checkpoint.perm, data.t, qweight.t, scales.t, zeros.t, checkpoint.qweight.t, checkpoint.scales.t, checkpoint.zeros.t, checkpoint.mins.t, checkpoint.perm.t

// -----
// a16_matmul: zero points or mins, not both
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xf16>, %z: tensor<32x2xui8>, %m: tensor<32x2xf16>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %z, %m) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xf16>, tensor<32x2xui8>, tensor<32x2xf16>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 326):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': a16_matmul takes zero points or mins, not both

// -----
// a16_matmul: float mins (the scale-and-min form), not integers
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xf16>, %m: tensor<32x2xui8>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %m) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 0, 1, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xf16>, tensor<32x2xui8>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 338):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': mins must be floating point [32, 2]

// -----
// a16_matmul: one min per output channel and group
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x32xui8>, %s: tensor<32x2xf32>, %m: tensor<32x1xf32>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %m) {weight_bits = 4 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 0, 1, 0>} : (tensor<1x8x64xbf16>, tensor<32x32xui8>, tensor<32x2xf32>, tensor<32x1xf32>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 350):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': mins must be floating point [32, 2]

// -----
// a16_matmul: 8-bit weights with mins are ui8 (unsigned, as stored)
builtin.module {
  func.func @f(%x: tensor<1x8x64xbf16>, %q: tensor<32x64xi8>, %s: tensor<32x2xf16>, %m: tensor<32x2xf16>) -> tensor<1x8x32xbf16> {
    %0 = "tpu.a16_matmul"(%x, %q, %s, %m) {weight_bits = 8 : i64, group_size = 32 : i64, compute = f32, operandSegmentSizes = array<i32: 1, 1, 1, 0, 1, 0>} : (tensor<1x8x64xbf16>, tensor<32x64xi8>, tensor<32x2xf16>, tensor<32x2xf16>) -> tensor<1x8x32xbf16>
    func.return %0 : tensor<1x8x32xbf16>
  }
}
// CHECK:      verify_tpu.mlir (the chunk from line 362):5:{{[0-9]+}}
// CHECK-NEXT: tpu.a16_matmul
// CHECK:      'tpu.a16_matmul': 8-bit weights are i8 without zero points or mins, ui8 with them
