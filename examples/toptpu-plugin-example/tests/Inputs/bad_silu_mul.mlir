// The plugin's op verifies as toptpu's own do: gate and up of one shape and type.
builtin.module {
  func.func @main(%gate: tensor<1x4x8xbf16>, %up: tensor<1x8xbf16>) -> tensor<1x4x8xbf16> {
    %y = "top.silu_mul"(%gate, %up) : (tensor<1x4x8xbf16>, tensor<1x8xbf16>) -> tensor<1x4x8xbf16>
    func.return %y : tensor<1x4x8xbf16>
  }
}
