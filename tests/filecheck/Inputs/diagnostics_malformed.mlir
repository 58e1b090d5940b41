builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    // expected-error @+1 the message {{ without its closing braces
    func.return %x : tensor<2x3xf32>
  }
}
