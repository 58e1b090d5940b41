// RUN: toptpu-opt %s -p fold-constants,cse --split-input-file | filecheck %s
// RUN: toptpu-opt %s -p fold-constants --split-input-file | filecheck %s --check-prefix=NOCSE

// fold-constants evaluates each op whose operands are all small constants with the reference
// kernels (the interpreter's and the machine's) into a constant of its level; cse merges
// what is left identical.

// Small constants fold through the backend kernels; identical ops merge (CSE).
builtin.module {
  func.func @consts(%x: tensor<2xf32>) -> (tensor<2xf32>, tensor<2xf32>) {
    %c = "top.constant"() {value = dense<[1.0, 4.0]> : tensor<2xf32>} : () -> tensor<2xf32>
    %s = "top.sqrt"(%c) : (tensor<2xf32>) -> tensor<2xf32>
    %m = "top.mul_const"(%s) {value = 3.0 : f64} : (tensor<2xf32>) -> tensor<2xf32>
    %a = "top.add"(%x, %m) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    %b = "top.add"(%x, %m) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    func.return %a, %b : tensor<2xf32>, tensor<2xf32>
  }
}

// CHECK-LABEL: func.func @consts
// CHECK-NEXT:    [[C:%.*]] = "top.constant"() {value = dense<[3.000000e+00, 6.000000e+00]> : tensor<2xf32>}
// CHECK-NEXT:    [[A:%.*]] = top.add %x, [[C]]
// CHECK-NEXT:    func.return [[A]], [[A]]

// NOCSE-LABEL: func.func @consts
// NOCSE-NEXT:    [[C:%.*]] = "top.constant"() {value = dense<[3.000000e+00, 6.000000e+00]> : tensor<2xf32>}
// NOCSE-NEXT:    [[A:%.*]] = top.add %x, [[C]]
// NOCSE-NEXT:    [[B:%.*]] = top.add %x, [[C]]
// NOCSE-NEXT:    func.return [[A]], [[B]]

// -----

// Tpu ops fold into tpu.constant (a cast rounds to bf16 as the kernel does); a result of
// more than FOLD_LIMIT (4096) elements is left as it is.
builtin.module {
  func.func @tpu() -> (tensor<3xbf16>, tensor<4097xf32>) {
    %c = "tpu.constant"() {value = dense<[1.0, 3.0e-3, 257.0]> : tensor<3xf32>} : () -> tensor<3xf32>
    %h = "tpu.cast"(%c) {dtype = bf16} : (tensor<3xf32>) -> tensor<3xbf16>
    %z = "tpu.constant"() {value = dense<1.0> : tensor<1xf32>} : () -> tensor<1xf32>
    %big = "tpu.expand"(%z) {shape = array<i64: 4097>} : (tensor<1xf32>) -> tensor<4097xf32>
    func.return %h, %big : tensor<3xbf16>, tensor<4097xf32>
  }
}

// CHECK-LABEL: func.func @tpu
// CHECK-NEXT:    [[H:%.*]] = "tpu.constant"() {value = dense<[1.000000e+00, 3.005980e-03, 2.560000e+02]> : tensor<3xbf16>}
// CHECK-NEXT:    [[Z:%.*]] = "tpu.constant"() {value = dense<1.000000e+00> : tensor<1xf32>}
// CHECK-NEXT:    [[B:%.*]] = tpu.expand [[Z]] {shape = array<i64: 4097>}
// CHECK-NEXT:    func.return [[H]], [[B]]
