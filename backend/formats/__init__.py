"""toptpu.backend.formats: the file formats the compiler writes and the runtime reads — the
checksummed container (`model_file`), the LLM model file and its typed header (`llm_file`,
decoded by `header_schema`)."""
