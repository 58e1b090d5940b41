// RUN: toptpu-opt %s -p 'layer-group{chip=bm1688},lmem-verify{chip=bm1688}' | filecheck %s
// RUN: toptpu-opt %s -p 'layer-group{chip=bm1688 split-reduction=needed},lmem-verify{chip=bm1688}' | filecheck %s --check-prefix=NEEDED
// RUN: not toptpu-opt %s -p 'layer-group{chip=bm1688 split-reduction=always}' 2>&1 | filecheck %s --check-prefix=BADOPT

// A 256 x 256 x 16384 f32 matmul on bm1688 (32 lanes x 128 KiB: either operand alone
// fills the local memory). By the cost model its K is split in reduction parts (40% below
// the best plan without them, whose tiles hold all of K: one operand is loaded again for
// every block of the other): R x C tiles of P parts, each part's activation and weight columns
// loaded and folded into the f32 accumulator at `acc`, the tile stored after its last
// part. Planning reads shapes only: the weight needs no data.
builtin.module {
  func.func @main(%x: tensor<1x256x16384xf32>) -> tensor<1x256x256xf32> {
    %w = "tpu.weight"() {name = "fc.weight", source = "fc.weight", part = "data"} : () -> tensor<256x16384xf32>
    %y = "tpu.matmul"(%x, %w) {transpose_b = true, compute = f32} : (tensor<1x256x16384xf32>, tensor<256x16384xf32>) -> tensor<1x256x256xf32>
    func.return %y : tensor<1x256x256xf32>
  }
}

// CHECK:      tpu.group(%x, %w) {slices = {{[0-9]+}} : i64, cost = {{[0-9]+}} : i64, tiles = array<i64: {{[0-9]+}}, {{[0-9]+}}, {{[0-9]+}}>, tile_outer = {{[01]}} : i64, acc = {{[0-9]+}} : i64}
// CHECK:        tpu.load %{{.*}} {slice_axis = 1 : i64, ts = 0 : i64, tile_axes = array<i64: 1, -1, 2>, lmem = array<i64: {{[0-9]+}}, {{[0-9]+}}>} : tensor<1x256x16384xf32> -> tensor<1x{{[0-9]+}}x{{[0-9]+}}xf32>
// CHECK:        tpu.load %{{.*}} {slice_axis = 0 : i64, ts = 0 : i64, tile_axes = array<i64: -1, 0, 1>, lmem = array<i64: {{[0-9]+}}, {{[0-9]+}}>} : tensor<256x16384xf32> -> tensor<{{[0-9]+}}x{{[0-9]+}}xf32>
// CHECK:        tpu.matmul
// CHECK:        tpu.store %{{.*}} {slice_axis = 2 : i64, tile_axes = array<i64: 1, 2, -1>, ts = 2 : i64}
// CHECK:        tpu.yield

// only where no plan without them fits: K stays whole (2-D tiles, no accumulator)
// NEEDED:      tpu.group(%x, %w) {slices = {{[0-9]+}} : i64, cost = {{[0-9]+}} : i64, tiles = array<i64: {{[0-9]+}}, {{[0-9]+}}>, tile_outer = {{[01]}} : i64}
// NEEDED:      tile_axes = array<i64: 1, -1>
// NEEDED:      tile_axes = array<i64: -1, 0>
// NEEDED-NOT:  acc =

// BADOPT: split-reduction is 'always'; it is one of cost, needed
