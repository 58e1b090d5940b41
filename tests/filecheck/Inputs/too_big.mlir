// One softmax row of 8M f32 (32 MiB in, 32 MiB out): rows cannot be split below one and
// the whole row does not fit bm1684x's 64 x 256 KiB (input of layer_group.mlir's failing case).
builtin.module {
  func.func @main(%x: tensor<1x1x8388608xf32>) -> tensor<1x1x8388608xf32> {
    %0 = "tpu.softmax"(%x) {axis = 2 : i64, compute = f32} : (tensor<1x1x8388608xf32>) -> tensor<1x1x8388608xf32> loc("probs")
    func.return %0 : tensor<1x1x8388608xf32>
  }
}
