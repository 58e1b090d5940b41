// Tpu IR (after convert-top-to-tpu): expand-silu takes Top IR and refuses it.
builtin.module {
  func.func @main(%gate: tensor<1x4x8xf32>) -> tensor<1x4x8xf32> {
    %s = "tpu.silu"(%gate) {compute = f32} : (tensor<1x4x8xf32>) -> tensor<1x4x8xf32> loc("mlp.act")
    func.return %s : tensor<1x4x8xf32>
  }
}
