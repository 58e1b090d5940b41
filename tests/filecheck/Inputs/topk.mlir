// input of convert_top_to_linalg.mlir: an op convert-top-to-linalg refuses (k > 1)
builtin.module {
  func.func @topk(%x: tensor<2x8xf32>) -> tensor<2x2xf32> {
    %v, %i = "top.topk"(%x) {k = 2 : i64, axis = 1 : i64} : (tensor<2x8xf32>) -> (tensor<2x2xf32>, tensor<2x2xi32>) loc("topk")
    func.return %v : tensor<2x2xf32>
  }
}
