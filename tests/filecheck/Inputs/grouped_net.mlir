// A norm, a linear, reshapes and elementwise ops: tests/test_op_interfaces.py lowers it,
// groups it for the machine and prints the grouped net in the custom forms.
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>, %y: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %g = top.weight "norm.weight" : tensor<64xf32>
    %w = top.weight "fc.weight" : tensor<32x64xf32>
    %n = top.rms_norm %x weight %g {eps = 1.000000e-06 : f64} : tensor<1x8x64xf32> weight tensor<64xf32> -> tensor<1x8x64xf32>
    %m = top.matmul %n, %w {transpose_b = true} : tensor<1x8x64xf32>, tensor<32x64xf32> -> tensor<1x8x32xf32>
    %r = top.reshape %m {shape = array<i64: 1, 8, 2, 16>} : tensor<1x8x32xf32> -> tensor<1x8x2x16xf32>
    %b = top.reshape %r {shape = array<i64: 1, 8, 32>} : tensor<1x8x2x16xf32> -> tensor<1x8x32xf32>
    %s = top.mul %b, %y : tensor<1x8x32xf32>, tensor<1x8x32xf32> -> tensor<1x8x32xf32>
    %o = top.add %s, %y : tensor<1x8x32xf32>, tensor<1x8x32xf32> -> tensor<1x8x32xf32>
    func.return %o : tensor<1x8x32xf32>
  }
}
