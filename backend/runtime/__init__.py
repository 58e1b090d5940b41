"""toptpu.backend.runtime: execution — the reference machine (`machine`), the executors that
run a model file's nets (`interpreter_executor`, `machine_executor`), the generation loop
(`runtime`), vision inputs (`vision`) and profiles (`profile`)."""
