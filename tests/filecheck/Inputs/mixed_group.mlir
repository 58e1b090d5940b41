// A tpu.group whose inputs differ in type (an activation and a weight), as layer-group
// builds: valid in xDSL, not expressible in MLIR 22's IRDL (input of mlir_pipeline.mlir).
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
    %w = "tpu.weight"() {name = "fc.weight", source = "fc.weight", part = "data"} : () -> tensor<32x64xf32>
    %y = "tpu.group"(%x, %w) ({
    ^bb0(%x0: tensor<1x8x64xf32>, %w0: tensor<32x64xf32>):
      %l = "tpu.load"(%x0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
      %lw = "tpu.load"(%w0) {slice_axis = -1 : i64, ts = 0 : i64} : (tensor<32x64xf32>) -> tensor<32x64xf32>
      %m = "tpu.matmul"(%l, %lw) {transpose_b = true, compute = f32, ts = 1 : i64} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32>
      %t = "tpu.store"(%m) {slice_axis = -1 : i64, ts = 2 : i64} : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
      "tpu.yield"(%t) : (tensor<1x8x32xf32>) -> ()
    }) {slices = 1 : i64} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32> loc("group.mm")
    func.return %y : tensor<1x8x32xf32>
  }
}
