// RUN: toptpu-opt %s -p top-pipeline,canonicalize > %t.plain
// RUN: toptpu-opt %s -p 'builtin.module(top-pipeline,canonicalize)' > %t.module
// RUN: toptpu-opt %s --pass-pipeline='builtin.module(top-pipeline,canonicalize)' > %t.flag
// RUN: toptpu-opt - -p 'builtin.module(top-pipeline,canonicalize)' -o - < %s > %t.stdin
// RUN: diff %t.plain %t.module
// RUN: diff %t.plain %t.flag
// RUN: diff %t.plain %t.stdin
// RUN: filecheck %s --input-file %t.stdin
// RUN: not toptpu-opt %s -p 'builtin.module(func.func(canonicalize))' 2>&1 | filecheck %s --check-prefix=NESTED
// RUN: not toptpu-opt %s -p canonicalize --pass-pipeline='builtin.module(canonicalize)' 2>&1 | filecheck %s --check-prefix=TWICE
// RUN: not toptpu-opt %s -p 'builtin.module(canonicalize' 2>&1 | filecheck %s --check-prefix=OPEN

// mlir-opt's pipeline syntax: builtin.module(...) around the passes (in -p or
// --pass-pipeline) runs the same passes as the plain list; '-' reads stdin (and -o - writes
// stdout). Passes nested under another op are refused: toptpu's passes run on the module.
builtin.module {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<*xf32> {
    %0 = "top.silu"(%x) : (tensor<1x8x64xf32>) -> tensor<*xf32>
    %dead = "top.exp"(%0) : (tensor<*xf32>) -> tensor<*xf32>
    func.return %0 : tensor<*xf32>
  }
}

// CHECK:      func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x64xf32>
// CHECK-NEXT:   %0 = top.silu %x : tensor<1x8x64xf32> -> tensor<1x8x64xf32>
// CHECK-NEXT:   func.return %0

// NESTED: toptpu-opt: error: pass pipeline 'builtin.module(func.func(canonicalize))': 'func.func(...)' nests passes under 'func.func': toptpu-opt runs module passes only

// TWICE: toptpu-opt: error: give the passes once: -p or --pass-pipeline, not both

// OPEN: toptpu-opt: error: pass pipeline 'builtin.module(canonicalize': '(' at column 15 is not closed
