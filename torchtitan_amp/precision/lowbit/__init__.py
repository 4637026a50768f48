"""Low-bit formats: what a Linear (or the routed experts' grouped GEMMs) computes in below bf16.

- `capability.py`:     the probes the precision plan asks (torchao installed, fp8 matmuls on this
                       device, block-scaled tensor cores, a recipe torchao's kernels can honour);
- `formats.py`:        MXFP8 and NVFP4 quantization, bit-exact, and `BlockScaledRecipe`;
- `linear.py`:         the emulated block-scaled Linear (its three GEMMs), `observe_gemms`, the
                       stochastic-rounding keys;
- `grouped.py`:        the routed experts' grouped GEMMs block-scaled, per expert, as the Linear's;
- `torchao_kernels.py`: our block-scaled recipe mapped to torchao's MXFP8 / NVFP4 training modules;
- `float8.py`:         fp8 training through torchao's Float8Linear (which Linears, the conversion);
- `quant_error.py`:    how much a format loses of one GEMM operand (the benchmarks' measures).

They take the plan's values (recipes, formats, skip patterns), never the plan; precision/block_scaled.py
applies the block-scaled decision to a model with them.
"""
