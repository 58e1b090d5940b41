"""toptpu.backend.codegen: code generation — a grouped, allocated, addressed Tpu function
to the machine's command streams (`streams`)."""
