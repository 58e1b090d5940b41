// Every Top op in its custom assembly form (top.constant, which has none, in the generic
// form): tests/test_op_interfaces.py runs it through the interpreter, lowers and prints it,
// and tests/filecheck/assembly_format.mlir prints it with toptpu-opt and parses it back.
builtin.module {
  func.func @main(%x: tensor<2x4x8xf32>, %pos: tensor<2x4x8xf32>, %ids: tensor<2x3xi32>, %q: tensor<1x4x2x8xf32>,
                  %k: tensor<1x4x1x8xf32>, %v: tensor<1x4x1x8xf32>, %mask: tensor<1x1x4x6xf32>,
                  %hk: tensor<1x2x1x8xf32>, %hv: tensor<1x2x1x8xf32>, %img: tensor<1x3x6x6xf32>,
                  %cx: tensor<1x4x8xf32>, %cstate: tensor<1x2x8xf32>, %valid: tensor<1x4xf32>,
                  %gq: tensor<1x4x1x4xf32>, %gv: tensor<1x4x2x4xf32>, %gg: tensor<1x4x2xf32>,
                  %gstate: tensor<1x2x4x4xf32>)
      -> (tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x1xi32>, tensor<2x4x1xf32>, tensor<1x2x4x8xf32>,
          tensor<2x3x8xf32>, tensor<1x4x4x4xf32>, tensor<1x4x8xf32>, tensor<1x2x8xf32>,
          tensor<1x4x2x4xf32>, tensor<2x4x2xf32>, tensor<1x8x4x4xf32>, tensor<64xf32>,
          tensor<2x4x8xi1>) {
    %w = top.weight "fc.weight" : tensor<6x8xf32>
    %b = top.weight "fc.bias" : tensor<6xf32>
    %g = top.weight "norm.weight" : tensor<8xf32>
    %emb = top.weight "embed.weight" : tensor<5x8xf32>
    %cw = top.weight "conv.weight" : tensor<4x3x3x3xf32>
    %dw = top.weight "dconv.weight" : tensor<8x3xf32>
    %half = "top.constant"() {value = dense<5.000000e-01> : tensor<8xf32>} : () -> tensor<8xf32>
    %p = top.sigmoid %x : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %p1 = top.add_const %p {value = 5.000000e-01 : f64} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %r0 = top.rsqrt %p1 : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %r1 = top.sqrt %p1 : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %e = top.exp %x : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %c = top.cos %pos : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %s = top.sin %pos : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %t = top.tanh %x : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %si = top.silu %x : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %re = top.relu %x : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %sp = top.softplus %x : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %ge = top.gelu %x {approximate = "tanh"} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %pw = top.pow %x {exponent = 2.000000e+00 : f64} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %cl = top.clamp %x {min = -5.000000e-01 : f64, max = 7.500000e-01 : f64} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %sc = top.sub_const %x {value = 1.500000e+00 : f64, reverse = true} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %mc = top.mul_const %x {value = 2.000000e+00 : f64} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %dc = top.div_const %x {value = 4.000000e+00 : f64} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a0 = top.add %r0, %r1 : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a1 = top.sub %a0, %e : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a2 = top.mul %a1, %c : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a3 = top.div %a2, %p1 : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a4 = top.max %a3, %s : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a5 = top.min %a4, %t : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %a6 = top.add %a5, %half : tensor<2x4x8xf32>, tensor<8xf32> -> tensor<2x4x8xf32>
    %u0 = top.add %si, %re : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %u1 = top.add %u0, %sp : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %u2 = top.add %u1, %ge : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %pc = top.add %pw, %cl : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %u3 = top.add %u2, %pc : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %u4 = top.add %u3, %sc : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %u5 = top.add %u4, %mc : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %u6 = top.add %u5, %dc : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %xr = top.reshape %x {shape = array<i64: 8, 8>} : tensor<2x4x8xf32> -> tensor<8x8xf32>
    %rl = top.matmul %xr, %w {transpose_b = true} : tensor<8x8xf32>, tensor<6x8xf32> -> tensor<8x6xf32>
    %rw:2 = top.moe_route %rl {k = 2 : i64, normalize = true} : tensor<8x6xf32> -> tensor<8x2xf32>, tensor<8x2xi32>
    %eg = top.weight "moe.gate" : tensor<6x8x8xf32>
    %eu = top.weight "moe.up" : tensor<6x8x8xf32>
    %dn = top.weight "moe.down" : tensor<6x8x8xf32>
    %my = top.moe_experts %xr, %eg, %eu, %dn, %rw#0, %rw#1 : tensor<8x8xf32>, tensor<6x8x8xf32>, tensor<6x8x8xf32>, tensor<6x8x8xf32>, tensor<8x2xf32>, tensor<8x2xi32> -> tensor<8x8xf32>
    %ym = top.reshape %my {shape = array<i64: 2, 4, 8>} : tensor<8x8xf32> -> tensor<2x4x8xf32>
    %u7 = top.add %u6, %ym : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %cmp = top.compare %x, %a6 {predicate = "gt"} : tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xi1>
    %wh = top.where %cmp, %a6, %u7 : tensor<2x4x8xi1>, tensor<2x4x8xf32>, tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %sm = top.softmax %wh {axis = -1 : i64} : tensor<2x4x8xf32> -> tensor<2x4x8xf32>
    %rd = top.reduce %sm {mode = "max", axes = array<i64: 2>, keepdims = true} : tensor<2x4x8xf32> -> tensor<2x4x1xf32>
    %ci = top.cast %rd {dtype = i32} : tensor<2x4x1xf32> -> tensor<2x4x1xi32>
    %rn = top.rms_norm %wh weight %g {eps = 1.000000e-06 : f64} : tensor<2x4x8xf32> weight tensor<8xf32> -> tensor<2x4x8xf32>
    %ln = top.layer_norm %rn weight %g bias %g {eps = 1.000000e-05 : f64, axis = -1 : i64} : tensor<2x4x8xf32> weight tensor<8xf32> bias tensor<8xf32> -> tensor<2x4x8xf32>
    %rc = top.reshape %c {shape = array<i64: 1, 4, 2, 8>} : tensor<2x4x8xf32> -> tensor<1x4x2x8xf32>
    %rs = top.reshape %s {shape = array<i64: 1, 4, 2, 8>} : tensor<2x4x8xf32> -> tensor<1x4x2x8xf32>
    %ro = top.rope %q, %rc, %rs {mode = "half"} : tensor<1x4x2x8xf32>, tensor<1x4x2x8xf32>, tensor<1x4x2x8xf32> -> tensor<1x4x2x8xf32>
    %at = top.attention %ro, %k, %v mask %mask history %hk, %hv {scale = 2.500000e-01 : f64, q_heads = 2 : i64, kv_heads = 1 : i64, head_dim = 8 : i64} : tensor<1x4x2x8xf32>, tensor<1x4x1x8xf32>, tensor<1x4x1x8xf32> mask tensor<1x1x4x6xf32> history tensor<1x2x1x8xf32>, tensor<1x2x1x8xf32> -> tensor<1x4x2x8xf32>
    %pm = top.permute %at {order = array<i64: 0, 2, 1, 3>} : tensor<1x4x2x8xf32> -> tensor<1x2x4x8xf32>
    %mm = top.matmul %ln, %w bias %b {transpose_b = true} : tensor<2x4x8xf32>, tensor<6x8xf32> bias tensor<6xf32> -> tensor<2x4x6xf32>
    %tk:2 = top.topk %mm {k = 1 : i64, axis = -1 : i64, largest = true} : tensor<2x4x6xf32> -> tensor<2x4x1xf32>, tensor<2x4x1xi32>
    %ix = top.add %tk#1, %ci : tensor<2x4x1xi32>, tensor<2x4x1xi32> -> tensor<2x4x1xi32>
    %sl = top.slice %ix {axis = 2 : i64, start = 0 : i64, end = 1 : i64, step = 1 : i64} : tensor<2x4x1xi32> -> tensor<2x4x1xi32>
    %gt = top.gather %emb, %ids {axis = 0 : i64} : tensor<5x8xf32>, tensor<2x3xi32> -> tensor<2x3x8xf32>
    %ex = top.expand %rd {shape = array<i64: 2, 4, 2>} : tensor<2x4x1xf32> -> tensor<2x4x2xf32>
    %cs = top.cumsum %ex {axis = 2 : i64} : tensor<2x4x2xf32> -> tensor<2x4x2xf32>
    %upd = top.slice %cs {axis = 2 : i64, start = 1 : i64, end = 2 : i64, step = 1 : i64} : tensor<2x4x2xf32> -> tensor<2x4x1xf32>
    %z = top.mul_const %upd {value = 0.000000e+00 : f64} : tensor<2x4x1xf32> -> tensor<2x4x1xf32>
    %zi = top.cast %z {dtype = i32} : tensor<2x4x1xf32> -> tensor<2x4x1xi32>
    %sct = top.scatter %cs, %zi, %upd {axis = 2 : i64} : tensor<2x4x2xf32>, tensor<2x4x1xi32>, tensor<2x4x1xf32> -> tensor<2x4x2xf32>
    %cv = top.conv2d %img, %cw {strides = array<i64: 1, 1>, pads = array<i64: 0, 0, 0, 0>, dilations = array<i64: 1, 1>, groups = 1 : i64} : tensor<1x3x6x6xf32>, tensor<4x3x3x3xf32> -> tensor<1x4x4x4xf32>
    %cc:2 = top.causal_conv1d %cx, %dw state %cstate valid %valid : tensor<1x4x8xf32>, tensor<8x3xf32> state tensor<1x2x8xf32> valid tensor<1x4xf32> -> tensor<1x4x8xf32>, tensor<1x2x8xf32>
    %beta = top.sigmoid %gg : tensor<1x4x2xf32> -> tensor<1x4x2xf32>
    %decay = top.mul_const %beta {value = -1.000000e+00 : f64} : tensor<1x4x2xf32> -> tensor<1x4x2xf32>
    %dr:2 = top.gated_delta_rule %gq, %gq, %gv, %decay, %beta state %gstate {scale = 5.000000e-01 : f64} : tensor<1x4x1x4xf32>, tensor<1x4x1x4xf32>, tensor<1x4x2x4xf32>, tensor<1x4x2xf32>, tensor<1x4x2xf32> state tensor<1x2x4x4xf32> -> tensor<1x4x2x4xf32>, tensor<1x2x4x4xf32>
    %d1 = top.reshape %dr#1 {shape = array<i64: 1, 8, 4>} : tensor<1x2x4x4xf32> -> tensor<1x8x4xf32>
    %d2 = top.concat %d1, %d1 {axis = 2 : i64} : tensor<1x8x4xf32>, tensor<1x8x4xf32> -> tensor<1x8x8xf32>
    %d3 = top.slice %d2 {axis = 2 : i64, start = 0 : i64, end = 8 : i64, step = 2 : i64} : tensor<1x8x8xf32> -> tensor<1x8x4xf32>
    %d4 = top.reshape %d3 {shape = array<i64: 1, 8, 4, 1>} : tensor<1x8x4xf32> -> tensor<1x8x4x1xf32>
    %d5 = top.expand %d4 {shape = array<i64: 1, 8, 4, 4>} : tensor<1x8x4x1xf32> -> tensor<1x8x4x4xf32>
    %flat = top.reshape %mm {shape = array<i64: 48>} : tensor<2x4x6xf32> -> tensor<48xf32>
    %head = top.slice %flat {axis = 0 : i64, start = 0 : i64, end = 16 : i64, step = 1 : i64} : tensor<48xf32> -> tensor<16xf32>
    %f64 = top.concat %flat, %head {axis = 0 : i64} : tensor<48xf32>, tensor<16xf32> -> tensor<64xf32>
    func.return %wh, %ln, %sl, %tk#0, %pm, %gt, %cv, %cc#0, %cc#1, %dr#0, %sct, %d5, %f64, %cmp : tensor<2x4x8xf32>, tensor<2x4x8xf32>, tensor<2x4x1xi32>, tensor<2x4x1xf32>, tensor<1x2x4x8xf32>, tensor<2x3x8xf32>, tensor<1x4x4x4xf32>, tensor<1x4x8xf32>, tensor<1x2x8xf32>, tensor<1x4x2x4xf32>, tensor<2x4x2xf32>, tensor<1x8x4x4xf32>, tensor<64xf32>, tensor<2x4x8xi1>
  }
}
