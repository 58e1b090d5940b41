// RUN: sed 's|@WEIGHTS@|%S/Inputs/linear_attention.safetensors|' %s | toptpu-opt -p shape-infer | filecheck %s --check-prefix=SHAPE
// RUN: sed 's|@WEIGHTS@|%S/Inputs/linear_attention.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=w4bf16}' | filecheck %s --check-prefix=W4
// RUN: sed 's|@WEIGHTS@|%S/Inputs/linear_attention.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-tpu{mode=f16}' | filecheck %s --check-prefix=F16
// RUN: sed 's|@WEIGHTS@|%S/Inputs/linear_attention.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-linalg' | filecheck %s --check-prefix=LINALG
// RUN: sed 's|@WEIGHTS@|%S/Inputs/linear_attention.safetensors|' %s | toptpu-opt -p 'shape-infer,convert-top-to-linalg,mlir{pipeline="canonicalize,cse"}' | filecheck %s --check-prefix=MLIR

// Linear attention's two fused ops (Qwen3.5's Gated DeltaNet): a depthwise causal conv over
// its state and the input, and the gated delta rule over a recurrent state; @carried takes
// both states (block_kv, block_cache), @zero_state starts from zeros (block). Result types
// are left unranked for shape-infer to derive.
builtin.module attributes {top.weight_store = "@WEIGHTS@"} {
  func.func @carried(%x: tensor<1x8x16xf32>, %conv_state: tensor<1x3x16xf32>, %valid: tensor<1x8xf32>, %q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x4x4xf32>, %g: tensor<1x8x4xf32>, %beta: tensor<1x8x4xf32>, %recurrent_state: tensor<1x4x4x4xf32>) -> (tensor<*xf32>, tensor<*xf32>, tensor<*xf32>, tensor<*xf32>) {
    %w = "top.weight"() {name = "conv.weight"} : () -> tensor<16x4xf32>
    %y, %cs = "top.causal_conv1d"(%x, %w, %conv_state, %valid) {operandSegmentSizes = array<i32: 1, 1, 1, 1>} : (tensor<1x8x16xf32>, tensor<16x4xf32>, tensor<1x3x16xf32>, tensor<1x8xf32>) -> (tensor<*xf32>, tensor<*xf32>)
    %o, %rs = "top.gated_delta_rule"(%q, %k, %v, %g, %beta, %recurrent_state) {scale = 0.5 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 1>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x4x4xf32>, tensor<1x8x4xf32>, tensor<1x8x4xf32>, tensor<1x4x4x4xf32>) -> (tensor<*xf32>, tensor<*xf32>)
    func.return %y, %cs, %o, %rs : tensor<*xf32>, tensor<*xf32>, tensor<*xf32>, tensor<*xf32>
  }
  func.func @zero_state(%x: tensor<1x8x16xf32>, %valid: tensor<1x8xf32>, %q: tensor<1x8x2x4xf32>, %k: tensor<1x8x2x4xf32>, %v: tensor<1x8x4x4xf32>, %g: tensor<1x8x4xf32>, %beta: tensor<1x8x4xf32>) -> (tensor<*xf32>, tensor<*xf32>, tensor<*xf32>, tensor<*xf32>) {
    %w = "top.weight"() {name = "conv.weight"} : () -> tensor<16x4xf32>
    %y, %cs = "top.causal_conv1d"(%x, %w, %valid) {operandSegmentSizes = array<i32: 1, 1, 0, 1>} : (tensor<1x8x16xf32>, tensor<16x4xf32>, tensor<1x8xf32>) -> (tensor<*xf32>, tensor<*xf32>)
    %o, %rs = "top.gated_delta_rule"(%q, %k, %v, %g, %beta) {scale = 0.5 : f64, operandSegmentSizes = array<i32: 1, 1, 1, 1, 1, 0>} : (tensor<1x8x2x4xf32>, tensor<1x8x2x4xf32>, tensor<1x8x4x4xf32>, tensor<1x8x4xf32>, tensor<1x8x4xf32>) -> (tensor<*xf32>, tensor<*xf32>)
    func.return %y, %cs, %o, %rs : tensor<*xf32>, tensor<*xf32>, tensor<*xf32>, tensor<*xf32>
  }
  func.func @decay_rate(%a: tensor<1x8x4xf32>) -> tensor<*xf32> {
    %sp = "top.softplus"(%a) : (tensor<1x8x4xf32>) -> tensor<*xf32>
    func.return %sp : tensor<*xf32>
  }
}

