// Tpu IR that layer-group has not grouped (input of address_assign.mlir's failing case).
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x64xf32> {
    %s = "tpu.silu"(%x) {compute = f32} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
    func.return %s : tensor<1x8x64xf32>
  }
}
