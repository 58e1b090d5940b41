// RUN: not toptpu-opt %s -p shape-infer 2>&1 | filecheck %s

// Regression test of a fixed defect:
// shape-infer names a failing op by its kind and its location name; an op without a
// location (hand-written IR) is reported as "'top.add' (None)": Python's None in a user
// message (passes/shape_infer.py formats op_name(inner), which is None here).
builtin.module {
  func.func @f(%x: tensor<2x3xf32>, %y: tensor<4x3xf32>) -> tensor<*xf32> {
    %0 = "top.add"(%x, %y) : (tensor<2x3xf32>, tensor<4x3xf32>) -> tensor<*xf32>
    func.return %0 : tensor<*xf32>
  }
}
// CHECK:      pass 'shape-infer': shape inference failed at 'top.add': shapes [2, 3], [4, 3] do not broadcast
// CHECK-NOT:  None