// shape-infer: y like x, the conv state [1, K-1, C] in x's type; the rule's output like v,
// its state [1, Hv, Dk, Dv] f32; the signatures follow
// SHAPE-LABEL: func.func @carried
// SHAPE-SAME:    -> (tensor<1x8x16xf32>, tensor<1x3x16xf32>, tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>)
// SHAPE:         top.causal_conv1d %x, %w state %conv_state valid %valid {{.*}} -> tensor<1x8x16xf32>, tensor<1x3x16xf32>
// SHAPE:         top.gated_delta_rule %q, %k, %v, %g, %beta state %recurrent_state {{.*}} -> tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>
// SHAPE-LABEL: func.func @zero_state
// SHAPE-SAME:    -> (tensor<1x8x16xf32>, tensor<1x3x16xf32>, tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>)
// SHAPE:         top.causal_conv1d %x, %w valid %valid {{.*}} -> tensor<1x8x16xf32>, tensor<1x3x16xf32>
// SHAPE:         top.gated_delta_rule %q, %k, %v, %g, %beta {{.*}} -> tensor<1x8x4x4xf32>, tensor<1x4x4x4xf32>

// convert-top-to-tpu: both ops compute in f32; the conv taps stay an f32 weight and the
// recurrent state f32 (the argument, the result and the function's signature) in every
// mode; x, the conv state, q/k/v/g/beta and the output take the activation type
// W4-LABEL: func.func @carried(%x: tensor<1x8x16xbf16>, %conv_state: tensor<1x3x16xbf16>, %valid: tensor<1x8xbf16>, %q: tensor<1x8x2x4xbf16>, %k: tensor<1x8x2x4xbf16>, %v: tensor<1x8x4x4xbf16>, %g: tensor<1x8x4xbf16>, %beta: tensor<1x8x4xbf16>, %recurrent_state: tensor<1x4x4x4xf32>)
// W4-SAME:     -> (tensor<1x8x16xbf16>, tensor<1x3x16xbf16>, tensor<1x8x4x4xbf16>, tensor<1x4x4x4xf32>)
// W4-NEXT:     [[W:%.*]] = tpu.weight "conv.weight" {source = "conv.weight", part = "data"} : tensor<16x4xf32>
// W4-NEXT:     tpu.causal_conv1d %x, [[W]] state %conv_state valid %valid {compute = f32} : tensor<1x8x16xbf16>, tensor<16x4xf32> state tensor<1x3x16xbf16> valid tensor<1x8xbf16> -> tensor<1x8x16xbf16>, tensor<1x3x16xbf16>
// W4-NEXT:     tpu.gated_delta_rule %q, %k, %v, %g, %beta state %recurrent_state {scale = 5.000000e-01 : f64, compute = f32} : {{.*}} state tensor<1x4x4x4xf32> -> tensor<1x8x4x4xbf16>, tensor<1x4x4x4xf32>
// W4-LABEL: func.func @zero_state
// W4-SAME:     -> (tensor<1x8x16xbf16>, tensor<1x3x16xbf16>, tensor<1x8x4x4xbf16>, tensor<1x4x4x4xf32>)
// W4-NEXT:     [[W0:%.*]] = tpu.weight "conv.weight" {{{.*}}} : tensor<16x4xf32>
// W4-NEXT:     tpu.causal_conv1d %x, [[W0]] valid %valid {compute = f32}
// W4-NEXT:     tpu.gated_delta_rule %q, %k, %v, %g, %beta {{.*}} -> tensor<1x8x4x4xbf16>, tensor<1x4x4x4xf32>
// softplus (the decay rate g's) computes in f32 in the activation type's tensors
// W4-LABEL: func.func @decay_rate
// W4-NEXT:     tpu.softplus %a {compute = f32} : tensor<1x8x4xbf16> -> tensor<1x8x4xbf16>
// W4-NOT:      top.

// F16-LABEL: func.func @carried
// F16-SAME:    %recurrent_state: tensor<1x4x4x4xf32>) -> (tensor<1x8x16xf16>, tensor<1x3x16xf16>, tensor<1x8x4x4xf16>, tensor<1x4x4x4xf32>)
// F16:         tpu.weight "conv.weight" {{{.*}}} : tensor<16x4xf32>
// F16:         tpu.causal_conv1d {{.*}} {compute = f32} : tensor<1x8x16xf16>, tensor<16x4xf32> state tensor<1x3x16xf16> valid tensor<1x8xf16> ->
// F16:         tpu.gated_delta_rule {{.*}} {{{.*}}compute = f32} : {{.*}}tensor<1x8x4xf16> state tensor<1x4x4x4xf32> -> tensor<1x8x4x4xf16>, tensor<1x4x4x4xf32>

