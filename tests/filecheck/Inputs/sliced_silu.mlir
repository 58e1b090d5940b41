// Tpu IR too big for local memory in one piece (32 MiB in, 32 MiB out, bm1684x has 64 x
// 256 KiB): layer-group slices it (input of commands.mlir's sliced case).
builtin.module {
  func.func @main(%x: tensor<1x4096x2048xf32>) -> tensor<1x4096x2048xf32> {
    %s = "tpu.silu"(%x) {compute = f32} : (tensor<1x4096x2048xf32>) -> tensor<1x4096x2048xf32> loc("act")
    func.return %s : tensor<1x4096x2048xf32>
  }
}
