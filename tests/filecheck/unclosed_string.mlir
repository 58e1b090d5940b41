// RUN: not toptpu-opt %s -p top-pipeline 2>&1 | filecheck %s

// A location's string literal cut open by an editing mistake is refused at once, at its place
// (xDSL 0.75.0's lexer alone takes time exponential in the rest of the line).
builtin.module {
  func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> {
    func.return %x : tensor<2xf32> loc("layer.self_attn.q_proj.linear"("/models/qwen2/modeling
  }
}
// CHECK: parse error
// CHECK: unclosed_string.mlir:7:72
// CHECK: string literal not closed before the end of the line
// CHECK-NOT: Traceback
