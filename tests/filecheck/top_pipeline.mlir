// RUN: toptpu-opt %s -p top-pipeline --strip-debuginfo -o %t.pipeline
// RUN: filecheck %s --input-file %t.pipeline
// RUN: toptpu-opt %s -p shape-infer,canonicalize,fold-constants,cse,fuse,canonicalize,fold-constants,cse --strip-debuginfo -o %t.passes
// RUN: diff %t.pipeline %t.passes

// top-pipeline = shape-infer, canonicalize, fold-constants, cse, fuse, canonicalize,
// fold-constants, cse (the diff: the same text as the passes run one after another). On a
// norm + linear as an importer may leave them (result types unranked, rms_norm decomposed,
// linear as flatten, matmul by the transposed weight, bias add, unflatten; a dead op):
// shape-infer ranks every type and the signature, canonicalize drops the dead op, fuse
// makes one rms_norm and one matmul(transpose_b, bias).
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<*xf32> {
    %nw = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %b = "top.weight"() {name = "fc.bias"} : () -> tensor<32xf32>
    %0 = "top.pow"(%x) {exponent = 2.0 : f64} : (tensor<1x8x64xf32>) -> tensor<*xf32>
    %1 = "top.reduce"(%0) {mode = "mean", axes = array<i64: 2>, keepdims = true} : (tensor<*xf32>) -> tensor<*xf32>
    %2 = "top.add_const"(%1) {value = 1.0e-06 : f64} : (tensor<*xf32>) -> tensor<*xf32>
    %3 = "top.rsqrt"(%2) : (tensor<*xf32>) -> tensor<*xf32>
    %4 = "top.mul"(%x, %3) : (tensor<1x8x64xf32>, tensor<*xf32>) -> tensor<*xf32>
    %5 = "top.mul"(%nw, %4) : (tensor<64xf32>, tensor<*xf32>) -> tensor<*xf32>
    %6 = "top.reshape"(%5) {shape = array<i64: 8, 64>} : (tensor<*xf32>) -> tensor<*xf32>
    %7 = "top.permute"(%w) {order = array<i64: 1, 0>} : (tensor<32x64xf32>) -> tensor<*xf32>
    %8 = "top.matmul"(%6, %7) {operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<*xf32>, tensor<*xf32>) -> tensor<*xf32>
    %9 = "top.add"(%8, %b) : (tensor<*xf32>, tensor<32xf32>) -> tensor<*xf32>
    %10 = "top.reshape"(%9) {shape = array<i64: 1, 8, 32>} : (tensor<*xf32>) -> tensor<*xf32>
    %dead = "top.exp"(%10) : (tensor<*xf32>) -> tensor<*xf32>
    func.return %10 : tensor<*xf32>
  }
}

// CHECK:      func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
// CHECK-DAG:    [[NW:%.*]] = top.weight "norm.weight" : tensor<64xf32>
// CHECK-DAG:    [[W:%.*]] = top.weight "fc.weight" : tensor<32x64xf32>
// CHECK-DAG:    [[B:%.*]] = top.weight "fc.bias" : tensor<32xf32>
// CHECK:        [[N:%.*]] = top.rms_norm %x weight [[NW]] {eps = 1.000000e-06 : f64} : tensor<1x8x64xf32> weight tensor<64xf32> -> tensor<1x8x64xf32>
// CHECK-NEXT:   [[M:%.*]] = top.matmul [[N]], [[W]] bias [[B]] {transpose_b = true{{.*}}} : tensor<1x8x64xf32>, tensor<32x64xf32> bias tensor<32xf32> -> tensor<1x8x32xf32>
// CHECK-NEXT:   func.return [[M]] : tensor<1x8x32xf32>
// CHECK-NOT:    top.exp
// CHECK-NOT:    tensor<*xf32>
