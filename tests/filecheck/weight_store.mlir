// RUN: rm -rf %t && mkdir -p %t
// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s > %t/a.mlir
//
// Passes that derive nothing the result needs leave top.weight_store as it was:
// RUN: toptpu-opt %t/a.mlir -p 'convert-top-to-tpu{mode=f32}' -o %t/f32.mlir
// RUN: filecheck %s --check-prefix=KEEP --input-file %t/f32.mlir
// RUN: not ls %t/f32.weights.safetensors
//
// A step that derives weights writes OUT.weights.safetensors beside -o OUT.mlir and points
// the result at it; the next step, another process, runs on that result alone:
// RUN: toptpu-opt %t/a.mlir -p 'convert-top-to-tpu{mode=bf16}' -o %t/b.mlir
// RUN: filecheck %s --check-prefix=BF16 --input-file %t/b.mlir
// RUN: toptpu-opt %t/b.mlir -p weight-reorder -o %t/c.mlir
// RUN: filecheck %s --check-prefix=REORDER --input-file %t/c.mlir
//
// The companion holds what its module names: c's the transposed copy, not the dead [K, N]
// bf16 weight nor the float weights of a.
// RUN: python -c "import sys; from safetensors import safe_open; print(sorted(safe_open(sys.argv[1], 'pt').keys()))" %t/c.weights.safetensors | filecheck %s --check-prefix=NAMES
//
// --weights-out names the file (needed when the result goes to stdout) ...
// RUN: toptpu-opt %t/b.mlir -p weight-reorder --weights-out %t/w.safetensors | filecheck %s --check-prefix=OUT
// RUN: not toptpu-opt %t/b.mlir -p weight-reorder 2>&1 | filecheck %s --check-prefix=STDOUT
// ... and the input's own store is never overwritten (here: b.mlir in place):
// RUN: not toptpu-opt %t/b.mlir -p weight-reorder -o %t/b.mlir 2>&1 | filecheck %s --check-prefix=INPUT
// RUN: filecheck %s --check-prefix=BF16 --input-file %t/b.mlir
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x8x32xf32>) -> tensor<1x8x64xf32> {
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %y = "top.matmul"(%x, %w) {operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x8x32xf32>, tensor<32x64xf32>) -> tensor<1x8x64xf32>
    func.return %y : tensor<1x8x64xf32>
  }
}

// KEEP:       builtin.module attributes {top.weight_store = "{{.*}}/Inputs/weights.safetensors"}
// KEEP:         tpu.weight "fc.weight" {source = "fc.weight", part = "data"} : tensor<32x64xf32>

// BF16:       builtin.module attributes {top.weight_store = "{{.*}}/b.weights.safetensors"}
// BF16:         tpu.weight "fc.weight:bf16" {source = "fc.weight", part = "data"} : tensor<32x64xbf16>

// REORDER:    builtin.module attributes {top.weight_store = "{{.*}}/c.weights.safetensors"}
// REORDER:      tpu.weight "fc.weight:bf16.t" {part = "data.t", source = "fc.weight"} : tensor<64x32xbf16>
// REORDER-NOT:  tpu.weight

// NAMES:      ['fc.weight:bf16.t']

// OUT:        builtin.module attributes {top.weight_store = "{{.*}}/w.safetensors"}

// STDOUT:     toptpu-opt: the passes derived 1 weight tensor(s) the result needs ('fc.weight:bf16.t') and the result goes to stdout: give --weights-out PATH (a .safetensors file), or -o OUT.mlir (the weights then go to OUT.weights.safetensors)
// STDOUT-NOT: Traceback

// INPUT:      toptpu-opt: the weights of the result would go to {{.*}}/b.weights.safetensors, the weight store of the input, which is never overwritten: give -o another name or --weights-out PATH
