"""One module per parallelism, each with one public `apply_*(model, mesh_slice, cfg_section)`;
parallelize.py applies them in the one order. The mesh (mesh.py), the process group (dist.py) and
the data-parallel backends (data.py for DDP, zero.py for DeepSpeed ZeRO) live here too."""
