// RUN: not toptpu-opt %s -p 'layer-group{chip=bm9999}' 2>&1 | filecheck %s

// Regression test of a fixed bug:
// an unknown chip name in a pass option is a mistake of the command line, yet toptpu-opt
// reports it as an internal error with a traceback and the bug-report hint (exit 70):
// get_chip's UnknownChipError is not among toptpu/opt.py's PASS_ERRORS. The same holds for
// tpu-pipeline{chip=...} and lmem-verify{chip=...}. The input is Tpu IR: layer-group checks
// the IR level before the chip.
builtin.module {
  func.func @main(%x: tensor<1x8x32xf32>) -> tensor<1x8x32xf32> {
    %0 = "tpu.silu"(%x) : (tensor<1x8x32xf32>) -> tensor<1x8x32xf32>
    func.return %0 : tensor<1x8x32xf32>
  }
}

// CHECK: toptpu-opt: {{.*}}unknown_chip.mlir: pass 'layer-group': unknown chip 'bm9999'; choose one of bm1684x, bm1688
// CHECK-NOT: Traceback
