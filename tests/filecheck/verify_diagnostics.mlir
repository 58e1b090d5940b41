// RUN: toptpu-opt %s -p shape-infer --split-input-file --verify-diagnostics | filecheck %s
// RUN: not toptpu-opt %S/Inputs/diagnostics_mismatch.mlir --split-input-file --verify-diagnostics 2>&1 | filecheck %s --check-prefix=MISMATCH
// RUN: not toptpu-opt - --verify-diagnostics -o %t.out < /dev/null 2>&1 | filecheck %s --check-prefix=NONE
// RUN: not toptpu-opt %S/Inputs/diagnostics_malformed.mlir --verify-diagnostics 2>&1 | filecheck %s --check-prefix=MALFORMED

// --verify-diagnostics as mlir-opt: every diagnostic must be expected by an
// `expected-error {{...}}` comment (at its line: @+N, @-N, @above, @below, or the comment's
// own line; @unknown for one without a line: a pass's refusal) and every expectation
// produced; the chunks that verify print their IR. The second run line: a file whose
// expectations do not match exits 1, naming each mismatch (Inputs/diagnostics_mismatch.mlir).

// a verifier error, at the op's line
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    // expected-error @+1 {{gelu approximation "fast" is not one of none, tanh}}
    %0 = "top.gelu"(%x) {approximate = "fast"} : (tensor<2x3xf32>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}

// -----
// @below: the next line that is not an expectation (any other line counts, a comment too)
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<2x3xf16>) -> tensor<2x3xf32> {
    // expected-error @below {{'top.add': operand element types differ}}
    %0 = "top.add"(%x, %y) : (tensor<2x3xf32>, tensor<2x3xf16>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
  }
}

// -----
// -re: {{regex}} inside the message; @-N
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<2x3xf16>) -> tensor<2x3xf32> {
    %0 = "top.add"(%x, %y) : (tensor<2x3xf32>, tensor<2x3xf16>) -> tensor<2x3xf32>
    func.return %0 : tensor<2x3xf32>
    // expected-error-re @-2 {{element types differ: f{{[0-9]+}} vs f16}}
  }
}

// -----
// an expectation on the op's own line
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<3x2xf32> {
    %0 = "top.permute"(%x) {order = array<i64: 0, 1>} : (tensor<2x3xf32>) -> tensor<3x2xf32> // expected-error {{inferred ['tensor<2x3xf32>']}}
    func.return %0 : tensor<3x2xf32>
  }
}

// -----
// @above: the last line that is not an expectation; a parse error, at its token's line
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<2x3xf32> {
    %0 = "top.no_such_op"(%x) : (tensor<2x3xf32>) -> tensor<2x3xf32>
    // expected-error @above {{Operation top.no_such_op is not registered}}
    func.return %0 : tensor<2x3xf32>
  }
}

// -----
// a pass's refusal names no line: @unknown
builtin.module {
  func.func @f(%x: tensor<2x3xf32>) -> tensor<*xf32> {
    // expected-error @unknown {{pass 'shape-infer': shape inference failed at 'top.reshape' (flat): cannot reshape [2, 3] to [7]}}
    %0 = "top.reshape"(%x) {shape = array<i64: 7>} : (tensor<2x3xf32>) -> tensor<*xf32> loc("flat")
    func.return %0 : tensor<*xf32>
  }
}

// -----
// a chunk without diagnostics prints its result
builtin.module {
  func.func @ok(%x: tensor<2x3xf32>) -> tensor<*xf32> {
    %0 = "top.silu"(%x) : (tensor<2x3xf32>) -> tensor<*xf32>
    func.return %0 : tensor<*xf32>
  }
}
// CHECK:     func.func @ok(%x: tensor<2x3xf32>) -> tensor<2x3xf32>
// CHECK-NOT: error

// MISMATCH:      diagnostics_mismatch.mlir:9: error: unexpected error: 'top.gelu': gelu approximation "fast" is not one of none, tanh
// MISMATCH-NEXT: diagnostics_mismatch.mlir:6: error: expected error "something else" was not produced at line 9
// MISMATCH:      diagnostics_mismatch.mlir:18: error: unexpected error: 'top.gelu': gelu approximation "fast"
// MISMATCH-NEXT: diagnostics_mismatch.mlir:17: error: expected error "is not one of none, tanh" was not produced at line 19
// MISMATCH:      diagnostics_mismatch.mlir:25: error: expected warning "a warning" was not produced at line 26
// MISMATCH:      toptpu-opt: {{.*}}diagnostics_mismatch.mlir: 3 of 3 chunks did not produce the diagnostics expected

// stdin (/dev/null: no text) is no IR: an unexpected error; nothing is written to -o
// NONE: stdin: error: unexpected error: stdin is empty
// NONE: toptpu-opt: stdin: 1 of 1 chunk did not produce the diagnostics expected; nothing was written

// MALFORMED: toptpu-opt: --verify-diagnostics: {{.*}}diagnostics_malformed.mlir:3: malformed expectation