// convert-top-to-linalg: the conv is a reduction over the taps reading cat(state, x) by
// index; n = the count of valid > 0 (a [1, 1] i64 reduction) places the new state; the
// delta rule is an scf.for over the tokens carrying the state and the output, the state
// updated in place (decay, then the delta update into the decayed tensor) and each
// token's output row inserted at the loop index
// LINALG-LABEL: func.func @carried(
// LINALG-SAME:    %w: tensor<16x4xf32> {top.weight = "conv.weight", top.name = "conv.weight"})
// LINALG-NOT:     top.
// LINALG:         %y = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>], iterator_types = ["parallel", "parallel", "parallel", "reduction"]} ins(%w : tensor<16x4xf32>)
// LINALG:           tensor.extract %x[
// LINALG:           tensor.extract %conv_state[
// LINALG:           arith.cmpi slt
// LINALG:           arith.select
// LINALG:         [[N:%.*]] = linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]} ins(%valid : tensor<1x8xf32>) outs({{.*}} : tensor<1x1xi64>)
// LINALG:           arith.cmpf ogt
// LINALG:         %cs = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (0, 0)>, {{.*}}]{{.*}} ins([[N]] : tensor<1x1xi64>) outs({{.*}} : tensor<1x3x16xf32>)
// LINALG:           arith.index_cast
// LINALG:           tensor.extract %x[
// LINALG:           tensor.extract %conv_state[
// LINALG:         %rs, %o = scf.for [[I:%.*]] = {{.*}} iter_args([[S:%.*]] = %recurrent_state, [[O:%.*]] = {{.*}}) -> (tensor<1x4x4x4xf32>, tensor<1x8x4x4xf32>) {
// LINALG-NEXT:      [[D:%.*]] = linalg.generic {{.*}} outs([[S]] : tensor<1x4x4x4xf32>)
// LINALG:             tensor.extract %g[{{.*}}, [[I]], {{.*}}]
// LINALG:             math.exp
// LINALG:           [[KV:%.*]] = linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction", "parallel"]} ins([[D]] : {{.*}}) outs({{.*}} : tensor<1x4x1x4xf32>)
// LINALG:             arith.floordivsi
// LINALG:             tensor.extract %k[{{.*}}, [[I]], {{.*}}]
// LINALG:           [[U:%.*]] = linalg.generic {{.*}} ins([[KV]] : tensor<1x4x1x4xf32>) outs([[D]] : tensor<1x4x4x4xf32>)
// LINALG:             tensor.extract %v[{{.*}}, [[I]], {{.*}}]
// LINALG:             tensor.extract %beta[{{.*}}, [[I]], {{.*}}]
// LINALG:           [[R:%.*]] = linalg.generic {{.*}}"reduction", "parallel"]} ins([[U]] : {{.*}}) outs({{.*}} : tensor<1x1x4x4xf32>)
// LINALG:             tensor.extract %q[{{.*}}, [[I]], {{.*}}]
// LINALG:           [[ROW:%.*]] = tensor.insert_slice [[R]] into [[O]][0, [[I]], 0, 0] [1, 1, 4, 4] [1, 1, 1, 1] : tensor<1x1x4x4xf32> into tensor<1x8x4x4xf32>
// LINALG-NEXT:      scf.yield [[U]], [[ROW]] : tensor<1x4x4x4xf32>, tensor<1x8x4x4xf32>
// LINALG:         func.return %y, %cs
// without a state: the conv reads zeros before the input, the loop starts from zeros
// LINALG-LABEL: func.func @zero_state(
// LINALG-NOT:     %conv_state
// LINALG:         [[Z:%.*]] = linalg.generic {{.*}} outs({{.*}} : tensor<1x4x4x4xf32>)
// LINALG-NEXT:    ^bb0
// LINALG-NEXT:      arith.constant 0.000000e+00 : f32
// LINALG-NEXT:      linalg.yield
// LINALG:         scf.for {{.*}} iter_args({{.*}} = [[Z]],

// softplus: torch's, x itself above the threshold 20, else log1p(exp(x))
// LINALG-LABEL: func.func @decay_rate
// LINALG:         linalg.generic
// LINALG:           [[BIG:%.*]] = arith.cmpf ogt, {{%.*}}, {{%.*}} : f32
// LINALG:           [[E:%.*]] = math.exp
// LINALG-NEXT:      [[L:%.*]] = math.log1p [[E]] : f32
// LINALG-NEXT:      arith.select [[BIG]], {{%.*}}, [[L]] : f32

// MLIR 22 parses the lowered module and canonicalizes it; the loop and its slice stay
// MLIR-LABEL: func.func @carried
// MLIR:         scf.for {{.*}} iter_args(
// MLIR:           math.exp
// MLIR:           tensor.insert_slice {{.*}}[0, %{{.*}}, 0, 0] [1, 1, 4, 4] [1, 1, 1, 1]
// MLIR:           scf.yield
// MLIR-LABEL: func.func @zero_state
// MLIR:         scf.for
