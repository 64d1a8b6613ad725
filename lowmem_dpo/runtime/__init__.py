"""The ground floor: what every part needs, importing nothing of the package above it.

    errors.py       UserError, ConfigError, the exit codes and log (rank 0's stderr)
    ranks.py        which process this is, from torchrun's or mpirun's environment
    units.py        sizes: parse_size ("11.25GiB"), fmt
    files.py        atomic writes, free-space checks, content digests, $LOWMEM_DPO_HOME
    folders.py      the marker (lowmem_dpo.json) that makes a folder this tool's, checked before writing into one
    builtins.py     lowmem_dpo:NAME: the demo's recipes and rows shipped in the package (lowmem_dpo/demo/)
    rules.py        the per-device rule book, and the CUDA decisions from a card's numbers: pure
    distributed.py  several processes: the process group, the gradient and metric sums (one process: no-ops)
    devices.py      the rules applied to this machine: every torch.cuda call, bitsandbytes and other optional
                    packages (imported lazily), the optimizer, the float16 scaler, autocast, out-of-memory helpers
    kernels.py      optional fused kernels (TRL's LM head on CUDA): imported lazily, probed before the first step
    heap.py         the C library's heap on a CPU run: freed tensors leave RAM (or, with room, stay for reuse)
    ram.py          the RAM a run may still take: MemAvailable, or less under a container's memory limit (cgroups)

Its face: errors.UserError and errors.log, devices.resolve (a Config into a Resolved device, dtype and
choices with their reasons), units.GiB / fmt / parse_size.
"""
