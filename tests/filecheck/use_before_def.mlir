// RUN: not toptpu-opt %s -p top-pipeline 2>&1 | filecheck %s

// An op moved above the op whose result it uses: xDSL parses forward references and does not
// check dominance; toptpu-opt refuses it at the op (not after the passes ran on it).
builtin.module {
  func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> {
    %1 = "top.add"(%0, %x) : (tensor<2xf32>, tensor<2xf32>) -> tensor<2xf32>
    %0 = "top.silu"(%x) : (tensor<2xf32>) -> tensor<2xf32>
    func.return %1 : tensor<2xf32>
  }
}
// CHECK: does not verify
// CHECK: use_before_def.mlir:7:5
// CHECK: uses %0 before the op that defines it ('top.silu' at line 8)
// CHECK-NOT: Traceback
