// Expectations that do not match what toptpu-opt produces (verify_diagnostics.mlir checks the
// mismatches are reported and the exit status is 1).
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    // an expectation that is not produced, and an error that was not expected
    // expected-error @+3 {{something else}}
    %0 = "top.gelu"(%x) {approximate = "none"} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    %1 = "top.exp"(%0) : (tensor<2x3xf32>) -> tensor<2x3xf32>
    %2 = "top.gelu"(%1) {approximate = "fast"} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %2 : tensor<2x3xf32>
  }
}
// -----
builtin.module {
  // the right message at the wrong line
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    // expected-error @+2 {{is not one of none, tanh}}
    %0 = "top.gelu"(%x) {approximate = "fast"} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}
// -----
// toptpu-opt produces no warnings: an expected one is missing
builtin.module {
  // expected-warning @+1 {{a warning}}
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    func.return %x : tensor<2x3xf32>
  }
}
