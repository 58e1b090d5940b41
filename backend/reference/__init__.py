"""toptpu.backend.reference: the reference semantics — one numpy kernel per op (`kernels`)
and the evaluators that run Top and Tpu IR with them (`interpreter`)."""
