// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s > %t.mlir
// RUN: toptpu-opt %t.mlir -p 'convert-top-to-tpu{mode=bf16},canonicalize,fold-constants,cse,weight-reorder' --strip-debuginfo -o %t.tpu.mlir
// RUN: toptpu-opt %t.tpu.mlir -p 'machine-pipeline{chip=bm1688 max-ops=1}' --strip-debuginfo -o %t.pipeline
// RUN: filecheck %s --input-file %t.pipeline
// RUN: toptpu-opt %t.tpu.mlir -p 'layer-group{chip=bm1688 max-ops=1},lmem-verify{chip=bm1688},address-assign' --strip-debuginfo -o %t.passes
// RUN: diff %t.pipeline %t.passes

// machine-pipeline{chip, max-ops} = layer-group, lmem-verify, address-assign: the passes
// between Tpu IR and codegen (the diff: the same text as those passes one by one; the
// compiler, tests and benchmarks run this one list through toptpu.machine_pipeline). The
// Tpu IR comes from an earlier toptpu-opt process (its derived bf16 weights in
// %t.tpu.weights.safetensors, which the machine passes keep: they derive none). With
// max-ops=1 on bm1688, each of norm, linear and silu is a group of its own; the norm's
// result (1x8x64 bf16, 1024 B) and the linear's (512 B) cross groups into activation
// memory, both live while the linear runs: 1536 B, the linear's placed after the norm's.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%x: tensor<1x8x64xf32>) -> tensor<1x8x32xf32> {
    %nw = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %b = "top.weight"() {name = "fc.bias"} : () -> tensor<32xf32>
    %n = "top.rms_norm"(%x, %nw) {eps = 1.0e-06 : f64} : (tensor<1x8x64xf32>, tensor<64xf32>) -> tensor<1x8x64xf32>
    %y = "top.matmul"(%n, %w, %b) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 1>} : (tensor<1x8x64xf32>, tensor<32x64xf32>, tensor<32xf32>) -> tensor<1x8x32xf32>
    %z = "top.silu"(%y) : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %z : tensor<1x8x32xf32>
  }
}

// CHECK:      builtin.module attributes {top.weight_store = "{{.*}}.tpu.weights.safetensors"}
// CHECK:      func.func @main(%x: tensor<1x8x64xbf16>) -> tensor<1x8x32xbf16> attributes {tpu.regions = #tpu.regions<1536 : i64, 0 : i64, 4480 : i64, 1536 : i64>}
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, cost = {{[0-9]+}} : i64, gaddrs = array<i64: 0>}
// CHECK:          tpu.rms_norm {{.*}} {eps = 1.000000e-06 : f64, compute = f32, ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK-NEXT:     tpu.store
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, cost = {{[0-9]+}} : i64, gaddrs = array<i64: 1024>}
// CHECK:          tpu.matmul {{.*}} {transpose_b = true, compute = f32, ts = 1 : i64, lmem = array<i64: {{[0-9]+}}>}
// CHECK-NEXT:     tpu.store
// CHECK:        tpu.group({{.*}}) {slices = 1 : i64, cost = {{[0-9]+}} : i64, gaddrs = array<i64: -1>}
// CHECK:          tpu.silu
// CHECK:          tpu.yield
// CHECK-NEXT:   }
// CHECK-NEXT:   func.return
