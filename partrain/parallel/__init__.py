"""One module per parallelism, each with one public `apply_*(model, mesh_slice, cfg_section)`."""
