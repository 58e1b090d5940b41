// RUN: sed 's|@WEIGHTS@|%S/Inputs/weights.safetensors|' %s > %t.mlir
// RUN: toptpu-opt %t.mlir -p 'tpu-pipeline{mode=w4bf16 group-size=32}' --weights-out %t.safetensors -t commands | filecheck %s
// RUN: toptpu-opt %S/Inputs/sliced_silu.mlir -p 'layer-group{chip=bm1684x},address-assign' -t 'commands{chip=bm1684x}' | filecheck %s --check-prefix=SLICED
// RUN: not toptpu-opt %t.mlir -p 'convert-top-to-tpu{mode=f32}' --weights-out %t.safetensors -t commands 2>&1 | filecheck %s --check-prefix=UNGROUPED
// RUN: not toptpu-opt %t.mlir -p 'tpu-pipeline{mode=f32}' --weights-out %t.safetensors -t 'commands{chip=tpu9000}' 2>&1 | filecheck %s --check-prefix=CHIP

// `-t commands` prints codegen's command streams: one line per command with its id, engine,
// op or direction, global tensor (space:name, or space+offset) and shape, the slice moved,
// the local buffers (L<per-lane address>#<buffer id>), layer group and slice, the commands
// it waits for and the buffers it frees.
// (`--weights-out`: the passes derive weights, and toptpu-opt asks where they go even
// though the command text does not carry them.)
//
// An embedding gather, a norm, a w4 linear and silu in one group: the table stays in global
// memory (the gather runs on the DMA engine and reads it row by row); the ids, the norm
// weight and the three parts of the packed weight (no bias: "-") are loaded whole; each
// compute command waits for the commands that wrote its operands and frees what nothing
// reads again, so the a16_matmul result reuses the gather's freed address; the store waits
// for silu and frees its buffer.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @main(%ids: tensor<1x8xi32> loc("ids")) -> tensor<1x8x32xf32> {
    %e = "top.weight"() {name = "embed.weight"} : () -> tensor<16x64xf32>
    %nw = "top.weight"() {name = "norm.weight"} : () -> tensor<64xf32>
    %w = "top.weight"() {name = "fc.weight"} : () -> tensor<32x64xf32>
    %h = "top.gather"(%e, %ids) {axis = 0 : i64} : (tensor<16x64xf32>, tensor<1x8xi32>) -> tensor<1x8x64xf32> loc("hidden")
    %n = "top.rms_norm"(%h, %nw) {eps = 1.0e-06 : f64} : (tensor<1x8x64xf32>, tensor<64xf32>) -> tensor<1x8x64xf32> loc("norm")
    %y = "top.matmul"(%n, %w) {transpose_b = true, operandSegmentSizes = array<i32: 1, 1, 0>} : (tensor<1x8x64xf32>, tensor<32x64xf32>) -> tensor<1x8x32xf32> loc("fc")
    %z = "top.silu"(%y) : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32> loc("act")
    func.return %z : tensor<1x8x32xf32>
  }
}

// CHECK:      program @main: 10 commands, 36096 FLOPs; regions activations 0, constants 0, weights 3520, io 576
// CHECK-NEXT:   modelled on bm1684x: {{[0-9]+}} cycles ({{[0-9.]+}} us), dma busy {{[0-9]+}}, compute busy {{[0-9]+}}
// CHECK-NEXT:   in: input0 [1, 8] int32
// CHECK-NEXT:   out: output0 [1, 8, 32] bfloat16
// CHECK-NEXT:    0 dma load     io:input0 1x8xint32 [all] -> L0#1 g0.s0 deps=[] cycles={{[1-9][0-9]*}}
// CHECK-NEXT:    1 dma load     w:norm.weight 64xfloat32 [all] -> L64#2 g0.s0 deps=[]
// CHECK-NEXT:    2 dma load     w:fc.weight:q4g32a:bf16.qweight 32x32xuint8 [all] -> L128#3 g0.s0 deps=[]
// CHECK-NEXT:    3 dma load     w:fc.weight:q4g32a:bf16.scales 32x2xbfloat16 [all] -> L192#4 g0.s0 deps=[]
// CHECK-NEXT:    4 dma load     w:fc.weight:q4g32a:bf16.zeros 32x2xuint8 [all] -> L256#5 g0.s0 deps=[]
// CHECK-NEXT:    5 dma gather   hidden 1x8x64xbfloat16 (w:embed.weight:bf16, L0#1) -> L16384#6 g0.s0 deps=[0] free=#1
// CHECK-NEXT:    6 cmp rms_norm norm 1x8x64xbfloat16 (L16384#6, L64#2) -> L32768#7 g0.s0 deps=[1,5] free=#6,#2
// CHECK-NEXT:    7 cmp a16_matmul fc 1x8x32xbfloat16 (L32768#7, L128#3, L192#4, L256#5, -, -) -> L16384#8 g0.s0 deps=[2,3,4,6] free=#7,#3,#4,#5 cycles={{[1-9][0-9]*}}
// CHECK-NEXT:    8 cmp silu     act 1x8x32xbfloat16 (L16384#8) -> L320#9 g0.s0 deps=[7] free=#8
// CHECK-NEXT:    9 dma store    io:output0 1x8x32xbfloat16 [all] <- L320#9 g0.s0 deps=[8] free=#9
// CHECK-EMPTY:

// A silu too big for local memory: sliced along the rows (N a slice) and pipelined.
// Slice 0 and 1 load into two buffers before the first compute; slice 2 loads into slice
// 0's address again once silu(0) has read and freed it (dep 2: freeing counts as a write of
// the buffer, so the new load waits for the free, which waited for the load); each store
// moves its slice's rows of the output.
// SLICED:      program @main: {{[0-9]+}} commands, 41943040 FLOPs; regions activations 0, constants 0, weights 0, io 67108864
// SLICED:         0 dma load     io:input0 1x4096x2048xfloat32 [:,0:[[N:[0-9]+]],:] -> L0#1 g0.s0 deps=[]
// SLICED-NEXT:    1 dma load     io:input0 1x4096x2048xfloat32 [:,[[N]]:[[N2:[0-9]+]],:] -> L[[B:[0-9]+]]#2 g0.s1 deps=[]
// SLICED-NEXT:    2 cmp silu     act 1x[[N]]x2048xfloat32 (L0#1) -> L[[C:[0-9]+]]#3 g0.s0 deps=[0] free=#1
// SLICED-NEXT:    3 dma load     io:input0 1x4096x2048xfloat32 [:,[[N2]]:{{[0-9]+}},:] -> L0#4 g0.s2 deps=[2]
// SLICED-NEXT:    4 cmp silu     act 1x[[N]]x2048xfloat32 (L[[B]]#2) -> L{{[0-9]+}}#5 g0.s1 deps=[1] free=#2
// SLICED-NEXT:    5 dma store    io:output0 1x4096x2048xfloat32 [:,0:[[N]],:] <- L[[C]]#3 g0.s0 deps=[2] free=#3

// UNGROUPED: toptpu-opt: error: -t commands: {{.*}}run {{address-assign|layer-group}}

// CHIP: toptpu-opt: error: -t commands: unknown chip 'tpu9000'; choose one of
