// RUN: toptpu-opt %s -p 'mlir{pipeline="symbol-dce,cse"}' --print-debuginfo | filecheck %s
// RUN: not toptpu-opt %S/Inputs/mixed_group.mlir -p 'mlir{pipeline="cse"}' 2>&1 | filecheck %s --check-prefix=IRDL

// mlir{pipeline=...} runs real MLIR's passes on the module (top/tpu loaded from their IRDL)
// and reads the result back: symbol-dce drops the unused private function, cse merges the
// duplicate arith constants and MLIR erases them as dead; the top ops, their attributes,
// their names (loc) and the module's weight store come back unchanged. The two identical
// top.silu stay two: IRDL gives MLIR no traits, so it cannot know they are pure.
builtin.module attributes {top.weight_store = "weights.safetensors"} {
  func.func private @unused(%x: tensor<2xf32>) -> tensor<2xf32> {
    func.return %x : tensor<2xf32>
  }
  func.func @main(%x: tensor<2x8xf32>) -> (tensor<2x8xf32>, tensor<2x8xf32>) {
    %0 = "top.softmax"(%x) {axis = 1 : i64} : (tensor<2x8xf32>) -> tensor<2x8xf32> loc("probs")
    %1 = "top.silu"(%0) : (tensor<2x8xf32>) -> tensor<2x8xf32> loc("act")
    %2 = "top.silu"(%0) : (tensor<2x8xf32>) -> tensor<2x8xf32> loc("act2")
    %c = arith.constant 1 : i64
    %d = arith.constant 1 : i64
    func.return %1, %2 : tensor<2x8xf32>, tensor<2x8xf32>
  }
}

// CHECK:      builtin.module attributes {top.weight_store = "weights.safetensors"} {
// CHECK-NOT:    @unused
// CHECK:        func.func @main(%{{.*}}: tensor<2x8xf32> loc(unknown)) -> (tensor<2x8xf32>, tensor<2x8xf32>) {
// CHECK-NEXT:     [[P:%.*]] = top.softmax %{{.*}} {axis = 1 : i64} : tensor<2x8xf32> -> tensor<2x8xf32> loc("probs")
// CHECK-NEXT:     [[A:%.*]] = top.silu [[P]] : tensor<2x8xf32> -> tensor<2x8xf32> loc("act")
// CHECK-NEXT:     [[B:%.*]] = top.silu [[P]] : tensor<2x8xf32> -> tensor<2x8xf32> loc("act2")
// CHECK-NEXT:     func.return [[A]], [[B]]
// CHECK-NOT:    arith.constant

// What IRDL in MLIR 22 cannot say (docs/mlir.md): no IRDL op is a terminator, so MLIR's block
// verifier refuses the body of a tpu.group (it ends in tpu.yield), by name, not crashed on
// (the group's inputs of different types are no longer a problem: one segment per value).
// IRDL: pass 'mlir': MLIR (top/tpu from IRDL) rejected the module:
// IRDL-NEXT: 'tpu.yield' at loc(unknown): block with no terminator, has "tpu.yield"
// IRDL-NOT: Traceback
